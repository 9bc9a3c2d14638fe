// Kernels: the math behind the ops, per backend.
//
// Op files call these functions only. Each takes the Stream it runs on
// first (ops pass *ctx.stream), checks that its arrays live on the stream's
// device and calls the backend registered for that device type
// (src/kernels/dispatch.cc, backend.h): CPU in src/kernels/cpu/ (runs
// inline), CUDA in src/kernels/cuda/. Every kernel is a line of
// kernel_list.inc (docs/kernels.md). All arrays are contiguous unless
// stated; outputs are preallocated by the caller.
#pragma once

#include <cstdint>

#include "hspmd/core/device.h"
#include "hspmd/core/ndarray.h"

namespace hspmd::kernels {

// Throws hspmd::Error "[kernels] <kernel>: no kernel for device <device> in
// this build": the one place where missing backend support is declared (the
// dispatch calls it for a device type without a registered backend). An
// array on another device than the stream's throws "[kernels] <kernel>: an
// array lives on <device> but the stream on <device>".
[[noreturn]] void no_kernel(const char* kernel, Device device);

// ---- elementwise ----
// f32 arrays; add's a and b may also be bf16 (widened exactly), and its
// out bf16 (the f32 sum rounded once, as a cast would).
void add(Stream& s, const NDArray& a, const NDArray& b, NDArray& out);
void mul(Stream& s, const NDArray& a, const NDArray& b, NDArray& out);
void scale(Stream& s, const NDArray& a, float factor, NDArray& out);
// out += a (same shapes).
void accumulate(Stream& s, const NDArray& a, NDArray& out);
// out = x + bias broadcast over the leading dims: x [..., N], bias [N]
// (f32). Threaded over rows, vectorized along N.
void add_bias(Stream& s, const NDArray& x, const NDArray& bias, NDArray& out);
// dbias [N] = dy [..., N] summed over its leading dims (column sums of dy
// viewed as [rows, N]), accumulated in double over fixed chunks of rows that
// are then added in order: the same bits for every thread count.
void bias_grad(Stream& s, const NDArray& dy, NDArray& dbias);

}  // namespace hspmd::kernels
