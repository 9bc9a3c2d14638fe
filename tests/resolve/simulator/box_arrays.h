// Arrays that hold one box of a global tensor (f32, contiguous): copying and
// adding regions between them by rows. Used by the simulator and the shard
// helpers.
#pragma once

#include <vector>

#include "hspmd/annotation/annotation.h"
#include "hspmd/core/ndarray.h"

namespace hspmd::resolve_internal {

// Calls f(offset_in_a, offset_in_b, length) for every innermost row of
// `region` (global coordinates), where arrays a and b hold boxes `a_box` and
// `b_box` (both must contain `region`).
template <typename F>
void for_rows(const Box& region, const Box& a_box, const Box& b_box, F&& f) {
  const size_t n = region.begin.size();
  if (n == 0) {
    f(int64_t{0}, int64_t{0}, int64_t{1});
    return;
  }
  const Shape sa = contiguous_strides(a_box.shape());
  const Shape sb = contiguous_strides(b_box.shape());
  const int64_t len = region.end[n - 1] - region.begin[n - 1];
  for (size_t d = 0; d < n; ++d)
    if (region.end[d] <= region.begin[d]) return;
  std::vector<int64_t> idx(region.begin.begin(), region.begin.end());
  while (true) {
    int64_t oa = 0, ob = 0;
    for (size_t d = 0; d < n; ++d) {
      oa += (idx[d] - a_box.begin[d]) * sa[d];
      ob += (idx[d] - b_box.begin[d]) * sb[d];
    }
    f(oa, ob, len);
    size_t d = n - 1;
    while (true) {
      if (d == 0) return;
      --d;
      if (++idx[d] < region.end[d]) break;
      idx[d] = region.begin[d];
    }
  }
}

// A fresh f32 array holding `region`, copied from `a` (which holds `a_box`).
NDArray extract(const NDArray& a, const Box& a_box, const Box& region);
// Copies (or adds) `region` of `from` (holding from_box) into `to` (holding to_box).
void copy_region(const NDArray& from, const Box& from_box, NDArray& to, const Box& to_box, const Box& region);
void add_region(const NDArray& from, const Box& from_box, NDArray& to, const Box& to_box, const Box& region);

}  // namespace hspmd::resolve_internal
