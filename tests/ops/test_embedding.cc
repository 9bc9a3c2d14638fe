#include "gradcheck.h"
#include "hspmd/ops/ops.h"

namespace hspmd {
namespace {

using testing::expect_gradients_match;
using testing::random_array;

TEST(Embedding, ForwardPicksRows) {
  NDArray w = random_array({5, 3}, 1);
  NDArray ids = NDArray::from_vector_i32({2, 3}, {0, 4, 2, 2, 1, 0});
  Graph g;
  Tensor tw = g.parameter("w", {5, 3});
  Tensor ti = g.placeholder("ids", {SymDim::symbol("B"), 3}, DType::I32);
  Tensor y = ops::embedding(tw, ti);
  EXPECT_EQ(y.shape(), (SymShape{SymDim::symbol("B"), 3, 3}));
  NDArray out = Executor(g, {y}).run({{"w", w}, {"ids", ids}})[0];
  ASSERT_EQ(out.shape(), (Shape{2, 3, 3}));
  for (int t = 0; t < 6; ++t)
    for (int h = 0; h < 3; ++h)
      EXPECT_EQ(out.data<float>()[t * 3 + h], w.data<float>()[ids.data<int32_t>()[t] * 3 + h]);
}

TEST(Embedding, GradientAccumulatesRepeatedIds) {
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& x) { return ops::embedding(x[0], x[1]); },
      {{"w", random_array({5, 3}, 2)},
       {"ids", NDArray::from_vector_i32({2, 3}, {0, 4, 2, 2, 1, 0}), false}});
}

TEST(Embedding, WideGradientMatchesNaiveScatter) {
  const int64_t vocab = 7, hidden = 150, tokens = 400;
  std::vector<int32_t> idv(tokens);
  for (int64_t t = 0; t < tokens; ++t) idv[t] = static_cast<int32_t>((t * 5 + t / 3) % vocab);
  NDArray ids = NDArray::from_vector_i32({tokens}, idv);
  NDArray dy = random_array({tokens, hidden}, 3);
  Graph g;
  Tensor w = g.parameter("w", {vocab, hidden});
  Tensor ti = g.placeholder("ids", {tokens}, DType::I32);
  Tensor gy = g.placeholder("dy", {tokens, hidden}, DType::F32);
  Tensor loss = ops::reduce_sum(ops::mul(ops::embedding(w, ti), gy));
  Tensor dw = gradients(loss, {w})[0];
  NDArray out = Executor(g, {dw}).run(
      {{"w", random_array({vocab, hidden}, 4)}, {"ids", ids}, {"dy", dy}})[0];
  std::vector<double> want(vocab * hidden, 0.0);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h)
      want[idv[t] * hidden + h] += dy.data<float>()[t * hidden + h];
  for (int64_t i = 0; i < vocab * hidden; ++i) EXPECT_NEAR(out.data<float>()[i], want[i], 1e-4);
}

TEST(Embedding, OutOfRangeIdIsAnError) {
  Graph g;
  Tensor tw = g.parameter("w", {5, 3});
  Tensor ti = g.placeholder("ids", {2, 3}, DType::I32);
  Tensor y = ops::embedding(tw, ti);
  NDArray ids = NDArray::from_vector_i32({2, 3}, {0, 4, 2, 2, 5, 0});
  try {
    Executor(g, {y}).run({{"w", random_array({5, 3}, 1)}, {"ids", ids}});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "[embedding] token id 5 at position 4 is outside the vocabulary [0, 5)");
  }
  ids.data<int32_t>()[4] = -1;
  EXPECT_THROW(Executor(g, {y}).run({{"w", random_array({5, 3}, 1)}, {"ids", ids}}), Error);
}

TEST(Embedding, BadInputsAreErrors) {
  Graph g;
  Tensor w = g.parameter("w", {5, 3});
  Tensor fids = g.placeholder("fids", {4}, DType::F32);
  Tensor w3 = g.parameter("w3", {5, 3, 1});
  Tensor ids = g.placeholder("ids", {4}, DType::I32);
  EXPECT_THROW(ops::embedding(w, fids), Error);
  EXPECT_THROW(ops::embedding(w3, ids), Error);
}

}  // namespace
}  // namespace hspmd
