#include <cstring>

#include "gradcheck.h"
#include "kernels/basic.h"
#include "kernels/kernels.h"
#include "hspmd/ops/autodiff.h"
#include "hspmd/ops/ops.h"

namespace hspmd {
namespace {

using testing::expect_gradients_match;
using testing::random_array;

TEST(RmsNorm, ForwardMatchesReference) {
  const int64_t rows = 6, h = 80;
  const float eps = 1e-5f;
  NDArray x = random_array({2, 3, h}, 1), w = random_array({h}, 2);
  Graph g;
  Tensor tx = g.placeholder("x", {SymDim::symbol("B"), 3, h}, DType::F32);
  Tensor tw = g.parameter("w", {h});
  NDArray out = Executor(g, {ops::rms_norm(tx, tw, eps)}).run({{"x", x}, {"w", w}})[0];
  ASSERT_EQ(out.shape(), x.shape());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < h; ++i) ss += std::pow(x.data<float>()[r * h + i], 2);
    const double s = 1.0 / std::sqrt(ss / h + eps);
    for (int64_t i = 0; i < h; ++i)
      EXPECT_NEAR(out.data<float>()[r * h + i], x.data<float>()[r * h + i] * s * w.data<float>()[i],
                  1e-5);
  }
}

TEST(RmsNorm, Gradients) {
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) { return ops::rms_norm(t[0], t[1], 1e-5f); },
      {{"x", random_array({2, 3, 8}, 3)}, {"w", random_array({8}, 4)}});
  // More than one column block of the dweight reduction.
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) { return ops::rms_norm(t[0], t[1], 1e-6f); },
      {{"x", random_array({5, 130}, 5)}, {"w", random_array({130}, 6)}});
}

// A bf16 output is the f32 one rounded once (norm and cast in one pass);
// the gradients stay f32 and equal those through an explicit cast.
TEST(RmsNorm, Bf16OutputIsTheF32OneRounded) {
  const NDArray x = random_array({3, 5, 37}, 31), w = random_array({37}, 32);
  std::vector<NDArray> got[2];
  for (int fused = 0; fused < 2; ++fused) {
    Graph g;
    Tensor tx = g.placeholder("x", {3, 5, 37}, DType::F32), tw = g.placeholder("w", {37}, DType::F32);
    Tensor y = fused ? ops::rms_norm(tx, tw, 1e-5f, DType::BF16)
                     : ops::cast(ops::rms_norm(tx, tw, 1e-5f), DType::BF16);
    ASSERT_EQ(y.dtype(), DType::BF16);
    Tensor loss = g.add1(std::make_shared<testing::WeightedSumOp>(), {ops::cast(y, DType::F32), tx});
    const std::vector<Tensor> grads = gradients(loss, {tx, tw});
    EXPECT_EQ(grads[0].dtype(), DType::F32);
    got[fused] = Executor(g, {y, grads[0], grads[1]}).run({{"x", x}, {"w", w}});
  }
  for (int i = 0; i < 3; ++i)
    for (int64_t e = 0; e < got[0][i].numel(); ++e)
      ASSERT_EQ(got[0][i].to(DType::F32).data<float>()[e], got[1][i].to(DType::F32).data<float>()[e])
          << "output " << i << " element " << e;
  Graph g;
  Tensor tx = g.placeholder("x", {2, 4}, DType::F32), tw = g.placeholder("w", {4}, DType::F32);
  EXPECT_THROW(ops::rms_norm(tx, tw, 1e-5f, DType::I32), Error);
}

TEST(RmsNorm, WeightShapeMismatchIsAnError) {
  Graph g;
  Tensor x = g.placeholder("x", {2, 8}, DType::F32);
  Tensor w = g.parameter("w", {7});
  Tensor w2 = g.parameter("w2", {1, 8});
  EXPECT_THROW(ops::rms_norm(x, w, 1e-5f), Error);
  EXPECT_THROW(ops::rms_norm(x, w2, 1e-5f), Error);
}

// The residual stream h feeds the norm and, later, a consumer of its own:
// h's gradient from that consumer is added by the norm's backward kernel
// (rms_norm_grad's addend), no add node is left, and dx has the bits of the
// backward and the add done apart.
TEST(RmsNorm, ResidualGradientAddsInTheBackwardKernel) {
  const Shape hs = {3, 5, 40};
  Graph g;
  Tensor h = g.placeholder("h", sym_shape(hs), DType::F32);
  Tensor w = g.placeholder("w", {40}, DType::F32);
  Tensor r0 = g.placeholder("r0", sym_shape(hs), DType::F32), r1 = g.placeholder("r1", sym_shape(hs), DType::F32);
  Tensor y = ops::rms_norm(h, w, 1e-5f);
  Tensor loss = ops::add(g.add1(std::make_shared<testing::WeightedSumOp>(), {y, r0}),
                         g.add1(std::make_shared<testing::WeightedSumOp>(), {h, r1}));
  const int forward_end = loss.node_id();
  const std::vector<Tensor> grads = gradients(loss, {h, w});
  int folded = 0, wide_adds = 0;
  for (int id = forward_end + 1; id < g.num_nodes(); ++id) {
    const Node& n = g.node(id);
    folded += n.op->type() == "rms_norm_grad" && n.inputs.size() == 4;
    wide_adds += n.op->type() == "add";
  }
  EXPECT_EQ(folded, 1);
  EXPECT_EQ(wide_adds, 0);
  const NDArray hv = random_array(hs, 80), wv = random_array({40}, 81), r0v = random_array(hs, 82),
                r1v = random_array(hs, 83);
  const std::vector<NDArray> got = Executor(g, grads).run({{"h", hv}, {"w", wv}, {"r0", r0v}, {"r1", r1v}});
  Stream& cpu = default_stream(Device::cpu());
  NDArray dx = NDArray::empty(hs, DType::F32), dw = NDArray::empty({40}, DType::F32);
  kernels::rms_norm_backward(cpu, r0v, hv, wv, 1e-5f, dx, dw);
  kernels::add(cpu, dx, r1v, dx);
  EXPECT_EQ(std::memcmp(got[0].data<float>(), dx.data<float>(), dx.nbytes()), 0);
  EXPECT_EQ(std::memcmp(got[1].data<float>(), dw.data<float>(), dw.nbytes()), 0);
}

// A bf16 block input, as the decoder feeds it: the norm and the residual
// add read it as it is, and its gradient (the norm's dx with the residual
// stream's added, rounded once to bf16) has the bits of the graph that
// widened it first and rounded the widening's gradient.
TEST(RmsNorm, Bf16InputReadAsItIs) {
  const Shape hs = {3, 5, 40};
  const NDArray hv = random_array(hs, 90).to(DType::BF16), wv = random_array({40}, 91),
                bv = random_array(hs, 92).to(DType::BF16), r0v = random_array(hs, 93), r1v = random_array(hs, 94);
  std::vector<NDArray> got[2];
  int casts[2] = {0, 0}, folded[2] = {0, 0};
  for (int direct = 0; direct < 2; ++direct) {
    Graph g;
    Tensor h = g.placeholder("h", sym_shape(hs), DType::BF16), b = g.placeholder("b", sym_shape(hs), DType::BF16);
    Tensor w = g.placeholder("w", {40}, DType::F32);
    Tensor r0 = g.placeholder("r0", sym_shape(hs), DType::F32), r1 = g.placeholder("r1", sym_shape(hs), DType::F32);
    const Tensor x = direct ? h : ops::cast(h, DType::F32);
    Tensor y = ops::rms_norm(x, w, 1e-5f, DType::BF16);
    Tensor mid = ops::add(x, b);
    ASSERT_EQ(mid.dtype(), DType::F32);
    Tensor loss = ops::add(g.add1(std::make_shared<testing::WeightedSumOp>(), {ops::cast(y, DType::F32), r0}),
                           g.add1(std::make_shared<testing::WeightedSumOp>(), {mid, r1}));
    const int forward_end = loss.node_id();
    const std::vector<Tensor> grads = gradients(loss, {h, w});
    ASSERT_EQ(grads[0].dtype(), DType::BF16);
    for (int id = 0; id < g.num_nodes(); ++id) {
      const Node& n = g.node(id);
      casts[direct] += n.op->type() == "cast" && n.inputs[0].node_id() == h.node_id();
      folded[direct] += id > forward_end && n.op->type() == "rms_norm_grad" && n.inputs.size() == 4;
    }
    got[direct] =
        Executor(g, {loss, grads[0], grads[1]}).run({{"h", hv}, {"b", bv}, {"w", wv}, {"r0", r0v}, {"r1", r1v}});
  }
  EXPECT_EQ(casts[1], 0);  // nothing widens the input
  EXPECT_EQ(folded[0], 1);
  EXPECT_EQ(folded[1], 1);
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(got[0][i].dtype(), got[1][i].dtype()) << i;
    EXPECT_EQ(std::memcmp(got[0][i].raw_data(), got[1][i].raw_data(), got[0][i].nbytes()), 0) << "output " << i;
  }
}

// The kernels behind it: a bf16 x, addend or dx is the f32 kernel on exact
// values, the result rounded once.
TEST(RmsNorm, Bf16KernelArraysAreTheF32KernelRounded) {
  Stream& cpu = default_stream(Device::cpu());
  const Shape hs = {4, 7, 33};
  const NDArray x16 = random_array(hs, 95).to(DType::BF16), x32 = x16.to(DType::F32), w = random_array({33}, 96),
                dy = random_array(hs, 97), a16 = random_array(hs, 98).to(DType::BF16), a32 = a16.to(DType::F32);
  NDArray y16x = NDArray::empty(hs, DType::F32), y32x = NDArray::empty(hs, DType::F32);
  kernels::rms_norm(cpu, x16, w, 1e-5f, y16x);
  kernels::rms_norm(cpu, x32, w, 1e-5f, y32x);
  EXPECT_EQ(std::memcmp(y16x.raw_data(), y32x.raw_data(), y32x.nbytes()), 0);
  NDArray dx = NDArray::empty(hs, DType::F32), dw = NDArray::empty({33}, DType::F32);
  kernels::rms_norm_backward(cpu, dy, x32, w, 1e-5f, dx, dw, &a32);
  NDArray dx16 = NDArray::empty(hs, DType::BF16), dw16 = NDArray::empty({33}, DType::F32);
  kernels::rms_norm_backward(cpu, dy, x16, w, 1e-5f, dx16, dw16, &a16);
  const NDArray want = dx.to(DType::BF16);
  EXPECT_EQ(std::memcmp(dx16.raw_data(), want.raw_data(), want.nbytes()), 0);
  EXPECT_EQ(std::memcmp(dw16.raw_data(), dw.raw_data(), dw.nbytes()), 0);
  NDArray sum16 = NDArray::empty(hs, DType::BF16), sum = NDArray::empty(hs, DType::F32);
  kernels::add(cpu, x16, a16, sum16);
  kernels::add(cpu, x32, a32, sum);
  const NDArray want_sum = sum.to(DType::BF16);
  EXPECT_EQ(std::memcmp(sum16.raw_data(), want_sum.raw_data(), want_sum.nbytes()), 0);
}

// The residual add and the norm of its sum as one op (the decoder's
// post-attention pair): the bits of add then rms_norm, forward and
// backward, with the sum read again later (the block's last residual add,
// whose gradient the norm's backward folds) or read by the norm only, on
// bf16 inputs as the decoder gives them and on f32 ones.
TEST(RmsNorm, AddRmsNormIsTheAddThenTheNorm) {
  const Shape hs = {3, 5, 40};
  for (const bool bf16 : {true, false}) {
    for (const bool sum_read_again : {true, false}) {
      const DType in_dtype = bf16 ? DType::BF16 : DType::F32, act = bf16 ? DType::BF16 : DType::F32;
      const NDArray hv = random_array(hs, 110).to(in_dtype), bv = random_array(hs, 111).to(in_dtype),
                    wv = random_array({40}, 112), dv = random_array(hs, 113).to(in_dtype),
                    r0v = random_array(hs, 114), r1v = random_array(hs, 115);
      std::vector<NDArray> got[2];
      int fused_nodes[2] = {0, 0}, norm_nodes[2] = {0, 0}, folded[2] = {0, 0}, dx_casts[2] = {0, 0};
      for (int fused = 0; fused < 2; ++fused) {
        Graph g;
        Tensor h = g.placeholder("h", sym_shape(hs), in_dtype), b = g.placeholder("b", sym_shape(hs), in_dtype);
        Tensor d = g.placeholder("d", sym_shape(hs), in_dtype), w = g.placeholder("w", {40}, DType::F32);
        Tensor r0 = g.placeholder("r0", sym_shape(hs), DType::F32), r1 = g.placeholder("r1", sym_shape(hs), DType::F32);
        Tensor sum, y;
        if (fused) {
          const ops::AddRmsNorm r = ops::add_rms_norm(h, b, w, 1e-5f, DType::F32, act);
          sum = r.sum, y = r.y;
        } else {
          sum = ops::add(h, b);
          y = ops::rms_norm(sum, w, 1e-5f, act);
        }
        ASSERT_EQ(sum.dtype(), DType::F32);
        ASSERT_EQ(y.dtype(), act);
        Tensor loss = g.add1(std::make_shared<testing::WeightedSumOp>(), {ops::cast(y, DType::F32), r0});
        Tensor out;
        if (sum_read_again) {
          out = ops::add(sum, d, act);  // the block's last residual add
          loss = ops::add(loss, g.add1(std::make_shared<testing::WeightedSumOp>(), {ops::cast(out, DType::F32), r1}));
        }
        const int forward_end = loss.node_id();
        const std::vector<Tensor> grads = gradients(loss, {h, b, w});
        ASSERT_EQ(grads[0].dtype(), DType::F32);  // an f32 sum: a's gradient f32 (AddOp's)
        ASSERT_EQ(grads[1].dtype(), in_dtype);
        for (int id = 0; id < g.num_nodes(); ++id) {
          const Node& n = g.node(id);
          fused_nodes[fused] += n.op && n.op->type() == "add_rms_norm";
          norm_nodes[fused] += n.op && n.op->type() == "rms_norm";
          folded[fused] += id > forward_end && n.op && n.op->type() == "rms_norm_grad" && n.inputs.size() == 4;
          dx_casts[fused] += n.op && n.op->type() == "cast" && n.inputs[0].node().op &&
                             n.inputs[0].node().op->type() == "rms_norm_grad";
        }
        std::vector<Tensor> fetch = {loss, sum, y, grads[0], grads[1], grads[2]};
        if (out.valid()) fetch.push_back(out);
        got[fused] = Executor(g, fetch).run({{"h", hv}, {"b", bv}, {"d", dv}, {"w", wv}, {"r0", r0v}, {"r1", r1v}});
      }
      EXPECT_EQ(fused_nodes[0], 0);
      EXPECT_EQ(fused_nodes[1], 1);
      EXPECT_EQ(norm_nodes[1], 0);
      EXPECT_EQ(folded[0], sum_read_again ? 1 : 0);
      EXPECT_EQ(folded[1], folded[0]);  // the sum's other gradient folded into the norm's backward alike
      // b's bf16 gradient: a cast of the norm's dx, or written by its pass
      EXPECT_EQ(dx_casts[0], bf16 ? 1 : 0);
      EXPECT_EQ(dx_casts[1], 0);
      ASSERT_EQ(got[0].size(), got[1].size());
      for (size_t i = 0; i < got[0].size(); ++i) {
        ASSERT_EQ(got[0][i].dtype(), got[1][i].dtype()) << i;
        ASSERT_EQ(got[0][i].nbytes(), got[1][i].nbytes()) << i;
        EXPECT_EQ(std::memcmp(got[0][i].raw_data(), got[1][i].raw_data(), got[0][i].nbytes()), 0)
            << "bf16 " << bf16 << ", sum read again " << sum_read_again << ", output " << i;
      }
    }
  }
}

TEST(RmsNorm, AddRmsNormGradients) {
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) {
        const ops::AddRmsNorm r = ops::add_rms_norm(t[0], t[1], t[2], 1e-5f);
        return ops::add(r.y, ops::scale(r.sum, 0.5f));
      },
      {{"a", random_array({2, 3, 8}, 120)}, {"b", random_array({2, 3, 8}, 121)}, {"w", random_array({8}, 122)}});
}

}  // namespace
}  // namespace hspmd
