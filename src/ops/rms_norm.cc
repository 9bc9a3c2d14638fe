// rms_norm: x[..., H] * rsqrt(mean(x^2) + eps) * weight[H]. The backward is
// one fused op producing dx and dweight. add_rms_norm: a residual add and the
// norm of its sum in one op (two outputs), the two ops' bits. Deduction: the hidden dim must be
// whole, token dims pass, no partial input (the op is not linear);
// rms_norm_grad is linear in dy and sums dweight over the token dims (a
// partial weight gradient when tokens are split).
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

// Labels: tokens t0.., hidden h; inputs (dy,) x, weight.
DimRule norm_rule(int x_rank, bool backward) {
  const auto tokens = numbered_labels("t", x_rank - 1);
  const auto x = labels_plus(tokens, {"h"});
  DimRule rule;
  if (backward) {
    rule = DimRule{.inputs = {x, x, {"h"}},
                   .input_names = {"dy", "x", "weight"},
                   .outputs = {x, {"h"}},
                   .linear = {true, false, false}};
    sum_over(rule, tokens);
  } else {
    rule = DimRule{.inputs = {x, {"h"}}, .input_names = {"x", "weight"}, .outputs = {x}};
  }
  rule.unsplittable["h"] = "rms_norm normalizes over it";
  return rule;
}

// (dy, x, weight[, addend]) -> (dx [+ addend], dweight[, dx in bf16]). The
// addend is x's gradient from its other consumers (the residual stream's),
// added to dx in the same pass instead of by a separate add; dx comes out
// in x's dtype (a bf16 block input's gradient is the f32 sum rounded once).
// With `rounded` (an f32 x), a third output: dx rounded to bf16 in the same
// pass, the bits of a cast of dx (add_rms_norm's gradient of its bf16
// branch, which a cast pass made from dx before).
class RmsNormGradOp final : public Op {
 public:
  explicit RmsNormGradOp(float eps, bool rounded = false) : eps_(eps), rounded_(rounded) {}
  std::string type() const override { return "rms_norm_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    if (in.size() != 3 && in.size() != 4)
      fail("[rms_norm_grad] expected 3 inputs (or 4 with an addend), got ", in.size());
    if (in.size() == 4 && ((in[3].dtype != DType::F32 && in[3].dtype != DType::BF16) || !(in[3].shape == in[1].shape)))
      fail("[rms_norm_grad] the addend must be f32 or bf16 of x's shape ", sym_shape_str(in[1].shape), ", got ",
           dtype_name(in[3].dtype), " ", sym_shape_str(in[3].shape));
    if (!rounded_) return {in[1], in[2]};  // dx in x's dtype (a bf16 one rounded once, the addend added)
    if (in[1].dtype != DType::F32) fail("[rms_norm_grad] a bf16 copy of dx needs an f32 x, got ", dtype_name(in[1].dtype));
    return {in[1], in[2], TensorMeta{in[1].shape, DType::BF16}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    out[1] = ctx.alloc(1);
    if (rounded_) out[2] = ctx.alloc(2);
    const NDArray addend = in.size() == 4 ? in[3].contiguous() : NDArray();
    kernels::rms_norm_backward(*ctx.stream, in[0].contiguous(), in[1].contiguous(), in[2].contiguous(), eps_,
                               out[0], out[1], addend.valid() ? &addend : nullptr, rounded_ ? &out[2] : nullptr);
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    const DimRule rule = norm_rule(ctx.node.inputs[1].ndim(), true);
    // With an addend: dx's layout, which the addend must share (as add's
    // inputs must; identical partial terms give a partial sum).
    std::vector<Annotation> out = deduce_by_dims(ctx, rule, {in[0], in[1], in[2]});
    if (in.size() == 4 && !same_layout(out[0], in[3]))
      fail_at(ctx, "the addend (input 3) is sharded differently from dx (", to_string(in[3]), ") vs (",
              to_string(out[0]), "); insert a Reshard");
    if (rounded_) out.push_back(out[0]);  // the bf16 copy: dx's layout
    return out;
  }

 private:
  float eps_;
  bool rounded_;
};

class RmsNormOp final : public Op {
 public:
  RmsNormOp(float eps, DType out) : eps_(eps), out_(out) {}
  std::string type() const override { return "rms_norm"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("rms_norm", in, 2);
    if (in[0].dtype != DType::F32 && in[0].dtype != DType::BF16)
      fail("[rms_norm] x must be f32 or bf16, got ", dtype_name(in[0].dtype));
    expect_dtype("rms_norm", "weight", in[1], DType::F32);
    const SymShape& x = in[0].shape;
    const SymShape& w = in[1].shape;
    if (x.empty() || w.size() != 1 || !(x.back() == w[0]))
      fail("[rms_norm] weight must be [H] with H the last dim of x: x ", sym_shape_str(x),
           ", weight ", sym_shape_str(w));
    return {TensorMeta{x, out_}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::rms_norm(*ctx.stream, in[0].contiguous(), in[1].contiguous(), eps_, out[0]);
  }
  // dx in x's dtype (f32, or bf16 rounded once), dweight f32; a bf16 dy is
  // widened.
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    std::vector<Tensor> none(node.inputs.size());
    return gradient_into(node, g, none);
  }
  // x's gradient from its other consumer (the residual add after the
  // norm's block) is added to dx by the backward kernel itself.
  std::vector<Tensor> gradient_into(const Node& node, const std::vector<Tensor>& g,
                                    std::vector<Tensor>& addends) const override {
    const Tensor x = node.inputs[0], w = node.inputs[1];
    std::vector<Tensor> in = {cast(g[0], DType::F32), x, w};
    Tensor& fold = addends[0];
    if (fold.valid() && (fold.dtype() == DType::F32 || fold.dtype() == DType::BF16) && fold.shape() == x.shape()) {
      in.push_back(fold);
      fold = Tensor();
    }
    return g[0].graph()->add(std::make_shared<RmsNormGradOp>(eps_), in);
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    return deduce_by_dims(ctx, norm_rule(ctx.node.inputs[0].ndim(), false), in);
  }

 private:
  float eps_;
  DType out_;
};

// (a, b, weight) -> (sum = a + b in `sum_dtype`, rms_norm(sum) in `out`):
// the residual add and the norm that reads its sum, one kernel pass (the
// GPU's kernel reads a and b once and writes both; the separate norm read
// the sum again). The same bits as AddOp followed by RmsNormOp, forward and
// backward: the CPU kernel runs those two kernels, and gradient() appends
// the nodes their gradients would, in their order, except that the bf16
// branch's gradient (AddOp's cast of the sum's gradient) comes from the
// norm's backward pass itself where that gradient is its dx.
class AddRmsNormOp final : public Op {
 public:
  AddRmsNormOp(float eps, DType sum, DType out) : eps_(eps), sum_(sum), out_(out) {}
  std::string type() const override { return "add_rms_norm"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("add_rms_norm", in, 3);
    for (int i : {0, 1})
      if (in[i].dtype != DType::F32 && in[i].dtype != DType::BF16)
        fail("[add_rms_norm] ", i == 0 ? "a" : "b", " must be f32 or bf16, got ", dtype_name(in[i].dtype));
    expect_same_shape("add_rms_norm", in[0], in[1]);
    expect_dtype("add_rms_norm", "weight", in[2], DType::F32);
    const SymShape& x = in[0].shape;
    const SymShape& w = in[2].shape;
    if (x.empty() || w.size() != 1 || !(x.back() == w[0]))
      fail("[add_rms_norm] weight must be [H] with H the last dim of a and b: a ", sym_shape_str(x), ", weight ",
           sym_shape_str(w));
    return {TensorMeta{x, sum_}, TensorMeta{x, out_}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    out[1] = ctx.alloc(1);
    kernels::add_rms_norm(*ctx.stream, in[0].contiguous(), in[1].contiguous(), in[2].contiguous(), eps_, out[0],
                          out[1]);
  }
  // RmsNormOp's gradient (the sum's gradient from its other readers folded
  // into the norm's backward as its addend), then AddOp's.
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    const Tensor b = node.inputs[1], w = node.inputs[2], sum = node.output(0);
    Tensor gsum = g[0], dw;
    if (g[1].valid()) {
      std::vector<Tensor> in = {cast(g[1], DType::F32), sum, w};
      const bool fold = gsum.valid() && (gsum.dtype() == DType::F32 || gsum.dtype() == DType::BF16) &&
                        gsum.shape() == sum.shape();
      if (fold) in.push_back(gsum);
      // The sum's whole gradient is dx (folded, or no other reader): the
      // bf16 branch's gradient (AddOp's cast of it) is written in the same
      // pass.
      const bool rounded = (fold || !gsum.valid()) && sum_ == DType::F32 && b.dtype() == DType::BF16;
      const std::vector<Tensor> r = g[1].graph()->add(std::make_shared<RmsNormGradOp>(eps_, rounded), in);
      dw = r[1];
      if (rounded) return {r[0], r[2], dw};  // a's: cast(dx, f32) is dx
      gsum = fold || !gsum.valid() ? r[0] : add(gsum, r[0]);
    }
    if (!gsum.valid()) return {Tensor(), Tensor(), dw};
    const Tensor ga = sum_ == DType::BF16 ? gsum : cast(gsum, DType::F32);
    return {ga, cast(gsum, b.dtype()), dw};
  }
  // a and b identically laid out (as add's default rule wants), the norm's
  // rule on a and the weight; the sum is laid out as the norm's output.
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    if (!same_layout(in[0], in[1]))
      fail_at(ctx, "a and b (inputs 0 and 1) are sharded differently: (", to_string(in[0]), ") vs (",
              to_string(in[1]), "); insert a Reshard");
    const std::vector<Annotation> y = deduce_by_dims(ctx, norm_rule(ctx.node.inputs[0].ndim(), false), {in[0], in[2]});
    return {y[0], y[0]};
  }

 private:
  float eps_;
  DType sum_, out_;
};

}  // namespace

AddRmsNorm add_rms_norm(const Tensor& a, const Tensor& b, const Tensor& weight, float eps, DType sum_dtype,
                        DType out) {
  for (DType t : {sum_dtype, out})
    if (t != DType::F32 && t != DType::BF16)
      fail("[add_rms_norm] the sum and the output must be f32 or bf16, got ", dtype_name(t));
  const std::vector<Tensor> r = a.graph()->add(std::make_shared<AddRmsNormOp>(eps, sum_dtype, out), {a, b, weight});
  return AddRmsNorm{r[0], r[1]};
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, float eps, DType out) {
  if (out != DType::F32 && out != DType::BF16)
    fail("[rms_norm] the output must be f32 or bf16, got ", dtype_name(out));
  return x.graph()->add1(std::make_shared<RmsNormOp>(eps, out), {x, weight});
}

}  // namespace hspmd::ops
