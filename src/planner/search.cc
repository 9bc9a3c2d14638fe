// The strategy search (docs/planner.md), first level: the device classes,
// their TP groups, the enumeration of configurations (symmetric, mixed,
// separate), Searcher::run and search_strategy. The second level, which
// scores the configurations, is in search_second_level.cc.
#include "hspmd/planner/search.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <cstdio>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "planner/search_internal.h"

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
std::vector<Group> make_groups(const DeviceClass& c, int cls, int tp, bool leftovers, const ModelConfig& m,
                               const Topology& t) {
  std::vector<Group> groups;
  for (const std::vector<int>& node : c.nodes) {
    const int where = t.node_of(node.front());  // a class's ranks of one node
    size_t i = 0;
    for (; i + tp <= node.size(); i += tp) groups.push_back({{node.begin() + i, node.begin() + i + tp}, cls, where});
    while (leftovers && i < node.size()) {
      int k = 1;
      while (k * 2 <= static_cast<int>(node.size() - i) && valid_tp(m, k * 2)) k *= 2;
      groups.push_back({{node.begin() + i, node.begin() + i + k}, cls, where});
      i += k;
    }
  }
  return groups;
}

// Splits n items into `parts` contiguous blocks [first, second) whose sizes
// differ by at most one (larger first).
std::vector<std::pair<int, int>> blocks(int n, int parts) {
  std::vector<std::pair<int, int>> out(parts);
  int at = 0;
  for (int p = 0; p < parts; ++p) {
    const int size = n / parts + (p < n % parts ? 1 : 0);
    out[p] = {at, at + size};
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

Group Searcher::group_of(std::vector<int> ranks) const {
  Group g;
  g.ranks = std::move(ranks);
  g.cls = rank_class_[g.ranks.front()];
  g.node = model_.topology().node_of(g.ranks.front());
  for (int r : g.ranks) {
    if (rank_class_[r] != g.cls) g.cls = -1;
    if (model_.topology().node_of(r) != g.node) g.node = -1;
  }
  if (g.cls < 0 || g.node < 0) g.cls = g.node = -1;
  return g;
}

bool Searcher::runnable(int64_t stages, int64_t pipelines, int64_t longest) const {
  if (longest > m_.num_hidden_layers || pipelines < 1) return false;
  const int64_t least = o_.schedule == "gpipe" ? pipelines : stages;  // micro-batches, at least
  return least * least_b_ <= o_.global_batch;
}

// First level: configurations are collected, then run best-bound first.
void Searcher::consider(ConfigRef c) {
  const int pipelines = c.symmetric >= 0 ? static_cast<int>(symmetric_[c.symmetric].pipelines.size()) : c.P;
  if (pipelines < o_.min_pipelines || full()) return;
  configs_.push_back(c);
}

bool Searcher::full() {
  if (configs_.size() < kMaxConfigs) return false;
  limit("the enumeration stopped at " + std::to_string(kMaxConfigs) + " configurations");
  return true;
}

Config Searcher::config(size_t i) const {
  const ConfigRef& r = configs_[i];
  if (r.symmetric >= 0) return symmetric_[r.symmetric];
  const std::vector<std::vector<Group>>& per_class = group_sets_[r.set];
  Config c;
  c.cp = r.cp;
  if (r.mixed) {
    c.family = "mixed";
    c.pipelines.resize(r.P);
    for (const auto& groups : per_class) {
      const auto parts = blocks(static_cast<int>(groups.size()), r.P);
      for (int p = 0; p < r.P; ++p)
        for (int i = parts[p].first; i < parts[p].second; ++i) c.pipelines[p].push_back(&groups[i]);
    }
  } else {
    c.family = "separate";
    for (size_t k = 0; k < per_class.size(); ++k)
      if (counts_[r.counts + k] > 0)
        for (const auto& [from, to] : blocks(static_cast<int>(per_class[k].size()), counts_[r.counts + k])) {
          Pipe pipe;
          for (int i = from; i < to; ++i) pipe.push_back(&per_class[k][i]);
          c.pipelines.push_back(std::move(pipe));
        }
  }
  return c;
}

// Pipelines mixing the classes: each class's groups split into P contiguous
// blocks, pipeline p taking block p of every class, stages slowest first.
// Every group takes work, so only P matters to whether the batch can feed
// them: pipeline 0 has the most stages.
void Searcher::enumerate_mixed(int set, int cp) {
  const std::vector<std::vector<Group>>& per_class = group_sets_[set];
  int most = 0;
  int64_t groups = 0;
  for (const auto& g : per_class) most = std::max(most, static_cast<int>(g.size())), groups += static_cast<int64_t>(g.size());
  for (int P = 1; P <= most && !out_of_time() && !full(); ++P) {
    int64_t longest = 0;
    for (const auto& g : per_class) longest += (static_cast<int64_t>(g.size()) + P - 1) / P;
    if (!runnable(groups, P, longest)) continue;
    ConfigRef c;
    c.set = set;
    c.cp = cp;
    c.mixed = true;
    c.P = P;
    consider(std::move(c));
  }
}

// Pipelines of one class each: P_c pipelines from class c's groups (0 =
// the class stays idle), every combination the batch can feed.
void Searcher::enumerate_separate(int set, int cp) {
  const std::vector<std::vector<Group>>& per_class = group_sets_[set];
  if (per_class.size() < 2) return;
  const int64_t L = m_.num_hidden_layers;
  std::vector<int> count(per_class.size(), 0);
  std::function<void(size_t, int64_t, int64_t, int64_t)> rec = [&](size_t c, int64_t stages, int64_t pipelines,
                                                                   int64_t longest) {
    if (out_of_time() || full()) return;
    // Stages and pipelines only grow: a partial choice the batch cannot
    // feed stays so (pipelines: 0 only while nothing is chosen).
    if (pipelines > 0 && !runnable(stages, pipelines, longest)) return;
    if (c == per_class.size()) {
      if (pipelines == 0) return;
      ConfigRef cfg;
      cfg.set = set;
      cfg.cp = cp;
      cfg.P = static_cast<int>(pipelines);
      if (pipelines < o_.min_pipelines || full()) return;
      cfg.counts = static_cast<uint32_t>(counts_.size());
      counts_.insert(counts_.end(), count.begin(), count.end());
      consider(cfg);
      return;
    }
    const int64_t g = static_cast<int64_t>(per_class[c].size());
    count[c] = 0;
    rec(c + 1, stages, pipelines, longest);
    // At most L stages a pipeline: at least ceil(g / L) pipelines.
    for (int64_t n = std::max<int64_t>(1, (g + L - 1) / L); n <= g && !timed_out_; ++n) {
      count[c] = static_cast<int>(n);
      rec(c + 1, stages + g, pipelines + n, std::max(longest, (g + n - 1) / n));
      if (o_.schedule == "gpipe" && !runnable(stages + g, pipelines + n, 0)) break;  // more pipelines: no better
    }
    count[c] = 0;
  };
  rec(0, 0, 0, 0);
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
    // Even past the limit: the fallback's candidates (at most 4 L of them).
    for (int pp = 1; pp * tp <= n && pp <= L; ++pp) {
      // As many pipelines as the ranks fill, but no more than the global
      // batch feeds (under 1F1B pp micro-batches each at least, of the
      // smallest size; GPipe one): on a cluster larger than the batch the
      // other ranks stay idle.
      const int fed = o_.global_batch / least_b_ / (o_.schedule == "gpipe" ? 1 : pp);
      const int dp = std::min(n / (tp * pp), fed);
      if (dp < 1) continue;
      std::vector<Group> groups;
      bool inside = true;
      for (int at = 0; at < dp * pp * tp && inside; at += tp) {
        groups.push_back(group_of({ranks.begin() + at, ranks.begin() + at + tp}));
        for (int r : groups.back().ranks) inside = inside && model_.topology().same_node(r, groups.back().ranks.front());
      }
      if (!inside) continue;
      const std::vector<Group>& owned = symmetric_groups_.emplace_back(std::move(groups));
      Config c;
      c.family = "symmetric";
      for (int d = 0; d < dp; ++d) {
        Pipe pipe;
        for (int k = 0; k < pp; ++k) pipe.push_back(&owned[d * pp + k]);
        c.pipelines.push_back(std::move(pipe));
      }
      symmetric_.push_back(std::move(c));
      ConfigRef ref;
      ref.symmetric = static_cast<int>(symmetric_.size()) - 1;
      consider(std::move(ref));
    }
  }
}

SearchResult Searcher::run() {
  phase_ = "the device classes";
  classify_ranks();
  index_device_types();
  {
    const std::vector<int> sizes = micro_batch_sizes();
    least_b_ = sizes.empty() ? o_.global_batch + 1 : *std::min_element(sizes.begin(), sizes.end());
  }
  const std::vector<std::vector<int>> degrees = class_tp_degrees();
  phase_ = "the enumeration of configurations";
  enumerate_symmetric();  // first: whatever the time limit leaves, these are there
  for (int cp = 1; cp <= o_.max_cp; cp *= 2) enumerate_tp_combinations(degrees, cp);
  second_levels();
  phase_ = "the micro-batch sizes pass";
  refine_sizes();
  SearchResult res = result();
  if (res.best.empty()) fail_nothing_found();
  return res;
}

void Searcher::classify_ranks() {
  classes_ = device_classes(model_, o_);
  if (classes_.empty()) fail("[search] no available rank: every rank of the cluster is unavailable");
  rank_class_.assign(model_.topology().world_size(), -1);
  for (size_t c = 0; c < classes_.size(); ++c)
    for (const std::vector<int>& node : classes_[c].nodes)
      for (int r : node) rank_class_[r] = static_cast<int>(c);
}

void Searcher::index_device_types() {
  std::map<std::string, int> type_ids;
  const Topology& t = model_.topology();
  rank_type_.resize(t.world_size());
  for (int r = 0; r < t.world_size(); ++r) {
    rank_type_[r] = type_ids.emplace(t.rank(r).device_type, static_cast<int>(type_ids.size())).first->second;
    num_nodes_ = std::max(num_nodes_, t.node_of(r) + 1);
  }
  type_names_ = type_ids.size();
  std::vector<int> rep(type_names_, 0);
  for (int r = t.world_size() - 1; r >= 0; --r) rep[rank_type_[r]] = r;
  link_gbps_.assign(type_names_ * type_names_ * 2, 0);
  for (size_t a = 0; a < type_names_; ++a)
    for (size_t b = 0; b < type_names_; ++b) {
      const DeviceSpec &x = t.device_type(rep[a]), &y = t.device_type(rep[b]);
      link_gbps_[(a * type_names_ + b) * 2] = std::min(x.intra_node_gbps, y.intra_node_gbps);
      link_gbps_[(a * type_names_ + b) * 2 + 1] = std::min(x.inter_node_gbps, y.inter_node_gbps);
    }
}

std::vector<std::vector<int>> Searcher::class_tp_degrees() const {
  // The previous solution's TP degrees per device type (re-plan).
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
  return degrees;
}

void Searcher::enumerate_tp_combinations(const std::vector<std::vector<int>>& degrees, int cp) {
  std::vector<int> pick(classes_.size(), 0);
  std::function<void(size_t)> rec = [&](size_t k) {
    if (out_of_time()) return;
    if (k == classes_.size()) {
      std::vector<int> tps(classes_.size());
      for (size_t c = 0; c < classes_.size(); ++c) tps[c] = degrees[c][pick[c]] * cp;
      enumerate_group_sets(tps, cp);
      return;
    }
    for (size_t i = 0; i < degrees[k].size(); ++i) pick[k] = static_cast<int>(i), rec(k + 1);
  };
  rec(0);
}

void Searcher::enumerate_group_sets(const std::vector<int>& tps, int cp) {
  for (bool leftovers : {false, true}) {
    if (leftovers && cp > 1) continue;
    std::vector<std::vector<Group>> per_class;
    bool any_leftover = false;
    for (size_t c = 0; c < classes_.size(); ++c) {
      per_class.push_back(make_groups(classes_[c], static_cast<int>(c), tps[c], leftovers, m_, model_.topology()));
      for (const Group& g : per_class.back()) any_leftover = any_leftover || static_cast<int>(g.ranks.size()) != tps[c];
    }
    if (leftovers && !any_leftover) continue;
    std::vector<std::vector<Group>> nonempty;
    for (auto& g : per_class)
      if (!g.empty()) nonempty.push_back(g);
    if (nonempty.empty()) continue;
    group_sets_.push_back(std::move(nonempty));
    const int set = static_cast<int>(group_sets_.size()) - 1;
    const size_t before = configs_.size();
    enumerate_mixed(set, cp);
    enumerate_separate(set, cp);
    if (configs_.size() == before) group_sets_.pop_back();  // nothing the batch can feed
  }
}

SearchResult Searcher::result() const {
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
  res.timed_out = timed_out_ || limited_;
  res.search_s = elapsed();
  if (res.timed_out) res.note = limit_note(res.search_s);
  return res;
}

std::string Searcher::limit_note(double search_s) const {
  char text[128], seconds[32];
  std::snprintf(seconds, sizeof seconds, "%.2f", search_s);
  std::snprintf(text, sizeof text, "[search] time limit of %g s%s", o_.time_limit_s,
                limit_what_.rfind("reached", 0) == 0 ? " " : ": ");
  return text + limit_what_ + " (" + std::to_string(configs_.size()) + " configurations, " +
         std::to_string(bounded_) + " bounded, " + std::to_string(configurations_) + " solved, " +
         std::to_string(pruned_) + " pruned in " + seconds + " s)" +
         (fell_back_ ? ": answering with the fallback, the symmetric (Megatron-like) strategy of the fewest "
                       "stages that fits"
                     : ": answering with the best of the " + std::to_string(scored_.size()) +
                           " strategies scored");
}

void Searcher::fail_nothing_found() const {
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

}  // namespace search_detail

using namespace search_detail;

nlohmann::json SearchResult::to_json() const {
  nlohmann::json alts = nlohmann::json::array();
  for (const SearchCandidate& c : best)
    alts.push_back({{"predicted_step_s", c.predicted_step_s}, {"family", c.family}, {"strategy", hspmd::to_json(c.strategy)}});
  nlohmann::json j = {{"predicted_step_s", best.empty() ? 0.0 : best[0].predicted_step_s},
                      {"strategy", best.empty() ? nlohmann::json() : hspmd::to_json(best[0].strategy)},
                      {"alternatives", alts},
                      {"configurations", configurations},
                      {"pruned", pruned},
                      {"ilps", ilps},
                      {"search_s", search_s},
                      {"timed_out", timed_out}};
  if (!note.empty()) j["note"] = note;
  return j;
}

SearchResult search_strategy(const CostModel& model, const SearchOptions& o) {
  if (o.global_batch < 1) fail("[search] ", option_name("global_batch"), " must be >= 1, got ", o.global_batch);
  if (o.seq_len < 1) fail("[search] ", option_name("seq_len"), " must be >= 1, got ", o.seq_len);
  if (o.schedule != "1f1b" && o.schedule != "gpipe")
    fail("[search] unknown schedule '", o.schedule, "' (expected 1f1b or gpipe)");
  if (o.top_k < 1) fail("[search] ", option_name("top"), " must be >= 1, got ", o.top_k);
  if (o.max_cp < 1 || !is_pow2(o.max_cp)) fail("[search] ", option_name("max_cp"), " must be a power of two, got ", o.max_cp);
  return Searcher(model, o).run();
}

}  // namespace hspmd
