// transpose: swaps two dims into a new contiguous array. Deduction: the
// splits (and hdim) of the two dims swap with them; linear.
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

class TransposeOp final : public Op {
 public:
  TransposeOp(int dim0, int dim1) : dim0_(dim0), dim1_(dim1) {}
  std::string type() const override { return "transpose"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("transpose", in, 1);
    const int n = static_cast<int>(in[0].shape.size());
    TensorMeta out = in[0];
    std::swap(out.shape[norm_axis("transpose", dim0_, n)],
              out.shape[norm_axis("transpose", dim1_, n)]);
    return {out};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    const int n = in[0].ndim();
    out[0] = ctx.alloc(0);
    kernels::transpose(*ctx.stream, in[0], norm_axis("transpose", dim0_, n), norm_axis("transpose",
                       dim1_, n), out[0]);
  }
  std::vector<Tensor> gradient(const Node&, const std::vector<Tensor>& g) const override {
    return {transpose(g[0], dim0_, dim1_)};
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    const int n = ctx.node.inputs[0].ndim();
    const auto labels = numbered_labels("d", n);
    auto out = labels;
    std::swap(out[norm_axis("transpose", dim0_, n)], out[norm_axis("transpose", dim1_, n)]);
    const DimRule rule{
        .inputs = {labels}, .input_names = {"a"}, .outputs = {out}, .linear = {true}};
    return deduce_by_dims(ctx, rule, in);
  }

 private:
  int dim0_;
  int dim1_;
};

}  // namespace

Tensor transpose(const Tensor& a, int dim0, int dim1) {
  return a.graph()->add1(std::make_shared<TransposeOp>(dim0, dim1), {a});
}

}  // namespace hspmd::ops
