// Annotation deduction: the engine (leaves, reshards, device checks), the
// shared dim rule, elementwise, matmul, both tiers and the layout ops.
#include <gtest/gtest.h>

#include "hspmd/models/model.h"
#include "hspmd/ops/autodiff.h"
#include "hspmd/ops/ops.h"
#include "deduce/deduce_test_util.h"

namespace hspmd {
namespace {

using namespace deduce_test;

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

// ---- add_bias (x [..., N] + bias [N]) and bias_grad ----

// y = add_bias(x, b) with x [B, S, 8]; the gradients of sum(y) for x and b.
struct BiasAdd {
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 8}, DType::F32);
  Tensor b = g.parameter("b", {8});
  Tensor y = ops::add_bias(x, b);
  std::vector<Tensor> grads = gradients(ops::reduce_sum(y), {x, b});
};

TEST(DeduceAddBias, TensorParallelSplitsTheBiasLikeTheColumns) {
  BiasAdd m;
  // TP 2: a column-parallel projection's output and its bias.
  const Annotation x = on({0, 1}, {{2, 2}}, {2});
  AnnotatedGraph ag = deduce(m.g, {{"x", x}, {"b", on({0, 1}, {{0, 2}}, {0})}}, 2);
  EXPECT_EQ(ag.of(m.y), x);
  EXPECT_EQ(ag.of(m.grads[0]), x);
  EXPECT_EQ(ag.of(m.grads[1]), on({0, 1}, {{0, 2}}, {0}));
  EXPECT_EQ(find_node(m.g, "bias_grad").op->type(), "bias_grad");
  // DP 2 (slow digit) x TP 2 (fast digit): the bias dup over the batch split,
  // its gradient partial there.
  const Annotation dp_tp = on({0, 1, 2, 3}, {{0, 2}, {2, 2}}, {0, 2});
  AnnotatedGraph ag4 =
      deduce(m.g, {{"x", dp_tp}, {"b", on({0, 1, 2, 3}, {{kDup, 2}, {0, 2}}, {kDup, 0})}}, 4);
  EXPECT_EQ(ag4.of(m.y), dp_tp);
  EXPECT_EQ(ag4.of(m.grads[0]), dp_tp);
  EXPECT_EQ(ag4.of(m.grads[1]), on({0, 1, 2, 3}, {{kP, 2}, {0, 2}}, {kP, 0}));
}

TEST(DeduceAddBias, TokenSplitsDuplicateTheBias) {
  BiasAdd m;
  const Annotation dup = on({0, 1}, {{kDup, 2}}, {kDup});
  for (int d : {0, 1}) {  // data parallel, sequence (context) parallel
    const Annotation x = on({0, 1}, {{d, 2}}, {d});
    AnnotatedGraph ag = deduce(m.g, {{"x", x}, {"b", dup}}, 2);
    EXPECT_EQ(ag.of(m.y), x) << "split dim " << d;
    EXPECT_EQ(ag.of(m.grads[1]), on({0, 1}, {{kP, 2}}, {kP})) << "split dim " << d;
  }
  // Everything replicated: so is the bias gradient.
  EXPECT_EQ(deduce(m.g, {{"x", dup}, {"b", dup}}, 2).of(m.grads[1]), dup);
}

TEST(DeduceAddBias, HeterogeneousAndUnevenSplits) {
  BiasAdd m;
  // Two pipelines cutting the batch 3:1: TP 2 on ranks 0, 1, TP 1 on rank 2.
  const Annotation x = hetero({sub({0, 1}, {{2, 2}}, {2}), sub({2})}, 0, {3, 1});
  AnnotatedGraph ag =
      deduce(m.g, {{"x", x}, {"b", hetero({sub({0, 1}, {{0, 2}}, {0}), sub({2})}, kDup)}}, 3);
  EXPECT_EQ(ag.of(m.y), x);
  EXPECT_EQ(ag.of(m.grads[1]), hetero({sub({0, 1}, {{0, 2}}, {0}), sub({2})}, kP));
  // The columns cut 3:1 across subgroups (6 and 2 of 8), then in two inside
  // subgroup 0: the bias cut alike.
  const Annotation cols = hetero({sub({0, 1}, {{2, 2}}, {2}), sub({2})}, 2, {3, 1});
  const Annotation bias = hetero({sub({0, 1}, {{0, 2}}, {0}), sub({2})}, 0, {3, 1});
  AnnotatedGraph uneven = deduce(m.g, {{"x", cols}, {"b", bias}}, 3);
  EXPECT_EQ(uneven.of(m.y), cols);
  EXPECT_EQ(uneven.of(m.grads[0]), cols);
  EXPECT_EQ(uneven.of(m.grads[1]), bias);
  // ... with a batch split inside subgroup 0 instead: the bias dup there.
  const Annotation mixed = hetero({sub({0, 1}, {{0, 2}}, {0}), sub({2})}, 2, {3, 1});
  AnnotatedGraph ag_mixed = deduce(
      m.g,
      {{"x", mixed}, {"b", hetero({sub({0, 1}, {{kDup, 2}}, {kDup}), sub({2})}, 0, {3, 1})}}, 3);
  EXPECT_EQ(ag_mixed.of(m.y), mixed);
  EXPECT_EQ(ag_mixed.of(m.grads[1]), hetero({sub({0, 1}, {{kP, 2}}, {kP}), sub({2})}, 0, {3, 1}));
  // Other proportions for the bias than for x's columns.
  expect_error(m.g,
               {{"x", cols}, {"b", hetero({sub({0, 1}, {{0, 2}}, {0}), sub({2})}, 0, {1, 1})}}, 3,
               {"op 'add_bias' (node 2)", "different proportions [3, 1] vs [1, 1]"});
}

TEST(DeduceAddBias, MismatchedBiasIsAnError) {
  BiasAdd m;
  const Annotation dup = on({0, 1}, {{kDup, 2}}, {kDup});
  expect_error(m.g, {{"x", on({0, 1}, {{2, 2}}, {2})}, {"b", dup}}, 2,
               {"[deduce] op 'add_bias' (node 2): input 0 (x) splits dim 2 by 2 but input 1 "
                "(bias) splits dim 0 by 1",
                "insert a Reshard"});
  expect_error(m.g, {{"x", dup}, {"b", on({0, 1}, {{0, 2}}, {0})}}, 2,
               {"input 0 (x) splits dim 2 by 1 but input 1 (bias) splits dim 0 by 2"});
  // The bias split on the batch's digit of the devices, not the columns'.
  expect_error(m.g,
               {{"x", on({0, 1, 2, 3}, {{0, 2}, {2, 2}}, {0, 2})},
                {"b", on({0, 1, 2, 3}, {{0, 2}, {kDup, 2}}, {0, kDup})}},
               4, {"op 'add_bias' (node 2): inputs 0 and 1 order their devices differently"});
  // Columns cut across subgroups, the bias whole on each.
  expect_error(m.g,
               {{"x", hetero({sub({0}), sub({1})}, 2)}, {"b", hetero({sub({0}), sub({1})}, kDup)}},
               2, {"input 0 (x) splits dim 2 by 2 but input 1 (bias) splits dim 0 by 1",
                   "across subgroups"});
  // The bias on other devices.
  expect_error(m.g, {{"x", on({0, 1}, {{2, 2}}, {2})}, {"b", on({2, 3}, {{0, 2}}, {0})}}, 4,
               {"op 'add_bias' (node 2): inputs 0 and 1 live on different subgroups"});
}

TEST(DeduceAddBias, PartialInputsAreRefused) {
  BiasAdd m;
  const Annotation dup = on({0, 1}, {{kDup, 2}}, {kDup});
  expect_error(m.g, {{"x", on({0, 1}, {{kP, 2}}, {kP})}, {"b", dup}}, 2,
               {"[deduce] op 'add_bias' (node 2): input 0 (x) is partial; a bias is added to the "
                "whole value, not to each partial term: insert a Reshard to reduce it first"});
  expect_error(m.g,
               {{"x", hetero({sub({0}), sub({1})}, kP)}, {"b", hetero({sub({0}), sub({1})}, kDup)}},
               2, {"input 0 (x) is partial"});
  Graph h;
  Tensor x = h.placeholder("x", {B, 8}, DType::F32);
  Tensor b = h.placeholder("b", {8}, DType::F32);
  ops::add_bias(x, b);
  expect_error(h, {{"x", dup}, {"b", on({0, 1}, {{kP, 2}}, {kP})}}, 2, {"input 1 (bias) is partial"});
}

TEST(DeduceAddBias, BiasGradientIsLinearInThePartialGradient) {
  // The biased value feeds a column-parallel linear: its gradient, and so the
  // bias gradient, is a partial sum over the tensor-parallel ranks.
  Graph g;
  Tensor x = g.placeholder("x", {B, 8}, DType::F32);
  Tensor b = g.parameter("b", {8});
  Tensor w = g.parameter("w", {4, 8});
  std::vector<Tensor> grads = gradients(ops::reduce_sum(ops::linear(ops::add_bias(x, b), w)), {x, b});
  const Annotation dup = on({0, 1}, {{kDup, 2}}, {kDup});
  AnnotatedGraph ag = deduce(g, {{"x", dup}, {"b", dup}, {"w", on({0, 1}, {{0, 2}}, {0})}}, 2);
  EXPECT_EQ(ag.of(grads[0]), on({0, 1}, {{kP, 2}}, {kP}));
  EXPECT_EQ(ag.of(grads[1]), on({0, 1}, {{kP, 2}}, {kP}));
}

// ---- linear_bias (x · weight^T + bias in one op) against linear, add_bias, cast ----

// y = linear_bias(x, w, b, out), or the chain it replaces, with x [B, S, 8],
// w [8, 8], b [8]; the gradients of sum(y) for x, w and b.
struct BiasProjection {
  explicit BiasProjection(bool fused, DType out = DType::BF16) {
    y = fused ? ops::linear_bias(x, w, b, out) : ops::cast(ops::add_bias(ops::linear(x, w), b), out);
    grads = gradients(ops::reduce_sum(ops::cast(y, DType::F32)), {x, w, b});
  }
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 8}, DType::F32);
  Tensor w = g.parameter("w", {8, 8});
  Tensor b = g.parameter("b", {8});
  Tensor y;
  std::vector<Tensor> grads;
};

TEST(DeduceLinearBias, LayoutsAreTheChains) {
  const Annotation dup2 = on({0, 1}, {{kDup, 2}}, {kDup});
  const std::vector<std::pair<const char*, Plan>> plans = {
      // TP 2, column parallel: the bias split like the weight's rows.
      {"tp2", {{"x", dup2}, {"w", on({0, 1}, {{0, 2}}, {0})}, {"b", on({0, 1}, {{0, 2}}, {0})}}},
      // DP 2 (slow digit) x TP 2 (fast digit).
      {"dp2_tp2",
       {{"x", on({0, 1, 2, 3}, {{0, 2}, {kDup, 2}}, {0, kDup})},
        {"w", on({0, 1, 2, 3}, {{kDup, 2}, {0, 2}}, {kDup, 0})},
        {"b", on({0, 1, 2, 3}, {{kDup, 2}, {0, 2}}, {kDup, 0})}}},
      // Sequence parallel with replicated weights.
      {"sp2", {{"x", on({0, 1}, {{1, 2}}, {1})}, {"w", dup2}, {"b", dup2}}},
      // Two pipelines cutting the batch 3:1, TP 2 on ranks 0, 1 and TP 1 on rank 2.
      {"hetero",
       {{"x", hetero({sub({0, 1}, {{kDup, 2}}, {kDup}), sub({2})}, 0, {3, 1})},
        {"w", hetero({sub({0, 1}, {{0, 2}}, {0}), sub({2})}, kDup)},
        {"b", hetero({sub({0, 1}, {{0, 2}}, {0}), sub({2})}, kDup)}}},
  };
  for (DType out : {DType::F32, DType::BF16})
    for (const auto& [name, plan] : plans) {
      SCOPED_TRACE(::testing::Message() << name << " " << dtype_name(out));
      const int world = name == std::string("dp2_tp2") ? 4 : name == std::string("hetero") ? 3 : 2;
      BiasProjection fused(true, out), chain(false, out);
      const AnnotatedGraph af = deduce(fused.g, plan, world), ac = deduce(chain.g, plan, world);
      EXPECT_EQ(af.of(fused.y), ac.of(chain.y));
      for (size_t i = 0; i < 3; ++i) EXPECT_EQ(af.of(fused.grads[i]), ac.of(chain.grads[i])) << "gradient " << i;
    }
  // The column-parallel output itself: split along its last dim.
  BiasProjection m(true);
  const Annotation cols = on({0, 1}, {{2, 2}}, {2});
  EXPECT_EQ(deduce(m.g, plans[0].second, 2).of(m.y), cols);
}

TEST(DeduceLinearBias, PartialInputsAndRowParallelAreRefused) {
  const Annotation dup2 = on({0, 1}, {{kDup, 2}}, {kDup});
  BiasProjection m(true);
  expect_error(m.g, {{"x", on({0, 1}, {{kP, 2}}, {kP})}, {"w", dup2}, {"b", dup2}}, 2,
               {"[deduce] op 'linear_bias' (node 3): input 0 (x) is partial; a bias is added to the whole "
                "product, not to each partial term: insert a Reshard to reduce it first"});
  // Row parallel: the contracted dim split in x and the weight; the chain
  // refuses it at add_bias (a partial product).
  const Plan rows{{"x", on({0, 1}, {{2, 2}}, {2})}, {"w", on({0, 1}, {{1, 2}}, {1})}, {"b", dup2}};
  expect_error(m.g, rows, 2, {"op 'linear_bias'", "input 0 (x)", "makes the product partial"});
  BiasProjection chain(false);
  expect_error(chain.g, rows, 2, {"op 'add_bias'", "input 0 (x) is partial"});
  // A bias not split like the weight's rows.
  expect_error(m.g, {{"x", dup2}, {"w", on({0, 1}, {{0, 2}}, {0})}, {"b", dup2}}, 2,
               {"op 'linear_bias'", "input 2 (bias)"});
}

}  // namespace
}  // namespace hspmd
