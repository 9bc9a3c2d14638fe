// Annotation deduction: the engine (leaves, reshards, device checks), every
// op's rule on both tiers, its error paths, and the annotated backward graph.
#include <gtest/gtest.h>

#include <functional>

#include "hspmd/annotation/deduce.h"
#include "hspmd/core/error.h"
#include "hspmd/graph/autodiff.h"
#include "hspmd/graph/op.h"
#include "hspmd/models/llama.h"
#include "hspmd/ops/ops.h"

namespace hspmd {

void PrintTo(const Annotation& a, std::ostream* os) { *os << to_string(a); }
void PrintTo(const DistStates& s, std::ostream* os) { *os << to_string(s); }

namespace {

using Plan = std::map<std::string, Annotation>;
const SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
constexpr int kP = kPartial;

// States with an explicit order.
DistStates ds(std::map<int, int> degrees, std::vector<int> order) {
  return DistStates{std::move(degrees), std::move(order)};
}

// One subgroup over `ranks`.
Annotation on(std::vector<int> ranks, std::map<int, int> degrees = {},
              std::vector<int> order = {}) {
  return Annotation{
      {Subgroup{DeviceGroup{std::move(ranks)}, ds(std::move(degrees), std::move(order))}}};
}

Subgroup sub(std::vector<int> ranks, std::map<int, int> degrees = {}, std::vector<int> order = {}) {
  return Subgroup{DeviceGroup{std::move(ranks)}, ds(std::move(degrees), std::move(order))};
}

Annotation hetero(std::vector<Subgroup> groups, int hdim, std::vector<int64_t> weights = {}) {
  return Annotation{std::move(groups), hdim, std::move(weights)};
}

// The message of the hspmd::Error `f` throws ("" when it throws none).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Expects deduce() to throw one line containing every piece of `parts`.
void expect_error(const Graph& g, const Plan& plan, int world, std::vector<std::string> parts) {
  const std::string msg = error_of([&] { deduce(g, plan, world); });
  ASSERT_FALSE(msg.empty()) << "no error; expected " << parts[0];
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  for (const auto& p : parts)
    EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
}

// The first node of `type` after node `after`.
const Node& find_node(const Graph& g, const std::string& type, int after = -1) {
  for (int id = after + 1; id < g.num_nodes(); ++id)
    if (g.node(id).op->type() == type) return g.node(id);
  throw std::runtime_error("no node of type " + type);
}

// ---- engine ----

TEST(Deduce, LeavesComeFromThePlan) {
  Graph g;
  Tensor x = g.placeholder("x", {B, 4}, DType::F32);
  Tensor w = g.parameter("w", {4, 4});
  Plan plan{{"x", on({0, 1}, {{0, 2}}, {0})}, {"w", on({0, 1}, {{kDup, 2}}, {kDup})}};
  AnnotatedGraph ag = deduce(g, plan, 2);
  EXPECT_EQ(ag.of(x), plan["x"]);
  EXPECT_EQ(ag.of(w), plan["w"]);
  EXPECT_TRUE(ag.has(w));
  EXPECT_EQ(&ag.graph(), &g);
}

TEST(Deduce, MissingPlanAnnotationIsAnError) {
  Graph g;
  g.placeholder("x", {B, 4}, DType::F32);
  g.parameter("w", {4, 4});
  expect_error(g, {{"x", on({0})}}, 1, {"[deduce] tensor 'w' has no annotation in the plan"});
}

TEST(Deduce, PlanAnnotationsAreValidated) {
  Graph g;
  g.parameter("w", {4, 4});
  expect_error(g, {{"w", on({0, 1}, {{kP, 2}}, {kP})}}, 2,
               {"[annotation] tensor 'w'", "cannot be partial"});
  expect_error(g, {{"w", on({0, 5})}}, 2, {"[annotation] tensor 'w'"});
}

TEST(Deduce, KnownSizesMustDivide) {
  Graph g;
  g.parameter("w", {6, 4});
  expect_error(g, {{"w", on({0, 1, 2, 3}, {{0, 4}}, {0})}}, 4,
               {"[deduce] tensor 'w'", "splits dim 0 (size 6) by 4"});
  Graph h;
  h.placeholder("x", {5, B}, DType::F32);
  expect_error(h, {{"x", hetero({sub({0}), sub({1})}, 0, {1, 1})}}, 2,
               {"tensor 'x'", "proportions [1, 1]"});
}

TEST(Deduce, InputsOnDifferentSubgroupsNeedAReshard) {
  Graph g;
  Tensor a = g.placeholder("a", {B, 4}, DType::F32);
  Tensor b = g.placeholder("b", {B, 4}, DType::F32);
  ops::add(a, b);
  expect_error(g, {{"a", on({0, 1}, {{kDup, 2}}, {kDup})}, {"b", on({2, 3}, {{kDup, 2}}, {kDup})}},
               4,
               {"[deduce] op 'add' (node 2): inputs 0 and 1 live on different subgroups",
                "insert a Reshard"});
  // Same devices in another order are other positions: also a Reshard.
  expect_error(g, {{"a", on({0, 1}, {{kDup, 2}}, {kDup})}, {"b", on({1, 0}, {{kDup, 2}}, {kDup})}},
               2, {"live on different subgroups"});
}

// ---- DimRule, the einsum-style rule most ops use ----

// An op whose deduction is a given DimRule (one output of shape `out`).
class RuleOp final : public Op {
 public:
  RuleOp(DimRule rule, SymShape out) : rule_(std::move(rule)), out_(std::move(out)) {}
  std::string type() const override { return "rule_op"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>&) const override {
    return {TensorMeta{out_, DType::F32}};
  }
  void compute(const OpContext&, const std::vector<NDArray>&,
               std::vector<NDArray>&) const override {}
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    return deduce_by_dims(ctx, rule_, in);
  }

 private:
  DimRule rule_;
  SymShape out_;
};

TEST(DeduceDimRule, WhatAnOutputDoesWithALabelItLacks) {
  const Annotation x = on({0, 1, 2, 3}, {{0, 2}, {1, 2}}, {0, 1});
  auto run = [&](Reduction r) {
    Graph g;
    Tensor in = g.placeholder("x", {B, 4}, DType::F32);
    DimRule rule{.inputs = {{"t", "v"}}, .outputs = {{"t"}}};
    rule.reductions["v"] = r;
    Tensor y = g.add1(std::make_shared<RuleOp>(rule, SymShape{B}), {in});
    return deduce(g, {{"x", x}}, 4).of(y);
  };
  EXPECT_EQ(run(Reduction::kSum), on({0, 1, 2, 3}, {{0, 2}, {kP, 2}}, {0, kP}));
  EXPECT_EQ(run(Reduction::kCollective), on({0, 1, 2, 3}, {{0, 2}, {kDup, 2}}, {0, kDup}));
  const std::string msg = error_of([&] { run(Reduction::kForbidden); });
  EXPECT_NE(
      msg.find("op 'rule_op' (node 1): input 0 is split along dim 1, which output 0 does not keep"),
      std::string::npos)
      << msg;
}

TEST(DeduceDimRule, UnsplittableOnBothTiers) {
  Graph g;
  Tensor x = g.placeholder("x", {B, 4}, DType::F32);
  Tensor w = g.parameter("w", {4});
  ops::rms_norm(x, w, 1e-6f);
  expect_error(
      g, {{"x", hetero({sub({0}), sub({1})}, 1)}, {"w", hetero({sub({0}), sub({1})}, kDup)}}, 2,
      {"input 0 (x) is split along dim 1 across subgroups, but rms_norm normalizes over it"});
}

// ---- elementwise (the default rule) ----

TEST(Deduce, ElementwiseCopiesAndLinearOpsKeepPartial) {
  Graph g;
  Tensor a = g.placeholder("a", {B, 4}, DType::F32);
  Tensor b = g.placeholder("b", {B, 4}, DType::F32);
  Tensor sum = ops::add(a, b);
  Tensor scaled = ops::scale(sum, 2.0f);
  const Annotation p = on({0, 1}, {{kP, 2}}, {kP});
  AnnotatedGraph ag = deduce(g, {{"a", p}, {"b", p}}, 2);
  EXPECT_EQ(ag.of(sum), p);
  EXPECT_EQ(ag.of(scaled), p);
}

TEST(Deduce, ElementwiseNeedsIdenticalLayouts) {
  Graph g;
  Tensor a = g.placeholder("a", {B, 4}, DType::F32);
  Tensor b = g.placeholder("b", {B, 4}, DType::F32);
  ops::add(a, b);
  expect_error(g, {{"a", on({0, 1}, {{kP, 2}}, {kP})}, {"b", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2,
               {"op 'add' (node 2): inputs 0 and 1 are sharded differently", "insert a Reshard"});
}

TEST(Deduce, NonlinearOpWithPartialInputNeedsAReshard) {
  Graph g;
  Tensor a = g.placeholder("a", {B, 4}, DType::F32);
  ops::swiglu(a, a);
  expect_error(
      g, {{"a", on({0, 1}, {{kP, 2}}, {kP})}}, 2,
      {"[deduce] op 'swiglu' (node 1): input 0 is partial; insert a Reshard to reduce it first"});
  Graph h;
  Tensor c = h.placeholder("c", {B, 4}, DType::F32);
  ops::swiglu(c, c);
  expect_error(h, {{"c", hetero({sub({0}), sub({1})}, kP)}}, 2, {"input 0 is partial"});
}

TEST(Deduce, MulIsBilinear) {
  Graph g;
  Tensor a = g.placeholder("a", {B, 4}, DType::F32);
  Tensor b = g.placeholder("b", {B, 4}, DType::F32);
  Tensor y = ops::mul(a, b);
  AnnotatedGraph ag =
      deduce(g, {{"a", on({0, 1}, {{kP, 2}}, {kP})}, {"b", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2);
  EXPECT_EQ(ag.of(y), on({0, 1}, {{kP, 2}}, {kP}));
  expect_error(g, {{"a", on({0, 1}, {{kP, 2}}, {kP})}, {"b", on({0, 1}, {{kP, 2}}, {kP})}}, 2,
               {"inputs 0 and 1 are both partial"});
  expect_error(g, {{"a", on({0, 1}, {{0, 2}}, {0})}, {"b", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2,
               {"input 0 (a) splits dim 0 by 2 but input 1 (b) splits dim 0 by 1"});
}

// ---- matmul / linear ----

struct Linear {
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 4}, DType::F32);
  Tensor w = g.parameter("w", {8, 4});
  Tensor y = ops::linear(x, w);
};

TEST(DeduceMatmul, ColumnParallelSplitsTheOutput) {
  Linear m;
  AnnotatedGraph ag =
      deduce(m.g, {{"x", on({0, 1}, {{kDup, 2}}, {kDup})}, {"w", on({0, 1}, {{0, 2}}, {0})}}, 2);
  EXPECT_EQ(ag.of(m.y), on({0, 1}, {{2, 2}}, {2}));
}

TEST(DeduceMatmul, RowParallelGivesPartial) {
  Linear m;
  AnnotatedGraph ag =
      deduce(m.g, {{"x", on({0, 1}, {{2, 2}}, {2})}, {"w", on({0, 1}, {{1, 2}}, {1})}}, 2);
  EXPECT_EQ(ag.of(m.y), on({0, 1}, {{kP, 2}}, {kP}));
}

TEST(DeduceMatmul, BatchAndSequenceSplitsPassThrough) {
  Linear m;
  // DP 2 x TP 2: x batch-split over the slow digit, w column-split over the fast one.
  AnnotatedGraph ag = deduce(m.g,
                             {{"x", on({0, 1, 2, 3}, {{0, 2}, {kDup, 2}}, {0, kDup})},
                              {"w", on({0, 1, 2, 3}, {{kDup, 2}, {0, 2}}, {kDup, 0})}},
                             4);
  EXPECT_EQ(ag.of(m.y), on({0, 1, 2, 3}, {{0, 2}, {2, 2}}, {0, 2}));
  AnnotatedGraph cp =
      deduce(m.g, {{"x", on({0, 1}, {{1, 2}}, {1})}, {"w", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2);
  EXPECT_EQ(cp.of(m.y), on({0, 1}, {{1, 2}}, {1}));
}

TEST(DeduceMatmul, PartialInOneOperandIsLinear) {
  Linear m;
  AnnotatedGraph ag =
      deduce(m.g, {{"x", on({0, 1}, {{kP, 2}}, {kP})}, {"w", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2);
  EXPECT_EQ(ag.of(m.y), on({0, 1}, {{kP, 2}}, {kP}));
}

TEST(DeduceMatmul, PartialInBothOperandsIsAnError) {
  Graph g;
  Tensor a = g.placeholder("a", {B, 4}, DType::F32);
  Tensor b = g.placeholder("b", {4, 4}, DType::F32);
  ops::matmul(a, b);
  expect_error(g, {{"a", on({0, 1}, {{kP, 2}}, {kP})}, {"b", on({0, 1}, {{kP, 2}}, {kP})}}, 2,
               {"op 'matmul' (node 2): inputs 0 and 1 are both partial"});
}

TEST(DeduceMatmul, ContractedDimSplitInOneOperandOnlyIsAnError) {
  Linear m;
  expect_error(
      m.g, {{"x", on({0, 1}, {{2, 2}}, {2})}, {"w", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2,
      {"input 0 (a) splits dim 2 by 2 but input 1 (b) splits dim 1 by 1", "insert a Reshard"});
}

TEST(DeduceMatmul, InconsistentDeviceOrdersAreErrors) {
  Linear m;
  // K split on the slow digit of x but on the fast digit of w.
  expect_error(m.g,
               {{"x", on({0, 1, 2, 3}, {{2, 2}, {kDup, 2}}, {2, kDup})},
                {"w", on({0, 1, 2, 3}, {{1, 2}, {kDup, 2}}, {kDup, 1})}},
               4, {"inputs 0 and 1 order their devices differently", "position 1"});
  // Batch and output columns on the same digit: devices would hold chunks
  // (0, 0) and (1, 1) only.
  expect_error(m.g, {{"x", on({0, 1}, {{0, 2}}, {0})}, {"w", on({0, 1}, {{0, 2}}, {0})}}, 2,
               {"do not combine into one layout of output 0"});
}

TEST(DeduceMatmul, WeightGradientOverSplitTokensIsPartial) {
  Graph g;
  Tensor dy = g.placeholder("dy", {B, S, 8}, DType::F32);
  Tensor x = g.placeholder("x", {B, S, 4}, DType::F32);
  Tensor dw = ops::matmul(dy, x, true, false);  // [8, 4]
  // batch split (data parallel) and sequence split (context parallel)
  for (int d : {0, 1}) {
    const Annotation a = on({0, 1}, {{d, 2}}, {d});
    AnnotatedGraph ag = deduce(g, {{"dy", a}, {"x", a}}, 2);
    EXPECT_EQ(ag.of(dw), on({0, 1}, {{kP, 2}}, {kP})) << "split dim " << d;
  }
  // column-parallel dy: the gradient is split like the weight
  AnnotatedGraph col =
      deduce(g, {{"dy", on({0, 1}, {{2, 2}}, {2})}, {"x", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2);
  EXPECT_EQ(col.of(dw), on({0, 1}, {{0, 2}}, {0}));
  // tokens cut 3:1 across two subgroups: partial across them
  const Annotation top = hetero({sub({0}), sub({1})}, 0, {3, 1});
  AnnotatedGraph ag = deduce(g, {{"dy", top}, {"x", top}}, 2);
  EXPECT_EQ(ag.of(dw).hdim, kPartial);
  EXPECT_TRUE(ag.of(dw).part_weights.empty());
}

TEST(DeduceMatmul, FlattenedTokensAgainstATwoDimOperand) {
  Graph g;
  Tensor a = g.placeholder("a", {B, S, 8}, DType::F32);
  Tensor b = g.placeholder("b", {B * S, 4}, DType::F32);
  Tensor y = ops::matmul(a, b, true, false);
  AnnotatedGraph ag =
      deduce(g, {{"a", on({0, 1}, {{0, 2}}, {0})}, {"b", on({0, 1}, {{0, 2}}, {0})}}, 2);
  EXPECT_EQ(ag.of(y), on({0, 1}, {{kP, 2}}, {kP}));
  expect_error(g, {{"a", on({0, 1}, {{1, 2}}, {1})}, {"b", on({0, 1}, {{0, 2}}, {0})}}, 2,
               {"only a's dim 0 may be split"});
}

// ---- both tiers ----

TEST(DeduceTopTier, SubgroupsWithDifferentTensorParallelDegrees) {
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 4}, DType::F32);
  Tensor w1 = g.parameter("w1", {8, 4});
  Tensor w2 = g.parameter("w2", {4, 8});
  Tensor h = ops::linear(x, w1);
  Tensor y = ops::linear(h, w2);
  // Pipeline 0 (TP 2 on ranks 0, 1) takes 3/4 of the batch, pipeline 1 (rank 2) 1/4.
  Plan plan{{"x", hetero({sub({0, 1}, {{kDup, 2}}, {kDup}), sub({2})}, 0, {3, 1})},
            {"w1", hetero({sub({0, 1}, {{0, 2}}, {0}), sub({2})}, kDup)},
            {"w2", hetero({sub({0, 1}, {{1, 2}}, {1}), sub({2})}, kDup)}};
  AnnotatedGraph ag = deduce(g, plan, 3);
  EXPECT_EQ(ag.of(h), hetero({sub({0, 1}, {{2, 2}}, {2}), sub({2})}, 0, {3, 1}));
  EXPECT_EQ(ag.of(y), hetero({sub({0, 1}, {{kP, 2}}, {kP}), sub({2})}, 0, {3, 1}));
}

TEST(DeduceTopTier, MismatchedPartWeightsAreAnError) {
  Graph g;
  Tensor a = g.placeholder("a", {B, 4}, DType::F32);
  Tensor b = g.placeholder("b", {B, 4}, DType::F32);
  ops::mul(a, b);
  expect_error(
      g, {{"a", hetero({sub({0}), sub({1})}, 0, {3, 1})}, {"b", hetero({sub({0}), sub({1})}, 0)}},
      2, {"different proportions [3, 1] vs [1, 1]"});
  AnnotatedGraph ag = deduce(
      g, {{"a", hetero({sub({0}), sub({1})}, 0, {2, 2})}, {"b", hetero({sub({0}), sub({1})}, 0)}},
      2);
  EXPECT_EQ(ag.of(Tensor(&g, 2, 0)).hdim, 0);
}

TEST(DeduceTopTier, SplitAcrossSubgroupsMustMatchAcrossInputs) {
  Linear m;
  expect_error(m.g,
               {{"x", hetero({sub({0}), sub({1})}, 2)}, {"w", hetero({sub({0}), sub({1})}, kDup)}},
               2, {"splits dim 2 by 2 but", "across subgroups"});
}

// ---- layout ops ----

TEST(DeduceReshape, SplitHeadsMapToTheOuterFactor) {
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 8}, DType::F32);
  Tensor heads = ops::reshape(x, {B, S, 4, 2});
  Tensor back = ops::reshape(heads, {B, S, 8});
  AnnotatedGraph ag = deduce(g, {{"x", on({0, 1}, {{2, 2}}, {2})}}, 2);
  EXPECT_EQ(ag.of(heads), on({0, 1}, {{2, 2}}, {2}));
  EXPECT_EQ(ag.of(back), on({0, 1}, {{2, 2}}, {2}));
  // 8 = 2 x 4 split 4 ways: 4 does not divide the outer factor 2.
  Graph h;
  Tensor y = h.placeholder("y", {B, 8}, DType::F32);
  ops::reshape(y, {B, 2, 4});
  expect_error(h, {{"y", on({0, 1, 2, 3}, {{1, 4}}, {1})}}, 4,
               {"output dim 1", "has size 2", "does not divide"});
}

TEST(DeduceReshape, MergingTokensKeepsTheBatchSplit) {
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 4}, DType::F32);
  Tensor flat = ops::reshape(x, {B * S, 4});
  AnnotatedGraph ag = deduce(g, {{"x", on({0, 1, 2, 3}, {{0, 2}, {kP, 2}}, {kP, 0})}}, 4);
  EXPECT_EQ(ag.of(flat), on({0, 1, 2, 3}, {{0, 2}, {kP, 2}}, {kP, 0}));
  // top tier: the 3:1 batch cut survives the flattening
  AnnotatedGraph top =
      deduce(g, {{"x", hetero({sub({0, 1}, {{2, 2}}, {2}), sub({2})}, 0, {3, 1})}}, 3);
  EXPECT_EQ(top.of(flat), hetero({sub({0, 1}, {{1, 2}}, {1}), sub({2})}, 0, {3, 1}));
  // a sequence split is not contiguous in B*S
  expect_error(g, {{"x", on({0, 1}, {{1, 2}}, {1})}}, 2,
               {"op 'reshape'", "merges it under dim 0", "not contiguous"});
  expect_error(g, {{"x", hetero({sub({0}), sub({1})}, 1)}}, 2,
               {"across subgroups", "not contiguous"});
}

TEST(DeduceReshape, UnmatchableDimsAreAnError) {
  Graph g;
  Tensor x = g.placeholder("x", {B, 6}, DType::F32);
  ops::reshape(x, {2, B * 3});
  expect_error(g, {{"x", on({0})}}, 1, {"cannot match the dims"});
}

TEST(DeduceLayout, TransposeSwapsSplits) {
  Graph g;
  Tensor x = g.placeholder("x", {B, 4, 6}, DType::F32);
  Tensor t = ops::transpose(x, 0, 2);
  AnnotatedGraph ag = deduce(g, {{"x", hetero({sub({0, 1}, {{2, 2}}, {2}), sub({2})}, 0)}}, 3);
  EXPECT_EQ(ag.of(t), hetero({sub({0, 1}, {{0, 2}}, {0}), sub({2})}, 2));
}

TEST(DeduceLayout, SliceAndConcatNeedTheirAxisWhole) {
  Graph g;
  Tensor x = g.placeholder("x", {B, 8}, DType::F32);
  Tensor s = ops::slice(x, 1, 0, 4);
  Tensor c = ops::concat({s, s}, 1);
  AnnotatedGraph ag = deduce(g, {{"x", on({0, 1}, {{0, 2}}, {0})}}, 2);
  EXPECT_EQ(ag.of(s), on({0, 1}, {{0, 2}}, {0}));
  EXPECT_EQ(ag.of(c), on({0, 1}, {{0, 2}}, {0}));
  expect_error(g, {{"x", on({0, 1}, {{1, 2}}, {1})}}, 2,
               {"op 'slice'", "slice takes a range of it"});
  Graph h;
  Tensor y = h.placeholder("y", {4, B}, DType::F32);
  ops::concat({y, y}, 0);
  expect_error(h, {{"y", on({0, 1}, {{0, 2}}, {0})}}, 2, {"op 'concat'", "concatenation axis 0"});
}

TEST(DeduceLayout, ReduceSumOverASplitDimIsPartial) {
  Graph g;
  Tensor x = g.placeholder("x", {B, 4, 6}, DType::F32);
  Tensor r = ops::reduce_sum(x, {1});
  Tensor all = ops::reduce_sum(x);
  AnnotatedGraph ag = deduce(g, {{"x", on({0, 1, 2, 3}, {{1, 2}, {2, 2}}, {1, 2})}}, 4);
  EXPECT_EQ(ag.of(r), on({0, 1, 2, 3}, {{kP, 2}, {1, 2}}, {kP, 1}));
  EXPECT_EQ(ag.of(all), on({0, 1, 2, 3}, {{kP, 4}}, {kP}));
  AnnotatedGraph top = deduce(g, {{"x", hetero({sub({0}), sub({1})}, 0, {3, 1})}}, 2);
  EXPECT_EQ(top.of(all).hdim, kPartial);
  EXPECT_EQ(top.of(r), hetero({sub({0}), sub({1})}, 0, {3, 1}));
}

// ---- model ops ----

TEST(DeduceEmbedding, VocabHiddenAndTokenSplits) {
  Graph g;
  Tensor w = g.parameter("w", {16, 4});
  Tensor ids = g.placeholder("ids", {B, S}, DType::I32);
  Tensor y = ops::embedding(w, ids);
  const Annotation dup = on({0, 1}, {{kDup, 2}}, {kDup});
  EXPECT_EQ(deduce(g, {{"w", on({0, 1}, {{0, 2}}, {0})}, {"ids", dup}}, 2).of(y),
            on({0, 1}, {{kP, 2}}, {kP}));
  EXPECT_EQ(deduce(g, {{"w", on({0, 1}, {{1, 2}}, {1})}, {"ids", dup}}, 2).of(y),
            on({0, 1}, {{2, 2}}, {2}));
  EXPECT_EQ(deduce(g, {{"w", dup}, {"ids", on({0, 1}, {{0, 2}}, {0})}}, 2).of(y),
            on({0, 1}, {{0, 2}}, {0}));
}

TEST(DeduceEmbedding, GradientIsPartialOverTokensAndSplitLikeTheVocab) {
  Graph g;
  Tensor w = g.parameter("w", {16, 4});
  Tensor ids = g.placeholder("ids", {B, S}, DType::I32);
  Tensor y = ops::reshard(ops::embedding(w, ids), "emb.out");
  Tensor dw = gradients(ops::reduce_sum(y), {w})[0];
  // DP 2 (slow digit) x vocab-parallel 2 (fast digit)
  Plan plan{{"w", on({0, 1, 2, 3}, {{kDup, 2}, {0, 2}}, {kDup, 0})},
            {"ids", on({0, 1, 2, 3}, {{0, 2}, {kDup, 2}}, {0, kDup})},
            {"emb.out", on({0, 1, 2, 3}, {{0, 2}, {kDup, 2}}, {0, kDup})}};
  AnnotatedGraph ag = deduce(g, plan, 4);
  EXPECT_EQ(ag.of(dw), on({0, 1, 2, 3}, {{kP, 2}, {0, 2}}, {kP, 0}));
}

TEST(DeduceNorm, HiddenDimMustBeWholeAndNoPartial) {
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 4}, DType::F32);
  Tensor w = g.parameter("w", {4});
  Tensor y = ops::rms_norm(x, w, 1e-6f);
  const Annotation dup = on({0, 1}, {{kDup, 2}}, {kDup});
  EXPECT_EQ(deduce(g, {{"x", on({0, 1}, {{1, 2}}, {1})}, {"w", dup}}, 2).of(y),
            on({0, 1}, {{1, 2}}, {1}));
  expect_error(
      g, {{"x", on({0, 1}, {{2, 2}}, {2})}, {"w", on({0, 1}, {{0, 2}}, {0})}}, 2,
      {"op 'rms_norm' (node 2): input 0 (x) is split along dim 2", "rms_norm normalizes over it"});
  expect_error(g, {{"x", on({0, 1}, {{kP, 2}}, {kP})}, {"w", dup}}, 2,
               {"input 0 is partial; insert a Reshard to reduce it first"});
}

TEST(DeduceNorm, WeightGradientIsPartialOverTokenSplits) {
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 4}, DType::F32);
  Tensor w = g.parameter("w", {4});
  std::vector<Tensor> grads = gradients(ops::reduce_sum(ops::rms_norm(x, w, 1e-6f)), {x, w});
  AnnotatedGraph ag =
      deduce(g, {{"x", on({0, 1}, {{0, 2}}, {0})}, {"w", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2);
  EXPECT_EQ(ag.of(grads[0]), on({0, 1}, {{0, 2}}, {0}));
  EXPECT_EQ(ag.of(grads[1]), on({0, 1}, {{kP, 2}}, {kP}));
  EXPECT_EQ(find_node(g, "rms_norm_grad").op->type(), "rms_norm_grad");
}

TEST(DeduceRope, PositionsFollowTheTokenSplits) {
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 4, 2}, DType::F32);
  Tensor pos = g.placeholder("pos", {B, S}, DType::I32);
  Tensor y = ops::rope(x, pos, 10000.0f);
  AnnotatedGraph ag =
      deduce(g, {{"x", on({0, 1}, {{1, 2}}, {1})}, {"pos", on({0, 1}, {{1, 2}}, {1})}}, 2);
  EXPECT_EQ(ag.of(y), on({0, 1}, {{1, 2}}, {1}));
  AnnotatedGraph heads =
      deduce(g, {{"x", on({0, 1}, {{2, 2}}, {2})}, {"pos", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2);
  EXPECT_EQ(heads.of(y), on({0, 1}, {{2, 2}}, {2}));
  AnnotatedGraph partial =
      deduce(g, {{"x", on({0, 1}, {{kP, 2}}, {kP})}, {"pos", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2);
  EXPECT_EQ(partial.of(y), on({0, 1}, {{kP, 2}}, {kP}));
  expect_error(g, {{"x", on({0, 1}, {{1, 2}}, {1})}, {"pos", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2,
               {"input 0 (x) splits dim 1 by 2 but input 1 (positions) splits dim 1 by 1"});
  expect_error(g, {{"x", on({0, 1}, {{3, 2}}, {3})}, {"pos", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2,
               {"rope rotates pairs"});
}

struct AttentionGraph {
  explicit AttentionGraph(bool cp) {
    out = ops::attention(q, k, k, Tensor(), 0.5f, cp);
    lse = Tensor(&g, out.node_id(), 1);
  }
  Graph g;
  Tensor q = g.placeholder("q", {B, S, 4, 2}, DType::F32);
  Tensor k = g.placeholder("k", {B, S, 2, 2}, DType::F32);  // GQA: 2 kv heads for 4 query heads
  Tensor out, lse;
};

TEST(DeduceAttention, HeadsSplitConsistentlyAndBatchPasses) {
  AttentionGraph m(false);
  AnnotatedGraph ag =
      deduce(m.g, {{"q", on({0, 1}, {{2, 2}}, {2})}, {"k", on({0, 1}, {{2, 2}}, {2})}}, 2);
  EXPECT_EQ(ag.of(m.out), on({0, 1}, {{2, 2}}, {2}));
  EXPECT_EQ(ag.of(m.lse), on({0, 1}, {{1, 2}}, {1}));
  AnnotatedGraph dp =
      deduce(m.g, {{"q", on({0, 1}, {{0, 2}}, {0})}, {"k", on({0, 1}, {{0, 2}}, {0})}}, 2);
  EXPECT_EQ(dp.of(m.lse), on({0, 1}, {{0, 2}}, {0}));
  expect_error(m.g, {{"q", on({0, 1}, {{2, 2}}, {2})}, {"k", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2,
               {"input 0 (q) splits dim 2 by 2 but input 1 (k) splits dim 2 by 1"});
  expect_error(m.g, {{"q", on({0, 1}, {{3, 2}}, {3})}, {"k", on({0, 1}, {{3, 2}}, {3})}}, 2,
               {"attention contracts the head dim"});
  expect_error(m.g, {{"q", on({0, 1}, {{kP, 2}}, {kP})}, {"k", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2,
               {"input 0 is partial"});
}

TEST(DeduceAttention, SequenceSplitOnlyWithContextParallel) {
  const Annotation seq = on({0, 1}, {{1, 2}}, {1});
  AttentionGraph plain(false);
  expect_error(plain.g, {{"q", seq}, {"k", seq}}, 2, {"context_parallel"});
  AttentionGraph cp(true);
  AnnotatedGraph ag = deduce(cp.g, {{"q", seq}, {"k", seq}}, 2);
  EXPECT_EQ(ag.of(cp.out), seq);
  EXPECT_EQ(ag.of(cp.lse), on({0, 1}, {{2, 2}}, {2}));
}

TEST(DeduceAttention, GradientFollowsTheForward) {
  AttentionGraph m(true);
  std::vector<Tensor> grads = gradients(ops::reduce_sum(m.out), {m.q, m.k});
  const Annotation a = on({0, 1, 2, 3}, {{1, 2}, {2, 2}}, {1, 2});
  AnnotatedGraph ag = deduce(m.g, {{"q", a}, {"k", a}}, 4);
  EXPECT_EQ(ag.of(grads[0]), a);
  EXPECT_EQ(ag.of(grads[1]), a);
}

struct CrossEntropyGraph {
  Graph g;
  Tensor logits = g.placeholder("logits", {B, S, 8}, DType::F32);
  Tensor targets = g.placeholder("targets", {B, S}, DType::I32);
  Tensor norm = g.placeholder("norm", {}, DType::F32);
  Tensor loss = ops::cross_entropy(logits, targets, norm);
  Tensor lse = Tensor(&g, loss.node_id(), 1);
};

TEST(DeduceCrossEntropy, TokenSplitsMakeTheLossPartial) {
  CrossEntropyGraph m;
  const Annotation batch = on({0, 1}, {{0, 2}}, {0});
  AnnotatedGraph ag = deduce(
      m.g, {{"logits", batch}, {"targets", batch}, {"norm", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2);
  EXPECT_EQ(ag.of(m.loss), on({0, 1}, {{kP, 2}}, {kP}));
  EXPECT_EQ(ag.of(m.lse), batch);
}

TEST(DeduceCrossEntropy, VocabParallelLossIsDupOverTheVocabGroup) {
  CrossEntropyGraph m;
  // DP 2 x vocab-parallel 2
  Plan plan{{"logits", on({0, 1, 2, 3}, {{0, 2}, {2, 2}}, {0, 2})},
            {"targets", on({0, 1, 2, 3}, {{0, 2}, {kDup, 2}}, {0, kDup})},
            {"norm", on({0, 1, 2, 3}, {{kDup, 4}}, {kDup})}};
  AnnotatedGraph ag = deduce(m.g, plan, 4);
  EXPECT_EQ(ag.of(m.loss), on({0, 1, 2, 3}, {{kP, 2}, {kDup, 2}}, {kP, kDup}));
  EXPECT_EQ(ag.of(m.lse), on({0, 1, 2, 3}, {{0, 2}, {kDup, 2}}, {0, kDup}));
  // d(loss) is dup everywhere; dlogits is split like the logits
  Tensor dlogits = gradients(m.loss, {m.logits})[0];
  AnnotatedGraph bw = deduce(m.g, plan, 4);
  EXPECT_EQ(bw.of(find_node(m.g, "fill_like").output(0)), on({0, 1, 2, 3}, {{kDup, 4}}, {kDup}));
  EXPECT_EQ(bw.of(dlogits), plan["logits"]);
}

TEST(DeduceCrossEntropy, TopTierTokensGiveAPartialLossAcrossSubgroups) {
  CrossEntropyGraph m;
  const Annotation top = hetero({sub({0, 1}, {{2, 2}}, {2}), sub({2})}, 0, {3, 1});
  Plan plan{{"logits", top},
            {"targets", hetero({sub({0, 1}, {{kDup, 2}}, {kDup}), sub({2})}, 0, {3, 1})},
            {"norm", hetero({sub({0, 1}, {{kDup, 2}}, {kDup}), sub({2})}, kDup)}};
  AnnotatedGraph ag = deduce(m.g, plan, 3);
  EXPECT_EQ(ag.of(m.loss), hetero({sub({0, 1}, {{kDup, 2}}, {kDup}), sub({2})}, kPartial));
  Tensor dlogits = gradients(m.loss, {m.logits})[0];
  EXPECT_EQ(deduce(m.g, plan, 3).of(dlogits), top);
}

TEST(DeduceCrossEntropy, Errors) {
  CrossEntropyGraph m;
  const Annotation dup = on({0, 1}, {{kDup, 2}}, {kDup});
  expect_error(m.g, {{"logits", on({0, 1}, {{kP, 2}}, {kP})}, {"targets", dup}, {"norm", dup}}, 2,
               {"op 'cross_entropy' (node 3): input 0 is partial"});
  expect_error(m.g, {{"logits", dup}, {"targets", dup}, {"norm", on({0, 1}, {{kP, 2}}, {kP})}}, 2,
               {"input 2 is partial"});
  expect_error(m.g, {{"logits", on({0, 1}, {{0, 2}}, {0})}, {"targets", dup}, {"norm", dup}}, 2,
               {"input 0 (logits) splits dim 0 by 2 but input 1 (targets) splits dim 0 by 1"});
  const Annotation top_dup = hetero({sub({0}), sub({1})}, kDup);
  expect_error(
      m.g, {{"logits", hetero({sub({0}), sub({1})}, 2)}, {"targets", top_dup}, {"norm", top_dup}},
      2, {"across subgroups, but the op reduces over it only inside a subgroup"});
}

// ---- constants ----

TEST(DeduceFill, FillLikeTurnsPartialIntoDup) {
  Graph g;
  Tensor x = g.placeholder("x", {}, DType::F32);
  Tensor one = ops::fill_like(x, 1.0f);
  EXPECT_EQ(deduce(g, {{"x", on({0, 1, 2, 3}, {{kP, 2}, {kDup, 2}}, {kP, kDup})}}, 4).of(one),
            on({0, 1, 2, 3}, {{kDup, 4}}, {kDup}));
  EXPECT_EQ(
      deduce(g, {{"x", hetero({sub({0, 1}, {{kP, 2}}, {kP}), sub({2})}, kPartial)}}, 3).of(one),
      hetero({sub({0, 1}, {{kDup, 2}}, {kDup}), sub({2})}, kDup));
  Graph h;
  Tensor y = h.placeholder("y", {B, 4}, DType::F32);
  ops::fill_like(y, 0.0f);
  expect_error(h,
               {{"y", on({0, 1, 2, 3, 4, 5, 6, 7}, {{kP, 2}, {0, 2}, {kDup, 2}}, {kP, 0, kDup})}},
               8, {"op 'fill_like'", "not adjacent"});
}

TEST(DeduceFill, FillNeedsANameInThePlan) {
  Graph g;
  ops::fill(g, {2}, 1.0f);
  expect_error(g, {}, 1, {"op 'fill' (node 0)", "use fill_like"});
  Graph h;
  Tensor c = ops::fill(h, {2}, 1.0f, "ones");
  EXPECT_EQ(deduce(h, {{"ones", on({0})}}, 1).of(c), on({0}));
}

// ---- reshards ----

TEST(DeduceReshard, NamedFromPlanUnnamedIdentity) {
  Graph g;
  Tensor x = g.placeholder("x", {B, 4}, DType::F32);
  Tensor same = ops::reshard(x);
  Tensor moved = ops::reshard(x, "moved");
  const Annotation there = on({2, 3}, {{0, 2}}, {0});
  AnnotatedGraph ag = deduce(g, {{"x", on({0, 1}, {{kDup, 2}}, {kDup})}, {"moved", there}}, 4);
  EXPECT_EQ(ag.of(same), on({0, 1}, {{kDup, 2}}, {kDup}));
  EXPECT_EQ(ag.of(moved), there);
  expect_error(g, {{"x", on({0})}}, 4, {"[deduce] tensor 'moved' has no annotation in the plan"});
  expect_error(g, {{"x", on({0})}, {"moved", on({0}, {{3, 1}})}}, 4,
               {"[annotation] tensor 'moved'"});
}

TEST(DeduceReshard, GradientOfAReshardMirrorsTheForwardInput) {
  Graph g;
  Tensor x = g.placeholder("x", {B, 4}, DType::F32);
  Tensor w = g.parameter("w", {4, 4});
  Tensor y = ops::linear(x, w);  // row parallel: partial
  Tensor r = ops::reshard(y, "reduced");
  Tensor dx = gradients(ops::reduce_sum(ops::mul(r, r)), {x})[0];
  const Node& mirror = find_node(g, "reshard", r.node_id());
  EXPECT_EQ(mirror.name, "backward.reduced");
  EXPECT_EQ(ops::reshard_mirror_of(mirror), r.node_id());
  EXPECT_EQ(ops::reshard_mirror_of(r.node()), -1);
  Plan plan{{"x", on({0, 1}, {{1, 2}}, {1})},
            {"w", on({0, 1}, {{1, 2}}, {1})},
            {"reduced", on({0, 1}, {{kDup, 2}}, {kDup})}};
  AnnotatedGraph ag = deduce(g, plan, 2);
  EXPECT_EQ(ag.of(y), on({0, 1}, {{kP, 2}}, {kP}));
  // partial forward input -> the full gradient, dup
  EXPECT_EQ(ag.of(mirror.output(0)), on({0, 1}, {{kDup, 2}}, {kDup}));
  EXPECT_EQ(ag.of(dx), plan["x"]);
}

TEST(DeduceReshard, MirrorKeepsPartialSumsAcrossPipelines) {
  Graph g;
  Tensor x = g.placeholder("x", {B, 4}, DType::F32);
  Tensor w = g.parameter("w", {4, 4});
  Tensor wr = ops::reshard(w, "w.use");
  Tensor dw = gradients(ops::reduce_sum(ops::matmul(x, wr)), {w})[0];
  const Annotation w_ann = hetero({sub({0}), sub({1})}, kDup);
  Plan plan{{"x", hetero({sub({0}), sub({1})}, 0, {3, 1})}, {"w", w_ann}, {"w.use", w_ann}};
  AnnotatedGraph ag = deduce(g, plan, 2);
  // the weight gradient of each pipeline is a partial sum: it stays one
  EXPECT_EQ(ag.of(dw), hetero({sub({0}), sub({1})}, kPartial));
  EXPECT_EQ(ops::reshard_mirror_of(dw.node()), wr.node_id());
}

// ---- whole graphs ----

// Megatron MLP over 4 ranks: data parallel 2 (slow digit) x tensor parallel 2.
TEST(DeduceGradients, TensorParallelMlp) {
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 4}, DType::F32);
  Tensor wn = g.parameter("norm", {4});
  Tensor w1 = g.parameter("gate", {8, 4});
  Tensor w3 = g.parameter("up", {8, 4});
  Tensor w2 = g.parameter("down", {4, 8});
  Tensor h = ops::reshard(ops::rms_norm(x, wn, 1e-6f), "mlp.input");
  Tensor act = ops::swiglu(ops::linear(h, w1), ops::linear(h, w3));
  Tensor down = ops::linear(act, w2);
  Tensor out = ops::reshard(down, "mlp.output");
  Tensor loss = ops::reduce_sum(out);
  const int forward_nodes = g.num_nodes();
  std::vector<Tensor> grads = gradients(loss, {wn, w1, w3, w2, x});

  const std::vector<int> ranks = {0, 1, 2, 3};
  const Annotation tokens = on(ranks, {{0, 2}, {kDup, 2}}, {0, kDup});
  Plan plan{{"x", tokens},
            {"norm", on(ranks, {{kDup, 4}}, {kDup})},
            {"gate", on(ranks, {{kDup, 2}, {0, 2}}, {kDup, 0})},
            {"up", on(ranks, {{kDup, 2}, {0, 2}}, {kDup, 0})},
            {"down", on(ranks, {{kDup, 2}, {1, 2}}, {kDup, 1})},
            {"mlp.input", tokens},
            {"mlp.output", tokens}};
  AnnotatedGraph ag = deduce(g, plan, 4);
  EXPECT_EQ(ag.of(act), on(ranks, {{0, 2}, {2, 2}}, {0, 2}));
  EXPECT_EQ(ag.of(down), on(ranks, {{0, 2}, {kP, 2}}, {0, kP}));
  EXPECT_EQ(ag.of(loss), on(ranks, {{kP, 2}, {kDup, 2}}, {kP, kDup}));

  // weight gradients: partial over the data-parallel replicas, split like the weights
  EXPECT_EQ(ag.of(grads[0]), on(ranks, {{kP, 2}, {kDup, 2}}, {kP, kDup}));
  EXPECT_EQ(ag.of(grads[1]), on(ranks, {{kP, 2}, {0, 2}}, {kP, 0}));
  EXPECT_EQ(ag.of(grads[2]), on(ranks, {{kP, 2}, {0, 2}}, {kP, 0}));
  EXPECT_EQ(ag.of(grads[3]), on(ranks, {{kP, 2}, {1, 2}}, {kP, 1}));
  EXPECT_EQ(ag.of(grads[4]), tokens);

  // the backward of the reshard after the norm is a mirror: it all-reduces
  // the partial gradient of the column-parallel linears back to the norm's layout
  int mirrors = 0;
  for (int id = forward_nodes; id < g.num_nodes(); ++id) {
    const Node& n = g.node(id);
    if (n.op->type() != "reshard") continue;
    ++mirrors;
    ASSERT_GE(ops::reshard_mirror_of(n), 0);
    if (n.name != "backward.mlp.input") continue;
    EXPECT_EQ(ag.of(n.inputs[0]), on(ranks, {{0, 2}, {kP, 2}}, {0, kP}));
    EXPECT_EQ(ag.of(n.output(0)), tokens);
  }
  EXPECT_EQ(mirrors, 2);
}

LlamaConfig tiny_llama() {
  LlamaConfig c;
  c.vocab_size = 32;
  c.hidden_size = 16;
  c.intermediate_size = 32;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  return c;
}

// Data parallel over 2 ranks needs no Reshard: the whole training graph
// deduces, and every parameter gradient is a partial sum over the replicas.
TEST(DeduceGradients, DataParallelLlama) {
  const LlamaConfig c = tiny_llama();
  LlamaGraph m = build_llama(c);
  const Annotation batch = on({0, 1}, {{0, 2}}, {0});
  const Annotation dup = on({0, 1}, {{kDup, 2}}, {kDup});
  Plan plan{{"input_ids", batch}, {"targets", batch}, {"positions", batch}, {"normalizer", dup}};
  for (const auto& name : m.names) plan[name] = dup;
  AnnotatedGraph ag = deduce(*m.graph, plan, 2);
  EXPECT_EQ(ag.of(m.loss), on({0, 1}, {{kP, 2}}, {kP}));
  for (size_t i = 0; i < m.grads.size(); ++i)
    EXPECT_EQ(ag.of(m.grads[i]), on({0, 1}, {{kP, 2}}, {kP})) << m.names[i];
}

// On one device everything is trivially annotated.
TEST(DeduceGradients, SingleDeviceLlama) {
  LlamaGraph m = build_llama(tiny_llama(), true);
  Plan plan{{"input_ids", on({0})},
            {"targets", on({0})},
            {"positions", on({0})},
            {"normalizer", on({0})},
            {"cu_seqlens", on({0})}};
  for (const auto& name : m.names) plan[name] = on({0});
  AnnotatedGraph ag = deduce(*m.graph, plan, 1);
  for (int id = 0; id < m.graph->num_nodes(); ++id)
    for (int i = 0; i < static_cast<int>(m.graph->node(id).outputs.size()); ++i)
      EXPECT_EQ(ag.of(Tensor(m.graph.get(), id, i)), on({0})) << "node " << id;
}

}  // namespace
}  // namespace hspmd
