// Vocab-parallel embedding and cross-entropy backward on one process: the ops
// that need no communication run every shard in turn with its ShardContext,
// and the shards are checked against the op on the whole tensors. (The
// forward cross-entropy, which talks to its vocab group, is tested under
// mpirun in test_vocab_parallel.cc.)
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

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
using testing::whole;

ShardContext no_group_context() {
  ShardContext s;
  s.group_along = [](int, int) -> Communicator& { throw InternalError("no group needed"); };
  return s;
}

class VocabShards : public ::testing::TestWithParam<int> {};

TEST_P(VocabShards, EmbeddingShardsSumToFullAndGradsAreSlices) {
  const int n = GetParam();
  const Shape weight{24, 6}, ids_shape{2, 9}, out_shape{2, 9, 6};
  std::vector<int32_t> id(18);
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<int32_t>((i * 5 + 1) % 24);
  const NDArray w = random_array(weight, 1), ids = NDArray::from_vector_i32(ids_shape, id);
  const NDArray grad = random_array(out_shape, 2);

  Graph g;
  Tensor out = ops::embedding(g.placeholder("w", sym_shape(cut(whole(weight), 0, 0, n).shape()), DType::F32),
                              g.placeholder("ids", sym_shape(ids_shape), DType::I32));
  Tensor dw = out.node().op->gradient(
      out.node(), {g.placeholder("g", sym_shape(out_shape), DType::F32)})[0];
  const NDArray want = run_op(out.node(), {w, ids}, {out_shape})[0];  // shape-agnostic compute
  const NDArray want_dw = run_op(dw.node(), {grad, ids}, {weight})[0];

  NDArray sum = NDArray::zeros(out_shape, DType::F32);
  for (int r = 0; r < n; ++r) {
    const Box wbox = cut(whole(weight), 0, r, n);
    ShardContext s = no_group_context();
    s.input_global_shapes = {weight, ids_shape};
    s.input_boxes = {wbox, whole(ids_shape)};
    s.output_global_shapes = {out_shape};
    s.output_boxes = {whole(out_shape)};
    const NDArray part = run_op(out.node(), {take(w, wbox), ids}, {out_shape}, &s)[0];
    for (int64_t i = 0; i < part.numel(); ++i) sum.data<float>()[i] += part.data<float>()[i];

    ShardContext gs = no_group_context();
    gs.input_global_shapes = {out_shape, ids_shape};
    gs.input_boxes = {whole(out_shape), whole(ids_shape)};
    gs.output_global_shapes = {weight};
    gs.output_boxes = {wbox};
    expect_equal(run_op(dw.node(), {grad, ids}, {wbox.shape()}, &gs)[0], take(want_dw, wbox));
  }
  expect_equal(sum, want);
}

TEST_P(VocabShards, CrossEntropyGradShardsAreSlicesOfTheFullGrad) {
  const int n = GetParam();
  const Shape logits_shape{3, 4, 24}, targets_shape{3, 4};
  const int ignore = -100;
  std::vector<int32_t> t(12);
  for (size_t i = 0; i < t.size(); ++i) t[i] = i % 5 == 2 ? ignore : static_cast<int32_t>((i * 7) % 24);
  const NDArray logits = random_array(logits_shape, 3, 2.0f);
  const NDArray targets = NDArray::from_vector_i32(targets_shape, t);
  const NDArray norm = NDArray::from_vector({}, {5.0f}), dloss = NDArray::from_vector({}, {0.7f});

  Graph g;
  Tensor loss = ops::cross_entropy(g.placeholder("l", sym_shape(logits_shape), DType::F32),
                                   g.placeholder("t", sym_shape(targets_shape), DType::I32),
                                   g.placeholder("n", {}, DType::F32), ignore);
  Tensor dl = loss.node().op->gradient(loss.node(), {g.placeholder("d", {}, DType::F32), Tensor()})[0];
  const auto fwd = run_op(loss.node(), {logits, targets, norm}, {{}, targets_shape});
  const NDArray want = run_op(dl.node(), {dloss, logits, targets, norm, fwd[1]}, {logits_shape})[0];

  for (int r = 0; r < n; ++r) {
    const Box lbox = cut(whole(logits_shape), 2, r, n);
    ShardContext s = no_group_context();
    s.input_global_shapes = {{}, logits_shape, targets_shape, {}, targets_shape};
    s.input_boxes = {Box{}, lbox, whole(targets_shape), Box{}, whole(targets_shape)};
    s.output_global_shapes = {logits_shape};
    s.output_boxes = {lbox};
    const NDArray got =
        run_op(dl.node(), {dloss, take(logits, lbox), targets, norm, fwd[1]}, {lbox.shape()}, &s)[0];
    expect_close(got, take(want, lbox), 1e-6, 1e-7);
  }
}

INSTANTIATE_TEST_SUITE_P(Shards, VocabShards, ::testing::Values(1, 2, 3, 4));

TEST(VocabLocal, CrossEntropyWithTheWholeVocabNeedsNoGroup) {
  const Shape logits_shape{6, 10}, targets_shape{6};
  const NDArray logits = random_array(logits_shape, 4);
  const NDArray targets = NDArray::from_vector_i32(targets_shape, {1, -100, 9, 0, 3, 3});
  const NDArray norm = NDArray::from_vector({}, {2.0f});
  Graph g;
  Tensor loss = ops::cross_entropy(g.placeholder("l", sym_shape(logits_shape), DType::F32),
                                   g.placeholder("t", sym_shape(targets_shape), DType::I32),
                                   g.placeholder("n", {}, DType::F32));
  ShardContext s = no_group_context();  // throws if the op asks for a group
  s.input_global_shapes = {logits_shape, targets_shape, {}};
  s.input_boxes = {whole(logits_shape), whole(targets_shape), Box{}};
  s.output_global_shapes = {{}, targets_shape};
  s.output_boxes = {Box{}, whole(targets_shape)};
  const auto want = run_op(loss.node(), {logits, targets, norm}, {{}, targets_shape});
  const auto got = run_op(loss.node(), {logits, targets, norm}, {{}, targets_shape}, &s);
  expect_equal(got[0], want[0]);
  expect_equal(got[1], want[1]);
}

TEST(VocabLocal, EmbeddingIdOutsideTheGlobalVocabularyThrows) {
  const Shape weight{4, 3};
  Graph g;
  Tensor out = ops::embedding(g.placeholder("w", sym_shape(weight), DType::F32),
                              g.placeholder("ids", {2}, DType::I32));
  ShardContext s = no_group_context();
  s.input_global_shapes = {{8, 3}, {2}};
  s.input_boxes = {Box{{4, 0}, {8, 3}}, whole({2})};
  s.output_global_shapes = {{2, 3}};
  s.output_boxes = {whole({2, 3})};
  const NDArray w = random_array(weight, 5);
  // Id 1 belongs to the other shard: zeros here. Id 8 is outside [0, 8).
  const NDArray y = run_op(out.node(), {w, NDArray::from_vector_i32({2}, {1, 5})}, {{2, 3}}, &s)[0];
  EXPECT_EQ(y.to_vector(), (std::vector<float>{0, 0, 0, w.data<float>()[3], w.data<float>()[4],
                                               w.data<float>()[5]}));
  EXPECT_THROW(run_op(out.node(), {w, NDArray::from_vector_i32({2}, {1, 8})}, {{2, 3}}, &s), Error);
}

}  // namespace
}  // namespace hspmd
