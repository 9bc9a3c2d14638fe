// fill: a constant tensor of a given shape; fill_like: a constant with the
// shape of another tensor, living on that tensor's devices (it seeds the
// backward pass with d(loss)/d(loss) = 1).
#include "hspmd/ops/ops.h"
#include "kernels/memory.h"
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
    kernels::fill(*ctx.stream, out[0], value_);
  }
  std::vector<Tensor> gradient(const Node&, const std::vector<Tensor>&) const override {
    return {};
  }
  // No input to take devices from: a named fill is annotated by the plan.
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>&) const override {
    if (ctx.node.name.empty())
      fail_at(ctx, "a constant without inputs has no devices: use fill_like(tensor, value), or "
              "name it and annotate it in the plan");
    return {annotation_from_plan(ctx, ctx.node.name, static_cast<int>(shape_.size()), false)};
  }

 private:
  SymShape shape_;
  float value_;
};

// Input: like. The value of `like` is not read, only its shape.
class FillLikeOp final : public Op {
 public:
  explicit FillLikeOp(float value) : value_(value) {}
  std::string type() const override { return "fill_like"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("fill_like", in, 1);
    return {TensorMeta{in[0].shape, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>&,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::fill(*ctx.stream, out[0], value_);
  }
  std::vector<Tensor> gradient(const Node&, const std::vector<Tensor>&) const override {
    return {Tensor()};
  }
  // Every holder of `like` holds the constant in full: partial becomes dup.
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    return {without_partial(ctx, in[0])};
  }

 private:
  float value_;
};

}  // namespace

Tensor fill(Graph& graph, const SymShape& shape, float value, const std::string& name) {
  return graph.add1(std::make_shared<FillOp>(shape, value), {}, name);
}

Tensor fill_like(const Tensor& like, float value) {
  if (!like.valid()) fail("[fill_like] the tensor to take the shape from is undefined");
  return like.graph()->add1(std::make_shared<FillLikeOp>(value), {like});
}

}  // namespace hspmd::ops
