// swiglu: silu(gate) * up. The backward is one fused op producing dgate, dup
// (in gate's and up's dtype; dy may be f32 or bf16). Computed in f32 from
// f32 or bf16 inputs; a bf16 result is rounded once.
// Deduction: elementwise (the default rule: identical annotations, no
// partial); swiglu_grad is linear in dy, gate and up sharded like it.
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

// (dy, gate, up) -> (dgate, dup).
class SwigluGradOp final : public Op {
 public:
  std::string type() const override { return "swiglu_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("swiglu_grad", in, 3);
    return {in[1], in[2]};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    out[1] = ctx.alloc(1);
    kernels::swiglu_backward(*ctx.stream, in[0].contiguous(), in[1].contiguous(),
                             in[2].contiguous(), out[0], out[1]);
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    const auto d = numbered_labels("d", ctx.node.inputs[0].ndim());
    const DimRule rule{.inputs = {d, d, d},
                       .input_names = {"dy", "gate", "up"},
                       .outputs = {d, d},
                       .linear = {true, false, false}};
    return deduce_by_dims(ctx, rule, in);
  }
};

// (dy, gate, up) -> (y, dgate, dup): the forward's output recomputed for a
// consumer's weight gradient and the backward, in one pass over gate and up.
class SwigluRecomputeGradOp final : public Op {
 public:
  std::string type() const override { return "swiglu_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("swiglu_grad", in, 3);
    return {in[1], in[1], in[2]};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    for (int i = 0; i < 3; ++i) out[i] = ctx.alloc(i);
    kernels::swiglu_backward(*ctx.stream, in[0].contiguous(), in[1].contiguous(), in[2].contiguous(), out[1], out[2],
                             &out[0]);
  }
  // y: swiglu's rule on (gate, up); dgate, dup: swiglu_grad's on all three.
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    if (has_partial(in[1]) || has_partial(in[2]))
      fail_at(ctx, "gate or up is partial; insert a Reshard to reduce it first");
    if (!same_layout(in[1], in[2]))
      fail_at(ctx, "gate and up are sharded differently (", to_string(in[1]), ") vs (", to_string(in[2]),
              "); insert a Reshard");
    const std::vector<Annotation> grads = SwigluGradOp().deduce(ctx, in);
    return {in[1], grads[0], grads[1]};
  }
};

class SwigluOp final : public Op {
 public:
  std::string type() const override { return "swiglu"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("swiglu", in, 2);
    if (in[0].dtype != DType::F32 && in[0].dtype != DType::BF16)
      fail("[swiglu] gate must be f32 or bf16, got ", dtype_name(in[0].dtype));
    expect_dtype("swiglu", "up", in[1], in[0].dtype);
    expect_same_shape("swiglu", in[0], in[1]);
    return {in[0]};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::swiglu(*ctx.stream, in[0].contiguous(), in[1].contiguous(), out[0]);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    if (fused_.grad.valid() && g[0] == fused_.grad) return {fused_.dgate, fused_.dup};
    const Tensor gate = node.inputs[0], up = node.inputs[1];
    return g[0].graph()->add(std::make_shared<SwigluGradOp>(), {g[0], gate, up});
  }
  bool recompute_for_backward() const override { return true; }
  Tensor recompute_with_gradient(const Node& node, const Tensor& grad) const override {
    const Tensor gate = node.inputs[0], up = node.inputs[1];
    const std::vector<Tensor> out = grad.graph()->add(std::make_shared<SwigluRecomputeGradOp>(), {grad, gate, up});
    fused_ = Fused{grad, out[1], out[2]};
    return out[0];
  }

 private:
  // The gradients a recompute_with_gradient node made, for the gradient()
  // call that receives its `grad` (this node's; set while the backward is
  // built, which is single-threaded).
  struct Fused {
    Tensor grad, dgate, dup;
  };
  mutable Fused fused_;
};

}  // namespace

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  return gate.graph()->add1(std::make_shared<SwigluOp>(), {gate, up});
}

}  // namespace hspmd::ops
