// CUDA RMSNorm (f32 math; x, the output, dx and the addend f32 or bf16) and
// SwiGLU (f32 or bf16 arrays, f32 math), forward and backward (basic.h
// contracts).
// RMSNorm: one block per row; sums in double as the CPU kernel does, so the
// two agree to f32 rounding. dweight: partial sums over chunks of rows, then
// over the chunks (launch::column_sums: a fixed order, the same bits on every
// run; the CPU sums the rows in one double, so the two agree to f32 rounding).
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
                                   const A* addend, int64_t h) {
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
    dr[i] = from_f32<D>(ar != nullptr ? v + to_f32(ar[i]) : v);
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

// Rows per partial sum of dweight: [16384, 2048] gives 256 x 8 blocks.
constexpr int64_t kNormRowChunk = 64;

// The whole backward in one pass over dy, x (and the addend): a block takes
// kFusedRows consecutive rows, each thread the columns threadIdx.x + k *
// blockDim.x (k < kFusedCols, so rows up to kThreads * kFusedCols wide),
// and for each row computes the row's sums as rms_norm_dx_kernel does (the
// same columns per thread, the same tree: dx has its bits), writes dx, and
// adds the row's dweight terms to its columns' running sums in double, in
// row order; the block writes its partial sums, and column_totals_kernel
// adds the chunks in order (dweight: rows summed in chunks of kFusedRows,
// then the chunks; deterministic). The two-kernel path read dy and x again
// for dweight.
constexpr int kFusedRows = 16;
constexpr int kFusedCols = 16;

template <typename X, typename A, typename D>
__global__ void rms_norm_backward_fused_kernel(const float* dy, const X* x, const float* w, float eps, D* dx,
                                               const A* addend, double* partial, int64_t rows, int64_t h) {
  __shared__ double scratch[kThreads];
  double acc[kFusedCols];
#pragma unroll
  for (int k = 0; k < kFusedCols; ++k) acc[k] = 0;
  const int64_t r0 = blockIdx.x * static_cast<int64_t>(kFusedRows);
  const int64_t r1 = r0 + kFusedRows < rows ? r0 + kFusedRows : rows;
  for (int64_t r = r0; r < r1; ++r) {  // the same trip count in every thread: block_sum is safe
    const X* xr = x + r * h;
    const float* gr = dy + r * h;
    D* dr = dx + r * h;
    double ss, dot;
    norm_row_sums(xr, gr, w, h, scratch, ss, dot);
    const float s = inv_rms(ss, h, eps);
    const float c = static_cast<float>(dot * s * s * s / static_cast<double>(h));
    const A* ar = addend != nullptr ? addend + r * h : nullptr;
#pragma unroll
    for (int k = 0; k < kFusedCols; ++k) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (i < h) {
        const float xv = to_f32(xr[i]);
        const float v = s * w[i] * gr[i] - xv * c;
        dr[i] = from_f32<D>(ar != nullptr ? v + to_f32(ar[i]) : v);
        acc[k] += static_cast<double>(gr[i]) * (xv * s);  // RmsNormDwTerm's term
      }
    }
  }
  double* pr = partial + blockIdx.x * h;
#pragma unroll
  for (int k = 0; k < kFusedCols; ++k) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (i < h) pr[i] = acc[k];
  }
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
  with_float_type("rms_norm", x, [&](auto* px) {
    with_float_type("rms_norm", out, [&](auto* y) {
      rms_norm_kernel<<<static_cast<unsigned>(rows), kThreads, 0, native(s)>>>(px, weight.data<float>(), eps, y, h);
    });
  });
  launched("rms_norm");
}

void rms_norm_backward(Stream& s, const NDArray& dy, const NDArray& x, const NDArray& weight, float eps, NDArray& dx,
                       NDArray& dweight, const NDArray* addend) {
  require_contiguous("rms_norm_backward", dy);
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
    if (h <= static_cast<int64_t>(kThreads) * kFusedCols) {
      const int64_t chunks = (rows + kFusedRows - 1) / kFusedRows;
      NDArray partial = NDArray::empty({chunks, h}, DType::F64, s.device());  // stream-ordered reuse only
      auto* p = static_cast<double*>(partial.raw_data());
      rms_norm_backward_fused_kernel<X, A, D><<<static_cast<unsigned>(chunks), kThreads, 0, native(s)>>>(
          dy.data<float>(), px, weight.data<float>(), eps, pdx, add, p, rows, h);
      launched("rms_norm_backward");
      column_totals_kernel<<<static_cast<unsigned>((h + kThreads - 1) / kThreads), kThreads, 0, native(s)>>>(
          p, chunks, h, dweight.data<float>());
      launched("rms_norm_backward");
      return;
    }
    NDArray scale = NDArray::empty({rows}, DType::F32, s.device());  // stream-ordered reuse only
    rms_norm_dx_kernel<X, A, D><<<static_cast<unsigned>(rows), kThreads, 0, native(s)>>>(
        dy.data<float>(), px, weight.data<float>(), eps, pdx, scale.data<float>(), add, h);
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
