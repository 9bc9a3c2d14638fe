#include "hspmd/core/rng.h"

#include <cmath>

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

void fill_normal(NDArray& array, uint64_t seed, std::string_view name, float std) {
  HSPMD_CHECK(array.dtype() == DType::F32 && array.is_contiguous());
  Rng rng(tensor_seed(seed, name));
  float* p = array.host_data<float>("fill_normal");
  for (int64_t i = 0, n = array.numel(); i < n; ++i) p[i] = static_cast<float>(rng.normal() * std);
}

}  // namespace hspmd
