// Helpers of the CUDA backend's conformance programs (conformance_*.cc):
// one RESULT line per case, random inputs, host <-> device moves and the
// comparisons every case uses.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <random>
#include <string>
#include <vector>

#include "hspmd/core/device.h"
#include "hspmd/core/ndarray.h"
#include "kernels/memory.h"

namespace hspmd::conformance {

// The program's name on its RESULT lines, and its failed cases so far.
inline const char* program = "conformance";
inline int failures = 0;

//   RESULT probe=<program> case=<name> <detail> status=PASS|FAIL
inline void result(const std::string& name, bool ok, const std::string& detail = "") {
  std::printf("RESULT probe=%s case=%s %s status=%s\n", program, name.c_str(), detail.c_str(), ok ? "PASS" : "FAIL");
  std::fflush(stdout);
  if (!ok) ++failures;
}

// The device under test: cuda:0, or where a program offers it (conformance_memory
// --device cpu:1) the device test double cpu:1 (docs/cuda.md), whose arrays
// the CPU's kernels compute: the harness itself then runs on any machine, and
// every comparison must come out exact.
inline Device device_under_test = Device::cuda(0);

inline Stream& cpu() { return default_stream(Device::cpu()); }
inline Stream& gpu() { return default_stream(device_under_test); }

inline NDArray random_f32(const Shape& shape, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> v(shape_numel(shape));
  for (float& x : v) x = n(rng);
  return NDArray::from_vector(shape, v);
}

inline NDArray up(const NDArray& host) { return kernels::to_device(gpu(), host); }
inline NDArray down(const NDArray& dev) { return kernels::to_host(gpu(), dev); }
inline NDArray dev_empty(const Shape& shape, DType t = DType::F32) { return NDArray::empty(shape, t, device_under_test); }

// Largest |a - b| over the elements (as f32), or inf when the shapes differ.
inline double max_diff(const NDArray& a, const NDArray& b) {
  if (a.shape() != b.shape()) return INFINITY;
  const std::vector<float> x = a.to_vector(), y = b.to_vector();
  double d = 0;
  for (size_t i = 0; i < x.size(); ++i) d = std::max(d, static_cast<double>(std::fabs(x[i] - y[i])));
  return d;
}

// max_diff relative to the largest |b| (at least 1).
inline double rel_diff(const NDArray& a, const NDArray& b) {
  const std::vector<float> y = b.to_vector();
  double m = 1;
  for (float v : y) m = std::max(m, static_cast<double>(std::fabs(v)));
  return max_diff(a, b) / m;
}

// Runs one case; an exception fails it with its message.
template <typename F>
void run_case(const std::string& name, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    result(name, false, std::string("error=\"") + e.what() + "\"");
  }
}

}  // namespace hspmd::conformance
