// scale: a * factor for a constant factor. Deduction: the default rule
// (copies the input's annotation); linear, so partial stays partial.
#include "hspmd/ops/ops.h"
#include "kernels/kernels.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

class ScaleOp final : public Op {
 public:
  explicit ScaleOp(float factor) : factor_(factor) {}
  std::string type() const override { return "scale"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("scale", in, 1);
    expect_dtype("scale", "a", in[0], DType::F32);
    return {in[0]};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::scale(*ctx.stream, in[0], factor_, out[0]);
  }
  std::vector<Tensor> gradient(const Node&, const std::vector<Tensor>& g) const override {
    return {scale(g[0], factor_)};
  }
  bool is_linear() const override { return true; }

 private:
  float factor_;
};

}  // namespace

Tensor scale(const Tensor& a, float factor) {
  return a.graph()->add1(std::make_shared<ScaleOp>(factor), {a});
}

}  // namespace hspmd::ops
