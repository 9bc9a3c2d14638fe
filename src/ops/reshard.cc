// reshard: the point where a tensor may change layout. Identity on one
// device (the output is the input array); the annotation layer turns it into
// communication. Deduction: a named Reshard takes its annotation from the
// plan, an unnamed one keeps its input's; the gradient of a Reshard is a
// mirror, which sends the gradient back to the layout of the forward input.
#include <algorithm>

#include "hspmd/ops/ops.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

class ReshardOp final : public Op {
 public:
  // `mirror_of`: the forward Reshard node whose gradient this is, or -1.
  explicit ReshardOp(int mirror_of = -1) : mirror_of_(mirror_of) {}
  std::string type() const override { return "reshard"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("reshard", in, 1);
    return {in[0]};
  }
  void compute(const OpContext&, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = in[0];
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    const std::string name = node.name.empty() ? "" : "backward." + node.name;
    return {g[0].graph()->add1(std::make_shared<ReshardOp>(node.id), {g[0]}, name)};
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    if (mirror_of_ >= 0) return {mirror(ctx, in[0])};
    if (ctx.node.name.empty()) return {in[0]};
    return {annotation_from_plan(ctx, ctx.node.name, ctx.node.inputs[0].ndim(), false)};
  }
  int mirror_of() const { return mirror_of_; }

 private:
  // The forward input's layout, holding the full gradient where the forward
  // input held a partial sum; partial sums across subgroups (hdim -2) of a
  // forward input duplicated across them (hdim -1) stay partial: gradient
  // sync reduces them later. A parameter (e.g. tied embeddings used as LM
  // head on another stage) replicated over ranks that see different tokens
  // (dup over cp) gets partial gradients there from its other uses: this
  // gradient joins them as one partial term, so its dup becomes partial (the
  // resolver moves partial terms pairwise when the layouts match, else
  // reduces them first, and puts a whole value on partial coordinate 0).
  Annotation mirror(const DeduceContext& ctx, const Annotation& grad) const {
    const Node& forward = ctx.graph.graph().node(mirror_of_);
    const Annotation& source = ctx.graph.of(forward.inputs[0]);
    Annotation dst = without_partial(ctx, source);
    if (grad.hdim == kPartial && grad.hsize() > 1 && source.hdim == kDup && dst.hsize() > 1)
      dst.hdim = kPartial;
    if (is_parameter(forward.inputs[0].node())) dup_as_partial(dst);
    return dst;
  }

  static void dup_as_partial(Annotation& a) {
    for (Subgroup& g : a.subgroups) {
      DistStates& s = g.states;
      const int n = s.degree(kDup);
      if (n <= 1 || s.has_partial()) continue;
      s.degrees.erase(kDup);
      s.degrees[kPartial] = n;
      std::replace(s.order.begin(), s.order.end(), kDup, kPartial);
    }
  }

  int mirror_of_;
};

}  // namespace

Tensor reshard(const Tensor& x, const std::string& name) {
  if (!x.valid()) fail("[reshard] the input tensor is undefined");
  return x.graph()->add1(std::make_shared<ReshardOp>(), {x}, name);
}

bool is_reshard(const Node& node) { return dynamic_cast<const ReshardOp*>(node.op.get()) != nullptr; }

int reshard_mirror_of(const Node& node) {
  const auto* op = dynamic_cast<const ReshardOp*>(node.op.get());
  return op ? op->mirror_of() : -1;
}

}  // namespace hspmd::ops
