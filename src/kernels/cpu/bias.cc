// Bias add and its gradient on CPU. The forward is one vectorized pass over
// rows; the bias gradient sums rows per column in double, in fixed chunks of
// rows combined in chunk order, so its bits do not depend on the thread count.
#include <algorithm>
#include <vector>

#include "hspmd/core/error.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "kernels/cpu/variant.h"

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT {

namespace {

// Columns per task of the bias gradient, and rows per partial sum. Both are
// constants (never derived from the thread count): they fix the reduction
// order.
constexpr int64_t kColumns = 64;
constexpr int64_t kRowChunk = 512;

}  // namespace

void add_bias(const NDArray& x, const NDArray& bias, NDArray& out) {
  require_contiguous("add_bias", x);
  require_contiguous("add_bias", bias);
  const int64_t n = bias.numel(), rows = n == 0 ? 0 : x.numel() / n;
  HSPMD_CHECK(x.ndim() >= 1 && x.dim(-1) == n && out.numel() == x.numel(), "add_bias: sizes");
  const float* px = x.data<float>();
  const float* b = bias.data<float>();
  float* y = out.data<float>();
#pragma omp parallel for schedule(static) if (x.numel() > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = px + r * n;
    float* yr = y + r * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) yr[j] = xr[j] + b[j];
  }
}

void bias_grad(const NDArray& dy, NDArray& dbias) {
  require_contiguous("bias_grad", dy);
  const int64_t n = dbias.numel(), rows = n == 0 ? 0 : dy.numel() / n;
  HSPMD_CHECK(dy.ndim() >= 1 && dy.dim(-1) == n, "bias_grad: sizes");
  const float* g = dy.data<float>();
  float* db = dbias.data<float>();
  const int64_t blocks = (n + kColumns - 1) / kColumns;
  const int64_t chunks = std::max<int64_t>(1, (rows + kRowChunk - 1) / kRowChunk);
  // partial[c * n + j]: the sum of column j over the rows of chunk c.
  std::vector<double> partial(static_cast<size_t>(chunks * n));
  const bool threaded = dy.numel() > 32768;
#pragma omp parallel for collapse(2) schedule(static) if (threaded)
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t k = 0; k < blocks; ++k) {
      const int64_t j0 = k * kColumns, w = std::min(n, j0 + kColumns) - j0;
      const int64_t r0 = c * kRowChunk, r1 = std::min(rows, r0 + kRowChunk);
      double acc[kColumns] = {};
      for (int64_t r = r0; r < r1; ++r) {
        const float* gr = g + r * n + j0;
#pragma omp simd
        for (int64_t i = 0; i < w; ++i) acc[i] += static_cast<double>(gr[i]);
      }
      std::copy(acc, acc + w, partial.data() + c * n + j0);
    }
  }
#pragma omp parallel for schedule(static) if (threaded)
  for (int64_t j = 0; j < n; ++j) {
    double s = 0;
    for (int64_t c = 0; c < chunks; ++c) s += partial[c * n + j];
    db[j] = static_cast<float>(s);
  }
}

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT
