// Seeded, reproducible random numbers.
//
// Rng is a counter-based generator (SplitMix64 over a 64-bit state): the same
// seed gives the same stream on every machine and build. Parameter
// initialization seeds one stream per tensor from (seed, tensor name), so a
// tensor's initial values never depend on the plan or the creation order.
#pragma once

#include <cstdint>
#include <string_view>

#include "hspmd/core/ndarray.h"

namespace hspmd {

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}

  uint64_t next_u64();
  // Uniform in [0, 1).
  double uniform();
  // Standard normal (Box–Muller; both values of a pair are used).
  double normal();

 private:
  uint64_t state_;
  bool has_spare_ = false;
  double spare_ = 0.0;
};

// Stable 64-bit hash of a string (FNV-1a), used to derive per-tensor streams.
uint64_t hash_name(std::string_view name);

// Seed of the stream of tensor `name` under global seed `seed`.
uint64_t tensor_seed(uint64_t seed, std::string_view name);

// Fills a contiguous f32 array with N(0, std^2) from the stream of (seed, name).
void fill_normal(NDArray& array, uint64_t seed, std::string_view name, float std);

}  // namespace hspmd
