#include "hspmd/core/cpu_isa.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>

#include "hspmd/core/error.h"

namespace hspmd {

namespace {

constexpr CpuIsa kAll[] = {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16, CpuIsa::kAmx};

// AMX as Linux reports it (the kernel enables its state only when it knows
// it); GCC 12's __builtin_cpu_supports has no AMX names.
bool proc_cpuinfo_has(const std::string& flag) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    return (line + " ").find(" " + flag + " ") != std::string::npos;
  }
  return false;
}

CpuIsa detect() {
#if defined(__x86_64__) && defined(__GNUC__)
  // __builtin_cpu_supports counts a feature only when the OS saves its
  // registers (XGETBV), so an AVX-512 CPU under an OS without ZMM state is
  // AVX2 here.
  __builtin_cpu_init();
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
                  __builtin_cpu_supports("f16c");
  if (!v3) return CpuIsa::kBaseline;
  const bool v4 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (!v4) return CpuIsa::kAvx2;
  if (!__builtin_cpu_supports("avx512bf16")) return CpuIsa::kAvx512;
  return proc_cpuinfo_has("amx_bf16") ? CpuIsa::kAmx : CpuIsa::kAvx512Bf16;
#else
  return CpuIsa::kBaseline;
#endif
}

// The level HSPMD_CPU_ISA names, or kAmx (no cap) when it is unset or empty.
CpuIsa cap_from_env() {
  const char* v = std::getenv("HSPMD_CPU_ISA");
  if (v == nullptr || *v == '\0') return CpuIsa::kAmx;
  for (CpuIsa isa : kAll)
    if (std::string(v) == cpu_isa_name(isa)) return isa;
  fail("[cpu] HSPMD_CPU_ISA must be one of baseline, avx2, avx512, avx512_bf16, amx (a cap on the CPU's "
       "level), got \"", v, "\"");
}

}  // namespace

CpuIsa cpu_isa_detected() {
  static const CpuIsa isa = detect();
  return isa;
}

CpuIsa cpu_isa() {
  static const CpuIsa isa = std::min(cpu_isa_detected(), cap_from_env());
  return isa;
}

bool cpu_isa_capped() { return cpu_isa() < cpu_isa_detected(); }

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline: return "baseline";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx512Bf16: return "avx512_bf16";
    case CpuIsa::kAmx: return "amx";
  }
  return "?";
}

std::string cpu_isa_description() {
  std::string s = cpu_isa_name(cpu_isa());
  if (cpu_isa_capped())
    return s + " (CPU: " + cpu_isa_name(cpu_isa_detected()) + ", capped by HSPMD_CPU_ISA)";
  return s + " (CPU)";
}

}  // namespace hspmd
