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

}  // namespace hspmd::kernels
