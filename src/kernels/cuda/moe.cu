// CUDA kernels of the mixture-of-experts layers (basic.h contracts, f32):
// the router (one thread per token row: experts are few), the weighted
// combination of expert rows and its gradient, the shared expert's sigmoid
// gate. Sums run in double in a fixed order (block_sum's tree for the dot
// products), so results do not depend on the launch. The row indices are
// made by the ops from the router's own indices (src/ops/moe.cc) and are
// not checked here.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "hspmd/core/error.h"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/launch.cuh"

namespace hspmd::kernels::cuda {

namespace {

using namespace launch;

constexpr int kMaxExperts = 1024;  // the selection's taken-mask bits per thread

__global__ void route_kernel(const float* logits, int64_t T, int64_t E, int64_t k, bool normalize, float* w,
                             int32_t* idx, float* p) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < T;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float* row = logits + t * E;
    float* prow = p + t * E;
    double m = -INFINITY;
    for (int64_t e = 0; e < E; ++e) m = fmax(m, static_cast<double>(row[e]));
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += exp(static_cast<double>(row[e]) - m);
    for (int64_t e = 0; e < E; ++e) prow[e] = static_cast<float>(exp(static_cast<double>(row[e]) - m) / sum);
    unsigned taken[kMaxExperts / 32] = {};
    double picked = 0;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!(taken[e / 32] >> (e % 32) & 1u) && (best < 0 || prow[e] > prow[best])) best = e;
      taken[best / 32] |= 1u << (best % 32);
      idx[t * k + j] = static_cast<int32_t>(best);
      w[t * k + j] = prow[best];
      picked += prow[best];
    }
    if (normalize)
      for (int64_t j = 0; j < k; ++j) w[t * k + j] = static_cast<float>(w[t * k + j] / picked);
  }
}

// One block per token row: dp in shared memory (E doubles).
__global__ void route_backward_kernel(const float* p, const int32_t* idx, const float* dw, const float* dp_in,
                                      int64_t E, int64_t k, bool normalize, float* dl) {
  extern __shared__ double shared[];
  double* dp = shared;           // E
  double* scratch = shared + E;  // blockDim.x
  const int64_t t = blockIdx.x;
  const float* prow = p + t * E;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) dp[e] = dp_in != nullptr ? dp_in[t * E + e] : 0.0;
  __syncthreads();
  if (threadIdx.x == 0) {
    double picked = 0, dot = 0;
    for (int64_t j = 0; j < k; ++j) picked += prow[idx[t * k + j]];
    if (normalize)
      for (int64_t j = 0; j < k; ++j) dot += static_cast<double>(dw[t * k + j]) * (prow[idx[t * k + j]] / picked);
    for (int64_t j = 0; j < k; ++j) {
      const double g = dw[t * k + j];
      dp[idx[t * k + j]] += normalize ? (g - dot) / picked : g;
    }
  }
  __syncthreads();
  double part = 0;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) part += prow[e] * dp[e];
  const double inner = block_sum(part, scratch);
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) dl[t * E + e] = static_cast<float>(prow[e] * (dp[e] - inner));
}

__global__ void combine_kernel(const float* in, const int32_t* rows, const float* w, int64_t T, int64_t k, int64_t H,
                               float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < T * H;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / H, h = i % H;
    double acc = 0;
    for (int64_t j = 0; j < k; ++j)
      acc += (w != nullptr ? static_cast<double>(w[t * k + j]) : 1.0) * in[rows[t * k + j] * H + h];
    out[i] = static_cast<float>(acc);
  }
}

// One block per (token, slot): the scaled rows and, with `in`, the dot product.
__global__ void combine_backward_kernel(const float* g, const float* in, const int32_t* rows, const float* w,
                                        int64_t k, int64_t H, float* d, float* dw) {
  __shared__ double scratch[kThreads];
  const int64_t tj = blockIdx.x, t = tj / k, row = rows[tj];
  const float scale = w != nullptr ? w[tj] : 1.0f;
  double part = 0;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    d[row * H + h] = scale * g[t * H + h];
    if (in != nullptr) part += static_cast<double>(g[t * H + h]) * in[row * H + h];
  }
  if (dw == nullptr) return;
  const double dot = block_sum(part, scratch);
  if (threadIdx.x == 0) dw[tj] = static_cast<float>(dot);
}

__global__ void sigmoid_gate_kernel(const float* x, const float* gate, int64_t T, int64_t H, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < T * H;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float s = static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(gate[i / H]))));
    out[i] = s * x[i];
  }
}

__global__ void sigmoid_gate_backward_kernel(const float* g, const float* x, const float* gate, int64_t H, float* dx,
                                             float* dgate) {
  __shared__ double scratch[kThreads];
  const int64_t t = blockIdx.x;
  const double s = 1.0 / (1.0 + exp(-static_cast<double>(gate[t])));
  double part = 0;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    dx[t * H + h] = static_cast<float>(s) * g[t * H + h];
    part += static_cast<double>(g[t * H + h]) * x[t * H + h];
  }
  const double dot = block_sum(part, scratch);
  if (threadIdx.x == 0) dgate[t] = static_cast<float>(dot * s * (1 - s));
}

void check_f32(const char* kernel, const NDArray& a) {
  require_contiguous(kernel, a);
  HSPMD_CHECK(a.dtype() == DType::F32, kernel, ": f32 arrays only, got ", dtype_name(a.dtype()));
}

int64_t rows_of(const NDArray& a, int64_t last) { return last > 0 ? a.numel() / last : 0; }

}  // namespace

void moe_route(Stream& s, const NDArray& logits, int64_t top_k, bool normalize, NDArray& weights, NDArray& indices,
               NDArray& probs) {
  check_f32("moe_route", logits);
  const int64_t E = logits.dim(-1), T = rows_of(logits, E);
  HSPMD_CHECK(top_k >= 1 && top_k <= E, "moe_route: top_k ", top_k, " outside [1, ", E, "]");
  HSPMD_CHECK(E <= kMaxExperts, "moe_route: at most ", kMaxExperts, " experts on CUDA, got ", E);
  if (T == 0) return;
  route_kernel<<<blocks_for(T), kThreads, 0, native(s)>>>(logits.data<float>(), T, E, top_k, normalize,
                                                          weights.data<float>(), indices.data<int32_t>(),
                                                          probs.data<float>());
  launched("moe_route");
}

void moe_route_backward(Stream& s, const NDArray& probs, const NDArray& indices, const NDArray& dweights,
                        const NDArray* dprobs, bool normalize, NDArray& dlogits) {
  check_f32("moe_route_backward", probs);
  const int64_t E = probs.dim(-1), T = rows_of(probs, E), k = indices.dim(-1);
  if (T == 0) return;
  const size_t shared = static_cast<size_t>(E + kThreads) * sizeof(double);
  route_backward_kernel<<<static_cast<unsigned>(T), kThreads, shared, native(s)>>>(
      probs.data<float>(), indices.data<int32_t>(), dweights.data<float>(),
      dprobs != nullptr ? dprobs->data<float>() : nullptr, E, k, normalize, dlogits.data<float>());
  launched("moe_route_backward");
}

void moe_combine(Stream& s, const NDArray& rows_in, const NDArray& rows, const NDArray* weights, NDArray& y) {
  check_f32("moe_combine", rows_in);
  const int64_t H = rows_in.dim(-1), k = rows.dim(-1), T = rows_of(rows, k);
  if (T * H == 0) return;
  combine_kernel<<<blocks_for(T * H), kThreads, 0, native(s)>>>(
      rows_in.data<float>(), rows.data<int32_t>(), weights != nullptr ? weights->data<float>() : nullptr, T, k, H,
      y.data<float>());
  launched("moe_combine");
}

void moe_combine_backward(Stream& s, const NDArray& dy, const NDArray& rows_in, const NDArray& rows,
                          const NDArray* weights, NDArray& drows_in, NDArray* dweights) {
  check_f32("moe_combine_backward", dy);
  const int64_t H = dy.dim(-1), k = rows.dim(-1), T = rows_of(rows, k);
  cuda_rt::check(cudaMemsetAsync(drows_in.raw_data(), 0, drows_in.nbytes(), native(s)), "moe_combine_backward");
  if (T * k == 0) return;
  combine_backward_kernel<<<static_cast<unsigned>(T * k), kThreads, 0, native(s)>>>(
      dy.data<float>(), dweights != nullptr ? rows_in.data<float>() : nullptr, rows.data<int32_t>(),
      weights != nullptr ? weights->data<float>() : nullptr, k, H, drows_in.data<float>(),
      dweights != nullptr ? dweights->data<float>() : nullptr);
  launched("moe_combine_backward");
}

void sigmoid_gate(Stream& s, const NDArray& x, const NDArray& gate, NDArray& out) {
  check_f32("sigmoid_gate", x);
  const int64_t T = gate.numel(), H = T > 0 ? x.numel() / T : 0;
  if (T * H == 0) return;
  sigmoid_gate_kernel<<<blocks_for(T * H), kThreads, 0, native(s)>>>(x.data<float>(), gate.data<float>(), T, H,
                                                                     out.data<float>());
  launched("sigmoid_gate");
}

void sigmoid_gate_backward(Stream& s, const NDArray& dy, const NDArray& x, const NDArray& gate, NDArray& dx,
                           NDArray& dgate) {
  check_f32("sigmoid_gate_backward", dy);
  const int64_t T = gate.numel(), H = T > 0 ? x.numel() / T : 0;
  if (T == 0) return;
  sigmoid_gate_backward_kernel<<<static_cast<unsigned>(T), kThreads, 0, native(s)>>>(
      dy.data<float>(), x.data<float>(), gate.data<float>(), H, dx.data<float>(), dgate.data<float>());
  launched("sigmoid_gate_backward");
}

}  // namespace hspmd::kernels::cuda
