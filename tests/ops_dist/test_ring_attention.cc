// Context-parallel (ring) attention under mpirun: the ranks of a cp group
// each hold a contiguous chunk of the sequence, run the attention op and its
// gradient with a hand-made ShardContext, and every result (out, lse, dq, dk,
// dv) is checked against the single-process op on the whole tensors.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "comm/mpi_test_main.h"
#include "hspmd/core/error.h"
#include "hspmd/ops/ops.h"
#include "kernels/attention.h"
#include "ops/gradcheck.h"
#include "ops_dist/shard_util.h"

namespace hspmd {
namespace {

using testing::cut;
using testing::expect_close;
using testing::random_array;
using testing::run_op;
using testing::take;
using testing::test_world;
using testing::whole;

struct Dims {
  int64_t B, S, Hq, Hkv, D;
  Shape q() const { return {B, S, Hq, D}; }
  Shape kv() const { return {B, S, Hkv, D}; }
  Shape lse() const { return {B, Hq, S}; }
  Shape tokens() const { return {B, S}; }
};

// Where a rank sits: cp group g of `cp` consecutive ranks, chunk c in it.
struct Place {
  int cp, group, chunk;
  Place(int rank, int cp) : cp(cp), group(rank / cp), chunk(rank % cp) {}
  std::vector<int> members() const {
    std::vector<int> m;
    for (int i = 0; i < cp; ++i) m.push_back(group * cp + i);
    return m;
  }
  Box seq(const Shape& shape, int dim) const { return cut(whole(shape), dim, chunk, cp); }
};

// One node of attention and one of its gradient, on arrays of `d`'s shapes.
struct AttentionGraph {
  Graph g;
  Tensor out, dq;
  AttentionGraph(const Dims& d, bool positions, bool cu_seqlens = false, int64_t window = 0) {
    Tensor q = g.placeholder("q", sym_shape(d.q()), DType::F32);
    Tensor k = g.placeholder("k", sym_shape(d.kv()), DType::F32);
    Tensor v = g.placeholder("v", sym_shape(d.kv()), DType::F32);
    Tensor docs;
    if (positions) docs = g.placeholder("pos", sym_shape(d.tokens()), DType::I32);
    if (cu_seqlens) docs = g.placeholder("cu", {3}, DType::I32);
    out = ops::attention(q, k, v, docs, 0.35f, true, DType::F32, window);
    Tensor grad = g.placeholder("grad", sym_shape(d.q()), DType::F32);
    dq = out.node().op->gradient(out.node(), {grad, Tensor()})[0];
  }
};

// The global arrays of one case.
struct Data {
  NDArray q, k, v, grad, pos;
};

Data make_data(const Dims& d, const std::vector<int32_t>& pos, uint64_t seed) {
  Data x{random_array(d.q(), seed), random_array(d.kv(), seed + 1), random_array(d.kv(), seed + 2),
         random_array(d.q(), seed + 3), NDArray()};
  if (!pos.empty()) x.pos = NDArray::from_vector_i32(d.tokens(), pos);
  return x;
}

ShardContext shard(const std::vector<Shape>& in, const std::vector<Box>& in_boxes,
                   const std::vector<Shape>& out, const std::vector<Box>& out_boxes,
                   Communicator& world, const Place& p) {
  ShardContext s{in, in_boxes, out, out_boxes, {}, {}};
  s.ranks_along = [p](int, int) { return p.members(); };
  s.group_along = [&world, p](int input, int dim) -> Communicator& {
    EXPECT_EQ(input, 0);
    EXPECT_EQ(dim, 1);
    return world.group(p.members());
  };
  return s;
}

// Runs the ring on this rank's chunk and compares with the whole-tensor op
// (both with the sliding window `window`, 0: none).
void check_ring(const Dims& d, const std::vector<int32_t>& pos, int cp, uint64_t seed,
                int64_t window = 0) {
  Communicator& world = test_world();
  if (world.size() % cp != 0) GTEST_SKIP() << "world not divisible by cp=" << cp;
  const Place p(world.rank(), cp);
  const Data x = make_data(d, pos, seed + 10 * p.group);  // each cp group its own data
  const bool docs = !pos.empty();

  AttentionGraph full(d, docs, false, window);
  std::vector<NDArray> in = {x.q, x.k, x.v};
  if (docs) in.push_back(x.pos);
  const auto want = run_op(full.out.node(), in, {d.q(), d.lse()});
  std::vector<NDArray> gin = {x.q, x.k, x.v, want[0], want[1], x.grad};
  if (docs) gin.push_back(x.pos);
  const auto want_grads = run_op(full.dq.node(), gin, {d.q(), d.kv(), d.kv()});

  const Box qb = p.seq(d.q(), 1), kb = p.seq(d.kv(), 1), lb = p.seq(d.lse(), 2),
            tb = p.seq(d.tokens(), 1);
  Dims local = d;
  local.S = d.S / cp;
  AttentionGraph part(local, docs, false, window);
  std::vector<NDArray> lin = {take(x.q, qb), take(x.k, kb), take(x.v, kb)};
  std::vector<Shape> shapes = {d.q(), d.kv(), d.kv()};
  std::vector<Box> boxes = {qb, kb, kb};
  if (docs) lin.push_back(take(x.pos, tb)), shapes.push_back(d.tokens()), boxes.push_back(tb);
  const ShardContext fs = shard(shapes, boxes, {d.q(), d.lse()}, {qb, lb}, world, p);
  // The op's own prediction of its communication is what the counters see.
  const ByteCounters before = world.bytes();
  const auto got = run_op(part.out.node(), lin, {qb.shape(), lb.shape()}, &fs);
  const OpTraffic ft = part.out.node().op->traffic(fs);
  EXPECT_EQ(ft.sent, world.bytes().sent - before.sent);
  EXPECT_EQ(ft.received, world.bytes().received - before.received);
  EXPECT_EQ(ft.group, p.members());
  expect_close(got[0], take(want[0], qb), 1e-5, 1e-6);
  expect_close(got[1], take(want[1], lb), 1e-5, 1e-6);

  std::vector<NDArray> lgin = {lin[0], lin[1], lin[2], got[0], got[1], take(x.grad, qb)};
  std::vector<Shape> gshapes = {d.q(), d.kv(), d.kv(), d.q(), d.lse(), d.q()};
  std::vector<Box> gboxes = {qb, kb, kb, qb, lb, qb};
  if (docs) lgin.push_back(lin[3]), gshapes.push_back(d.tokens()), gboxes.push_back(tb);
  const ShardContext gs = shard(gshapes, gboxes, {d.q(), d.kv(), d.kv()}, {qb, kb, kb}, world, p);
  const ByteCounters gbefore = world.bytes();
  const auto grads = run_op(part.dq.node(), lgin, {qb.shape(), kb.shape(), kb.shape()}, &gs);
  const OpTraffic gt = part.dq.node().op->traffic(gs);
  EXPECT_EQ(gt.sent, world.bytes().sent - gbefore.sent);
  EXPECT_EQ(gt.received, world.bytes().received - gbefore.received);
  const Box gb[] = {qb, kb, kb};
  for (int i = 0; i < 3; ++i) expect_close(grads[i], take(want_grads[i], gb[i]), 1e-5, 2e-6);
}

// Sets the kernels' tile sizes for one test and restores them afterwards.
class TilesGuard {
 public:
  explicit TilesGuard(kernels::AttentionTiles t) : saved_(kernels::attention_tiles()) {
    kernels::set_attention_tiles(t);
  }
  ~TilesGuard() { kernels::set_attention_tiles(saved_); }

 private:
  kernels::AttentionTiles saved_;
};

const kernels::AttentionTiles kTiles[] = {{64, 64}, {3, 2}};

// Positions of packed documents: one row per list of document lengths.
std::vector<int32_t> positions(const std::vector<std::vector<int>>& rows) {
  std::vector<int32_t> pos;
  for (const auto& lengths : rows)
    for (int len : lengths)
      for (int i = 0; i < len; ++i) pos.push_back(i);
  return pos;
}

TEST(RingAttention, PlainCausal) {
  const int cp = test_world().size();
  for (const auto& tiles : kTiles) {
    TilesGuard guard(tiles);
    check_ring({1, 8 * cp, 2, 2, 8}, {}, cp, 1);
  }
}

TEST(RingAttention, GroupedQueryHeads) {
  const int cp = test_world().size();
  for (const auto& tiles : kTiles) {
    TilesGuard guard(tiles);
    check_ring({1, 4 * cp, 4, 2, 8}, {}, cp, 2);
  }
}

// S = 48: halves of 12 (cp=2) or 6 (cp=4). Documents start on half
// boundaries (12; 6 in row 1) and cross chunk boundaries (24, 36).
TEST(RingAttention, PackedDocumentsWithBatchOfTwo) {
  const int cp = test_world().size();
  if (48 % (2 * cp) != 0) GTEST_SKIP();
  const std::vector<int32_t> pos = positions({{12, 5, 13, 11, 7}, {6, 17, 2, 22, 1}});
  for (const auto& tiles : kTiles) {
    TilesGuard guard(tiles);
    check_ring({2, 48, 4, 2, 8}, pos, cp, 3);
  }
}

// A sliding window below half a chunk (whole blocks hidden: skipped, while
// the ring still passes every block on) and one spanning several chunks, so
// the window crosses chunk boundaries; with and without packed documents.
TEST(RingAttention, SlidingWindow) {
  const int cp = test_world().size();
  const int64_t S = 8 * cp, chunk = S / cp, half = chunk / 2;
  for (const auto& tiles : kTiles) {
    TilesGuard guard(tiles);
    for (int64_t window : {int64_t{1}, half - 1, 2 * chunk + 3, S - 1}) {
      SCOPED_TRACE("window " + std::to_string(window));
      check_ring({1, S, 4, 2, 8}, {}, cp, 7, window);
    }
  }
  if (48 % (2 * cp) != 0) return;
  const std::vector<int32_t> pos = positions({{12, 5, 13, 11, 7}, {6, 17, 2, 22, 1}});
  TilesGuard guard({3, 2});
  for (int64_t window : {2, 9, 30}) {
    SCOPED_TRACE("documents, window " + std::to_string(window));
    check_ring({2, 48, 4, 2, 8}, pos, cp, 8, window);
  }
}

// Two cp groups of two ranks (with 4 ranks), each on its own data: checks
// that the op rings over group_along's communicator, not the world.
TEST(RingAttention, CpGroupsInsideTheWorld) {
  TilesGuard guard({4, 4});
  check_ring({2, 16, 2, 1, 8}, positions({{5, 11}, {8, 8}}), 2, 4);
}

// `box` with its sequence dim cut to [begin, end).
Box seq_range(Box box, int dim, int64_t begin, int64_t end) {
  box.begin[dim] = begin;
  box.end[dim] = end;
  return box;
}

// Runs the forward on this rank's chunk and returns the error ("" if none).
// `uneven`: rank r holds [2r, 2r + 2), the last rank the rest.
std::string ring_error(const Dims& d, const std::vector<int32_t>& pos, bool cu_seqlens,
                       bool uneven = false) {
  Communicator& world = test_world();
  const Place p(world.rank(), world.size());
  const Data x = make_data(d, pos, 5);
  int64_t begin = d.S / p.cp * p.chunk, end = begin + d.S / p.cp;
  if (uneven) begin = 2 * p.chunk, end = p.chunk + 1 == p.cp ? d.S : begin + 2;
  const Box qb = seq_range(whole(d.q()), 1, begin, end),
            kb = seq_range(whole(d.kv()), 1, begin, end),
            lb = seq_range(whole(d.lse()), 2, begin, end),
            tb = seq_range(whole(d.tokens()), 1, begin, end);
  Dims local = d;
  local.S = end - begin;
  AttentionGraph part(local, !pos.empty(), cu_seqlens);
  std::vector<NDArray> in = {take(x.q, qb), take(x.k, kb), take(x.v, kb)};
  std::vector<Shape> shapes = {d.q(), d.kv(), d.kv()};
  std::vector<Box> boxes = {qb, kb, kb};
  if (!pos.empty())
    in.push_back(take(x.pos, tb)), shapes.push_back(d.tokens()), boxes.push_back(tb);
  if (cu_seqlens) {
    const int32_t total = static_cast<int32_t>(d.B * d.S);
    in.push_back(NDArray::from_vector_i32({3}, {0, total / 2, total}));
    shapes.push_back({3});
    boxes.push_back(whole({3}));
  }
  const ShardContext s = shard(shapes, boxes, {d.q(), d.lse()}, {qb, lb}, world, p);
  try {
    run_op(part.out.node(), in, {qb.shape(), lb.shape()}, &s);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Every rank threw one line starting with `prefix`, and nobody is left
// inside a ring: the world still works.
void expect_one_line(const std::string& msg, const std::string& prefix) {
  EXPECT_EQ(msg.rfind(prefix, 0), 0u) << "'" << msg << "'";
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  float one = 1;
  test_world().all_reduce(&one, 1);
  EXPECT_EQ(one, static_cast<float>(test_world().size()));
}

TEST(RingAttention, SequenceNotDivisibleByTwiceCpThrowsOnEveryRank) {
  const int cp = test_world().size();
  expect_one_line(ring_error({1, 3 * cp, 2, 2, 4}, {}, false),
                  "[attention] context parallelism over cp=" + std::to_string(cp) +
                      " needs the sequence length S divisible by 2*cp");
}

TEST(RingAttention, UnevenChunksThrowOnEveryRank) {
  const int cp = test_world().size();
  expect_one_line(ring_error({1, 4 * cp, 2, 2, 4}, {}, false, true),
                  "[attention] context parallelism over cp=" + std::to_string(cp) +
                      " needs q's sequence cut into equal chunks in cp order");
}

TEST(RingAttention, CuSeqlensThrowsOnEveryRank) {
  const int cp = test_world().size();
  expect_one_line(ring_error({1, 4 * cp, 2, 2, 4}, {}, true),
                  "[attention] context parallelism over cp=" + std::to_string(cp) +
                      " needs documents as positions");
}

TEST(RingAttention, NegativePositionThrowsOnEveryRank) {
  const int cp = test_world().size();
  std::vector<int32_t> pos(4 * cp);
  for (int i = 0; i < 4 * cp; ++i) pos[i] = i;
  pos[1] = -2;  // on rank 0 only
  expect_one_line(ring_error({1, 4 * cp, 2, 2, 4}, pos, false), "[attention] document positions: ");
}

}  // namespace
}  // namespace hspmd
