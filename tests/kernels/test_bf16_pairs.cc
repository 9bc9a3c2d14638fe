// kernels::gemm_bf16_pairs (the attention tiles' bf16 products), native and
// portable, against a double reference on the same bf16 values: every block
// shape and column tail, alpha and beta, strided operands.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "hspmd/core/dtype.h"
#include "hspmd/core/rng.h"
#include "kernels/basic.h"
#include "kernels/cpu/bf16_pairs.h"

namespace hspmd {
namespace {

using Gemm = void (*)(int64_t, int64_t, int64_t, float, const uint16_t*, int64_t, const uint16_t*,
                      int64_t, float, float*, int64_t);

std::vector<uint16_t> random_bf16(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(static_cast<float>(2.0 * rng.uniform() - 1.0));
  return v;
}

void check(Gemm gemm, int64_t m, int64_t n, int64_t kp, float alpha, float beta,
           const std::string& what) {
  const int64_t lda = kp + 4, ldb = 2 * n + 6, ldc = n + 3;
  const std::vector<uint16_t> a = random_bf16(m * lda, 1 + m), b = random_bf16(kp / 2 * ldb, 2 + n);
  std::vector<float> c(m * ldc);
  Rng rng(3);
  for (auto& x : c) x = static_cast<float>(rng.uniform());
  const std::vector<float> c0 = c;
  gemm(m, n, kp, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < ldc; ++j) {
      if (j >= n) {  // padding of C is never written
        ASSERT_EQ(c[i * ldc + j], c0[i * ldc + j]) << what << " wrote past column " << n;
        continue;
      }
      double want = 0, size = 0;
      for (int64_t p = 0; p < kp; ++p) {
        const double x = bf16_to_f32(a[i * lda + p]);
        const double y = bf16_to_f32(b[p / 2 * ldb + 2 * j + p % 2]);
        want += x * y;
        size += std::fabs(x * y);
      }
      want = alpha * want + beta * c0[i * ldc + j];
      ASSERT_NEAR(c[i * ldc + j], want, 1e-6 * (size + 1) * 4)
          << what << " m=" << m << " n=" << n << " kp=" << kp << " at (" << i << ", " << j << ")";
    }
}

void check_all(Gemm gemm, const std::string& what) {
  for (int64_t m : {1, 3, 4, 7, 8, 13, 64, 67})
    for (int64_t n : {1, 15, 16, 17, 33, 48, 64, 65, 100})
      for (int64_t kp : {2, 32, 66}) {
        check(gemm, m, n, kp, 1.0f, 0.0f, what);
        check(gemm, m, n, kp, 0.5f, 1.0f, what);
      }
}

TEST(Bf16Pairs, PortableMatchesReference) {
  check_all(kernels::gemm_bf16_pairs_portable, "portable");
}

TEST(Bf16Pairs, NativeMatchesReference) {
  if (!kernels::bf16_pairs_native()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  check_all(kernels::gemm_bf16_pairs, "native");
}

TEST(Bf16Pairs, EmulationSelectsThePortableCode) {
  kernels::set_bf16_gemm_emulation(true);
  EXPECT_FALSE(kernels::bf16_pairs_native());
  check(kernels::gemm_bf16_pairs, 13, 33, 32, 1.0f, 1.0f, "emulated");
  kernels::set_bf16_gemm_emulation(false);
}

}  // namespace
}  // namespace hspmd
