// linear_bias: x[..., K] · weight[N, K]^T + bias[N], written in `out` (f32
// or bf16) by one kernel call (kernels::matmul with a bias epilogue): the
// f32 product plus the bias in f32, rounded once, the bits of the chain
// cast(add_bias(linear(x, weight, f32), bias), out) it replaces (Qwen2's
// q/k/v projections) without its two passes over the f32 product.
//
// Deduction: linear's followed by add_bias's, as one rule. weight's rows
// (n) are out's last dim and the bias's dim 0: a column-parallel split cuts
// all three alike; token splits of x pass through with the bias dup. The
// chain refuses a partial product (a bias is added to the whole value, not
// to each partial term), so here no input may be partial and the contracted
// dim (k) may not be split (row parallel would make the product partial).
// Gradient: the nodes of the chain's gradients, in their order: cast's (the
// incoming gradient widened to f32 where out is bf16), add_bias's bias
// gradient, then matmul's (gemm_gradients.h): the backward's bits as before.
#include "gemm_gradients.h"
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

void expect_float(const char* what, const TensorMeta& m) {
  if (m.dtype != DType::F32 && m.dtype != DType::BF16)
    fail("[linear_bias] ", what, " must be f32 or bf16, got ", dtype_name(m.dtype));
}

class LinearBiasOp final : public Op {
 public:
  explicit LinearBiasOp(DType out) : out_(out) {
    if (out != DType::F32 && out != DType::BF16)
      fail("[linear_bias] the output must be f32 or bf16, got ", dtype_name(out));
  }
  std::string type() const override { return "linear_bias"; }

  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("linear_bias", in, 3);
    expect_float("x", in[0]);
    expect_float("weight", in[1]);
    expect_dtype("linear_bias", "bias", in[2], DType::F32);
    const SymShape& x = in[0].shape;
    const SymShape& w = in[1].shape;
    const SymShape& b = in[2].shape;
    if (x.empty() || w.size() != 2 || !(x.back() == w[1]))
      fail("[linear_bias] x [..., K] and weight [N, K] do not fit: x ", sym_shape_str(x), ", weight ",
           sym_shape_str(w));
    if (b.size() != 1 || !(b[0] == w[0]))
      fail("[linear_bias] bias must be [N] with N weight's dim 0: weight ", sym_shape_str(w), ", bias ",
           sym_shape_str(b));
    SymShape out(x.begin(), x.end() - 1);
    out.push_back(w[0]);
    return {TensorMeta{out, out_}};
  }

  void compute(const OpContext& ctx, const std::vector<NDArray>& in, std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    const NDArray bias = in[2].contiguous();
    kernels::matmul(*ctx.stream, in[0], in[1], false, true, out[0], kernels::GemmCompute::kF32,
                    kernels::GemmEpilogue::with_bias(&bias));
  }

  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    std::vector<Tensor> none(node.inputs.size());
    return gradient_into(node, g, none);
  }

  std::vector<Tensor> gradient_into(const Node& node, const std::vector<Tensor>& g,
                                    std::vector<Tensor>& addends) const override {
    if (!g[0].valid()) return {Tensor(), Tensor(), Tensor()};
    // Copies: adding nodes may move the graph's node storage (and `node`).
    const Tensor x = node.inputs[0], weight = node.inputs[1];
    // The chain's cast existed only with a bf16 out; add_bias passed its
    // incoming gradient on as it came.
    const Tensor dy = out_ == DType::F32 ? g[0] : cast(g[0], DType::F32);
    const Tensor dbias = bias_gradient(dy);
    std::vector<Tensor> out = matmul_input_gradients(x, weight, false, true, dy, addends[0]);
    out.push_back(dbias);
    return out;
  }

  std::vector<Annotation> deduce(const DeduceContext& ctx, const std::vector<Annotation>& in) const override {
    static const char* const kNames[] = {"x", "weight", "bias"};
    for (int i = 0; i < 3; ++i)
      if (has_partial(in[i]))
        fail_at(ctx, "input ", i, " (", kNames[i], ") is partial; a bias is added to the whole product, ",
                "not to each partial term: insert a Reshard to reduce it first");
    const std::vector<std::string> lead = numbered_labels("t", ctx.node.inputs[0].ndim() - 1);
    DimRule rule{.inputs = {labels_plus(lead, {"k"}), {"n", "k"}, {"n"}},
                 .input_names = {"x", "weight", "bias"},
                 .outputs = {labels_plus(lead, {"n"})}};
    rule.unsplittable["k"] =
        "a split of the contracted dim (row parallel) makes the product partial, and a bias is added to "
        "the whole product: use linear, a Reshard and add_bias";
    return deduce_by_dims(ctx, rule, in);
  }

  // The chain's work: 2 m n k for the product, one add per output element
  // for the bias (the rounding is memory traffic, no flops).
  double flops(const std::vector<Shape>& in, const std::vector<Shape>& out, const ShardContext*) const override {
    const Shape& x = in.at(0);
    const double elements = static_cast<double>(shape_numel(out.at(0)));
    return elements * (2.0 * static_cast<double>(x.empty() ? 0 : x.back()) + 1.0);
  }

 private:
  DType out_;
};

}  // namespace

Tensor linear_bias(const Tensor& x, const Tensor& weight, const Tensor& bias, DType out) {
  return x.graph()->add1(std::make_shared<LinearBiasOp>(out), {x, weight, bias});
}

}  // namespace hspmd::ops
