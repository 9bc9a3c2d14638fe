// add: elementwise a + b (same shapes) in f32; a and b may be bf16
// (widened exactly in the kernel: a bf16 branch joins the f32 residual
// stream, and a bf16 block input is read as it is, without a cast pass).
// b's gradient is rounded to b's dtype, as a cast's would be; a's is f32
// whatever a holds (the residual stream's gradient, which the norm reading
// the same block input adds to its dx before rounding once, as a widening
// cast's gradient did). The output may be bf16 (the f32 sum rounded once:
// add then cast in one pass); a's gradient is then the output's as it is
// (bf16 values: the norm that reads a widens it in its own pass).
// Deduction: the default elementwise
// rule (identical annotations); linear, so identical partial inputs give a
// partial output.
#include "hspmd/ops/ops.h"
#include "kernels/kernels.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

class AddOp final : public Op {
 public:
  explicit AddOp(DType out_dtype) : out_dtype_(out_dtype) {}
  std::string type() const override { return "add"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("add", in, 2);
    if (in[0].dtype != DType::F32 && in[0].dtype != DType::BF16)
      fail("[add] a must be f32 or bf16, got ", dtype_name(in[0].dtype));
    if (in[1].dtype != DType::F32 && in[1].dtype != DType::BF16)
      fail("[add] b must be f32 or bf16, got ", dtype_name(in[1].dtype));
    expect_same_shape("add", in[0], in[1]);
    return {TensorMeta{in[0].shape, out_dtype_}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::add(*ctx.stream, in[0], in[1], out[0]);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    // A bf16 output (a block boundary): its gradient comes back bf16, and
    // a's is that gradient as it is; the norm that reads a folds it into
    // its backward pass, widening it there, instead of a widening pass here.
    const Tensor ga = out_dtype_ == DType::BF16 ? g[0] : cast(g[0], DType::F32);
    return {ga, cast(g[0], node.inputs[1].dtype())};
  }
  // Linear with a bf16 output too, as cast is taken to be: the rounding is
  // the one a cast after the add would apply.
  bool is_linear() const override { return true; }

 private:
  DType out_dtype_;
};

}  // namespace

Tensor add(const Tensor& a, const Tensor& b, DType out_dtype) {
  if (out_dtype != DType::F32 && out_dtype != DType::BF16)
    fail("[add] out_dtype must be f32 or bf16, got ", dtype_name(out_dtype));
  return a.graph()->add1(std::make_shared<AddOp>(out_dtype), {a, b});
}

}  // namespace hspmd::ops
