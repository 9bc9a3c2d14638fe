// The model clock's pieces (docs/profiling.md): op_work counts 2mnk for
// matmuls, attention's causal products (against the whole sequence under
// context parallelism) and one flop per output element otherwise;
// OpTimeModel predicts from per-type fits with the kAnyOp fallback; a
// model-mode VirtualClock reads no CPU time and bills only advance().
#include <gtest/gtest.h>

#include <ctime>
#include <string>

#include "hspmd/core/error.h"
#include "hspmd/exec/op_work.h"
#include "hspmd/exec/virtual_clock.h"
#include "hspmd/ops/ops.h"
#include "test_util.h"

namespace hspmd {
namespace {

using testing::error_of;

double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

void burn(double seconds) {
  const double until = cpu_seconds() + seconds;
  volatile double x = 0;
  while (cpu_seconds() < until) x = x + 1.0;
}

TEST(OpWork, MatmulIsTwoMnk) {
  Graph g;
  Tensor x = g.placeholder("x", {SymDim(3), SymDim(5), SymDim(8)}, DType::F32);
  Tensor w = g.parameter("w", {6, 8});
  Tensor y = ops::matmul(x, w, false, true);  // [3, 5, 6], k = 8
  OpWork work = op_work(y.node(), {{3, 5, 8}, {6, 8}}, {{3, 5, 6}});
  EXPECT_EQ(work.flops, 2.0 * 15 * 6 * 8);
  EXPECT_EQ(work.elements, 120 + 48 + 90);
  Tensor dw = ops::matmul(x, ops::reshape(y, {SymDim(15), SymDim(6)}), true, false);  // contracts 15 rows
  work = op_work(dw.node(), {{3, 5, 8}, {15, 6}}, {{8, 6}});
  EXPECT_EQ(work.flops, 2.0 * 8 * 6 * 15);
}

TEST(OpWork, AttentionCountsTheWholeSequencesKeys) {
  Graph g;
  const SymShape qkv = {SymDim(2), SymDim(16), SymDim(4), SymDim(8)};
  Tensor q = g.placeholder("q", qkv, DType::F32), k = g.placeholder("k", qkv, DType::F32);
  Tensor out = ops::attention(q, k, k, Tensor(), 0.35f, true);
  const Shape local = {2, 8, 4, 8};
  EXPECT_EQ(op_work(out.node(), {local, local, local}, {local, {2, 4, 8}}).flops, 2.0 * 2 * 4 * 8 * 8 * 8);
  ShardContext shard;  // cp = 2: the local half of the queries against all 16 keys
  shard.input_global_shapes = {{2, 16, 4, 8}, {2, 16, 4, 8}, {2, 16, 4, 8}};
  EXPECT_EQ(op_work(out.node(), {local, local, local}, {local, {2, 4, 8}}, &shard).flops,
            2.0 * 2 * 4 * 8 * 8 * 16);
}

// With documents the model clock bills the products the mask keeps (the
// kernels skip the tiles it hides): one document per row bills what no
// documents bill, two halves of a row half of it, and cu_seqlens what the
// same documents as positions do; the gradient is 2.5 times the forward.
TEST(OpWork, AttentionWithDocumentsCountsTheKeptProducts) {
  Graph g;
  const SymShape qkv = {SymDim(2), SymDim(8), SymDim(4), SymDim(8)};
  Tensor q = g.placeholder("q", qkv, DType::F32), k = g.placeholder("k", qkv, DType::F32);
  Tensor pos = g.placeholder("pos", {SymDim(2), SymDim(8)}, DType::I32);
  Tensor cu = g.placeholder("cu", {SymDim(5)}, DType::I32);
  Tensor with_pos = ops::attention(q, k, k, pos, 0.35f, false);
  Tensor with_cu = ops::attention(q, k, k, cu, 0.35f, false);
  const Shape local = {2, 8, 4, 8};
  const NDArray x = NDArray::zeros(local, DType::F32);
  const NDArray out = NDArray::zeros(local, DType::F32), lse = NDArray::zeros({2, 4, 8}, DType::F32);
  const double whole = op_work(with_pos.node(), {local, local, local}, {local, {2, 4, 8}}).flops;
  EXPECT_EQ(whole, 2.0 * 2 * 4 * 8 * 8 * 8);
  std::vector<int32_t> causal, halves;
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 8; ++i) causal.push_back(i), halves.push_back(i % 4);
  const NDArray one_doc = NDArray::from_vector_i32({2, 8}, causal);
  EXPECT_EQ(op_work(with_pos.node(), {x, x, x, one_doc}, {out, lse}).flops, whole);
  EXPECT_EQ(op_work(with_pos.node(), {x, x, x, NDArray::from_vector_i32({2, 8}, halves)}, {out, lse}).flops,
            whole / 2);
  const NDArray cu_halves = NDArray::from_vector_i32({5}, {0, 4, 8, 12, 16});
  EXPECT_EQ(op_work(with_cu.node(), {x, x, x, cu_halves}, {out, lse}).flops, whole / 2);
  // No documents: the shapes' count, as before.
  EXPECT_EQ(op_work(with_pos.node(), {x, x, x, NDArray()}, {out, lse}).flops, whole);
  // Context parallelism: the shapes' count (the rank's half of the queries
  // against all 16 keys), documents or not.
  ShardContext shard;
  shard.input_global_shapes = {{2, 16, 4, 8}, {2, 16, 4, 8}, {2, 16, 4, 8}, {2, 16}};
  EXPECT_EQ(op_work(with_pos.node(), {x, x, x, NDArray::from_vector_i32({2, 8}, halves)}, {out, lse}, &shard).flops,
            2.0 * 2 * 4 * 8 * 8 * 16);
  // The gradient op: q, k, v, out, lse, grad_out, documents.
  const Node& fwd = with_pos.node();
  const std::vector<Tensor> d = fwd.op->gradient(fwd, {q, Tensor()});
  ASSERT_EQ(d.at(0).node().op->type(), "attention_grad");
  EXPECT_EQ(op_work(d.at(0).node(), {x, x, x, out, lse, x, NDArray::from_vector_i32({2, 8}, halves)}, {x, x, x}).flops,
            2.5 * whole / 2);
}

TEST(OpWork, ElementwiseOpsCountTheirOutput) {
  Graph g;
  Tensor a = g.placeholder("a", {SymDim(4), SymDim(5)}, DType::F32);
  Tensor s = ops::add(a, a);
  const OpWork w = op_work(s.node(), {{4, 5}, {4, 5}}, {{4, 5}});
  EXPECT_EQ(w.flops, 20);
  EXPECT_EQ(w.elements, 60);
}

TEST(OpTimeModel, PerTypeFitsThenTheFallback) {
  OpFit matmul{1e-6, 1e-11, 0, 0, 10};
  OpFit any{2e-6, 0, 1e-9, 0, 30};
  const OpTimeModel model({{"matmul", matmul}, {kAnyOp, any}}, "p.json");
  EXPECT_DOUBLE_EQ(model.seconds("matmul", {1e6, 5}), 1e-6 + 1e-5);
  EXPECT_DOUBLE_EQ(model.seconds("rope", {3, 1000}), 2e-6 + 1e-6);
  const OpTimeModel only({{"matmul", matmul}}, "p.json");
  EXPECT_NE(error_of([&] { only.seconds("rope", {}); }).find("[profile] p.json: no fit for op type 'rope'"),
            std::string::npos);
  EXPECT_NE(error_of([] { OpTimeModel({}, "q.json"); }).find("[profile] q.json: no per-op fits"), std::string::npos);
}

TEST(VirtualClock, ModelModeReadsNoCpuTime) {
  VirtualClock clock(3.0, ClockMode::kModel);
  EXPECT_TRUE(clock.modeled());
  clock.begin_compute();
  burn(0.01);
  clock.end_compute();
  EXPECT_EQ(clock.now(), 0.0);
  clock.advance(0.5);  // a prediction, times the slowdown
  EXPECT_DOUBLE_EQ(clock.now(), 1.5);
  EXPECT_DOUBLE_EQ(clock.compute_s(), 1.5);
  clock.communicate(2.0, 0.25);
  EXPECT_DOUBLE_EQ(clock.now(), 2.25);
  EXPECT_DOUBLE_EQ(clock.compute_s(), 1.5);

  VirtualClock cpu(2.0);  // CPU mode: the bracket's CPU time, times the slowdown
  cpu.begin_compute();
  burn(0.01);
  cpu.end_compute();
  EXPECT_GE(cpu.compute_s(), 0.02);
}

}  // namespace
}  // namespace hspmd
