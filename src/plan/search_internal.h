// Internal to src/plan: the strategy search's state (docs/planner.md), shared
// by its two files. search.cc holds the first level (device classes, TP
// groups, the enumeration of configurations) and run(); search_second_level.cc
// the second level (layer and micro-batch programs, lower bounds, the
// exhaustive reference, scoring, per-pipeline micro-batch sizes).
#pragma once

#include <chrono>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "hspmd/plan/cost_model.h"
#include "hspmd/plan/ilp.h"
#include "hspmd/plan/search.h"
#include "hspmd/plan/strategy.h"

namespace hspmd {

// A named namespace, not an anonymous one, because the Searcher's members
// are defined in two files.
namespace search_detail {

using SteadyClock = std::chrono::steady_clock;

// Devices that are interchangeable for the planner.
struct DeviceClass {
  std::string type;
  double slowdown = 1, cap = 0;
  std::vector<std::vector<int>> nodes;  // available ranks per node (ascending)
  double seconds_per_layer = 0;         // block forward at tp 1: smaller is faster
  int max_per_node = 0;
};

// A tensor-parallel group: one stage's ranks.
struct Group {
  std::vector<int> ranks;
  int cls = 0;
};

// One first-level configuration: per pipeline its stages' groups, in order.
struct Config {
  std::vector<std::vector<Group>> pipelines;
  int cp = 1;
  std::string family;
};

struct Scored {
  Strategy strategy;
  double step = 0;
  std::string family, key;
};

class Searcher {
 public:
  Searcher(const CostModel& model, const SearchOptions& o) : model_(model), o_(o), m_(model.model()) {
    start_ = SteadyClock::now();
  }

  SearchResult run();

 private:
  bool out_of_time() {
    if (timed_out_) return true;
    if (std::chrono::duration<double>(SteadyClock::now() - start_).count() > o_.time_limit_s) timed_out_ = true;
    return timed_out_;
  }
  std::vector<int> tp_degrees(int max_per_node) const;
  std::vector<int> micro_batch_sizes() const;
  void consider(const Config& c);
  double lower_bound(const Config& c, int b) const;
  double kth_best() const;
  void second_levels();
  void second_level(const Config& c, int b, bool recompute);
  // Stage k of a pipeline in the layer program: its time and memory per
  // micro-batch as fixed + per-layer terms (cost model), its capacity.
  LayerStage stage_program(const std::vector<Group>& pipe, int k, int cp, int b, bool recompute, int pipelines) const;
  void exhaustive(const Config& c, int b, bool recompute);
  void score(Strategy s, const std::string& family);
  double ilp_limit() const { return std::max(0.05, std::min(10.0, o_.time_limit_s)); }
  // The layer ILP, solved once per distinct input (pipelines of the same
  // shape recur across configurations).
  LayerAssignment layers_for(const std::vector<LayerStage>& stages, int L) {
    std::string key;
    for (const LayerStage& s : stages)
      for (double x : {s.time_per_layer, s.fixed_time, s.memory_per_layer, s.fixed_memory, s.memory_capacity})
        key.append(reinterpret_cast<const char*>(&x), sizeof x);
    auto it = layer_cache_.find(key);
    if (it != layer_cache_.end()) return it->second;
    ++ilps_;
    return layer_cache_[key] = assign_layers(stages, L, ilp_limit(), o_.solver);
  }
  std::map<std::string, LayerAssignment> layer_cache_;
  StageShape shape(const std::vector<Group>& pipe, size_t k, int cp, int layers, bool recompute) const;
  // Per micro-batch, the transfers a stage makes and waits for: the
  // activation in and out, the gradient in and out (each boundary twice).
  double transfers(const std::vector<Group>& pipe, size_t k, int cp, int b) const {
    double t = 0;
    const StageShape me = shape(pipe, k, cp, 1, false);
    if (k + 1 < pipe.size()) t += 2 * model_.boundary_seconds(me, shape(pipe, k + 1, cp, 1, false), o_.seq_len, b);
    if (k > 0) t += 2 * model_.boundary_seconds(shape(pipe, k - 1, cp, 1, false), me, o_.seq_len, b);
    return t;
  }
  void enumerate_mixed(const std::vector<std::vector<Group>>& per_class, int cp);
  void enumerate_separate(const std::vector<std::vector<Group>>& per_class, int cp);
  void enumerate_symmetric();
  // The best strategies scored so far again, each pipeline with its own
  // micro-batch size (see resize()).
  void refine_sizes();

  const CostModel& model_;
  const SearchOptions& o_;
  const ModelConfig& m_;
  SteadyClock::time_point start_;
  bool timed_out_ = false;
  int configurations_ = 0, ilps_ = 0, pruned_ = 0;
  std::vector<Config> configs_;
  std::vector<DeviceClass> classes_;
  std::map<std::string, Scored> scored_;  // by strategy JSON (dedupe)
  // The memory shortfall closest to fitting, for the error when nothing fits.
  double least_missing_ = std::numeric_limits<double>::infinity();
  int least_missing_rank_ = -1;
};

}  // namespace search_detail

}  // namespace hspmd
