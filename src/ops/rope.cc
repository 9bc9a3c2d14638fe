// rope: rotary position embedding (Hugging Face rotate_half convention). The
// gradient is the inverse rotation: the same op with the angle negated. x is
// f32 or bf16 (read exactly); the output f32 or bf16 (rounded once: the
// attention input of the bf16 graph); the gradient f32, or bf16 when the
// incoming one is (attention's bf16 gradients on a GPU).
// Deduction: linear in x; positions must be split like x's [B, S] dims; the
// head dim must be whole (rotate_half pairs its two halves). rope_qk: rope
// of q and of k in one op (one kernel call), each with rope's rule and bits.
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

DimRule rope_rule() {
  DimRule rule{.inputs = {{"b", "s", "h", "d"}, {"b", "s"}},
               .input_names = {"x", "positions"},
               .outputs = {{"b", "s", "h", "d"}},
               .linear = {true, false}};
  rule.unsplittable["d"] = "rope rotates pairs across its two halves";
  return rule;
}

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
    return deduce_by_dims(ctx, rope_rule(), in);
  }

 private:
  float theta_;
  bool inverse_;
  DType out_;
};

// (q, k, positions) -> (rope(q), rope(k)): RopeOp on both in one kernel call
// (one cos/sin table and one launch on a GPU), its bits; the gradient
// likewise, one op for both when both come.
class RopeQkOp final : public Op {
 public:
  RopeQkOp(float theta, bool inverse, DType out) : theta_(theta), inverse_(inverse), out_(out) {}
  std::string type() const override { return "rope_qk"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("rope_qk", in, 3);
    const RopeOp one(theta_, inverse_, out_);
    const TensorMeta q = one.infer({in[0], in[2]})[0], k = one.infer({in[1], in[2]})[0];
    if (!(in[0].shape[3] == in[1].shape[3]))
      fail("[rope_qk] q and k must share the head dim: q ", sym_shape_str(in[0].shape), ", k ",
           sym_shape_str(in[1].shape));
    return {q, k};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    out[1] = ctx.alloc(1);
    kernels::rope_qk(*ctx.stream, in[0].contiguous(), in[1].contiguous(), in[2].contiguous(), theta_, inverse_,
                     out[0], out[1]);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    const Tensor positions = node.inputs[2];
    // RopeOp's gradient dtype: bf16 where the incoming gradient is.
    const auto dtype = [](const Tensor& t) { return t.dtype() == DType::BF16 ? DType::BF16 : DType::F32; };
    if (g[0].valid() && g[1].valid() && dtype(g[0]) == dtype(g[1])) {
      const std::vector<Tensor> r = g[0].graph()->add(
          std::make_shared<RopeQkOp>(theta_, !inverse_, dtype(g[0])), {g[0], g[1], positions});
      return {r[0], r[1], Tensor()};
    }
    std::vector<Tensor> out(3);
    for (int i : {1, 0})  // k's first, as the separate ops' backward reached them
      if (g[i].valid())
        out[i] = g[i].graph()->add1(std::make_shared<RopeOp>(theta_, !inverse_, dtype(g[i])), {g[i], positions});
    return out;
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    const DimRule rule = rope_rule();
    return {deduce_by_dims(ctx, rule, {in[0], in[2]})[0], deduce_by_dims(ctx, rule, {in[1], in[2]})[0]};
  }

 private:
  float theta_;
  bool inverse_;
  DType out_;
};

}  // namespace

RopeQk rope_qk(const Tensor& q, const Tensor& k, const Tensor& positions, float theta, DType out) {
  if (out != DType::F32 && out != DType::BF16) fail("[rope] the output must be f32 or bf16, got ", dtype_name(out));
  const std::vector<Tensor> r = q.graph()->add(std::make_shared<RopeQkOp>(theta, false, out), {q, k, positions});
  return RopeQk{r[0], r[1]};
}

Tensor rope(const Tensor& x, const Tensor& positions, float theta, DType out) {
  if (out != DType::F32 && out != DType::BF16) fail("[rope] the output must be f32 or bf16, got ", dtype_name(out));
  return x.graph()->add1(std::make_shared<RopeOp>(theta, false, out), {x, positions});
}

}  // namespace hspmd::ops
