// Launch helpers shared by the CUDA kernel files (internal to src/kernels/cuda).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "kernels/cuda/runtime.h"
#include "hspmd/core/device.h"
#include "hspmd/core/error.h"
#include "hspmd/core/ndarray.h"

namespace hspmd::kernels::cuda::launch {

constexpr int kThreads = 256;  // threads per block

inline cudaStream_t native(Stream& s) { return static_cast<cudaStream_t>(s.native_handle()); }

// Throws "[cuda] <kernel>: <error>" when the last launch failed.
inline void launched(const char* kernel) { cuda_rt::check(cudaGetLastError(), kernel); }

inline void require_contiguous(const char* kernel, const NDArray& a) {
  HSPMD_CHECK(a.is_contiguous(), kernel, ": strided input");
}

// Blocks for a grid-stride loop over n elements (at least 1, capped).
inline unsigned blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 * 32 ? (b > 0 ? b : 1) : 65535 * 32);
}

// Sums `v` over the block (blockDim.x threads, a power of two, at most
// kThreads; `scratch` holds blockDim.x doubles in shared memory), in a fixed
// tree order; every thread gets the total.
__device__ inline double block_sum(double v, double* scratch) {
  scratch[threadIdx.x] = v;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) scratch[threadIdx.x] += scratch[threadIdx.x + w];
    __syncthreads();
  }
  const double total = scratch[0];
  __syncthreads();
  return total;
}

// The same with max.
__device__ inline double block_max(double v, double* scratch) {
  scratch[threadIdx.x] = v;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) scratch[threadIdx.x] = fmax(scratch[threadIdx.x], scratch[threadIdx.x + w]);
    __syncthreads();
  }
  const double total = scratch[0];
  __syncthreads();
  return total;
}

// f32 <-> the element types of f32 and bf16 arrays (round to nearest even).
__device__ inline float to_f32(float v) { return v; }
__device__ inline float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ inline T from_f32(float v);
template <>
__device__ inline float from_f32<float>(float v) { return v; }
template <>
__device__ inline __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Calls f(T*) with the array's elements as float or __nv_bfloat16.
template <typename F>
void with_float_type(const char* kernel, const NDArray& a, F f) {
  if (a.dtype() == DType::F32) return f(static_cast<float*>(a.raw_data()));
  HSPMD_CHECK(a.dtype() == DType::BF16, kernel, ": expected f32 or bf16, got ", dtype_name(a.dtype()));
  f(static_cast<__nv_bfloat16*>(a.raw_data()));
}

// ---- vectorized elementwise kernels ----
// A memory-bound kernel moves 16 bytes per access (8 bf16 or 4 f32 values)
// where its arrays allow: with 2 or 4 bytes per thread and access, too few
// bytes are in flight to reach the GPU's memory bandwidth. load/store move V
// consecutive elements from element i as floats (V > 1: the caller has
// checked that every array is 16-byte aligned and i is a multiple of V).
constexpr int kVec = 8;

template <int V>
__device__ inline void load(const float* p, int64_t i, float (&v)[V]) {
  if constexpr (V == 1) {
    v[0] = p[i];
  } else {
    static_assert(V % 4 == 0);
#pragma unroll
    for (int k = 0; k < V; k += 4) {
      const float4 q = *reinterpret_cast<const float4*>(p + i + k);
      v[k] = q.x, v[k + 1] = q.y, v[k + 2] = q.z, v[k + 3] = q.w;
    }
  }
}

template <int V>
__device__ inline void load(const __nv_bfloat16* p, int64_t i, float (&v)[V]) {
  if constexpr (V == 1) {
    v[0] = __bfloat162float(p[i]);
  } else {
    static_assert(V % 8 == 0);
#pragma unroll
    for (int k = 0; k < V; k += 8) {
      const uint4 q = *reinterpret_cast<const uint4*>(p + i + k);
      const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const float2 f = __bfloat1622float2(pairs[m]);  // .x: the lower address
        v[k + 2 * m] = f.x, v[k + 2 * m + 1] = f.y;
      }
    }
  }
}

template <int V>
__device__ inline void store(float* p, int64_t i, const float (&v)[V]) {
  if constexpr (V == 1) {
    p[i] = v[0];
  } else {
#pragma unroll
    for (int k = 0; k < V; k += 4) *reinterpret_cast<float4*>(p + i + k) = make_float4(v[k], v[k + 1], v[k + 2], v[k + 3]);
  }
}

template <int V>
__device__ inline void store(__nv_bfloat16* p, int64_t i, const float (&v)[V]) {
  if constexpr (V == 1) {
    p[i] = __float2bfloat16_rn(v[0]);
  } else {
#pragma unroll
    for (int k = 0; k < V; k += 8) {
      uint4 q;
      auto* pairs = reinterpret_cast<__nv_bfloat162*>(&q);
#pragma unroll
      for (int m = 0; m < 4; ++m) pairs[m] = __floats2bfloat162_rn(v[k + 2 * m], v[k + 2 * m + 1]);  // each RN
      *reinterpret_cast<uint4*>(p + i + k) = q;
    }
  }
}

// f.template apply<V>(i) for the groups of V elements, then apply<1> for the
// tail: a grid-stride loop over n elements.
template <int V, typename F>
__global__ void elementwise_kernel(F f, int64_t n) {
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x, groups = n / V;
  for (int64_t g = first; g < groups; g += stride) f.template apply<V>(g * V);
  if constexpr (V > 1)
    for (int64_t i = groups * V + first; i < n; i += stride) f.template apply<1>(i);
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Runs f over n elements on s: kVec at a time when every pointer in
// `arrays` is 16-byte aligned, else one at a time (views at odd offsets).
template <typename F>
void elementwise(Stream& s, const char* kernel, const F& f, int64_t n, std::initializer_list<const void*> arrays) {
  if (n <= 0) return;
  bool vec = true;
  for (const void* p : arrays) vec = vec && aligned16(p);
  if (vec)
    elementwise_kernel<kVec><<<blocks_for((n + kVec - 1) / kVec), kThreads, 0, native(s)>>>(f, n);
  else
    elementwise_kernel<1><<<blocks_for(n), kThreads, 0, native(s)>>>(f, n);
  launched(kernel);
}

// Column sums of a [rows, cols] matrix of terms (term(r, j), as double), in
// a fixed order: the rows in chunks of `chunk`, each chunk summed in row
// order (column_partials_kernel: one thread per (chunk, column), a block
// row per chunk), then the chunks in order (column_totals_kernel: one
// thread per column). The same bits on every run, and parallel over rows:
// a thread per column walking every row would use a few SMs for [16384,
// 2048]. `term` is a functor (no extended lambdas).
template <typename Term>
__global__ void column_partials_kernel(Term term, int64_t rows, int64_t cols, int64_t chunk, int64_t chunks,
                                       double* partial) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= cols) return;
  for (int64_t c = blockIdx.y; c < chunks; c += gridDim.y) {
    const int64_t r0 = c * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
    double acc = 0;
    for (int64_t r = r0; r < r1; ++r) acc += term(r, j);
    partial[c * cols + j] = acc;
  }
}

static __global__ void column_totals_kernel(const double* partial, int64_t chunks, int64_t cols, float* out) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= cols) return;
  double total = 0;
  for (int64_t c = 0; c < chunks; ++c) total += partial[c * cols + j];
  out[j] = static_cast<float>(total);
}

// Runs the two kernels on `s` into `out` (cols f32 values, rows >= 1).
template <typename Term>
void column_sums(Stream& s, const char* kernel, Term term, int64_t rows, int64_t cols, int64_t chunk, float* out) {
  const int64_t chunks = (rows + chunk - 1) / chunk;
  NDArray partial = NDArray::empty({chunks, cols}, DType::F64, s.device());  // stream-ordered reuse only
  const dim3 grid(static_cast<unsigned>((cols + kThreads - 1) / kThreads),
                  static_cast<unsigned>(chunks < 65535 ? chunks : 65535));
  column_partials_kernel<<<grid, kThreads, 0, native(s)>>>(term, rows, cols, chunk, chunks,
                                                           static_cast<double*>(partial.raw_data()));
  launched(kernel);
  column_totals_kernel<<<static_cast<unsigned>((cols + kThreads - 1) / kThreads), kThreads, 0, native(s)>>>(
      static_cast<const double*>(partial.raw_data()), chunks, cols, out);
  launched(kernel);
}

}  // namespace hspmd::kernels::cuda::launch
