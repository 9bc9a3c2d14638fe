// matmul: op(a2) · op(b) with a2 = a's leading dims flattened; linear is
// matmul(x, weight, trans_b = true). With trans_a (and not trans_b), b may
// share a's leading dims ([L..., N]): weight gradients contract over token
// dims as they are, whatever splits them (batch, sequence).
// Deduction: einsum over labels; the contracted dim split in both operands
// gives partial (row parallel), b's output dim split gives the output's last
// dim split (column parallel), a's leading dims pass through.
#include <algorithm>

#include "gemm_gradients.h"
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

// a's shape with its leading dims flattened: [prod(a[:-1]), a[-1]].
SymShape flat_2d(const SymShape& s) {
  SymShape lead(s.begin(), s.end() - 1);
  return {sym_numel(lead), s.back()};
}

Tensor as_2d(const Tensor& t) {
  return t.ndim() == 2 ? t : reshape(t, flat_2d(t.shape()));
}

Tensor reshape_if_needed(const Tensor& t, const SymShape& shape) {
  return t.shape() == shape ? t : reshape(t, shape);
}

// Labels: a's leading dims m0.., a's last dim k (or, with trans_a, the
// output's dim 0 "a_out" while the leading dims are contracted), b's output
// dim n. A 2-D b against trans_a rows follows a's dim 0 only.
DimRule matmul_rule(int a_rank, int b_rank, bool trans_a, bool trans_b) {
  DimRule rule;
  rule.input_names = {"a", "b"};
  rule.linear = {true, true};
  const std::vector<std::string> lead = numbered_labels("m", a_rank - 1);
  std::vector<std::string> b;
  if (!trans_a) {
    b = trans_b ? std::vector<std::string>{"n", "k"} : std::vector<std::string>{"k", "n"};
    rule.inputs = {labels_plus(lead, {"k"}), b};
    rule.outputs = {labels_plus(lead, {"n"})};
    rule.reductions["k"] = Reduction::kSum;
    return rule;
  }
  if (b_rank == 2) {
    b = trans_b ? std::vector<std::string>{"n", "m0"} : std::vector<std::string>{"m0", "n"};
    for (size_t j = 1; j < lead.size(); ++j)
      rule.unsplittable[lead[j]] = "matmul flattens a's leading dims against b's rows, so only "
                                   "a's dim 0 may be split";
  } else {
    b = labels_plus(lead, {"n"});
  }
  rule.inputs = {labels_plus(lead, {"a_out"}), b};
  rule.outputs = {{"a_out", "n"}};
  sum_over(rule, labels_plus(lead, {"m0"}));
  return rule;
}

void expect_float(const char* what, const TensorMeta& m) {
  if (m.dtype != DType::F32 && m.dtype != DType::BF16)
    fail("[matmul] ", what, " must be f32 or bf16, got ", dtype_name(m.dtype));
}

class MatmulOp final : public Op {
 public:
  MatmulOp(bool trans_a, bool trans_b, DType out) : trans_a_(trans_a), trans_b_(trans_b), out_(out) {
    if (out != DType::F32 && out != DType::BF16)
      fail("[matmul] the output must be f32 or bf16, got ", dtype_name(out));
  }
  std::string type() const override { return "matmul"; }

  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    if (in.size() != 2 && in.size() != 3) fail("[matmul] expected 2 inputs (or 3 with an addend), got ", in.size());
    expect_float("a", in[0]);
    expect_float("b", in[1]);
    const SymShape& a = in[0].shape;
    const SymShape& b = in[1].shape;
    if (a.empty()) fail("[matmul] a must have rank >= 1, got a scalar");
    const bool nd_b = trans_a_ && !trans_b_ && b.size() > 2;
    if (b.size() != 2 && !nd_b) fail("[matmul] b must be 2-D, got ", sym_shape_str(b));
    if (nd_b && (b.size() != a.size() || !std::equal(a.begin(), a.end() - 1, b.begin())))
      fail("[matmul] with trans_a, a ", sym_shape_str(a), " and b ", sym_shape_str(b),
           " must share their leading dims");
    const SymShape a2 = flat_2d(a);
    const SymShape b2 = nd_b ? flat_2d(b) : b;
    const SymDim k_a = trans_a_ ? a2[0] : a2[1];
    const SymDim k_b = trans_b_ ? b2[1] : b2[0];
    const SymDim n = trans_b_ ? b2[0] : b2[1];
    if (!(k_a == k_b))
      fail("[matmul] inner dims differ: a ", sym_shape_str(a), (trans_a_ ? "^T" : ""), " vs b ",
           sym_shape_str(b), (trans_b_ ? "^T" : ""), " (", k_a.str(), " vs ", k_b.str(), ")");
    SymShape out;
    if (trans_a_) {
      out = {a.back(), n};
    } else {
      out.assign(a.begin(), a.end() - 1);
      out.push_back(n);
    }
    if (in.size() == 3 && (out_ != DType::F32 || in[2].dtype != DType::F32 || !(in[2].shape == out)))
      fail("[matmul] the addend must be f32 of the output's shape ", sym_shape_str(out), " with an f32 output, got ",
           dtype_name(in[2].dtype), " ", sym_shape_str(in[2].shape));
    return {TensorMeta{out, out_}};
  }

  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    const NDArray& a = in[0];
    const NDArray& b = in[1];
    const NDArray addend = in.size() == 3 ? in[2].contiguous() : NDArray();
    const NDArray* add = addend.valid() ? &addend : nullptr;
    if (b.ndim() <= 2) {
      kernels::matmul(*ctx.stream, a, b, trans_a_, trans_b_, out[0], kernels::GemmCompute::kF32, add);
      return;
    }
    const int64_t n = b.dim(-1);
    kernels::matmul(*ctx.stream, a, b.contiguous().reshape({n == 0 ? 0 : b.numel() / n, n}),
                    trans_a_, trans_b_, out[0], kernels::GemmCompute::kF32, add);
  }

  // With A' = op(A), B' = op(B), C = A'B': dA' = dC B'^T and dB' = A'^T dC.
  // Without trans_a, dB' contracts a and dC over their shared leading dims
  // directly (no flattening: a reshape could not carry a sequence split).
  // Mixed precision: when an operand is bf16 the incoming gradient is rounded
  // to bf16 once here (a graph cast) rather than inside both of its GEMMs.
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    std::vector<Tensor> none(node.inputs.size());
    return gradient_into(node, g, none);
  }

  // a's gradient (without trans_a) is one GEMM of a's shape: a gradient a
  // already has from later consumers (the other projections reading the
  // same normalized input) is added by that GEMM (matmul's addend).
  std::vector<Tensor> gradient_into(const Node& node, const std::vector<Tensor>& g,
                                    std::vector<Tensor>& addends) const override {
    // Copies: adding nodes may move the graph's node storage (and `node`).
    const Tensor a = node.inputs[0], b = node.inputs[1];
    const size_t n_inputs = node.inputs.size();
    std::vector<Tensor> out = matmul_input_gradients(a, b, trans_a_, trans_b_, g[0], addends[0]);
    // An addend input's gradient is the incoming one (second order only).
    if (n_inputs == 3) out.push_back(g[0]);
    return out;
  }

  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    const DimRule rule = matmul_rule(ctx.node.inputs[0].ndim(), ctx.node.inputs[1].ndim(),
                                     trans_a_, trans_b_);
    if (in.size() == 2) return deduce_by_dims(ctx, rule, in);
    // With an addend: the product's layout, which the addend must share (as
    // add's inputs must; identical partial terms give a partial sum).
    std::vector<Annotation> out = deduce_by_dims(ctx, rule, {in[0], in[1]});
    if (!same_layout(out[0], in[2]))
      fail_at(ctx, "the addend (input 2) is sharded differently from the product (", to_string(in[2]), ") vs (",
              to_string(out[0]), "); insert a Reshard");
    return out;
  }

  // 2 m n k: every output element is a dot product over the contracted dim
  // (a's last dim, or with trans_a its leading dims).
  double flops(const std::vector<Shape>& in, const std::vector<Shape>& out, const ShardContext*) const override {
    const Shape& a = in.at(0);
    const int64_t k = a.empty() ? 0 : trans_a_ ? shape_numel(a) / std::max<int64_t>(a.back(), 1) : a.back();
    return 2.0 * static_cast<double>(shape_numel(out.at(0))) * static_cast<double>(k);
  }

 private:
  bool trans_a_;
  bool trans_b_;
  DType out_;
};

}  // namespace

std::vector<Tensor> matmul_input_gradients(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
                                           const Tensor& g, Tensor& fold) {
  const bool bf16 = a.dtype() == DType::BF16 || b.dtype() == DType::BF16;
  const Tensor dc = bf16 ? cast(g, DType::BF16) : g;
  const SymShape a_shape = a.shape(), b_shape = b.shape();
  const bool folds = !trans_a && fold.valid() && fold.dtype() == DType::F32 && fold.shape() == a_shape;
  // a's gradient in bf16 where that is all of it and a's producer reads it
  // rounded anyway (o_proj's input, attention's bf16 output on a GPU).
  const DType da_dtype = !trans_a && !folds && bf16 && ops::gradient_rounded(a) ? DType::BF16 : DType::F32;
  Tensor da = trans_a ? reshape_if_needed(matmul(b, as_2d(dc), trans_b, true), a_shape)
              : folds ? a.graph()->add1(std::make_shared<MatmulOp>(false, !trans_b, DType::F32), {dc, b, fold})
                      : matmul(dc, b, false, !trans_b, da_dtype);
  if (folds) fold = Tensor();
  // b's gradient reads a: a cheap producer's output is made again here
  // instead of being kept from the forward (recompute_for_backward), with
  // the producer's own backward in the same pass where da is all of a's
  // gradient.
  const Tensor a_again = ops::recompute_for_backward(a, da);
  if (!trans_a && a.ndim() >= 2)
    return {da, trans_b ? matmul(dc, a_again, true, false) : matmul(a_again, dc, true, false)};
  Tensor db = trans_b ? matmul(as_2d(dc), as_2d(a_again), true, trans_a)
                      : reshape_if_needed(matmul(a_again, as_2d(dc), !trans_a, false), b_shape);
  return {da, db};
}

Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, DType out) {
  return a.graph()->add1(std::make_shared<MatmulOp>(trans_a, trans_b, out), {a, b});
}

Tensor linear(const Tensor& x, const Tensor& weight, DType out) {
  return matmul(x, weight, false, true, out);
}

}  // namespace hspmd::ops
