// place_layer_experts (hspmd/plan/expert_placement.h, docs/moe.md "Choosing
// a placement"): replicas for the hot experts, every member used, the busiest
// member's load near an even share, device speeds weighed.
#include "hspmd/plan/expert_placement.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "hspmd/core/error.h"
#include "test_util.h"

namespace hspmd {
namespace {

double total(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); }

void expect_valid(const std::vector<std::vector<int>>& p, size_t experts, int members) {
  ASSERT_EQ(p.size(), experts);
  std::vector<int> held(members, 0);
  for (const auto& m : p) {
    ASSERT_FALSE(m.empty());
    EXPECT_TRUE(std::is_sorted(m.begin(), m.end()));
    EXPECT_EQ(std::adjacent_find(m.begin(), m.end()), m.end());  // a member once per expert
    for (int x : m) {
      ASSERT_GE(x, 0);
      ASSERT_LT(x, members);
      ++held[x];
    }
  }
  for (int x = 0; x < members; ++x) EXPECT_GT(held[x], 0) << "member " << x << " holds no expert";
}

TEST(ExpertPlacement, ReplicatesAHotExpertUntilTheBusiestMemberIsNearAnEvenShare) {
  // Expert 0 takes 60% of 1000 tokens over 8 experts and 8 members.
  const std::vector<double> loads = {600, 80, 70, 60, 60, 50, 40, 40};
  const std::vector<std::vector<int>> p = place_layer_experts(loads, 8);
  expect_valid(p, loads.size(), 8);
  EXPECT_GE(p[0].size(), 4u);  // 600 / 125 per member: at least 5 members' worth, 4 replicas at least
  const double even = total(loads) / 8;
  const double one_each = placement_bottleneck({{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}, loads, 8);
  EXPECT_DOUBLE_EQ(one_each, 600);
  EXPECT_LE(placement_bottleneck(p, loads, 8), 1.25 * even);
}

TEST(ExpertPlacement, KeepsBalancedLoadsOneExpertPerMember) {
  const std::vector<double> loads = {100, 101, 99, 100};
  const std::vector<std::vector<int>> p = place_layer_experts(loads, 4);
  expect_valid(p, 4, 4);
  for (const auto& m : p) EXPECT_EQ(m.size(), 1u);
}

TEST(ExpertPlacement, FewerExpertsThanMembersAreReplicatedOntoEveryMember) {
  const std::vector<std::vector<int>> p = place_layer_experts({30, 10}, 4);
  expect_valid(p, 2, 4);
  EXPECT_EQ(p[0].size() + p[1].size(), 4u);
  EXPECT_EQ(p[0].size(), 3u);  // 30 / 3 = 10 each beside expert 1's 10
}

TEST(ExpertPlacement, AFasterMemberTakesMore) {
  // Member 0 twice as fast: the hot expert's share goes there first.
  const std::vector<double> loads = {200, 50, 50, 50};
  const std::vector<double> speeds = {2, 1, 1, 1};
  const std::vector<std::vector<int>> p = place_layer_experts(loads, 4, speeds);
  expect_valid(p, 4, 4);
  EXPECT_LE(placement_bottleneck(p, loads, 4, speeds), placement_bottleneck(p, loads, 4) + 1e-9);
  EXPECT_LE(placement_bottleneck(p, loads, 4, speeds), 1.2 * total(loads) / 5);  // 5 units of speed
}

TEST(ExpertPlacement, MergesLayersWithOnePlacementAndRefusesBadInput) {
  const std::vector<std::vector<double>> loads = {{10, 10}, {10, 10}, {30, 1}};
  const std::vector<ExpertPlacement> out = place_experts({0, 1, 2}, loads, 2, 2);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].first_layer, 0);
  EXPECT_EQ(out[0].last_layer, 1);
  EXPECT_EQ(out[1].first_layer, 2);
  EXPECT_THROW(place_layer_experts({}, 2), Error);
  EXPECT_THROW(place_layer_experts({1, -1}, 2), Error);
  EXPECT_THROW(place_layer_experts({1, 1}, 0), Error);
  EXPECT_THROW(place_layer_experts({1, 1}, 2, {1, 0}), Error);
  const std::string e = testing::error_of([&] { place_experts({0, 1}, {{1, 1}}, 2, 2); });
  EXPECT_EQ(e, "[experts] loads of 1 sparse layers, the model has 2");
}

}  // namespace
}  // namespace hspmd
