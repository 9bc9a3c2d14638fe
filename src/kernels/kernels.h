// Kernels: the math behind the ops, per backend.
//
// Op files call these functions only; each checks its arrays' device through
// require_backend() and runs the matching backend's code (today: CPU in
// src/kernels/cpu/). A CUDA backend adds its implementations here and in
// src/kernels/cuda/ without touching any op file. All arrays are contiguous
// unless stated; outputs are preallocated by the caller.
#pragma once

#include <cstdint>

#include "hspmd/core/ndarray.h"

namespace hspmd::kernels {

// Throws hspmd::Error "[<kernel>] no <device> kernel in this build" unless the
// array lives on a device this build has a backend for (the one place where
// missing backend support is declared).
void require_backend(const char* kernel, const NDArray& a);

// ---- elementwise ----
void add(const NDArray& a, const NDArray& b, NDArray& out);
void mul(const NDArray& a, const NDArray& b, NDArray& out);
void scale(const NDArray& a, float factor, NDArray& out);
// out += a (same shapes).
void accumulate(const NDArray& a, NDArray& out);
// out = x + bias broadcast over the leading dims: x [..., N], bias [N]
// (f32). Threaded over rows, vectorized along N.
void add_bias(const NDArray& x, const NDArray& bias, NDArray& out);
// dbias [N] = dy [..., N] summed over its leading dims (column sums of dy
// viewed as [rows, N]), accumulated in double over fixed chunks of rows that
// are then added in order: the same bits for every thread count.
void bias_grad(const NDArray& dy, NDArray& dbias);

}  // namespace hspmd::kernels
