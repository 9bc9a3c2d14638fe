// Elastic training's events (docs/elastic.md): what happens to the cluster
// before a step — devices fail, join again, or slow down — and optionally
// the strategy to train under from then on.
//
//   [{"step": 4, "fail": [3]},
//    {"step": 7, "fail": [6, 7], "strategy": "after_7.json"},
//    {"step": 9, "join": [3]},
//    {"step": 11, "slowdown": {"2": 3.0}}]
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace hspmd {

struct ElasticEvent {
  int64_t step = 0;               // takes effect before this step
  std::vector<int> fail;          // ranks whose devices are lost (memory gone)
  std::vector<int> join;          // failed ranks that are back (empty memory)
  std::map<int, double> slowdown; // rank -> its compute-time multiplier from now on
  std::string strategy_path;      // the next strategy; "" = re-plan (when ranks fail or join)
  // Whether the set of available ranks changes.
  bool changes_ranks() const { return !fail.empty() || !join.empty(); }
  // "fail 3; join 5; slowdown 2x3" for logs.
  std::string cause() const;
};

// Reads and checks an events file for a job of `world_size` ranks and
// `steps` steps: a JSON list of objects with "step" (1 <= step < steps,
// strictly ascending) and at least one of "fail", "join" (lists of ranks),
// "slowdown" (an object rank -> factor > 0), plus an optional "strategy"
// (a path, relative to the events file's directory unless absolute). A rank
// must lie in the world, fail only while available, join only while failed,
// appear once per list; not every rank may be failed at once. Throws
// hspmd::Error "[events] <path>: event <i> (step k): <rule>" (one line).
std::vector<ElasticEvent> load_events(const std::string& path, int world_size, int64_t steps);

// The ranks that are failed after every event with step <= `step` (in order).
std::set<int> failed_after(const std::vector<ElasticEvent>& events, int64_t step);

}  // namespace hspmd
