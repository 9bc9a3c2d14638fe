// CPU kernels of the mixture-of-experts layers (basic.h, "mixture of
// experts"): the router's softmax and top-k with its gradient, the weighted
// combination of expert rows (token permutation's inverse) with its
// gradient, and the sigmoid gate of a shared expert. Row-parallel over
// tokens with OpenMP; every sum runs in double in a fixed order, so the
// result does not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "hspmd/core/error.h"
#include "kernels/cpu/cpu.h"

namespace hspmd::kernels::cpu {

namespace {

// Rows of `a` viewed as [numel / last, last].
int64_t rows_of(const NDArray& a, int64_t last) { return last > 0 ? a.numel() / last : 0; }

void check_f32(const char* kernel, const NDArray& a) {
  require_contiguous(kernel, a);
  HSPMD_CHECK(a.dtype() == DType::F32, kernel, ": f32 arrays only, got ", dtype_name(a.dtype()));
}

}  // namespace

void moe_route(const NDArray& logits, int64_t top_k, bool normalize, NDArray& weights, NDArray& indices,
               NDArray& probs) {
  check_f32("moe_route", logits);
  const int64_t E = logits.dim(-1), T = rows_of(logits, E), k = top_k;
  HSPMD_CHECK(k >= 1 && k <= E, "moe_route: top_k ", k, " outside [1, ", E, "]");
  const float* l = logits.data<float>();
  float* w = weights.data<float>();
  int32_t* idx = indices.data<int32_t>();
  float* p = probs.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* row = l + t * E;
    float* prow = p + t * E;
    double m = -INFINITY;
    for (int64_t e = 0; e < E; ++e) m = std::max(m, static_cast<double>(row[e]));
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(row[e]) - m);
    for (int64_t e = 0; e < E; ++e) prow[e] = static_cast<float>(std::exp(static_cast<double>(row[e]) - m) / sum);
    // Top k by selection: the largest prob not yet taken, the lower index on a tie.
    std::vector<char> taken(static_cast<size_t>(E), 0);
    double picked = 0;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || prow[e] > prow[best])) best = e;
      taken[best] = 1;
      idx[t * k + j] = static_cast<int32_t>(best);
      w[t * k + j] = prow[best];
      picked += prow[best];
    }
    if (normalize)
      for (int64_t j = 0; j < k; ++j) w[t * k + j] = static_cast<float>(w[t * k + j] / picked);
  }
}

void moe_route_backward(const NDArray& probs, const NDArray& indices, const NDArray& dweights, const NDArray* dprobs,
                        bool normalize, NDArray& dlogits) {
  check_f32("moe_route_backward", probs);
  check_f32("moe_route_backward", dweights);
  const int64_t E = probs.dim(-1), T = rows_of(probs, E), k = indices.dim(-1);
  const float* p = probs.data<float>();
  const int32_t* idx = indices.data<int32_t>();
  const float* dw = dweights.data<float>();
  const float* dp_in = dprobs != nullptr ? dprobs->data<float>() : nullptr;
  float* dl = dlogits.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* prow = p + t * E;
    std::vector<double> dp(static_cast<size_t>(E), 0.0);
    if (dp_in != nullptr)
      for (int64_t e = 0; e < E; ++e) dp[e] = dp_in[t * E + e];
    double picked = 0, dot = 0;
    for (int64_t j = 0; j < k; ++j) picked += prow[idx[t * k + j]];
    // With the normalization w_j = v_j / s: dv_i = (dw_i - sum_j dw_j w_j) / s.
    if (normalize)
      for (int64_t j = 0; j < k; ++j) dot += static_cast<double>(dw[t * k + j]) * (prow[idx[t * k + j]] / picked);
    for (int64_t j = 0; j < k; ++j) {
      const double g = dw[t * k + j];
      dp[idx[t * k + j]] += normalize ? (g - dot) / picked : g;
    }
    double inner = 0;
    for (int64_t e = 0; e < E; ++e) inner += prow[e] * dp[e];
    for (int64_t e = 0; e < E; ++e) dl[t * E + e] = static_cast<float>(prow[e] * (dp[e] - inner));
  }
}

void moe_combine(const NDArray& rows_in, const NDArray& rows, const NDArray* weights, NDArray& y) {
  check_f32("moe_combine", rows_in);
  const int64_t H = rows_in.dim(-1), R = rows_of(rows_in, H), k = rows.dim(-1), T = rows_of(rows, k);
  const float* in = rows_in.data<float>();
  const int32_t* r = rows.data<int32_t>();
  const float* w = weights != nullptr ? weights->data<float>() : nullptr;
  float* out = y.data<float>();
  for (int64_t i = 0; i < T * k; ++i)
    if (r[i] < 0 || r[i] >= R) fail("[moe_combine] row ", r[i], " at position ", i, " is outside [0, ", R, ")");
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      double acc = 0;
      for (int64_t j = 0; j < k; ++j)
        acc += (w != nullptr ? static_cast<double>(w[t * k + j]) : 1.0) * in[r[t * k + j] * H + h];
      out[t * H + h] = static_cast<float>(acc);
    }
}

void moe_combine_backward(const NDArray& dy, const NDArray& rows_in, const NDArray& rows, const NDArray* weights,
                          NDArray& drows_in, NDArray* dweights) {
  check_f32("moe_combine_backward", dy);
  const int64_t H = dy.dim(-1), T = rows_of(dy, H), k = rows.dim(-1), R = rows_of(drows_in, H);
  const float* g = dy.data<float>();
  const int32_t* r = rows.data<int32_t>();
  const float* w = weights != nullptr ? weights->data<float>() : nullptr;
  const float* in = dweights != nullptr ? rows_in.data<float>() : nullptr;
  float* d = drows_in.data<float>();
  std::fill(d, d + R * H, 0.0f);
  for (int64_t i = 0; i < T * k; ++i)
    if (r[i] < 0 || r[i] >= R)
      fail("[moe_combine_backward] row ", r[i], " at position ", i, " is outside [0, ", R, ")");
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t row = r[t * k + j];
      const float scale = w != nullptr ? w[t * k + j] : 1.0f;
      double dot = 0;
      for (int64_t h = 0; h < H; ++h) {
        d[row * H + h] = scale * g[t * H + h];
        if (in != nullptr) dot += static_cast<double>(g[t * H + h]) * in[row * H + h];
      }
      if (dweights != nullptr) dweights->data<float>()[t * k + j] = static_cast<float>(dot);
    }
}

void sigmoid_gate(const NDArray& x, const NDArray& gate, NDArray& out) {
  check_f32("sigmoid_gate", x);
  check_f32("sigmoid_gate", gate);
  const int64_t T = gate.numel(), H = T > 0 ? x.numel() / T : 0;
  const float* xs = x.data<float>();
  const float* gs = gate.data<float>();
  float* o = out.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float s = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(gs[t]))));
    for (int64_t h = 0; h < H; ++h) o[t * H + h] = s * xs[t * H + h];
  }
}

void sigmoid_gate_backward(const NDArray& dy, const NDArray& x, const NDArray& gate, NDArray& dx, NDArray& dgate) {
  check_f32("sigmoid_gate_backward", dy);
  const int64_t T = gate.numel(), H = T > 0 ? x.numel() / T : 0;
  const float* g = dy.data<float>();
  const float* xs = x.data<float>();
  const float* gs = gate.data<float>();
  float* d = dx.data<float>();
  float* dg = dgate.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const double s = 1.0 / (1.0 + std::exp(-static_cast<double>(gs[t])));
    double dot = 0;
    for (int64_t h = 0; h < H; ++h) {
      d[t * H + h] = static_cast<float>(s) * g[t * H + h];
      dot += static_cast<double>(g[t * H + h]) * xs[t * H + h];
    }
    dg[t] = static_cast<float>(dot * s * (1 - s));
  }
}

}  // namespace hspmd::kernels::cpu
