// RMSNorm on CPU (Hugging Face LlamaRMSNorm in f32). Row statistics
// accumulate in double; dweight sums rows in a fixed order per column block.
#include <algorithm>
#include <cmath>
#include <vector>

#include "hspmd/core/error.h"
#include "kernels/basic.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "kernels/cpu/variant.h"

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT {

namespace {

// rsqrt(mean(x^2) + eps) from a row's Σ x^2.
float inv_rms(double ss, int64_t h, float eps) {
  return static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(h) + eps));
}

// The double sums run in vector lanes (`omp simd`): a serial double sum is
// one dependent add per element, several times slower, and no more precise.
float inv_rms(const float* x, int64_t h, float eps) {
  double ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) ss += static_cast<double>(x[i]) * x[i];
  return inv_rms(ss, h, eps);
}

// A bf16 array's exact f32 copy (on its device: the test double's too);
// an f32 array as it is.
NDArray widened(const NDArray& a) {
  if (a.dtype() != DType::BF16) return a;
  NDArray w = NDArray::empty(a.shape(), DType::F32, a.device());
  bf16_to_f32_n(a.data<uint16_t>(), w.data<float>(), a.numel());
  return w;
}

}  // namespace

void rms_norm(const NDArray& x, const NDArray& weight, float eps, NDArray& out) {
  require_contiguous("rms_norm", x);
  if (x.dtype() == DType::BF16) return rms_norm(widened(x), weight, eps, out);  // its values exactly
  require_contiguous("rms_norm", weight);
  const int64_t h = weight.numel(), rows = h == 0 ? 0 : x.numel() / h;
  HSPMD_CHECK(x.dim(-1) == h && out.numel() == x.numel(), "rms_norm: sizes");
  const bool bf16 = out.dtype() == DType::BF16;
  HSPMD_CHECK(bf16 || out.dtype() == DType::F32, "rms_norm: out must be f32 or bf16");
  const float* px = x.data<float>();
  const float* w = weight.data<float>();
#pragma omp parallel if (x.numel() > 32768)
  {
    std::vector<float> row(bf16 ? h : 0);  // a bf16 output's row, in f32 first
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = px + r * h;
      float* yr = bf16 ? row.data() : out.data<float>() + r * h;
      const float s = inv_rms(xr, h, eps);
      for (int64_t i = 0; i < h; ++i) yr[i] = w[i] * (xr[i] * s);
      if (bf16) f32_to_bf16_n(yr, out.data<uint16_t>() + r * h, h);
    }
  }
}

// The add's kernel, then the norm's on its stored sum: the bits of the two
// ops, by construction (the GPU's kernel is the one that saves a pass).
void add_rms_norm(const NDArray& a, const NDArray& b, const NDArray& weight, float eps, NDArray& sum,
                  NDArray& out) {
  HSPMD_CHECK(sum.numel() == a.numel() && out.numel() == a.numel(), "add_rms_norm: sizes");
  add(a, b, sum);
  rms_norm(sum, weight, eps, out);
}

void rms_norm_backward(const NDArray& dy, const NDArray& x, const NDArray& weight, float eps,
                       NDArray& dx, NDArray& dweight, const NDArray* addend, NDArray* dx_bf16) {
  if (dx_bf16 != nullptr) {  // dx, then its bf16 copy (a cast's rounding)
    HSPMD_CHECK(dx.dtype() == DType::F32 && dx_bf16->dtype() == DType::BF16 && dx_bf16->numel() == dx.numel() &&
                    dx_bf16->is_contiguous(),
                "rms_norm_backward: dx_bf16 needs an f32 dx and a contiguous bf16 array of its size");
    rms_norm_backward(dy, x, weight, eps, dx, dweight, addend, nullptr);
    f32_to_bf16_n(dx.data<float>(), dx_bf16->data<uint16_t>(), dx.numel());
    return;
  }
  require_contiguous("rms_norm_backward", dy);
  // bf16 x or addend: their exact values; a bf16 dx: the f32 result (the
  // addend added) rounded once, as a cast after it would.
  if (x.dtype() == DType::BF16 || dx.dtype() == DType::BF16 || (addend != nullptr && addend->dtype() == DType::BF16)) {
    require_contiguous("rms_norm_backward", x);
    const NDArray x32 = widened(x);
    const NDArray a32 = addend != nullptr ? widened(addend->contiguous()) : NDArray();
    NDArray dx32 = dx.dtype() == DType::BF16 ? NDArray::empty(dx.shape(), DType::F32, dx.device()) : dx;
    rms_norm_backward(dy, x32, weight, eps, dx32, dweight, addend != nullptr ? &a32 : nullptr, nullptr);
    if (dx.dtype() == DType::BF16) f32_to_bf16_n(dx32.data<float>(), dx.data<uint16_t>(), dx.numel());
    return;
  }
  const int64_t h = weight.numel(), rows = h == 0 ? 0 : x.numel() / h;
  HSPMD_CHECK(dy.numel() == x.numel() && dx.numel() == x.numel() && dweight.numel() == h,
              "rms_norm_backward: sizes");
  const float* px = x.data<float>();
  const float* pg = dy.data<float>();
  const float* w = weight.data<float>();
  float* pdx = dx.data<float>();
  const float* pa = addend != nullptr ? addend->data<float>() : nullptr;
  std::vector<float> inv(rows);
  // dx = s*w*dy - x * s^3 / H * Σ(dy*w*x), with s = rsqrt(mean(x^2) + eps).
#pragma omp parallel for schedule(static) if (x.numel() > 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = px + r * h;
    const float* gr = pg + r * h;
    double ss = 0, dot = 0;  // one pass for both sums
#pragma omp simd reduction(+ : ss, dot)
    for (int64_t i = 0; i < h; ++i) {
      ss += static_cast<double>(xr[i]) * xr[i];
      dot += static_cast<double>(gr[i]) * w[i] * xr[i];
    }
    const float s = inv[r] = inv_rms(ss, h, eps);
    const float c = static_cast<float>(dot * s * s * s / static_cast<double>(h));
    float* dr = pdx + r * h;
    for (int64_t i = 0; i < h; ++i) dr[i] = s * w[i] * gr[i] - xr[i] * c;
    if (pa != nullptr) {  // after the row, as a separate add would be
      const float* ar = pa + r * h;
      for (int64_t i = 0; i < h; ++i) dr[i] += ar[i];
    }
  }
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (h + kBlock - 1) / kBlock;
  float* dw = dweight.data<float>();
#pragma omp parallel for schedule(static) if (x.numel() > 32768)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t h0 = b * kBlock, h1 = std::min(h, h0 + kBlock);
    double acc[kBlock] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = px + r * h;
      const float* gr = pg + r * h;
      for (int64_t i = h0; i < h1; ++i)
        acc[i - h0] += static_cast<double>(gr[i]) * (xr[i] * inv[r]);
    }
    for (int64_t i = h0; i < h1; ++i) dw[i] = static_cast<float>(acc[i - h0]);
  }
}

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT
