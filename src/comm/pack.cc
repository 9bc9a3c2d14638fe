// Box packing (pack.h), row by row with the resolver's box-array walker.
#include "hspmd/comm/pack.h"

#include <algorithm>

#include "hspmd/core/error.h"
#include "resolve/box_arrays.h"
#include "resolve/internal.h"

namespace hspmd {

using resolve_internal::contains;
using resolve_internal::for_rows;
using resolve_internal::is_empty;

int64_t pack_box(const NDArray& from, const Box& from_box, const Box& region, float* out) {
  if (is_empty(region)) return 0;
  HSPMD_CHECK(contains(from_box, region), "pack ", to_string(region), " from ", to_string(from_box));
  const float* src = from.data<float>();
  float* dst = out;
  for_rows(region, from_box, region, [&](int64_t a, int64_t, int64_t n) { dst = std::copy(src + a, src + a + n, dst); });
  return region.numel();
}

int64_t unpack_box(const float* in, NDArray& to, const Box& to_box, const Box& region) {
  if (is_empty(region)) return 0;
  HSPMD_CHECK(contains(to_box, region), "unpack ", to_string(region), " into ", to_string(to_box));
  float* dst = to.data<float>();
  const float* src = in;
  for_rows(region, region, to_box, [&](int64_t, int64_t b, int64_t n) {
    std::copy(src, src + n, dst + b);
    src += n;
  });
  return region.numel();
}

}  // namespace hspmd
