// most_blamed (src/cli/heartbeat_blame.h): whose link the heartbeat names
// when no host it hears well agrees.
#include "cli/heartbeat_blame.h"

#include <gtest/gtest.h>

namespace {

using hspmd::cli::most_blamed;
constexpr double kUnknown = -1;

// Three hosts, host 2's link drops 30% each way. Host 1's count of host 2
// happened to stay under the threshold (7 of 40): the open case of the
// agreement rule. Host 2 finds host 0 lossy and host 1 fresh; host 0 finds
// host 2 lossy. Both must name host 2.
TEST(HeartbeatBlame, TheLossyHostIsNamedWhenOneCountStaysUnderTheLine) {
  const std::vector<std::vector<double>> loss = {
      {kUnknown, 0.0, 0.325},   // host 0: none of host 1's lost, 13 of 40 of host 2's
      {0.0, kUnknown, 0.175},   // host 1: 7 of 40 of host 2's
      {0.30, 0.15, kUnknown}};  // host 2: 12 of 40 of host 0's, 6 of 40 of host 1's
  EXPECT_EQ(most_blamed(loss, /*bad=*/{0}, /*self=*/2), 2);  // host 2 names itself, not host 0
  EXPECT_EQ(most_blamed(loss, /*bad=*/{2}, /*self=*/0), 2);  // host 0 names host 2
}

// Four hosts: a lossy host is blamed by all three others; a healthy host
// only by the lossy one.
TEST(HeartbeatBlame, MoreHostsMakeTheLossyOneStandOut) {
  const std::vector<std::vector<double>> loss = {
      {kUnknown, 0.0, 0.0, 0.4}, {0.0, kUnknown, 0.0, 0.1}, {0.0, 0.0, kUnknown, 0.35}, {0.4, 0.3, 0.0, kUnknown}};
  EXPECT_EQ(most_blamed(loss, {0, 1}, 3), 3);
  EXPECT_EQ(most_blamed(loss, {3}, 0), 3);
}

// A healthy host is not blamed when the others saw it lose nothing: the
// lossy peer's own row is outvoted.
TEST(HeartbeatBlame, AHealthyCallerKeepsNamingTheBadHost) {
  const std::vector<std::vector<double>> loss = {
      {kUnknown, 0.0, 0.5}, {0.0, kUnknown, 0.45}, {0.5, 0.45, kUnknown}};
  EXPECT_EQ(most_blamed(loss, {2}, 0), 2);
  EXPECT_EQ(most_blamed(loss, {0, 1}, 2), 2);
}

// A silent host counts as lost entirely in the rows that find it silent.
TEST(HeartbeatBlame, SilentCountsAsAllLost) {
  const std::vector<std::vector<double>> loss = {{kUnknown, 0.0, 1.0}, {0.0, kUnknown, 1.0}, {kUnknown, kUnknown, kUnknown}};
  EXPECT_EQ(most_blamed(loss, {2}, 0), 2);
}

// Nothing known beyond the caller's own suspicion (no whole window counted
// anywhere): the first bad host, as before the table existed.
TEST(HeartbeatBlame, WithoutCountsTheFirstBadHostIsKept) {
  const std::vector<std::vector<double>> none(3, std::vector<double>(3, kUnknown));
  EXPECT_EQ(most_blamed(none, {1, 2}, 0), 1);
  // Ties keep the first bad host too.
  const std::vector<std::vector<double>> tie = {{kUnknown, 0.3, 0.3}, {0.3, kUnknown, 0.3}, {0.3, 0.3, kUnknown}};
  EXPECT_EQ(most_blamed(tie, {1, 2}, 0), 1);
}

}  // namespace
