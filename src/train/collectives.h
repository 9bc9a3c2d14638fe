// Small collectives and helpers the distributed trainer's parts share.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "hspmd/comm/communicator.h"
#include "hspmd/plan/strategy.h"

namespace hspmd::dist {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Every rank's values of `mine`: out[i][r] is rank r's mine[i].
inline std::vector<std::vector<int64_t>> gather_counts(const std::vector<int64_t>& mine, Communicator& world) {
  const int k = static_cast<int>(mine.size());
  std::vector<int64_t> all(static_cast<size_t>(k) * world.size());
  world.all_gather(mine.data(), all.data(), std::vector<int64_t>(world.size(), k));
  std::vector<std::vector<int64_t>> out(k, std::vector<int64_t>(world.size()));
  for (int r = 0; r < world.size(); ++r)
    for (int i = 0; i < k; ++i) out[i][r] = all[static_cast<size_t>(r) * k + i];
  return out;
}

inline double all_reduce_scalar(double v, Communicator& world) {
  world.all_reduce(&v, 1);
  return v;
}

// Rank 0's `text` on every rank.
inline void broadcast_text(std::string& text, Communicator& world) {
  int64_t n = static_cast<int64_t>(text.size());
  world.broadcast(&n, 1, 0);
  std::vector<int64_t> words((n + 7) / 8, 0);
  if (world.rank() == 0 && n > 0) std::copy(text.begin(), text.end(), reinterpret_cast<char*>(words.data()));
  if (!words.empty()) world.broadcast(words.data(), static_cast<int64_t>(words.size()), 0);
  text.assign(reinterpret_cast<const char*>(words.data()), static_cast<size_t>(n));
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// Two strategies that execute alike (the description aside).
inline bool same_execution(Strategy a, Strategy b) {
  a.description.clear();
  b.description.clear();
  return a == b;
}

}  // namespace hspmd::dist
