// The state tensors of a plan switch (docs/switching.md): which boxes of a
// run's training state every rank holds before and after, the names of
// algorithms and slots, the JSON report and the switch-plan cache.
#include <algorithm>
#include <string>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "hspmd/models/model.h"
#include "hspmd/plan/plan.h"
#include "hspmd/plan/switch.h"

namespace hspmd {
namespace {

// Embedding 0, block i -> i + 1, the final norm and LM head L + 1 (the
// model's declared parts, not its names).
int layer_group(const ModelParameter& p, int64_t layers) {
  if (p.part == ModelPart::kEmbedding) return 0;
  if (p.part == ModelPart::kBlock) return static_cast<int>(p.layer) + 1;
  return static_cast<int>(layers) + 1;
}

using Params = std::vector<ModelParameter>;

// Same parameters in the same order with the same shapes, except the rows of
// the vocabulary tables (a vocabulary padded for another tp).
void check_same_model(const Params& from, const Params& to) {
  if (from.size() != to.size())
    fail("[switch] plans of different models: ", from.size(), " parameters in the source plan, ", to.size(),
         " in the destination plan");
  for (size_t i = 0; i < from.size(); ++i) {
    const std::string &a = from[i].name, &b = to[i].name;
    const Shape &sa = from[i].shape, &sb = to[i].shape;
    if (a != b)
      fail("[switch] plans of different models: parameter ", i, " is '", a, "' in the source plan and '", b,
           "' in the destination plan");
    Shape ra = sa, rb = sb;
    if (from[i].role == ParamRole::kVocabulary && !ra.empty() && !rb.empty()) ra[0] = rb[0] = 0;
    if (ra != rb)
      fail("[switch] plans of different models: parameter '", a, "' has shape ", shape_str(sa),
           " in the source plan and ", shape_str(sb), " in the destination plan");
  }
}

void add_holdings(const Annotation& a, const Shape& shape, StateSlot slot, std::vector<StateHolding>& out) {
  for (int rank : a.all_ranks()) {
    std::optional<Box> box = local_box(a, shape, rank);
    HSPMD_CHECK(box.has_value(), "rank ", rank, " of an annotation holds no box");
    out.push_back(StateHolding{rank, std::move(*box), slot});
  }
}

void sort_holdings(std::vector<StateHolding>& hs) {
  std::sort(hs.begin(), hs.end(), [](const StateHolding& a, const StateHolding& b) {
    return a.rank != b.rank ? a.rank < b.rank : a.slot < b.slot;
  });
}

// The holdings of `kind` for one parameter under one plan. As a source
// (`owner`) under mixed precision with ZeRO, only the f32 master shards
// count: the gathered parameters are bf16 compute copies.
std::vector<StateHolding> holdings(const AnnotationPlan& plan, const std::string& name, const Shape& shape,
                                   StateSlot kind, bool owner) {
  const bool masters_only = owner && plan.precision.mixed() && plan.optimizer_states.count(name);
  const std::vector<StateSlot> slots =
      kind != StateSlot::kParam ? std::vector<StateSlot>{kind}
      : masters_only             ? std::vector<StateSlot>{StateSlot::kMaster}
                                : std::vector<StateSlot>{StateSlot::kParam, StateSlot::kMaster};
  std::vector<StateHolding> out;
  for (StateSlot slot : slots)
    if (const Annotation* a = slot_layout(plan, name, slot)) add_holdings(*a, shape, slot, out);
  sort_holdings(out);
  return out;
}

}  // namespace

std::string algorithm_name(SwitchAlgorithm algorithm) {
  switch (algorithm) {
    case SwitchAlgorithm::kNaive:
      return "naive";
    case SwitchAlgorithm::kPerTensor:
      return "per-tensor";
    case SwitchAlgorithm::kFused:
      return "fused";
  }
  HSPMD_CHECK(false, "unknown switch algorithm ", static_cast<int>(algorithm));
  return {};
}

SwitchAlgorithm parse_switch_algorithm(const std::string& s, const std::string& flag) {
  for (SwitchAlgorithm a : {SwitchAlgorithm::kNaive, SwitchAlgorithm::kPerTensor, SwitchAlgorithm::kFused})
    if (s == algorithm_name(a)) return a;
  fail(options_tag(), " ", flag, ": unknown switch algorithm '", s, "' (expected naive, per-tensor or fused)");
}

std::string slot_name(StateSlot slot) {
  switch (slot) {
    case StateSlot::kParam:
      return "param";
    case StateSlot::kMaster:
      return "master";
    case StateSlot::kExpAvg:
      return "exp_avg";
    case StateSlot::kExpAvgSq:
      return "exp_avg_sq";
  }
  HSPMD_CHECK(false, "unknown state slot ", static_cast<int>(slot));
  return {};
}

const Annotation* slot_layout(const AnnotationPlan& plan, const std::string& param, StateSlot slot) {
  auto p = plan.tensors.find(param);
  if (p == plan.tensors.end()) fail("[switch] plan: parameter '", param, "' has no annotation");
  auto z = plan.optimizer_states.find(param);
  const Annotation* zero = z == plan.optimizer_states.end() ? nullptr : &z->second;
  if (slot == StateSlot::kParam) return &p->second;
  if (slot == StateSlot::kMaster) return zero;
  return zero ? zero : &p->second;
}

std::string state_tensor_name(const std::string& param, StateSlot kind) {
  if (kind == StateSlot::kExpAvg) return param + ".exp_avg";
  if (kind == StateSlot::kExpAvgSq) return param + ".exp_avg_sq";
  return param;
}

std::vector<StateTensor> state_tensors(const AnnotationPlan& from, const AnnotationPlan& to) {
  if (from.world_size != to.world_size)
    fail("[switch] plans of different world sizes: ", from.world_size, " ranks in the source plan, ", to.world_size,
         " in the destination plan");
  const Params src = model_parameters(from.model);
  const Params dst = model_parameters(to.model);
  check_same_model(src, dst);
  std::vector<StateTensor> out;
  out.reserve(3 * dst.size());
  for (size_t i = 0; i < dst.size(); ++i) {
    const std::string& name = dst[i].name;
    for (StateSlot kind : {StateSlot::kParam, StateSlot::kExpAvg, StateSlot::kExpAvgSq}) {
      StateTensor t;
      t.param = name;
      t.kind = kind;
      t.shape = dst[i].shape;
      t.source_shape = src[i].shape;
      t.group = layer_group(dst[i], to.model.num_hidden_layers);
      t.owners = holdings(from, name, t.source_shape, kind, true);
      t.needers = holdings(to, name, t.shape, kind, false);
      out.push_back(std::move(t));
    }
  }
  return out;
}

nlohmann::json to_json(const SwitchPlan& plan) {
  nlohmann::json ranks = nlohmann::json::array();
  int64_t max_rank = 0, total = 0;
  for (size_t r = 0; r < plan.stats.size(); ++r) {
    const RankSwitchStats& s = plan.stats[r];
    max_rank = std::max(max_rank, s.sent());
    total += s.sent();
    ranks.push_back({{"rank", static_cast<int>(r)},
                     {"intra_sent", s.intra_sent},
                     {"intra_received", s.intra_received},
                     {"inter_sent", s.inter_sent},
                     {"inter_received", s.inter_received},
                     {"messages_sent", s.messages_sent},
                     {"messages_received", s.messages_received},
                     {"checkpoint_read", s.checkpoint_read}});
  }
  return {{"algorithm", algorithm_name(plan.algorithm)},
          {"predicted_s", plan.predicted_s},
          {"max_rank_bytes", max_rank},
          {"total_bytes", total},
          {"rounds", plan.rounds.size()},
          {"ranks", std::move(ranks)}};
}

namespace {

// What a switch plan depends on: both plans' models and state layouts, the
// topology and the options.
std::string cache_key(const AnnotationPlan& from, const AnnotationPlan& to, const Topology& topology,
                      const SwitchOptions& o) {
  nlohmann::json key = nlohmann::json::array();
  for (const AnnotationPlan* p : {&from, &to}) {
    nlohmann::json side = {{"model", p->model.to_json()}, {"world", p->world_size}, {"mixed", p->precision.mixed()}};
    for (const auto& [name, shape] : model_parameter_shapes(p->model)) {
      auto it = p->tensors.find(name);
      side["param"][name] = it == p->tensors.end() ? nlohmann::json() : to_json(it->second);
      if (const Annotation* z = slot_layout(*p, name, StateSlot::kMaster)) side["zero"][name] = to_json(*z);
    }
    key.push_back(std::move(side));
  }
  key.push_back(topology.to_json());
  key.push_back({algorithm_name(o.algorithm), o.lost_ranks, o.have_checkpoint, o.bucket_bytes});
  return key.dump();
}

}  // namespace

const SwitchPlan& SwitchPlanCache::get(const AnnotationPlan& from, const AnnotationPlan& to, const Topology& topology,
                                       const SwitchOptions& options) {
  std::string key = cache_key(from, to, topology, options);
  auto it = cache_.find(key);
  if (it != cache_.end()) return it->second;
  ++misses_;
  SwitchPlan plan = plan_switch(state_tensors(from, to), topology, options);
  return cache_.emplace(std::move(key), std::move(plan)).first->second;
}

}  // namespace hspmd
