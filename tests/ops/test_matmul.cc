#include <cstring>

#include "gradcheck.h"
#include "hspmd/ops/autodiff.h"
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "kernels/kernels.h"

namespace hspmd {
namespace {

using testing::expect_gradients_match;
using testing::random_array;

// op(a2) · op(b) in double, a2 = a viewed as [rows, cols].
std::vector<double> reference_matmul(const NDArray& a, const NDArray& b, bool ta, bool tb) {
  const int64_t cols = a.dim(-1), rows = a.numel() / cols;
  const int64_t m = ta ? cols : rows, k = ta ? rows : cols, n = tb ? b.dim(0) : b.dim(1);
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  std::vector<double> out(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t p = 0; p < k; ++p) {
        const double av = ta ? pa[p * cols + i] : pa[i * cols + p];
        const double bv = tb ? pb[j * b.dim(1) + p] : pb[p * b.dim(1) + j];
        out[i * n + j] += av * bv;
      }
  return out;
}

struct MatmulCase {
  Shape a, b;
  bool ta, tb;
  Shape out;
};

TEST(Matmul, ForwardMatchesReferenceForEveryTransposition) {
  const std::vector<MatmulCase> cases = {
      {{2, 3, 4}, {4, 5}, false, false, {2, 3, 5}},
      {{2, 3, 4}, {5, 4}, false, true, {2, 3, 5}},
      {{2, 3, 4}, {6, 5}, true, false, {4, 5}},
      {{2, 3, 4}, {5, 6}, true, true, {4, 5}},
  };
  uint64_t seed = 10;
  for (const auto& c : cases) {
    NDArray a = random_array(c.a, seed++), b = random_array(c.b, seed++);
    Graph g;
    Tensor ta = g.placeholder("a", sym_shape(c.a), DType::F32);
    Tensor tb = g.placeholder("b", sym_shape(c.b), DType::F32);
    Tensor y = ops::matmul(ta, tb, c.ta, c.tb);
    NDArray out = Executor(g, {y}).run({{"a", a}, {"b", b}})[0];
    ASSERT_EQ(out.shape(), c.out);
    std::vector<double> want = reference_matmul(a, b, c.ta, c.tb);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(out.data<float>()[i], want[i], 1e-4);
  }
}

TEST(Matmul, GradientsForEveryTransposition) {
  const std::vector<MatmulCase> cases = {
      {{2, 3, 4}, {4, 5}, false, false, {}},
      {{2, 3, 4}, {5, 4}, false, true, {}},
      {{2, 3, 4}, {6, 5}, true, false, {}},
      {{2, 3, 4}, {5, 6}, true, true, {}},
  };
  uint64_t seed = 20;
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << "trans_a=" << c.ta << " trans_b=" << c.tb);
    expect_gradients_match(
        [&](Graph&, const std::vector<Tensor>& x) { return ops::matmul(x[0], x[1], c.ta, c.tb); },
        {{"a", random_array(c.a, seed)}, {"b", random_array(c.b, seed + 1)}});
    seed += 2;
  }
}

TEST(Linear, SymbolicBatchForwardAndGradient) {
  const SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 4}, DType::F32);
  Tensor w = g.parameter("w", {3, 4});
  Tensor y = ops::linear(x, w);
  EXPECT_EQ(y.shape(), (SymShape{B, S, 3}));
  NDArray xv = random_array({2, 5, 4}, 1), wv = random_array({3, 4}, 2);
  NDArray out = Executor(g, {y}).run({{"x", xv}, {"w", wv}})[0];
  ASSERT_EQ(out.shape(), (Shape{2, 5, 3}));
  std::vector<double> want = reference_matmul(xv, wv, false, true);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(out.data<float>()[i], want[i], 1e-4);

  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) { return ops::linear(t[0], t[1]); },
      {{"x", xv}, {"w", wv}});
}

TEST(Matmul, SymbolicGradientShapes) {
  const SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 4}, DType::F32);
  Tensor w = g.parameter("w", {3, 4});
  Tensor loss = ops::reduce_sum(ops::linear(x, w));
  std::vector<Tensor> grads = gradients(loss, {x, w});
  EXPECT_EQ(grads[0].shape(), (SymShape{B, S, 4}));
  EXPECT_EQ(grads[1].shape(), (SymShape{3, 4}));
  std::vector<NDArray> v =
      Executor(g, grads).run({{"x", random_array({3, 2, 4}, 1)}, {"w", random_array({3, 4}, 2)}});
  EXPECT_EQ(v[0].shape(), (Shape{3, 2, 4}));
  EXPECT_EQ(v[1].shape(), (Shape{3, 4}));
}

TEST(Matmul, InnerDimMismatchIsAnError) {
  Graph g;
  Tensor a = g.placeholder("a", {2, 3, 4}, DType::F32);
  Tensor b = g.placeholder("b", {5, 6}, DType::F32);
  EXPECT_THROW(ops::matmul(a, b), Error);
  EXPECT_THROW(ops::linear(a, b), Error);
  Tensor b3 = g.placeholder("b3", {4, 5, 1}, DType::F32);
  EXPECT_THROW(ops::matmul(a, b3), Error);
  try {
    ops::matmul(a, b);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[matmul]"), std::string::npos) << e.what();
  }
}

// An input read by three projections (q, k and v of one normalized
// activation): its gradient's accumulation is folded into the dgrad GEMMs
// (matmul's addend), no add node is left, and the sum has the bits of the
// GEMMs and adds done apart, in autodiff's order (the last consumer first).
TEST(Matmul, SharedInputGradientAccumulatesInTheGemms) {
  const Shape xs = {2, 3, 4};
  const std::vector<Shape> ws = {{5, 4}, {6, 4}, {5, 4}};
  Graph g;
  Tensor x = g.placeholder("x", sym_shape(xs), DType::F32);
  Tensor loss;
  std::vector<NDArray> w, r;
  ValueMap feed;
  feed["x"] = random_array(xs, 70);
  for (int i = 0; i < 3; ++i) {
    w.push_back(random_array(ws[i], 71 + i));
    r.push_back(random_array({2, 3, ws[i][0]}, 74 + i));
    const std::string wn = "w" + std::to_string(i), rn = "r" + std::to_string(i);
    feed[wn] = w.back();
    feed[rn] = r.back();
    Tensor y = ops::linear(x, g.placeholder(wn, sym_shape(ws[i]), DType::F32));
    Tensor term = g.add1(std::make_shared<testing::WeightedSumOp>(),
                         {y, g.placeholder(rn, sym_shape(r.back().shape()), DType::F32)});
    loss = i == 0 ? term : ops::add(loss, term);
  }
  const Tensor dx = gradients(loss, {x})[0];
  int folded = 0, wide_adds = 0;
  for (int id = loss.node_id() + 1; id < g.num_nodes(); ++id) {
    const Node& n = g.node(id);
    folded += n.op->type() == "matmul" && n.inputs.size() == 3;
    wide_adds += n.op->type() == "add";
  }
  EXPECT_EQ(folded, 2);
  EXPECT_EQ(wide_adds, 0);
  const NDArray got = Executor(g, {dx}).run(feed)[0];
  // Apart: d2 = r2 W2, then r1 W1 + d2, then r0 W0 + that.
  Stream& cpu = default_stream(Device::cpu());
  NDArray want;
  for (int i = 2; i >= 0; --i) {
    NDArray term = NDArray::empty(xs, DType::F32);
    kernels::matmul(cpu, r[i], w[i], false, false, term);
    if (i < 2) kernels::add(cpu, term, want, term);
    want = term;
  }
  ASSERT_EQ(got.shape(), want.shape());
  EXPECT_EQ(std::memcmp(got.data<float>(), want.data<float>(), want.nbytes()), 0);
}

TEST(Matmul, AddendMustBeAnF32ArrayOfTheOutputsShapeApartFromIt) {
  Stream& cpu = default_stream(Device::cpu());
  const NDArray a = random_array({3, 4}, 1), b = random_array({4, 5}, 2);
  NDArray out = NDArray::empty({3, 5}, DType::F32), out16 = NDArray::empty({3, 5}, DType::BF16);
  const NDArray wrong_shape = random_array({3, 4}, 3), right = random_array({3, 5}, 4);
  const auto gemm = [&](NDArray& o, const NDArray* add) {
    kernels::matmul(cpu, a, b, false, false, o, kernels::GemmCompute::kF32, add);
  };
  EXPECT_THROW(gemm(out, &wrong_shape), InternalError);  // a caller's bug, not bad input
  EXPECT_THROW(gemm(out16, &right), InternalError);
  EXPECT_THROW(gemm(out, &out), InternalError);
  gemm(out, &right);  // and the sum: the product plus the addend
  NDArray want = NDArray::empty({3, 5}, DType::F32);
  kernels::matmul(cpu, a, b, false, false, want);
  kernels::add(cpu, want, right, want);
  EXPECT_EQ(std::memcmp(out.data<float>(), want.data<float>(), want.nbytes()), 0);
}

}  // namespace
}  // namespace hspmd
