#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "hspmd/core/device.h"
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

// Name lookups and reader lists are kept as nodes are added (no scan of the
// graph: building a model was quadratic in its layers, issue 39 item 6).
TEST(Graph, FindsLeavesByNameAndListsReaders) {
  Graph g;
  Tensor x = g.placeholder("x", {2}, DType::F32);
  Tensor w = g.parameter("w", {2});
  Tensor shadow = g.parameter("x", {2});  // a parameter named like a placeholder: find() prefers it
  EXPECT_EQ(g.find("w"), w);
  EXPECT_EQ(g.find("x"), shadow);
  EXPECT_THROW(g.parameter("w", {2}), Error);
  EXPECT_THROW(g.placeholder("x", {2}, DType::F32), Error);
  try {
    g.find("nope");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "[graph] no placeholder or parameter named 'nope'");
  }
  Tensor sq = ops::mul(x, x);    // reads x twice
  Tensor y = ops::add(sq, w);
  Tensor z = ops::add(x, y);
  EXPECT_EQ(g.readers(x), (std::vector<int>{sq.node_id(), sq.node_id(), z.node_id()}));
  EXPECT_EQ(g.readers(w), (std::vector<int>{y.node_id()}));
  EXPECT_EQ(g.readers(sq), (std::vector<int>{y.node_id()}));
  EXPECT_TRUE(g.readers(z).empty());
  EXPECT_TRUE(g.readers(shadow).empty());
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

// A chain of adds holds at most the array being read and the one being
// written: each intermediate is freed after its last consumer.
TEST(Executor, PeakIsTheLiveSetNotTheGraph) {
  Graph g;
  Tensor x = g.placeholder("x", {1024}, DType::F32);
  Tensor y = x;
  for (int i = 0; i < 8; ++i) y = ops::add(y, y);
  const NDArray fed = NDArray::from_vector({1024}, std::vector<float>(1024, 1.0f));
  Allocator& memory = allocator_for(Device::cpu());
  const size_t base = memory.current_bytes();
  memory.reset_peak();
  const NDArray out = Executor(g, {y}).run({{"x", fed}})[0];
  EXPECT_EQ(out.data<float>()[0], 256.0f);
  EXPECT_EQ(memory.peak_bytes() - base, 2 * 1024 * sizeof(float));
  EXPECT_EQ(memory.current_bytes() - base, 1024 * sizeof(float));  // the fetch
}

// The loop both executors share: values are released after their last
// counted read, an output nothing reads at once, a kept one never; an input
// from a node without slots arrives invalid.
TEST(RunNodes, ReleasesAfterTheLastCountedRead) {
  Graph g;
  Tensor x = g.placeholder("x", {2}, DType::F32);
  Tensor y = ops::add(x, x);  // read by z and w
  Tensor z = ops::add(y, x);  // read by w
  Tensor u = ops::add(x, x);  // read by nothing
  Tensor w = ops::add(z, y);  // kept
  const std::vector<int> ids = {x.node_id(), y.node_id(), z.node_id(), u.node_id(), w.node_id()};
  UseCounts uses = count_consumers(g, ids, {ids});
  EXPECT_EQ(uses[x.node_id()], std::vector<int>{5});
  EXPECT_EQ(uses[y.node_id()], std::vector<int>{2});
  keep_value(uses, w);
  NodeValues values{std::vector<std::vector<NDArray>>(g.num_nodes()), uses};
  auto live = [&](const Tensor& t) { return values.slots[t.node_id()][t.index()].valid(); };
  std::vector<std::string> seen;  // after each node: which of x y z u are live
  NodeRunner runner;
  runner.leaf = [](const Node&) { return std::vector<NDArray>{NDArray::from_vector({2}, {1, 2})}; };
  runner.compute = [](const Node& n, const std::vector<NDArray>& inputs) {
    OpContext ctx;
    ctx.stream = &default_stream(Device::cpu());
    ctx.out_shapes = {{2}};
    ctx.out_dtypes = {DType::F32};
    return run_op(n, ctx, inputs);
  };
  runner.after = [&](const Node&) {
    std::string s;
    for (const Tensor& t : {x, y, z, u})
      s += values.slots[t.node_id()].empty() ? '-' : live(t) ? '1' : '0';
    seen.push_back(s);
  };
  run_nodes(g, ids, values, runner);
  EXPECT_EQ(seen, (std::vector<std::string>{"11--", "111-", "1110", "0110"}));
  EXPECT_FALSE(live(x) || live(y) || live(z) || live(u));
  EXPECT_EQ(values.slots[w.node_id()][0].to_vector(), (std::vector<float>{5, 10}));

  NodeValues alone{std::vector<std::vector<NDArray>>(g.num_nodes()),
                   count_consumers(g, std::vector<int>{y.node_id()}, {})};
  runner.after = nullptr;
  runner.compute = [](const Node& n, const std::vector<NDArray>& inputs) {
    EXPECT_FALSE(inputs[0].valid() || inputs[1].valid());
    return std::vector<NDArray>(n.outputs.size());
  };
  run_nodes(g, std::vector<int>{y.node_id()}, alone, runner);
  EXPECT_TRUE(alone.slots[x.node_id()].empty());
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
