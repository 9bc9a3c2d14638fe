// Builders of the defined graph's ops. Each appends one node to the graph of
// its inputs and returns the output tensor(s). Shape mismatches throw
// hspmd::Error naming the op and the rule. Every op lives in its own file
// under src/ops/ with its shape rule, annotation-deduction rule (Op::deduce;
// the table is docs/deduction.md), kernel calls and gradient.
#pragma once

#include <string>
#include <vector>

#include "hspmd/graph/graph.h"

namespace hspmd::ops {

// ---- elementwise (same shapes, f32) ----
// a and b f32 or bf16 (read exactly), summed in f32 and written in
// `out_dtype` (f32, or bf16: the sum rounded once, the same bits as add then
// cast). a's gradient is f32 (with a bf16 output: the output's, as it
// is), b's in b's dtype (src/ops/add.cc).
Tensor add(const Tensor& a, const Tensor& b, DType out_dtype = DType::F32);
// x [..., N] + bias [N], the bias broadcast over x's leading dims (x of any
// rank >= 1, both f32). Deduction: y like x; the bias split along dim 0 like
// x's last dim and dup over its leading-dim splits; no partial input.
// Gradient: dx = dy, dbias = dy summed over the leading dims (op bias_grad).
Tensor add_bias(const Tensor& x, const Tensor& bias);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor scale(const Tensor& a, float factor);
// A constant tensor of `shape` filled with `value` (f32). It has no input to
// take devices from: deduction needs a plan annotation under `name` (an
// unnamed fill cannot be deduced; prefer fill_like).
Tensor fill(Graph& graph, const SymShape& shape, float value, const std::string& name = "");
// A constant f32 tensor with `like`'s shape filled with `value`; `like`'s
// value is not read. Deduction: `like`'s annotation with partial turned into
// dup (hdim -2 into -1), so the constant lives on `like`'s devices.
Tensor fill_like(const Tensor& like, float value);

// The same values as `dtype` (f32 <-> bf16; rounds to nearest even); `a`
// itself when it already has that dtype. Its gradient comes back in a's
// dtype. Mixed precision's casts (docs/precision.md).
Tensor cast(const Tensor& a, DType dtype);
// For gradient builders: `t` itself, or, when its producer says so
// (Op::recompute_for_backward), a new node computing it again from the
// same inputs, appended where the gradient is built (so it runs right
// before its backward consumer, and the forward's value is freed early).
Tensor recompute_for_backward(const Tensor& t);
// The same where `grad` is the gradient t's one consumer sends it: when no
// other node reads t, that is all of t's gradient, and a producer that can
// (Op::recompute_with_gradient) computes its own backward in the pass that
// recomputes t (SwiGLU: one pass over gate, up and grad instead of two).
Tensor recompute_for_backward(const Tensor& t, const Tensor& grad);

// Whether t's whole gradient is rounded to bf16 where it is used: t has one
// forward reader (inside gradients(): nodes up to the loss; elsewhere every
// node), so the gradient its reader makes is all of it, and t's producer
// reads it rounded (Op::rounds_gradient). The reader's gradient op may then
// write it in bf16 (MatmulOp: o_proj's input gradient, which cuDNN's
// attention backward reads in bf16).
bool gradient_rounded(const Tensor& t);

// ---- linear algebra (GEMMs: kernels/basic.h) ----
// a is viewed as 2-D [prod(a.shape[:-1]), a.shape[-1]], transposed when
// trans_a; b is 2-D, transposed when trans_b. Output: a's leading dims + [N]
// (or [a.shape[-1], N] when trans_a). With trans_a and not trans_b, b may
// also be [a.shape[:-1]..., N] (viewed as 2-D the same way), so that weight
// gradients contract over token dims without flattening them.
// a and b are f32 or bf16; when either is bf16 the product is computed with
// bf16 operands and f32 accumulation. The output is `out` (f32 or bf16:
// the f32 sums rounded once to nearest even).
Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false,
              DType out = DType::F32);
// x[..., in] · weight[out, in]^T -> [..., out] (Hugging Face weight layout).
Tensor linear(const Tensor& x, const Tensor& weight, DType out = DType::F32);
// linear(x, weight) + bias[out] in one op (one GEMM with the bias in its
// epilogue): the f32 product plus the bias in f32, rounded once to `out`
// (f32 or bf16), the bits of cast(add_bias(linear(x, weight, F32), bias),
// out). bias is f32 [out]. Deduction: linear's followed by add_bias's: the
// bias split along dim 0 like weight's rows (column parallel) and dup over
// x's token splits; no input partial and x's last dim not split (the product
// would be partial). Gradient: the nodes the three ops' gradients make
// (src/ops/linear_bias.cc).
Tensor linear_bias(const Tensor& x, const Tensor& weight, const Tensor& bias, DType out = DType::F32);

// ---- layout ----
Tensor reshape(const Tensor& a, const SymShape& shape);
Tensor transpose(const Tensor& a, int dim0, int dim1);  // materialized
Tensor slice(const Tensor& a, int axis, int64_t begin, int64_t end);
Tensor concat(const std::vector<Tensor>& parts, int axis);
// Sum over `axes` (all axes when empty); reduced axes are dropped.
Tensor reduce_sum(const Tensor& a, const std::vector<int>& axes = {});

// ---- model ops ----
// weight[V, H], ids i32 [...] -> [..., H]. Throws on ids outside [0, V) at run time.
Tensor embedding(const Tensor& weight, const Tensor& ids);
// x[..., H] * rsqrt(mean(x^2) + eps) * weight[H].
// x and weight f32; the output `out` f32 or bf16 (computed in f32, rounded
// once: the norm and the cast to a GEMM's bf16 operand in one pass).
Tensor rms_norm(const Tensor& x, const Tensor& weight, float eps, DType out = DType::F32);
// A residual add and the RMSNorm of its sum in one op: sum = add(a, b,
// sum_dtype), y = rms_norm(sum, weight, eps, out), with the bits, the
// gradients and the deduction of those two ops (a and b laid out alike),
// one pass over a and b where the separate norm read the sum again.
struct AddRmsNorm {
  Tensor sum, y;
};
AddRmsNorm add_rms_norm(const Tensor& a, const Tensor& b, const Tensor& weight, float eps,
                        DType sum_dtype = DType::F32, DType out = DType::F32);
// Rotary embedding, Hugging Face rotate_half convention: x [B, S, heads, D],
// positions i32 [B, S]; frequency i uses theta^(-2i/D).
// x is f32; the output `out` (f32 or bf16, rounded once), its gradient f32.
Tensor rope(const Tensor& x, const Tensor& positions, float theta, DType out = DType::F32);
// rope of q and of k (the same positions and head dim) in one op: the bits,
// gradients and deduction of rope on each, one kernel call for both (one
// cos/sin table and one launch on a GPU), forward and backward.
struct RopeQk {
  Tensor q, k;
};
RopeQk rope_qk(const Tensor& q, const Tensor& k, const Tensor& positions, float theta, DType out = DType::F32);
// silu(gate) * up, computed in f32; gate and up are both f32 or both bf16,
// the output has their dtype. Recomputed for the backward (its inputs are
// saved for its own gradient anyway), so a consumer's gradient that reads it
// does not keep the forward's output alive: see recompute_for_backward.
Tensor swiglu(const Tensor& gate, const Tensor& up);
// Causal attention with grouped-query heads: q [B, S, Hq, D], k and v
// [B, S, Hkv, D] with Hkv dividing Hq, all f32 or all bf16 (bf16 needs bf16
// products); returns [B, S, Hq, D] in f32 (the backward reads it unrounded;
// dq, dk, dv are f32 too). Scores are
// scaled by `softmax_scale`. `documents` (optional, i32) restricts each token
// to the earlier tokens of its own document; it is either
//  * cu_seqlens [n+1]: cumulative document lengths over the flattened B*S
//    tokens; every row boundary (multiple of S) must be a document boundary;
//  * positions [B, S]: each token's position inside its document (the RoPE
//    positions of packed documents, 0 at each document start): query i sees
//    key j of its row iff max(0, i - positions[i]) <= j <= i. Positions
//    0..S-1 give plain causal attention.
// Bad documents throw hspmd::Error "[attention] cu_seqlens: ..." or
// "[attention] document positions: ..." when the op runs. `context_parallel`
// lets deduction accept q, k, v (and positions) split along the sequence
// (dim 1), all the same way (the output is then split alike); the op then
// runs ring attention over the ranks sharing the split (docs/attention.md),
// which needs S divisible by 2*cp and no cu_seqlens (else hspmd::Error). On
// one device it changes nothing. `products` BF16 multiplies bf16-rounded
// operands (q, k, v, the probabilities, the incoming gradient) with f32 sums
// in every tile product, as mixed precision does for the GEMMs; softmax
// and lse stay f32. `window` W > 0 is a sliding window
// (Mistral's `sliding_window`): query i sees only keys i - W < j <= i, on top
// of the document mask; 0 (the default) is no window. W < 0 throws
// hspmd::Error "[attention] window: ...". `out_dtype` is the output's dtype:
// F32, or BF16 with bf16 products (computed in f32 and rounded once; the
// backward then reads the rounded O, as cuDNN's does); lse stays f32.
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& documents,
                 float softmax_scale, bool context_parallel = false,
                 DType products = DType::F32, int64_t window = 0, DType out_dtype = DType::F32);
// Softmax cross-entropy: logits [..., V] (f32, or bf16: widened exactly,
// the log-softmax computed in f32 either way), targets i32 [...]. Returns the
// scalar sum over tokens with target != ignore_index of -log p(target),
// divided by `normalizer` (an f32 scalar tensor, usually the number of target
// tokens of the whole global batch).
// `classes` > 0: only the first `classes` vocabulary entries are classes
// (a vocabulary padded for tensor parallelism); the others are left out of
// the softmax and get zero gradient.
// `grad_dtype`: the dtype of the logits' gradient (f32 or bf16, computed in
// f32 and rounded once): bf16 when the logits come from a bf16 GEMM, whose
// gradient rounds it to bf16 anyway, so no f32 copy of it is ever held.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& normalizer,
                     int ignore_index = -100, int64_t classes = 0,
                     DType grad_dtype = DType::F32);

// ---- mixture of experts (src/ops/moe.cc, docs/moe.md) ----
// The router's outputs: weights [..., k] (f32), indices [..., k] (i32),
// probs [..., E] (the softmax, f32).
struct MoeRouting {
  Tensor weights, indices, probs;
};
// softmax(logits [..., E]) and its top_k (renormalized over the k when
// `normalize`). Differentiable in logits through weights and probs.
MoeRouting moe_route(const Tensor& logits, int64_t top_k, bool normalize);
// x [..., H] (f32) -> [..., k, H]: each token's row once per chosen expert;
// a rank's array holds its tokens' rows in expert order (by expert, then
// token, then slot), read as flat rows by the two ops below.
Tensor moe_permute(const Tensor& x, const Tensor& indices, int64_t experts);
// rows [..., k, H] (f32, expert order) -> [..., H] = sum_j weights[.., j] *
// the row of (token, j): the permutation's weighted inverse.
Tensor moe_combine(const Tensor& rows, const Tensor& indices, const Tensor& weights, int64_t experts);
// rows [..., k, in] in expert order times each expert's weight [out, in]
// transposed (a linear layer per expert over its rows): [..., k, out] f32.
// The number of experts is weights.size(); bf16 operands make bf16 products.
Tensor grouped_linear(const Tensor& rows, const Tensor& indices, const std::vector<Tensor>& weights);
// Expert parallelism (src/ops/moe_ep.cc, docs/moe.md): rows [..., k, H] in
// expert order (the compute dtype) through each expert's SwiGLU MLP
// down(silu(gate x) * up x), the weights [F, H], [F, H], [H, F] in the rows'
// dtype: [..., k, H] f32, grouped_linear's three products in one op. The
// weights may live on other ranks than the rows (one subgroup per
// expert-parallel group): each call moves the rows to their experts' owners
// and back by Reshards it resolves for the step's routing counts.
Tensor moe_experts(const Tensor& rows, const Tensor& indices, const std::vector<Tensor>& gate,
                   const std::vector<Tensor>& up, const std::vector<Tensor>& down);
// [E] f32: the (token, slot) pairs routed to each expert (no gradient).
Tensor moe_counts(const Tensor& indices, int64_t experts);
// y itself, whose gradient also gives probs [..., E] the gradient `weights`
// [E] broadcast: the auxiliary load-balancing loss's term, its weights fed
// once the step's routing is known (docs/moe.md).
Tensor moe_aux_tap(const Tensor& y, const Tensor& probs, const Tensor& weights);
// sigmoid(gate [..., 1]) * x [..., H] (f32).
Tensor sigmoid_gate(const Tensor& x, const Tensor& gate);

// ---- distribution ----
// Marks a point where the tensor may change layout (docs/architecture.md,
// "Defined graph"). Identity on one device; resolved into communication by
// the annotation layer (docs/resolver.md). A named Reshard is a handle of
// the annotation plan: deduction takes its output's annotation from the plan
// under `name`. An unnamed one keeps its input's annotation. Its gradient is
// a *mirror* Reshard (named "backward.<name>" when `name` is set) whose
// destination deduction derives from the forward Reshard's input
// (docs/deduction.md).
Tensor reshard(const Tensor& x, const std::string& name = "");

// Whether `node` applies a Reshard (named, unnamed or mirror): the only op
// whose output may live on other devices than its input.
bool is_reshard(const Node& node);

// The id of the forward Reshard node that `node` mirrors (node is a Reshard
// made by the gradient of that one), or -1 for any other node.
int reshard_mirror_of(const Node& node);

}  // namespace hspmd::ops
