// The CPU kernel variants (src/kernels/cpu/variant.h): the dispatch runs the
// highest variant at or below the capped level (CTest runs this binary with
// HSPMD_CPU_ISA unset, baseline and avx2), and every variant the CPU can run
// computes what the baseline computes, up to the order of float sums.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <string>

#include "hspmd/core/cpu_isa.h"
#include "kernels/cpu/cpu.h"

namespace hspmd {
namespace {

using kernels::cpu::Kernels;
using kernels::cpu::kernels_for;

TEST(CpuVariants, TheDispatchRunsTheCappedLevel) {
  const char* cap = std::getenv("HSPMD_CPU_ISA");
  CpuIsa want = cpu_isa_detected();
  if (cap && *cap) {
    for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16, CpuIsa::kAmx})
      if (std::string(cap) == cpu_isa_name(isa)) want = std::min(want, isa);
  }
  EXPECT_EQ(cpu_isa(), want) << "HSPMD_CPU_ISA=" << (cap ? cap : "");
  EXPECT_EQ(cpu_isa_capped(), want < cpu_isa_detected());
  // The highest variant the build has at or below the level.
  CpuIsa variant = CpuIsa::kBaseline;
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512})
    if (isa <= want && kernels_for(isa)) variant = isa;
  EXPECT_EQ(kernels::cpu::kernels().isa, variant);
  EXPECT_EQ(&kernels::cpu::kernels(), kernels_for(variant));
}

TEST(CpuVariants, EveryVariantIsComplete) {
  ASSERT_NE(kernels_for(CpuIsa::kBaseline), nullptr);
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  ASSERT_NE(kernels_for(CpuIsa::kAvx2), nullptr);
  ASSERT_NE(kernels_for(CpuIsa::kAvx512), nullptr);
#endif
  for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    const Kernels* k = kernels_for(isa);
    if (!k) continue;
    EXPECT_EQ(k->isa, isa);
#define HSPMD_CPU_KERNEL(name, ret, params) EXPECT_NE(k->name, nullptr) << #name;
#include "kernels/cpu/variant_kernels.inc"
#undef HSPMD_CPU_KERNEL
  }
}

NDArray random_array(const Shape& shape, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  NDArray a = NDArray::empty(shape, DType::F32);
  for (int64_t i = 0; i < a.numel(); ++i) a.data<float>()[i] = d(rng);
  return a;
}

// Largest |x - y| / (1 + |y|) over the elements.
double max_rel(const NDArray& x, const NDArray& y) {
  double worst = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double a = x.data<float>()[i], b = y.data<float>()[i];
    worst = std::max(worst, std::abs(a - b) / (1.0 + std::abs(b)));
  }
  return worst;
}

// rms_norm, swiglu and attention (the kernels with vectorized sums and the
// vectorized exp) of every variant this CPU runs against the baseline's:
// they differ by the order of sums and by fused multiply-adds, a few units
// of f32 rounding times the sum's length, never more.
TEST(CpuVariants, AgreeWithTheBaseline) {
  std::mt19937 rng(7);
  const int64_t B = 2, S = 96, H = 4, D = 32, F = 256;
  const NDArray x = random_array({B * S, F}, rng), w = random_array({F}, rng), up = random_array({B * S, F}, rng);
  const NDArray q = random_array({B, S, H, D}, rng), k = random_array({B, S, H, D}, rng),
                v = random_array({B, S, H, D}, rng);
  const Kernels& base = *kernels_for(CpuIsa::kBaseline);
  auto outputs = [&](const Kernels& kn) {
    std::vector<NDArray> out;
    NDArray n = NDArray::empty({B * S, F}, DType::F32), g = NDArray::empty({B * S, F}, DType::F32);
    kn.rms_norm(x, w, 1e-6f, n);
    kn.swiglu(x, up, g);
    NDArray o = NDArray::empty({B, S, H, D}, DType::F32), lse = NDArray::empty({B, H, S}, DType::F32);
    kn.attention_forward(q, k, v, NDArray(), 1.0f / std::sqrt(float(D)), o, lse, {64, 64}, DType::F32, 0);
    return std::vector<NDArray>{n, g, o, lse};
  };
  const std::vector<NDArray> want = outputs(base);
  // The bound: 64 units of f32 rounding for sums of up to F terms.
  const double bound = 64 * std::ldexp(1.0, -24) * std::sqrt(double(F));
  int compared = 0;
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    const Kernels* kn = kernels_for(isa);
    if (!kn || isa > cpu_isa_detected()) continue;
    const std::vector<NDArray> got = outputs(*kn);
    const char* names[] = {"rms_norm", "swiglu", "attention out", "attention lse"};
    for (size_t i = 0; i < got.size(); ++i) {
      const double e = max_rel(got[i], want[i]);
      EXPECT_LE(e, bound) << cpu_isa_name(isa) << " " << names[i];
    }
    ++compared;
  }
  if (compared == 0) GTEST_SKIP() << "this CPU runs only the baseline variant";
}

}  // namespace
}  // namespace hspmd
