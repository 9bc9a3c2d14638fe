// reduce_sum: sums over some axes (all when none are given), dropping them.
// The gradient broadcasts back over the reduced axes (broadcast_reduced).
// Deduction: a split of a reduced axis makes the output partial (hdim on it:
// -2); kept axes pass; both ops are linear.
#include <algorithm>

#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

// reduced[d] for each dim of a rank-`rank` tensor; all dims when `axes` is empty.
std::vector<bool> reduced_mask(const std::vector<int>& axes, int rank) {
  std::vector<bool> mask(rank, axes.empty());
  for (int a : axes) {
    const int d = norm_axis("reduce_sum", a, rank);
    if (mask[d]) fail("[reduce_sum] axis ", a, " is listed twice");
    mask[d] = true;
  }
  return mask;
}

// `forward_input` (the reduce_sum's input, read by deduction only) gives the
// splits of the broadcast dims: broadcasting is local, so any split works,
// and the forward's is the one the rest of the backward expects.
class BroadcastReducedOp final : public Op {
 public:
  BroadcastReducedOp(SymShape shape, std::vector<bool> reduced, Tensor forward_input)
      : shape_(std::move(shape)), reduced_(std::move(reduced)), forward_input_(forward_input) {}
  std::string type() const override { return "broadcast_reduced"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("broadcast_reduced", in, 1);
    expect_dtype("broadcast_reduced", "input", in[0], DType::F32);
    return {TensorMeta{shape_, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::broadcast_reduced(*ctx.stream, in[0].contiguous(), reduced_, out[0]);
  }
  std::vector<Tensor> gradient(const Node&, const std::vector<Tensor>& g) const override;
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    const auto labels = numbered_labels("d", static_cast<int>(reduced_.size()));
    // The forward input has every dim; only its broadcast dims are labelled.
    std::vector<std::string> kept, broadcast(labels.size());
    for (size_t d = 0; d < reduced_.size(); ++d)
      (reduced_[d] ? broadcast[d] : kept.emplace_back()) = labels[d];
    DimRule rule{.inputs = {kept}, .input_names = {"input"}, .outputs = {labels}, .linear = {true}};
    std::vector<Annotation> inputs = in;
    const Tensor& f = forward_input_;
    if (f.valid() && ctx.graph.has(f) && same_devices(ctx.graph.of(f), in[0])) {
      rule.inputs.push_back(broadcast);
      rule.input_names.push_back("forward input");
      rule.layout_only = {false, true};
      inputs.push_back(ctx.graph.of(f));
    }
    return deduce_by_dims(ctx, rule, inputs);
  }

 private:
  SymShape shape_;
  std::vector<bool> reduced_;
  Tensor forward_input_;
};

class ReduceSumOp final : public Op {
 public:
  explicit ReduceSumOp(std::vector<int> axes) : axes_(std::move(axes)) {}
  std::string type() const override { return "reduce_sum"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("reduce_sum", in, 1);
    expect_dtype("reduce_sum", "input", in[0], DType::F32);
    const std::vector<bool> mask = reduced_mask(axes_, static_cast<int>(in[0].shape.size()));
    SymShape out;
    for (size_t d = 0; d < mask.size(); ++d)
      if (!mask[d]) out.push_back(in[0].shape[d]);
    return {TensorMeta{out, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::reduce_sum(*ctx.stream, in[0].contiguous(), reduced_mask(axes_, in[0].ndim()), out[0]);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    const SymShape shape = node.inputs[0].shape();
    auto op = std::make_shared<BroadcastReducedOp>(
        shape, reduced_mask(axes_, static_cast<int>(shape.size())), node.inputs[0]);
    return {g[0].graph()->add1(op, {g[0]})};
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    const int rank = ctx.node.inputs[0].ndim();
    const std::vector<bool> mask = reduced_mask(axes_, rank);
    const auto labels = numbered_labels("d", rank);
    std::vector<std::string> kept, summed;
    for (int d = 0; d < rank; ++d) (mask[d] ? summed : kept).push_back(labels[d]);
    DimRule rule{.inputs = {labels}, .input_names = {"input"}, .outputs = {kept}, .linear = {true}};
    sum_over(rule, summed);
    return deduce_by_dims(ctx, rule, in);
  }

 private:
  std::vector<int> axes_;
};

std::vector<Tensor> BroadcastReducedOp::gradient(const Node&, const std::vector<Tensor>& g) const {
  std::vector<int> axes;
  for (size_t d = 0; d < reduced_.size(); ++d)
    if (reduced_[d]) axes.push_back(static_cast<int>(d));
  if (axes.empty()) return {g[0]};
  return {reduce_sum(g[0], axes)};
}

}  // namespace

Tensor reduce_sum(const Tensor& a, const std::vector<int>& axes) {
  return a.graph()->add1(std::make_shared<ReduceSumOp>(axes), {a});
}

}  // namespace hspmd::ops
