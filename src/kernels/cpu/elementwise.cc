#include "hspmd/core/error.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "kernels/cpu/variant.h"

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT {

namespace {

template <typename F>
void binary(const char* name, const NDArray& a, const NDArray& b, NDArray& out, F f) {
  require_contiguous(name, a);
  HSPMD_CHECK(a.numel() == b.numel() && a.numel() == out.numel(), name, ": sizes differ");
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  float* po = out.data<float>();
  const int64_t n = a.numel();
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) po[i] = f(pa[i], pb[i]);
}

}  // namespace

void add(const NDArray& a, const NDArray& b, NDArray& out) {
  if (a.dtype() != DType::BF16 && b.dtype() != DType::BF16 && out.dtype() != DType::BF16)
    return binary("add", a, b, out, [](float x, float y) { return x + y; });
  require_contiguous("add", a);
  require_contiguous("add", b);
  HSPMD_CHECK(a.numel() == b.numel() && a.numel() == out.numel(), "add: sizes differ");
  const int64_t n = a.numel();
  // bf16 inputs read as their exact f32 values; the sum in f32, written
  // rounded to bf16 (the cast's rounding) where the output is bf16.
  const auto run = [&](auto a_at, auto b_at) {
    if (out.dtype() == DType::BF16) {
      uint16_t* po = out.data<uint16_t>();
#pragma omp parallel for simd schedule(static) if (n > 65536)
      for (int64_t i = 0; i < n; ++i) po[i] = f32_to_bf16(a_at(i) + b_at(i));
    } else {
      float* po = out.data<float>();
#pragma omp parallel for simd schedule(static) if (n > 65536)
      for (int64_t i = 0; i < n; ++i) po[i] = a_at(i) + b_at(i);
    }
  };
  const auto with_b = [&](auto a_at) {
    if (b.dtype() == DType::BF16) {
      const uint16_t* pb = b.data<uint16_t>();
      run(a_at, [pb](int64_t i) { return bf16_to_f32(pb[i]); });
    } else {
      const float* pb = b.data<float>();
      run(a_at, [pb](int64_t i) { return pb[i]; });
    }
  };
  if (a.dtype() == DType::BF16) {
    const uint16_t* pa = a.data<uint16_t>();
    with_b([pa](int64_t i) { return bf16_to_f32(pa[i]); });
  } else {
    const float* pa = a.data<float>();
    with_b([pa](int64_t i) { return pa[i]; });
  }
}

void mul(const NDArray& a, const NDArray& b, NDArray& out) {
  binary("mul", a, b, out, [](float x, float y) { return x * y; });
}

void scale(const NDArray& a, float factor, NDArray& out) {
  binary("scale", a, a, out, [factor](float x, float) { return x * factor; });
}

void accumulate(const NDArray& a, NDArray& out) {
  binary("accumulate", a, out, out, [](float x, float y) { return x + y; });
}

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT
