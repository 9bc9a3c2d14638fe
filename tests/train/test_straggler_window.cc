// The straggler watch's window (src/train/straggler_window.h): the cost
// model's error per role is learned, a device's speed change is not.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <vector>

#include "hspmd/core/error.h"
#include "train/straggler_window.h"

namespace hspmd::dist {
namespace {

const StragglerRole kTp1{1, 1}, kCp2{1, 2};

// Eight ranks; ranks 0 and 1 are a cp2 pipeline whose prediction is off by
// `cp2_error` (seen = predicted * error), the rest tp1. `slow` ranks run at
// that factor of their assumed speed.
void add_step(StragglerWindow& w, double cp2_error, const std::vector<double>& slow) {
  std::vector<double> seen(8), predicted(8, 0.1);
  std::vector<StragglerRole> roles(8, kTp1);
  roles[0] = roles[1] = kCp2;
  for (int k = 0; k < 8; ++k) seen[k] = predicted[k] * (k < 2 ? cp2_error : 1.0) * slow[k];
  w.add(seen, predicted, roles);
}

TEST(StragglerWindow, ARolesModelErrorIsLearnedNotTakenForASpeed) {
  StragglerWindow w;
  const std::vector<double> none(8, 1.0);
  add_step(w, 0.6, none);
  add_step(w, 0.6, none);
  std::vector<int> active;
  std::vector<double> r = w.ratios({}, true, active);
  ASSERT_EQ(active.size(), 8u);
  for (double x : r) EXPECT_NEAR(x, 1.0, 1e-12);
  EXPECT_NEAR(w.factors().at(kCp2), 0.6, 1e-12);
  EXPECT_NEAR(w.factors().at(kTp1), 1.0, 1e-12);
}

TEST(StragglerWindow, ALaterSlowdownIsFoundWithTheLearnedFactorsKept) {
  StragglerWindow w;
  const std::vector<double> none(8, 1.0);
  add_step(w, 0.6, none);
  std::vector<int> active;
  w.ratios({}, false, active);
  w.clear();
  std::vector<double> slow = none;
  slow[1] = 4.0;  // a cp2 rank
  slow[5] = 2.0;  // a tp1 rank
  add_step(w, 0.6, slow);
  add_step(w, 0.6, slow);
  std::vector<double> r = w.ratios({}, false, active);
  EXPECT_NEAR(r[0], 1.0, 1e-12);
  EXPECT_NEAR(r[1], 4.0, 1e-12);
  EXPECT_NEAR(r[5], 2.0, 1e-12);
  EXPECT_NEAR(r[7], 1.0, 1e-12);
}

TEST(StragglerWindow, ARankSlowFromTheStartInARoleOfThreeIsFound) {
  StragglerWindow w;
  std::vector<double> slow(8, 1.0);
  slow[6] = 3.0;  // tp1 has six ranks: their median is not moved
  add_step(w, 1.3, slow);
  std::vector<int> active;
  std::vector<double> r = w.ratios({}, true, active);
  EXPECT_NEAR(r[6], 3.0, 1e-12);
  EXPECT_NEAR(r[2], 1.0, 1e-12);
  EXPECT_NEAR(r[0], 1.0, 1e-12);
}

TEST(StragglerWindow, ATwoRankRoleKeepsTheRankClosestToTheMedian) {
  StragglerWindow w;
  std::vector<double> slow(8, 1.0);
  slow[0] = 5.0;  // one of the two cp2 ranks is slow from the start
  add_step(w, 1.0, slow);
  std::vector<int> active;
  std::vector<double> r = w.ratios({}, true, active);
  EXPECT_NEAR(r[1], 1.0, 1e-12);
  EXPECT_NEAR(r[0], 5.0, 1e-12);
}

TEST(StragglerWindow, ExcludedAndIdleRanksStayOut) {
  StragglerWindow w;
  std::vector<double> seen(4, 0.2), predicted = {0.2, 0.2, 0.0, 0.2};
  w.add(seen, predicted, {kTp1, kTp1, StragglerRole{}, kTp1});
  std::vector<int> active;
  std::vector<double> r = w.ratios({3}, true, active);
  EXPECT_EQ(active, (std::vector<int>{0, 1}));
  EXPECT_EQ(r[2], 0.0);
  EXPECT_EQ(r[3], 0.0);
}

TEST(StragglerWindow, AStepOfAnotherWorldSizeIsRefused) {
  StragglerWindow w;
  w.add({1, 1}, {1, 1}, {kTp1, kTp1});
  EXPECT_THROW(w.add({1, 1, 1}, {1, 1, 1}, {kTp1, kTp1, kTp1}), Error);
}

}  // namespace
}  // namespace hspmd::dist
