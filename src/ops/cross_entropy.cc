// cross_entropy: Σ over non-ignored tokens of -log softmax(logits)[target],
// divided by a scalar normalizer. The backward is one fused op producing
// dlogits; targets and normalizer get no gradient.
// Deduction: token splits of logits (targets alike) make the loss partial
// (hdim over tokens: -2) and pass to lse; a vocab split inside a subgroup is
// vocab-parallel cross-entropy (the kernel reduces max, sum-exp and target
// logit over the vocab group): loss and lse are dup there. No partial input;
// the normalizer is a dup scalar. cross_entropy_grad is linear in dloss.
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

// Labels: tokens t0.., vocab v. Forward inputs: logits, targets, normalizer;
// backward: dloss, logits, targets, normalizer, lse.
DimRule cross_entropy_rule(int targets_rank, bool backward) {
  const auto tokens = numbered_labels("t", targets_rank);
  const auto logits = labels_plus(tokens, {"v"});
  DimRule rule;
  if (backward) {
    rule = DimRule{.inputs = {{}, logits, tokens, {}, tokens},
                   .input_names = {"dloss", "logits", "targets", "normalizer", "lse"},
                   .outputs = {logits},
                   .linear = {true, false, false, false, false}};
  } else {
    rule = DimRule{.inputs = {logits, tokens, {}},
                   .input_names = {"logits", "targets", "normalizer"},
                   .outputs = {{}, tokens}};
    sum_over(rule, tokens);
  }
  rule.reductions["v"] = Reduction::kCollective;
  return rule;
}

// (dloss, logits, targets, normalizer, lse) -> dlogits.
class CrossEntropyGradOp final : public Op {
 public:
  explicit CrossEntropyGradOp(int ignore_index) : ignore_index_(ignore_index) {}
  std::string type() const override { return "cross_entropy_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("cross_entropy_grad", in, 5);
    return {in[1]};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::cross_entropy_backward(in[0], in[1].contiguous(), in[2].contiguous(), in[3], in[4],
                                    ignore_index_, out[0]);
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    return deduce_by_dims(ctx, cross_entropy_rule(ctx.node.inputs[2].ndim(), true), in);
  }

 private:
  int ignore_index_;
};

class CrossEntropyOp final : public Op {
 public:
  explicit CrossEntropyOp(int ignore_index) : ignore_index_(ignore_index) {}
  std::string type() const override { return "cross_entropy"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("cross_entropy", in, 3);
    expect_dtype("cross_entropy", "logits", in[0], DType::F32);
    expect_dtype("cross_entropy", "targets", in[1], DType::I32);
    expect_dtype("cross_entropy", "normalizer", in[2], DType::F32);
    const SymShape& l = in[0].shape;
    if (l.empty() || SymShape(l.begin(), l.end() - 1) != in[1].shape)
      fail("[cross_entropy] logits must be [..., V] over targets [...]: logits ",
           sym_shape_str(l), ", targets ", sym_shape_str(in[1].shape));
    if (!in[2].shape.empty())
      fail("[cross_entropy] normalizer must be a scalar, got ", sym_shape_str(in[2].shape));
    // Output 1: the per-row log-sum-exp, saved for the backward.
    return {TensorMeta{{}, DType::F32}, TensorMeta{in[1].shape, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    out[1] = ctx.alloc(1);
    kernels::cross_entropy(in[0].contiguous(), in[1].contiguous(), in[2], ignore_index_, out[0],
                           out[1]);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    const Tensor logits = node.inputs[0], targets = node.inputs[1], norm = node.inputs[2];
    auto op = std::make_shared<CrossEntropyGradOp>(ignore_index_);
    return {g[0].graph()->add1(op, {g[0], logits, targets, norm, node.output(1)}), Tensor(),
            Tensor()};
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    return deduce_by_dims(ctx, cross_entropy_rule(ctx.node.inputs[1].ndim(), false), in);
  }

 private:
  int ignore_index_;
};

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& normalizer,
                     int ignore_index) {
  return logits.graph()->add(std::make_shared<CrossEntropyOp>(ignore_index),
                             {logits, targets, normalizer})[0];
}

}  // namespace hspmd::ops
