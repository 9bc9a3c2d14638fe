// Element types. f32 is the compute type; bf16 is a storage type (weights on
// disk, later mixed precision); i32/i64 hold token ids, positions and offsets;
// f64 is for exact reductions of counters and statistics across ranks (the
// communicator moves every dtype; NDArray does not hold f64 yet).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace hspmd {

enum class DType : uint8_t { F32, BF16, I32, I64, F64 };

// Size of one element in bytes.
size_t dtype_size(DType t);
// Lower-case name ("f32", "bf16", "i32", "i64", "f64").
const char* dtype_name(DType t);

// bf16 <-> f32. Conversion to bf16 rounds to nearest even; NaN stays NaN.
inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu))
    return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// The instruction sets of the bulk conversions below, best first.
enum class ConvertIsa : uint8_t { kAvx512Bf16, kAvx512F, kScalar };
// The best one this CPU has under HSPMD_CPU_ISA's cap (checked once, at the first call).
ConvertIsa best_convert_isa();

// dst[i] = f32_to_bf16(src[i]) / bf16_to_f32(src[i]) for i < n, bitwise equal
// to the scalar functions on every path; OpenMP over large arrays. `isa`
// forces a path (tests); one the CPU lacks falls back to best_convert_isa().
void f32_to_bf16_n(const float* src, uint16_t* dst, int64_t n,
                   ConvertIsa isa = ConvertIsa::kAvx512Bf16);
void bf16_to_f32_n(const uint16_t* src, float* dst, int64_t n,
                   ConvertIsa isa = ConvertIsa::kAvx512Bf16);

}  // namespace hspmd
