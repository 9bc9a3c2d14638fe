// Memory kernels on the CPU (memory.h): fills, copies, block copies and host
// transfers (the host is the CPU device: no copy), and the optimizer's
// multi-tensor kernels.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "hspmd/core/dtype.h"
#include "hspmd/core/error.h"
#include "kernels/cpu/cpu.h"
#include "kernels/memory.h"
#include "kernels/cpu/variant.h"

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT {

void fill(NDArray& out, float value) {
  require_contiguous("fill", out);
  const int64_t n = out.numel();
  switch (out.dtype()) {
    case DType::F32: std::fill_n(out.data<float>(), n, value); break;
    case DType::BF16: std::fill_n(out.data<uint16_t>(), n, f32_to_bf16(value)); break;
    case DType::I32: std::fill_n(out.data<int32_t>(), n, static_cast<int32_t>(value)); break;
    case DType::I64: std::fill_n(out.data<int64_t>(), n, static_cast<int64_t>(value)); break;
    case DType::F64: fail("[kernels] fill: no f64 arrays");
  }
}

NDArray zeros(const Shape& shape, DType dtype) {
  NDArray a = NDArray::empty(shape, dtype, Device::cpu());
  if (a.nbytes() > 0) std::memset(a.raw_data(), 0, a.nbytes());
  return a;
}

void copy(const NDArray& from, NDArray& out) {
  require_contiguous("copy", from);
  require_contiguous("copy", out);
  HSPMD_CHECK(from.dtype() == out.dtype() && from.numel() == out.numel(), "copy: ",
              dtype_name(from.dtype()), shape_str(from.shape()), " into ", dtype_name(out.dtype()),
              shape_str(out.shape()));
  if (from.nbytes() > 0 && from.raw_data() != out.raw_data())
    std::memcpy(out.raw_data(), from.raw_data(), from.nbytes());
}

void copy_block(const NDArray& from, const Shape& from_start, NDArray& to, const Shape& to_start,
                const Shape& extent, bool accumulate) {
  require_contiguous("copy_block", from);
  require_contiguous("copy_block", to);
  const size_t n = extent.size();
  HSPMD_CHECK(from.dtype() == to.dtype(), "copy_block: ", dtype_name(from.dtype()), " into ",
              dtype_name(to.dtype()));
  HSPMD_CHECK(from.ndim() == static_cast<int>(n) && to.ndim() == static_cast<int>(n) &&
                  from_start.size() == n && to_start.size() == n,
              "copy_block: ranks differ");
  HSPMD_CHECK(!accumulate || to.dtype() == DType::F32, "copy_block: accumulates f32 only");
  for (size_t d = 0; d < n; ++d) {
    HSPMD_CHECK(extent[d] >= 0 && from_start[d] >= 0 && to_start[d] >= 0 &&
                    from_start[d] + extent[d] <= from.shape()[d] &&
                    to_start[d] + extent[d] <= to.shape()[d],
                "copy_block: block ", shape_str(extent), " at ", shape_str(from_start), " of ",
                shape_str(from.shape()), " into ", shape_str(to_start), " of ", shape_str(to.shape()));
    if (extent[d] == 0) return;
  }
  const size_t es = dtype_size(from.dtype());
  const auto* src = static_cast<const char*>(from.raw_data());
  auto* dst = static_cast<char*>(to.raw_data());
  if (n == 0) {  // scalars
    if (accumulate) *reinterpret_cast<float*>(dst) += *reinterpret_cast<const float*>(src);
    else std::memcpy(dst, src, es);
    return;
  }
  const Shape sa = from.strides(), sb = to.strides();
  const int64_t len = extent[n - 1];
  std::vector<int64_t> idx(n, 0);
  while (true) {
    int64_t oa = 0, ob = 0;
    for (size_t d = 0; d < n; ++d) {
      oa += (from_start[d] + idx[d]) * sa[d];
      ob += (to_start[d] + idx[d]) * sb[d];
    }
    if (accumulate) {
      const float* x = reinterpret_cast<const float*>(src) + oa;
      float* y = reinterpret_cast<float*>(dst) + ob;
      for (int64_t i = 0; i < len; ++i) y[i] += x[i];
    } else {
      std::memcpy(dst + ob * static_cast<int64_t>(es), src + oa * static_cast<int64_t>(es),
                  static_cast<size_t>(len) * es);
    }
    size_t d = n - 1;
    while (true) {
      if (d == 0) return;
      --d;
      if (++idx[d] < extent[d]) break;
      idx[d] = 0;
    }
  }
}

double sum_of_squares(const std::vector<NDArray>& arrays) {
  double sum = 0;
  for (const NDArray& a : arrays) {
    require_contiguous("sum_of_squares", a);
    const float* x = a.data<float>();
    const int64_t n = a.numel();
    for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  }
  return sum;
}

void clip_control(const std::vector<NDArray>& grads, const std::vector<NDArray>& losses, double max_norm,
                  NDArray& control) {
  HSPMD_CHECK(control.dtype() == DType::F64 && control.numel() == 3 && control.is_contiguous(),
              "clip_control: the control array must be f64 [3]");
  bool finite = true;
  for (const NDArray& l : losses) {
    HSPMD_CHECK(l.dtype() == DType::F32 && l.numel() == 1, "clip_control: each loss must be one f32 value");
    finite = finite && std::isfinite(l.data<float>()[0]);
  }
  const double sum = sum_of_squares(grads);
  const double norm = std::sqrt(sum);
  double* c = control.data<double>();
  c[0] = sum;
  // clip_coefficient's expression (optim/lr_schedule.cc), the same bits.
  c[1] = max_norm > 0 && norm > max_norm ? static_cast<double>(static_cast<float>(max_norm / (norm + 1e-6))) : 1.0;
  c[2] = finite && std::isfinite(norm) ? 1.0 : 0.0;
}

namespace {

// Below this many elements the OpenMP fork costs more than the loop.
constexpr int64_t kAdamParallelThreshold = 1 << 15;
// Elements per piece of a clipped update (its scaled gradient's buffer).
constexpr int64_t kAdamClipChunk = 1 << 16;

// a - b * c, rounded once where the CPU has FMA: the rounding GCC chose for
// the scalar loop. Vectorized, it would fuse a's own product (p * decay)
// instead, and the bf16 runs of tests/exec compare one process with
// multi-rank runs closely enough to see the difference.
inline float minus_product(float a, float b, float c) {
#ifdef FP_FAST_FMAF
  return std::fma(-b, c, a);
#else
  return a - b * c;
#endif
}

// One AdamW element: torch's operation order on p, g, m, v; with kCopy the
// updated parameter's bf16 rounding (f32_to_bf16, the cast's bits) into
// `copy`. Inlined into both loops below.
template <bool kCopy>
[[gnu::always_inline]] inline void adam_element(float* p, const float* g, float* m, float* v, uint16_t* copy,
                                                int64_t i, const AdamFactors& f) {
  const float gi = g[i] + f.l2 * p[i];
  const float pi = p[i] * f.decay_scale;
  const float mi = f.beta1 * m[i] + f.one_minus_beta1 * gi;
  const float vi = f.beta2 * v[i] + f.one_minus_beta2 * gi * gi;
  m[i] = mi;
  v[i] = vi;
  // Same operation order as torch: denom = sqrt(v) / sqrt(bc2) + eps.
  const float updated = minus_product(pi, f.step_size, mi / (std::sqrt(vi) / f.sqrt_bc2 + f.eps));
  p[i] = updated;
  if constexpr (kCopy) copy[i] = f32_to_bf16(updated);
}

// A whole tensor, its own OpenMP region over the elements.
template <bool kCopy>
void adam_tensor(float* p, const float* g, float* m, float* v, uint16_t* copy, int64_t n, const AdamFactors& f) {
#pragma omp parallel for simd schedule(static) if (n >= kAdamParallelThreshold)
  for (int64_t i = 0; i < n; ++i) adam_element<kCopy>(p, g, m, v, copy, i, f);
}

// A piece on the calling thread (inside the caller's parallel region). Not
// adam_tensor with its region switched off: nested in another region, GCC's
// code for that loop ran about 9x slower (a clipped 16 M-element tensor: 110
// ms against 12.5 on one thread), this one as fast as adam_tensor's. The
// same elements' bits (MemoryKernels.AdamStepGradScaleIsTheClipPassThenTheUpdate).
template <bool kCopy>
void adam_piece(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                uint16_t* __restrict copy, int64_t n, const AdamFactors f) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) adam_element<kCopy>(p, g, m, v, copy, i, f);
}

}  // namespace

void adam_step(const std::vector<AdamTensor>& tensors, const AdamFactors& given) {
  AdamFactors f = given;
  bool apply = true;
  if (given.control != nullptr) {
    const NDArray& control = *given.control;
    HSPMD_CHECK(control.dtype() == DType::F64 && control.numel() == 3 && control.is_contiguous(),
                "adam_step: the control array must be f64 [3] (clip_control's)");
    apply = control.data<double>()[2] == 1.0;  // 0: a non-finite step, nothing changes
    f.grad_scale = static_cast<float>(control.data<double>()[1]);
  }
  if (given.step != nullptr) {
    const NDArray& step = *given.step;
    HSPMD_CHECK(step.dtype() == DType::F32 && step.numel() == 3 && step.is_contiguous(),
                "adam_step: the step's factors must be f32 [3] (decay_scale, sqrt_bc2, step_size)");
    f.decay_scale = step.data<float>()[0];
    f.sqrt_bc2 = step.data<float>()[1];
    f.step_size = step.data<float>()[2];
  }
  for (const AdamTensor& t : tensors) {
    for (const NDArray* a : {static_cast<const NDArray*>(t.param), t.grad,
                             static_cast<const NDArray*>(t.exp_avg), static_cast<const NDArray*>(t.exp_avg_sq)}) {
      HSPMD_CHECK(a != nullptr && a->dtype() == DType::F32 && a->numel() == t.param->numel(),
                  "adam_step: param, grad and moments must be f32 of one size");
      require_contiguous("adam_step", *a);
    }
    if (t.param_bf16 != nullptr) {
      HSPMD_CHECK(t.param_bf16->dtype() == DType::BF16 && t.param_bf16->numel() == t.param->numel(),
                  "adam_step: the parameter's bf16 copy must be bf16 of the parameter's size");
      require_contiguous("adam_step", *t.param_bf16);
    }
    if (!apply) continue;
    float *p = t.param->data<float>(), *m = t.exp_avg->data<float>(), *v = t.exp_avg_sq->data<float>();
    const float* g = t.grad->data<float>();
    auto* copy = t.param_bf16 != nullptr ? static_cast<uint16_t*>(t.param_bf16->raw_data()) : nullptr;
    const int64_t n = t.param->numel();
    if (f.grad_scale == 1.0f) {
      if (copy != nullptr)
        adam_tensor<true>(p, g, m, v, copy, n, f);
      else
        adam_tensor<false>(p, g, m, v, nullptr, n, f);
      continue;
    }
    // The clip as a pass of its own over a chunk, then the update's loop on
    // it as for an unclipped gradient (what the compiler fuses there stays
    // the same): the bits of kernels::scale and then the update, without a
    // scaled copy of the whole gradient. The chunks share one parallel
    // region, each thread with its own buffer.
    const int64_t chunks = (n + kAdamClipChunk - 1) / kAdamClipChunk;
#pragma omp parallel if (n >= kAdamParallelThreshold)
    {
      std::vector<float> buffer(static_cast<size_t>(std::min(kAdamClipChunk, n)));
      float* const scaled = buffer.data();
      const float scale = f.grad_scale;
#pragma omp for schedule(static)
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t at = c * kAdamClipChunk, len = std::min(kAdamClipChunk, n - at);
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) scaled[i] = g[at + i] * scale;
        if (copy != nullptr)
          adam_piece<true>(p + at, scaled, m + at, v + at, copy + at, len, f);
        else
          adam_piece<false>(p + at, scaled, m + at, v + at, nullptr, len, f);
      }
    }
  }
}

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT
