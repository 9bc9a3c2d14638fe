// GEMM peak of kernels::matmul's backends at the reference model's shapes
// (tokens 2048, hidden 256, kv dim 128, FFN 688, vocab 4096: forward, the
// transposed-weight form and the weight gradients) and at 1024^3.
//
// For every shape it times each backend `--reps` times after warm-up (each
// backend alone; `--interleave 1`: the backends alternating call by call, as
// when a program mixes them) and prints one JSON line with the median GFLOP/s
// (2*M*N*K / time):
//   fp32_openblas   F32 operands, cblas_sgemm
//   fp32_onednn     F32 operands, oneDNN f32 matmul
//   bf16_onednn     BF16 operands -> F32 out, oneDNN bf16 (native bf16 only)
//   bf16_onednn_f32in  F32 operands with GemmCompute::kBF16 (rounding included)
//   bf16_emulated   BF16 operands -> F32 out, rounded values through sgemm
// bench/gemm_bench.py runs it per thread count and writes the tables.
//
// usage: gemm_bench [--threads 1] [--reps 15] [--warmup 3] [--shapes model|all]
//                   [--interleave 0|1]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "hspmd/core/error.h"
#include "hspmd/core/rng.h"
#include "hspmd/core/threads.h"
#include "kernels/basic.h"

using namespace hspmd;
using kernels::GemmCompute;
using kernels::GemmF32Backend;

namespace {

// The stream the kernels here run on.
Stream& cpu_stream() { return default_stream(Device::cpu()); }

struct Shape3 {
  std::string name;
  int64_t m, n, k;
  bool ta, tb;
};

std::vector<Shape3> model_shapes() {
  const int64_t T = 2048, H = 256, KV = 128, F = 688, V = 4096;
  std::vector<Shape3> s;
  // Forward / input gradients: [T, K] · [K, N].
  const std::vector<std::pair<int64_t, int64_t>> kn = {{H, H}, {H, KV}, {H, F}, {F, H}, {H, V}};
  for (auto [k, n] : kn)
    s.push_back({"x[" + std::to_string(T) + "x" + std::to_string(k) + "]·W[" + std::to_string(k) +
                     "x" + std::to_string(n) + "]",
                 T, n, k, false, false});
  // The same with W stored [N, K] (linear: x · W^T).
  for (auto [k, n] : kn)
    s.push_back({"x·W^T, W[" + std::to_string(n) + "x" + std::to_string(k) + "]", T, n, k, false,
                 true});
  // Weight gradients: x^T [K, T] · dy [T, N].
  for (auto [k, n] : kn)
    s.push_back({"dW=x^T[" + std::to_string(k) + "x" + std::to_string(T) + "]·dy[" +
                     std::to_string(T) + "x" + std::to_string(n) + "]",
                 k, n, T, true, false});
  s.push_back({"1024^3", 1024, 1024, 1024, false, false});
  return s;
}

NDArray random_array(const std::vector<int64_t>& shape, uint64_t seed) {
  Rng rng(seed);
  NDArray x = NDArray::empty(shape, DType::F32);
  float* p = x.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) p[i] = static_cast<float>(2.0 * rng.uniform() - 1.0);
  return x;
}

double seconds(const std::function<void()>& f) {
  auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Median seconds of each function over `reps` calls. Blocks (the default):
// each function alone, after warm-up calls lasting at least 0.3 s, which
// also outlasts the spinning of OpenBLAS's idle threads (pthreads; they spin
// ~0.1 s after a call and take the core from oneDNN's OpenMP threads, the
// interleaved mode shows it). Interleaved: the calls alternate round by round.
std::vector<double> median_seconds(int warmup, int reps, bool interleaved,
                                   const std::vector<std::function<void()>>& fs) {
  auto warm = [&](const std::function<void()>& f) {
    double spent = 0;
    for (int i = 0; i < warmup || spent < 0.3; ++i) spent += seconds(f);
  };
  std::vector<std::vector<double>> t(fs.size());
  if (interleaved) {
    for (const auto& f : fs) warm(f);
    for (int r = 0; r < reps; ++r)
      for (size_t i = 0; i < fs.size(); ++i) t[i].push_back(seconds(fs[i]));
  } else {
    for (size_t i = 0; i < fs.size(); ++i) {
      warm(fs[i]);
      for (int r = 0; r < reps; ++r) t[i].push_back(seconds(fs[i]));
    }
  }
  std::vector<double> med;
  for (auto& v : t) {
    std::sort(v.begin(), v.end());
    med.push_back(v[v.size() / 2]);
  }
  return med;
}

}  // namespace

int main(int argc, char** argv) {
  ensure_passive_omp_wait(argv);
  int threads = 1, reps = 15, warmup = 3;
  std::string shapes = "all";
  bool interleaved = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--threads") threads = std::stoi(v);
    else if (k == "--reps") reps = std::stoi(v);
    else if (k == "--warmup") warmup = std::stoi(v);
    else if (k == "--shapes") shapes = v;
    else if (k == "--interleave") interleaved = v == "1";
    else fail("[gemm_bench] unknown flag ", k);
  }
  set_num_threads(threads);
  std::vector<Shape3> list = model_shapes();
  if (shapes == "model") list.pop_back();
  const bool have_dnnl = kernels::set_f32_gemm_backend(GemmF32Backend::kOneDNN);
  kernels::set_f32_gemm_backend(GemmF32Backend::kOpenBLAS);
  std::printf("{\"info\": true, \"threads\": %d, \"interleaved\": %s, \"backends\": \"%s\", "
              "\"bf16_native\": %s, \"onednn\": %s}\n",
              threads, interleaved ? "true" : "false", kernels::gemm_isa_description().c_str(),
              kernels::bf16_gemm_native() ? "true" : "false", have_dnnl ? "true" : "false");
  uint64_t seed = 1;
  for (const Shape3& s : list) {
    NDArray a = random_array(s.ta ? std::vector<int64_t>{s.k, s.m} : std::vector<int64_t>{s.m, s.k},
                             seed++);
    NDArray b = random_array(s.tb ? std::vector<int64_t>{s.n, s.k} : std::vector<int64_t>{s.k, s.n},
                             seed++);
    NDArray a16 = a.to(DType::BF16), b16 = b.to(DType::BF16);
    NDArray out = NDArray::empty({s.m, s.n}, DType::F32);
    const double flop = 2.0 * static_cast<double>(s.m) * s.n * s.k;
    std::string line = "{\"shape\": \"" + s.name + "\", \"m\": " + std::to_string(s.m) +
                       ", \"n\": " + std::to_string(s.n) + ", \"k\": " + std::to_string(s.k) +
                       ", \"trans_a\": " + (s.ta ? "true" : "false") +
                       ", \"trans_b\": " + (s.tb ? "true" : "false") +
                       ", \"threads\": " + std::to_string(threads);
    auto add = [&](const char* key, double v) {
      char buf[64];
      std::snprintf(buf, sizeof buf, ", \"%s\": %.1f", key, v);
      line += buf;
    };
    // Each case sets the backend it measures before its call.
    std::vector<std::pair<const char*, std::function<void()>>> cases;
    cases.push_back({"fp32_openblas", [&] {
                       kernels::set_f32_gemm_backend(GemmF32Backend::kOpenBLAS);
                       kernels::matmul(cpu_stream(), a, b, s.ta, s.tb, out);
                     }});
    if (have_dnnl)
      cases.push_back({"fp32_onednn", [&] {
                         kernels::set_f32_gemm_backend(GemmF32Backend::kOneDNN);
                         kernels::matmul(cpu_stream(), a, b, s.ta, s.tb, out);
                       }});
    if (kernels::bf16_gemm_native()) {
      cases.push_back({"bf16_onednn", [&] {
                         kernels::set_bf16_gemm_emulation(false);
                         kernels::matmul(cpu_stream(), a16, b16, s.ta, s.tb, out);
                       }});
      cases.push_back({"bf16_onednn_f32in", [&] {
                         kernels::set_bf16_gemm_emulation(false);
                         kernels::matmul(cpu_stream(), a, b, s.ta, s.tb, out, GemmCompute::kBF16);
                       }});
    }
    cases.push_back({"bf16_emulated", [&] {
                       kernels::set_bf16_gemm_emulation(true);
                       kernels::matmul(cpu_stream(), a16, b16, s.ta, s.tb, out);
                     }});
    std::vector<std::function<void()>> fs;
    for (auto& c : cases) fs.push_back(c.second);
    const std::vector<double> med = median_seconds(warmup, reps, interleaved, fs);
    for (size_t i = 0; i < cases.size(); ++i) add(cases[i].first, flop / med[i] / 1e9);
    kernels::set_f32_gemm_backend(GemmF32Backend::kOpenBLAS);
    kernels::set_bf16_gemm_emulation(false);
    std::printf("%s}\n", line.c_str());
    std::fflush(stdout);
  }
  return 0;
}
