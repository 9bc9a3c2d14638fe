// embedding: rows of weight[V, H] picked by i32 ids. The gradient w.r.t. the
// weight is a dense [V, H] scatter-add (embedding_grad); ids get none.
// Deduction: ids' splits pass to the output's leading dims; weight split(1)
// gives the output's last dim split; weight split(0) (vocab parallel: each
// device looks up its own rows, zeros elsewhere) gives a partial output.
// embedding_grad: the token dims are summed over (partial weight gradient),
// the hidden dim follows the gradient's, the vocab dim the forward weight's.
// Under a distributed executor (ctx.shard) a weight holding vocab rows
// [v0, v1) looks up / accumulates only the ids in that range; no
// communication (the partial output is summed by a later Reshard).
#include "hspmd/core/error.h"
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

// The vocab rows a rank's weight (or weight gradient) holds: [begin, begin +
// local rows) of `size`; the whole local dim on one device.
struct VocabRange {
  int64_t begin;
  int64_t size;
};

VocabRange vocab_range(const OpContext& ctx, bool of_output, int64_t local_rows) {
  if (ctx.shard == nullptr) return {0, local_rows};
  const ShardContext& s = *ctx.shard;
  const Box& box = of_output ? s.output_boxes.at(0) : s.input_boxes.at(0);
  const Shape& global = of_output ? s.output_global_shapes.at(0) : s.input_global_shapes.at(0);
  HSPMD_CHECK(box.end.at(0) - box.begin.at(0) == local_rows,
              "embedding: the weight's box does not match its local rows");
  return {box.begin[0], global.at(0)};
}

// Labels: tokens t0.. (ids' dims), vocab v, hidden h.
DimRule embedding_rule(int ids_rank) {
  const auto tokens = numbered_labels("t", ids_rank);
  DimRule rule{.inputs = {{"v", "h"}, tokens},
               .input_names = {"weight", "ids"},
               .outputs = {labels_plus(tokens, {"h"})},
               .linear = {true, false}};
  rule.reductions["v"] = Reduction::kSum;
  return rule;
}

// dweight [V, H] from (grad [..., H], ids [...]). `weight` (the forward
// weight, read by deduction only) gives the vocab split of the result.
class EmbeddingGradOp final : public Op {
 public:
  EmbeddingGradOp(SymShape weight_shape, Tensor weight)
      : weight_shape_(std::move(weight_shape)), weight_(weight) {}
  std::string type() const override { return "embedding_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("embedding_grad", in, 2);
    return {TensorMeta{weight_shape_, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    const VocabRange v = vocab_range(ctx, /*of_output=*/true, out[0].dim(0));
    kernels::embedding_backward(*ctx.stream, in[0].contiguous(), in[1].contiguous(), v.begin,
                                v.size, out[0]);
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    const auto tokens = numbered_labels("t", ctx.node.inputs[1].ndim());
    DimRule rule{.inputs = {labels_plus(tokens, {"h"}), tokens},
                 .input_names = {"grad", "ids"},
                 .outputs = {{"v", "h"}},
                 .linear = {true, false}};
    sum_over(rule, tokens);
    std::vector<Annotation> inputs = in;
    // The forward weight as one more input that only constrains the vocab dim.
    if (weight_.valid() && ctx.graph.has(weight_) && same_devices(ctx.graph.of(weight_), in[0])) {
      rule.inputs.push_back({"v", ""});
      rule.input_names.push_back("forward weight");
      rule.layout_only = {false, false, true};
      inputs.push_back(ctx.graph.of(weight_));
    }
    return deduce_by_dims(ctx, rule, inputs);
  }

 private:
  SymShape weight_shape_;
  Tensor weight_;
};

class EmbeddingOp final : public Op {
 public:
  std::string type() const override { return "embedding"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("embedding", in, 2);
    expect_dtype("embedding", "weight", in[0], DType::F32);
    expect_dtype("embedding", "ids", in[1], DType::I32);
    if (in[0].shape.size() != 2)
      fail("[embedding] weight must be [V, H], got ", sym_shape_str(in[0].shape));
    SymShape out = in[1].shape;
    out.push_back(in[0].shape[1]);
    return {TensorMeta{out, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    const VocabRange v = vocab_range(ctx, /*of_output=*/false, in[0].dim(0));
    kernels::embedding(*ctx.stream, in[0].contiguous(), in[1].contiguous(), v.begin, v.size,
                       out[0]);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    const Tensor weight = node.inputs[0], ids = node.inputs[1];
    auto op = std::make_shared<EmbeddingGradOp>(weight.shape(), weight);
    return {g[0].graph()->add1(op, {g[0], ids}), Tensor()};
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    return deduce_by_dims(ctx, embedding_rule(ctx.node.inputs[1].ndim()), in);
  }
};

}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& ids) {
  return weight.graph()->add1(std::make_shared<EmbeddingOp>(), {weight, ids});
}

}  // namespace hspmd::ops
