// reduce_sum and its inverse broadcast on CPU. Sums accumulate in double in a
// fixed order, so results do not depend on the thread count.
#include <vector>

#include "hspmd/core/error.h"
#include "kernels/basic.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "kernels/cpu/variant.h"

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT {

namespace {

// For each dim of `in_shape`, the stride of the matching output element
// (0 along reduced dims).
Shape reduced_strides(const Shape& in_shape, const std::vector<bool>& reduced) {
  Shape kept;
  for (size_t d = 0; d < in_shape.size(); ++d)
    if (!reduced[d]) kept.push_back(in_shape[d]);
  const Shape kept_strides = contiguous_strides(kept);
  Shape strides(in_shape.size(), 0);
  for (size_t d = 0, k = 0; d < in_shape.size(); ++d)
    if (!reduced[d]) strides[d] = kept_strides[k++];
  return strides;
}

// Calls f(in_index, out_index) for every element of `shape` in row-major order.
template <typename F>
void for_each_mapped(const Shape& shape, const Shape& out_strides, F f) {
  const int n = static_cast<int>(shape.size());
  if (shape_numel(shape) == 0) return;
  if (n == 0) return f(int64_t{0}, int64_t{0});
  const int64_t last = shape[n - 1], last_stride = out_strides[n - 1];
  const int64_t rows = shape_numel(shape) / last;
  std::vector<int64_t> idx(n, 0);
  int64_t out_base = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < last; ++j) f(r * last + j, out_base + j * last_stride);
    for (int d = n - 2; d >= 0; --d) {
      out_base += out_strides[d];
      if (++idx[d] < shape[d]) break;
      out_base -= idx[d] * out_strides[d];
      idx[d] = 0;
    }
  }
}

}  // namespace

void reduce_sum(const NDArray& a, const std::vector<bool>& reduced, NDArray& out) {
  require_contiguous("reduce_sum", a);
  HSPMD_CHECK(static_cast<int>(reduced.size()) == a.ndim(), "reduce_sum: mask rank");
  std::vector<double> acc(out.numel(), 0.0);
  const float* x = a.data<float>();
  for_each_mapped(a.shape(), reduced_strides(a.shape(), reduced),
                  [&](int64_t i, int64_t o) { acc[o] += x[i]; });
  float* y = out.data<float>();
  for (int64_t o = 0; o < out.numel(); ++o) y[o] = static_cast<float>(acc[o]);
}

void broadcast_reduced(const NDArray& g, const std::vector<bool>& reduced, NDArray& out) {
  require_contiguous("broadcast_reduced", g);
  HSPMD_CHECK(static_cast<int>(reduced.size()) == out.ndim(), "broadcast_reduced: mask rank");
  const float* x = g.data<float>();
  float* y = out.data<float>();
  for_each_mapped(out.shape(), reduced_strides(out.shape(), reduced),
                  [&](int64_t i, int64_t o) { y[i] = x[o]; });
}

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT
