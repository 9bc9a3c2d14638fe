// Launch helpers shared by the CUDA kernel files (internal to src/kernels/cuda).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_runtime.h"
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


}  // namespace hspmd::kernels::cuda::launch
