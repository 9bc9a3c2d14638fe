// mul: elementwise a * b (same shapes). Deduction: a and b sharded alike on
// every dim; bilinear, so one of them (not both) may be partial.
#include "hspmd/ops/ops.h"
#include "kernels/kernels.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

class MulOp final : public Op {
 public:
  std::string type() const override { return "mul"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("mul", in, 2);
    expect_dtype("mul", "a", in[0], DType::F32);
    expect_dtype("mul", "b", in[1], DType::F32);
    expect_same_shape("mul", in[0], in[1]);
    return {in[0]};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::mul(*ctx.stream, in[0], in[1], out[0]);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    const Tensor a = node.inputs[0], b = node.inputs[1];
    return {mul(g[0], b), mul(g[0], a)};
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    const auto labels = numbered_labels("d", ctx.node.inputs[0].ndim());
    const DimRule rule{.inputs = {labels, labels},
                       .input_names = {"a", "b"},
                       .outputs = {labels},
                       .linear = {true, true}};
    return deduce_by_dims(ctx, rule, in);
  }
};

}  // namespace

Tensor mul(const Tensor& a, const Tensor& b) {
  return a.graph()->add1(std::make_shared<MulOp>(), {a, b});
}

}  // namespace hspmd::ops
