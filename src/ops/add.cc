// add: elementwise a + b (same shapes), f32; b may be bf16 (widened
// exactly in the kernel: a bf16 branch joins the f32 residual stream
// without a cast pass), its gradient then rounded to bf16 as a cast's would
// be. Deduction: the default elementwise
// rule (identical annotations); linear, so identical partial inputs give a
// partial output.
#include "hspmd/ops/ops.h"
#include "kernels/kernels.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

class AddOp final : public Op {
 public:
  std::string type() const override { return "add"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("add", in, 2);
    expect_dtype("add", "a", in[0], DType::F32);
    if (in[1].dtype != DType::F32 && in[1].dtype != DType::BF16)
      fail("[add] b must be f32 or bf16, got ", dtype_name(in[1].dtype));
    expect_same_shape("add", in[0], in[1]);
    return {in[0]};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::add(*ctx.stream, in[0], in[1], out[0]);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    return {g[0], cast(g[0], node.inputs[1].dtype())};
  }
  bool is_linear() const override { return true; }
};

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  return a.graph()->add1(std::make_shared<AddOp>(), {a, b});
}

}  // namespace hspmd::ops
