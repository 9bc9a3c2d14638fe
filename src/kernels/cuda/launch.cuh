// Launch helpers shared by the CUDA kernel files (internal to src/kernels/cuda).
#pragma once

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

}  // namespace hspmd::kernels::cuda::launch
