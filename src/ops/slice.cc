// slice: keeps [begin, end) of a constant-sized axis. The gradient pads the
// incoming gradient with zeros back to the input's shape (slice_grad).
// Deduction (both): the axis may not be split; the rest passes; linear.
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

// The input of a slice over `axis` whose dims before `axis` are all 1 is
// contiguous: view it as flat memory instead of copying.
bool leading_dims_are_one(const Shape& s, int axis) {
  for (int d = 0; d < axis; ++d)
    if (s[d] != 1) return false;
  return true;
}

class SliceOp final : public Op {
 public:
  SliceOp(int axis, int64_t begin, int64_t end) : axis_(axis), begin_(begin), end_(end) {}
  std::string type() const override { return "slice"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("slice", in, 1);
    TensorMeta out = in[0];
    const int axis = norm_axis("slice", axis_, static_cast<int>(out.shape.size()));
    const SymDim& dim = out.shape[axis];
    if (!dim.is_const())
      fail("[slice] axis ", axis_, " has symbolic size ", dim.str(), "; only constant-sized "
           "axes can be sliced");
    if (begin_ < 0 || begin_ > end_ || end_ > dim.value())
      fail("[slice] range [", begin_, ", ", end_, ") is not inside axis ", axis_, " of size ",
           dim.value());
    out.shape[axis] = end_ - begin_;
    return {out};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    const NDArray a = in[0].contiguous();
    const int axis = norm_axis("slice", axis_, a.ndim());
    if (a.numel() > 0 && leading_dims_are_one(a.shape(), axis)) {
      const int64_t inner = a.numel() / a.dim(axis);
      out[0] = a.reshape({a.numel()})
                   .slice(0, begin_ * inner, end_ * inner)
                   .reshape(ctx.out_shapes[0]);
      return;
    }
    out[0] = ctx.alloc(0);
    kernels::slice(*ctx.stream, a, axis, begin_, out[0]);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override;
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override;

 private:
  int axis_;
  int64_t begin_;
  int64_t end_;
};

// Every dim passes its sharding through, except `axis`, which must be whole.
std::vector<Annotation> deduce_along(const DeduceContext& ctx, const std::vector<Annotation>& in,
                                     int axis, const char* why) {
  const int n = ctx.node.inputs[0].ndim();
  const auto labels = numbered_labels("d", n);
  DimRule rule{.inputs = {labels}, .input_names = {"a"}, .outputs = {labels}, .linear = {true}};
  rule.unsplittable[labels[norm_axis("slice", axis, n)]] = why;
  return deduce_by_dims(ctx, rule, in);
}

// Zeros of the sliced input's shape with the gradient written at [begin, end).
class SliceGradOp final : public Op {
 public:
  SliceGradOp(int axis, int64_t begin, int64_t end, int64_t size)
      : axis_(axis), begin_(begin), end_(end), size_(size) {}
  std::string type() const override { return "slice_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("slice_grad", in, 1);
    TensorMeta out = in[0];
    const int axis = norm_axis("slice_grad", axis_, static_cast<int>(out.shape.size()));
    out.shape[axis] = size_;
    return {out};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::slice_backward(*ctx.stream, in[0].contiguous(), norm_axis("slice_grad", axis_,
                            in[0].ndim()), begin_, out[0]);
  }
  std::vector<Tensor> gradient(const Node&, const std::vector<Tensor>& g) const override {
    return {slice(g[0], axis_, begin_, end_)};
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    return deduce_along(ctx, in, axis_, "slice_grad pads it with zeros");
  }

 private:
  int axis_;
  int64_t begin_;
  int64_t end_;
  int64_t size_;
};

std::vector<Annotation> SliceOp::deduce(const DeduceContext& ctx,
                                        const std::vector<Annotation>& in) const {
  return deduce_along(ctx, in, axis_, "slice takes a range of it");
}

std::vector<Tensor> SliceOp::gradient(const Node& node, const std::vector<Tensor>& g) const {
  const Tensor a = node.inputs[0];
  const int axis = norm_axis("slice", axis_, a.ndim());
  const int64_t size = a.shape()[axis].value();
  return {g[0].graph()->add1(std::make_shared<SliceGradOp>(axis, begin_, end_, size), {g[0]})};
}

}  // namespace

Tensor slice(const Tensor& a, int axis, int64_t begin, int64_t end) {
  return a.graph()->add1(std::make_shared<SliceOp>(axis, begin, end), {a});
}

}  // namespace hspmd::ops
