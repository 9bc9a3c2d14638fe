// bf16 tile products (see bf16_pairs.h). The native code keeps a block of
// MR rows x NB*16 columns of C in registers and adds one pair row of B per
// step with VDPBF16PS (32 bf16 products per instruction, f32 sums). It is
// compiled for AVX512-BF16 whatever the build flags, and only called after a
// run-time check of the CPU.
#include "bf16_pairs.h"

// GCC 12 reports the _mm512_undefined_* inside the AVX-512 intrinsics as
// "maybe uninitialized" when they are inlined (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "hspmd/core/cpu_isa.h"
#include "hspmd/core/dtype.h"
#include "kernels/basic.h"

namespace hspmd::kernels {

namespace {

#define HSPMD_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

template <int MR, int NB>
HSPMD_BF16_TARGET void block(int64_t kp, float alpha, const uint16_t* a, int64_t lda,
                             const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc,
                             const __mmask16* mask) {
  __m512 acc[MR][NB];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp / 2; ++p) {
    const uint16_t* bp = b + p * ldb;
    __m512i bv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) bv[j] = _mm512_maskz_loadu_epi32(mask[j], bp + 32 * j);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
      const __m512i av = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j)
        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)av, (__m512bh)bv[j]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      float* cp = c + r * ldc + 16 * j;
      __m512 v = _mm512_mul_ps(acc[r][j], va);
      if (beta != 0.0f) v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask[j], cp), vb, v);
      _mm512_mask_storeu_ps(cp, mask[j], v);
    }
}

// Rows [0, m) of one column panel, MR at a time, the rest by smaller blocks.
template <int MR, int NB>
HSPMD_BF16_TARGET void panel(int64_t m, int64_t kp, float alpha, const uint16_t* a, int64_t lda,
                             const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc,
                             const __mmask16* mask) {
  int64_t i = 0;
  for (; i + MR <= m; i += MR) block<MR, NB>(kp, alpha, a + i * lda, lda, b, ldb, beta, c + i * ldc, ldc, mask);
  if (i == m) return;
  if constexpr (MR > 1) {
    constexpr int half = MR / 2;
    if (m - i >= half) {
      block<half, NB>(kp, alpha, a + i * lda, lda, b, ldb, beta, c + i * ldc, ldc, mask);
      i += half;
    }
    if (i < m) panel<(half > 1 ? half : 1), NB>(m - i, kp, alpha, a + i * lda, lda, b, ldb, beta, c + i * ldc, ldc, mask);
  }
}

HSPMD_BF16_TARGET void gemm_native(int64_t m, int64_t n, int64_t kp, float alpha,
                                   const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                                   float beta, float* c, int64_t ldc) {
  for (int64_t j0 = 0; j0 < n; j0 += 64) {
    const int64_t cols = std::min<int64_t>(64, n - j0);
    const int nb = static_cast<int>((cols + 15) / 16);
    __mmask16 mask[4];
    for (int j = 0; j < 4; ++j) {
      const int64_t left = std::clamp<int64_t>(cols - 16 * j, 0, 16);
      mask[j] = static_cast<__mmask16>((1u << left) - 1u);
    }
    const uint16_t* bj = b + 2 * j0;
    float* cj = c + j0;
    switch (nb) {
      case 4: panel<4, 4>(m, kp, alpha, a, lda, bj, ldb, beta, cj, ldc, mask); break;
      case 3: panel<4, 3>(m, kp, alpha, a, lda, bj, ldb, beta, cj, ldc, mask); break;
      case 2: panel<8, 2>(m, kp, alpha, a, lda, bj, ldb, beta, cj, ldc, mask); break;
      default: panel<8, 1>(m, kp, alpha, a, lda, bj, ldb, beta, cj, ldc, mask); break;
    }
  }
}

HSPMD_BF16_TARGET void row_pairs_native(const float* r0, const float* r1, int64_t n,
                                         uint16_t* out) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r0 + c)));
    const __m512i hi =
        r1 ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r1 + c)))
           : _mm512_setzero_si512();
    _mm512_storeu_si512(out + 2 * c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
  for (; c < n; ++c) {
    out[2 * c] = f32_to_bf16(r0[c]);
    out[2 * c + 1] = r1 ? f32_to_bf16(r1[c]) : 0;
  }
}

HSPMD_BF16_TARGET void tile_rows_native(const float* s, int64_t m, int64_t n, int64_t ld,
                                         uint16_t* out, int64_t ldo) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1u);
  for (int64_t r = 0; r < m; ++r) {
    const float* in = s + r * ld;
    uint16_t* o = out + r * ldo;
    int64_t c = 0;
    for (; c + 16 <= n; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + c)));
    if (c < n)
      _mm256_mask_storeu_epi16(o + c, tail,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, in + c)));
    if (n % 2) o[n] = 0;
  }
}

// The CPU's level under HSPMD_CPU_ISA's cap (hspmd/core/cpu_isa.h).
bool cpu_has_avx512_bf16() {
  static const bool has = cpu_isa() >= CpuIsa::kAvx512Bf16;
  return has;
}

}  // namespace

void gemm_bf16_pairs_portable(int64_t m, int64_t n, int64_t kp, float alpha, const uint16_t* a,
                              int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
                              int64_t ldc) {
  std::vector<float> acc(n), b0(n), b1(n);
  for (int64_t i = 0; i < m; ++i) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t p = 0; p < kp / 2; ++p) {
      const float a0 = bf16_to_f32(a[i * lda + 2 * p]), a1 = bf16_to_f32(a[i * lda + 2 * p + 1]);
      const uint16_t* bp = b + p * ldb;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j)
        acc[j] += a0 * bf16_to_f32(bp[2 * j]) + a1 * bf16_to_f32(bp[2 * j + 1]);
    }
    float* ci = c + i * ldc;
    for (int64_t j = 0; j < n; ++j) ci[j] = alpha * acc[j] + (beta != 0.0f ? beta * ci[j] : 0.0f);
  }
}

void bf16_row_pairs(const float* r0, const float* r1, int64_t n, uint16_t* out) {
  if (cpu_has_avx512_bf16()) return row_pairs_native(r0, r1, n, out);
  for (int64_t c = 0; c < n; ++c) {
    out[2 * c] = f32_to_bf16(r0[c]);
    out[2 * c + 1] = r1 ? f32_to_bf16(r1[c]) : 0;
  }
}

void bf16_tile_rows(const float* s, int64_t m, int64_t n, int64_t ld, uint16_t* out,
                    int64_t ldo) {
  if (cpu_has_avx512_bf16()) return tile_rows_native(s, m, n, ld, out, ldo);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) out[r * ldo + c] = f32_to_bf16(s[r * ld + c]);
    if (n % 2) out[r * ldo + n] = 0;
  }
}

bool bf16_pairs_native() { return cpu_has_avx512_bf16() && !bf16_gemm_emulated(); }

void gemm_bf16_pairs(int64_t m, int64_t n, int64_t kp, float alpha, const uint16_t* a,
                     int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
                     int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (bf16_pairs_native())
    gemm_native(m, n, kp, alpha, a, lda, b, ldb, beta, c, ldc);
  else
    gemm_bf16_pairs_portable(m, n, kp, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace hspmd::kernels
