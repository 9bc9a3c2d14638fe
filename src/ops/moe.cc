// Mixture-of-experts ops (docs/moe.md): the router (softmax and top-k), the
// token permutation into expert order and its inverse, the grouped linear
// layer over the experts' weights, the router statistics, the auxiliary
// load-balancing loss's gradient seed and the shared expert's sigmoid gate.
//
// Rows in expert order: the k (token, slot) pairs of every token, sorted by
// expert, within an expert by token then slot (a stable counting sort of the
// router's indices). Every op that needs that order computes it from the
// indices on the host (kernels::to_host: a small read of T x k ints, which
// waits for the device), so no op carries a data-dependent shape.
//
// The permuted rows keep the token dims: [..., k, H] for tokens [...], each
// rank's array being its own tokens' rows in expert order, read as flat
// rows by the expert ops. So every split of the tokens (data parallelism
// across pipelines, the sequence under context parallelism) passes through
// every op of the layer by the ordinary rules below, and each rank routes
// and computes its own tokens; no Reshard reads the permuted rows (their
// order within a rank is not the global tensor's).
#include <algorithm>
#include <vector>

#include "hspmd/core/error.h"
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"
#include "moe_routing.h"
#include "op_util.h"

namespace hspmd::ops {

RoutingMap routing_map(Stream& s, const NDArray& indices, int64_t experts, bool arrays) {
  const NDArray host = kernels::to_host(s, indices.contiguous());
  const int32_t* idx = host.host_data<int32_t>("the router's indices");
  const int64_t n = host.numel(), k = host.dim(-1);
  RoutingMap m;
  m.offsets.assign(static_cast<size_t>(experts) + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (idx[i] < 0 || idx[i] >= experts)
      fail("[moe] expert index ", idx[i], " at position ", i, " is outside [0, ", experts, ")");
    ++m.offsets[idx[i] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) m.offsets[e + 1] += m.offsets[e];
  if (!arrays) return m;
  std::vector<int64_t> next(m.offsets.begin(), m.offsets.end() - 1);
  std::vector<int32_t> rows(static_cast<size_t>(n)), src(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {  // (token, slot) in order: stable within an expert
    const int64_t r = next[idx[i]]++;
    rows[i] = static_cast<int32_t>(r);
    src[r] = static_cast<int32_t>(i / k);
  }
  m.rows = kernels::to_device(s, NDArray::from_vector_i32(host.shape(), rows));
  m.src = kernels::to_device(s, NDArray::from_vector_i32({n}, src));
  return m;
}

NDArray flat_rows(const NDArray& a) {
  const int64_t n = a.dim(-1);
  return a.reshape({n == 0 ? 0 : a.numel() / n, n});
}

namespace {

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Labels of the token dims of indices [..., k].
std::vector<std::string> token_labels(const Node& node, int indices_input) {
  return numbered_labels("t", node.inputs[indices_input].ndim() - 1);
}

SymShape with_last(SymShape shape, SymDim last) {
  shape.back() = last;
  return shape;
}

// ---- the router ----

// (probs, indices, dweights[, dprobs]) -> dlogits.
class MoeRouteGradOp final : public Op {
 public:
  explicit MoeRouteGradOp(bool normalize) : normalize_(normalize) {}
  std::string type() const override { return "moe_route_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    if (in.size() != 3 && in.size() != 4) fail("[moe_route_grad] expected 3 or 4 inputs, got ", in.size());
    return {in[0]};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in, std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    const NDArray dprobs = in.size() == 4 ? in[3].contiguous() : NDArray();
    kernels::moe_route_backward(*ctx.stream, in[0].contiguous(), in[1].contiguous(), in[2].contiguous(),
                                in.size() == 4 ? &dprobs : nullptr, normalize_, out[0]);
  }

  std::vector<Annotation> deduce(const DeduceContext& ctx, const std::vector<Annotation>& in) const override {
    const auto t = token_labels(ctx.node, 1);
    DimRule rule{.inputs = {labels_plus(t, {"e"}), labels_plus(t, {"k"}), labels_plus(t, {"k"})},
                 .input_names = {"probs", "indices", "dweights"},
                 .outputs = {labels_plus(t, {"e"})},
                 .linear = {false, false, true, true}};
    if (in.size() == 4) {
      rule.inputs.push_back(labels_plus(t, {"e"}));
      rule.input_names.push_back("dprobs");
    }
    rule.unsplittable["e"] = "the router's softmax runs over every expert";
    rule.unsplittable["k"] = "a token's top-k is one row";
    return deduce_by_dims(ctx, rule, in);
  }
 private:
  bool normalize_;
};

// logits [..., E] -> weights [..., k], indices [..., k] (i32), probs [..., E].
class MoeRouteOp final : public Op {
 public:
  MoeRouteOp(int64_t top_k, bool normalize) : top_k_(top_k), normalize_(normalize) {}
  std::string type() const override { return "moe_route"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("moe_route", in, 1);
    expect_dtype("moe_route", "logits", in[0], DType::F32);
    const SymDim E = in[0].shape.back();
    if (!E.is_const() || top_k_ < 1 || top_k_ > E.value())
      fail("[moe_route] top_k ", top_k_, " must lie in [1, experts ", E.str(), "]");
    const SymShape k = with_last(in[0].shape, top_k_);
    return {TensorMeta{k, DType::F32}, TensorMeta{k, DType::I32}, in[0]};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in, std::vector<NDArray>& out) const override {
    for (int i = 0; i < 3; ++i) out[i] = ctx.alloc(i);
    kernels::moe_route(*ctx.stream, in[0].contiguous(), top_k_, normalize_, out[0], out[1], out[2]);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    if (!g[0].valid() && !g[2].valid()) return {Tensor()};
    const Tensor weights = node.output(0), indices = node.output(1), probs = node.output(2);
    std::vector<Tensor> inputs = {probs, indices, g[0].valid() ? g[0] : fill_like(weights, 0.0f)};
    if (g[2].valid()) inputs.push_back(g[2]);
    return {probs.graph()->add1(std::make_shared<MoeRouteGradOp>(normalize_), inputs)};
  }

  std::vector<Annotation> deduce(const DeduceContext& ctx, const std::vector<Annotation>& in) const override {
    const auto t = numbered_labels("t", ctx.node.inputs[0].ndim() - 1);
    DimRule rule{.inputs = {labels_plus(t, {"e"})},
                 .input_names = {"logits"},
                 .outputs = {labels_plus(t, {"k"}), labels_plus(t, {"k"}), labels_plus(t, {"e"})}};
    rule.unsplittable["e"] = "the router's softmax and top-k run over every expert";
    return deduce_by_dims(ctx, rule, in);
  }
 private:
  int64_t top_k_;
  bool normalize_;
};

// ---- expert order and back ----

// (rows_in [R, H], indices [..., k][, weights [..., k]]) -> y [..., H] =
// sum_j weights * rows_in[row(t, j)].
class MoeCombineOp final : public Op {
 public:
  explicit MoeCombineOp(int64_t experts) : experts_(experts) {}
  std::string type() const override { return "moe_combine"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    if (in.size() != 2 && in.size() != 3) fail("[moe_combine] expected 2 or 3 inputs, got ", in.size());
    expect_dtype("moe_combine", "rows", in[0], DType::F32);
    expect_dtype("moe_combine", "indices", in[1], DType::I32);
    return {TensorMeta{with_last(in[1].shape, in[0].shape.back()), DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in, std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    const RoutingMap m = routing_map(*ctx.stream, in[1], experts_, true);
    const NDArray w = in.size() == 3 ? in[2].contiguous() : NDArray();
    kernels::moe_combine(*ctx.stream, in[0].contiguous(), m.rows, in.size() == 3 ? &w : nullptr, out[0]);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override;

  std::vector<Annotation> deduce(const DeduceContext& ctx, const std::vector<Annotation>& in) const override {
    const auto t = token_labels(ctx.node, 1);
    DimRule rule{.inputs = {labels_plus(t, {"k", "h"}), labels_plus(t, {"k"})},
                 .input_names = {"rows", "indices"},
                 .outputs = {labels_plus(t, {"h"})},
                 .linear = {true, false, true}};
    if (in.size() == 3) {
      rule.inputs.push_back(labels_plus(t, {"k"}));
      rule.input_names.push_back("weights");
    }
    rule.reductions["k"] = Reduction::kSum;
    rule.unsplittable["k"] = "a token's k slots are summed in one place";
    rule.unsplittable["h"] = "the experts take whole rows";
    return deduce_by_dims(ctx, rule, in);
  }
 private:
  int64_t experts_;
};

// (dy [..., H], rows_in [R, H], indices[, weights]) -> drows_in [R, H][,
// dweights [..., k]].
class MoeCombineGradOp final : public Op {
 public:
  MoeCombineGradOp(int64_t experts, SymShape rows_shape) : experts_(experts), rows_shape_(std::move(rows_shape)) {}
  std::string type() const override { return "moe_combine_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    if (in.size() != 3 && in.size() != 4) fail("[moe_combine_grad] expected 3 or 4 inputs, got ", in.size());
    std::vector<TensorMeta> out = {TensorMeta{rows_shape_, DType::F32}};
    if (in.size() == 4) out.push_back(TensorMeta{in[3].shape, DType::F32});
    return out;
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in, std::vector<NDArray>& out) const override {
    const bool weighted = in.size() == 4;
    out[0] = ctx.alloc(0);
    if (weighted) out[1] = ctx.alloc(1);
    const RoutingMap m = routing_map(*ctx.stream, in[2], experts_, true);
    const NDArray w = weighted ? in[3].contiguous() : NDArray();
    kernels::moe_combine_backward(*ctx.stream, in[0].contiguous(), weighted ? in[1].contiguous() : in[0],
                                  m.rows, weighted ? &w : nullptr, out[0], weighted ? &out[1] : nullptr);
  }

  std::vector<Annotation> deduce(const DeduceContext& ctx, const std::vector<Annotation>& in) const override {
    const auto t = token_labels(ctx.node, 2);
    DimRule rule{.inputs = {labels_plus(t, {"h"}), labels_plus(t, {"k", "h"}), labels_plus(t, {"k"})},
                 .input_names = {"dy", "rows", "indices"},
                 .outputs = {labels_plus(t, {"k", "h"})},
                 .linear = {true, false, false, false}};
    if (in.size() == 4) {
      rule.inputs.push_back(labels_plus(t, {"k"}));
      rule.input_names.push_back("weights");
      rule.outputs.push_back(labels_plus(t, {"k"}));
    }
    rule.unsplittable["k"] = "a token's k slots are summed in one place";
    rule.unsplittable["h"] = "the experts take whole rows";
    return deduce_by_dims(ctx, rule, in);
  }
 private:
  int64_t experts_;
  SymShape rows_shape_;
};

std::vector<Tensor> MoeCombineOp::gradient(const Node& node, const std::vector<Tensor>& g) const {
  const bool weighted = node.inputs.size() == 3;
  const Tensor rows = node.inputs[0], indices = node.inputs[1];
  // Without weights the gradient needs no rows_in: dy stands in its place.
  std::vector<Tensor> inputs = {g[0], weighted ? rows : g[0], indices};
  if (weighted) inputs.push_back(node.inputs[2]);
  const std::vector<Tensor> d =
      g[0].graph()->add(std::make_shared<MoeCombineGradOp>(experts_, rows.shape()), inputs);
  return weighted ? std::vector<Tensor>{d[0], Tensor(), d[1]} : std::vector<Tensor>{d[0], Tensor()};
}

// (x [..., H], indices [..., k]) -> rows [B*S*k, H]: each token's row once
// per expert it goes to, in expert order.
class MoePermuteOp final : public Op {
 public:
  explicit MoePermuteOp(int64_t experts) : experts_(experts) {}
  std::string type() const override { return "moe_permute"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("moe_permute", in, 2);
    expect_dtype("moe_permute", "x", in[0], DType::F32);
    expect_dtype("moe_permute", "indices", in[1], DType::I32);
    SymShape out = in[1].shape;
    out.push_back(in[0].shape.back());
    return {TensorMeta{out, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in, std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    const RoutingMap m = routing_map(*ctx.stream, in[1], experts_, true);
    const NDArray x = in[0].contiguous();
    const int64_t H = x.dim(-1), T = H > 0 ? x.numel() / H : 0;
    NDArray rows = flat_rows(out[0]);
    kernels::embedding(*ctx.stream, x.reshape({T, H}), m.src, 0, T, rows);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    const Tensor indices = node.inputs[1];
    return {g[0].graph()->add1(std::make_shared<MoeCombineOp>(experts_), {g[0], indices}), Tensor()};
  }

  std::vector<Annotation> deduce(const DeduceContext& ctx, const std::vector<Annotation>& in) const override {
    const auto t = token_labels(ctx.node, 1);
    DimRule rule{.inputs = {labels_plus(t, {"h"}), labels_plus(t, {"k"})},
                 .input_names = {"x", "indices"},
                 .outputs = {labels_plus(t, {"k", "h"})},
                 .linear = {true, false}};
    rule.unsplittable["h"] = "the experts take whole rows";
    rule.unsplittable["k"] = "a token's top-k is one row";
    return deduce_by_dims(ctx, rule, in);
  }
 private:
  int64_t experts_;
};

// ---- the experts' linear layers ----

// (dy [R, out], x [R, in], indices) -> dweight of expert e [out, in] = dy_e^T x_e.
class ExpertWeightGradOp final : public Op {
 public:
  ExpertWeightGradOp(int64_t experts, int64_t expert, SymShape shape)
      : experts_(experts), expert_(expert), shape_(std::move(shape)) {}
  std::string type() const override { return "expert_weight_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("expert_weight_grad", in, 3);
    return {TensorMeta{shape_, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in, std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    const RoutingMap m = routing_map(*ctx.stream, in[2], experts_, false);
    const int64_t begin = m.offsets[expert_], end = m.offsets[expert_ + 1];
    if (begin == end) return kernels::fill(*ctx.stream, out[0], 0.0f);
    kernels::matmul(*ctx.stream, flat_rows(in[0].contiguous()).slice(0, begin, end),
                    flat_rows(in[1].contiguous()).slice(0, begin, end), true, false, out[0]);
  }
  double flops(const std::vector<Shape>& in, const std::vector<Shape>& out, const ShardContext*) const override {
    // The expert's share of the rows is data-dependent: an even share.
    const double rows = static_cast<double>(shape_numel(in[0])) / static_cast<double>(in[0].back());
    return 2.0 * rows / static_cast<double>(experts_) * static_cast<double>(out[0][0]) * out[0][1];
  }

  std::vector<Annotation> deduce(const DeduceContext& ctx, const std::vector<Annotation>& in) const override {
    const auto t = token_labels(ctx.node, 2);
    DimRule rule{.inputs = {labels_plus(t, {"k", "o"}), labels_plus(t, {"k", "i"}), labels_plus(t, {"k"})},
                 .input_names = {"dy", "rows", "indices"},
                 .outputs = {{"o", "i"}},
                 .linear = {true, true, false}};
    sum_over(rule, labels_plus(t, {"k"}));
    return deduce_by_dims(ctx, rule, in);
  }
 private:
  int64_t experts_, expert_;
  SymShape shape_;
};

// (x [R, in], indices [..., k], w_0 .. w_{E-1}) -> [R, out]: the rows of
// expert e times w_e^T (w_e [out, in]); `transposed` false: times w_e
// (w_e [in, out] read as stored: the input gradient of the transposed form).
class GroupedLinearOp final : public Op {
 public:
  GroupedLinearOp(int64_t experts, bool transposed) : experts_(experts), transposed_(transposed) {}
  std::string type() const override { return "grouped_linear"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("grouped_linear", in, static_cast<size_t>(experts_) + 2);
    expect_dtype("grouped_linear", "indices", in[1], DType::I32);
    const SymShape& w = in[2].shape;
    if (w.size() != 2 || in[0].shape.size() != in[1].shape.size() + 1)
      fail("[grouped_linear] rows must be [..., k, in] for indices [..., k] and weights 2-D, got ",
           sym_shape_str(in[0].shape), ", ", sym_shape_str(in[1].shape), " and ", sym_shape_str(w));
    for (int64_t e = 1; e < experts_; ++e)
      if (in[2 + e].shape != w) fail("[grouped_linear] expert ", e, "'s weight differs from expert 0's");
    const SymDim k_in = transposed_ ? w[1] : w[0], n_out = transposed_ ? w[0] : w[1];
    if (!(in[0].shape.back() == k_in))
      fail("[grouped_linear] rows have ", in[0].shape.back().str(), " features, the weights take ", k_in.str());
    return {TensorMeta{with_last(in[0].shape, n_out), DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in, std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    const RoutingMap m = routing_map(*ctx.stream, in[1], experts_, false);
    const NDArray x = flat_rows(in[0].contiguous());
    NDArray y = flat_rows(out[0]);
    for (int64_t e = 0; e < experts_; ++e) {
      const int64_t begin = m.offsets[e], end = m.offsets[e + 1];
      if (begin == end) continue;
      NDArray rows_out = y.slice(0, begin, end);
      kernels::matmul(*ctx.stream, x.slice(0, begin, end), in[2 + e].contiguous(), false, transposed_, rows_out);
    }
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    HSPMD_CHECK(transposed_, "grouped_linear: the untransposed form has no gradient");
    Graph& graph = *g[0].graph();
    const std::vector<Tensor> in = node.inputs;  // adding nodes may move `node`
    // Each GEMM's operands in one dtype: the gradient rounded to the
    // weights' (or the rows') dtype where those are bf16.
    const Tensor dy_w = cast(g[0], in[2].dtype()), dy_x = cast(g[0], in[0].dtype());
    std::vector<Tensor> inputs = {dy_w, in[1]};
    inputs.insert(inputs.end(), in.begin() + 2, in.end());
    std::vector<Tensor> grads = {graph.add1(std::make_shared<GroupedLinearOp>(experts_, false), inputs), Tensor()};
    for (int64_t e = 0; e < experts_; ++e)
      grads.push_back(
          graph.add1(std::make_shared<ExpertWeightGradOp>(experts_, e, in[2 + e].shape()), {dy_x, in[0], in[1]}));
    return grads;
  }
  double flops(const std::vector<Shape>& in, const std::vector<Shape>& out, const ShardContext*) const override {
    return 2.0 * static_cast<double>(shape_numel(in[0])) * static_cast<double>(out[0].back());
  }

  std::vector<Annotation> deduce(const DeduceContext& ctx, const std::vector<Annotation>& in) const override {
    const auto t = token_labels(ctx.node, 1);
    const std::string contracted = transposed_ ? "i" : "o", kept = transposed_ ? "o" : "i";
    DimRule rule{.inputs = {labels_plus(t, {"k", contracted}), labels_plus(t, {"k"})},
                 .input_names = {"rows", "indices"},
                 .outputs = {labels_plus(t, {"k", kept})},
                 .linear = {true, false}};
    for (int64_t e = 0; e < experts_; ++e) {
      rule.inputs.push_back({"o", "i"});
      rule.input_names.push_back("expert " + std::to_string(e) + "'s weight");
      rule.linear.push_back(true);
    }
    rule.reductions[contracted] = Reduction::kSum;
    rule.unsplittable["k"] = "a token's top-k is one row";
    return deduce_by_dims(ctx, rule, in);
  }
 private:
  int64_t experts_;
  bool transposed_;
};

// ---- statistics and the auxiliary loss ----

// indices [..., k] -> [E] f32: how many (token, slot) pairs went to each expert.
class MoeCountsOp final : public Op {
 public:
  explicit MoeCountsOp(int64_t experts) : experts_(experts) {}
  std::string type() const override { return "moe_counts"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("moe_counts", in, 1);
    return {TensorMeta{{experts_}, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in, std::vector<NDArray>& out) const override {
    const RoutingMap m = routing_map(*ctx.stream, in[0], experts_, false);
    NDArray counts = NDArray::empty({experts_}, DType::F32);
    for (int64_t e = 0; e < experts_; ++e)
      counts.host_data<float>("moe counts")[e] = static_cast<float>(m.offsets[e + 1] - m.offsets[e]);
    out[0] = kernels::to_device(*ctx.stream, counts);
  }
  std::vector<Tensor> gradient(const Node&, const std::vector<Tensor>&) const override { return {Tensor()}; }

  std::vector<Annotation> deduce(const DeduceContext& ctx, const std::vector<Annotation>& in) const override {
    const auto t = numbered_labels("t", ctx.node.inputs[0].ndim() - 1);
    DimRule rule{.inputs = {labels_plus(t, {"k"})}, .input_names = {"indices"}, .outputs = {{"e"}}};
    sum_over(rule, labels_plus(t, {"k"}));
    return deduce_by_dims(ctx, rule, in);
  }
 private:
  int64_t experts_;
};

// (w [E], probs [..., E]: layout only) -> w broadcast over the tokens: the
// auxiliary loss's gradient w.r.t. the router's probabilities.
class MoeAuxGradOp final : public Op {
 public:
  explicit MoeAuxGradOp(SymShape probs_shape) : shape_(std::move(probs_shape)) {}
  std::string type() const override { return "moe_aux_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("moe_aux_grad", in, 2);
    return {TensorMeta{shape_, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in, std::vector<NDArray>& out) const override {
    std::vector<bool> tokens(ctx.out_shapes[0].size(), true);
    tokens.back() = false;
    out[0] = ctx.alloc(0);
    kernels::broadcast_reduced(*ctx.stream, in[0].contiguous(), tokens, out[0]);
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx, const std::vector<Annotation>& in) const override {
    const auto t = numbered_labels("t", ctx.node.inputs[1].ndim() - 1);
    const DimRule rule{.inputs = {{"e"}, labels_plus(t, {"e"})},
                       .input_names = {"weights", "probs"},
                       .outputs = {labels_plus(t, {"e"})},
                       .layout_only = {false, true}};
    return deduce_by_dims(ctx, rule, in);
  }

 private:
  SymShape shape_;
};

// (y, probs [..., E], w [E]) -> y: the identity on y whose gradient also
// gives probs the gradient w (broadcast over the tokens): the auxiliary
// loss's term sum_e w_e * sum_t probs[t, e] for a loss whose gradient is 1,
// with w fed once the step's routing is known (its value is added to the
// loss on the host). Placed on the layer's output, so that it lives on the
// layer's devices (a pipeline stage's), not the loss's.
class MoeAuxTapOp final : public Op {
 public:
  std::string type() const override { return "moe_aux_tap"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("moe_aux_tap", in, 3);
    return {in[0]};
  }
  void compute(const OpContext&, const std::vector<NDArray>& in, std::vector<NDArray>& out) const override {
    out[0] = in[0];
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    const Tensor probs = node.inputs[1], w = node.inputs[2];
    return {g[0], probs.graph()->add1(std::make_shared<MoeAuxGradOp>(probs.shape()), {w, probs}), Tensor()};
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx, const std::vector<Annotation>& in) const override {
    const auto t = numbered_labels("t", ctx.node.inputs[0].ndim() - 1);
    DimRule rule{.inputs = {labels_plus(t, {"h"}), labels_plus(t, {"e"}), {"e"}},
                 .input_names = {"y", "probs", "aux weights"},
                 .outputs = {labels_plus(t, {"h"})},
                 .linear = {true, false, false}};
    rule.unsplittable["e"] = "the router's softmax runs over every expert";
    return deduce_by_dims(ctx, rule, in);
  }
};

// ---- the shared expert's gate ----

class SigmoidGateGradOp final : public Op {
 public:
  std::string type() const override { return "sigmoid_gate_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("sigmoid_gate_grad", in, 3);
    return {in[1], in[2]};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in, std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    out[1] = ctx.alloc(1);
    kernels::sigmoid_gate_backward(*ctx.stream, in[0].contiguous(), in[1].contiguous(), in[2].contiguous(), out[0],
                                   out[1]);
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx, const std::vector<Annotation>& in) const override {
    const auto t = numbered_labels("t", ctx.node.inputs[0].ndim() - 1);
    DimRule rule{.inputs = {labels_plus(t, {"h"}), labels_plus(t, {"h"}), labels_plus(t, {"u"})},
                 .input_names = {"dy", "x", "gate"},
                 .outputs = {labels_plus(t, {"h"}), labels_plus(t, {"u"})},
                 .linear = {true, false, false}};
    rule.unsplittable["h"] = "the gate's gradient sums over the row";
    return deduce_by_dims(ctx, rule, in);
  }
};

// (x [..., H], gate [..., 1]) -> sigmoid(gate) * x.
class SigmoidGateOp final : public Op {
 public:
  std::string type() const override { return "sigmoid_gate"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("sigmoid_gate", in, 2);
    expect_dtype("sigmoid_gate", "x", in[0], DType::F32);
    expect_dtype("sigmoid_gate", "gate", in[1], DType::F32);
    if (in[1].shape != with_last(in[0].shape, 1))
      fail("[sigmoid_gate] gate ", sym_shape_str(in[1].shape), " must be x's shape ", sym_shape_str(in[0].shape),
           " with a last dim of 1");
    return {in[0]};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in, std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::sigmoid_gate(*ctx.stream, in[0].contiguous(), in[1].contiguous(), out[0]);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    return g[0].graph()->add(std::make_shared<SigmoidGateGradOp>(), {g[0], node.inputs[0], node.inputs[1]});
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx, const std::vector<Annotation>& in) const override {
    const auto t = numbered_labels("t", ctx.node.inputs[0].ndim() - 1);
    const DimRule rule{.inputs = {labels_plus(t, {"h"}), labels_plus(t, {"u"})},
                       .input_names = {"x", "gate"},
                       .outputs = {labels_plus(t, {"h"})},
                       .linear = {true, false}};
    return deduce_by_dims(ctx, rule, in);
  }
};

}  // namespace

MoeRouting moe_route(const Tensor& logits, int64_t top_k, bool normalize) {
  const std::vector<Tensor> out = logits.graph()->add(std::make_shared<MoeRouteOp>(top_k, normalize), {logits});
  return {out[0], out[1], out[2]};
}

Tensor moe_permute(const Tensor& x, const Tensor& indices, int64_t experts) {
  return x.graph()->add1(std::make_shared<MoePermuteOp>(experts), {x, indices});
}

Tensor moe_combine(const Tensor& rows, const Tensor& indices, const Tensor& weights, int64_t experts) {
  return rows.graph()->add1(std::make_shared<MoeCombineOp>(experts), {rows, indices, weights});
}

Tensor grouped_linear(const Tensor& rows, const Tensor& indices, const std::vector<Tensor>& weights) {
  if (weights.empty()) fail("[grouped_linear] needs at least one expert");
  std::vector<Tensor> inputs = {rows, indices};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  return rows.graph()->add1(std::make_shared<GroupedLinearOp>(static_cast<int64_t>(weights.size()), true), inputs);
}

Tensor moe_counts(const Tensor& indices, int64_t experts) {
  return indices.graph()->add1(std::make_shared<MoeCountsOp>(experts), {indices});
}

Tensor moe_aux_tap(const Tensor& y, const Tensor& probs, const Tensor& weights) {
  return y.graph()->add1(std::make_shared<MoeAuxTapOp>(), {y, probs, weights});
}

Tensor sigmoid_gate(const Tensor& x, const Tensor& gate) {
  return x.graph()->add1(std::make_shared<SigmoidGateOp>(), {x, gate});
}

}  // namespace hspmd::ops
