// Whose link to blame when a host finds other hosts bad and no host it hears
// well agrees (docs/multi_host.md, "Heartbeat between hosts"). A header of
// its own, with no sockets or threads, so that a unit test can drive it.
#pragma once

#include <cstddef>
#include <vector>

namespace hspmd::cli {

// loss[h][c]: the share (0 to 1) of host c's heartbeats that host h lost
// over its last window, as host h last reported it (the calling host's own
// row: its own counts); 1 for a host h finds silent; negative where h does
// not know (it has not numbered a whole window of c's yet, or h == c).
//
// A lossy link drops the datagrams of its host to every other host, so each
// of them counts that host's losses; a healthy host's datagrams are lost
// only on their way to the lossy one. So the host whose datagrams the other
// hosts lost the most of, on average over those that know, is the one whose
// link is at fault, even when one host's own count of it happens to stay
// under the threshold (a window of 40 at 30% loss holds 8 or fewer losses
// about one time in ten). Returns that host among `bad` (the hosts the
// caller finds silent or lossy) and `self` (the caller); ties, and
// candidates no other host knows about, keep the first of `bad`.
inline int most_blamed(const std::vector<std::vector<double>>& loss, const std::vector<int>& bad, int self) {
  auto score = [&](int c) {
    double sum = 0;
    int known = 0;
    for (size_t h = 0; h < loss.size(); ++h) {
      if (static_cast<int>(h) == c || static_cast<size_t>(c) >= loss[h].size() || loss[h][c] < 0) continue;
      sum += loss[h][c];
      ++known;
    }
    return known > 0 ? sum / known : -1.0;
  };
  int best = bad.empty() ? self : bad.front();
  double best_score = score(best);
  std::vector<int> candidates(bad.begin(), bad.end());
  candidates.push_back(self);
  for (int c : candidates) {
    const double s = score(c);
    if (s > best_score) best = c, best_score = s;
  }
  return best;
}

}  // namespace hspmd::cli
