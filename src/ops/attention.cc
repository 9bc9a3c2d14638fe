// attention: causal grouped-query attention, optionally restricted to
// documents (cu_seqlens); attention_grad: its backward. Outputs of the
// forward: out [B, S, Hq, D] and the rows' log-sum-exp lse [B, Hq, S], kept
// for the backward. See docs/attention.md.
// Deduction: batch and heads (q's and k/v's heads split by the same degree,
// which keeps GQA groups together) pass; the head dim must be whole; the
// sequence may be split (q, k, v alike) only with context_parallel; lse
// follows; cu_seqlens must be whole. attention_grad is linear in grad_out.
#include "hspmd/ops/ops.h"
#include "kernels/attention.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

constexpr const char* kOp = "attention";

void expect_rank(const char* what, const TensorMeta& m, size_t rank) {
  if (m.shape.size() != rank)
    fail("[attention] ", what, " must have rank ", rank, ", got ", sym_shape_str(m.shape));
}

void expect_heads_divide(const SymDim& hq, const SymDim& hkv) {
  bool divides = true;
  try {
    hq.divide(hkv);
  } catch (const Error&) {
    divides = false;
  }
  if (!divides)
    fail("[attention] kv heads ", hkv.str(), " must divide query heads ", hq.str());
}

// Shape rule shared by both ops: q, k, v and the optional cu_seqlens.
void check_qkv(const TensorMeta& q, const TensorMeta& k, const TensorMeta& v,
               const TensorMeta* cu_seqlens) {
  const char* names[] = {"q", "k", "v"};
  const TensorMeta* metas[] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    expect_dtype(kOp, names[i], *metas[i], DType::F32);
    expect_rank(names[i], *metas[i], 4);
  }
  if (k.shape != v.shape)
    fail("[attention] k and v shapes differ: ", sym_shape_str(k.shape), " vs ",
         sym_shape_str(v.shape));
  if (!(q.shape[0] == k.shape[0]) || !(q.shape[1] == k.shape[1]))
    fail("[attention] q and k must share [B, S], got ", sym_shape_str(q.shape), " and ",
         sym_shape_str(k.shape));
  if (!(q.shape[3] == k.shape[3]))
    fail("[attention] head dims differ: q has ", q.shape[3].str(), ", k has ",
         k.shape[3].str());
  expect_heads_divide(q.shape[2], k.shape[2]);
  if (cu_seqlens) {
    expect_dtype(kOp, "cu_seqlens", *cu_seqlens, DType::I32);
    expect_rank("cu_seqlens", *cu_seqlens, 1);
  }
}

// Labels b, s, h (heads), d; `n_in` inputs: q, k, v[, out, lse, grad_out]
// [, cu_seqlens]; outputs out, lse (forward) or dq, dk, dv (backward).
DimRule attention_rule(size_t n_in, bool backward, bool context_parallel) {
  const std::vector<std::string> qkv = {"b", "s", "h", "d"}, lse = {"b", "h", "s"};
  DimRule rule;
  rule.inputs = {qkv, qkv, qkv};
  rule.input_names = {"q", "k", "v"};
  if (backward) {
    rule.inputs.insert(rule.inputs.end(), {qkv, lse, qkv});
    rule.input_names.insert(rule.input_names.end(), {"out", "lse", "grad_out"});
    rule.outputs = {qkv, qkv, qkv};
    rule.linear = {false, false, false, false, false, true};
  } else {
    rule.outputs = {qkv, lse};
  }
  if (rule.inputs.size() < n_in) {
    rule.inputs.push_back({"docs"});
    rule.input_names.push_back("cu_seqlens");
  }
  rule.unsplittable["d"] = "attention contracts the head dim";
  rule.unsplittable["docs"] = "every device needs all document boundaries";
  if (!context_parallel)
    rule.unsplittable["s"] = "attention needs the whole sequence unless context_parallel is set";
  return rule;
}

// Under a distributed executor, q (input 0) must hold whole sequences: the
// context-parallel kernel (exchanging keys and values between the cp ranks)
// does not exist yet, and attending over a sequence chunk would be wrong.
void require_whole_sequences(const OpContext& ctx) {
  if (ctx.shard == nullptr) return;
  const Box& q = ctx.shard->input_boxes.at(0);
  const int64_t s = ctx.shard->input_global_shapes.at(0).at(1);
  if (q.begin.at(1) != 0 || q.end.at(1) != s)
    fail("[attention] context parallelism (a sequence split over cp ranks) is planned and "
         "deduced but not executable yet: use cp = 1 to train");
}

NDArray optional_input(const std::vector<NDArray>& in, size_t i) {
  return i < in.size() ? in[i].contiguous() : NDArray();
}

// Inputs: q, k, v, out, lse, grad_out[, cu_seqlens]. Outputs: dq, dk, dv.
class AttentionGradOp final : public Op {
 public:
  AttentionGradOp(float scale, bool context_parallel)
      : scale_(scale), context_parallel_(context_parallel) {}
  std::string type() const override { return "attention_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    if (in.size() != 6 && in.size() != 7)
      fail("[attention_grad] expected 6 or 7 inputs, got ", in.size());
    check_qkv(in[0], in[1], in[2], in.size() == 7 ? &in[6] : nullptr);
    expect_same_shape("attention_grad", in[0], in[3]);
    expect_same_shape("attention_grad", in[0], in[5]);
    const SymShape& q = in[0].shape;
    if (in[4].shape != SymShape{q[0], q[2], q[1]})
      fail("[attention_grad] lse must be [B, Hq, S], got ", sym_shape_str(in[4].shape));
    return {in[0], in[1], in[2]};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    require_whole_sequences(ctx);
    for (int i = 0; i < 3; ++i) out[i] = ctx.alloc(i);
    kernels::attention_backward(in[0].contiguous(), in[1].contiguous(), in[2].contiguous(),
                                in[3].contiguous(), in[4].contiguous(), in[5].contiguous(),
                                optional_input(in, 6), scale_, out[0], out[1], out[2],
                                kernels::attention_tiles());
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    return deduce_by_dims(ctx, attention_rule(in.size(), true, context_parallel_), in);
  }

 private:
  float scale_;
  bool context_parallel_;
};

// Inputs: q, k, v[, cu_seqlens]. Outputs: out, lse.
class AttentionOp final : public Op {
 public:
  AttentionOp(float scale, bool context_parallel)
      : scale_(scale), context_parallel_(context_parallel) {}
  std::string type() const override { return "attention"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    if (in.size() != 3 && in.size() != 4)
      fail("[attention] expected 3 or 4 inputs, got ", in.size());
    check_qkv(in[0], in[1], in[2], in.size() == 4 ? &in[3] : nullptr);
    const SymShape& q = in[0].shape;
    return {in[0], TensorMeta{{q[0], q[2], q[1]}, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    require_whole_sequences(ctx);
    out[0] = ctx.alloc(0);
    out[1] = ctx.alloc(1);
    kernels::attention_forward(in[0].contiguous(), in[1].contiguous(), in[2].contiguous(),
                               optional_input(in, 3), scale_, out[0], out[1],
                               kernels::attention_tiles());
  }
  // lse's gradient is never used: it only feeds the backward.
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    std::vector<Tensor> grads(node.inputs.size());
    if (!g[0].valid()) return grads;
    std::vector<Tensor> in = {node.inputs[0], node.inputs[1], node.inputs[2],
                              node.output(0), node.output(1), g[0]};
    if (node.inputs.size() == 4) in.push_back(node.inputs[3]);
    // `node` may dangle once the graph grows: everything needed is copied above.
    std::vector<Tensor> d =
        node.graph->add(std::make_shared<AttentionGradOp>(scale_, context_parallel_), in);
    grads[0] = d[0], grads[1] = d[1], grads[2] = d[2];
    return grads;
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    return deduce_by_dims(ctx, attention_rule(in.size(), false, context_parallel_), in);
  }

 private:
  float scale_;
  bool context_parallel_;
};

}  // namespace

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens,
                 float softmax_scale, bool context_parallel) {
  if (!q.valid() || !k.valid() || !v.valid()) fail("[attention] q, k and v must be defined");
  std::vector<Tensor> in = {q, k, v};
  if (cu_seqlens.valid()) in.push_back(cu_seqlens);
  return q.graph()->add(std::make_shared<AttentionOp>(softmax_scale, context_parallel), in)[0];
}

}  // namespace hspmd::ops
