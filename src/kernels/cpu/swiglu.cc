// SwiGLU on CPU: silu(gate) * up and its fused backward.
#include <algorithm>
#include <cmath>

#include "hspmd/core/error.h"
#include "kernels/basic.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "kernels/cpu/variant.h"

#include "vec_math.h"

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT {

namespace {

constexpr int64_t kBlock = 4096;  // elements per OpenMP work item

inline vec::f32v sigmoid(vec::f32v x) { return 1.0f / (1.0f + vec::exp(-x)); }

// Runs f(begin, end) over [0, n) in blocks whose inner ranges are multiples of
// the vector width except the last.
template <typename F>
void for_blocks(int64_t n, F f) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n > 32768)
  for (int64_t b = 0; b < blocks; ++b) f(b * kBlock, std::min(n, (b + 1) * kBlock));
}

// A block of one array as f32: the array's own elements when it is f32,
// else converted into `buf` (kBlock floats).
const float* f32_block(const NDArray& a, int64_t begin, int64_t n, float* buf) {
  if (a.dtype() == DType::F32) return a.data<float>() + begin;
  bf16_to_f32_n(a.data<uint16_t>() + begin, buf, n);
  return buf;
}

// Where a block of `out` is computed in f32: in place when f32, else `buf`.
float* f32_target(NDArray& out, int64_t begin, float* buf) {
  return out.dtype() == DType::F32 ? out.data<float>() + begin : buf;
}

// Rounds a block computed in `buf` into a bf16 `out`.
void store_block(NDArray& out, int64_t begin, int64_t n, const float* buf) {
  if (out.dtype() == DType::BF16) f32_to_bf16_n(buf, out.data<uint16_t>() + begin, n);
}

void swiglu_block(const float* g, const float* u, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + vec::kLanes <= n; i += vec::kLanes) {
    const vec::f32v gv = vec::load(g + i);
    vec::store(y + i, gv * sigmoid(gv) * vec::load(u + i));
  }
  for (; i < n; ++i) y[i] = g[i] / (1.0f + vec::exp_scalar(-g[i])) * u[i];
}

// silu'(x) = s * (1 + x * (1 - s)) with s = sigmoid(x).
void swiglu_backward_block(const float* d, const float* g, const float* u, float* dg, float* du,
                           int64_t n) {
  int64_t i = 0;
  for (; i + vec::kLanes <= n; i += vec::kLanes) {
    const vec::f32v gv = vec::load(g + i), dv = vec::load(d + i);
    const vec::f32v s = sigmoid(gv);
    vec::store(du + i, dv * gv * s);
    vec::store(dg + i, dv * vec::load(u + i) * s * (1.0f + gv * (1.0f - s)));
  }
  for (; i < n; ++i) {
    const float s = 1.0f / (1.0f + vec::exp_scalar(-g[i]));
    du[i] = d[i] * g[i] * s;
    dg[i] = d[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
  }
}

void expect_float(const char* kernel, const NDArray& a) {
  HSPMD_CHECK(a.dtype() == DType::F32 || a.dtype() == DType::BF16, kernel, ": expected f32 or bf16, got ",
              dtype_name(a.dtype()));
}

}  // namespace

// Every array f32 or bf16 (computed in f32 either way), contiguous.
void swiglu(const NDArray& gate, const NDArray& up, NDArray& out) {
  require_contiguous("swiglu", gate);
  require_contiguous("swiglu", up);
  const int64_t n = gate.numel();
  HSPMD_CHECK(up.numel() == n && out.numel() == n, "swiglu: sizes");
  for (const NDArray* a : {&gate, &up, static_cast<const NDArray*>(&out)}) expect_float("swiglu", *a);
  for_blocks(n, [&](int64_t begin, int64_t end) {
    alignas(64) float gb[kBlock], ub[kBlock], yb[kBlock];
    const int64_t m = end - begin;
    float* y = f32_target(out, begin, yb);
    swiglu_block(f32_block(gate, begin, m, gb), f32_block(up, begin, m, ub), y, m);
    store_block(out, begin, m, y);
  });
}

void swiglu_backward(const NDArray& dy, const NDArray& gate, const NDArray& up, NDArray& dgate,
                     NDArray& dup, NDArray* out) {
  require_contiguous("swiglu_backward", dy);
  const int64_t n = gate.numel();
  HSPMD_CHECK(dy.numel() == n && up.numel() == n && dgate.numel() == n && dup.numel() == n,
              "swiglu_backward: sizes");
  for (const NDArray* a : {&dy, &gate, &up, static_cast<const NDArray*>(&dgate),
                           static_cast<const NDArray*>(&dup)})
    expect_float("swiglu_backward", *a);
  if (out != nullptr) expect_float("swiglu_backward", *out);
  for_blocks(n, [&](int64_t begin, int64_t end) {
    alignas(64) float db[kBlock], gb[kBlock], ub[kBlock], dgb[kBlock], dub[kBlock], yb[kBlock];
    const int64_t m = end - begin;
    float* dg = f32_target(dgate, begin, dgb);
    float* du = f32_target(dup, begin, dub);
    const float* g = f32_block(gate, begin, m, gb);
    const float* u = f32_block(up, begin, m, ub);
    swiglu_backward_block(f32_block(dy, begin, m, db), g, u, dg, du, m);
    store_block(dgate, begin, m, dg);
    store_block(dup, begin, m, du);
    if (out != nullptr) {  // the forward's blocks and code: swiglu's bits
      float* y = f32_target(*out, begin, yb);
      swiglu_block(g, u, y, m);
      store_block(*out, begin, m, y);
    }
  });
}

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT
