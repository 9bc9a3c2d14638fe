// add_bias: y = x[..., N] + bias[N], the bias broadcast over x's leading dims
// (the biases of Qwen2's q/k/v projections). Its gradient: dx = dy, and
// dbias = dy summed over the leading dims by the bias_grad op.
//
// Deduction: y is annotated like x. The bias shares x's last dim (label n):
// where x is split along it (the outputs of a column-parallel projection),
// the bias must be split along dim 0 alike (same degree and chunk on every
// device; across subgroups the same proportions); where x is split along
// leading dims (data, sequence parallel) the bias is dup. No partial input:
// x + bias is not linear in x (the bias would be added once per partial
// term), nor in the bias, so a partial x or bias must be reduced by a
// Reshard first, as for rms_norm. bias_grad is linear in dy and sums over
// the token dims: dbias is partial where the tokens are split (hdim -2 when
// they are cut across subgroups; gradient sync reduces it, like rms_norm's
// weight gradient) and split along dim 0 like dy's last dim.
#include "gemm_gradients.h"
#include "hspmd/ops/ops.h"
#include "kernels/kernels.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

// Labels: tokens t0.. (x's leading dims), n (its last dim, the bias's dim 0).
std::vector<std::string> x_labels(int x_rank) {
  return labels_plus(numbered_labels("t", x_rank - 1), {"n"});
}

// dy [..., N] -> dbias [N].
class BiasGradOp final : public Op {
 public:
  std::string type() const override { return "bias_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("bias_grad", in, 1);
    expect_dtype("bias_grad", "dy", in[0], DType::F32);
    if (in[0].shape.empty()) fail("[bias_grad] dy must have rank >= 1, got a scalar");
    return {TensorMeta{{in[0].shape.back()}, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::bias_grad(*ctx.stream, in[0].contiguous(), out[0]);
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    const int rank = ctx.node.inputs[0].ndim();
    DimRule rule{.inputs = {x_labels(rank)},
                 .input_names = {"dy"},
                 .outputs = {{"n"}},
                 .linear = {true}};
    sum_over(rule, numbered_labels("t", rank - 1));
    return deduce_by_dims(ctx, rule, in);
  }
  // One add per element of dy (the default counts the [N] output only).
  double flops(const std::vector<Shape>& in, const std::vector<Shape>&,
               const ShardContext*) const override {
    return static_cast<double>(shape_numel(in[0]));
  }
};

class AddBiasOp final : public Op {
 public:
  std::string type() const override { return "add_bias"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("add_bias", in, 2);
    expect_dtype("add_bias", "x", in[0], DType::F32);
    expect_dtype("add_bias", "bias", in[1], DType::F32);
    const SymShape& x = in[0].shape;
    const SymShape& b = in[1].shape;
    if (x.empty() || b.size() != 1 || !(x.back() == b[0]))
      fail("[add_bias] bias must be [N] with N the last dim of x: x ", sym_shape_str(x),
           ", bias ", sym_shape_str(b));
    return {in[0]};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::add_bias(*ctx.stream, in[0].contiguous(), in[1].contiguous(), out[0]);
  }
  std::vector<Tensor> gradient(const Node&, const std::vector<Tensor>& g) const override {
    if (!g[0].valid()) return {Tensor(), Tensor()};
    // dx is the incoming gradient as it comes (bf16 where attention's
    // gradients are, on a GPU: the projection's GEMMs read that); dbias
    // sums it in f32.
    return {g[0], bias_gradient(g[0])};
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    static const char* const kNames[] = {"x", "bias"};
    for (int i = 0; i < 2; ++i)
      if (has_partial(in[i]))
        fail_at(ctx, "input ", i, " (", kNames[i], ") is partial; a bias is added to the whole ",
                "value, not to each partial term: insert a Reshard to reduce it first");
    const auto x = x_labels(ctx.node.inputs[0].ndim());
    const DimRule rule{.inputs = {x, {"n"}}, .input_names = {"x", "bias"}, .outputs = {x}};
    return deduce_by_dims(ctx, rule, in);
  }
};

}  // namespace

Tensor bias_gradient(const Tensor& dy) {
  return dy.graph()->add1(std::make_shared<BiasGradOp>(), {cast(dy, DType::F32)});
}

Tensor add_bias(const Tensor& x, const Tensor& bias) {
  return x.graph()->add1(std::make_shared<AddBiasOp>(), {x, bias});
}

}  // namespace hspmd::ops
