// cast: the same values in another floating-point dtype (f32 <-> bf16;
// to bf16 rounds to nearest even). Mixed precision (docs/precision.md) puts
// it where a tensor enters a bf16 GEMM or a Reshard that carries bf16.
// Deduction: the default rule; treated as linear so that a partial sum may be
// rounded shard by shard before it is reduced (the sum of rounded partials
// differs from the rounded sum by bf16 rounding, as in Megatron's bf16
// tensor-parallel reductions).
// Gradient: the incoming gradient in the input's dtype. A bf16 -> f32 -> bf16
// round trip is the identity and adds no node.
#include "hspmd/ops/ops.h"
#include "kernels/memory.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

bool is_float(DType t) { return t == DType::F32 || t == DType::BF16; }

class CastOp final : public Op {
 public:
  explicit CastOp(DType to) : to_(to) {}
  std::string type() const override { return "cast"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("cast", in, 1);
    if (!is_float(in[0].dtype) || !is_float(to_))
      fail("[cast] converts between f32 and bf16, got ", dtype_name(in[0].dtype), " -> ", dtype_name(to_));
    return {TensorMeta{in[0].shape, to_}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    // ops::cast adds no node when the dtypes agree.
    out[0] = kernels::cast(*ctx.stream, in[0], to_);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    return {cast(g[0], node.inputs[0].dtype())};
  }
  bool is_linear() const override { return true; }
  // Conversions are memory traffic, not arithmetic.
  double flops(const std::vector<Shape>&, const std::vector<Shape>&, const ShardContext*) const override {
    return 0.0;
  }

 private:
  DType to_;
};

}  // namespace

Tensor cast(const Tensor& a, DType dtype) {
  if (a.dtype() == dtype) return a;
  // bf16 -> f32 is exact, so rounding its result back to bf16 gives its
  // input: that input, with no pass (the backward meets this where a block
  // input's bf16 gradient, widened for the residual stream, is rounded again
  // for o_proj's or down_proj's GEMMs).
  const Node& producer = a.node();
  if (dtype == DType::BF16 && a.dtype() == DType::F32 && producer.op != nullptr &&
      dynamic_cast<const CastOp*>(producer.op.get()) != nullptr && producer.inputs.at(0).dtype() == DType::BF16)
    return producer.inputs[0];
  return a.graph()->add1(std::make_shared<CastOp>(dtype), {a});
}

}  // namespace hspmd::ops
