#include <cstring>

#include "gradcheck.h"
#include "kernels/basic.h"
#include "hspmd/core/dtype.h"
#include "hspmd/graph/executor.h"
#include "hspmd/ops/autodiff.h"
#include "hspmd/ops/ops.h"

namespace hspmd {
namespace {

using testing::expect_gradients_match;
using testing::random_array;

TEST(Swiglu, ForwardMatchesReference) {
  NDArray gate = random_array({3, 7}, 1, 3.0f), up = random_array({3, 7}, 2);
  Graph g;
  Tensor tg = g.placeholder("gate", {3, 7}, DType::F32);
  Tensor tu = g.placeholder("up", {3, 7}, DType::F32);
  NDArray out = Executor(g, {ops::swiglu(tg, tu)}).run({{"gate", gate}, {"up", up}})[0];
  for (int i = 0; i < 21; ++i) {
    const double x = gate.data<float>()[i];
    EXPECT_NEAR(out.data<float>()[i], x / (1 + std::exp(-x)) * up.data<float>()[i], 1e-5);
  }
}

TEST(Swiglu, Gradients) {
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) { return ops::swiglu(t[0], t[1]); },
      {{"gate", random_array({3, 7}, 3, 2.0f)}, {"up", random_array({3, 7}, 4)}});
}

TEST(Swiglu, ShapeMismatchIsAnError) {
  Graph g;
  Tensor a = g.placeholder("a", {3, 4}, DType::F32), b = g.placeholder("b", {3, 5}, DType::F32);
  EXPECT_THROW(ops::swiglu(a, b), Error);
}

// A bf16 copy of an f32 array (rounded to nearest even) and back.
NDArray to_bf16(const NDArray& a) {
  NDArray out = NDArray::empty(a.shape(), DType::BF16);
  for (int64_t i = 0; i < a.numel(); ++i) out.data<uint16_t>()[i] = f32_to_bf16(a.data<float>()[i]);
  return out;
}

NDArray to_f32(const NDArray& a) {
  NDArray out = NDArray::empty(a.shape(), DType::F32);
  for (int64_t i = 0; i < a.numel(); ++i) out.data<float>()[i] = bf16_to_f32(a.data<uint16_t>()[i]);
  return out;
}

// bf16 gate and up: the same f32 math as on their f32 values, the result
// rounded once; the backward's dgate and dup likewise. Sizes
// beyond one kernel block (4096) with a vector tail.
TEST(Swiglu, Bf16ArraysComputeInF32AndRoundOnce) {
  const Shape shape{3, 3001};
  const NDArray gate = to_bf16(random_array(shape, 5, 3.0f)), up = to_bf16(random_array(shape, 6));
  const NDArray dy = to_f32(to_bf16(random_array(shape, 7)));  // bf16 values: the cast keeps them
  std::vector<NDArray> ref, got;
  for (const DType t : {DType::F32, DType::BF16}) {
    Graph g;
    Tensor tg = g.placeholder("gate", sym_shape(shape), t);
    Tensor tu = g.placeholder("up", sym_shape(shape), t);
    Tensor td = g.placeholder("dy", sym_shape(shape), DType::F32);
    Tensor y = ops::swiglu(tg, tu);
    EXPECT_EQ(y.dtype(), t);
    Tensor loss = g.add1(std::make_shared<testing::WeightedSumOp>(), {ops::cast(y, DType::F32), td});
    std::vector<Tensor> grads = gradients(loss, {tg, tu});
    EXPECT_EQ(grads[0].dtype(), t);
    const bool bf16 = t == DType::BF16;
    (bf16 ? got : ref) = Executor(g, {y, grads[0], grads[1]})
                             .run({{"gate", bf16 ? gate : to_f32(gate)},
                                   {"up", bf16 ? up : to_f32(up)},
                                   {"dy", dy}});
  }
  for (int k = 0; k < 3; ++k)
    for (int64_t i = 0; i < ref[k].numel(); ++i)
      ASSERT_EQ(got[k].data<uint16_t>()[i], f32_to_bf16(ref[k].data<float>()[i])) << "output " << k << " element " << i;
}

TEST(Swiglu, MixedGateAndUpDtypesAreAnError) {
  Graph g;
  Tensor a = g.placeholder("a", {3, 4}, DType::BF16), b = g.placeholder("b", {3, 4}, DType::F32);
  EXPECT_THROW(ops::swiglu(a, b), Error);
  Tensor i = g.placeholder("i", {3, 4}, DType::I32);
  EXPECT_THROW(ops::swiglu(i, i), Error);
}

// A GEMM's weight gradient that reads SwiGLU's output recomputes it in the
// backward (a second swiglu node, built where the gradient is), so the
// forward's output has no backward consumer and is freed after the GEMM.
// SwiGLU's output is not kept for the weight gradient that reads it: it is
// recomputed there, in the same pass as SwiGLU's own backward (its one
// consumer's dgrad is all of its gradient), and gradient() reuses that
// pass's dgate and dup.
TEST(Swiglu, RecomputedForTheWeightGradientThatReadsIt) {
  Graph g;
  Tensor tg = g.placeholder("gate", {4, 6}, DType::F32), tu = g.placeholder("up", {4, 6}, DType::F32);
  Tensor w = g.parameter("w", {5, 6});
  Tensor act = ops::swiglu(tg, tu);
  Tensor y = ops::linear(act, w);
  Tensor tw = g.placeholder("dy", {4, 5}, DType::F32);
  Tensor loss = g.add1(std::make_shared<testing::WeightedSumOp>(), {y, tw});
  const int forward_end = loss.node_id();
  std::vector<Tensor> grads = gradients(loss, {w, tg, tu});
  int swiglus = 0, fused = 0, other_grads = 0, readers_after_forward = 0;
  for (int id = 0; id < g.num_nodes(); ++id) {
    const Node& n = g.node(id);
    swiglus += n.op && n.op->type() == "swiglu";
    if (n.op && n.op->type() == "swiglu_grad") (n.outputs.size() == 3 ? fused : other_grads) += 1;
    for (const Tensor& in : n.inputs)
      if (id > forward_end && in.node_id() == act.node_id()) ++readers_after_forward;
  }
  EXPECT_EQ(swiglus, 1);
  EXPECT_EQ(fused, 1);
  EXPECT_EQ(other_grads, 0);
  EXPECT_EQ(readers_after_forward, 0);
  EXPECT_EQ(grads[1].node_id(), grads[2].node_id());  // dgate and dup: the fused node's
  // The same bits as the forward, a separate backward and the GEMMs apart.
  const NDArray gv = random_array({4, 6}, 8, 2.0f), uv = random_array({4, 6}, 9), wv = random_array({5, 6}, 10),
                dyv = random_array({4, 5}, 11);
  const std::vector<NDArray> got = Executor(g, grads).run({{"gate", gv}, {"up", uv}, {"w", wv}, {"dy", dyv}});
  Stream& cpu = default_stream(Device::cpu());
  NDArray a = NDArray::empty({4, 6}, DType::F32), da = NDArray::empty({4, 6}, DType::F32);
  NDArray dw = NDArray::empty({5, 6}, DType::F32), dg = NDArray::empty({4, 6}, DType::F32),
          du = NDArray::empty({4, 6}, DType::F32);
  kernels::swiglu(cpu, gv, uv, a);
  kernels::matmul(cpu, dyv, wv, false, false, da);
  kernels::matmul(cpu, dyv, a, true, false, dw);
  kernels::swiglu_backward(cpu, da, gv, uv, dg, du);
  for (const auto& [x, want] : {std::pair{got[0], dw}, {got[1], dg}, {got[2], du}})
    EXPECT_EQ(std::memcmp(x.data<float>(), want.data<float>(), want.nbytes()), 0);
  // And the gradients are right (finite differences through the same graph shape).
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) {
        return ops::linear(ops::swiglu(t[0], t[1]), t[2]);
      },
      {{"gate", random_array({4, 6}, 8, 2.0f)}, {"up", random_array({4, 6}, 9)},
       {"w", random_array({5, 6}, 10)}});
}

// An output read by two nodes gets its gradient from both: the recompute
// then stays a plain swiglu and the backward a separate swiglu_grad.
TEST(Swiglu, TwoConsumersKeepTheSeparateBackward) {
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) {
        const Tensor act = ops::swiglu(t[0], t[1]);
        return ops::add(ops::linear(act, t[2]), ops::linear(act, t[3]));
      },
      {{"gate", random_array({4, 6}, 12, 2.0f)}, {"up", random_array({4, 6}, 13)},
       {"w", random_array({5, 6}, 14)}, {"w2", random_array({5, 6}, 15)}});
}

}  // namespace
}  // namespace hspmd
