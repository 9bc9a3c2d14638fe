// One CPU variant's table of kernels (cpu.h, Kernels), compiled with the
// variant's other sources (variant.h). A constant: no code of the variant
// runs before the dispatch has chosen it (an AVX-512 initializer would kill
// an AVX2 CPU at start-up).
#include "kernels/cpu/variant.h"

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT {

constinit const Kernels table = [] {
  Kernels k;
  k.isa = static_cast<CpuIsa>(HSPMD_CPU_VARIANT_LEVEL);
#define HSPMD_CPU_KERNEL(name, ret, params) k.name = &name;
#include "kernels/cpu/variant_kernels.inc"
#undef HSPMD_CPU_KERNEL
  return k;
}();

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT
