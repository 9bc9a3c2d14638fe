// SwiGLU on CPU: silu(gate) * up and its fused backward.
#include <algorithm>
#include <cmath>

#include "hspmd/core/error.h"
#include "kernels/basic.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "vec_math.h"

namespace hspmd::kernels::cpu {

namespace {

constexpr int64_t kBlock = 4096;  // elements per OpenMP work item

inline vec::f32x16 sigmoid(vec::f32x16 x) { return 1.0f / (1.0f + vec::exp(-x)); }

// Runs f(begin, end) over [0, n) in blocks whose inner ranges are multiples of
// the vector width except the last.
template <typename F>
void for_blocks(int64_t n, F f) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n > 32768)
  for (int64_t b = 0; b < blocks; ++b) f(b * kBlock, std::min(n, (b + 1) * kBlock));
}

}  // namespace

void swiglu(const NDArray& gate, const NDArray& up, NDArray& out) {
  require_contiguous("swiglu", gate);
  require_contiguous("swiglu", up);
  const int64_t n = gate.numel();
  HSPMD_CHECK(up.numel() == n && out.numel() == n, "swiglu: sizes");
  const float* g = gate.data<float>();
  const float* u = up.data<float>();
  float* y = out.data<float>();
  for_blocks(n, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + vec::kLanes <= end; i += vec::kLanes) {
      const vec::f32x16 gv = vec::load(g + i);
      vec::store(y + i, gv * sigmoid(gv) * vec::load(u + i));
    }
    for (; i < end; ++i) y[i] = g[i] / (1.0f + vec::exp_scalar(-g[i])) * u[i];
  });
}

void swiglu_backward(const NDArray& dy, const NDArray& gate, const NDArray& up, NDArray& dgate,
                     NDArray& dup) {
  require_contiguous("swiglu_backward", dy);
  const int64_t n = gate.numel();
  HSPMD_CHECK(dy.numel() == n && up.numel() == n && dgate.numel() == n && dup.numel() == n,
              "swiglu_backward: sizes");
  const float* d = dy.data<float>();
  const float* g = gate.data<float>();
  const float* u = up.data<float>();
  float* dg = dgate.data<float>();
  float* du = dup.data<float>();
  // silu'(x) = s * (1 + x * (1 - s)) with s = sigmoid(x).
  for_blocks(n, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + vec::kLanes <= end; i += vec::kLanes) {
      const vec::f32x16 gv = vec::load(g + i), dv = vec::load(d + i);
      const vec::f32x16 s = sigmoid(gv);
      vec::store(du + i, dv * gv * s);
      vec::store(dg + i, dv * vec::load(u + i) * s * (1.0f + gv * (1.0f - s)));
    }
    for (; i < end; ++i) {
      const float s = 1.0f / (1.0f + vec::exp_scalar(-g[i]));
      du[i] = d[i] * g[i] * s;
      dg[i] = d[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
    }
  });
}

}  // namespace hspmd::kernels::cpu
