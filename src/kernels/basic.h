// Kernels of the basic ops: linear algebra, layout, reductions and the model
// ops (embedding, RMSNorm, RoPE, SwiGLU, cross-entropy).
//
// Same contract as kernels.h: each kernel takes its stream first and runs on
// the stream's device (dispatch.cc), arrays are contiguous, outputs are preallocated by the
// caller with the right shape. Results are deterministic for a given thread
// count. Data errors (ids, targets) throw hspmd::Error.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hspmd/core/device.h"
#include "hspmd/core/ndarray.h"

namespace hspmd::kernels {

// ---- linear algebra ----
// The precision of a matmul's products (docs/precision.md, "GEMM backends").
// kF32: fp32 operands, fp32 accumulation. kBF16: operands rounded to bf16
// (nearest even), products accumulated in fp32.
enum class GemmCompute { kF32, kBF16 };

// out = op(a2) · op(b): a2 is `a` viewed as [numel / a.dim(-1), a.dim(-1)],
// b is 2-D; op transposes when the flag is set. out holds M*N elements.
// a and b are each F32 or BF16, out is F32 or BF16. The product is computed
// in bf16 (kBF16 above) when a or b is BF16 or `compute` is kBF16, else in
// fp32; the result is rounded to out's dtype (nearest even for BF16).
// Backends, chosen at run time: bf16 on oneDNN where this CPU has native bf16
// (bf16_gemm_native()), else emulated (operands rounded to bf16 values in
// fp32 buffers, then OpenBLAS sgemm: the same products, the sums in another
// order); fp32 on oneDNN by default (OpenBLAS sgemm without oneDNN, with
// HSPMD_GEMM_F32=openblas or set_f32_gemm_backend()). oneDNN primitives are
// made once per shape, transposes and dtypes (and thread count) and cached;
// both libraries use the thread count of set_num_threads().
//
// What a matmul adds to its product before writing `out` (at most one of the
// two; the arrays are borrowed for the call). Converts implicitly from an
// addend pointer (nullptr: nothing added).
//
// `addend` (f32, out's shape, out f32; not out itself): out = op(a)·op(b) +
// addend, the product rounded to f32 first and the addend added to it, the
// same bits as a matmul followed by add(out, addend), in one kernel where the
// backend has one (the backward folds a gradient's accumulation into the GEMM
// that makes the next term).
//
// `bias` (f32 [N], contiguous, N = out's last dim; out f32 or bf16): out =
// the f32 product plus bias[j] on every row (one f32 add per element),
// rounded once to out's dtype: the bits of a matmul to f32 followed by
// add_bias and a cast (Qwen2's q/k/v projections), in one GEMM with a bias
// epilogue where the backend has one (cuBLASLt), else the GEMM to f32 and
// one pass that adds and rounds.
struct GemmEpilogue {
  GemmEpilogue(const NDArray* addend_array = nullptr) : addend(addend_array) {}  // implicit: matmul(..., &addend)
  static GemmEpilogue with_bias(const NDArray* bias_array) {
    GemmEpilogue e;
    e.bias = bias_array;
    return e;
  }
  const NDArray* addend = nullptr;
  const NDArray* bias = nullptr;
};

// Throws hspmd::Error when both are set, or when the addend or the bias
// does not fit (the contract above).
void matmul(Stream& s, const NDArray& a, const NDArray& b, bool trans_a, bool trans_b, NDArray& out,
            GemmCompute compute = GemmCompute::kF32, GemmEpilogue epilogue = {});

// Whether this build and CPU run bf16 GEMMs natively: oneDNN is linked, its
// effective ISA includes avx512_core_bf16 (or AMX) and /proc/cpuinfo lists
// avx512_bf16 or amx_bf16. Computed once.
bool bf16_gemm_native();
// The GEMM backends in use, for logs, e.g. "oneDNN avx512_core_bf16 (bf16
// avx512_bf16); fp32 oneDNN matmul" or "OpenBLAS sgemm (bf16 emulated: built
// without oneDNN); fp32 OpenBLAS sgemm".
std::string gemm_isa_description();
// Forces (true) or stops forcing (false) the emulated bf16 path even where
// bf16 is native. The initial value is true when the environment has
// HSPMD_GEMM_BF16=emulate (read once; any other value but "native" or empty
// throws hspmd::Error at the first bf16 matmul).
void set_bf16_gemm_emulation(bool emulate);
// Whether bf16 matmuls run emulated now (forced, or not native).
bool bf16_gemm_emulated();

// The fp32 GEMM backend. The initial value comes from HSPMD_GEMM_F32
// (onednn | openblas, read once; default onednn when the build has it, see
// docs/precision.md; any other value throws hspmd::Error at the first fp32
// matmul).
enum class GemmF32Backend { kOpenBLAS, kOneDNN };
// Returns false, and keeps OpenBLAS, when oneDNN is not in this build.
bool set_f32_gemm_backend(GemmF32Backend backend);
GemmF32Backend f32_gemm_backend();

// How a device backend (CUDA) picks a GEMM's algorithm (docs/cuda.md,
// "GEMM algorithm choice"). kHeuristic (default): the library's first
// choice (cublasGemmEx's own; cuBLASLt's first heuristic result for a GEMM
// with an addend). kMeasured: at the first call of each key (shape, dtypes,
// transposes, addend, alignments) the default's output is digested on the
// device, and of the top heuristic results without split-K, those whose
// output has the default's digest are timed with it on the call's own
// arrays; the fastest is kept for the process (one host wait per new key;
// on any error, or while the stream is captured, the default). So the bits
// are the heuristic mode's whichever wins; not the default until measured
// on a GPU. The initial value comes from
// HSPMD_GEMM_ALGO (heuristic | measured, read once; any other value throws
// hspmd::Error at the first GEMM that reads it). The CPU backends ignore it.
enum class GemmAlgorithm { kHeuristic, kMeasured };
void set_gemm_algorithm(GemmAlgorithm algorithm);
GemmAlgorithm gemm_algorithm();

// ---- layout ----
// out = a with dims d0 and d1 swapped (materialized).
void transpose(Stream& s, const NDArray& a, int d0, int d1, NDArray& out);
// out = a[..., begin : begin + out.dim(axis), ...].
void slice(Stream& s, const NDArray& a, int axis, int64_t begin, NDArray& out);
// out = zeros, then out[..., begin : begin + grad.dim(axis), ...] = grad.
void slice_backward(Stream& s, const NDArray& grad, int axis, int64_t begin, NDArray& out);
// out = the parts joined along `axis`.
void concat(Stream& s, const std::vector<NDArray>& parts, int axis, NDArray& out);
// out = sum of a over the dims with reduced[d] set (out keeps the others).
void reduce_sum(Stream& s, const NDArray& a, const std::vector<bool>& reduced, NDArray& out);
// Inverse of reduce_sum's shape change: out[i] = g[i with reduced dims dropped].
void broadcast_reduced(Stream& s, const NDArray& g, const std::vector<bool>& reduced, NDArray& out);

// ---- model ops ----
// `weight` holds vocabulary rows [vocab_begin, vocab_begin + weight.dim(0)) of
// a vocabulary of `vocab_size` (vocab parallel; the whole of it on one device:
// 0, weight.dim(0)). out[t, :] = weight[ids[t] - vocab_begin, :] for the ids
// it holds, zeros for the others (a partial sum over the vocab shards).
// Throws hspmd::Error on an id outside [0, vocab_size).
void embedding(Stream& s, const NDArray& weight, const NDArray& ids, int64_t vocab_begin,
               int64_t vocab_size, NDArray& out);
// dweight (rows [vocab_begin, vocab_begin + dweight.dim(0)) of vocab_size) =
// zeros, then dweight[ids[t] - vocab_begin, :] += grad[t, :] for the ids it
// holds, in token order. Throws like embedding.
void embedding_backward(Stream& s, const NDArray& grad, const NDArray& ids, int64_t vocab_begin,
                        int64_t vocab_size, NDArray& dweight);
// out = x * rsqrt(mean(x^2, -1) + eps) * weight; x f32 or bf16 (read
// exactly), out f32 or bf16 (rounded once), weight f32.
void rms_norm(Stream& s, const NDArray& x, const NDArray& weight, float eps, NDArray& out);
// A residual add and the RMSNorm of its sum in one pass: sum = a + b (a and
// b f32 or bf16, read exactly; the f32 sum, rounded once where `sum` is
// bf16), out = rms_norm(sum as stored, weight, eps) (f32 or bf16): the bits
// of add(a, b, sum) followed by rms_norm(sum, weight, eps, out) on the same
// backend's kernels up to the order of the row's double sum (the CPU runs
// exactly those two).
void add_rms_norm(Stream& s, const NDArray& a, const NDArray& b, const NDArray& weight, float eps, NDArray& sum,
                  NDArray& out);
// `addend` (f32 or bf16, x's shape): dx = the norm's dx + addend, added as
// the last step (the same bits as a separate add), in the same pass. x may
// be bf16 (read exactly) and dx bf16 (the f32 result rounded once: the bits
// of a cast after it). `dx_bf16` (with an f32 dx): also dx rounded to bf16,
// written in the same pass (the bits of a cast of dx).
void rms_norm_backward(Stream& s, const NDArray& dy, const NDArray& x, const NDArray& weight,
                       float eps, NDArray& dx, NDArray& dweight, const NDArray* addend = nullptr,
                       NDArray* dx_bf16 = nullptr);
// Rotates x [B, S, heads, D] by angle positions[b, s] * theta^(-2i/D)
// (rotate_half convention); `inverse` rotates by the negated angle. x f32
// or bf16 (read exactly), out f32 or bf16 (computed in f32, rounded once).
void rope(Stream& s, const NDArray& x, const NDArray& positions, float theta, bool inverse,
          NDArray& out);
// rope of q and of k (the same positions, any head counts, one head dim) in
// one call: the bits of rope(q, ...) and rope(k, ...) (the GPU computes the
// cos/sin table once and rotates both in one launch).
void rope_qk(Stream& s, const NDArray& q, const NDArray& k, const NDArray& positions, float theta, bool inverse,
             NDArray& q_out, NDArray& k_out);
// out = silu(gate) * up, in f32; each array f32 or bf16 (gate and up alike;
// dgate and dup in gate's dtype on CUDA), a bf16 result rounded once.
void swiglu(Stream& s, const NDArray& gate, const NDArray& up, NDArray& out);
// `out` (gate's size, f32 or bf16): also writes the forward's output,
// computed as swiglu computes it (the same bits), in the same pass.
void swiglu_backward(Stream& s, const NDArray& dy, const NDArray& gate, const NDArray& up,
                     NDArray& dgate, NDArray& dup, NDArray* out = nullptr);
// loss (scalar) = Σ_{targets != ignore} (logsumexp(row) - row[target]) / normalizer;
// lse [rows] receives logsumexp(row) (0 for ignored rows) for the backward.
// Throws hspmd::Error on a target outside [0, V) that is not ignore_index.
// `classes` > 0: only the first `classes` columns are classes (a padded
// vocabulary); the others are left out of the softmax.
void cross_entropy(Stream& s, const NDArray& logits, const NDArray& targets,
                   const NDArray& normalizer,
                   int ignore_index, NDArray& loss, NDArray& lse, int64_t classes = 0);
// Vocab-parallel cross-entropy, where `logits` holds vocabulary entries
// [vocab_begin, vocab_begin + logits.dim(-1)) of vocab_size, in two steps
// around the vocab group's communication:
// 1. Per shard: local_lse[r] = logsumexp of the shard's row; target_logit[r]
//    = row[target - vocab_begin] when the shard holds the target, else 0
//    (both 0 for ignored rows). Throws hspmd::Error on a target outside
//    [0, vocab_size) that is not ignore_index.
//    With `classes` > 0, entries >= classes are left out (a shard holding
//    none of them gets local_lse -inf).
void cross_entropy_shard_stats(Stream& s, const NDArray& logits, const NDArray& targets,
                               int64_t vocab_begin, int64_t vocab_size, int ignore_index,
                               NDArray& local_lse, NDArray& target_logit, int64_t classes = 0);
// 2. From every shard's local_lse gathered as shard_lse [shards, rows] and
//    target_logit summed over the shards: lse[r] = m + log Σ_s exp(shard_lse[s, r] - m)
//    with m the max over shards (0 for ignored rows), and loss as above. The
//    result depends on the inputs only, so every shard computes the same.
void cross_entropy_combine(Stream& s, const NDArray& shard_lse, const NDArray& target_logit,
                           const NDArray& targets, const NDArray& normalizer, int ignore_index,
                           NDArray& loss, NDArray& lse);
// dlogits = dloss * (exp(row - lse) - onehot(target)) / normalizer; zero for
// ignored rows. `logits` holds vocabulary entries [vocab_begin, vocab_begin +
// logits.dim(-1)) and `lse` the log-sum-exp over the whole vocabulary, so a
// vocab shard needs no communication.
// Entries >= classes (when > 0) get zero gradient. dlogits: f32, or bf16
// (each value computed in f32 and rounded once).
void cross_entropy_backward(Stream& s, const NDArray& dloss, const NDArray& logits,
                            const NDArray& targets,
                            const NDArray& normalizer, const NDArray& lse, int ignore_index,
                            int64_t vocab_begin, NDArray& dlogits, int64_t classes = 0);

// ---- mixture of experts (docs/moe.md) ----
// Token rows T (the leading dims of the arrays flattened), experts E, k
// experts per token. The router: probs [T, E] = softmax(logits [T, E]) (f32,
// computed in double per row); indices [T, k] (i32) the k largest probs in
// descending order (the lower expert first on a tie), weights [T, k] their
// probs, divided by their sum when `normalize` (Mixtral; Qwen2-MoE's
// norm_topk_prob).
void moe_route(Stream& s, const NDArray& logits, int64_t top_k, bool normalize, NDArray& weights,
               NDArray& indices, NDArray& probs);
// dlogits [T, E] of moe_route from dweights [T, k] and, when not null,
// dprobs [T, E] (the auxiliary loss's gradient): the top-k and its
// normalization's gradient, then the softmax's.
void moe_route_backward(Stream& s, const NDArray& probs, const NDArray& indices, const NDArray& dweights,
                        const NDArray* dprobs, bool normalize, NDArray& dlogits);
// y [T, H] = sum over j of weights[t, j] * rows_in[rows[t, j], :] (weights
// null: 1), j ascending; rows [T, k] (i32) index rows_in [R, H] (f32). Token
// permutation's inverse (and, without weights, its gradient).
void moe_combine(Stream& s, const NDArray& rows_in, const NDArray& rows, const NDArray* weights, NDArray& y);
// Its gradient: drows_in[rows[t, j], :] = weights[t, j] * dy[t, :] (every
// row of drows_in is named once by `rows`; rows named by none are zeros) and,
// when dweights is not null, dweights[t, j] = dot(dy[t, :], rows_in[rows[t, j], :])
// in double.
void moe_combine_backward(Stream& s, const NDArray& dy, const NDArray& rows_in, const NDArray& rows,
                          const NDArray* weights, NDArray& drows_in, NDArray* dweights);
// out [T, H] = sigmoid(gate [T]) * x [T, H] (Qwen2-MoE's shared expert gate).
void sigmoid_gate(Stream& s, const NDArray& x, const NDArray& gate, NDArray& out);
// dx = sigmoid(gate) * dy; dgate[t] = sum_h dy[t, h] x[t, h] * s (1 - s), in double.
void sigmoid_gate_backward(Stream& s, const NDArray& dy, const NDArray& x, const NDArray& gate, NDArray& dx,
                           NDArray& dgate);

}  // namespace hspmd::kernels
