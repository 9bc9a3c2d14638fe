// Vectorized float math for the CPU kernels, written with GCC vector
// extensions so it compiles to the SIMD of each CPU variant without
// intrinsics: one register of it (variant.h: 16 lanes for AVX-512, 8 for
// AVX2, 4 for SSE; a vector wider than the target's registers is split
// into pieces GCC handles poorly, 3-7x slower in swiglu and cross_entropy). Loops over rows call these helpers
// instead of relying on auto-vectorization of libm calls.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef HSPMD_CPU_VARIANT
#error "vec_math.h: include it after kernels/cpu/variant.h, in a CPU variant's source"
#endif

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT::vec {

#if HSPMD_CPU_VARIANT_LEVEL >= 2
constexpr int kLanes = 16;
#elif HSPMD_CPU_VARIANT_LEVEL == 1
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float f32v __attribute__((vector_size(4 * kLanes)));
typedef int32_t i32v __attribute__((vector_size(4 * kLanes)));

inline f32v load(const float* p) {
  f32v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, f32v v) { std::memcpy(p, &v, sizeof v); }
inline f32v splat(float x) { return f32v{} + x; }

// exp(x), Cephes polynomial (relative error ~2e-7): exactly 0 below -87 (so
// exp(-inf) = 0), exp(88) above 88.
inline f32v exp(f32v x) {
  const auto underflow = x < -87.0f;
  x = underflow ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  const f32v t = x * 1.44269504088896341f;
  const f32v magic = splat(12582912.0f);  // 1.5 * 2^23: rounds to nearest
  const f32v n = (t + magic) - magic;
  const f32v r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f32v p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f32v e = p * r * r + r + 1.0f;
  const i32v bits = (__builtin_convertvector(n, i32v) + 127) << 23;
  f32v scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return underflow ? splat(0.0f) : e * scale;
}

// The same exp for one float, branch-free so `omp simd` loops calling it
// vectorize (attention's online softmax) and for the tails of the loops here.
inline float exp_scalar(float x) {
  const float xc = std::min(std::max(x, -87.0f), 88.0f);
  const float rn = xc * 1.44269504088896341f + 12582912.0f;  // + 1.5 * 2^23 rounds to int
  const float n = rn - 12582912.0f;
  const int32_t e = std::bit_cast<int32_t>(rn) - 0x4B400000;
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float out = std::bit_cast<float>(std::bit_cast<int32_t>(y) + (e << 23));
  return x < -87.0f ? 0.0f : out;
}

inline float hsum(f32v v) {
  float s = 0;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

inline float row_max(const float* x, int64_t n) {
  f32v m = splat(-INFINITY);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const f32v v = load(x + i);
    m = v > m ? v : m;
  }
  float out = -INFINITY;
  for (int l = 0; l < kLanes; ++l) out = std::max(out, m[l]);
  for (; i < n; ++i) out = std::max(out, x[i]);
  return out;
}

// Σ exp(x[i] - shift).
inline float sum_exp(const float* x, int64_t n, float shift) {
  f32v s = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) s += exp(load(x + i) - shift);
  float out = hsum(s);
  for (; i < n; ++i) out += exp_scalar(x[i] - shift);
  return out;
}

// x[i] = exp(x[i] - shift) in place; returns their sum.
inline float exp_shift_sum(float* x, int64_t n, float shift) {
  f32v s = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const f32v e = exp(load(x + i) - shift);
    store(x + i, e);
    s += e;
  }
  float out = hsum(s);
  for (; i < n; ++i) out += x[i] = exp_scalar(x[i] - shift);
  return out;
}

// out[i] = exp(x[i] - shift) * scale (out may be x).
inline void exp_scale(const float* x, int64_t n, float shift, float scale, float* out) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(out + i, exp(load(x + i) - shift) * scale);
  for (; i < n; ++i) out[i] = exp_scalar(x[i] - shift) * scale;
}

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT::vec
