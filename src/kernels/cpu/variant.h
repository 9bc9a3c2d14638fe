// Included by every source of an instruction-set variant of the CPU kernels
// (the files listed in src/kernels/CMakeLists.txt), after all its other
// includes. The build compiles each such file once per level, with
// HSPMD_CPU_VARIANT naming the namespace (baseline, avx2, avx512) and
// HSPMD_CPU_VARIANT_LEVEL its CpuIsa value.
//
// Everything after this header is compiled for that level (the GCC target
// pragma below) and must sit in namespace hspmd::kernels::cpu::
// HSPMD_CPU_VARIANT, helper headers included after it too (vec_math.h,
// attention_tile.h): one name compiled for two levels would be one symbol,
// and the linker would keep one copy for every level (an AVX-512 copy on an
// AVX2 CPU dies of SIGILL). Code included before the pragma (the standard
// library, hspmd's headers) is compiled for the baseline in every variant,
// so its shared copies are equal; CTest cpu_variants_one_definition checks
// the objects for both rules.
#pragma once

#include <cblas.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "hspmd/core/dtype.h"
#include "hspmd/core/error.h"
#include "hspmd/core/ndarray.h"
#include "kernels/attention.h"
#include "kernels/basic.h"
#include "kernels/cpu/bf16_pairs.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"

#if !defined(HSPMD_CPU_VARIANT) || !defined(HSPMD_CPU_VARIANT_LEVEL)
#error "variant.h: compile this file through the CPU variants of src/kernels/CMakeLists.txt"
#endif

// x86-64-v3 / -v4 as GCC names them (arch= also sets the ISA flags).
#if HSPMD_CPU_VARIANT_LEVEL == 1
#pragma GCC target("arch=x86-64-v3")
#elif HSPMD_CPU_VARIANT_LEVEL == 2
#pragma GCC target("arch=x86-64-v4")
#elif HSPMD_CPU_VARIANT_LEVEL != 0
#error "variant.h: HSPMD_CPU_VARIANT_LEVEL must be 0 (baseline), 1 (avx2) or 2 (avx512)"
#endif

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT {

#define HSPMD_CPU_KERNEL(name, ret, params) ret name params;
#include "kernels/cpu/variant_kernels.inc"
#undef HSPMD_CPU_KERNEL

// This variant's kernels (variant_table.cc), read by cpu::kernels().
extern const Kernels table;

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT
