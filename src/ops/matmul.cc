// matmul: op(a2) · op(b) with a2 = a's leading dims flattened; linear is
// matmul(x, weight, trans_b = true).
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

class MatmulOp final : public Op {
 public:
  MatmulOp(bool trans_a, bool trans_b) : trans_a_(trans_a), trans_b_(trans_b) {}
  std::string type() const override { return "matmul"; }

  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("matmul", in, 2);
    expect_dtype("matmul", "a", in[0], DType::F32);
    expect_dtype("matmul", "b", in[1], DType::F32);
    const SymShape& a = in[0].shape;
    const SymShape& b = in[1].shape;
    if (a.empty()) fail("[matmul] a must have rank >= 1, got a scalar");
    if (b.size() != 2) fail("[matmul] b must be 2-D, got ", sym_shape_str(b));
    const SymShape a2 = flat_2d(a);
    const SymDim k_a = trans_a_ ? a2[0] : a2[1];
    const SymDim k_b = trans_b_ ? b[1] : b[0];
    const SymDim n = trans_b_ ? b[0] : b[1];
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
    return {TensorMeta{out, DType::F32}};
  }

  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::matmul(in[0], in[1], trans_a_, trans_b_, out[0]);
  }

  // With A' = op(A), B' = op(B), C = A'B': dA' = dC B'^T and dB' = A'^T dC.
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    const Tensor a = node.inputs[0], b = node.inputs[1], dc = g[0];
    const SymShape a_shape = a.shape(), b_shape = b.shape();
    Tensor da = trans_a_ ? reshape_if_needed(matmul(b, as_2d(dc), trans_b_, true), a_shape)
                         : matmul(dc, b, false, !trans_b_);
    Tensor db = trans_b_ ? matmul(as_2d(dc), as_2d(a), true, trans_a_)
                         : reshape_if_needed(matmul(a, as_2d(dc), !trans_a_, false), b_shape);
    return {da, db};
  }

 private:
  bool trans_a_;
  bool trans_b_;
};

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  return a.graph()->add1(std::make_shared<MatmulOp>(trans_a, trans_b), {a, b});
}

Tensor linear(const Tensor& x, const Tensor& weight) { return matmul(x, weight, false, true); }

}  // namespace hspmd::ops
