// Packing boxes of a tensor held by one rank into contiguous message buffers
// and back: the glue between NDArray shards and communicator buffers.
#pragma once

#include <cstdint>

#include "hspmd/annotation/annotation.h"
#include "hspmd/core/ndarray.h"

namespace hspmd {

// Copies `region` (global coordinates, ⊆ from_box) of `from` — a contiguous
// array of any dtype holding box `from_box` of the global tensor — to `out`,
// row-major, in from's dtype; returns region.numel() (0 for an empty region).
// `out` must have room. Throws InternalError when region is not inside from_box.
int64_t pack_box(const NDArray& from, const Box& from_box, const Box& region, void* out);

// The inverse: writes region.numel() elements (to's dtype) from `in` into
// `region` of `to` (contiguous, holding `to_box` ⊇ region); returns how many
// it read.
int64_t unpack_box(const void* in, NDArray& to, const Box& to_box, const Box& region);

}  // namespace hspmd
