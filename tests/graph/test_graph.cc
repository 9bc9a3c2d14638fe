#include <gtest/gtest.h>

#include "hspmd/core/error.h"
#include "hspmd/graph/executor.h"
#include "hspmd/graph/op.h"
#include "hspmd/ops/autodiff.h"
#include "hspmd/ops/ops.h"

namespace hspmd {
namespace {

TEST(SymDim, ProductsDivisionAndEvaluation) {
  SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
  SymDim n = B * S * 4;
  EXPECT_EQ(n.str(), "4*B*S");
  EXPECT_EQ(n.eval({{"B", 2}, {"S", 3}}), 24);
  EXPECT_EQ(n.divide(S), B * 4);
  EXPECT_THROW(n.divide(SymDim(3)), Error);
  EXPECT_THROW(n.eval({{"B", 2}}), Error);
}

TEST(Executor, BindsSymbolsFromFeedsAndChecksThem) {
  Graph g;
  SymDim B = SymDim::symbol("B");
  Tensor a = g.placeholder("a", {B, 2}, DType::F32);
  Tensor b = g.placeholder("b", {B, 2}, DType::F32);
  Executor ex(g, {ops::add(a, b)});
  NDArray x = NDArray::from_vector({3, 2}, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(ex.run({{"a", x}, {"b", x}})[0].to_vector(),
            (std::vector<float>{2, 4, 6, 8, 10, 12}));
  NDArray y = NDArray::from_vector({2, 2}, {1, 2, 3, 4});
  EXPECT_EQ(ex.run({{"a", y}, {"b", y}})[0].shape(), (Shape{2, 2}));  // rebinding per run
  EXPECT_THROW(ex.run({{"a", x}, {"b", y}}), Error);                  // B = 3 vs 2
  EXPECT_THROW(ex.run({{"a", x}}), Error);                            // b missing
  EXPECT_THROW(ex.run({{"a", NDArray::from_vector({3, 1}, {1, 2, 3})}, {"b", x}}), Error);
}

TEST(Autodiff, SumsGradientsOfSeveralPathsAndSkipsUnrelatedInputs) {
  Graph g;
  Tensor x = g.placeholder("x", {2}, DType::F32);
  Tensor w = g.parameter("w", {2});
  Tensor u = g.parameter("unused", {2});
  // loss = sum(x*w + w*w)  => d/dw = x + 2w
  Tensor loss = ops::reduce_sum(ops::add(ops::mul(x, w), ops::mul(w, w)));
  auto grads = gradients(loss, {w, u});
  ASSERT_TRUE(grads[0].valid());
  EXPECT_FALSE(grads[1].valid());
  NDArray out = Executor(g, {grads[0]}).run({{"x", NDArray::from_vector({2}, {1, 2})},
                                              {"w", NDArray::from_vector({2}, {3, 5})}})[0];
  EXPECT_EQ(out.to_vector(), (std::vector<float>{7, 12}));
  EXPECT_THROW(gradients(ops::add(x, w), {w}), Error);  // not a scalar
}

TEST(Graph, LeafPredicatesFollowTheOpNotTheName) {
  Graph g;
  Tensor x = g.placeholder("parameter", {2}, DType::F32);  // names do not matter
  Tensor w = g.parameter("placeholder", {2});
  Tensor y = ops::add(x, w);
  EXPECT_TRUE(is_placeholder(x.node()));
  EXPECT_FALSE(is_parameter(x.node()));
  EXPECT_TRUE(is_parameter(w.node()));
  EXPECT_FALSE(is_placeholder(w.node()));
  EXPECT_TRUE(is_leaf(x.node()) && is_leaf(w.node()));
  EXPECT_FALSE(is_leaf(y.node()) || is_parameter(y.node()) || is_placeholder(y.node()));
  EXPECT_EQ(x.node().op->type(), "placeholder");  // type() stays for reports
  EXPECT_EQ(w.node().op->type(), "parameter");
}

TEST(Graph, DuplicateLeafNamesAndUnknownNamesAreErrors) {
  Graph g;
  g.parameter("w", {2});
  EXPECT_THROW(g.parameter("w", {3}), Error);
  EXPECT_THROW(g.find("nope"), Error);
}

}  // namespace
}  // namespace hspmd
