// SwiGLU on CPU: silu(gate) * up and its fused backward.
#include <cmath>

#include "hspmd/core/error.h"
#include "kernels/basic.h"
#include "kernels/kernels.h"

namespace hspmd::kernels {

namespace {

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

}  // namespace

void swiglu(const NDArray& gate, const NDArray& up, NDArray& out) {
  require_backend("swiglu", gate);
  require_backend("swiglu", up);
  const int64_t n = gate.numel();
  HSPMD_CHECK(up.numel() == n && out.numel() == n, "swiglu: sizes");
  const float* g = gate.data<float>();
  const float* u = up.data<float>();
  float* y = out.data<float>();
#pragma omp parallel for schedule(static) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) y[i] = g[i] * sigmoid(g[i]) * u[i];
}

void swiglu_backward(const NDArray& dy, const NDArray& gate, const NDArray& up, NDArray& dgate,
                     NDArray& dup) {
  require_backend("swiglu_backward", dy);
  const int64_t n = gate.numel();
  HSPMD_CHECK(dy.numel() == n && up.numel() == n && dgate.numel() == n && dup.numel() == n,
              "swiglu_backward: sizes");
  const float* d = dy.data<float>();
  const float* g = gate.data<float>();
  const float* u = up.data<float>();
  float* dg = dgate.data<float>();
  float* du = dup.data<float>();
  // silu'(x) = s * (1 + x * (1 - s)) with s = sigmoid(x).
#pragma omp parallel for schedule(static) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid(g[i]);
    du[i] = d[i] * g[i] * s;
    dg[i] = d[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
  }
}

}  // namespace hspmd::kernels
