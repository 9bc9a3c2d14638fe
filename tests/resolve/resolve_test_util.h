// Builders shared by the resolver tests.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "hspmd/annotation/annotation.h"
#include "hspmd/core/ndarray.h"
#include "hspmd/resolve/resolver.h"
#include "hspmd/resolve/topology.h"
#include "resolve/simulator/simulate.h"

namespace hspmd::testing {

constexpr int S0 = 0;  // split(0)
constexpr int S1 = 1;  // split(1)
constexpr int DUP = kDup;
constexpr int PART = kPartial;

// A subgroup; `order` defaults to the keys with degree > 1 in map order.
inline Subgroup sg(std::vector<int> ranks, std::map<int, int> degrees = {}, std::vector<int> order = {}) {
  if (order.empty())
    for (auto [k, n] : degrees)
      if (n > 1) order.push_back(k);
  return Subgroup{DeviceGroup{std::move(ranks)}, DistStates{std::move(degrees), std::move(order)}};
}

inline Annotation ann(std::vector<Subgroup> subgroups, int hdim = kDup, std::vector<int64_t> weights = {}) {
  return Annotation{std::move(subgroups), hdim, std::move(weights)};
}

// A global tensor of small distinct integers (exact in f32 sums).
inline NDArray iota(const Shape& shape) {
  std::vector<float> v(shape_numel(shape));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(static_cast<int>(i % 251) - 125);
  return NDArray::from_vector(shape, v);
}

// Resolves, runs the resolution through the simulator and checks every rank
// ends with its destination shard. Returns the resolution.
inline Resolution resolve_and_check(const ReshardSpec& spec, const Topology& topology, uint64_t seed = 7) {
  Resolution res = resolve(spec, topology);
  const NDArray global = iota(spec.shape);
  std::map<int, NDArray> out = simulate(res, make_shards(global, spec.src, seed));
  const std::string diff = check_shards(global, spec.dst, out);
  EXPECT_EQ(diff, "") << spec.name << ": " << to_string(spec.src) << " -> " << to_string(spec.dst);
  return res;
}

inline ReshardSpec spec(Shape shape, Annotation src, Annotation dst, std::string name = "t") {
  return ReshardSpec{std::move(name), std::move(shape), DType::F32, std::move(src), std::move(dst)};
}

// Every op of `rank` over all its phases, flattened.
inline std::vector<CommOp> ops_of(const Resolution& res, int rank) {
  std::vector<CommOp> ops;
  for (const CommPhase& ph : res.ranks.at(rank).phases) ops.insert(ops.end(), ph.ops.begin(), ph.ops.end());
  return ops;
}

}  // namespace hspmd::testing
