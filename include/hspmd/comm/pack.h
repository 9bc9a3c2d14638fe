// Packing boxes of a tensor held by one rank into contiguous message buffers
// and back: the glue between NDArray shards and communicator buffers. The
// elements move by kernels::copy_block on `stream` (the arrays' device).
#pragma once

#include <cstdint>

#include "hspmd/annotation/annotation.h"
#include "hspmd/core/device.h"
#include "hspmd/core/ndarray.h"

namespace hspmd {

// Copies `region` (global coordinates, ⊆ from_box) of `from` — a contiguous
// array of any dtype holding box `from_box` of the global tensor — into the
// first region.numel() elements of `out` (contiguous, from's dtype),
// row-major; returns region.numel() (0 for an empty region). Throws
// InternalError when region is not inside from_box or `out` is too small.
int64_t pack_box(Stream& stream, const NDArray& from, const Box& from_box, const Box& region,
                 NDArray& out);

// The inverse: writes the first region.numel() elements of `in` into
// `region` of `to` (contiguous, holding `to_box` ⊇ region); returns how many
// it read.
int64_t unpack_box(Stream& stream, const NDArray& in, NDArray& to, const Box& to_box,
                   const Box& region);

}  // namespace hspmd
