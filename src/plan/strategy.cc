#include "hspmd/plan/strategy.h"

#include <algorithm>
#include <numeric>
#include <climits>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "hspmd/core/json_file.h"

namespace hspmd {
namespace {

using nlohmann::json;

// Reads one JSON object strictly; every error names the file (when any) and
// the place ("pipeline 1 stage 0") it is reading.
class ObjectReader {
 public:
  ObjectReader(const json& j, std::string where, const std::string& source)
      : j_(j), where_(std::move(where)), source_(source) {
    if (!j_.is_object()) fail_here("expected a JSON object, got ", j_.type_name(), " ", json_excerpt(j_));
  }

  template <typename... Args>
  [[noreturn]] void fail_here(const Args&... args) const {
    fail("[strategy] ", source_, source_.empty() ? "" : ": ", where_, where_.empty() ? "" : ": ", args...);
  }

  // Fails on any member whose name is not in `known`.
  void reject_unknown(std::initializer_list<const char*> known) const {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      const std::string& name = it.key();
      const bool ok = std::any_of(known.begin(), known.end(), [&](const char* k) { return name == k; });
      if (!ok) fail_here("unknown field '", shorten(name), "'");
    }
  }

  const json* find(const char* name, bool required) const {
    auto it = j_.find(name);
    if (it != j_.end()) return &*it;
    if (required) fail_here("missing required field '", name, "'");
    return nullptr;
  }

  int integer(const json& v, const std::string& what) const {
    if (!v.is_number_integer()) fail_here(what, " must be an integer, got ", v.type_name(), " ", json_excerpt(v));
    if (v.is_number_unsigned() ? v.get<uint64_t>() > INT_MAX
                               : (v.get<int64_t>() > INT_MAX || v.get<int64_t>() < INT_MIN))
      fail_here(what, " ", json_excerpt(v), " is out of range");
    return v.get<int>();
  }
  void integer(const char* name, int& out, bool required) const {
    if (const json* v = find(name, required)) out = integer(*v, std::string("field '") + name + "'");
  }
  void string(const char* name, std::string& out) const {
    if (const json* v = find(name, false)) {
      if (!v->is_string()) wrong_type(name, "a string", *v);
      out = v->get<std::string>();
    }
  }
  void boolean(const char* name, bool& out) const {
    if (const json* v = find(name, false)) {
      if (!v->is_boolean()) wrong_type(name, "true or false", *v);
      out = v->get<bool>();
    }
  }
  const json& array(const char* name) const {
    const json& v = *find(name, true);
    if (!v.is_array()) wrong_type(name, "an array", v);
    return v;
  }
  [[noreturn]] void wrong_type(const char* name, const char* expected, const json& v) const {
    fail_here("field '", name, "' must be ", expected, ", got ", v.type_name(), " ", json_excerpt(v));
  }

 private:
  const json& j_;
  std::string where_;
  const std::string& source_;
};

std::string place(int p, int s = -1) {
  return "pipeline " + std::to_string(p) + (s >= 0 ? " stage " + std::to_string(s) : "");
}

Stage parse_stage(const json& j, int p, int s, const std::string& source) {
  ObjectReader r(j, place(p, s), source);
  r.reject_unknown({"ranks", "layers", "cp", "recompute"});
  Stage stage;
  for (const json& rank : r.array("ranks")) stage.ranks.push_back(r.integer(rank, "field 'ranks' entry"));
  const json& layers = r.array("layers");
  if (layers.size() != 2) r.wrong_type("layers", "[first, last]", layers);
  stage.first_layer = r.integer(layers[0], "field 'layers' entry");
  stage.last_layer = r.integer(layers[1], "field 'layers' entry");
  r.integer("cp", stage.cp, false);
  r.boolean("recompute", stage.recompute);
  return stage;
}

Pipeline parse_pipeline(const json& j, int p, const std::string& source, bool token_strategy) {
  ObjectReader r(j, place(p), source);
  r.reject_unknown({"micro_batch_size", "micro_batches", "stages", "max_seq_len", "micro_batch_tokens"});
  Pipeline pipeline;
  r.integer("max_seq_len", pipeline.max_seq_len, false);
  r.integer("micro_batch_tokens", pipeline.micro_batch_tokens, false);
  // Token-budget pipelines (either field given) size micro-batches in tokens.
  const bool tokens =
      token_strategy || (j.is_object() && (j.contains("max_seq_len") || j.contains("micro_batch_tokens")));
  r.integer("micro_batch_size", pipeline.micro_batch_size, !tokens);
  r.integer("micro_batches", pipeline.micro_batches, !tokens);
  const json& stages = r.array("stages");
  for (size_t s = 0; s < stages.size(); ++s)
    pipeline.stages.push_back(parse_stage(stages[s], p, static_cast<int>(s), source));
  return pipeline;
}

Strategy parse_strategy(const json& j, const std::string& source) {
  ObjectReader r(j, "", source);
  r.reject_unknown({"description", "schedule", "zero", "pipelines", "max_seq_len", "expert_parallel",
                    "expert_placement"});
  Strategy strategy;
  r.string("description", strategy.description);
  r.integer("max_seq_len", strategy.max_seq_len, false);
  r.string("schedule", strategy.schedule);
  r.boolean("zero", strategy.zero);
  r.integer("expert_parallel", strategy.expert_parallel, false);
  if (j.is_object() && j.contains("expert_placement")) {
    const json& placements = r.array("expert_placement");
    for (size_t i = 0; i < placements.size(); ++i) {
      ObjectReader pr(placements[i], "expert_placement " + std::to_string(i), source);
      pr.reject_unknown({"layers", "experts"});
      ExpertPlacement ep;
      const json& layers = pr.array("layers");
      if (layers.size() != 2) pr.wrong_type("layers", "[first, last]", layers);
      ep.first_layer = pr.integer(layers[0], "field 'layers' entry");
      ep.last_layer = pr.integer(layers[1], "field 'layers' entry");
      for (const json& e : pr.array("experts")) {
        if (!e.is_array()) pr.wrong_type("experts", "a list of member lists", e);
        std::vector<int>& m = ep.members.emplace_back();
        for (const json& x : e) m.push_back(pr.integer(x, "field 'experts' entry"));
      }
      strategy.expert_placement.push_back(std::move(ep));
    }
  }
  const json& pipelines = r.array("pipelines");
  for (size_t p = 0; p < pipelines.size(); ++p)
    strategy.pipelines.push_back(parse_pipeline(pipelines[p], static_cast<int>(p), source, strategy.max_seq_len > 0));
  return strategy;
}

// ---- validation ----

template <typename... Args>
[[noreturn]] void fail_at(int p, int s, const Args&... args) {
  fail("[strategy] ", place(p, s), ": ", args...);
}

std::string layer_range(const Stage& st) {
  return "layers [" + std::to_string(st.first_layer) + ", " + std::to_string(st.last_layer) + "]";
}

// Where each rank was first seen, to name both places of a duplicate.
using RankOwners = std::map<int, std::pair<int, int>>;

void validate_ranks(const Stage& st, int p, int s, int world_size, RankOwners& owners) {
  if (st.ranks.empty()) fail_at(p, s, "a stage needs at least one rank");
  for (int rank : st.ranks) {
    if (rank < 0 || rank >= world_size)
      fail_at(p, s, "rank ", rank, " is outside the world of ", world_size, " ranks");
    auto [it, fresh] = owners.emplace(rank, std::make_pair(p, s));
    if (!fresh)
      fail_at(p, s, "rank ", rank, " appears twice (", place(it->second.first, it->second.second), " and ",
              place(p, s), ")");
  }
  if (st.cp < 1) fail_at(p, s, "cp=", st.cp, " must be at least 1");
  if (st.ranks.size() % st.cp != 0)
    fail_at(p, s, "cp=", st.cp, " does not divide the stage's ", st.ranks.size(), " ranks");
}

void validate_tp(const Stage& st, int p, int s, const ModelConfig& c) {
  const int64_t tp = st.tp();
  const std::pair<const char*, int64_t> sizes[] = {{"num_attention_heads", c.num_attention_heads},
                                                   {"num_key_value_heads", c.kv_heads()},
                                                   {"intermediate_size", c.intermediate_size}};
  for (const auto& [name, size] : sizes)
    if (size % tp != 0) fail_at(p, s, "tp=", tp, " does not divide ", name, "=", size);
}

// The pipelines' stages as layer ranges: equal ones run the same schedule.
std::vector<std::pair<int, int>> stage_layers(const Pipeline& p) {
  std::vector<std::pair<int, int>> out;
  for (const Stage& st : p.stages) out.emplace_back(st.first_layer, st.last_layer);
  return out;
}

void validate_expert_placement(const Strategy& strategy, const ModelConfig& c) {
  const int g = strategy.expert_parallel;
  std::vector<int> taken(static_cast<size_t>(std::max<int64_t>(0, c.num_hidden_layers)), -1);
  for (size_t i = 0; i < strategy.expert_placement.size(); ++i) {
    const ExpertPlacement& ep = strategy.expert_placement[i];
    const std::string where = "[strategy] expert_placement " + std::to_string(i) + ": ";
    if (g <= 1) fail(where, "needs expert_parallel above 1");
    if (ep.first_layer < 0 || ep.first_layer > ep.last_layer || ep.last_layer >= c.num_hidden_layers)
      fail(where, "layers [", ep.first_layer, ", ", ep.last_layer, "] are not a range of the model's ",
           c.num_hidden_layers, " layers");
    for (int l = ep.first_layer; l <= ep.last_layer; ++l) {
      if (taken[l] >= 0) fail(where, "layer ", l, " is also placed by expert_placement ", taken[l]);
      taken[l] = static_cast<int>(i);
    }
    if (static_cast<int64_t>(ep.members.size()) != c.moe.num_experts)
      fail(where, "lists ", ep.members.size(), " experts, the model has ", c.moe.num_experts);
    std::vector<bool> used(g, false);
    for (size_t e = 0; e < ep.members.size(); ++e) {
      const std::vector<int>& m = ep.members[e];
      if (m.empty()) fail(where, "expert ", e, " has no member: every expert needs one");
      std::set<int> seen;
      for (int x : m) {
        if (x < 0 || x >= g) fail(where, "expert ", e, ": member ", x, " is outside [0, ", g, ")");
        if (!seen.insert(x).second) fail(where, "expert ", e, ": member ", x, " is listed twice");
        used[x] = true;
      }
    }
    for (int x = 0; x < g; ++x)
      if (!used[x]) fail(where, "member ", x, " holds no expert: every member of a group holds one");
  }
}

void validate_expert_parallel(const Strategy& strategy, const ModelConfig& c) {
  const int g = strategy.expert_parallel;
  if (g < 1) fail("[strategy] expert_parallel=", g, " must be at least 1");
  validate_expert_placement(strategy, c);
  if (g == 1) return;
  const int64_t experts = c.moe.num_experts;
  if (experts <= 0 || c.sparse_layers() == 0)
    fail("[strategy] expert_parallel=", g, " needs a model with mixture-of-experts layers");
  if (experts % g != 0)
    fail("[strategy] expert_parallel=", g, " does not divide the ", experts, " experts");
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.moe.sparse_layer(l)) continue;
    int slots = 0;
    for (size_t p = 0; p < strategy.pipelines.size(); ++p)
      for (size_t s = 0; s < strategy.pipelines[p].stages.size(); ++s) {
        const Stage& st = strategy.pipelines[p].stages[s];
        if (l < st.first_layer || l > st.last_layer) continue;
        slots += st.cp;
        if (st.recompute)
          fail_at(static_cast<int>(p), static_cast<int>(s), "recompute is not supported with expert_parallel=", g,
                  " on a stage holding sparse layer ", l, " (its expert exchange would run again in the backward)");
      }
    if (slots % g != 0)
      fail("[strategy] expert_parallel=", g, " does not divide the ", slots, " token slots of sparse layer ", l,
           " (a slot: one cp chunk of the stage holding the layer in one pipeline)");
    for (const std::vector<int>& pipelines : expert_groups(strategy, l).pipelines) {
      if (pipelines.size() < 2) continue;
      const Pipeline& first = strategy.pipelines[pipelines.front()];
      for (int p : pipelines) {
        const Pipeline& other = strategy.pipelines[p];
        if (strategy.max_seq_len > 0)
          fail("[strategy] expert_parallel=", g, ": token-budget steps (max_seq_len) cannot run an expert group across "
               "pipelines ", pipelines.front(), " and ", p, " (their micro-batch counts vary per step)");
        if (other.micro_batches != first.micro_batches)
          fail("[strategy] expert_parallel=", g, ": sparse layer ", l, "'s expert group spans pipelines ",
               pipelines.front(), " and ", p, ", whose micro_batches differ (", first.micro_batches, " vs ",
               other.micro_batches, "): they exchange tokens every micro-batch");
        if (strategy.schedule != "gpipe" && stage_layers(other) != stage_layers(first))
          fail("[strategy] expert_parallel=", g, ": sparse layer ", l, "'s expert group spans pipelines ",
               pipelines.front(), " and ", p, ", whose stages hold different layers: use \"schedule\": \"gpipe\" "
               "(under 1f1b their exchanges would wait on each other in different orders)");
      }
    }
  }
}

// `next` is the first layer the stage must start at (the previous stage's last + 1).
void validate_layers(const Stage& st, int p, int s, int num_layers, int next) {
  if (st.first_layer > st.last_layer) fail_at(p, s, layer_range(st), " are reversed (first > last)");
  if (st.first_layer < 0 || st.last_layer >= num_layers)
    fail_at(p, s, layer_range(st), " are outside the model's ", num_layers, " layers [0, ", num_layers - 1,
            "]");
  if (st.first_layer > next)
    fail_at(p, s, layer_range(st),
            next == 0 ? std::string(" do not start at layer 0")
                      : " leave a gap after layer " + std::to_string(next - 1));
  if (st.first_layer < next)
    fail_at(p, s, layer_range(st), " overlap the previous stage, which ends at layer ", next - 1);
}

void validate_pipeline(const Pipeline& pl, int p, const ModelConfig& c, int world_size, RankOwners& owners) {
  if (pl.micro_batch_size < 1)
    fail_at(p, -1, "micro_batch_size=", pl.micro_batch_size, " must be at least 1");
  if (pl.micro_batches < 1) fail_at(p, -1, "micro_batches=", pl.micro_batches, " must be at least 1");
  if (pl.stages.empty()) fail_at(p, -1, "a pipeline needs at least one stage");
  if (pl.max_seq_len < 0) fail_at(p, -1, "max_seq_len=", pl.max_seq_len, " must be positive");
  if (pl.micro_batch_tokens < 0)
    fail_at(p, -1, "micro_batch_tokens=", pl.micro_batch_tokens, " must be positive");
  if (pl.max_seq_len > 0 && pl.micro_batch_tokens > 0 && pl.micro_batch_tokens < pl.max_seq_len)
    fail_at(p, -1, "micro_batch_tokens=", pl.micro_batch_tokens, " cannot hold a piece of its max_seq_len=",
            pl.max_seq_len);
  const int num_layers = static_cast<int>(c.num_hidden_layers);
  int next = 0;
  for (size_t i = 0; i < pl.stages.size(); ++i) {
    const Stage& st = pl.stages[i];
    const int s = static_cast<int>(i);
    validate_ranks(st, p, s, world_size, owners);
    validate_layers(st, p, s, num_layers, next);
    validate_tp(st, p, s, c);
    next = st.last_layer + 1;
  }
  if (next != num_layers)
    fail_at(p, static_cast<int>(pl.stages.size()) - 1, "the stages end at layer ", next - 1,
            " but the model has ", num_layers, " layers [0, ", num_layers - 1, "]");
}

}  // namespace

int Strategy::global_batch() const {
  int total = 0;
  for (const auto& p : pipelines) total += p.batch();
  return total;
}

std::vector<int> Strategy::ranks() const {
  std::set<int> all;
  for (const auto& p : pipelines)
    for (const auto& s : p.stages) all.insert(s.ranks.begin(), s.ranks.end());
  return {all.begin(), all.end()};
}

Strategy strategy_from_json(const json& j) { return parse_strategy(j, ""); }

Strategy load_strategy(const std::string& path) {
  return parse_strategy(read_json_file(path, "strategy"), path);
}

json to_json(const Strategy& strategy) {
  json pipelines = json::array();
  for (const auto& p : strategy.pipelines) {
    json stages = json::array();
    for (const auto& s : p.stages) {
      json stage = {{"ranks", s.ranks}, {"layers", {s.first_layer, s.last_layer}}};
      if (s.cp != 1) stage["cp"] = s.cp;
      if (s.recompute) stage["recompute"] = true;
      stages.push_back(std::move(stage));
    }
    json pl = {{"micro_batch_size", p.micro_batch_size}, {"micro_batches", p.micro_batches}, {"stages", stages}};
    if (p.max_seq_len > 0) pl["max_seq_len"] = p.max_seq_len;
    if (p.micro_batch_tokens > 0) pl["micro_batch_tokens"] = p.micro_batch_tokens;
    pipelines.push_back(std::move(pl));
  }
  json j = {{"schedule", strategy.schedule}, {"zero", strategy.zero}, {"pipelines", pipelines}};
  if (!strategy.description.empty()) j["description"] = strategy.description;
  if (strategy.max_seq_len > 0) j["max_seq_len"] = strategy.max_seq_len;
  if (strategy.expert_parallel != 1) j["expert_parallel"] = strategy.expert_parallel;
  if (!strategy.expert_placement.empty()) {
    json placements = json::array();
    for (const ExpertPlacement& ep : strategy.expert_placement)
      placements.push_back({{"layers", {ep.first_layer, ep.last_layer}}, {"experts", ep.members}});
    j["expert_placement"] = std::move(placements);
  }
  return j;
}

void validate(const Strategy& strategy, const ModelConfig& config, int world_size) {
  if (world_size < 1) fail("[strategy] world size must be positive, got ", world_size);
  if (world_size > kMaxWorldSize)
    fail("[strategy] world size ", world_size, " is above the limit of ", kMaxWorldSize, " ranks");
  if (strategy.schedule != "1f1b" && strategy.schedule != "gpipe")
    fail("[strategy] unknown schedule '", shorten(strategy.schedule), "' (expected 1f1b or gpipe)");
  if (strategy.pipelines.empty()) fail("[strategy] no pipelines: a strategy needs at least one");
  if (strategy.max_seq_len < 0) fail("[strategy] max_seq_len=", strategy.max_seq_len, " must be positive");
  RankOwners owners;
  for (size_t p = 0; p < strategy.pipelines.size(); ++p) {
    validate_pipeline(strategy.pipelines[p], static_cast<int>(p), config, world_size, owners);
    if (strategy.max_seq_len > 0 && strategy.pipelines[p].max_seq_len > strategy.max_seq_len)
      fail_at(static_cast<int>(p), -1, "max_seq_len=", strategy.pipelines[p].max_seq_len,
              " is above the strategy's max_seq_len=", strategy.max_seq_len);
  }
  validate_expert_parallel(strategy, config);
}

std::vector<int> expert_members(const Strategy& strategy, int64_t layer, int64_t expert, int64_t experts) {
  for (const ExpertPlacement& ep : strategy.expert_placement)
    if (ep.first_layer <= layer && layer <= ep.last_layer && expert < static_cast<int64_t>(ep.members.size())) {
      std::vector<int> m = ep.members[expert];
      std::sort(m.begin(), m.end());
      return m;
    }
  const int64_t g = std::max(1, strategy.expert_parallel);
  return {static_cast<int>(expert / std::max<int64_t>(1, experts / g))};
}

ExpertGroups expert_groups(const Strategy& strategy, int64_t layer) {
  std::vector<std::pair<int, std::vector<int>>> slots;  // (pipeline, ranks)
  for (size_t p = 0; p < strategy.pipelines.size(); ++p)
    for (const Stage& st : strategy.pipelines[p].stages) {
      if (layer < st.first_layer || layer > st.last_layer) continue;
      const int tp = st.tp();
      for (int c = 0; c < st.cp; ++c)
        slots.emplace_back(static_cast<int>(p),
                           std::vector<int>(st.ranks.begin() + c * tp, st.ranks.begin() + (c + 1) * tp));
    }
  const int g = std::max(1, strategy.expert_parallel);
  ExpertGroups out;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (i % g == 0) out.slots.emplace_back(), out.pipelines.emplace_back();
    out.slots.back().push_back(slots[i].second);
    std::vector<int>& pl = out.pipelines.back();
    if (std::find(pl.begin(), pl.end(), slots[i].first) == pl.end()) pl.push_back(slots[i].first);
  }
  return out;
}

int64_t sequence_granularity(const Strategy& strategy) {
  int64_t g = 1;
  for (const Pipeline& p : strategy.pipelines)
    for (const Stage& st : p.stages) {
      g = std::lcm(g, static_cast<int64_t>(st.cp) * st.tp());
      if (st.cp > 1) g = std::lcm(g, int64_t{2} * st.cp);
    }
  return g;
}

std::vector<int> idle_ranks(const Strategy& strategy, int world_size) {
  const std::vector<int> used = strategy.ranks();
  std::vector<int> idle;
  for (int r = 0; r < world_size; ++r)
    if (!std::binary_search(used.begin(), used.end(), r)) idle.push_back(r);
  return idle;
}

std::string format_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(ranks[i]);
    if (j > i) {
      out += '-';
      out += std::to_string(ranks[j]);
    }
    i = j + 1;
  }
  return out;
}

DispatchRule parse_dispatch_rule(const std::string& name) {
  if (name == "cost") return DispatchRule::kCost;
  if (name == "symmetric") return DispatchRule::kSymmetric;
  fail(options_tag(), " ", option_name("dispatch"), " must be cost or symmetric, got '", name, "'");
}

}  // namespace hspmd
