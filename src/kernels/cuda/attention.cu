// CUDA attention (attention.h contracts): the whole-sequence forward and
// backward and the blocks of ring attention, f32 outputs, with f32 or bf16
// products. A first, correct kernel set, not a fast one: one warp per query row
// (forward, dq) or per key row (dk, dv), an online softmax, every pair the
// mask lets through visited in index order; each output row has one writer,
// so the results are the same bits on every run (no atomics).
//
// The mask is the block form for both: query i sees key j iff
// q_start[b, i] <= k_index[j] <= q_index[i] and, with a window W > 0,
// q_index[i] - W < k_index[j]. The whole sequence is the block with
// q_index = k_index = 0 .. S-1 and q_start = where each token's keys start
// (documents and window folded in, on the host, by the CPU backend's
// rules and errors: the documents are read back, one synchronization per
// call). With bf16 products every operand of a product (q, k, v, grad_out,
// the probabilities and dS) is rounded to bf16 (nearest even) first; the
// sums stay f32.
//
// With bf16 products the whole-sequence forward and backward first offer the
// case to cuDNN's fused attention (attention_sdpa.cu; docs/cuda.md): these
// kernels run when it is off, refuses or is missing. Ring attention's blocks
// always run here.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kernels/cuda/runtime.h"
#include "hspmd/core/error.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/memory.h"

namespace hspmd::kernels::cuda {

namespace {

using namespace launch;

constexpr int kWarp = 32;
constexpr int kPer = 8;  // head dims per lane: D <= 256

struct Args {
  const float* q;
  const float* k;
  const float* v;
  int64_t B, Sq, Sk, Hq, Hkv, D;
  const int64_t* q_index;  // [Sq]
  const int64_t* k_index;  // [Sk]
  const int32_t* q_start;  // [B * Sq]
  float scale;
  int64_t window;
  bool bf16;
};

__device__ inline float rnd(float x, bool bf16) { return bf16 ? __bfloat162float(__float2bfloat16_rn(x)) : x; }

__device__ inline float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ inline bool visible(const Args& a, int64_t b, int64_t i, int64_t j) {
  const int64_t kj = a.k_index[j], qi = a.q_index[i];
  if (kj > qi || kj < a.q_start[b * a.Sq + i]) return false;
  return a.window <= 0 || qi - a.window < kj;
}

// Loads row[d] for this lane's dims (rounded), zeros past D.
__device__ inline void load_row(const float* row, int64_t D, bool bf16, float (&x)[kPer]) {
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int c = 0; c < kPer; ++c) {
    const int64_t d = lane + c * kWarp;
    x[c] = d < D ? rnd(row[d], bf16) : 0.0f;
  }
}

__device__ inline float dot(const float (&x)[kPer], const float* row, int64_t D, bool bf16) {
  const int lane = threadIdx.x % kWarp;
  float part = 0;
#pragma unroll
  for (int c = 0; c < kPer; ++c) {
    const int64_t d = lane + c * kWarp;
    if (d < D) part += x[c] * rnd(row[d], bf16);
  }
  return warp_sum(part);
}

__device__ inline int64_t warp_id() { return (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / kWarp; }

// Forward: a warp per query row (b, i, h): out [B, Sq, Hq, D], lse [B, Hq, Sq].
__global__ void forward_kernel(Args a, float* out, float* lse) {
  const int64_t w = warp_id();
  if (w >= a.B * a.Sq * a.Hq) return;
  const int64_t h = w % a.Hq, i = w / a.Hq % a.Sq, b = w / (a.Hq * a.Sq), hk = h / (a.Hq / a.Hkv);
  const int lane = threadIdx.x % kWarp;
  float qv[kPer], acc[kPer];
  load_row(a.q + w * a.D, a.D, a.bf16, qv);
#pragma unroll
  for (int c = 0; c < kPer; ++c) acc[c] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int64_t j = 0; j < a.Sk; ++j) {
    if (!visible(a, b, i, j)) continue;
    const int64_t kv = ((b * a.Sk + j) * a.Hkv + hk) * a.D;
    const float s = dot(qv, a.k + kv, a.D, a.bf16) * a.scale;
    const float m_new = fmaxf(m, s);
    const float corr = m == -INFINITY ? 0.0f : expf(m - m_new);
    const float p = expf(s - m_new);
    l = l * corr + p;
    const float pr = rnd(p, a.bf16);
#pragma unroll
    for (int c = 0; c < kPer; ++c) {
      const int64_t d = lane + c * kWarp;
      if (d < a.D) acc[c] = acc[c] * corr + pr * rnd(a.v[kv + d], a.bf16);
    }
    m = m_new;
  }
#pragma unroll
  for (int c = 0; c < kPer; ++c) {
    const int64_t d = lane + c * kWarp;
    if (d < a.D) out[w * a.D + d] = l > 0 ? acc[c] / l : 0.0f;
  }
  if (lane == 0) lse[(b * a.Hq + h) * a.Sq + i] = l > 0 ? m + logf(l) : -INFINITY;
}

struct Grads {
  const float* grad_out;  // [B, Sq, Hq, D]
  const float* lse;       // [B, Hq, Sq]
  const float* delta;     // [B, Hq, Sq]
  float* dq;
  float* dk;
  float* dv;
};

// dq of a query row: Σ_j dS_ij k_j * scale, added to dq.
__global__ void dq_kernel(Args a, Grads g) {
  const int64_t w = warp_id();
  if (w >= a.B * a.Sq * a.Hq) return;
  const int64_t h = w % a.Hq, i = w / a.Hq % a.Sq, b = w / (a.Hq * a.Sq), hk = h / (a.Hq / a.Hkv);
  const int lane = threadIdx.x % kWarp;
  float qv[kPer], gv[kPer], acc[kPer];
  load_row(a.q + w * a.D, a.D, a.bf16, qv);
  load_row(g.grad_out + w * a.D, a.D, a.bf16, gv);
#pragma unroll
  for (int c = 0; c < kPer; ++c) acc[c] = 0.0f;
  const int64_t at = (b * a.Hq + h) * a.Sq + i;
  const float row_lse = g.lse[at], row_delta = g.delta[at];
  for (int64_t j = 0; j < a.Sk; ++j) {
    if (!visible(a, b, i, j)) continue;
    const int64_t kv = ((b * a.Sk + j) * a.Hkv + hk) * a.D;
    const float p = expf(dot(qv, a.k + kv, a.D, a.bf16) * a.scale - row_lse);
    const float dp = dot(gv, a.v + kv, a.D, a.bf16);
    const float ds = rnd(p * (dp - row_delta), a.bf16);
#pragma unroll
    for (int c = 0; c < kPer; ++c) {
      const int64_t d = lane + c * kWarp;
      if (d < a.D) acc[c] += ds * rnd(a.k[kv + d], a.bf16);
    }
  }
#pragma unroll
  for (int c = 0; c < kPer; ++c) {
    const int64_t d = lane + c * kWarp;
    if (d < a.D) g.dq[w * a.D + d] += acc[c] * a.scale;
  }
}

// dk, dv of a key row (b, j, hk): over the query heads of its group and the
// queries that see it, in order; added to dk, dv.
__global__ void dkdv_kernel(Args a, Grads g) {
  const int64_t w = warp_id();
  if (w >= a.B * a.Sk * a.Hkv) return;
  const int64_t hk = w % a.Hkv, j = w / a.Hkv % a.Sk, b = w / (a.Hkv * a.Sk);
  const int64_t group = a.Hq / a.Hkv;
  const int lane = threadIdx.x % kWarp;
  float kv[kPer], vv[kPer], dk[kPer], dv[kPer];
  load_row(a.k + w * a.D, a.D, a.bf16, kv);
  load_row(a.v + w * a.D, a.D, a.bf16, vv);
#pragma unroll
  for (int c = 0; c < kPer; ++c) dk[c] = dv[c] = 0.0f;
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
    for (int64_t i = 0; i < a.Sq; ++i) {
      if (!visible(a, b, i, j)) continue;
      const int64_t row = ((b * a.Sq + i) * a.Hq + h) * a.D, at = (b * a.Hq + h) * a.Sq + i;
      const float p = expf(dot(kv, a.q + row, a.D, a.bf16) * a.scale - g.lse[at]);
      const float dp = dot(vv, g.grad_out + row, a.D, a.bf16);
      const float ds = rnd(p * (dp - g.delta[at]), a.bf16), pr = rnd(p, a.bf16);
#pragma unroll
      for (int c = 0; c < kPer; ++c) {
        const int64_t d = lane + c * kWarp;
        if (d < a.D) {
          dv[c] += pr * rnd(g.grad_out[row + d], a.bf16);
          dk[c] += ds * rnd(a.q[row + d], a.bf16);
        }
      }
    }
#pragma unroll
  for (int c = 0; c < kPer; ++c) {
    const int64_t d = lane + c * kWarp;
    if (d < a.D) {
      g.dk[w * a.D + d] += dk[c] * a.scale;
      g.dv[w * a.D + d] += dv[c];
    }
  }
}

// delta [B, H, S] = rowsum(grad_out * out), grad_out rounded with bf16_grad.
__global__ void row_dots_kernel(const float* out, const float* grad_out, float* delta, int64_t B, int64_t S,
                                int64_t H, int64_t D, bool bf16_grad) {
  const int64_t w = warp_id();
  if (w >= B * S * H) return;
  const int lane = threadIdx.x % kWarp;
  float part = 0;
  for (int64_t d = lane; d < D; d += kWarp) part += out[w * D + d] * rnd(grad_out[w * D + d], bf16_grad);
  part = warp_sum(part);
  const int64_t h = w % H, i = w / H % S, b = w / (H * S);
  if (lane == 0) delta[(b * H + h) * S + i] = part;
}

__global__ void merge_kernel(float* out, float* lse, const float* out_blk, const float* lse_blk, int64_t B,
                             int64_t S, int64_t H, int64_t D) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= B * S * H) return;
  const int64_t h = t % H, i = t / H % S, b = t / (H * S), at = (b * H + h) * S + i;
  if (lse_blk[at] == -INFINITY) return;
  const float m = fmaxf(lse[at], lse_blk[at]);
  const float w_old = expf(lse[at] - m), w_blk = expf(lse_blk[at] - m), sum = w_old + w_blk;
  for (int64_t d = 0; d < D; ++d) out[t * D + d] = (out[t * D + d] * w_old + out_blk[t * D + d] * w_blk) / sum;
  lse[at] = m + logf(sum);
}

unsigned warp_blocks(int64_t warps) {
  const int64_t threads = warps * kWarp;
  return static_cast<unsigned>((threads + kThreads - 1) / kThreads);
}

// Index arrays on the device, kept alive with the call.
struct DeviceIndex {
  NDArray q_index, k_index, q_start;
};

NDArray upload_i64(Stream& s, const int64_t* p, int64_t n) {
  NDArray host = NDArray::empty({n}, DType::I64);
  if (n > 0) std::copy(p, p + n, static_cast<int64_t*>(host.host_raw_data("attention index")));
  return to_device(s, host);
}

NDArray upload_i32(Stream& s, const int32_t* p, int64_t n) {
  NDArray host = NDArray::empty({n}, DType::I32);
  if (n > 0) std::copy(p, p + n, static_cast<int32_t*>(host.host_raw_data("attention index")));
  return to_device(s, host);
}

Args make_args(const NDArray& q, const NDArray& k, const NDArray& v, float scale, DType products, int64_t window,
               const DeviceIndex& idx, const char* what) {
  for (const NDArray* x : {&q, &k, &v}) {
    require_contiguous(what, *x);
    if (x->dtype() != DType::F32) fail("[cuda] ", what, ": q, k, v must be f32, got ", dtype_name(x->dtype()));
  }
  HSPMD_CHECK(q.ndim() == 4 && k.ndim() == 4 && v.shape() == k.shape() && q.dim(0) == k.dim(0) &&
                  q.dim(3) == k.dim(3),
              what, ": shapes");
  if (products != DType::F32 && products != DType::BF16)
    fail("[attention] products: must be f32 or bf16, got ", dtype_name(products));
  Args a{};
  a.q = q.data<float>(), a.k = k.data<float>(), a.v = v.data<float>();
  a.B = q.dim(0), a.Sq = q.dim(1), a.Hq = q.dim(2), a.D = q.dim(3), a.Sk = k.dim(1), a.Hkv = k.dim(2);
  if (a.Hkv <= 0 || a.Hq % a.Hkv != 0) fail("[attention] ", a.Hq, " query heads are not a multiple of ", a.Hkv, " kv heads");
  if (a.D > kPer * kWarp) fail("[cuda] ", what, ": head dim ", a.D, " above ", kPer * kWarp, " (this kernel's limit)");
  a.q_index = static_cast<const int64_t*>(idx.q_index.raw_data());
  a.k_index = static_cast<const int64_t*>(idx.k_index.raw_data());
  a.q_start = static_cast<const int32_t*>(idx.q_start.raw_data());
  a.scale = scale;
  a.window = window;
  a.bf16 = products == DType::BF16;
  return a;
}

// The whole sequence as one block: indices 0 .. S-1, the starts of the CPU
// backend's rules (from the documents read back to the host), the window
// folded in.
DeviceIndex whole_sequence(Stream& s, const NDArray& host_docs, int64_t B, int64_t S, int64_t window) {
  const std::vector<int32_t> starts = cpu::key_starts(host_docs, B, S, window);
  std::vector<int64_t> iota(S);
  std::iota(iota.begin(), iota.end(), int64_t{0});
  DeviceIndex idx;
  idx.q_index = upload_i64(s, iota.data(), S);
  idx.k_index = idx.q_index;
  idx.q_start = upload_i32(s, starts.data(), B * S);
  return idx;
}

DeviceIndex block_index(Stream& s, const AttentionBlock& blk) {
  DeviceIndex idx;
  idx.q_index = upload_i64(s, blk.q_index.data(), static_cast<int64_t>(blk.q_index.size()));
  idx.k_index = upload_i64(s, blk.k_index.data(), static_cast<int64_t>(blk.k_index.size()));
  idx.q_start = upload_i32(s, blk.q_start.data(), static_cast<int64_t>(blk.q_start.size()));
  return idx;
}

void run_forward(Stream& s, const Args& a, NDArray& out, NDArray& lse) {
  HSPMD_CHECK(out.ndim() == 4 && out.dim(0) == a.B && out.dim(1) == a.Sq && out.dim(2) == a.Hq && out.dim(3) == a.D &&
                  lse.numel() == a.B * a.Hq * a.Sq && out.dtype() == DType::F32 && lse.dtype() == DType::F32,
              "attention: outputs");
  const int64_t warps = a.B * a.Sq * a.Hq;
  if (warps == 0) return;
  forward_kernel<<<warp_blocks(warps), kThreads, 0, native(s)>>>(a, out.data<float>(), lse.data<float>());
  launched("attention_forward");
}

void run_backward(Stream& s, const Args& a, const Grads& g) {
  if (a.B * a.Sq * a.Hq > 0) {
    dq_kernel<<<warp_blocks(a.B * a.Sq * a.Hq), kThreads, 0, native(s)>>>(a, g);
    launched("attention_backward: dq");
  }
  if (a.B * a.Sk * a.Hkv > 0) {
    dkdv_kernel<<<warp_blocks(a.B * a.Sk * a.Hkv), kThreads, 0, native(s)>>>(a, g);
    launched("attention_backward: dk, dv");
  }
}

}  // namespace


// The documents array on the host. Every layer's attention, forward and
// backward, reads the same positions array of the step: the first call
// reads it back (a host wait), the others reuse that copy (per thread; the
// cache holds the device array, so its storage is not reused meanwhile).
NDArray host_documents(Stream& s, const NDArray& documents) {
  if (!documents.valid()) return NDArray();
  thread_local NDArray device_copy, host_copy;
  if (!device_copy.same_view(documents)) {
    host_copy = to_host(s, documents);
    device_copy = documents;
  }
  return host_copy;
}

void attention_forward(Stream& s, const NDArray& q, const NDArray& k, const NDArray& v, const NDArray& documents,
                       float scale, NDArray& out, NDArray& lse, AttentionTiles tiles, DType products,
                       int64_t window) {
  (void)tiles;  // one warp per row: no tiles
  if (window < 0) fail("[attention] window: must be >= 0 (0: no window), got ", window);
  HSPMD_CHECK(q.ndim() == 4 && k.ndim() == 4 && k.dim(1) == q.dim(1), "attention: q and k lengths");
  const NDArray host_docs = host_documents(s, documents);
  if (sdpa_attention_forward(s, q, k, v, host_docs, scale, out, lse, products, window)) return;
  const DeviceIndex idx = whole_sequence(s, host_docs, q.dim(0), q.dim(1), window);
  if (q.dtype() != DType::BF16 && out.dtype() != DType::BF16)
    return run_forward(s, make_args(q, k, v, scale, products, 0, idx, "attention_forward"), out, lse);
  // bf16 arrays that cuDNN did not take: our kernels on f32 copies, the output rounded once.
  NDArray o = NDArray::empty(out.shape(), DType::F32, out.device());
  const NDArray q32 = kernels::as_f32(s, q), k32 = kernels::as_f32(s, k), v32 = kernels::as_f32(s, v);
  run_forward(s, make_args(q32, k32, v32, scale, products, 0, idx, "attention_forward"), o, lse);
  out = out.dtype() == DType::BF16 ? cast(s, o, DType::BF16) : o;
}

void attention_backward(Stream& s, const NDArray& q, const NDArray& k, const NDArray& v, const NDArray& out,
                        const NDArray& lse, const NDArray& grad_out, const NDArray& documents, float scale,
                        NDArray& dq, NDArray& dk, NDArray& dv, AttentionTiles tiles, DType products,
                        int64_t window) {
  (void)tiles;
  if (window < 0) fail("[attention] window: must be >= 0 (0: no window), got ", window);
  HSPMD_CHECK(q.ndim() == 4 && k.ndim() == 4 && k.dim(1) == q.dim(1), "attention: q and k lengths");
  for (const NDArray* x : {&out, &lse, &grad_out}) require_contiguous("attention_grad", *x);
  HSPMD_CHECK(out.shape() == q.shape() && grad_out.shape() == q.shape() && dq.shape() == q.shape() &&
                  dk.shape() == k.shape() && dv.shape() == v.shape(),
              "attention_grad: shapes");
  const NDArray host_docs = host_documents(s, documents);
  if (sdpa_attention_backward(s, q, k, v, out, lse, grad_out, host_docs, scale, dq, dk, dv, products, window)) return;
  const DeviceIndex idx = whole_sequence(s, host_docs, q.dim(0), q.dim(1), window);
  // bf16 arrays that cuDNN did not take: our kernels on f32 copies.
  const NDArray q32 = kernels::as_f32(s, q), k32 = kernels::as_f32(s, k), v32 = kernels::as_f32(s, v);
  const NDArray out32 = kernels::as_f32(s, out), grad32 = kernels::as_f32(s, grad_out);
  const Args a = make_args(q32, k32, v32, scale, products, 0, idx, "attention_backward");
  NDArray delta = NDArray::empty({a.B, a.Hq, a.Sq}, DType::F32, q.device());
  attention_row_dots(s, out32, grad32, delta, a.bf16);
  // Our kernels accumulate f32 gradients: bf16 ones are rounded once after.
  const auto f32_target = [&](const NDArray& d) {
    return d.dtype() == DType::F32 ? d : NDArray::empty(d.shape(), DType::F32, d.device());
  };
  NDArray d32[3] = {f32_target(dq), f32_target(dk), f32_target(dv)};
  for (NDArray& x : d32) fill(s, x, 0.0f);
  run_backward(s, a, {grad32.data<float>(), lse.data<float>(), delta.data<float>(), d32[0].data<float>(),
                      d32[1].data<float>(), d32[2].data<float>()});
  NDArray* to[3] = {&dq, &dk, &dv};
  for (int i = 0; i < 3; ++i)
    if (to[i]->dtype() != DType::F32) *to[i] = cast(s, d32[i], to[i]->dtype());
}

void attention_block_forward(Stream& s, const AttentionBlock& blk, NDArray& out_blk, NDArray& lse_blk,
                             AttentionTiles tiles) {
  (void)tiles;
  const DeviceIndex idx = block_index(s, blk);
  run_forward(s, make_args(blk.q, blk.k, blk.v, blk.scale, blk.products, blk.window, idx, "attention_block_forward"),
              out_blk, lse_blk);
}

void attention_merge(Stream& s, NDArray& out, NDArray& lse, const NDArray& out_blk, const NDArray& lse_blk) {
  HSPMD_CHECK(out.ndim() == 4 && out.shape() == out_blk.shape() && lse.shape() == lse_blk.shape() &&
                  lse.numel() == out.dim(0) * out.dim(2) * out.dim(1),
              "attention merge: shapes");
  const int64_t B = out.dim(0), S = out.dim(1), H = out.dim(2), D = out.dim(3);
  if (B * S * H == 0) return;
  merge_kernel<<<blocks_for(B * S * H), kThreads, 0, native(s)>>>(out.data<float>(), lse.data<float>(),
                                                                  out_blk.data<float>(), lse_blk.data<float>(), B, S,
                                                                  H, D);
  launched("attention_merge");
}

void attention_row_dots(Stream& s, const NDArray& out, const NDArray& grad_out, NDArray& delta, bool bf16_grad) {
  HSPMD_CHECK(out.ndim() == 4 && grad_out.shape() == out.shape() &&
                  delta.numel() == out.dim(0) * out.dim(1) * out.dim(2),
              "attention row dots: shapes");
  const int64_t B = out.dim(0), S = out.dim(1), H = out.dim(2), D = out.dim(3);
  if (B * S * H == 0) return;
  row_dots_kernel<<<warp_blocks(B * S * H), kThreads, 0, native(s)>>>(out.data<float>(), grad_out.data<float>(),
                                                                      delta.data<float>(), B, S, H, D, bf16_grad);
  launched("attention_row_dots");
}

void attention_block_backward(Stream& s, const AttentionBlock& blk, const NDArray& grad_out, const NDArray& lse,
                              const NDArray& delta, NDArray& dq, NDArray& dk, NDArray& dv, AttentionTiles tiles) {
  (void)tiles;
  HSPMD_CHECK(grad_out.shape() == blk.q.shape() && dq.shape() == blk.q.shape() && dk.shape() == blk.k.shape() &&
                  dv.shape() == blk.v.shape(),
              "attention block grad: shapes");
  const DeviceIndex idx = block_index(s, blk);
  const Args a = make_args(blk.q, blk.k, blk.v, blk.scale, blk.products, blk.window, idx, "attention_block_backward");
  HSPMD_CHECK(lse.numel() == a.B * a.Hq * a.Sq && delta.numel() == lse.numel(), "attention block grad: lse, delta");
  run_backward(s, a, {grad_out.data<float>(), lse.data<float>(), delta.data<float>(), dq.data<float>(),
                      dk.data<float>(), dv.data<float>()});
}

}  // namespace hspmd::kernels::cuda
