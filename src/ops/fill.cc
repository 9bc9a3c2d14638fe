// fill: a constant tensor (used to seed the backward pass).
#include "hspmd/ops/ops.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

class FillOp final : public Op {
 public:
  FillOp(SymShape shape, float value) : shape_(std::move(shape)), value_(value) {}
  std::string type() const override { return "fill"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("fill", in, 0);
    return {TensorMeta{shape_, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>&,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    out[0].fill(value_);
  }
  std::vector<Tensor> gradient(const Node&, const std::vector<Tensor>&) const override {
    return {};
  }

 private:
  SymShape shape_;
  float value_;
};

}  // namespace

Tensor fill(Graph& graph, const SymShape& shape, float value) {
  return graph.add1(std::make_shared<FillOp>(shape, value), {});
}

}  // namespace hspmd::ops
