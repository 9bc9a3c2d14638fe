// matmul on CPU: OpenBLAS sgemm on row-major operands.
#include <cblas.h>

#include "hspmd/core/error.h"
#include "kernels/basic.h"
#include "kernels/kernels.h"

namespace hspmd::kernels {

void matmul(const NDArray& a, const NDArray& b, bool trans_a, bool trans_b, NDArray& out) {
  require_backend("matmul", a);
  require_backend("matmul", b);
  HSPMD_CHECK(a.ndim() >= 1 && b.ndim() == 2, "matmul: ranks ", a.ndim(), ", ", b.ndim());
  const int64_t a_cols = a.dim(-1);
  const int64_t a_rows = a_cols == 0 ? 0 : a.numel() / a_cols;
  const int64_t m = trans_a ? a_cols : a_rows;
  const int64_t k = trans_a ? a_rows : a_cols;
  const int64_t n = trans_b ? b.dim(0) : b.dim(1);
  const int64_t kb = trans_b ? b.dim(1) : b.dim(0);
  HSPMD_CHECK(k == kb && out.numel() == m * n, "matmul: inner dims ", k, " vs ", kb);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    out.fill(0.0f);
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), 1.0f, a.data<float>(), static_cast<int>(a_cols),
              b.data<float>(), static_cast<int>(b.dim(1)), 0.0f, out.data<float>(),
              static_cast<int>(n));
}

}  // namespace hspmd::kernels
