// Shared helpers of the GPU probes (tests/gpu/probe_*.cu): error checks that
// name the failing call, the skip rule (exit 77 without a CUDA device), bf16
// rounding, device-side random fills, relative errors against float64
// references, and cudaEvent timing with the median over many repeats.
//
// Every result is one machine-readable line:
//   RESULT probe=<p> case=<c> <key=value>... status=PASS|FAIL|UNSUPPORTED|INFO
// scripts/gpu_check.sh collects these lines into its summary.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace probe {

inline const char*& probe_name() {
  static const char* name = "unknown";
  return name;
}
inline int& failures() {
  static int n = 0;
  return n;
}

// A failed call that leaves the probe unable to go on: one FAIL line, exit 1.
[[noreturn]] inline void fatal(const char* what, const char* detail, const char* file, int line) {
  std::printf("RESULT probe=%s case=fatal call=\"%s\" error=\"%s\" at=%s:%d status=FAIL\n",
              probe_name(), what, detail, file, line);
  std::fflush(stdout);
  std::exit(1);
}

#define PROBE_CUDA(call)                                                           \
  do {                                                                             \
    cudaError_t e_ = (call);                                                       \
    if (e_ != cudaSuccess) ::probe::fatal(#call, cudaGetErrorString(e_), __FILE__, __LINE__); \
  } while (0)

// After every kernel launch: launch errors now, execution errors at the next
// synchronizing call (also checked).
#define PROBE_LAUNCH(what)                                                         \
  do {                                                                             \
    cudaError_t e_ = cudaGetLastError();                                           \
    if (e_ != cudaSuccess) ::probe::fatal(what, cudaGetErrorString(e_), __FILE__, __LINE__); \
  } while (0)

// Exit 77 (CTest SKIP_RETURN_CODE) when there is no usable CUDA device, then
// print the device, driver and runtime versions.
inline void require_device(const char* name) {
  probe_name() = name;
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    std::printf("SKIP probe=%s reason=\"no CUDA device (%s)\"\n", name,
                e != cudaSuccess ? cudaGetErrorString(e) : "count 0");
    std::fflush(stdout);
    std::exit(77);
  }
  PROBE_CUDA(cudaSetDevice(0));
  cudaDeviceProp p{};
  PROBE_CUDA(cudaGetDeviceProperties(&p, 0));
  int drv = 0, rt = 0;
  PROBE_CUDA(cudaDriverGetVersion(&drv));
  PROBE_CUDA(cudaRuntimeGetVersion(&rt));
  std::printf("INFO probe=%s device=\"%s\" cc=%d.%d sms=%d mem_gib=%.1f driver_cuda=%d runtime=%d\n",
              name, p.name, p.major, p.minor, p.multiProcessorCount,
              p.totalGlobalMem / 1073741824.0, drv, rt);
}

// One RESULT line. fields: "key=value ..." (already formatted).
inline void result(const char* case_name, const char* status, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (std::strcmp(status, "FAIL") == 0) ++failures();
  std::printf("RESULT probe=%s case=%s %s status=%s\n", probe_name(), case_name, buf, status);
  std::fflush(stdout);
}

inline int exit_code() { return failures() ? 1 : 0; }

// ---------------------------------------------------------------- bf16 --
// Round-to-nearest-even float -> bf16 bits, the same on host and device.
__host__ __device__ inline uint16_t f2bf_bits(float f) {
#ifdef __CUDA_ARCH__
  uint32_t u = __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
#endif
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
__host__ __device__ inline float bf_bits2f(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
inline float bf16_to_float(__nv_bfloat16 x) {
  return bf_bits2f(static_cast<__nv_bfloat16_raw>(x).x);
}
inline __nv_bfloat16 float_to_bf16(float f) {
  __nv_bfloat16_raw r;
  r.x = f2bf_bits(f);
  return __nv_bfloat16(r);
}

// ------------------------------------------------------- random fills --
// Hash-based, so a fill is one kernel and any element can be recomputed.
// Values are non-zero: sign * (0.05 + 0.95 u) * scale, u in [0, 1).
__host__ __device__ inline float hash_value(uint64_t seed, uint64_t i, float scale) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  float u = static_cast<float>((z >> 40) & 0xFFFFFF) * (1.0f / 16777216.0f);
  float s = (z & 1) ? -1.0f : 1.0f;
  return s * (0.05f + 0.95f * u) * scale;
}

__global__ void fill_bf16_kernel(__nv_bfloat16* p, size_t n, uint64_t seed, float scale) {
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (; i < n; i += stride) {
    __nv_bfloat16_raw r;
    r.x = f2bf_bits(hash_value(seed, i, scale));
    p[i] = r;
  }
}
__global__ void fill_f32_kernel(float* p, size_t n, uint64_t seed, float scale) {
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (; i < n; i += stride) p[i] = hash_value(seed, i, scale);
}
inline void fill(__nv_bfloat16* p, size_t n, uint64_t seed, float scale, cudaStream_t s = 0) {
  fill_bf16_kernel<<<1024, 256, 0, s>>>(p, n, seed, scale);
  PROBE_LAUNCH("fill_bf16_kernel");
}
inline void fill(float* p, size_t n, uint64_t seed, float scale, cudaStream_t s = 0) {
  fill_f32_kernel<<<1024, 256, 0, s>>>(p, n, seed, scale);
  PROBE_LAUNCH("fill_f32_kernel");
}

// Poison an output: all bytes 0xFF is NaN in bf16 and fp32, so an element the
// call under test does not write fails the comparison.
inline void poison(void* p, size_t bytes, cudaStream_t s = 0) {
  PROBE_CUDA(cudaMemsetAsync(p, 0xFF, bytes, s));
}

// Device buffer -> host doubles.
inline std::vector<double> to_host(const __nv_bfloat16* d, size_t n) {
  std::vector<__nv_bfloat16> h(n);
  PROBE_CUDA(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
  std::vector<double> r(n);
  for (size_t i = 0; i < n; ++i) r[i] = bf16_to_float(h[i]);
  return r;
}
inline std::vector<double> to_host(const float* d, size_t n) {
  std::vector<float> h(n);
  PROBE_CUDA(cudaMemcpy(h.data(), d, n * 4, cudaMemcpyDeviceToHost));
  return std::vector<double>(h.begin(), h.end());
}

// ||out - ref|| / ||ref||; +inf when out holds a NaN/Inf or sizes differ (NaN
// never passes: every comparison is written as err <= bound).
inline double rel_err(const std::vector<double>& out, const std::vector<double>& ref) {
  if (out.size() != ref.size() || ref.empty()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    double d = out[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}
inline bool within(double err, double bound) { return err <= bound; }  // false for NaN

// --------------------------------------------------------------- GELU --
inline double gelu_tanh(double x) {
  const double c = 0.7978845608028654;  // sqrt(2/pi)
  return 0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x)));
}
inline double gelu_erf(double x) { return 0.5 * x * (1.0 + std::erf(x * 0.7071067811865476)); }
inline double dgelu_tanh(double x) {
  const double c = 0.7978845608028654;
  double t = std::tanh(c * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
}
inline double dgelu_erf(double x) {
  return 0.5 * (1.0 + std::erf(x * 0.7071067811865476)) +
         x * 0.3989422804014327 * std::exp(-0.5 * x * x);
}

// ------------------------------------------------------------- timing --
// Median milliseconds of fn() over reps runs after warmup runs, each run
// bracketed by its own pair of events on stream s.
template <class F>
double median_ms(cudaStream_t s, int warmup, int reps, F&& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) PROBE_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    PROBE_CUDA(cudaEventRecord(ev[2 * i], s));
    fn();
    PROBE_CUDA(cudaEventRecord(ev[2 * i + 1], s));
  }
  PROBE_CUDA(cudaStreamSynchronize(s));
  std::vector<double> t(reps);
  for (int i = 0; i < reps; ++i) {
    float ms = 0;
    PROBE_CUDA(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    t[i] = ms;
  }
  for (auto& e : ev) PROBE_CUDA(cudaEventDestroy(e));
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  return t[reps / 2];
}

inline const char* pass_fail(bool ok) { return ok ? "PASS" : "FAIL"; }

}  // namespace probe
