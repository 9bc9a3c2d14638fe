// Bulk f32 <-> bf16 conversions (dtype.h). The build is the same for every
// x86 CPU, so the AVX-512 loops are target functions picked at run time
// (cpu_isa(): HSPMD_CPU_ISA caps them). Every path is bitwise equal to the scalar
// f32_to_bf16 / bf16_to_f32, NaN and denormals included (tests/core).
#include <algorithm>

#include "hspmd/core/cpu_isa.h"
#include "hspmd/core/dtype.h"

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12 reports the _mm512_undefined_* inside these intrinsics as "maybe
// uninitialized" when they are inlined (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define HSPMD_CONVERT_X86 1
#endif

namespace hspmd {

namespace {

// Below this many elements one thread converts: a conversion moves 6 bytes
// per element, so smaller arrays finish before a parallel region pays off.
constexpr int64_t kParallelElems = 1 << 17;
// Elements per OpenMP work item, a multiple of 16.
constexpr int64_t kChunk = 1 << 14;

void f32_to_bf16_scalar(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

void bf16_to_f32_scalar(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

#ifdef HSPMD_CONVERT_X86

// f32_to_bf16 on 16 lanes in integer arithmetic; the bf16 in each low half.
__attribute__((target("avx512f"))) inline __m512i round_bf16_avx512f(__m512i bits) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  // NaN (|bits| above the infinity's): the truncated bits, made quiet.
  const __m512i abs = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
}

__attribute__((target("avx512f"))) void f32_to_bf16_avx512f(const float* src, uint16_t* dst,
                                                             int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i r = round_bf16_avx512f(_mm512_castps_si512(_mm512_loadu_ps(src + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512i r = round_bf16_avx512f(_mm512_castps_si512(_mm512_maskz_loadu_ps(m, src + i)));
    _mm512_mask_cvtepi32_storeu_epi16(dst + i, m, r);
  }
}

// vcvtneps2bf16 rounds to nearest even and quiets NaN like f32_to_bf16, but
// flushes denormal inputs to zero whatever MXCSR says; a vector holding one
// (rare in practice) takes the integer path instead.
__attribute__((target("avx512f,avx512bf16"))) inline __m256i round_bf16_avx512bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __mmask16 denormal = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7f800000)) &
                             _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x007fffff));
  if (denormal) return _mm512_cvtepi32_epi16(round_bf16_avx512f(bits));
  return (__m256i)_mm512_cvtneps_pbh(v);
}

__attribute__((target("avx512f,avx512bf16"))) void f32_to_bf16_avx512bf16(const float* src,
                                                                         uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        round_bf16_avx512bf16(_mm512_loadu_ps(src + i)));
  if (i < n) f32_to_bf16_avx512f(src + i, dst + i, n - i);
}

__attribute__((target("avx512f"))) void bf16_to_f32_avx512f(const uint16_t* src, float* dst,
                                                             int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_si512(dst + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  for (; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

#endif  // HSPMD_CONVERT_X86

// The CPU's level under HSPMD_CPU_ISA's cap (hspmd/core/cpu_isa.h).
ConvertIsa detect_convert_isa() {
#ifdef HSPMD_CONVERT_X86
  if (cpu_isa() >= CpuIsa::kAvx512Bf16) return ConvertIsa::kAvx512Bf16;
  if (cpu_isa() >= CpuIsa::kAvx512) return ConvertIsa::kAvx512F;
#endif
  return ConvertIsa::kScalar;
}

// Runs f(begin, end) over [0, n), in parallel chunks when n is large.
template <typename F>
void for_chunks(int64_t n, F f) {
  if (n <= kParallelElems) return f(int64_t{0}, n);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) f(c * kChunk, std::min(n, (c + 1) * kChunk));
}

}  // namespace

ConvertIsa best_convert_isa() {
  static const ConvertIsa isa = detect_convert_isa();
  return isa;
}

void f32_to_bf16_n(const float* src, uint16_t* dst, int64_t n, ConvertIsa isa) {
  // A path this CPU lacks falls back to the best it has (a lower one).
  isa = std::max(isa, best_convert_isa());
  for_chunks(n, [&](int64_t b, int64_t e) {
    switch (isa) {
#ifdef HSPMD_CONVERT_X86
      case ConvertIsa::kAvx512Bf16: return f32_to_bf16_avx512bf16(src + b, dst + b, e - b);
      case ConvertIsa::kAvx512F: return f32_to_bf16_avx512f(src + b, dst + b, e - b);
#endif
      default: return f32_to_bf16_scalar(src + b, dst + b, e - b);
    }
  });
}

void bf16_to_f32_n(const uint16_t* src, float* dst, int64_t n, ConvertIsa isa) {
  isa = std::max(isa, best_convert_isa());
  for_chunks(n, [&](int64_t b, int64_t e) {
#ifdef HSPMD_CONVERT_X86
    if (isa != ConvertIsa::kScalar) return bf16_to_f32_avx512f(src + b, dst + b, e - b);
#endif
    bf16_to_f32_scalar(src + b, dst + b, e - b);
  });
}

}  // namespace hspmd
