// The planner's search (docs/planner.md "Search"): the best strategy for a
// model, a cluster and a global batch under the cost model.
//
// Two levels, as in the paper's planner:
//   1. pipeline configurations, enumerated with pruning: devices grouped by
//      class (device type, slowdown, memory cap), one power-of-two TP degree
//      per class that divides the heads and fits in a node, TP groups inside
//      nodes, stages of a pipeline ordered by device speed, pipelines either
//      mixing the classes round-robin or keeping each class apart, and the
//      symmetric (Megatron-like) strategies always among the candidates;
//   2. per configuration, two integer linear programs (planner/ilp.h, CBC):
//      layers per stage (minimise the slowest stage under each device's
//      memory) and micro-batches per pipeline (minimise the slowest
//      pipeline, at least as many micro-batches as stages).
// Every candidate is then scored by the full cost model (the simulated
// schedule, gradient sync, optimizer) and the best are kept.
#pragma once

#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/planner/cost_model.h"
#include "hspmd/planner/ilp.h"
#include "hspmd/plan/strategy.h"

namespace hspmd {

struct SearchOptions {
  int global_batch = 0;
  int64_t seq_len = 0;
  bool zero = false;
  std::string schedule = "1f1b";
  // Expert parallelism of every strategy (docs/moe.md): a strategy whose
  // layout cannot run it (validate's rules) is skipped.
  int expert_parallel = 1;
  double time_limit_s = 60;  // the enumeration stops (keeping the best so far) after this
  int top_k = 5;
  std::set<int> unavailable;     // ranks that take no work (failed devices)
  std::vector<int> tp_degrees;   // empty: powers of two up to the node size that divide the heads
  int max_cp = 1;                // context-parallel degrees 1, 2, 4 .. max_cp
  std::vector<int> micro_batch_sizes;  // empty: powers of two up to 8 that divide the global batch
  bool allow_recompute = true;   // try recomputation where memory does not fit without it
  // At least this many pipelines (data-parallel replicas): with 2, every
  // weight and (without ZeRO) every optimizer state lives on two disjoint
  // sets of ranks, so that one failed device loses nothing another holds.
  int min_pipelines = 1;
  // Re-plan: the previous solution; its TP degree per device class and its
  // micro-batch size prune the first level.
  const Strategy* previous = nullptr;
  // Tests: score every layer split and micro-batch split of each
  // configuration with the full cost model instead of solving the ILPs.
  bool exhaustive = false;
  IlpSolver solver = IlpSolver::kCbc;  // who solves the second level's ILPs
};

struct SearchCandidate {
  Strategy strategy;
  double predicted_step_s = 0;
  std::string family;  // "mixed", "separate", "symmetric"
};

struct SearchResult {
  std::vector<SearchCandidate> best;  // ascending predicted step time, at most top_k
  int configurations = 0;             // (configuration, micro-batch size) pairs solved
  int pruned = 0;                     // pairs skipped: their lower bound could not enter the top k
  int ilps = 0;                       // integer programs solved
  double search_s = 0;
  bool timed_out = false;
  // When the time limit stopped the search: one line saying in which phase
  // and what the answer is (the best scored so far, or the fallback);
  // `hspmd plan search` prints it on stderr. Empty otherwise.
  std::string note;
  nlohmann::json to_json() const;
};

// Throws hspmd::Error "[search] ..." when no strategy fits: one line naming
// the device that is short of memory and the bytes missing, or why nothing
// can be built (no available rank, a batch no pipeline count divides).
SearchResult search_strategy(const CostModel& model, const SearchOptions& options);

}  // namespace hspmd
