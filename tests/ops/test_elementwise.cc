#include "gradcheck.h"
#include "hspmd/ops/autodiff.h"
#include "hspmd/ops/ops.h"

namespace hspmd {
namespace {

using testing::expect_gradients_match;
using testing::random_array;

TEST(Add, ForwardAndGradient) {
  NDArray a = random_array({3, 4}, 1), b = random_array({3, 4}, 2);
  Graph g;
  Tensor ta = g.placeholder("a", {3, 4}, DType::F32), tb = g.placeholder("b", {3, 4}, DType::F32);
  NDArray out = Executor(g, {ops::add(ta, tb)}).run({{"a", a}, {"b", b}})[0];
  for (int i = 0; i < 12; ++i)
    EXPECT_FLOAT_EQ(out.data<float>()[i], a.data<float>()[i] + b.data<float>()[i]);
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& x) { return ops::add(x[0], ops::add(x[0], x[1])); },
      {{"a", a}, {"b", b}});
}

// f32 + bf16: the same bits as widening b with a cast first, and b's
// gradient is rounded to bf16 as that cast's gradient would be.
TEST(Add, Bf16SecondOperandIsWidenedExactly) {
  const NDArray a = random_array({5, 4099}, 41), b = random_array({5, 4099}, 42).to(DType::BF16);
  const NDArray w = random_array({5, 4099}, 43);
  std::vector<NDArray> got[2];
  for (int fused = 0; fused < 2; ++fused) {
    Graph g;
    Tensor ta = g.placeholder("a", {5, 4099}, DType::F32), tb = g.placeholder("b", {5, 4099}, DType::BF16);
    Tensor tw = g.placeholder("w", {5, 4099}, DType::F32);
    Tensor y = fused ? ops::add(ta, tb) : ops::add(ta, ops::cast(tb, DType::F32));
    ASSERT_EQ(y.dtype(), DType::F32);
    Tensor loss = g.add1(std::make_shared<testing::WeightedSumOp>(), {y, tw});
    const std::vector<Tensor> grads = gradients(loss, {ta, tb});
    EXPECT_EQ(grads[1].dtype(), DType::BF16);
    got[fused] = Executor(g, {y, grads[0], grads[1]}).run({{"a", a}, {"b", b}, {"w", w}});
  }
  for (int i = 0; i < 3; ++i)
    for (int64_t e = 0; e < got[0][i].numel(); ++e)
      ASSERT_EQ(got[0][i].to(DType::F32).data<float>()[e], got[1][i].to(DType::F32).data<float>()[e])
          << "output " << i << " element " << e;
  Graph g;
  Tensor ta = g.placeholder("a", {2}, DType::F32), tb = g.placeholder("b", {2}, DType::F32);
  EXPECT_THROW(ops::add(ta, tb, DType::I32), Error);
  Tensor ti = g.placeholder("i", {2}, DType::I32);
  EXPECT_THROW(ops::add(ti, tb), Error);
}

// A bf16 a (a block input read as it is) and a bf16 output (the next
// block's input): the bits of casts around an f32 add; with the bf16
// output both gradients are the output's bf16 gradient.
TEST(Add, Bf16FirstOperandAndOutput) {
  const NDArray a = random_array({3, 4099}, 44).to(DType::BF16), b = random_array({3, 4099}, 45).to(DType::BF16);
  const NDArray w = random_array({3, 4099}, 46);
  std::vector<NDArray> got[2];
  for (int fused = 0; fused < 2; ++fused) {
    Graph g;
    Tensor ta = g.placeholder("a", {3, 4099}, DType::BF16), tb = g.placeholder("b", {3, 4099}, DType::BF16);
    Tensor tw = g.placeholder("w", {3, 4099}, DType::F32);
    Tensor y = fused ? ops::add(ta, tb, DType::BF16)
                     : ops::cast(ops::add(ops::cast(ta, DType::F32), ops::cast(tb, DType::F32)), DType::BF16);
    ASSERT_EQ(y.dtype(), DType::BF16);
    Tensor loss = g.add1(std::make_shared<testing::WeightedSumOp>(), {ops::cast(y, DType::F32), tw});
    const std::vector<Tensor> grads = gradients(loss, {ta, tb});
    if (fused) {  // the bf16 output's gradient is bf16: a's is it as it is
      EXPECT_EQ(grads[0].dtype(), DType::BF16);
      EXPECT_EQ(grads[1].dtype(), DType::BF16);
    }
    got[fused] = Executor(g, {y, grads[0], grads[1]}).run({{"a", a}, {"b", b}, {"w", w}});
  }
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(got[0][i].dtype(), got[1][i].dtype()) << i;
    const NDArray x = got[0][i].to(DType::F32), y = got[1][i].to(DType::F32);
    for (int64_t e = 0; e < x.numel(); ++e) ASSERT_EQ(x.data<float>()[e], y.data<float>()[e]) << i << " " << e;
  }
}

TEST(Add, ShapeMismatchIsAnError) {
  Graph g;
  Tensor ta = g.placeholder("a", {3, 4}, DType::F32), tb = g.placeholder("b", {4, 3}, DType::F32);
  EXPECT_THROW(ops::add(ta, tb), Error);
}

// bf16 -> f32 is exact, so a cast back to bf16 is the first cast's input
// itself (no node, no pass); f32 -> bf16 -> f32 rounds and stays two casts.
TEST(Cast, WideningThenNarrowingIsTheInput) {
  Graph g;
  Tensor b = g.placeholder("b", {3, 5}, DType::BF16), f = g.placeholder("f", {3, 5}, DType::F32);
  const int before = g.num_nodes();
  const Tensor wide = ops::cast(b, DType::F32);
  EXPECT_EQ(ops::cast(wide, DType::BF16), b);
  EXPECT_EQ(g.num_nodes(), before + 1);
  const Tensor narrow = ops::cast(f, DType::BF16), back = ops::cast(narrow, DType::F32);
  EXPECT_NE(back, f);
  EXPECT_EQ(g.num_nodes(), before + 3);
  const NDArray fv = random_array({3, 5}, 3);
  const NDArray bv = fv.to(DType::BF16);
  const std::vector<NDArray> out = Executor(g, {back, ops::cast(wide, DType::BF16)}).run({{"b", bv}, {"f", fv}});
  for (int64_t e = 0; e < 15; ++e) EXPECT_EQ(out[0].data<float>()[e], bv.to(DType::F32).data<float>()[e]);
}

}  // namespace
}  // namespace hspmd
