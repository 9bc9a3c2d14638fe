// Internal to src/planner: the strategy search's state (docs/planner.md), shared
// by its two files. search.cc holds the first level (device classes, TP
// groups, the enumeration of configurations) and run(); search_second_level.cc
// the second level (layer and micro-batch programs, lower bounds, the
// exhaustive reference, scoring, per-pipeline micro-batch sizes).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "hspmd/planner/cost_model.h"
#include "hspmd/planner/ilp.h"
#include "hspmd/planner/search.h"
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
  // The device class of every rank and the node holding them all, or -1
  // when the ranks are of several classes or nodes: a group of one class
  // on one node costs what every other such group of its size costs, so its
  // stage programs are cached (Searcher::stage_program).
  int cls = -1, node = -1;
};

// A pipeline: its stages' groups, in order (owned by the Searcher's
// group sets, symmetric_groups_; a configuration only points at them).
using Pipe = std::vector<const Group*>;

// One first-level configuration: per pipeline its stages' groups, in order.
struct Config {
  std::vector<Pipe> pipelines;
  int cp = 1;
  std::string family;
};

// A configuration as the enumeration keeps it: a set of per-class groups
// (Searcher::group_sets_) and how they split into pipelines (mixed: P
// pipelines; separate: a pipeline count per class of the set), or an index
// into the symmetric configurations. Materialized (Searcher::config) only
// when its bound or its programs are computed: on 2,048 devices a
// configuration holds up to 2,048 groups and there are 10^5 of them.
struct ConfigRef {
  int symmetric = -1;  // >= 0: Searcher::symmetric_[symmetric]
  int set = -1;        // else Searcher::group_sets_[set]
  int cp = 1;
  bool mixed = false;
  int P = 0;  // mixed: the pipeline count; separate: all pipelines
  // Separate: at Searcher::counts_[counts ..], per class of the set, its
  // pipelines (0: idle).
  uint32_t counts = 0;
};

struct Scored {
  Strategy strategy;
  double step = 0;
  std::string family, key;
};

// A configuration (an index into Searcher::configs_) at one micro-batch
// size (an index into the sizes the second level tries), with its lower
// bound (Searcher::second_levels).
struct BoundItem {
  double bound;
  uint32_t config;
  uint32_t b_index;
};

// The order in which the second level bounds the configurations: the
// symmetric ones (configs_[0 .. symmetric)) first, then the `rest` by
// bit-reversed index (Searcher::bound_order).
struct BoundOrder {
  size_t symmetric = 0, rest = 0;
  int bits = 0;  // the least with rest <= 2^bits
  size_t positions() const { return symmetric + (size_t{1} << bits); }
  // Position `next` of the order -> a configuration, or size_t(-1) (a
  // reversed index past the end, skipped).
  size_t at(size_t next) const;
};

// The stage-program cache's key (Searcher::stage_program): what a stage's
// program depends on when its group and its neighbours' are each of one
// class on one node.
struct StageKey {
  std::array<int64_t, 13> v{};
  bool operator==(const StageKey& o) const { return v == o.v; }
};
struct StageKeyHash {
  size_t operator()(const StageKey& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t x : k.v) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

class Searcher {
 public:
  Searcher(const CostModel& model, const SearchOptions& o) : model_(model), o_(o), m_(model.model()) {
    start_ = SteadyClock::now();
  }

  SearchResult run();

 private:
  // The time limit (docs/planner.md, "Time limit"): every loop of every
  // phase asks; once it is reached it stays reached.
  bool out_of_time() {
    if (timed_out_) return true;
    if (elapsed() > o_.time_limit_s) {
      timed_out_ = true;
      limit(std::string("reached in ") + phase_);
    }
    return timed_out_;
  }
  // A phase stopped by the limit (or its share of it): the first says what.
  void limit(const std::string& what) {
    limited_ = true;
    if (limit_what_.empty()) limit_what_ = what;
  }
  double elapsed() const { return std::chrono::duration<double>(SteadyClock::now() - start_).count(); }
  std::vector<int> tp_degrees(int max_per_node) const;
  std::vector<int> micro_batch_sizes() const;
  // run()'s steps, in order. The device classes (none: throws "[search] no
  // available rank ...") and each rank's class.
  void classify_ranks();
  // Each rank's device type as an index, the node count, and the links per
  // pair of device types (link_gbps_).
  void index_device_types();
  // Per class, the TP degrees to try: on a re-plan those of the previous
  // solution on the class's device type, when it used some of them.
  std::vector<std::vector<int>> class_tp_degrees() const;
  // Every combination of per-class TP degrees (times cp), each enumerated
  // by enumerate_group_sets.
  void enumerate_tp_combinations(const std::vector<std::vector<int>>& degrees, int cp);
  // The groups of per-class TP sizes `tps` (without leftover groups, and
  // at cp 1 with them), each set kept when the batch can feed one of its
  // configurations.
  void enumerate_group_sets(const std::vector<int>& tps, int cp);
  // The answer: the top_k strategies scored, the counters and the
  // time-limit note.
  SearchResult result() const;
  std::string limit_note(double search_s) const;
  // Nothing scored: throws, naming the least memory shortfall if there was one.
  [[noreturn]] void fail_nothing_found() const;
  // Whether some micro-batch size can run a configuration of `stages`
  // stages in all over `pipelines` pipelines, the longest of `longest`
  // stages: at most L stages a pipeline, and under 1F1B at least as many
  // micro-batches as stages in each pipeline (GPipe: one), all out of the
  // global batch. The second level refuses the others; the enumeration
  // does not keep them.
  bool runnable(int64_t stages, int64_t pipelines, int64_t longest) const;
  void consider(ConfigRef c);
  // Whether configs_ holds kMaxConfigs (then the enumeration stops, saying so).
  bool full();
  // Configuration i of configs_, materialized.
  Config config(size_t i) const;
  // A lower bound of the step time of a configuration per micro-batch size.
  std::vector<double> lower_bounds(const Config& c, const std::vector<int>& sizes) const;
  // lower_bounds' parts: the least gradient sync and optimizer step after
  // the schedule (the same at every size), each pipeline's pipe_shape
  // (-1: not cacheable), and the bound at micro-batch size b.
  double after_schedule_bound(const Config& c) const;
  std::vector<int> pipe_shapes(const Config& c) const;
  double size_bound(const Config& c, int b, const std::vector<int>& shapes, double after) const;
  // A group's optimizer step over one layer's shard of `per_layer`
  // parameters and whether its rank overlaps the sync; cached per class,
  // size and cp (optimizer_cache_).
  std::pair<double, bool> optimizer_facts(const Group& g, int cp, double per_layer) const;
  // A pipeline's stage classes, sizes and node sharing (`stages`: per
  // stage class << 32 + 2 size + whether it shares the previous stage's
  // node), with cp and P where the programs read it, as a number:
  // pipeline_bound's cache key with b.
  int pipe_shape(const std::vector<int64_t>& stages, int cp, int P) const;
  std::pair<double, double> pipeline_bound(const Pipe& pipe, int cp, int b, int P, int shape) const;
  double kth_best() const;
  void second_levels();
  // second_levels' parts. The micro-batch sizes it tries (a re-plan: the
  // previous one's only), and the order in which it bounds configurations.
  std::vector<int> second_level_sizes() const;
  BoundOrder bound_order() const;
  // A round's bounds from position `next` on (advanced), best first; sets
  // `stopped` when the time limit is reached.
  std::vector<BoundItem> bound_round(const BoundOrder& order, const std::vector<int>& sizes, double programs_until,
                                     size_t& next, bool& stopped);
  // A round's programs, best bound first, pruning by the k-th best (the
  // infinite bounds pruned go to `unfit`). Returns whether a limit stopped it.
  bool solve_round(const std::vector<BoundItem>& items, const std::vector<int>& sizes, double programs_until,
                   std::vector<BoundItem>& unfit);
  // One configuration at size b (exhaustively or by the programs): plain,
  // then with recomputation (if allowed) only when the plain one scored
  // nothing.
  void solve_config(const Config& c, int b);
  // Nothing fits: the unfit configurations' programs, only to name the
  // least shortfall.
  void solve_unfit(const std::vector<BoundItem>& unfit, const std::vector<int>& sizes);
  void second_level(const Config& c, int b, bool recompute);
  // Stage k of a pipeline in the layer program: its time and memory per
  // micro-batch as fixed + per-layer terms (cost model), its capacity.
  // Cached when the stage's and its neighbours' groups are each of one
  // class on one node (then it depends on nothing else of their ranks).
  LayerStage stage_program(const Pipe& pipe, int k, int cp, int b, bool recompute, int pipelines) const;
  LayerStage compute_stage_program(const Pipe& pipe, int k, int cp, int b, bool recompute,
                                   int pipelines) const;
  void exhaustive(const Config& c, int b, bool recompute);
  void score(Strategy s, const std::string& family);
  // CBC's limit per program: never past the search's own limit. Once that
  // is reached, the exact algorithm (the same optimum, in microseconds,
  // docs/ilp.md) answers the programs that are left (the fallback's), and
  // it answers programs of more than kCbcMembers members (stages or
  // pipelines) always: CBC took about 0.3 s for one of 256 pipelines (most
  // of the 46 s the second level of a search on 2,048 devices took), the
  // exact algorithm milliseconds at most.
  static constexpr size_t kCbcMembers = 32;
  double ilp_limit() const {
    return std::max(0.01, std::min({10.0, o_.time_limit_s, o_.time_limit_s - elapsed()}));
  }
  IlpSolver solver(size_t members) const {
    return timed_out_ || members > kCbcMembers ? IlpSolver::kExact : o_.solver;
  }
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
    return layer_cache_[key] = assign_layers(stages, L, ilp_limit(), solver(stages.size()));
  }
  std::map<std::string, LayerAssignment> layer_cache_;
  StageShape shape(const Pipe& pipe, size_t k, int cp, int layers, bool recompute) const;
  // Per micro-batch, the transfers a stage makes and waits for: the
  // activation in and out, the gradient in and out (each boundary twice).
  double transfers(const Pipe& pipe, size_t k, int cp, int b) const {
    double t = 0;
    const StageShape me = shape(pipe, k, cp, 1, false);
    if (k + 1 < pipe.size()) t += 2 * model_.boundary_seconds(me, shape(pipe, k + 1, cp, 1, false), o_.seq_len, b);
    if (k > 0) t += 2 * model_.boundary_seconds(shape(pipe, k - 1, cp, 1, false), me, o_.seq_len, b);
    return t;
  }
  // A group of `ranks` with its class and node when it has one of each.
  Group group_of(std::vector<int> ranks) const;
  void enumerate_mixed(int set, int cp);
  void enumerate_separate(int set, int cp);
  void enumerate_symmetric();
  // Out of time with nothing scored: the symmetric configurations, fewest
  // stages first, until one fits (docs/planner.md, "Time limit").
  void fallback();
  // The best strategies scored so far again, each pipeline with its own
  // micro-batch size (see resize()).
  void refine_sizes();

  const CostModel& model_;
  const SearchOptions& o_;
  const ModelConfig& m_;
  SteadyClock::time_point start_;
  bool timed_out_ = false;
  const char* phase_ = "";  // the phase running (for the time-limit note)
  bool limited_ = false;    // some phase stopped before its end
  std::string limit_what_;  // the first that did, and how
  bool fell_back_ = false;  // the answer is the fallback's
  int configurations_ = 0, ilps_ = 0, pruned_ = 0;
  size_t bounded_ = 0;      // configurations whose bounds were computed
  std::vector<ConfigRef> configs_;
  std::vector<int> counts_;  // ConfigRef::counts
  // At most this many configurations are kept (24 bytes each; three device
  // classes of hundreds of groups each would make 10^8 separate ones).
  static constexpr size_t kMaxConfigs = size_t{1} << 23;
  std::vector<Config> symmetric_;
  // Per set: per class of it, its groups; per symmetric configuration its
  // groups. Deques: a configuration points at their groups.
  std::deque<std::vector<std::vector<Group>>> group_sets_;
  std::deque<std::vector<Group>> symmetric_groups_;
  std::vector<DeviceClass> classes_;
  std::vector<int> rank_class_;  // per rank, its index in classes_ (-1: unavailable)
  std::vector<int> rank_type_;   // per rank, an index of its device type
  size_t type_names_ = 0;        // how many device types
  // Per pair of device types (t, u): the link between ranks of them on one
  // node and on two, GB/s (Topology::bandwidth), at [(t * types + u) * 2 + across].
  std::vector<double> link_gbps_;
  int num_nodes_ = 0;
  int least_b_ = 1;              // the smallest micro-batch size tried
  std::map<std::string, Scored> scored_;  // by strategy JSON (dedupe)
  mutable std::unordered_map<StageKey, LayerStage, StageKeyHash> stage_cache_;
  mutable std::unordered_map<std::string, int> pipe_shapes_;
  mutable std::unordered_map<int64_t, std::pair<double, double>> pipeline_bound_cache_;
  mutable std::unordered_map<int64_t, std::pair<double, bool>> optimizer_cache_;  // lower_bounds: (class, cp, size)
  mutable double kth_ = std::numeric_limits<double>::infinity();
  mutable size_t kth_at_ = static_cast<size_t>(-1);  // scored_.size() when kth_ was computed
  // The memory shortfall closest to fitting, for the error when nothing fits.
  double least_missing_ = std::numeric_limits<double>::infinity();
  int least_missing_rank_ = -1;
};

}  // namespace search_detail

}  // namespace hspmd
