#include "hspmd/core/rng.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "hspmd/core/error.h"

namespace hspmd {

uint64_t Rng::next_u64() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

double Rng::uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

double Rng::normal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  double u1 = 0.0;
  while (u1 <= 0.0) u1 = uniform();
  double u2 = uniform();
  double r = std::sqrt(-2.0 * std::log(u1));
  spare_ = r * std::sin(2.0 * M_PI * u2);
  has_spare_ = true;
  return r * std::cos(2.0 * M_PI * u2);
}

uint64_t hash_name(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

uint64_t tensor_seed(uint64_t seed, std::string_view name) {
  Rng mix(seed ^ hash_name(name));
  return mix.next_u64();
}

namespace {

constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ULL;  // SplitMix64's increment per draw

uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The stream of Rng(state) draws mix(state + (k + 1) * gamma) as its k-th
// number, so normal() pair j (elements 2j and 2j + 1: the cosine, then the
// spare sine) takes draws 2j and 2j + 1, as long as no u1 before it was
// rejected (u1 == 0: the top 53 bits of a draw all zero, odds 2^-53). Fills
// pairs [first, last) with the values the sequential loop below writes;
// false, leaving the rest, at a pair whose u1 would be rejected (the
// sequential loop's draws shift from there).
bool fill_normal_pairs(float* p, int64_t n, uint64_t state, float std, int64_t first, int64_t last) {
  for (int64_t j = first; j < last; ++j) {
    const uint64_t k = static_cast<uint64_t>(2 * j);
    const double u1 = static_cast<double>(mix(state + (k + 1) * kGamma) >> 11) * 0x1.0p-53;
    const double u2 = static_cast<double>(mix(state + (k + 2) * kGamma) >> 11) * 0x1.0p-53;
    if (u1 <= 0.0) return false;
    const double r = std::sqrt(-2.0 * std::log(u1));
    p[2 * j] = static_cast<float>(r * std::cos(2.0 * M_PI * u2) * std);
    if (2 * j + 1 < n) p[2 * j + 1] = static_cast<float>(r * std::sin(2.0 * M_PI * u2) * std);
  }
  return true;
}

// Pairs per thread below which one thread fills the array (2 Mi elements).
constexpr int64_t kPairsPerThread = int64_t{1} << 20;

}  // namespace

void fill_normal(NDArray& array, uint64_t seed, std::string_view name, float std) {
  HSPMD_CHECK(array.dtype() == DType::F32 && array.is_contiguous());
  const uint64_t state = tensor_seed(seed, name);
  float* p = array.host_data<float>("fill_normal");
  const int64_t n = array.numel(), pairs = (n + 1) / 2;
  // A model's matrices (hundreds of millions of elements at 1B parameters)
  // are filled by the machine's cores, each a range of pairs; the values are
  // the one stream's, so the same on any thread count.
  const int64_t threads =
      std::clamp<int64_t>(pairs / kPairsPerThread, 1, std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<bool> rejected{false};
  auto run = [&](int64_t t) {
    if (!fill_normal_pairs(p, n, state, std, pairs * t / threads, pairs * (t + 1) / threads)) rejected = true;
  };
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t) workers.emplace_back(run, t);
  run(0);
  for (std::thread& w : workers) w.join();
  if (!rejected) return;
  Rng rng(state);  // a rejected u1 somewhere: the stream as Rng::normal draws it
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(rng.normal() * std);
}

}  // namespace hspmd
