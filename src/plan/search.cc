// The strategy search (docs/planner.md), first level: the device classes,
// their TP groups, the enumeration of configurations (symmetric, mixed,
// separate), Searcher::run and search_strategy. The second level, which
// scores the configurations, is in search_second_level.cc.
#include "hspmd/plan/search.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <set>

#include "hspmd/core/error.h"
#include "plan/search_internal.h"

namespace hspmd {
namespace search_detail {

namespace {

bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

bool valid_tp(const ModelConfig& m, int tp) {
  return tp >= 1 && m.num_attention_heads % tp == 0 && m.kv_heads() % tp == 0 && m.intermediate_size % tp == 0;
}

std::vector<DeviceClass> device_classes(const CostModel& model, const SearchOptions& o) {
  const Topology& t = model.topology();
  std::map<std::tuple<std::string, double, double>, int> index;
  std::vector<DeviceClass> classes;
  std::map<std::pair<int, int>, std::vector<int>> per_node;  // (class, node) -> ranks
  for (int r = 0; r < t.world_size(); ++r) {
    if (o.unavailable.count(r)) continue;
    const RankInfo& info = t.rank(r);
    const auto key = std::make_tuple(info.device_type, info.slowdown, info.memory_cap_gib);
    auto it = index.find(key);
    if (it == index.end()) {
      it = index.emplace(key, static_cast<int>(classes.size())).first;
      DeviceClass c;
      c.type = info.device_type;
      c.slowdown = info.slowdown;
      c.cap = model.capacity_bytes(r);
      c.seconds_per_layer = model.part_seconds(r, "block_fwd", 1, 1, o.seq_len, 1) +
                            model.part_seconds(r, "block_bwd", 1, 1, o.seq_len, 1);
      classes.push_back(c);
    }
    per_node[{it->second, info.node}].push_back(r);
  }
  for (auto& [key, ranks] : per_node) {
    classes[key.first].nodes.push_back(ranks);
    classes[key.first].max_per_node = std::max(classes[key.first].max_per_node, static_cast<int>(ranks.size()));
  }
  // Slowest first: the order of stages in a pipeline (the paper's
  // heterogeneous strategies put the slow devices on the first stages,
  // which keep the most micro-batches alive under 1F1B, and the fast ones
  // last, where the LM head is).
  std::stable_sort(classes.begin(), classes.end(), [](const DeviceClass& a, const DeviceClass& b) {
    return a.seconds_per_layer > b.seconds_per_layer;
  });
  return classes;
}

// The TP groups of a class at degree tp: consecutive available ranks of a
// node, tp at a time; with `leftovers`, what remains of a node forms groups
// of the largest valid power of two that fits (else it stays idle).
std::vector<Group> make_groups(const DeviceClass& c, int cls, int tp, bool leftovers, const ModelConfig& m) {
  std::vector<Group> groups;
  for (const std::vector<int>& node : c.nodes) {
    size_t i = 0;
    for (; i + tp <= node.size(); i += tp) groups.push_back({{node.begin() + i, node.begin() + i + tp}, cls});
    while (leftovers && i < node.size()) {
      int t = 1;
      while (t * 2 <= static_cast<int>(node.size() - i) && valid_tp(m, t * 2)) t *= 2;
      groups.push_back({{node.begin() + i, node.begin() + i + t}, cls});
      i += t;
    }
  }
  return groups;
}

// Splits `items` into `parts` contiguous blocks whose sizes differ by at
// most one (larger first).
template <typename T>
std::vector<std::vector<T>> blocks(const std::vector<T>& items, int parts) {
  std::vector<std::vector<T>> out(parts);
  const int n = static_cast<int>(items.size());
  int at = 0;
  for (int p = 0; p < parts; ++p) {
    const int size = n / parts + (p < n % parts ? 1 : 0);
    out[p].assign(items.begin() + at, items.begin() + at + size);
    at += size;
  }
  return out;
}

}  // namespace

std::vector<int> Searcher::tp_degrees(int max_per_node) const {
  std::vector<int> out;
  if (!o_.tp_degrees.empty()) {
    for (int t : o_.tp_degrees)
      if (valid_tp(m_, t) && t <= max_per_node) out.push_back(t);
    return out;
  }
  for (int t = 1; t <= max_per_node; t *= 2)
    if (valid_tp(m_, t)) out.push_back(t);
  return out;
}

std::vector<int> Searcher::micro_batch_sizes() const {
  if (!o_.micro_batch_sizes.empty()) return o_.micro_batch_sizes;
  std::vector<int> out;
  for (int b = 1; b <= 8 && b <= o_.global_batch; b *= 2)
    if (o_.global_batch % b == 0) out.push_back(b);
  return out;
}

// First level: configurations are collected, then run best-bound first.
void Searcher::consider(const Config& c) {
  if (static_cast<int>(c.pipelines.size()) >= o_.min_pipelines) configs_.push_back(c);
}

// Pipelines mixing the classes: each class's groups split into P contiguous
// blocks, pipeline p taking block p of every class, stages slowest first.
void Searcher::enumerate_mixed(const std::vector<std::vector<Group>>& per_class, int cp) {
  int most = 0;
  for (const auto& g : per_class) most = std::max(most, static_cast<int>(g.size()));
  for (int P = 1; P <= most && !out_of_time(); ++P) {
    Config c;
    c.cp = cp;
    c.family = "mixed";
    c.pipelines.resize(P);
    for (const auto& groups : per_class) {
      const auto parts = blocks(groups, P);
      for (int p = 0; p < P; ++p) c.pipelines[p].insert(c.pipelines[p].end(), parts[p].begin(), parts[p].end());
    }
    bool empty = false;
    for (const auto& pipe : c.pipelines) empty = empty || pipe.empty();
    if (!empty) consider(c);
  }
}

// Pipelines of one class each: P_c pipelines from class c's groups (0 =
// the class stays idle), every combination.
void Searcher::enumerate_separate(const std::vector<std::vector<Group>>& per_class, int cp) {
  if (per_class.size() < 2) return;
  std::vector<int> count(per_class.size(), 0);
  std::function<void(size_t)> rec = [&](size_t c) {
    if (out_of_time()) return;
    if (c == per_class.size()) {
      Config cfg;
      cfg.cp = cp;
      cfg.family = "separate";
      for (size_t k = 0; k < per_class.size(); ++k)
        if (count[k] > 0)
          for (auto& part : blocks(per_class[k], count[k])) cfg.pipelines.push_back(part);
      if (!cfg.pipelines.empty()) consider(cfg);
      return;
    }
    for (int n = 0; n <= static_cast<int>(per_class[c].size()); ++n) count[c] = n, rec(c + 1);
  };
  rec(0);
}

// Megatron-like: one TP degree everywhere, pp stages, as many pipelines as
// the available ranks fill, ranks in ascending order.
void Searcher::enumerate_symmetric() {
  std::vector<int> ranks;
  for (int r = 0; r < model_.topology().world_size(); ++r)
    if (!o_.unavailable.count(r)) ranks.push_back(r);
  const int n = static_cast<int>(ranks.size());
  const int L = static_cast<int>(m_.num_hidden_layers);
  for (int tp = 1; tp <= n && tp <= 8; tp *= 2) {
    if (!valid_tp(m_, tp)) continue;
    if (!o_.tp_degrees.empty() && std::find(o_.tp_degrees.begin(), o_.tp_degrees.end(), tp) == o_.tp_degrees.end())
      continue;
    for (int pp = 1; pp * tp <= n && pp <= L; ++pp) {
      // As many pipelines as the ranks fill, but no more than the global
      // batch feeds (a sample each at least): on a cluster larger than the
      // batch the other ranks stay idle.
      const int dp = std::min(n / (tp * pp), o_.global_batch);
      if (dp < 1) continue;
      Config c;
      c.family = "symmetric";
      bool inside = true;
      for (int d = 0; d < dp && inside; ++d) {
        std::vector<Group> pipe;
        for (int k = 0; k < pp; ++k) {
          Group g;
          const int at = (d * pp + k) * tp;
          g.ranks.assign(ranks.begin() + at, ranks.begin() + at + tp);
          for (int r : g.ranks) inside = inside && model_.topology().same_node(r, g.ranks.front());
          pipe.push_back(g);
        }
        c.pipelines.push_back(pipe);
      }
      if (inside) consider(c);
    }
  }
}

SearchResult Searcher::run() {
  classes_ = device_classes(model_, o_);
  if (classes_.empty()) fail("[search] no available rank: every rank of the cluster is unavailable");
  // The previous solution's TP degree per class (re-plan).
  std::map<std::string, std::set<int>> previous_tp;
  if (o_.previous)
    for (const Pipeline& p : o_.previous->pipelines)
      for (const Stage& st : p.stages) previous_tp[model_.topology().rank(st.ranks.front()).device_type].insert(st.tp());
  std::vector<std::vector<int>> degrees;
  for (const DeviceClass& c : classes_) {
    std::vector<int> d = tp_degrees(c.max_per_node);
    auto it = previous_tp.find(c.type);
    if (it != previous_tp.end()) {
      std::vector<int> kept;
      for (int t : d)
        if (it->second.count(t)) kept.push_back(t);
      if (!kept.empty()) d = kept;
    }
    if (d.empty()) d = {1};
    degrees.push_back(d);
  }
  enumerate_symmetric();  // first: whatever the time limit leaves, these are there
  for (int cp = 1; cp <= o_.max_cp; cp *= 2) {
    // Every combination of per-class TP degrees.
    std::vector<int> pick(classes_.size(), 0);
    std::function<void(size_t)> rec = [&](size_t k) {
      if (out_of_time()) return;
      if (k == classes_.size()) {
        for (bool leftovers : {false, true}) {
          if (leftovers && cp > 1) continue;
          std::vector<std::vector<Group>> per_class;
          bool any_leftover = false;
          for (size_t c = 0; c < classes_.size(); ++c) {
            const int tp = degrees[c][pick[c]] * cp;
            per_class.push_back(make_groups(classes_[c], static_cast<int>(c), tp, leftovers, m_));
            for (const Group& g : per_class.back()) any_leftover = any_leftover || static_cast<int>(g.ranks.size()) != tp;
          }
          if (leftovers && !any_leftover) continue;
          std::vector<std::vector<Group>> nonempty;
          for (auto& g : per_class)
            if (!g.empty()) nonempty.push_back(g);
          if (nonempty.empty()) continue;
          enumerate_mixed(nonempty, cp);
          enumerate_separate(nonempty, cp);
        }
        return;
      }
      for (size_t i = 0; i < degrees[k].size(); ++i) pick[k] = static_cast<int>(i), rec(k + 1);
    };
    rec(0);
  }
  second_levels();
  refine_sizes();
  SearchResult res;
  std::vector<const Scored*> all;
  for (const auto& [key, s] : scored_) all.push_back(&s);
  std::sort(all.begin(), all.end(), [](const Scored* a, const Scored* b) {
    return a->step != b->step ? a->step < b->step : a->key < b->key;
  });
  for (size_t i = 0; i < all.size() && static_cast<int>(i) < o_.top_k; ++i)
    res.best.push_back({all[i]->strategy, all[i]->step, all[i]->family});
  res.configurations = configurations_;
  res.pruned = pruned_;
  res.ilps = ilps_;
  res.timed_out = timed_out_;
  res.search_s = std::chrono::duration<double>(SteadyClock::now() - start_).count();
  if (res.best.empty()) {
    if (least_missing_rank_ >= 0) {
      const RankInfo& info = model_.topology().rank(least_missing_rank_);
      fail("[search] no strategy fits in memory: even the best candidate needs ",
           static_cast<int64_t>(std::ceil(least_missing_)), " more bytes (",
           least_missing_ / (1024.0 * 1024.0 * 1024.0), " GiB) on rank ", least_missing_rank_, " (",
           info.device_type, ", ", model_.capacity_bytes(least_missing_rank_) / (1024.0 * 1024.0 * 1024.0),
           " GiB)");
    }
    fail("[search] no strategy found for global batch ", o_.global_batch, timed_out_ ? " within the time limit" : "",
         " (", configurations_, " configurations tried)");
  }
  return res;
}

}  // namespace search_detail

using namespace search_detail;

nlohmann::json SearchResult::to_json() const {
  nlohmann::json alts = nlohmann::json::array();
  for (const SearchCandidate& c : best)
    alts.push_back({{"predicted_step_s", c.predicted_step_s}, {"family", c.family}, {"strategy", hspmd::to_json(c.strategy)}});
  return {{"predicted_step_s", best.empty() ? 0.0 : best[0].predicted_step_s},
          {"strategy", best.empty() ? nlohmann::json() : hspmd::to_json(best[0].strategy)},
          {"alternatives", alts},
          {"configurations", configurations},
          {"pruned", pruned},
          {"ilps", ilps},
          {"search_s", search_s},
          {"timed_out", timed_out}};
}

SearchResult search_strategy(const CostModel& model, const SearchOptions& o) {
  if (o.global_batch < 1) fail("[search] --global-batch must be >= 1, got ", o.global_batch);
  if (o.seq_len < 1) fail("[search] --seq-len must be >= 1, got ", o.seq_len);
  if (o.schedule != "1f1b" && o.schedule != "gpipe")
    fail("[search] unknown schedule '", o.schedule, "' (expected 1f1b or gpipe)");
  if (o.top_k < 1) fail("[search] --top must be >= 1, got ", o.top_k);
  if (o.max_cp < 1 || !is_pow2(o.max_cp)) fail("[search] --max-cp must be a power of two, got ", o.max_cp);
  return Searcher(model, o).run();
}

}  // namespace hspmd
