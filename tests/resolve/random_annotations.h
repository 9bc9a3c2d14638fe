// Random annotation pairs for the property tests (the resolver's, executed
// by the simulator, and the MPI executor's): Generator, fits, involves_partial,
// for_each_random_pair.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <string>
#include <numeric>
#include <random>

#include "hspmd/core/error.h"
#include "resolve/resolve_test_util.h"

namespace hspmd::testing {

constexpr int kWorld = 8;

inline bool involves_partial(const Annotation& a) {
  if (a.hdim == kPartial && a.hsize() > 1) return true;
  return std::any_of(a.subgroups.begin(), a.subgroups.end(), [](const Subgroup& g) { return g.states.has_partial(); });
}

class Generator {
 public:
  explicit Generator(uint64_t seed) : rng_(seed) {}

  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }

  Shape shape() {
    switch (uniform(0, 3)) {
      case 0: return {48};
      case 1: return {12, 8, 4};
      default: return {48, 16};
    }
  }

  // A random non-empty subset of the world, shuffled.
  std::vector<int> ranks(int min_size = 1) {
    std::vector<int> all(kWorld);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng_);
    all.resize(uniform(min_size, kWorld));
    return all;
  }

  DistStates states(int size, int ndim, bool partial) {
    DistStates s;
    std::vector<int> keys = {kDup};
    for (int d = 0; d < ndim; ++d) keys.push_back(d);
    if (partial) keys.push_back(kPartial);
    for (int n = size, p = 2; n > 1;) {
      if (n % p != 0) {
        ++p;
        continue;
      }
      const int key = keys[uniform(0, static_cast<int>(keys.size()) - 1)];
      s.degrees[key] = s.degree(key) * p;
      n /= p;
    }
    for (auto [k, n] : s.degrees)
      if (n > 1) s.order.push_back(k);
    std::shuffle(s.order.begin(), s.order.end(), rng_);
    return s;
  }

  // Subgroups of the given ranks cut into consecutive chunks.
  Annotation annotation(const std::vector<int>& ranks, int ndim, bool partial) {
    const int hsize = uniform(1, std::min<int>(4, static_cast<int>(ranks.size())));
    std::vector<int> cuts = {0, static_cast<int>(ranks.size())};
    while (static_cast<int>(cuts.size()) < hsize + 1) {
      const int c = uniform(1, static_cast<int>(ranks.size()) - 1);
      if (std::find(cuts.begin(), cuts.end(), c) == cuts.end()) cuts.push_back(c);
    }
    std::sort(cuts.begin(), cuts.end());
    Annotation a;
    for (int i = 0; i < hsize; ++i) {
      std::vector<int> group(ranks.begin() + cuts[i], ranks.begin() + cuts[i + 1]);
      a.subgroups.push_back(Subgroup{DeviceGroup{group}, states(static_cast<int>(group.size()), ndim, partial && chance(0.5))});
    }
    a.hdim = hdim(ndim, partial);
    if (a.hdim >= 0 && hsize > 1 && chance(0.4)) weights(a);
    return a;
  }

  int hdim(int ndim, bool partial) {
    if (partial && chance(0.3)) return kPartial;
    return uniform(-1, ndim - 1);
  }

  void weights(Annotation& a) {
    a.part_weights.clear();
    for (int i = 0; i < a.hsize(); ++i) a.part_weights.push_back(uniform(1, 3));
  }

  // Same subgroups' devices, new bottom states (case 1 or 2 depending on hdim).
  Annotation restate(const Annotation& src, int ndim, bool partial) {
    Annotation a = src;
    for (Subgroup& g : a.subgroups) {
      if (!chance(0.7)) continue;
      for (int tries = 0; tries < 4 && g.states == src.subgroups[&g - a.subgroups.data()].states; ++tries)
        g.states = states(g.devices.size(), ndim, partial && chance(0.3));
    }
    return a;
  }

  // Partial keys become a random other key of the same degree (the gradient
  // patterns: all_reduce, reduce_scatter), sometimes with a shuffled order.
  Annotation unpartial(const Annotation& src, int ndim) {
    Annotation a = src;
    for (Subgroup& g : a.subgroups) {
      const int n = g.states.degree(kPartial);
      if (n == 1) continue;
      const int key = uniform(-1, ndim - 1);
      g.states.degrees.erase(kPartial);
      g.states.degrees[key] = g.states.degree(key) * n;
      auto& order = g.states.order;
      const bool present = std::count(order.begin(), order.end(), key) > 0;
      if (present) order.erase(std::find(order.begin(), order.end(), kPartial));
      else *std::find(order.begin(), order.end(), kPartial) = key;
      if (chance(0.2)) std::shuffle(order.begin(), order.end(), rng_);
    }
    return a;
  }

  // Same states, devices renamed by a random permutation of the world.
  Annotation move(const Annotation& src) {
    std::vector<int> perm(kWorld);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng_);
    Annotation a = src;
    for (Subgroup& g : a.subgroups)
      for (int& r : g.devices.ranks) r = perm[r];
    return a;
  }

  std::pair<Annotation, Annotation> pair(int ndim) {
    switch (uniform(0, 9)) {
      case 0:
      case 1: {  // anything to anything
        Annotation src = annotation(ranks(), ndim, chance(0.3));
        return {src, annotation(ranks(), ndim, false)};
      }
      case 2: {  // case 1: same devices and hdim, new states
        Annotation src = annotation(ranks(), ndim, chance(0.6));
        return {src, restate(src, ndim, chance(0.3))};
      }
      case 3: {  // case 1: partial terms reduced into another key
        Annotation src = annotation(ranks(2), ndim, true);
        for (int tries = 0; tries < 4 && !involves_partial(src); ++tries) src = annotation(ranks(2), ndim, true);
        return {src, unpartial(src, ndim)};
      }
      case 4: {  // case 1: other devices, same states (or new ones: BSR inside subgroups)
        Annotation src = annotation(ranks(), ndim, chance(0.5));
        return {src, move(chance(0.7) ? src : restate(src, ndim, false))};
      }
      case 5:
      case 6:
      case 7:
        return top_pair(ndim);
      case 8: {  // other devices and a new hdim
        Annotation src = annotation(ranks(2), ndim, false);
        Annotation dst = move(restate(src, ndim, false));
        dst.hdim = hdim(ndim, false);
        dst.part_weights.clear();
        return {src, dst};
      }
      default: {
        Annotation src = annotation(ranks(), ndim, chance(0.5));
        return {src, src};
      }
    }
  }

  // Case 2: same devices, another hdim (and maybe new states).
  std::pair<Annotation, Annotation> top_pair(int ndim) {
    Annotation src = annotation(ranks(2), ndim, true);
    while (src.hsize() < 2) src = annotation(ranks(2), ndim, true);
    if (chance(0.7)) src.hdim = chance(0.6) ? kPartial : uniform(0, ndim - 1);
    src.part_weights.clear();
    if (src.hdim >= 0 && chance(0.3)) weights(src);
    Annotation dst = chance(0.5) ? src : restate(src, ndim, false);
    if (chance(0.5)) dst = unpartial(dst, ndim);
    for (int tries = 0; tries < 4 && dst.hdim == src.hdim; ++tries) dst.hdim = hdim(ndim, false);
    dst.part_weights.clear();
    if (dst.hdim >= 0 && chance(0.4)) weights(dst);
    return {src, dst};
  }

 private:
  std::mt19937_64 rng_;
};

inline bool fits(const Annotation& a, const Shape& shape) {
  try {
    validate(a, "t", static_cast<int>(shape.size()), kWorld, false);
    check_divisible(a, "t", shape, {});
    return true;
  } catch (const Error&) {
    return false;
  }
}

// Runs f(spec, n) on up to `cases` random (source, destination) pairs that
// fit their random shapes, named "case1", "case2", ..., until f returns
// false. The environment variables `seed_var` and `cases_var` replace the
// seed and the count (a longer soak). Returns the count asked for.
template <typename F>
int for_each_random_pair(const char* seed_var, const char* cases_var, int cases, F&& f) {
  const char* seed = std::getenv(seed_var);
  const char* soak = std::getenv(cases_var);
  Generator gen(seed ? std::strtoull(seed, nullptr, 10) : 20240611);
  if (soak) cases = std::atoi(soak);
  for (int n = 0; n < cases;) {
    const Shape shape = gen.shape();
    auto [src, dst] = gen.pair(static_cast<int>(shape.size()));
    if (!fits(src, shape) || !fits(dst, shape)) continue;
    ++n;
    if (!f(spec(shape, src, dst, "case" + std::to_string(n)), n)) break;
  }
  return cases;
}

}  // namespace hspmd::testing
