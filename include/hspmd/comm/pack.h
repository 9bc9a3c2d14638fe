// Packing boxes of a tensor held by one rank into contiguous message buffers
// and back: the glue between NDArray shards and communicator buffers.
#pragma once

#include <cstdint>

#include "hspmd/annotation/annotation.h"
#include "hspmd/core/ndarray.h"

namespace hspmd {

// Copies `region` (global coordinates, ⊆ from_box) of `from` — a contiguous
// f32 array holding box `from_box` of the global tensor — to `out`, row-major;
// returns region.numel() (0 for an empty region). `out` must have room.
// Throws InternalError when region is not inside from_box.
int64_t pack_box(const NDArray& from, const Box& from_box, const Box& region, float* out);

// The inverse: writes region.numel() floats from `in` into `region` of `to`
// (contiguous f32, holding `to_box` ⊇ region); returns how many it read.
int64_t unpack_box(const float* in, NDArray& to, const Box& to_box, const Box& region);

}  // namespace hspmd
