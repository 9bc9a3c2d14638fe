// The acceptance property: for hundreds of random (source, destination)
// annotation pairs over up to 8 virtual ranks, the resolution, executed by the
// simulator on real data, leaves every rank with exactly its destination
// shard; pairs without a rule throw hspmd::Error (and involve partial).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <numeric>
#include <random>

#include "hspmd/core/error.h"
#include "resolve/random_annotations.h"
#include "resolve/resolve_test_util.h"

namespace hspmd {
namespace {

using namespace hspmd::testing;

// What the random cases came to.
struct Tally {
  int checked = 0, unsupported = 0, partial_checked = 0;
  std::map<std::string, int> tiers, kinds;

  std::string summary() const {
    std::string out = "checked " + std::to_string(checked) + ", unsupported " + std::to_string(unsupported) +
                      ", partial sources checked " + std::to_string(partial_checked) + ";";
    for (const auto& [k, c] : kinds) out += " " + k + "=" + std::to_string(c);
    return out;
  }
};

// Resolves one pair and, when it resolves, runs it on real data and checks
// every destination shard.
void run_case(const ReshardSpec& s, const Topology& topology, uint64_t seed, Tally& tally) {
  Resolution res;
  try {
    res = resolve(s, topology);
  } catch (const Error& e) {
    ++tally.unsupported;
    if (std::getenv("HSPMD_RESOLVE_VERBOSE")) std::cout << e.what() << "\n";
    EXPECT_TRUE(involves_partial(s.src) || involves_partial(s.dst)) << e.what();
    EXPECT_EQ(std::string(e.what()).rfind("[resolve] reshard '" + s.name + "': unsupported", 0), 0u) << e.what();
    return;
  }
  const NDArray global = iota(s.shape);
  std::string diff;
  try {
    diff = check_shards(global, s.dst, simulate(res, make_shards(global, s.src, seed)));
  } catch (const InternalError& e) {
    diff = e.what();
  }
  EXPECT_EQ(diff, "") << s.name << ": " << to_string(s.src) << " -> " << to_string(s.dst) << "\n"
                      << to_json(res).dump();
  ++tally.checked;
  tally.partial_checked += involves_partial(s.src) ? 1 : 0;
  ++tally.tiers[res.tier];
  ++tally.kinds[kind_name(res.kind)];
}

// HSPMD_RESOLVE_CASES (e.g. 100000) and HSPMD_RESOLVE_SEED run a longer soak
// locally; HSPMD_RESOLVE_VERBOSE prints the unsupported pairs' messages.
TEST(ResolveProperty, RandomPairsEndWithTheirDestinationShards) {
  const Topology topology = Topology::uniform(kWorld, 4);
  Tally tally;
  const int cases = for_each_random_pair("HSPMD_RESOLVE_SEED", "HSPMD_RESOLVE_CASES", 500,
                                         [&](const ReshardSpec& s, int n) {
                                           run_case(s, topology, n, tally);
                                           return true;
                                         });
  EXPECT_GE(tally.checked, cases * 6 / 10) << tally.summary();
  EXPECT_GE(tally.partial_checked, cases / 8) << tally.summary();
  for (const char* tier : {"bottom", "top", "bsr"}) EXPECT_GE(tally.tiers[tier], cases / 25) << tier;
  for (const char* kind : {"identity", "send", "local_slice", "all_reduce", "reduce_scatter", "all_gather",
                           "split_all_reduce", "split_reduce_scatter", "split_all_gather", "bsr"})
    EXPECT_GE(tally.kinds[kind], 1) << kind;
  std::cout << tally.summary() << "\n";
}

}  // namespace
}  // namespace hspmd
