// CUDA RMSNorm (f32 math; x, the output, dx and the addend f32 or bf16) and
// SwiGLU (f32 or bf16 arrays, f32 math), forward and backward (basic.h
// contracts).
// RMSNorm: sums in double as the CPU kernel does, so the two agree to f32
// rounding. The backward reads each row once (rows_kernel below): dweight as
// per-block partial sums over fixed runs of rows, then over the blocks in a
// fixed order (the same bits on every run; the CPU sums the rows in one
// double, so the two agree to f32 rounding). Rows too wide for it take two
// kernels (dx, then launch::column_sums).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "kernels/cuda/runtime.h"
#include "hspmd/core/error.h"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/launch.cuh"

namespace hspmd::kernels::cuda {

namespace {

using namespace launch;

__device__ float inv_rms(double ss, int64_t h, float eps) {
  return static_cast<float>(1.0 / sqrt(ss / static_cast<double>(h) + eps));
}

// X: x's type, O: the output's (f32 or bf16; a bf16 x is read exactly, a
// bf16 output rounded once).
template <typename X, typename O>
__global__ void rms_norm_kernel(const X* x, const float* w, float eps, O* y, int64_t h) {
  __shared__ double scratch[kThreads];
  const X* xr = x + blockIdx.x * h;
  O* yr = y + blockIdx.x * h;
  double ss = 0;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    const float v = to_f32(xr[i]);
    ss += static_cast<double>(v) * v;
  }
  const float s = inv_rms(block_sum(ss, scratch), h, eps);
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) yr[i] = from_f32<O>(w[i] * (to_f32(xr[i]) * s));
}

// ---- the forward in one read of each row ----
// One block of kThreads per row (grid-stride over rows). Thread t owns the
// column groups g = t + k * kThreads (k < K) of V consecutive columns (V =
// kVec: 16-byte loads and stores; V = 1: any width or alignment), so the row
// is read once into registers: its sum of squares in double (each thread
// its columns in order, a butterfly over the warp, then the warps' totals
// in warp order: one barrier a row, every thread the same bits), then
// w * (x * s) written from the registers (rms_norm_kernel's expression).
// rms_norm_kernel above stays for rows wider than kThreads * V * K.
template <int V, int K, typename X, typename O>
__global__ void __launch_bounds__(kThreads) rms_norm_rows_kernel(const X* x, const float* w, float eps, O* y,
                                                                 int64_t rows, int64_t h) {
  __shared__ double warp_sums[2][kThreads / 32];  // [row parity][warp]: one barrier a row
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int parity = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x, parity ^= 1) {  // the same trip count in every thread
    const int64_t base = r * h;
    float xv[K][V];
    double ss = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = (threadIdx.x + static_cast<int64_t>(k) * kThreads) * V;
      if (c < h) {
        load<V>(x, base + c, xv[k]);
#pragma unroll
        for (int v = 0; v < V; ++v) ss += static_cast<double>(xv[k][v]) * xv[k][v];
      }
    }
#pragma unroll
    for (int m = 16; m > 0; m /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, m);
    if (lane == 0) warp_sums[parity][warp] = ss;
    __syncthreads();
    ss = 0;
#pragma unroll
    for (int i = 0; i < kThreads / 32; ++i) ss += warp_sums[parity][i];
    const float s = inv_rms(ss, h, eps);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = (threadIdx.x + static_cast<int64_t>(k) * kThreads) * V;
      if (c < h) {
        float wv[V], out[V];
        load<V>(w, c, wv);
#pragma unroll
        for (int v = 0; v < V; ++v) out[v] = wv[v] * (xv[k][v] * s);
        store<V>(y, base + c, out);  // a bf16 output: the f32 value rounded once
      }
    }
  }
}

// The residual add and the norm of its sum (add_rms_norm) in one pass:
// rms_norm_rows_kernel's scheme with x = a + b (f32, each read exactly), the
// sum written in S (a bf16 sum rounded once, and the norm then reads the
// rounded value, as the norm after a separate add would).
template <int V, int K, typename A, typename B, typename S, typename O>
__global__ void __launch_bounds__(kThreads) add_rms_norm_rows_kernel(const A* a, const B* b, const float* w,
                                                                     float eps, S* sum, O* y, int64_t rows,
                                                                     int64_t h) {
  __shared__ double warp_sums[2][kThreads / 32];  // [row parity][warp]: one barrier a row
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int parity = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x, parity ^= 1) {  // the same trip count in every thread
    const int64_t base = r * h;
    float xv[K][V];
    double ss = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = (threadIdx.x + static_cast<int64_t>(k) * kThreads) * V;
      if (c < h) {
        float bv[V];
        load<V>(a, base + c, xv[k]);
        load<V>(b, base + c, bv);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          xv[k][v] += bv[v];
          if constexpr (!std::is_same_v<S, float>) xv[k][v] = to_f32(from_f32<S>(xv[k][v]));  // as stored
        }
        store<V>(sum, base + c, xv[k]);  // a bf16 sum: the f32 sum rounded once (the same rounding)
#pragma unroll
        for (int v = 0; v < V; ++v) ss += static_cast<double>(xv[k][v]) * xv[k][v];
      }
    }
#pragma unroll
    for (int m = 16; m > 0; m /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, m);
    if (lane == 0) warp_sums[parity][warp] = ss;
    __syncthreads();
    ss = 0;
#pragma unroll
    for (int i = 0; i < kThreads / 32; ++i) ss += warp_sums[parity][i];
    const float s = inv_rms(ss, h, eps);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = (threadIdx.x + static_cast<int64_t>(k) * kThreads) * V;
      if (c < h) {
        float wv[V], out[V];
        load<V>(w, c, wv);
#pragma unroll
        for (int v = 0; v < V; ++v) out[v] = wv[v] * (xv[k][v] * s);
        store<V>(y, base + c, out);
      }
    }
  }
}

// A row's sum of squares of x and of dy·w·x, in double: each thread its
// columns threadIdx.x + k·blockDim.x in order, then block_sum's fixed tree
// (every thread of the block calls it).
template <typename X>
__device__ void norm_row_sums(const X* xr, const float* gr, const float* w, int64_t h, double* scratch, double& ss,
                              double& dot) {
  ss = 0, dot = 0;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    const float v = to_f32(xr[i]);
    ss += static_cast<double>(v) * v;
    dot += static_cast<double>(gr[i]) * w[i] * v;
  }
  ss = block_sum(ss, scratch);
  dot = block_sum(dot, scratch);
}

// dx, and each row's scale s_r for dweight. X: x's type, A: the addend's,
// D: dx's (a bf16 dx is the f32 result rounded once).
template <typename X, typename A, typename D>
__global__ void rms_norm_dx_kernel(const float* dy, const X* x, const float* w, float eps, D* dx, float* row_scale,
                                   const A* addend, __nv_bfloat16* dx16, int64_t h) {
  __shared__ double scratch[kThreads];
  const X* xr = x + blockIdx.x * h;
  const float* gr = dy + blockIdx.x * h;
  D* dr = dx + blockIdx.x * h;
  double ss, dot;
  norm_row_sums(xr, gr, w, h, scratch, ss, dot);
  const float s = inv_rms(ss, h, eps);
  if (threadIdx.x == 0) row_scale[blockIdx.x] = s;
  const float c = static_cast<float>(dot * s * s * s / static_cast<double>(h));
  const A* ar = addend != nullptr ? addend + blockIdx.x * h : nullptr;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    const float v = s * w[i] * gr[i] - to_f32(xr[i]) * c;
    // the norm's dx rounded, then the addend: a separate add's bits
    const float d = ar != nullptr ? v + to_f32(ar[i]) : v;
    dr[i] = from_f32<D>(d);
    if (dx16 != nullptr) dx16[blockIdx.x * h + i] = __float2bfloat16_rn(d);  // a cast of the f32 dx
  }
}

// dweight[j] = Σ_rows dy[r, j] * (x[r, j] * s_r), as the CPU kernel's term.
template <typename X>
struct RmsNormDwTerm {
  const float* dy;
  const X* x;
  const float* s;
  int64_t h;
  __device__ double operator()(int64_t r, int64_t j) const {
    return static_cast<double>(dy[r * h + j]) * (to_f32(x[r * h + j]) * s[r]);
  }
};

// Rows per partial sum of dweight on the two-kernel path (rows wider than
// the one-pass kernel takes): [16384, 2048] gives 256 x 8 blocks.
constexpr int64_t kNormRowChunk = 64;

// ---- the one-pass backward ----
// A block of kThreads takes `per_block` consecutive rows (the last block
// fewer; rows_per_block: about kTargetBlocks blocks), one row at a time. Thread t owns the column groups g = t + k *
// kThreads (k < K) of V consecutive columns each (V = kVec: 16-byte loads
// and stores; V = 1: any width or alignment), so a row up to kThreads * V *
// K wide is read once: x, dy (and the addend) land in registers, the row's
// sums of x² and dy·w·x are taken in double (each thread its columns in
// order, a butterfly over the warp, then the warps' totals in warp order:
// every thread gets the same bits), and dx is written from the registers.
// Each thread adds the row's dweight terms to its columns' double sums in
// row order; the block writes them as its row of `partial`, and
// chunk_totals_kernel adds the blocks' rows in a fixed order. Traffic: one
// read of dy, x and the addend, one write of dx (w is read again for each
// row, from L1), and 16 * h bytes per block for the partial sums (written,
// then read).
constexpr int64_t kTargetBlocks = 512;  // about 4 resident blocks on each of 132 SMs: one wave
constexpr int64_t kMinRowsPerBlock = 8;

// Rows per block: a function of the row count alone, so the sums' order
// (and the bits) do not depend on the GPU. [16384, h] takes 32.
int64_t rows_per_block(int64_t rows) {
  const int64_t per = (rows + kTargetBlocks - 1) / kTargetBlocks;
  return per > kMinRowsPerBlock ? per : kMinRowsPerBlock;
}
constexpr int kWarps = kThreads / 32;

__device__ inline double warp_sum(double v) {
#pragma unroll
  for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);  // a + b == b + a: every lane alike
  return v;
}

template <int V, int K, typename X, typename A, typename D>
__global__ void __launch_bounds__(kThreads, K == 1 ? 4 : (K == 2 ? 2 : 1))
    rms_norm_backward_rows_kernel(const float* dy, const X* x, const float* w, float eps, D* dx, const A* addend,
                                  __nv_bfloat16* dx16, double* partial, int64_t rows, int64_t h, int64_t per_block) {
  __shared__ double warp_sums[2][2][kWarps];  // [row parity][x², dy·w·x][warp]: one barrier a row
  // This thread's dweight sums, slot (k * V + v) * kThreads + threadIdx.x
  // (its own: no barrier; consecutive threads, consecutive banks), in shared
  // memory rather than registers, which hold the row in flight instead.
  extern __shared__ double acc[];
#pragma unroll
  for (int i = 0; i < K * V; ++i) acc[i * kThreads + threadIdx.x] = 0;
  const int64_t r0 = blockIdx.x * per_block;
  const int64_t r1 = r0 + per_block < rows ? r0 + per_block : rows;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t r = r0; r < r1; ++r) {  // the same trip count in every thread: the barrier is safe
    const int64_t base = r * h;
    float xv[K][V], gv[K][V], av[K][V];
    double ss = 0, dot = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = (threadIdx.x + static_cast<int64_t>(k) * kThreads) * V;
      if (c < h) {
        load<V>(x, base + c, xv[k]);
        load<V>(dy, base + c, gv[k]);
        if (addend != nullptr) load<V>(addend, base + c, av[k]);
        float wv[V];  // read again each row (an L1 hit): registers kept for the rows in flight
        load<V>(w, c, wv);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          ss += static_cast<double>(xv[k][v]) * xv[k][v];
          dot += static_cast<double>(gv[k][v]) * wv[v] * xv[k][v];
        }
      }
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    const int parity = static_cast<int>((r - r0) & 1);
    if (lane == 0) warp_sums[parity][0][warp] = ss, warp_sums[parity][1][warp] = dot;
    __syncthreads();
    ss = 0, dot = 0;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) ss += warp_sums[parity][0][i], dot += warp_sums[parity][1][i];
    const float s = inv_rms(ss, h, eps);
    const float cf = static_cast<float>(dot * s * s * s / static_cast<double>(h));
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = (threadIdx.x + static_cast<int64_t>(k) * kThreads) * V;
      if (c < h) {
        float out[V], wv[V];
        load<V>(w, c, wv);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const float d = s * wv[v] * gv[k][v] - xv[k][v] * cf;
          out[v] = addend != nullptr ? d + av[k][v] : d;  // the norm's dx, then the addend: a separate add's bits
          acc[(k * V + v) * kThreads + threadIdx.x] += static_cast<double>(gv[k][v]) * (xv[k][v] * s);  // RmsNormDwTerm's
        }
        store<V>(dx, base + c, out);  // a bf16 dx: the f32 value rounded once
        if (dx16 != nullptr) store<V>(dx16, base + c, out);  // dx's bf16 copy: a cast's rounding
      }
    }
  }
  double* pr = partial + blockIdx.x * h;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t c = (threadIdx.x + static_cast<int64_t>(k) * kThreads) * V;
    if (c < h)
#pragma unroll
      for (int v = 0; v < V; ++v) pr[c + v] = acc[(k * V + v) * kThreads + threadIdx.x];
  }
}

// out[j] = Σ_b partial[b, j] over the blocks' rows of partial sums, in a
// fixed order: kSlices slices of consecutive rows, each summed in row order
// by one thread, then the slices in order. A block takes 32 columns (each
// slice reads 256 contiguous bytes a row), so [512, 2048] runs 64 blocks
// with 8 loads in flight per thread instead of one thread per column
// walking every row.
constexpr int kSlices = kThreads / 32;

__global__ void chunk_totals_kernel(const double* partial, int64_t chunks, int64_t cols, float* out) {
  __shared__ double slice_sums[kSlices][32];
  const int64_t j = blockIdx.x * int64_t{32} + threadIdx.x;
  const int64_t per = (chunks + kSlices - 1) / kSlices, c0 = threadIdx.y * per;
  const int64_t c1 = c0 + per < chunks ? c0 + per : chunks;
  double acc = 0;
  if (j < cols) {
#pragma unroll 8
    for (int64_t c = c0; c < c1; ++c) acc += partial[c * cols + j];
  }
  slice_sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    double total = 0;
#pragma unroll
    for (int i = 0; i < kSlices; ++i) total += slice_sums[i][threadIdx.x];
    out[j] = static_cast<float>(total);
  }
}

// The one-pass kernel's column groups per thread (its K) for a row of h
// (vectorized: 1, 2 or 4 groups of kVec; else 16 single columns), or 0 when
// the row is too wide for it (the two-kernel path).
int groups_per_thread(int64_t h, bool vec) {
  if (!vec) return h <= static_cast<int64_t>(kThreads) * 16 ? 16 : 0;
  for (int k : {1, 2, 4})
    if (h <= static_cast<int64_t>(kThreads) * kVec * k) return k;
  return 0;
}

__device__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

// SwiGLU in f32 on f32 or bf16 arrays (T: gate and up, O: the output).
template <typename T, typename O>
struct SwigluOp {
  const T* g;
  const T* u;
  O* y;
  template <int V>
  __device__ void apply(int64_t i) const {
    float gv[V], uv[V];
    load<V>(g, i, gv);
    load<V>(u, i, uv);
#pragma unroll
    for (int k = 0; k < V; ++k) gv[k] = gv[k] * sigmoidf(gv[k]) * uv[k];
    store<V>(y, i, gv);
  }
};

// D: dy; T: gate, up, dgate and dup; O: the recomputed output, if any.
template <typename D, typename T, typename O>
struct SwigluBackwardOp {
  const D* d;
  const T* g;
  const T* u;
  T* dg;
  T* du;
  O* y;  // nullptr: not written
  template <int V>
  __device__ void apply(int64_t i) const {
    float dv[V], gv[V], uv[V], dgv[V], duv[V];
    load<V>(d, i, dv);
    load<V>(g, i, gv);
    load<V>(u, i, uv);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float s = sigmoidf(gv[k]);
      duv[k] = dv[k] * gv[k] * s;
      dgv[k] = dv[k] * uv[k] * s * (1.0f + gv[k] * (1.0f - s));  // silu'(x) = s (1 + x (1 - s))
    }
    store<V>(du, i, duv);
    store<V>(dg, i, dgv);
    if (y != nullptr) {  // SwigluOp's expression: its bits
#pragma unroll
      for (int k = 0; k < V; ++k) gv[k] = gv[k] * sigmoidf(gv[k]) * uv[k];
      store<V>(y, i, gv);
    }
  }
};

}  // namespace

void rms_norm(Stream& s, const NDArray& x, const NDArray& weight, float eps, NDArray& out) {
  require_contiguous("rms_norm", x);
  require_contiguous("rms_norm", weight);
  const int64_t h = weight.numel(), rows = h == 0 ? 0 : x.numel() / h;
  HSPMD_CHECK(x.dim(-1) == h && out.numel() == x.numel(), "rms_norm: sizes");
  if (rows == 0) return;
  const bool vec = h % kVec == 0 && aligned16(x.raw_data()) && aligned16(weight.raw_data()) &&
                   aligned16(out.raw_data());
  const int k = groups_per_thread(h, vec);
  const unsigned grid = static_cast<unsigned>(rows < (1 << 20) ? rows : (1 << 20));
  with_float_type("rms_norm", x, [&](auto* px) {
    with_float_type("rms_norm", out, [&](auto* y) {
      using X = std::remove_const_t<std::remove_pointer_t<decltype(px)>>;
      using O = std::remove_pointer_t<decltype(y)>;
      if (k == 0) {  // rows wider than the one-read kernel takes
        rms_norm_kernel<<<static_cast<unsigned>(rows), kThreads, 0, native(s)>>>(px, weight.data<float>(), eps, y, h);
        return;
      }
      const auto kernel = !vec ? &rms_norm_rows_kernel<1, 16, X, O>
                          : k == 1 ? &rms_norm_rows_kernel<kVec, 1, X, O>
                          : k == 2 ? &rms_norm_rows_kernel<kVec, 2, X, O>
                                   : &rms_norm_rows_kernel<kVec, 4, X, O>;
      kernel<<<grid, kThreads, 0, native(s)>>>(px, weight.data<float>(), eps, y, rows, h);
    });
  });
  launched("rms_norm");
}

void add_rms_norm(Stream& s, const NDArray& a, const NDArray& b, const NDArray& weight, float eps, NDArray& sum,
                  NDArray& out) {
  require_contiguous("add_rms_norm", a);
  require_contiguous("add_rms_norm", b);
  require_contiguous("add_rms_norm", weight);
  const int64_t h = weight.numel(), rows = h == 0 ? 0 : a.numel() / h;
  HSPMD_CHECK(a.dim(-1) == h && b.numel() == a.numel() && sum.numel() == a.numel() && out.numel() == a.numel(),
              "add_rms_norm: sizes");
  if (rows == 0) return;
  const bool vec = h % kVec == 0 && aligned16(a.raw_data()) && aligned16(b.raw_data()) &&
                   aligned16(weight.raw_data()) && aligned16(sum.raw_data()) && aligned16(out.raw_data());
  const int k = groups_per_thread(h, vec);
  if (k == 0) {  // rows wider than the one-pass kernel takes: the two kernels
    add(s, a, b, sum);
    rms_norm(s, sum, weight, eps, out);
    return;
  }
  const unsigned grid = static_cast<unsigned>(rows < (1 << 20) ? rows : (1 << 20));
  with_float_type("add_rms_norm", a, [&](auto* pa) {
    with_float_type("add_rms_norm", b, [&](auto* pb) {
      with_float_type("add_rms_norm", sum, [&](auto* ps) {
        with_float_type("add_rms_norm", out, [&](auto* y) {
          using A = std::remove_pointer_t<decltype(pa)>;
          using B = std::remove_pointer_t<decltype(pb)>;
          using S = std::remove_pointer_t<decltype(ps)>;
          using O = std::remove_pointer_t<decltype(y)>;
          const auto kernel = !vec ? &add_rms_norm_rows_kernel<1, 16, A, B, S, O>
                              : k == 1 ? &add_rms_norm_rows_kernel<kVec, 1, A, B, S, O>
                              : k == 2 ? &add_rms_norm_rows_kernel<kVec, 2, A, B, S, O>
                                       : &add_rms_norm_rows_kernel<kVec, 4, A, B, S, O>;
          kernel<<<grid, kThreads, 0, native(s)>>>(pa, pb, weight.data<float>(), eps, ps, y, rows, h);
        });
      });
    });
  });
  launched("add_rms_norm");
}

void rms_norm_backward(Stream& s, const NDArray& dy, const NDArray& x, const NDArray& weight, float eps, NDArray& dx,
                       NDArray& dweight, const NDArray* addend, NDArray* dx_bf16) {
  require_contiguous("rms_norm_backward", dy);
  if (dx_bf16 != nullptr)
    HSPMD_CHECK(dx.dtype() == DType::F32 && dx_bf16->dtype() == DType::BF16 && dx_bf16->numel() == dx.numel() &&
                    dx_bf16->is_contiguous(),
                "rms_norm_backward: dx_bf16 needs an f32 dx and a contiguous bf16 array of its size");
  auto* dx16 = dx_bf16 != nullptr ? static_cast<__nv_bfloat16*>(dx_bf16->raw_data()) : nullptr;
  require_contiguous("rms_norm_backward", x);
  const int64_t h = weight.numel(), rows = h == 0 ? 0 : x.numel() / h;
  HSPMD_CHECK(dy.numel() == x.numel() && dx.numel() == x.numel() && dweight.numel() == h,
              "rms_norm_backward: sizes");
  if (h == 0) return;
  if (rows == 0) {
    fill(s, dweight, 0.0f);
    return;
  }
  if (addend != nullptr) require_contiguous("rms_norm_backward", *addend);
  // x, the addend and dx: each f32 or bf16 (A float with no addend).
  const auto run = [&](auto* px, auto* add, auto* pdx) {
    using X = std::remove_const_t<std::remove_pointer_t<decltype(px)>>;
    using A = std::remove_const_t<std::remove_pointer_t<decltype(add)>>;
    using D = std::remove_pointer_t<decltype(pdx)>;
    const bool vec = h % kVec == 0 && aligned16(dy.raw_data()) && aligned16(x.raw_data()) &&
                     aligned16(weight.raw_data()) && aligned16(dx.raw_data()) && aligned16(dx16) &&
                     (addend == nullptr || aligned16(addend->raw_data()));
    const int k = groups_per_thread(h, vec);
    if (k != 0) {
      const int64_t per_block = rows_per_block(rows), blocks = (rows + per_block - 1) / per_block;  // <= 512
      NDArray partial = NDArray::empty({blocks, h}, DType::F64, s.device());  // stream-ordered reuse only
      auto* p = static_cast<double*>(partial.raw_data());
      const auto kernel = !vec ? &rms_norm_backward_rows_kernel<1, 16, X, A, D>
                          : k == 1 ? &rms_norm_backward_rows_kernel<kVec, 1, X, A, D>
                          : k == 2 ? &rms_norm_backward_rows_kernel<kVec, 2, X, A, D>
                                   : &rms_norm_backward_rows_kernel<kVec, 4, X, A, D>;
      const size_t smem = sizeof(double) * kThreads * (vec ? kVec : 1) * k;  // the dweight sums: 16 KiB a group
      cuda_rt::check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
                     "rms_norm_backward");
      kernel<<<static_cast<unsigned>(blocks), kThreads, smem, native(s)>>>(dy.data<float>(), px, weight.data<float>(),
                                                                            eps, pdx, add, dx16, p, rows, h, per_block);
      launched("rms_norm_backward");
      chunk_totals_kernel<<<static_cast<unsigned>((h + 31) / 32), dim3(32, kSlices), 0, native(s)>>>(
          p, blocks, h, dweight.data<float>());
      launched("rms_norm_backward");
      return;
    }
    NDArray scale = NDArray::empty({rows}, DType::F32, s.device());  // stream-ordered reuse only
    rms_norm_dx_kernel<X, A, D><<<static_cast<unsigned>(rows), kThreads, 0, native(s)>>>(
        dy.data<float>(), px, weight.data<float>(), eps, pdx, scale.data<float>(), add, dx16, h);
    launched("rms_norm_backward");
    column_sums(s, "rms_norm_backward", RmsNormDwTerm<X>{dy.data<float>(), px, scale.data<float>(), h}, rows, h,
                kNormRowChunk, dweight.data<float>());
  };
  with_float_type("rms_norm_backward", x, [&](auto* px) {
    with_float_type("rms_norm_backward", dx, [&](auto* pdx) {
      if (addend == nullptr)
        run(px, static_cast<const float*>(nullptr), pdx);
      else
        with_float_type("rms_norm_backward", *addend, [&](auto* add) { run(px, add, pdx); });
    });
  });
}

void swiglu(Stream& s, const NDArray& gate, const NDArray& up, NDArray& out) {
  require_contiguous("swiglu", gate);
  require_contiguous("swiglu", up);
  const int64_t n = gate.numel();
  HSPMD_CHECK(up.numel() == n && out.numel() == n, "swiglu: sizes");
  HSPMD_CHECK(up.dtype() == gate.dtype(), "swiglu: gate and up differ in dtype");
  if (n == 0) return;
  with_float_type("swiglu", gate, [&](auto* g) {
    using T = std::remove_pointer_t<decltype(g)>;
    with_float_type("swiglu", out, [&](auto* y) {
      using O = std::remove_pointer_t<decltype(y)>;
      elementwise(s, "swiglu", SwigluOp<T, O>{g, static_cast<const T*>(up.raw_data()), y}, n,
                  {gate.raw_data(), up.raw_data(), out.raw_data()});
    });
  });
}

void swiglu_backward(Stream& s, const NDArray& dy, const NDArray& gate, const NDArray& up, NDArray& dgate,
                     NDArray& dup, NDArray* out) {
  require_contiguous("swiglu_backward", dy);
  const int64_t n = gate.numel();
  HSPMD_CHECK(dy.numel() == n && up.numel() == n && dgate.numel() == n && dup.numel() == n,
              "swiglu_backward: sizes");
  HSPMD_CHECK(up.dtype() == gate.dtype() && dgate.dtype() == gate.dtype() && dup.dtype() == gate.dtype(),
              "swiglu_backward: gate, up, dgate and dup must share one dtype");
  if (n == 0) return;
  with_float_type("swiglu_backward", dy, [&](auto* d) {
    with_float_type("swiglu_backward", gate, [&](auto* g) {
      using T = std::remove_pointer_t<decltype(g)>;
      using D = std::remove_pointer_t<decltype(d)>;
      const auto run = [&](auto* y) {
        using O = std::remove_pointer_t<decltype(y)>;
        elementwise(s, "swiglu_backward",
                    SwigluBackwardOp<D, T, O>{d, g, static_cast<const T*>(up.raw_data()),
                                              static_cast<T*>(dgate.raw_data()), static_cast<T*>(dup.raw_data()), y},
                    n,
                    {dy.raw_data(), gate.raw_data(), up.raw_data(), dgate.raw_data(), dup.raw_data(),
                     out != nullptr ? out->raw_data() : nullptr});
      };
      if (out == nullptr)
        run(static_cast<T*>(nullptr));
      else
        with_float_type("swiglu_backward", *out, run);
    });
  });
}

}  // namespace hspmd::kernels::cuda
