#include <cstring>

#include "gradcheck.h"
#include "hspmd/ops/autodiff.h"
#include "hspmd/ops/ops.h"

namespace hspmd {
namespace {

using testing::expect_gradients_match;
using testing::random_array;

// The Hugging Face rotate_half formula, in double.
std::vector<double> reference_rope(const NDArray& x, const std::vector<int32_t>& pos,
                                   double theta) {
  const int64_t tokens = x.dim(0) * x.dim(1), heads = x.dim(2), d = x.dim(3), half = d / 2;
  std::vector<double> out(x.numel());
  const float* px = x.data<float>();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const double angle = pos[t] * std::pow(theta, -2.0 * i / d);
        const int64_t base = (t * heads + h) * d;
        const double a = px[base + i], b = px[base + i + half];
        out[base + i] = a * std::cos(angle) - b * std::sin(angle);
        out[base + i + half] = b * std::cos(angle) + a * std::sin(angle);
      }
  return out;
}

NDArray run_rope(const NDArray& x, const std::vector<int32_t>& pos, float theta) {
  Graph g;
  const SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
  Tensor tx = g.placeholder("x", {B, S, x.dim(2), x.dim(3)}, DType::F32);
  Tensor tp = g.placeholder("pos", {B, S}, DType::I32);
  NDArray p = NDArray::from_vector_i32({x.dim(0), x.dim(1)}, pos);
  return Executor(g, {ops::rope(tx, tp, theta)}).run({{"x", x}, {"pos", p}})[0];
}

TEST(Rope, MatchesFormula) {
  NDArray x = random_array({2, 3, 2, 8}, 1);
  const std::vector<int32_t> pos = {0, 1, 2, 5, 7, 1000};
  NDArray out = run_rope(x, pos, 10000.0f);
  std::vector<double> want = reference_rope(x, pos, 10000.0);
  for (int64_t i = 0; i < x.numel(); ++i) EXPECT_NEAR(out.data<float>()[i], want[i], 1e-5);
  // Position 0 is the identity.
  for (int i = 0; i < 16; ++i) EXPECT_FLOAT_EQ(out.data<float>()[i], x.data<float>()[i]);
}

// A bf16 output is the f32 one rounded once.
TEST(Rope, Bf16OutputIsTheF32OneRounded) {
  const NDArray x = random_array({2, 5, 3, 8}, 4);
  std::vector<int32_t> pos(10);
  for (int i = 0; i < 10; ++i) pos[i] = i * 37 % 11;
  const NDArray f32 = run_rope(x, pos, 10000.0f);
  Graph g;
  Tensor tx = g.placeholder("x", {2, 5, 3, 8}, DType::F32), tp = g.placeholder("pos", {2, 5}, DType::I32);
  Tensor y = ops::rope(tx, tp, 10000.0f, DType::BF16);
  ASSERT_EQ(y.dtype(), DType::BF16);
  const NDArray got = Executor(g, {y}).run({{"x", x}, {"pos", NDArray::from_vector_i32({2, 5}, pos)}})[0];
  const NDArray want = f32.to(DType::BF16);
  for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(got.data<uint16_t>()[i], want.data<uint16_t>()[i]) << i;
  EXPECT_THROW(ops::rope(tx, tp, 10000.0f, DType::I32), Error);
}

// The gradient is in the incoming gradient's dtype. A bf16 one (attention's,
// on a GPU; here a cast's) is rotated back as it comes: read exactly, the
// result rounded once to bf16, the bits of the f32 inverse rotation of its
// widened values and a cast, with no cast node between.
TEST(Rope, Bf16GradientIsRotatedBackAsItComes) {
  const NDArray x = random_array({2, 5, 3, 8}, 6);
  const NDArray w = random_array({2, 5, 3, 8}, 7).to(DType::BF16).to(DType::F32);  // bf16 values
  std::vector<int32_t> pos(10);
  for (int i = 0; i < 10; ++i) pos[i] = i * 29 % 13;
  const NDArray p = NDArray::from_vector_i32({2, 5}, pos);
  const auto rotated_back = [&](DType out) {
    Graph g;
    Tensor tx = g.placeholder("x", {2, 5, 3, 8}, DType::F32), tp = g.placeholder("pos", {2, 5}, DType::I32);
    Tensor tw = g.placeholder("w", {2, 5, 3, 8}, DType::F32);
    // d(loss)/dy = w, rounded to y's dtype by the cast's gradient.
    Tensor y = ops::rope(tx, tp, 10000.0f, out);
    Tensor loss = g.add1(std::make_shared<testing::WeightedSumOp>(), {ops::cast(y, DType::F32), tw});
    const Tensor dx = gradients(loss, {tx})[0];
    EXPECT_EQ(dx.dtype(), out);
    EXPECT_EQ(dx.node().op->type(), "rope");
    EXPECT_EQ(dx.node().inputs[0].dtype(), out);  // read as it comes
    return Executor(g, {dx}).run({{"x", x}, {"pos", p}, {"w", w}})[0];
  };
  const NDArray got = rotated_back(DType::BF16), want = rotated_back(DType::F32).to(DType::BF16);
  ASSERT_EQ(got.dtype(), DType::BF16);
  for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(got.data<uint16_t>()[i], want.data<uint16_t>()[i]) << i;
}

TEST(Rope, PositionsMatter) {
  NDArray x = random_array({1, 2, 1, 4}, 2);
  NDArray a = run_rope(x, {3, 3}, 500.0f), b = run_rope(x, {3, 4}, 500.0f);
  for (int i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(a.data<float>()[i], b.data<float>()[i]);
  double diff = 0;
  for (int i = 4; i < 8; ++i) diff += std::fabs(a.data<float>()[i] - b.data<float>()[i]);
  EXPECT_GT(diff, 1e-3);
}

TEST(Rope, Gradient) {
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) { return ops::rope(t[0], t[1], 100.0f); },
      {{"x", random_array({2, 3, 2, 6}, 3)},
       {"pos", NDArray::from_vector_i32({2, 3}, {0, 1, 2, 9, 4, 30}), false}});
}

TEST(Rope, BadShapesAreErrors) {
  Graph g;
  Tensor odd = g.placeholder("odd", {1, 2, 1, 5}, DType::F32);
  Tensor x = g.placeholder("x", {1, 2, 1, 4}, DType::F32);
  Tensor pos = g.placeholder("pos", {1, 2}, DType::I32);
  Tensor bad_pos = g.placeholder("bad_pos", {1, 3}, DType::I32);
  Tensor x3 = g.placeholder("x3", {2, 1, 4}, DType::F32);
  EXPECT_THROW(ops::rope(odd, pos, 1e4f), Error);
  EXPECT_THROW(ops::rope(x, bad_pos, 1e4f), Error);
  EXPECT_THROW(ops::rope(x3, pos, 1e4f), Error);
  EXPECT_NO_THROW(ops::rope(x, pos, 1e4f));
}

// rope_qk: q and k rotated in one op, the bits of two ropes, forward and
// backward (the gradients in one op too, bf16 as they come or f32), with
// q and k of different head counts; the weighted sums make every output
// element matter.
TEST(Rope, RopeQkIsRopeOnEach) {
  const Shape qs = {2, 5, 4, 8}, ks = {2, 5, 2, 8};
  std::vector<int32_t> pos(10);
  for (int i = 0; i < 10; ++i) pos[i] = i * 37 % 17;
  const NDArray p = NDArray::from_vector_i32({2, 5}, pos);
  const NDArray qv = random_array(qs, 20), kv = random_array(ks, 21), wq = random_array(qs, 22),
                wk = random_array(ks, 23);
  for (const DType out : {DType::F32, DType::BF16}) {
    std::vector<NDArray> got[2];
    int pair_nodes[2] = {0, 0}, rope_nodes[2] = {0, 0};
    for (int fused = 0; fused < 2; ++fused) {
      Graph g;
      Tensor tq = g.placeholder("q", sym_shape(qs), DType::F32), tk = g.placeholder("k", sym_shape(ks), DType::F32);
      Tensor tp = g.placeholder("pos", {2, 5}, DType::I32);
      Tensor twq = g.placeholder("wq", sym_shape(qs), DType::F32), twk = g.placeholder("wk", sym_shape(ks), DType::F32);
      Tensor rq, rk;
      if (fused) {
        const ops::RopeQk r = ops::rope_qk(tq, tk, tp, 10000.0f, out);
        rq = r.q, rk = r.k;
      } else {
        rq = ops::rope(tq, tp, 10000.0f, out);
        rk = ops::rope(tk, tp, 10000.0f, out);
      }
      ASSERT_EQ(rq.dtype(), out);
      ASSERT_EQ(rk.dtype(), out);
      const auto weighted = [&](const Tensor& y, const Tensor& w) {
        // a bf16 output's gradient comes back bf16 (the cast's), as attention's does on a GPU
        return g.add1(std::make_shared<testing::WeightedSumOp>(), {ops::cast(y, DType::F32), w});
      };
      Tensor loss = ops::add(weighted(rq, twq), weighted(rk, twk));
      const std::vector<Tensor> grads = gradients(loss, {tq, tk});
      ASSERT_EQ(grads[0].dtype(), out);
      for (int id = 0; id < g.num_nodes(); ++id) {
        pair_nodes[fused] += g.node(id).op && g.node(id).op->type() == "rope_qk";
        rope_nodes[fused] += g.node(id).op && g.node(id).op->type() == "rope";
      }
      got[fused] = Executor(g, {rq, rk, grads[0], grads[1]})
                       .run({{"q", qv}, {"k", kv}, {"pos", p}, {"wq", wq}, {"wk", wk}});
    }
    EXPECT_EQ(rope_nodes[0], 4);
    EXPECT_EQ(pair_nodes[1], 2);  // forward and backward
    EXPECT_EQ(rope_nodes[1], 0);
    for (size_t i = 0; i < got[0].size(); ++i) {
      ASSERT_EQ(got[0][i].nbytes(), got[1][i].nbytes()) << i;
      EXPECT_EQ(std::memcmp(got[0][i].raw_data(), got[1][i].raw_data(), got[0][i].nbytes()), 0)
          << dtype_name(out) << " output " << i;
    }
  }
}

TEST(Rope, RopeQkGradientsAndShapes) {
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) {
        const ops::RopeQk r = ops::rope_qk(t[0], t[1], t[2], 100.0f);
        return ops::concat({r.q, r.k}, 2);
      },
      {{"q", random_array({2, 3, 2, 6}, 24)},
       {"k", random_array({2, 3, 1, 6}, 25)},
       {"pos", NDArray::from_vector_i32({2, 3}, {0, 1, 2, 9, 4, 30}), false}});
  Graph g;
  Tensor q = g.placeholder("q", {1, 2, 3, 4}, DType::F32), k = g.placeholder("k", {1, 2, 1, 6}, DType::F32);
  Tensor pos = g.placeholder("pos", {1, 2}, DType::I32);
  EXPECT_THROW(ops::rope_qk(q, k, pos, 1e4f), Error);  // head dims differ
}

}  // namespace
}  // namespace hspmd
