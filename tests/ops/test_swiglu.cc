#include "gradcheck.h"
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

}  // namespace
}  // namespace hspmd
