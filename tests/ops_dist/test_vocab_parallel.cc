// Vocab-parallel embedding and cross-entropy under mpirun: every rank holds a
// shard of the vocabulary (and, for cross-entropy, optionally a chunk of the
// tokens), computes its op with a ShardContext, and the results are checked
// against the single-process op on the whole tensors.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "comm/mpi_test_main.h"
#include "hspmd/core/error.h"
#include "hspmd/ops/ops.h"
#include "ops/gradcheck.h"
#include "ops_dist/shard_util.h"

namespace hspmd {
namespace {

using testing::cut;
using testing::expect_close;
using testing::expect_equal;
using testing::random_array;
using testing::run_op;
using testing::take;
using testing::test_world;
using testing::whole;

constexpr int64_t kVocab = 48;  // divisible by 2, 4, 8
constexpr int64_t kHidden = 8;

NDArray make_ids(const Shape& shape, int64_t vocab) {
  std::vector<int32_t> ids(shape_numel(shape));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 7 + 3) % vocab);
  return NDArray::from_vector_i32(shape, ids);
}

// ---- embedding ----

struct EmbeddingGraph {
  Graph g;
  Tensor out, grad_out, dweight;
  EmbeddingGraph(const Shape& weight, const Shape& ids) {
    Tensor w = g.placeholder("weight", sym_shape(weight), DType::F32);
    Tensor i = g.placeholder("ids", sym_shape(ids), DType::I32);
    out = ops::embedding(w, i);
    Shape gs = ids;
    gs.push_back(weight[1]);
    grad_out = g.placeholder("grad", sym_shape(gs), DType::F32);
    dweight = out.node().op->gradient(out.node(), {grad_out})[0];
  }
};

// The embedding's shard context for a rank holding weight box `wbox`.
ShardContext embedding_shard(const Shape& ids, const Box& wbox) {
  const Shape weight{kVocab, kHidden};
  Shape out = ids;
  out.push_back(kHidden);
  Box obox = whole(out);
  obox.begin.back() = wbox.begin[1];
  obox.end.back() = wbox.end[1];
  ShardContext s;
  s.input_global_shapes = {weight, ids};
  s.input_boxes = {wbox, whole(ids)};
  s.output_global_shapes = {out};
  s.output_boxes = {obox};
  s.group_along = [](int, int) -> Communicator& { throw InternalError("no group needed"); };
  return s;
}

ShardContext embedding_grad_shard(const Shape& ids, const Box& wbox) {
  const ShardContext fwd = embedding_shard(ids, wbox);
  ShardContext s;
  s.input_global_shapes = {fwd.output_global_shapes[0], ids};
  s.input_boxes = {fwd.output_boxes[0], whole(ids)};
  s.output_global_shapes = {fwd.input_global_shapes[0]};
  s.output_boxes = {wbox};
  s.group_along = fwd.group_along;
  return s;
}

TEST(VocabParallel, EmbeddingPartialOutputsSumToFull) {
  Communicator& world = test_world();
  const int n = world.size(), r = world.rank();
  const Shape ids_shape{3, 5}, weight{kVocab, kHidden};
  const NDArray w = random_array(weight, 11), ids = make_ids(ids_shape, kVocab);
  const NDArray grad = random_array({3, 5, kHidden}, 12);
  EmbeddingGraph full(weight, ids_shape);
  const NDArray want = run_op(full.out.node(), {w, ids}, {{3, 5, kHidden}})[0];
  const NDArray want_dw = run_op(full.dweight.node(), {grad, ids}, {weight})[0];

  const Box wbox = cut(whole(weight), 0, r, n);
  EmbeddingGraph local(wbox.shape(), ids_shape);
  const ShardContext s = embedding_shard(ids_shape, wbox);
  NDArray out = run_op(local.out.node(), {take(w, wbox), ids}, {{3, 5, kHidden}}, &s)[0];
  world.all_reduce(out.data<float>(), out.numel());
  expect_equal(out, want);

  const ShardContext gs = embedding_grad_shard(ids_shape, wbox);
  const NDArray dw = run_op(local.dweight.node(), {grad, ids}, {wbox.shape()}, &gs)[0];
  expect_equal(dw, take(want_dw, wbox));
}

TEST(VocabParallel, EmbeddingHiddenSplitIsALocalLookup) {
  Communicator& world = test_world();
  const int n = world.size(), r = world.rank();
  const Shape ids_shape{2, 6}, weight{kVocab, kHidden};
  const NDArray w = random_array(weight, 13), ids = make_ids(ids_shape, kVocab);
  const NDArray grad = random_array({2, 6, kHidden}, 14);
  EmbeddingGraph full(weight, ids_shape);
  const NDArray want = run_op(full.out.node(), {w, ids}, {{2, 6, kHidden}})[0];
  const NDArray want_dw = run_op(full.dweight.node(), {grad, ids}, {weight})[0];

  const Box wbox = cut(whole(weight), 1, r, n);
  const Box obox = cut(whole({2, 6, kHidden}), 2, r, n);
  EmbeddingGraph local(wbox.shape(), ids_shape);
  const ShardContext s = embedding_shard(ids_shape, wbox);
  expect_equal(run_op(local.out.node(), {take(w, wbox), ids}, {obox.shape()}, &s)[0],
               take(want, obox));
  const ShardContext gs = embedding_grad_shard(ids_shape, wbox);
  expect_equal(run_op(local.dweight.node(), {take(grad, obox), ids}, {wbox.shape()}, &gs)[0],
               take(want_dw, wbox));
}

TEST(VocabParallel, EmbeddingIdOutsideGlobalVocabThrowsOnEveryRank) {
  Communicator& world = test_world();
  const Shape ids_shape{4}, weight{kVocab, kHidden};
  const Box wbox = cut(whole(weight), 0, world.rank(), world.size());
  EmbeddingGraph local(wbox.shape(), ids_shape);
  const ShardContext s = embedding_shard(ids_shape, wbox);
  const NDArray w = random_array(wbox.shape(), 15);
  // Ids of other shards are fine; ids outside [0, V) are not.
  const NDArray good = NDArray::from_vector_i32(ids_shape, {0, 47, 24, 13});
  EXPECT_NO_THROW(run_op(local.out.node(), {w, good}, {{4, kHidden}}, &s));
  for (int32_t bad : {-1, static_cast<int32_t>(kVocab)}) {
    const NDArray ids = NDArray::from_vector_i32(ids_shape, {0, bad, 2, 3});
    EXPECT_THROW(run_op(local.out.node(), {w, ids}, {{4, kHidden}}, &s), Error);
    const ShardContext gs = embedding_grad_shard(ids_shape, wbox);
    EXPECT_THROW(run_op(local.dweight.node(), {random_array({4, kHidden}, 16), ids},
                        {wbox.shape()}, &gs),
                 Error);
  }
}

// ---- cross-entropy ----

const Shape kLogits{4, 5, kVocab};
const Shape kTargets{4, 5};
constexpr float kNorm = 11.0f;
constexpr float kDloss = 1.7f;

struct CeGraph {
  Graph g;
  Tensor loss, dlogits;
  CeGraph(const Shape& logits, int ignore) {
    Shape ts(logits.begin(), logits.end() - 1);
    Tensor l = g.placeholder("logits", sym_shape(logits), DType::F32);
    Tensor t = g.placeholder("targets", sym_shape(ts), DType::I32);
    Tensor norm = g.placeholder("norm", {}, DType::F32);
    loss = ops::cross_entropy(l, t, norm, ignore);
    Tensor dloss = g.placeholder("dloss", {}, DType::F32);
    dlogits = loss.node().op->gradient(loss.node(), {dloss, Tensor()})[0];
  }
};

// Targets spread over every shard, every fourth one `ignore`.
NDArray make_targets(int ignore) {
  std::vector<int32_t> t(shape_numel(kTargets));
  for (size_t i = 0; i < t.size(); ++i)
    t[i] = i % 4 == 1 ? ignore : static_cast<int32_t>((i * 11 + 5) % kVocab);
  return NDArray::from_vector_i32(kTargets, t);
}

// A rank's place: token chunk of dim 0 (token_ways chunks) and vocab chunk.
struct Place {
  int token_ways, vocab_ways, token_chunk, vocab_chunk;
  Place(int rank, int size, int token_ways)
      : token_ways(token_ways),
        vocab_ways(size / token_ways),
        token_chunk(rank / vocab_ways),
        vocab_chunk(rank % vocab_ways) {}
  Box logits_box() const {
    return cut(cut(whole(kLogits), 0, token_chunk, token_ways), 2, vocab_chunk, vocab_ways);
  }
  Box tokens_box() const { return cut(whole(kTargets), 0, token_chunk, token_ways); }
  std::vector<int> vocab_group() const {
    std::vector<int> members;
    for (int j = 0; j < vocab_ways; ++j) members.push_back(token_chunk * vocab_ways + j);
    return members;
  }
};

ShardContext ce_shard(const Place& p, Communicator& world) {
  const Box lbox = p.logits_box(), tbox = p.tokens_box();
  ShardContext s;
  s.input_global_shapes = {kLogits, kTargets, {}};
  s.input_boxes = {lbox, tbox, Box{}};
  s.output_global_shapes = {{}, kTargets};
  s.output_boxes = {Box{}, tbox};
  s.group_along = [&world, p](int input, int dim) -> Communicator& {
    EXPECT_EQ(input, 0);
    EXPECT_EQ(dim, 2);
    return world.group(p.vocab_group());
  };
  return s;
}

ShardContext ce_grad_shard(const Place& p) {
  const Box lbox = p.logits_box(), tbox = p.tokens_box();
  ShardContext s;
  s.input_global_shapes = {{}, kLogits, kTargets, {}, kTargets};
  s.input_boxes = {Box{}, lbox, tbox, Box{}, tbox};
  s.output_global_shapes = {kLogits};
  s.output_boxes = {lbox};
  s.group_along = [](int, int) -> Communicator& { throw InternalError("no group needed"); };
  return s;
}

void check_cross_entropy(int token_ways, int ignore) {
  Communicator& world = test_world();
  if (world.size() % token_ways != 0) GTEST_SKIP() << "world not divisible by " << token_ways;
  const Place p(world.rank(), world.size(), token_ways);
  const NDArray logits = random_array(kLogits, 21, 3.0f), targets = make_targets(ignore);
  const NDArray norm = NDArray::from_vector({}, {kNorm}), dloss = NDArray::from_vector({}, {kDloss});

  // The single-process results: on everything, and on this rank's tokens.
  CeGraph full(kLogits, ignore);
  const auto want = run_op(full.loss.node(), {logits, targets, norm}, {{}, kTargets});
  const NDArray want_grad =
      run_op(full.dlogits.node(), {dloss, logits, targets, norm, want[1]}, {kLogits})[0];
  const Box tbox = p.tokens_box(), lbox = p.logits_box();
  Box rows = whole(kLogits);
  rows.begin[0] = tbox.begin[0];
  rows.end[0] = tbox.end[0];
  CeGraph token_part(rows.shape(), ignore);
  const NDArray want_loss = run_op(token_part.loss.node(),
                                   {take(logits, rows), take(targets, tbox), norm},
                                   {{}, tbox.shape()})[0];

  CeGraph local(lbox.shape(), ignore);
  const ShardContext s = ce_shard(p, world);
  const auto got = run_op(local.loss.node(), {take(logits, lbox), take(targets, tbox), norm},
                          {{}, tbox.shape()}, &s);
  expect_close(got[0], want_loss, 1e-6, 0);
  expect_close(got[1], take(want[1], tbox), 1e-6, 0);

  // The loss is the same on every member of a vocab group, and its token
  // chunks sum to the full loss.
  std::vector<float> losses(world.size());
  world.all_gather(got[0].data<float>(), losses.data(), std::vector<int64_t>(world.size(), 1));
  for (int m : p.vocab_group()) EXPECT_EQ(losses[m], losses[world.rank()]);
  float total = 0;
  for (int c = 0; c < token_ways; ++c) total += losses[c * p.vocab_ways];
  EXPECT_NEAR(total, want[0].data<float>()[0], 1e-6 * std::abs(want[0].data<float>()[0]) * 4);

  const ShardContext gs = ce_grad_shard(p);
  const NDArray grad = run_op(local.dlogits.node(),
                              {dloss, take(logits, lbox), take(targets, tbox), norm, got[1]},
                              {lbox.shape()}, &gs)[0];
  expect_close(grad, take(want_grad, lbox), 1e-5, 1e-7);
}

TEST(VocabParallel, CrossEntropyVocabSplit) { check_cross_entropy(1, -100); }

TEST(VocabParallel, CrossEntropyIgnoreIndexInsideTheVocabulary) { check_cross_entropy(1, 5); }

TEST(VocabParallel, CrossEntropyTokensAndVocabSplit) { check_cross_entropy(2, -100); }

TEST(VocabParallel, CrossEntropyTargetOutsideGlobalVocabThrowsOnEveryRank) {
  Communicator& world = test_world();
  const Place p(world.rank(), world.size(), 1);
  CeGraph local(p.logits_box().shape(), -100);
  const ShardContext s = ce_shard(p, world);
  std::vector<int32_t> t(shape_numel(kTargets), 0);
  t[7] = static_cast<int32_t>(kVocab);
  const NDArray logits = random_array(p.logits_box().shape(), 22);
  EXPECT_THROW(run_op(local.loss.node(),
                      {logits, NDArray::from_vector_i32(kTargets, t), NDArray::from_vector({}, {1})},
                      {{}, kTargets}, &s),
               Error);
  // The group still works afterwards: nobody started a collective.
  float one = 1;
  world.group(p.vocab_group()).all_reduce(&one, 1);
  EXPECT_EQ(one, static_cast<float>(p.vocab_ways));
}

}  // namespace
}  // namespace hspmd
