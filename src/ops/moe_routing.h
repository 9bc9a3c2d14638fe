// The expert order of one routing, shared by the mixture-of-experts ops
// (moe.cc) and the expert-parallel ones (moe_ep.cc).
#pragma once

#include <cstdint>
#include <vector>

#include "hspmd/core/ndarray.h"
#include "hspmd/core/device.h"

namespace hspmd::ops {

// The expert order of one routing: offsets[e] .. offsets[e + 1] are expert
// e's rows; rows [T, k] (i32) the row of each (token, slot); src [R] (i32)
// the token of each row. rows and src on the stream's device (made only
// with `arrays`). Throws hspmd::Error "[moe] expert index ..." for an index
// outside [0, experts).
struct RoutingMap {
  std::vector<int64_t> offsets;
  NDArray rows, src;
};
RoutingMap routing_map(Stream& s, const NDArray& indices, int64_t experts, bool arrays);

// An array viewed as rows of its last dim.
NDArray flat_rows(const NDArray& a);

}  // namespace hspmd::ops
