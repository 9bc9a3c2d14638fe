// compile_plan: a Strategy becomes an annotation plan for the model of its config (any registered family).
// Pipelines are the top tier (one subgroup per pipeline: the stage holding
// the tensor's layer), stages the bottom tier (Megatron-style tensor
// parallelism, optionally tp x cp). See docs/plan.md.
#include "hspmd/plan/plan.h"

#include <functional>
#include <map>
#include <numeric>

#include "hspmd/core/error.h"
#include "hspmd/models/model.h"

namespace hspmd {

namespace {

// States from (key, degree) pairs in order, slowest first; degree-1 keys dropped.
DistStates make_states(const std::vector<std::pair<int, int>>& keys) {
  DistStates s;
  for (auto [key, n] : keys) {
    if (n <= 1) continue;
    s.degrees[key] = n;
    s.order.push_back(key);
  }
  return s;
}

// Token tensors [B, S, ...] entering attention, the MLP and the LM head:
// sequence split over cp, copies over tp (stage ranks are tp fastest:
// index = cp_index * tp + tp_index).
DistStates token_states(const Stage& st) { return make_states({{1, st.cp}, {kDup, st.tp()}}); }
// The residual stream between blocks, Megatron sequence parallelism: the
// sequence split over cp x tp, chunk index = the rank's index in the stage.
DistStates residual_states(const Stage& st) { return make_states({{1, st.cp * st.tp()}}); }
// A weight split along `dim` over tp (dim < 0: replicated), copies over cp.
DistStates weight_states(const Stage& st, int dim) {
  if (dim < 0) return make_states({{kDup, st.cp * st.tp()}});
  return make_states({{kDup, st.cp}, {dim, st.tp()}});
}

const Stage& stage_of_layer(const Pipeline& p, int64_t layer) {
  for (const Stage& st : p.stages)
    if (st.first_layer <= layer && layer <= st.last_layer) return st;
  fail("[plan] no stage holds layer ", layer);  // unreachable after validate()
}

using StagePick = std::function<const Stage&(const Pipeline&)>;
using StatesOf = std::function<DistStates(const Stage&)>;

class Compiler {
 public:
  Compiler(const ModelConfig& c, const Strategy& s) : c_(c), s_(s), experts_(expert_names()) {}

  // One subgroup per pipeline: the stage `pick` chooses, with `states`.
  Annotation across(const StagePick& pick, const StatesOf& states, bool tokens) const {
    Annotation a;
    for (const Pipeline& p : s_.pipelines) {
      const Stage& st = pick(p);
      a.subgroups.push_back(Subgroup{DeviceGroup{st.ranks}, states(st)});
    }
    a.hdim = tokens && a.hsize() > 1 ? 0 : kDup;  // tokens: the batch is cut between pipelines
    if (a.hdim == 0) a.part_weights = batch_weights();
    return a;
  }

  StagePick layer(int64_t l) const {
    return [l](const Pipeline& p) -> const Stage& { return stage_of_layer(p, l); };
  }
  static const Stage& first(const Pipeline& p) { return p.stages.front(); }
  static const Stage& last(const Pipeline& p) { return p.stages.back(); }

  // The batch is cut in proportion to each pipeline's micro-batch size
  // (empty when they are equal: equal parts).
  std::vector<int64_t> batch_weights() const {
    std::vector<int64_t> w;
    bool equal = true;
    for (const Pipeline& p : s_.pipelines) {
      if (!w.empty() && p.micro_batch_size != w.front()) equal = false;
      w.push_back(p.micro_batch_size);
    }
    return equal ? std::vector<int64_t>{} : w;
  }

  // Every rank of each pipeline, copies: where the data loader puts positions.
  Annotation whole_pipelines() const {
    Annotation a;
    for (const Pipeline& p : s_.pipelines) {
      std::vector<int> ranks;
      for (const Stage& st : p.stages) ranks.insert(ranks.end(), st.ranks.begin(), st.ranks.end());
      a.subgroups.push_back(
          Subgroup{DeviceGroup{ranks}, make_states({{kDup, static_cast<int>(ranks.size())}})});
    }
    a.hdim = a.hsize() > 1 ? 0 : kDup;
    if (a.hdim == 0) a.part_weights = batch_weights();
    return a;
  }

  // The stage of each pipeline that holds a part of the model.
  StagePick place(ModelPart part, int64_t l) const {
    switch (part) {
      case ModelPart::kEmbedding: return first;
      case ModelPart::kHead: return last;
      case ModelPart::kBlock: return layer(l);
    }
    HSPMD_CHECK(false, "unknown model part");
  }

  Annotation parameter(const ModelParameter& p) const {
    if (auto it = experts_.find(p.name); it != experts_.end()) return expert(p.layer, it->second);
    return across(place(p.part, p.layer), split_on(tp_dim(p.role)), false);
  }

  // Expert parallelism: expert e of a sparse layer whole on its owner slots
  // (replicas) of every group (one subgroup per group), copies over each
  // slot's tp ranks.
  Annotation expert(int64_t layer, int64_t e) const {
    const ExpertGroups groups = expert_groups(s_, layer);
    const std::vector<int> holders = expert_members(s_, layer, e, c_.moe.num_experts);
    Annotation a;
    for (const auto& members : groups.slots) {
      std::vector<int> owner;  // replica by replica
      for (int m : holders) owner.insert(owner.end(), members.at(m).begin(), members.at(m).end());
      a.subgroups.push_back(Subgroup{DeviceGroup{owner}, make_states({{kDup, static_cast<int>(owner.size())}})});
    }
    a.hdim = kDup;
    return a;
  }
  // Expert-parallel plans: each expert weight's name -> its expert.
  std::map<std::string, int64_t> expert_names() const {
    std::map<std::string, int64_t> out;
    if (s_.expert_parallel <= 1) return out;
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l)
      if (c_.moe.sparse_layer(l))
        for (int64_t e = 0; e < c_.moe.num_experts; ++e)
          for (const std::string& name : moe_expert_weight_names(c_, l, e)) out[name] = e;
    return out;
  }

  // Megatron: column-parallel weights split their output rows, row-parallel
  // ones their input columns, vocabulary tables their rows; norms replicated.
  static int tp_dim(ParamRole role) {
    switch (role) {
      case ParamRole::kColumnParallel: return 0;
      case ParamRole::kRowParallel: return 1;
      case ParamRole::kVocabulary: return 0;
      case ParamRole::kReplicated: return -1;
    }
    HSPMD_CHECK(false, "unknown parameter role");
  }

  // A Reshard point other than gradient sync (which takes its parameter's
  // optimizer-state layout): the residual stream is sequence-parallel, the
  // inputs of attention, the MLP and the LM head are gathered over tp.
  Annotation point(const ReshardPoint& p) const {
    const StagePick where = place(p.part, p.layer);
    switch (p.kind) {
      case ReshardKind::kEmbeddingOutput:
      case ReshardKind::kBlockInput:
      case ReshardKind::kSublayerOutput:
        return across(where, residual_states, true);
      case ReshardKind::kPositions:
      case ReshardKind::kSublayerInput:
      case ReshardKind::kHeadInput:
        return across(where, token_states, true);
      case ReshardKind::kTiedHead:
        return across(where, split_on(tp_dim(ParamRole::kVocabulary)), false);
      case ReshardKind::kGradSync:
        break;
    }
    HSPMD_CHECK(false, "no layout for Reshard point ", p.name);
  }

  static StatesOf split_on(int dim) {
    return [dim](const Stage& st) { return weight_states(st, dim); };
  }

  // ZeRO-1: the master weight and Adam moments are cut across the pipelines
  // (top tier) along a dim the stage does not split, so each rank's piece is
  // a sub-box of its own parameter shard (appendix C.2).
  Annotation optimizer_state(const Annotation& param, const Shape& shape) const {
    Annotation a = param;
    const int dim = zero_dim(param, shape);
    HSPMD_CHECK(dim >= 0, "no free dim for ZeRO");
    a.hdim = dim;
    const int64_t n = shape[dim], P = a.hsize();
    if (n % P != 0)  // near-equal exact sizes as weights
      for (int64_t i = 0; i < P; ++i) a.part_weights.push_back(n / P + (i < n % P ? 1 : 0));
    return a;
  }
  // The dim ZeRO cuts: the first the stage does not split with at least a
  // row per pipeline (a [1, H] gate has none along dim 0); -1 when none.
  static int zero_dim(const Annotation& a, const Shape& shape) {
    for (int dim = 0; dim < static_cast<int>(shape.size()); ++dim)
      if (!split_anywhere(a, dim) && shape[dim] >= a.hsize()) return dim;
    return -1;
  }
  static bool split_anywhere(const Annotation& a, int dim) {
    for (const Subgroup& g : a.subgroups)
      if (g.states.is_split(dim)) return true;
    return false;
  }

  AnnotationPlan compile(int world_size, int64_t seq_len) const {
    AnnotationPlan plan;
    plan.model = c_;
    plan.world_size = world_size;
    plan.strategy = s_;
    int64_t batch = 0;
    for (const Pipeline& p : s_.pipelines) batch += p.micro_batch_size;
    plan.bindings = {{"B", batch}, {"S", seq_len}};
    auto& t = plan.tensors;
    t["input_ids"] = across(first, token_states, true);
    t["targets"] = across(last, token_states, true);
    t["positions"] = whole_pipelines();
    t["normalizer"] = across(last, split_on(-1), false);
    if (c_.moe.aux_loss())  // each sparse layer's auxiliary-loss weights: whole, like the layer's replicated weights
      for (int64_t l = 0; l < c_.num_hidden_layers; ++l)
        if (c_.moe.sparse_layer(l))
          t["moe_aux_weights." + std::to_string(l)] = across(layer(l), split_on(-1), false);
    std::map<std::string, Annotation> sync;  // parameter -> its synced gradient's annotation
    for (const ModelParameter& p : model_parameters(c_)) {
      const Annotation a = parameter(p);
      t[p.name] = sync[p.name] = a;
      // A parameter whose every dim the stage splits (a TP-split bias), or
      // whose free dims are shorter than the pipelines are many, keeps its
      // optimizer state whole per replica: there is no dim left to cut.
      if (s_.zero && a.hsize() > 1 && zero_dim(a, p.shape) >= 0)
        sync[p.name] = plan.optimizer_states[p.name] = optimizer_state(a, p.shape);
    }
    for (const ReshardPoint& p : model_reshard_points(c_))
      t[p.name] = p.kind == ReshardKind::kGradSync ? sync.at(p.parameter) : point(p);
    return plan;
  }

 private:
  const ModelConfig& c_;
  const Strategy& s_;
  std::map<std::string, int64_t> experts_;  // expert weight -> its expert (expert parallelism)
};

}  // namespace

AnnotationPlan compile_plan(const ModelConfig& config, const Strategy& strategy, int world_size,
                            const CompileOptions& options) {
  validate(strategy, config, world_size);
  const int64_t seq_len = options.seq_len > 0 ? options.seq_len : config.max_position_embeddings;
  const int64_t g = sequence_granularity(strategy);
  if (seq_len % g != 0)
    fail("[plan] sequence length ", seq_len, " must be a multiple of ", g,
         " (stages split the sequence over their cp x tp ranks, and cp > 1 into 2 x cp chunks)");
  // Vocab-parallel embedding and LM head split the vocabulary over every
  // stage's tp ranks: pad it to a multiple of all tp degrees (Megatron's
  // make-vocab-size-divisible-by), with zero rows and masked logits.
  ModelConfig model = config;
  int64_t tp = 1;
  for (const Pipeline& p : strategy.pipelines)
    for (const Stage& st : p.stages) tp = std::lcm(tp, static_cast<int64_t>(st.tp()));
  if (model.table_rows() % tp != 0) model.padded_vocab_size = (model.vocab_size + tp - 1) / tp * tp;
  AnnotationPlan plan = Compiler(model, strategy).compile(world_size, seq_len);
  plan.precision = options.precision;
  // A custom program's ops are the user's, and the plan above follows its
  // declarations only: deduce its training graph, so that an op the plan
  // cannot serve (an unmarked row-parallel output) is refused here, by every
  // way in, naming the program op, and not at the first step.
  if (!model.program.is_null()) annotate_training_graph(plan);
  return plan;
}

}  // namespace hspmd
