// The model clock's pieces (docs/profiling.md): op_work counts 2mnk for
// matmuls, attention's causal products (against the whole sequence under
// context parallelism) and one flop per output element otherwise;
// OpTimeModel predicts from per-type fits with the kAnyOp fallback; a
// model-mode VirtualClock reads no CPU time and bills only advance().
#include <gtest/gtest.h>

#include <ctime>
#include <string>
#include <vector>

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

// With a sliding window W the bill is the pairs the mask keeps (i - W < j
// <= i within the document), each query's own key counted half as in the
// causal bill above, so that W >= S bills what no window bills: counted by
// brute force here, without documents (from the shapes alone and from the
// arrays), with positions and with cu_seqlens; the gradient 2.5 times that;
// under context parallelism the rank's share of the whole sequence's count.
TEST(OpWork, AttentionWithWindowCountsTheKeptPairs) {
  const int64_t B = 2, S = 8, Hq = 4, D = 8;
  Graph g;
  const SymShape qkv = {SymDim(B), SymDim(S), SymDim(Hq), SymDim(D)};
  Tensor q = g.placeholder("q", qkv, DType::F32), k = g.placeholder("k", qkv, DType::F32);
  Tensor pos = g.placeholder("pos", {SymDim(B), SymDim(S)}, DType::I32);
  Tensor cu = g.placeholder("cu", {SymDim(6)}, DType::I32);
  const Shape local = {B, S, Hq, D}, lse_shape = {B, Hq, S};
  const NDArray x = NDArray::zeros(local, DType::F32);
  const NDArray out = NDArray::zeros(local, DType::F32), lse = NDArray::zeros(lse_shape, DType::F32);
  // Documents of 3 and 5 tokens in row 0, one of 8 in row 1.
  const std::vector<int32_t> doc_pos = {0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7};
  const NDArray positions = NDArray::from_vector_i32({B, S}, doc_pos);
  const NDArray cu_seqlens = NDArray::from_vector_i32({6}, {0, 3, 8, 8, 16, 16});
  // Kept pairs of rows of `len` tokens whose documents start at `start`,
  // less half a pair per query.
  const auto kept = [](const std::vector<int64_t>& start, int64_t len, int64_t window) {
    double pairs = 0;
    for (size_t t = 0; t < start.size(); ++t) {
      const int64_t i = static_cast<int64_t>(t) % len;
      for (int64_t j = 0; j < len; ++j)
        pairs += j >= start[t] && j <= i && (window == 0 || i - j < window) ? 1 : 0;
      pairs -= 0.5;
    }
    return pairs;
  };
  std::vector<int64_t> whole_rows(B * S, 0), doc_starts;
  for (int64_t t = 0; t < B * S; ++t) doc_starts.push_back(t % S - doc_pos[t]);
  const double per_pair = 4.0 * Hq * D;
  const double no_window = op_work(ops::attention(q, k, k, Tensor(), 0.35f).node(),
                                   {local, local, local}, {local, lse_shape}).flops;
  for (int64_t w : {1, 2, 3, 5, 7, 8, 20}) {
    const std::string what = "W=" + std::to_string(w);
    Tensor plain = ops::attention(q, k, k, Tensor(), 0.35f, false, DType::F32, w);
    Tensor with_pos = ops::attention(q, k, k, pos, 0.35f, false, DType::F32, w);
    Tensor with_cu = ops::attention(q, k, k, cu, 0.35f, false, DType::F32, w);
    const double want = per_pair * kept(whole_rows, S, w);
    EXPECT_EQ(op_work(plain.node(), {local, local, local}, {local, lse_shape}).flops, want) << what;
    EXPECT_EQ(op_work(plain.node(), {x, x, x}, {out, lse}).flops, want) << what;
    if (w >= S) {
      EXPECT_EQ(want, no_window) << what;
    }
    const double docs = per_pair * kept(doc_starts, S, w);
    EXPECT_EQ(op_work(with_pos.node(), {x, x, x, positions}, {out, lse}).flops, docs) << what;
    EXPECT_EQ(op_work(with_cu.node(), {x, x, x, cu_seqlens}, {out, lse}).flops, docs) << what;
    const Node& fwd = with_pos.node();
    const std::vector<Tensor> d = fwd.op->gradient(fwd, {q, Tensor()});
    EXPECT_EQ(op_work(d.at(0).node(), {x, x, x, out, lse, x, positions}, {x, x, x}).flops,
              2.5 * docs)
        << what;
    // cp = 2: this rank's 8 queries of the 16, half of the whole rows' count.
    ShardContext shard;
    shard.input_global_shapes = {{B, 16, Hq, D}, {B, 16, Hq, D}, {B, 16, Hq, D}, {B, 16}};
    const double cp_want = per_pair * kept(std::vector<int64_t>(B * 16, 0), 16, w) / 2;
    EXPECT_EQ(op_work(plain.node(), {local, local, local}, {local, lse_shape}, &shard).flops,
              cp_want)
        << what;
    EXPECT_EQ(op_work(with_pos.node(), {x, x, x, positions}, {out, lse}, &shard).flops, cp_want)
        << what;
  }
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
