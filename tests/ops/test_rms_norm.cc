#include "gradcheck.h"
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

TEST(RmsNorm, WeightShapeMismatchIsAnError) {
  Graph g;
  Tensor x = g.placeholder("x", {2, 8}, DType::F32);
  Tensor w = g.parameter("w", {7});
  Tensor w2 = g.parameter("w2", {1, 8});
  EXPECT_THROW(ops::rms_norm(x, w, 1e-5f), Error);
  EXPECT_THROW(ops::rms_norm(x, w2, 1e-5f), Error);
}

}  // namespace
}  // namespace hspmd
