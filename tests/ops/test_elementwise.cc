#include "gradcheck.h"
#include "hspmd/ops/ops.h"

namespace hspmd {
namespace {

using testing::expect_gradients_match;
using testing::random_array;

TEST(Add, ForwardAndGradient) {
  NDArray a = random_array({3, 4}, 1), b = random_array({3, 4}, 2);
  Graph g;
  Tensor ta = g.placeholder("a", {3, 4}, DType::F32), tb = g.placeholder("b", {3, 4}, DType::F32);
  NDArray out = Executor(g, {ops::add(ta, tb)}).run({{"a", a}, {"b", b}})[0];
  for (int i = 0; i < 12; ++i)
    EXPECT_FLOAT_EQ(out.data<float>()[i], a.data<float>()[i] + b.data<float>()[i]);
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& x) { return ops::add(x[0], ops::add(x[0], x[1])); },
      {{"a", a}, {"b", b}});
}

TEST(Add, ShapeMismatchIsAnError) {
  Graph g;
  Tensor ta = g.placeholder("a", {3, 4}, DType::F32), tb = g.placeholder("b", {4, 3}, DType::F32);
  EXPECT_THROW(ops::add(ta, tb), Error);
}

}  // namespace
}  // namespace hspmd
