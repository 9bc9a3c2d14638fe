// concat: joins tensors along one constant-sized axis; the gradient slices
// the incoming gradient back into the parts. Deduction: the default rule
// (identical parts, linear) with the axis whole on both tiers.
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

class ConcatOp final : public Op {
 public:
  explicit ConcatOp(int axis) : axis_(axis) {}
  std::string type() const override { return "concat"; }

  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    if (in.empty()) fail("[concat] needs at least one part");
    TensorMeta out = in[0];
    const int rank = static_cast<int>(out.shape.size());
    const int axis = norm_axis("concat", axis_, rank);
    if (in.size() == 1) return {out};
    int64_t total = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      const SymShape& s = in[i].shape;
      if (in[i].dtype != out.dtype || static_cast<int>(s.size()) != rank)
        fail("[concat] part ", i, " is ", dtype_name(in[i].dtype), " ", sym_shape_str(s),
             ", part 0 is ", dtype_name(out.dtype), " ", sym_shape_str(out.shape));
      for (int d = 0; d < rank; ++d)
        if (d != axis && !(s[d] == out.shape[d]))
          fail("[concat] part ", i, " has shape ", sym_shape_str(s), ", part 0 has ",
               sym_shape_str(out.shape), ": only axis ", axis_, " may differ");
      if (!s[axis].is_const())
        fail("[concat] part ", i, " has symbolic size ", s[axis].str(), " along axis ", axis_);
      total += s[axis].value();
    }
    out.shape[axis] = total;
    return {out};
  }

  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    std::vector<NDArray> parts;
    for (const auto& p : in) parts.push_back(p.contiguous());
    out[0] = ctx.alloc(0);
    kernels::concat(*ctx.stream, parts, norm_axis("concat", axis_, out[0].ndim()), out[0]);
  }

  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    const std::vector<Tensor> parts = node.inputs;
    if (parts.size() == 1) return {g[0]};
    const int axis = norm_axis("concat", axis_, g[0].ndim());
    std::vector<Tensor> grads;
    int64_t offset = 0;
    for (const auto& p : parts) {
      const int64_t len = p.shape()[axis].value();
      grads.push_back(slice(g[0], axis, offset, offset + len));
      offset += len;
    }
    return grads;
  }

  bool is_linear() const override { return true; }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    std::vector<Annotation> out = Op::deduce(ctx, in);
    const int axis = norm_axis("concat", axis_, ctx.node.inputs[0].ndim());
    const Annotation& a = in[0];
    bool split = a.hsize() > 1 && a.hdim == axis;
    for (const Subgroup& g : a.subgroups) split = split || g.states.is_split(axis);
    if (split)
      fail_at(ctx, "the parts are split along the concatenation axis ", axis, "; insert a Reshard");
    return out;
  }

 private:
  int axis_;
};

}  // namespace

Tensor concat(const std::vector<Tensor>& parts, int axis) {
  if (parts.empty()) fail("[concat] needs at least one part");
  return parts[0].graph()->add1(std::make_shared<ConcatOp>(axis), parts);
}

}  // namespace hspmd::ops
