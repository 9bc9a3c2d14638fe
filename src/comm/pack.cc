// Box packing (pack.h), row by row with the resolver's box-array walker.
#include "hspmd/comm/pack.h"

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "hspmd/core/error.h"
#include "resolve/box_arrays.h"
#include "resolve/internal.h"

namespace hspmd {

using resolve_internal::contains;
using resolve_internal::for_rows;
using resolve_internal::is_empty;

int64_t pack_box(const NDArray& from, const Box& from_box, const Box& region, void* out) {
  if (is_empty(region)) return 0;
  HSPMD_CHECK(contains(from_box, region), "pack ", to_string(region), " from ", to_string(from_box));
  const size_t es = dtype_size(from.dtype());
  const auto* src = static_cast<const std::byte*>(from.raw_data());
  auto* dst = static_cast<std::byte*>(out);
  for_rows(region, from_box, region, [&](int64_t a, int64_t, int64_t n) {
    std::memcpy(dst, src + a * es, n * es);
    dst += n * es;
  });
  return region.numel();
}

int64_t unpack_box(const void* in, NDArray& to, const Box& to_box, const Box& region) {
  if (is_empty(region)) return 0;
  HSPMD_CHECK(contains(to_box, region), "unpack ", to_string(region), " into ", to_string(to_box));
  const size_t es = dtype_size(to.dtype());
  auto* dst = static_cast<std::byte*>(to.raw_data());
  const auto* src = static_cast<const std::byte*>(in);
  for_rows(region, region, to_box, [&](int64_t, int64_t b, int64_t n) {
    std::memcpy(dst + b * es, src, n * es);
    src += n * es;
  });
  return region.numel();
}

}  // namespace hspmd
