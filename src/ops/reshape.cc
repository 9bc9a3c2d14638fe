// reshape: same elements, new shape. The output is a view of the input.
// Deduction: dims are matched in groups of equal products ([B, S, H*D] <->
// [B, S, H, D], [B, S, H] <-> [B*S, H]); a split of a group's outermost
// non-1 dim maps to the outermost non-1 dim on the other side when the
// degree divides it (or its size is symbolic), on both tiers; any other
// split is not a split after the reshape and is an error.
#include "hspmd/ops/ops.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

// Input dims [i0, i1) hold the same elements as output dims [j0, j1).
struct DimGroup {
  int i0, i1, j0, j1;
};

// Whether `factor` divides `whole` as monomials.
bool divides(const SymDim& factor, const SymDim& whole) {
  try {
    whole.divide(factor);
    return true;
  } catch (const Error&) {
    return false;
  }
}

bool is_one(const SymDim& d) { return d.is_const() && d.value() == 1; }

std::vector<DimGroup> group_dims(const DeduceContext& ctx, const SymShape& in,
                                 const SymShape& out) {
  const int ni = static_cast<int>(in.size()), no = static_cast<int>(out.size());
  std::vector<DimGroup> groups;
  int i = 0, j = 0;
  while (i < ni || j < no) {
    if (i == ni || j == no) {  // trailing dims of size 1 join the last group
      if (groups.empty()) groups.push_back({0, 0, 0, 0});
      if (i < ni ? !is_one(in[i]) : !is_one(out[j])) break;
      if (i < ni) groups.back().i1 = ++i;
      else groups.back().j1 = ++j;
      continue;
    }
    DimGroup g{i, i + 1, j, j + 1};
    SymDim pi = in[i++], po = out[j++];
    while (!(pi == po)) {
      if (i < ni && divides(pi, po)) pi = pi * in[i++];
      else if (j < no && divides(po, pi)) po = po * out[j++];
      else break;
    }
    if (!(pi == po)) break;
    g.i1 = i, g.j1 = j;
    groups.push_back(g);
  }
  if (i < ni || j < no)
    fail_at(ctx, "cannot match the dims of ", sym_shape_str(in), " with ", sym_shape_str(out));
  return groups;
}

// The output dim that a split of input dim `d` by `degree` becomes.
int map_split(const DeduceContext& ctx, const std::vector<DimGroup>& groups, const SymShape& in,
              const SymShape& out, int d, int degree, const std::string& tier) {
  for (const DimGroup& g : groups) {
    if (d < g.i0 || d >= g.i1) continue;
    for (int e = g.i0; e < d; ++e)
      if (!is_one(in[e]))
        fail_at(ctx, "input dim ", d, " is split", tier, ", but the reshape of ", sym_shape_str(in),
                " to ", sym_shape_str(out), " merges it under dim ", e,
                ", so its chunks are not contiguous; insert a Reshard");
    for (int j = g.j0; j < g.j1; ++j) {
      if (is_one(out[j])) continue;
      if (out[j].is_const() && out[j].value() % degree != 0)
        fail_at(ctx, "input dim ", d, " is split by ", degree, tier, ", but output dim ", j,
                " of ", sym_shape_str(out), " has size ", out[j].value(),
                ", which that degree does not divide; insert a Reshard");
      return j;
    }
  }
  fail_at(ctx, "input dim ", d, " is split", tier, ", but no output dim of ", sym_shape_str(out),
          " can take the split; insert a Reshard");
}

// `s` with every split key renamed to the output dim it becomes.
DistStates map_states(const DeduceContext& ctx, const std::vector<DimGroup>& groups,
                      const SymShape& in, const SymShape& out, const DistStates& s,
                      const std::string& tier) {
  auto key_of = [&](int key) {
    return key < 0 ? key : map_split(ctx, groups, in, out, key, s.degree(key), tier);
  };
  DistStates mapped;
  for (const auto& [key, degree] : s.degrees)
    if (degree > 1) mapped.degrees[key_of(key)] = degree;
  for (int key : s.order) mapped.order.push_back(key_of(key));
  return mapped;
}

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
  // The gradient passes through as it comes: rounded where the input's is.
  bool rounds_gradient(const Node& node, int) const override { return gradient_rounded(node.inputs[0]); }
  // Linear: partial and dup pass through; splits are renamed dim by dim.
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    const SymShape& from = ctx.node.inputs[0].shape();
    const std::vector<DimGroup> groups = group_dims(ctx, from, shape_);
    Annotation out = in[0];
    for (int i = 0; i < out.hsize(); ++i) {
      const std::string tier = out.hsize() > 1 ? " in subgroup " + std::to_string(i) : "";
      const DistStates& s = in[0].subgroups[i].states;
      out.subgroups[i].states = map_states(ctx, groups, from, shape_, s, tier);
    }
    // Top-tier parts are proportions, not equal chunks: the engine checks
    // known sizes against them, so no degree is checked here.
    if (out.hsize() == 1) out.hdim = kDup, out.part_weights.clear();
    if (out.hdim >= 0)
      out.hdim = map_split(ctx, groups, from, shape_, out.hdim, 1, " across subgroups");
    return {out};
  }

 private:
  SymShape shape_;
};

}  // namespace

Tensor reshape(const Tensor& a, const SymShape& shape) {
  return a.graph()->add1(std::make_shared<ReshapeOp>(shape), {a});
}

}  // namespace hspmd::ops
