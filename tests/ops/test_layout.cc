// reshape, transpose, slice, concat, reduce_sum and reshard.
#include "gradcheck.h"
#include "hspmd/ops/ops.h"

namespace hspmd {
namespace {

using testing::expect_gradients_match;
using testing::random_array;

NDArray run1(const Graph& g, const Tensor& t, const ValueMap& values) {
  return Executor(g, {t}).run(values)[0];
}

TEST(Reshape, IsAViewWithSymbolicShapes) {
  const SymDim B = SymDim::symbol("B");
  Graph g;
  Tensor x = g.placeholder("x", {B, 3, 4}, DType::F32);
  Tensor y = ops::reshape(x, {B * 3, 2, 2});
  NDArray xv = random_array({2, 3, 4}, 1);
  NDArray out = run1(g, y, {{"x", xv}});
  EXPECT_EQ(out.shape(), (Shape{6, 2, 2}));
  EXPECT_EQ(out.raw_data(), xv.raw_data());
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) { return ops::reshape(t[0], {4, 6}); },
      {{"x", xv}});
}

TEST(Reshape, NumelMismatchIsAnError) {
  const SymDim B = SymDim::symbol("B");
  Graph g;
  Tensor x = g.placeholder("x", {B, 3, 4}, DType::F32);
  EXPECT_THROW(ops::reshape(x, {B, 13}), Error);
  EXPECT_THROW(ops::reshape(x, {12, 2}), Error);  // B is not 2 symbolically
  EXPECT_NO_THROW(ops::reshape(x, {B * 12}));
}

// Naive transpose of a row-major array (any rank).
std::vector<float> reference_transpose(const NDArray& a, int d0, int d1) {
  const Shape s = a.shape();
  Shape t = s;
  std::swap(t[d0], t[d1]);
  const Shape ss = contiguous_strides(s), ts = contiguous_strides(t);
  std::vector<float> out(a.numel());
  for (int64_t i = 0; i < a.numel(); ++i) {
    int64_t rem = i, j = 0;
    for (int d = 0; d < a.ndim(); ++d) {
      int64_t idx = rem / ss[d];
      rem %= ss[d];
      int td = d == d0 ? d1 : d == d1 ? d0 : d;
      j += idx * ts[td];
    }
    out[j] = a.data<float>()[i];
  }
  return out;
}

TEST(Transpose, MatchesReferenceOnSeveralLayouts) {
  struct Case {
    Shape shape;
    int d0, d1;
  };
  const std::vector<Case> cases = {{{3, 4}, 0, 1},          {{2, 3, 4, 5}, 1, 2},
                                   {{2, 3, 4, 5}, 1, 3},    {{2, 3, 4, 5}, -1, 0},
                                   {{70, 45}, 0, 1},        {{3, 40, 2, 33, 3}, 3, 1},
                                   {{4, 128, 8, 64}, 1, 2}, {{300, 260}, 1, 0}};
  uint64_t seed = 1;
  for (const auto& c : cases) {
    NDArray a = random_array(c.shape, seed++);
    Graph g;
    Tensor x = g.placeholder("x", sym_shape(c.shape), DType::F32);
    NDArray out = run1(g, ops::transpose(x, c.d0, c.d1), {{"x", a}});
    const int n = a.ndim();
    std::vector<float> want = reference_transpose(a, (c.d0 + n) % n, (c.d1 + n) % n);
    ASSERT_EQ(out.numel(), static_cast<int64_t>(want.size()));
    EXPECT_EQ(out.to_vector(), want) << shape_str(c.shape) << " " << c.d0 << "," << c.d1;
  }
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) { return ops::transpose(t[0], 0, 2); },
      {{"x", random_array({2, 3, 4}, 9)}});
}

TEST(Transpose, BadAxisIsAnError) {
  Graph g;
  Tensor x = g.placeholder("x", {2, 3}, DType::F32);
  EXPECT_THROW(ops::transpose(x, 0, 2), Error);
}

TEST(Slice, ViewAlongLeadingAxisAndCopyAlongInnerAxis) {
  NDArray a = random_array({4, 3, 5}, 2);
  Graph g;
  Tensor x = g.placeholder("x", {4, 3, 5}, DType::F32);
  std::vector<NDArray> out = Executor(g, {ops::slice(x, 0, 1, 3), ops::slice(x, -1, 2, 5)})
                                 .run({{"x", a}});
  ASSERT_EQ(out[0].shape(), (Shape{2, 3, 5}));
  ASSERT_EQ(out[1].shape(), (Shape{4, 3, 3}));
  EXPECT_TRUE(out[0].is_contiguous());
  const float* pa = a.data<float>();
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 15; ++j) EXPECT_EQ(out[0].data<float>()[i * 15 + j], pa[(i + 1) * 15 + j]);
  for (int r = 0; r < 12; ++r)
    for (int k = 0; k < 3; ++k) EXPECT_EQ(out[1].data<float>()[r * 3 + k], pa[r * 5 + k + 2]);
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) { return ops::slice(t[0], 1, 1, 3); },
      {{"x", a}});
}

TEST(Slice, BadRangeOrSymbolicAxisIsAnError) {
  Graph g;
  Tensor x = g.placeholder("x", {SymDim::symbol("B"), 4}, DType::F32);
  EXPECT_THROW(ops::slice(x, 1, 2, 5), Error);
  EXPECT_THROW(ops::slice(x, 1, 3, 2), Error);
  EXPECT_THROW(ops::slice(x, 0, 0, 1), Error);
  EXPECT_NO_THROW(ops::slice(x, 1, 0, 4));
}

TEST(Concat, ForwardAndGradient) {
  NDArray a = random_array({2, 2, 3}, 3), b = random_array({2, 1, 3}, 4);
  Graph g;
  Tensor ta = g.placeholder("a", {2, 2, 3}, DType::F32);
  Tensor tb = g.placeholder("b", {2, 1, 3}, DType::F32);
  NDArray out = run1(g, ops::concat({ta, tb}, 1), {{"a", a}, {"b", b}});
  ASSERT_EQ(out.shape(), (Shape{2, 3, 3}));
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 3; ++k) {
        const float want =
            j < 2 ? a.data<float>()[(i * 2 + j) * 3 + k] : b.data<float>()[i * 3 + k];
        EXPECT_EQ(out.data<float>()[(i * 3 + j) * 3 + k], want);
      }
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) {
        return ops::concat({t[0], t[1], t[0]}, -2);
      },
      {{"a", a}, {"b", b}});
}

TEST(Concat, MismatchIsAnError) {
  Graph g;
  Tensor a = g.placeholder("a", {2, 3}, DType::F32), b = g.placeholder("b", {3, 3}, DType::F32);
  EXPECT_THROW(ops::concat({a, b}, 1), Error);
  EXPECT_NO_THROW(ops::concat({a, b}, 0));
  Tensor c = g.placeholder("c", {SymDim::symbol("B"), 3}, DType::F32);
  EXPECT_THROW(ops::concat({a, c}, 0), Error);
}

TEST(ReduceSum, AxesAndAll) {
  NDArray a = random_array({2, 3, 4}, 5);
  Graph g;
  Tensor x = g.placeholder("x", {2, 3, 4}, DType::F32);
  Tensor by_axes = ops::reduce_sum(x, {0, 2});
  Tensor all = ops::reduce_sum(x);
  EXPECT_EQ(by_axes.shape(), (SymShape{3}));
  EXPECT_TRUE(all.shape().empty());
  std::vector<NDArray> out = Executor(g, {by_axes, all}).run({{"x", a}});
  double total = 0;
  for (int j = 0; j < 3; ++j) {
    double s = 0;
    for (int i = 0; i < 2; ++i)
      for (int k = 0; k < 4; ++k) s += a.data<float>()[(i * 3 + j) * 4 + k];
    EXPECT_NEAR(out[0].data<float>()[j], s, 1e-5);
    total += s;
  }
  EXPECT_NEAR(out[1].data<float>()[0], total, 1e-5);
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) { return ops::reduce_sum(t[0], {1}); }, {{"x", a}});
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) { return ops::reduce_sum(t[0], {-1, 0}); },
      {{"x", a}});
  expect_gradients_match([](Graph&, const std::vector<Tensor>& t) { return ops::reduce_sum(t[0]); },
                         {{"x", a}});
  EXPECT_THROW(ops::reduce_sum(x, {3}), Error);
  EXPECT_THROW(ops::reduce_sum(x, {1, -2}), Error);
}

TEST(Reshard, IsTheIdentityWithoutCopy) {
  NDArray a = random_array({3, 2}, 6);
  Graph g;
  Tensor x = g.placeholder("x", {3, 2}, DType::F32);
  Tensor y = ops::reshard(x);
  EXPECT_EQ(y.node().op->type(), "reshard");
  NDArray out = run1(g, y, {{"x", a}});
  EXPECT_EQ(out.raw_data(), a.raw_data());
  Tensor loss = ops::reduce_sum(y);
  Tensor dx = gradients(loss, {x})[0];
  EXPECT_EQ(dx.node().op->type(), "reshard");
  EXPECT_TRUE(ops::is_reshard(y.node()));
  EXPECT_TRUE(ops::is_reshard(dx.node()));  // the mirror
  EXPECT_FALSE(ops::is_reshard(x.node()) || ops::is_reshard(loss.node()));
  expect_gradients_match([](Graph&, const std::vector<Tensor>& t) { return ops::reshard(t[0]); },
                         {{"x", a}});
}

}  // namespace
}  // namespace hspmd
