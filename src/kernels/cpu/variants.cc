// The CPU variant the kernels run (cpu.h): the highest level the build has
// at or below cpu_isa(). Compiled once, for the baseline.
#include "hspmd/core/cpu_isa.h"
#include "hspmd/core/error.h"
#include "kernels/cpu/cpu.h"

namespace hspmd::kernels::cpu {

// The tables of the variants the build has (src/kernels/CMakeLists.txt
// defines HSPMD_CPU_VARIANT_AVX2 / _AVX512 when it compiles them).
namespace baseline {
extern const Kernels table;
}
#ifdef HSPMD_CPU_VARIANT_AVX2
namespace avx2 {
extern const Kernels table;
}
#endif
#ifdef HSPMD_CPU_VARIANT_AVX512
namespace avx512 {
extern const Kernels table;
}
#endif

const Kernels* kernels_for(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline: return &baseline::table;
#ifdef HSPMD_CPU_VARIANT_AVX2
    case CpuIsa::kAvx2: return &avx2::table;
#endif
#ifdef HSPMD_CPU_VARIANT_AVX512
    case CpuIsa::kAvx512: return &avx512::table;
#endif
    default: return nullptr;
  }
}

const Kernels& kernels() {
  static const Kernels* const chosen = [] {
    for (int level = static_cast<int>(cpu_isa()); level > 0; --level)
      if (const Kernels* k = kernels_for(static_cast<CpuIsa>(level))) return k;
    return &baseline::table;
  }();
  return *chosen;
}

void require_contiguous(const char* kernel, const NDArray& a) {
  HSPMD_CHECK(a.is_contiguous(), kernel, ": strided input");
}

std::vector<int32_t> key_starts(const NDArray& documents, int64_t B, int64_t S, int64_t window) {
  return kernels().key_starts(documents, B, S, window);
}

std::vector<int32_t> document_starts_from_positions(const NDArray& positions, int64_t first) {
  return kernels().document_starts_from_positions(positions, first);
}

}  // namespace hspmd::kernels::cpu
