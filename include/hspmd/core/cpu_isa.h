// The CPU's instruction-set level, as the kernels use it (docs/precision.md,
// "Kernels chosen at run time").
//
// One build runs on every x86-64 CPU: the CPU kernels are compiled once per
// level (src/kernels/cpu/variant.h) and the best one the CPU has is chosen at
// run time. HSPMD_CPU_ISA caps the level (never raises it), so one machine
// runs another's paths: HSPMD_CPU_ISA=avx2 on an AVX-512 CPU takes the AVX2
// kernels, the portable bf16 tile products and conversions, and oneDNN
// capped at AVX2 (unless ONEDNN_MAX_CPU_ISA is set). OpenBLAS reads its own
// OPENBLAS_CORETYPE when it loads (Haswell for AVX2).
#pragma once

#include <string>

namespace hspmd {

// Ordered: each level includes the ones before it.
enum class CpuIsa : int {
  kBaseline = 0,    // x86-64 (SSE2), or any other architecture
  kAvx2 = 1,        // x86-64-v3: AVX2, FMA, F16C, BMI1/2
  kAvx512 = 2,      // x86-64-v4: AVX512 F, BW, DQ, VL
  kAvx512Bf16 = 3,  // and AVX512-BF16 (bf16 dot products and conversions)
  kAmx = 4,         // and AMX-BF16 (used through oneDNN)
};

// What the CPU (and the OS) supports, checked once.
CpuIsa cpu_isa_detected();
// cpu_isa_detected() capped by HSPMD_CPU_ISA (read once; throws
// hspmd::Error "[cpu] HSPMD_CPU_ISA must be one of ..." for another value).
CpuIsa cpu_isa();
// Whether HSPMD_CPU_ISA lowers the level below what the CPU has.
bool cpu_isa_capped();
// "baseline", "avx2", "avx512", "avx512_bf16", "amx" (HSPMD_CPU_ISA's values).
const char* cpu_isa_name(CpuIsa isa);
// "avx512 (CPU: amx, capped by HSPMD_CPU_ISA)" / "avx512_bf16 (CPU)".
std::string cpu_isa_description();

}  // namespace hspmd
