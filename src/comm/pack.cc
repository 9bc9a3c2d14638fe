// Box packing (pack.h): one block copy between the shard and the message.
#include "hspmd/comm/pack.h"

#include "hspmd/core/error.h"
#include "kernels/memory.h"
#include "resolve/internal.h"

namespace hspmd {

using resolve_internal::contains;
using resolve_internal::is_empty;

namespace {

// `region`'s corner relative to `box`'s.
Shape offset_in(const Box& box, const Box& region) {
  Shape at(region.begin.size());
  for (size_t d = 0; d < at.size(); ++d) at[d] = region.begin[d] - box.begin[d];
  return at;
}

// The first region.numel() elements of the flat buffer `a`, viewed as the region.
NDArray region_view(const NDArray& a, const Box& region, const char* what) {
  const int64_t n = region.numel();
  HSPMD_CHECK(a.is_contiguous() && a.numel() >= n, what, ": buffer of ", a.numel(), " elements for ",
              to_string(region));
  return a.reshape({a.numel()}).slice(0, 0, n).reshape(region.shape());
}

}  // namespace

int64_t pack_box(Stream& stream, const NDArray& from, const Box& from_box, const Box& region,
                 NDArray& out) {
  if (is_empty(region)) return 0;
  HSPMD_CHECK(contains(from_box, region), "pack ", to_string(region), " from ", to_string(from_box));
  NDArray view = region_view(out, region, "pack");
  kernels::copy_block(stream, from.reshape(from_box.shape()), offset_in(from_box, region), view,
                      Shape(region.begin.size(), 0), region.shape());
  return region.numel();
}

int64_t unpack_box(Stream& stream, const NDArray& in, NDArray& to, const Box& to_box,
                   const Box& region) {
  if (is_empty(region)) return 0;
  HSPMD_CHECK(contains(to_box, region), "unpack ", to_string(region), " into ", to_string(to_box));
  NDArray target = to.reshape(to_box.shape());
  kernels::copy_block(stream, region_view(in, region, "unpack"), Shape(region.begin.size(), 0),
                      target, offset_in(to_box, region), region.shape());
  return region.numel();
}

}  // namespace hspmd
