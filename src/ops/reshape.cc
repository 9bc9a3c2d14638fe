// reshape: same elements, new shape. The output is a view of the input.
#include "hspmd/ops/ops.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

class ReshapeOp final : public Op {
 public:
  explicit ReshapeOp(SymShape shape) : shape_(std::move(shape)) {}
  std::string type() const override { return "reshape"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("reshape", in, 1);
    if (!(sym_numel(in[0].shape) == sym_numel(shape_)))
      fail("[reshape] cannot reshape ", sym_shape_str(in[0].shape), " (",
           sym_numel(in[0].shape).str(), " elements) to ", sym_shape_str(shape_), " (",
           sym_numel(shape_).str(), " elements)");
    return {TensorMeta{shape_, in[0].dtype}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = in[0].contiguous().reshape(ctx.out_shapes[0]);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    const SymShape in_shape = node.inputs[0].shape();
    return {reshape(g[0], in_shape)};
  }

 private:
  SymShape shape_;
};

}  // namespace

Tensor reshape(const Tensor& a, const SymShape& shape) {
  return a.graph()->add1(std::make_shared<ReshapeOp>(shape), {a});
}

}  // namespace hspmd::ops
