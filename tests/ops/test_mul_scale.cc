#include "gradcheck.h"
#include "hspmd/ops/ops.h"

namespace hspmd {
namespace {

using testing::expect_gradients_match;
using testing::random_array;

TEST(Mul, ForwardAndGradient) {
  NDArray a = random_array({3, 4}, 1), b = random_array({3, 4}, 2);
  Graph g;
  Tensor ta = g.placeholder("a", {3, 4}, DType::F32), tb = g.placeholder("b", {3, 4}, DType::F32);
  NDArray out = Executor(g, {ops::mul(ta, tb)}).run({{"a", a}, {"b", b}})[0];
  for (int i = 0; i < 12; ++i)
    EXPECT_FLOAT_EQ(out.data<float>()[i], a.data<float>()[i] * b.data<float>()[i]);
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& x) { return ops::mul(x[0], ops::mul(x[0], x[1])); },
      {{"a", a}, {"b", b}});
}

TEST(Mul, ShapeMismatchIsAnError) {
  Graph g;
  Tensor ta = g.placeholder("a", {3, 4}, DType::F32), tb = g.placeholder("b", {4, 3}, DType::F32);
  EXPECT_THROW(ops::mul(ta, tb), Error);
}

TEST(Scale, ForwardAndGradient) {
  NDArray a = random_array({2, 5}, 3);
  Graph g;
  Tensor ta = g.placeholder("a", {2, 5}, DType::F32);
  NDArray out = Executor(g, {ops::scale(ta, -2.5f)}).run({{"a", a}})[0];
  for (int i = 0; i < 10; ++i) EXPECT_FLOAT_EQ(out.data<float>()[i], a.data<float>()[i] * -2.5f);
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& x) { return ops::scale(x[0], 0.75f); }, {{"a", a}});
}

}  // namespace
}  // namespace hspmd
