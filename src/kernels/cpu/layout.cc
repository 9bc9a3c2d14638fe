// Layout kernels on CPU: transpose, slice, concat. They move bytes, so they
// work for every dtype.
#include <algorithm>
#include <cstring>

#include "hspmd/core/error.h"
#include "kernels/basic.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "kernels/cpu/variant.h"

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT {

namespace {

// Product of the dims in [begin, end).
int64_t dims_product(const Shape& s, int begin, int end) {
  int64_t p = 1;
  for (int d = begin; d < end; ++d) p *= s[d];
  return p;
}

// Copies `outer` blocks of `bytes` bytes: block o goes from src + o*src_pitch
// to dst + o*dst_pitch.
void copy_blocks(const char* src, int64_t src_pitch, char* dst, int64_t dst_pitch, int64_t outer,
                 int64_t bytes) {
  if (bytes == 0) return;
#pragma omp parallel for schedule(static) if (outer * bytes > (1 << 20) && outer > 1)
  for (int64_t o = 0; o < outer; ++o) std::memcpy(dst + o * dst_pitch, src + o * src_pitch, bytes);
}

// Tiled transpose of one [i0, i1) x [j0, j1) tile: dst[j][i] = src[i][j].
template <typename T>
void transpose_tile(const T* src, int64_t src_row, T* dst, int64_t dst_row, int64_t i0,
                    int64_t i1, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t i = i0; i < i1; ++i) dst[j * dst_row + i] = src[i * src_row + j];
}

}  // namespace

void transpose(const NDArray& a, int d0, int d1, NDArray& out) {
  require_contiguous("transpose", a);
  const int n = a.ndim();
  if (d0 > d1) std::swap(d0, d1);
  HSPMD_CHECK(0 <= d0 && d1 < n && out.numel() == a.numel(), "transpose: bad dims");
  const Shape& s = a.shape();
  const int64_t outer = dims_product(s, 0, d0), rows = s[d0], mid = dims_product(s, d0 + 1, d1),
                cols = s[d1], inner = dims_product(s, d1 + 1, n);
  const size_t es = dtype_size(a.dtype());
  const char* src = static_cast<const char*>(a.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  constexpr int64_t kTile = 32;
  const int64_t row_tiles = (rows + kTile - 1) / kTile, col_tiles = (cols + kTile - 1) / kTile;
  const int64_t tasks = outer * mid * row_tiles * col_tiles;
  // src index (o, i, m, j, n) -> dst index (o, j, m, i, n).
#pragma omp parallel for schedule(static) if (a.numel() > 65536)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t jt = t % col_tiles, it = (t / col_tiles) % row_tiles;
    const int64_t m = (t / (col_tiles * row_tiles)) % mid, o = t / (col_tiles * row_tiles * mid);
    const int64_t i0 = it * kTile, i1 = std::min(rows, i0 + kTile);
    const int64_t j0 = jt * kTile, j1 = std::min(cols, j0 + kTile);
    const char* s0 = src + ((o * rows * mid + m) * cols) * inner * es;
    char* t0 = dst + ((o * cols * mid + m) * rows) * inner * es;
    const int64_t src_row = mid * cols * inner, dst_row = mid * rows * inner;  // elements
    if (inner == 1 && es == 4) {
      transpose_tile(reinterpret_cast<const uint32_t*>(s0), src_row,
                     reinterpret_cast<uint32_t*>(t0), dst_row, i0, i1, j0, j1);
      continue;
    }
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t i = i0; i < i1; ++i)
        std::memcpy(t0 + (j * dst_row + i * inner) * es, s0 + (i * src_row + j * inner) * es,
                    inner * es);
  }
}

void slice(const NDArray& a, int axis, int64_t begin, NDArray& out) {
  require_contiguous("slice", a);
  const Shape& s = a.shape();
  const int64_t outer = dims_product(s, 0, axis), inner = dims_product(s, axis + 1, a.ndim());
  const int64_t len = out.dim(axis);
  HSPMD_CHECK(begin >= 0 && begin + len <= s[axis], "slice: range out of bounds");
  const int64_t es = static_cast<int64_t>(dtype_size(a.dtype()));
  copy_blocks(static_cast<const char*>(a.raw_data()) + begin * inner * es, s[axis] * inner * es,
              static_cast<char*>(out.raw_data()), len * inner * es, outer, len * inner * es);
}

void slice_backward(const NDArray& grad, int axis, int64_t begin, NDArray& out) {
  require_contiguous("slice_backward", grad);
  const Shape& s = out.shape();
  const int64_t outer = dims_product(s, 0, axis), inner = dims_product(s, axis + 1, out.ndim());
  const int64_t len = grad.dim(axis);
  HSPMD_CHECK(begin >= 0 && begin + len <= s[axis], "slice_backward: range out of bounds");
  const int64_t es = static_cast<int64_t>(dtype_size(out.dtype()));
  std::memset(out.raw_data(), 0, out.nbytes());
  copy_blocks(static_cast<const char*>(grad.raw_data()), len * inner * es,
              static_cast<char*>(out.raw_data()) + begin * inner * es, s[axis] * inner * es,
              outer, len * inner * es);
}

void concat(const std::vector<NDArray>& parts, int axis, NDArray& out) {
  const Shape& s = out.shape();
  const int64_t outer = dims_product(s, 0, axis), inner = dims_product(s, axis + 1, out.ndim());
  const int64_t es = static_cast<int64_t>(dtype_size(out.dtype()));
  int64_t offset = 0;
  for (const auto& p : parts) {
    require_contiguous("concat", p);
    const int64_t len = p.dim(axis);
    HSPMD_CHECK(offset + len <= s[axis], "concat: parts exceed the output");
    copy_blocks(static_cast<const char*>(p.raw_data()), len * inner * es,
                static_cast<char*>(out.raw_data()) + offset * inner * es, s[axis] * inner * es,
                outer, len * inner * es);
    offset += len;
  }
  HSPMD_CHECK(offset == s[axis], "concat: parts do not fill the output");
}

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT
