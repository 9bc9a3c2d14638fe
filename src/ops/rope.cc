// rope: rotary position embedding (Hugging Face rotate_half convention). The
// gradient is the inverse rotation: the same op with the angle negated. x is
// f32 or bf16 (read exactly); the output f32 or bf16 (rounded once: the
// attention input of the bf16 graph); the gradient f32, or bf16 when the
// incoming one is (attention's bf16 gradients on a GPU).
// Deduction: linear in x; positions must be split like x's [B, S] dims; the
// head dim must be whole (rotate_half pairs its two halves).
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

class RopeOp final : public Op {
 public:
  RopeOp(float theta, bool inverse, DType out) : theta_(theta), inverse_(inverse), out_(out) {}
  std::string type() const override { return "rope"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("rope", in, 2);
    if (in[0].dtype != DType::F32 && in[0].dtype != DType::BF16)
      fail("[rope] x must be f32 or bf16, got ", dtype_name(in[0].dtype));
    expect_dtype("rope", "positions", in[1], DType::I32);
    const SymShape& x = in[0].shape;
    const SymShape& p = in[1].shape;
    if (x.size() != 4 || p.size() != 2 || !(x[0] == p[0]) || !(x[1] == p[1]))
      fail("[rope] x must be [B, S, heads, D] and positions [B, S]: x ", sym_shape_str(x),
           ", positions ", sym_shape_str(p));
    if (!x[3].is_const() || x[3].value() % 2 != 0)
      fail("[rope] head dim ", x[3].str(), " must be a constant even number");
    return {TensorMeta{in[0].shape, out_}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::rope(*ctx.stream, in[0].contiguous(), in[1].contiguous(), theta_, inverse_, out[0]);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    const Tensor positions = node.inputs[1];
    // The rotation back, in f32, of the gradient as it comes: a bf16 one
    // (attention's on a GPU) is read as it is and the result rounded once
    // to bf16, the operand the projections' GEMMs read (the bits of an f32
    // gradient then a cast, without the f32 array and the pass).
    const DType dtype = g[0].dtype() == DType::BF16 ? DType::BF16 : DType::F32;
    auto op = std::make_shared<RopeOp>(theta_, !inverse_, dtype);
    return {g[0].graph()->add1(op, {g[0], positions}), Tensor()};
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    DimRule rule{.inputs = {{"b", "s", "h", "d"}, {"b", "s"}},
                 .input_names = {"x", "positions"},
                 .outputs = {{"b", "s", "h", "d"}},
                 .linear = {true, false}};
    rule.unsplittable["d"] = "rope rotates pairs across its two halves";
    return deduce_by_dims(ctx, rule, in);
  }

 private:
  float theta_;
  bool inverse_;
  DType out_;
};

}  // namespace

Tensor rope(const Tensor& x, const Tensor& positions, float theta, DType out) {
  if (out != DType::F32 && out != DType::BF16) fail("[rope] the output must be f32 or bf16, got ", dtype_name(out));
  return x.graph()->add1(std::make_shared<RopeOp>(theta, false, out), {x, positions});
}

}  // namespace hspmd::ops
