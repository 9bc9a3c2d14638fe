// add: elementwise a + b (same shapes). Deduction: the default elementwise
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
    expect_dtype("add", "b", in[1], DType::F32);
    expect_same_shape("add", in[0], in[1]);
    return {in[0]};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::add(*ctx.stream, in[0], in[1], out[0]);
  }
  std::vector<Tensor> gradient(const Node&, const std::vector<Tensor>& g) const override {
    return {g[0], g[0]};
  }
  bool is_linear() const override { return true; }
};

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  return a.graph()->add1(std::make_shared<AddOp>(), {a, b});
}

}  // namespace hspmd::ops
