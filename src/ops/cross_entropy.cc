// cross_entropy: Σ over non-ignored tokens of -log softmax(logits)[target],
// divided by a scalar normalizer; logits f32 or bf16 (the log-softmax in f32
// either way, as PyTorch's autocast computes it from a bf16 head). The backward is one fused op producing
// dlogits (f32, or bf16 rounded once from f32); targets and normalizer get
// no gradient.
// Deduction: token splits of logits (targets alike) make the loss partial
// (hdim over tokens: -2) and pass to lse; a vocab split inside a subgroup is
// vocab-parallel cross-entropy (compute combines log-sum-exps and target
// logits over the vocab group): loss and lse are dup there. No partial input;
// the normalizer is a dup scalar. cross_entropy_grad is linear in dloss.
// Compute under a distributed executor (ctx.shard) with logits holding vocab
// [v0, v1) of V: per-shard log-sum-exp and target logit, an all-gather of the
// one and an all-reduce of the other over the vocab group, then the global
// lse and loss, the same on every member. The backward reads the global lse
// and needs no communication.
#include "hspmd/comm/communicator.h"
#include "hspmd/core/error.h"
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

// The vocab entries [begin, begin + local) of `size` that the logits (input
// `input`) hold along their last dim; the whole local dim on one device.
struct VocabRange {
  int64_t begin;
  int64_t size;
  int64_t local;
  bool whole() const { return begin == 0 && size == local; }
};

VocabRange vocab_range(const OpContext& ctx, int input, const NDArray& logits) {
  const int64_t local = logits.dim(-1);
  if (ctx.shard == nullptr) return {0, local, local};
  const Box& box = ctx.shard->input_boxes.at(input);
  const Shape& global = ctx.shard->input_global_shapes.at(input);
  const size_t last = global.size() - 1;
  HSPMD_CHECK(box.end.at(last) - box.begin.at(last) == local,
              "cross_entropy: the logits' box does not match their local vocab");
  return {box.begin[last], global[last], local};
}

// Vocab-parallel forward: local statistics, then the group's collectives
// (started together, waited together), then the same combine on every member.
void vocab_parallel_forward(const OpContext& ctx, const std::vector<NDArray>& in, int ignore_index,
                            int64_t classes, const VocabRange& v, std::vector<NDArray>& out) {
  const NDArray logits = in[0].contiguous(), targets = in[1].contiguous();
  const int64_t rows = targets.numel();
  NDArray local_lse = NDArray::empty({rows}, DType::F32, logits.device());
  NDArray target_logit = NDArray::empty({rows}, DType::F32, logits.device());
  kernels::cross_entropy_shard_stats(*ctx.stream, logits, targets, v.begin, v.size, ignore_index,
                                     local_lse, target_logit, classes);
  Communicator& group = ctx.shard->group_along(0, logits.ndim() - 1);
  NDArray shard_lse = NDArray::empty({group.size(), rows}, DType::F32, logits.device());
  std::vector<Request> pending;
  pending.push_back(group.start_all_gather(*ctx.stream, local_lse, shard_lse,
                                           std::vector<int64_t>(group.size(), rows)));
  pending.push_back(group.start_all_reduce(*ctx.stream, target_logit));
  group.wait_all(pending);
  kernels::cross_entropy_combine(*ctx.stream, shard_lse, target_logit, targets, in[2],
                                 ignore_index, out[0], out[1]);
}

// Labels: tokens t0.., vocab v. Forward inputs: logits, targets, normalizer;
// backward: dloss, logits, targets, normalizer, lse.
DimRule cross_entropy_rule(int targets_rank, bool backward) {
  const auto tokens = numbered_labels("t", targets_rank);
  const auto logits = labels_plus(tokens, {"v"});
  DimRule rule;
  if (backward) {
    rule = DimRule{.inputs = {{}, logits, tokens, {}, tokens},
                   .input_names = {"dloss", "logits", "targets", "normalizer", "lse"},
                   .outputs = {logits},
                   .linear = {true, false, false, false, false}};
  } else {
    rule = DimRule{.inputs = {logits, tokens, {}},
                   .input_names = {"logits", "targets", "normalizer"},
                   .outputs = {{}, tokens}};
    sum_over(rule, tokens);
  }
  rule.reductions["v"] = Reduction::kCollective;
  return rule;
}

// (dloss, logits, targets, normalizer, lse) -> dlogits.
class CrossEntropyGradOp final : public Op {
 public:
  CrossEntropyGradOp(int ignore_index, int64_t classes, DType grad_dtype)
      : ignore_index_(ignore_index), classes_(classes), grad_dtype_(grad_dtype) {}
  std::string type() const override { return "cross_entropy_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("cross_entropy_grad", in, 5);
    return {TensorMeta{in[1].shape, grad_dtype_}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    const VocabRange v = vocab_range(ctx, 1, in[1]);
    kernels::cross_entropy_backward(*ctx.stream, in[0], in[1].contiguous(), in[2].contiguous(),
                                    in[3],
                                    in[4].contiguous(), ignore_index_, v.begin, out[0], classes_);
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    return deduce_by_dims(ctx, cross_entropy_rule(ctx.node.inputs[2].ndim(), true), in);
  }

 private:
  int ignore_index_;
  int64_t classes_;
  DType grad_dtype_;
};

class CrossEntropyOp final : public Op {
 public:
  CrossEntropyOp(int ignore_index, int64_t classes, DType grad_dtype)
      : ignore_index_(ignore_index), classes_(classes), grad_dtype_(grad_dtype) {}
  std::string type() const override { return "cross_entropy"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("cross_entropy", in, 3);
    if (in[0].dtype != DType::F32 && in[0].dtype != DType::BF16)
      fail("[cross_entropy] logits must be f32 or bf16, got ", dtype_name(in[0].dtype));
    expect_dtype("cross_entropy", "targets", in[1], DType::I32);
    expect_dtype("cross_entropy", "normalizer", in[2], DType::F32);
    const SymShape& l = in[0].shape;
    if (l.empty() || SymShape(l.begin(), l.end() - 1) != in[1].shape)
      fail("[cross_entropy] logits must be [..., V] over targets [...]: logits ",
           sym_shape_str(l), ", targets ", sym_shape_str(in[1].shape));
    if (!in[2].shape.empty())
      fail("[cross_entropy] normalizer must be a scalar, got ", sym_shape_str(in[2].shape));
    // Output 1: the per-row log-sum-exp, saved for the backward.
    return {TensorMeta{{}, DType::F32}, TensorMeta{in[1].shape, DType::F32}};
  }
  // Vocab-parallel: vocab_parallel_forward's all-gather and all-reduce of
  // one f32 per row over the vocab-split ranks.
  bool may_communicate() const override { return true; }
  OpTraffic traffic(const ShardContext& shard) const override {
    const Box& logits = shard.input_boxes.at(0);
    const int last = static_cast<int>(logits.begin.size()) - 1;
    if (logits.end[last] - logits.begin[last] == shard.input_global_shapes.at(0).at(last)) return {};
    OpTraffic t{"vocab_parallel_loss", shard.ranks_along(0, last)};
    const int64_t n = static_cast<int64_t>(t.group.size()), rows = shard.input_boxes.at(1).numel();
    const int64_t all_reduce = rows * 4 * 2 * (n - 1) / n;
    t.sent = (n - 1) * rows * 4 + all_reduce;
    t.received = (n - 1) * rows * 4 + all_reduce;
    return t;
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    out[1] = ctx.alloc(1);
    const VocabRange v = vocab_range(ctx, 0, in[0]);
    if (v.whole())
      kernels::cross_entropy(*ctx.stream, in[0].contiguous(), in[1].contiguous(), in[2],
                             ignore_index_, out[0], out[1], classes_);
    else
      vocab_parallel_forward(ctx, in, ignore_index_, classes_, v, out);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    const Tensor logits = node.inputs[0], targets = node.inputs[1], norm = node.inputs[2];
    auto op = std::make_shared<CrossEntropyGradOp>(ignore_index_, classes_, grad_dtype_);
    return {g[0].graph()->add1(op, {g[0], logits, targets, norm, node.output(1)}), Tensor(),
            Tensor()};
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    return deduce_by_dims(ctx, cross_entropy_rule(ctx.node.inputs[1].ndim(), false), in);
  }

 private:
  int ignore_index_;
  int64_t classes_;
  DType grad_dtype_;
};

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& normalizer,
                     int ignore_index, int64_t classes, DType grad_dtype) {
  if (classes < 0) fail("[cross_entropy] classes must be >= 0, got ", classes);
  if (grad_dtype != DType::F32 && grad_dtype != DType::BF16)
    fail("[cross_entropy] grad_dtype must be f32 or bf16, got ", dtype_name(grad_dtype));
  return logits.graph()->add(std::make_shared<CrossEntropyOp>(ignore_index, classes, grad_dtype),
                             {logits, targets, normalizer})[0];
}

}  // namespace hspmd::ops
