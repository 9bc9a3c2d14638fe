// dry_run: deduce the plan's annotated training graph and resolve every
// Reshard of it — forward, backward (mirrors), gradient sync, and the ZeRO
// gathers that follow the optimizer step — for a virtual world.
#include <algorithm>

#include "hspmd/core/error.h"
#include "hspmd/deduce/deduce.h"
#include "hspmd/graph/op.h"
#include "hspmd/models/model.h"
#include "hspmd/ops/ops.h"
#include "hspmd/plan/plan.h"

namespace hspmd {

namespace {

// Named Reshards carry their plan name, mirrors "backward.<name>".
std::string reshard_name(const Node& n) {
  return n.name.empty() ? "reshard#" + std::to_string(n.id) : n.name;
}

Shape concrete_shape(const SymShape& shape, const Bindings& bindings, const std::string& name) {
  try {
    return eval_shape(shape, bindings);
  } catch (const Error& e) {
    fail("[plan] reshard '", name, "': ", e.what(), " (add it to the plan's bindings)");
  }
}


void check_world(const AnnotationPlan& plan, const Topology& topology) {
  if (topology.world_size() != plan.world_size)
    fail("[plan] the cluster has ", topology.world_size(), " ranks but the plan's world has ",
         plan.world_size);
}

// The dry run's entries: the Reshards of the graph, then the ZeRO gathers;
// `resolve_cached` returns null for a Reshard to leave out.
std::vector<PlannedReshard> resolve_all(const AnnotationPlan& plan, const AnnotatedTraining& t,
                                        ResolutionCache& resolve_cached) {
  std::vector<PlannedReshard> out;
  for (const auto& [id, spec] : t.reshards(plan.bindings, resolve_cached.only_rank()))
    if (auto r = resolve_cached(spec)) out.push_back({spec.name, t.phase(id), std::move(r)});
  const std::map<std::string, DType> gather_dtypes = zero_gather_dtypes(plan, t.model);
  for (const auto& [name, shape] : model_parameter_shapes(plan.model)) {
    auto it = plan.optimizer_states.find(name);
    if (it == plan.optimizer_states.end()) continue;
    ReshardSpec spec{"zero_gather." + name, shape, gather_dtypes.at(name), it->second,
                     plan.tensors.at(name)};
    if (auto r = resolve_cached(spec)) out.push_back({spec.name, "zero_gather", std::move(r)});
  }
  return out;
}

}  // namespace

namespace {

// Every field of `a` as numbers: a key, not a report (to_string is slower).
void append_key(std::string& key, const Annotation& a) {
  auto add = [&](int64_t v) { key += std::to_string(v) + ","; };
  add(a.hdim);
  for (int64_t w : a.part_weights) add(w);
  for (const Subgroup& g : a.subgroups) {
    key += "[";
    for (int r : g.devices.ranks) add(r);
    key += "{";
    for (const auto& [k, d] : g.states.degrees) add(k), add(d);
    key += "}";
    for (int k : g.states.order) add(k);
  }
  key += "|";
}

}  // namespace

std::string ResolutionCache::key(const ReshardSpec& spec) {
  std::string key = shape_str(spec.shape) + dtype_name(spec.dtype) + "|";
  append_key(key, spec.src);
  append_key(key, spec.dst);
  return key;
}

std::shared_ptr<const Resolution> ResolutionCache::operator()(const ReshardSpec& spec) {
  if (only_rank_ >= 0 && !spec.src.contains(only_rank_) && !spec.dst.contains(only_rank_)) return nullptr;
  const std::string k = key(spec);
  auto it = cache_.find(k);
  if (it == cache_.end()) {
    Resolution r = only_rank_ < 0 ? resolve(spec, topology_) : resolve_for_rank(spec, topology_, only_rank_);
    it = cache_.emplace(k, std::make_shared<const Resolution>(std::move(r))).first;
  }
  return it->second;
}

std::string AnnotatedTraining::phase(int id) const {
  const ReshardPoint* point = model.point(id);
  if (point && point->kind == ReshardKind::kGradSync) return "grad_sync";
  return id < model.loss.node_id() ? "forward" : "backward";
}

std::map<std::string, DType> zero_gather_dtypes(const AnnotationPlan& plan, const ModelGraph& model) {
  std::map<std::string, DType> out;
  for (const std::string& name : model.names) out[name] = DType::F32;
  if (!plan.precision.mixed()) return out;
  const Graph& g = *model.graph;
  std::map<int, const std::string*> param_of;  // parameter node -> its name
  for (size_t i = 0; i < model.names.size(); ++i) param_of[model.params[i].node_id()] = &model.names[i];
  std::map<int, bool> only_bf16_casts;  // parameter node -> every consumer so far is a cast to bf16
  for (int id = 0; id < g.num_nodes(); ++id) {
    const Node& n = g.node(id);
    const bool bf16_cast = n.op && n.op->type() == "cast" && n.outputs.at(0).dtype == DType::BF16;
    for (const Tensor& in : n.inputs)
      if (param_of.count(in.node_id())) {
        auto [it, fresh] = only_bf16_casts.emplace(in.node_id(), bf16_cast);
        if (!fresh) it->second = it->second && bf16_cast;
      }
  }
  for (const auto& [node, bf16] : only_bf16_casts)
    if (bf16) out[*param_of.at(node)] = DType::BF16;
  return out;
}

namespace {

// Whether the plan places some expert on other subgroups than its layer's
// router: expert parallelism (the sparse layers then run ops::moe_experts).
bool places_experts_apart(const AnnotationPlan& plan) {
  const ModelConfig& c = plan.model;
  auto find = [&](const std::string& name) -> const Annotation* {
    auto it = plan.tensors.find(name);
    return it == plan.tensors.end() ? nullptr : &it->second;
  };
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.moe.num_experts <= 0 || !c.moe.sparse_layer(l)) continue;
    const Annotation* router = find(moe_router_weight_name(c, l));
    for (int64_t e = 0; e < c.moe.num_experts; ++e)
      for (const std::string& w : moe_expert_weight_names(c, l, e)) {
        const Annotation* a = find(w);
        if (router && a && !same_devices(*a, *router)) return true;
      }
  }
  return false;
}

}  // namespace

AnnotatedTraining annotate_training_graph(const AnnotationPlan& plan) {
  ModelBuildOptions options;
  options.expert_parallel = places_experts_apart(plan);
  options.reshard_points = true;
  options.context_parallel = true;
  options.packed_documents = true;  // fixed-length samples feed positions 0..S-1: plain causal
  options.precision = plan.precision;
  AnnotatedTraining t{build_model(plan.model, options), nullptr, plan.precision};
  t.annotated = std::make_unique<AnnotatedGraph>(deduce(*t.model.graph, plan.tensors, plan.world_size));
  return t;
}

std::vector<std::pair<int, ReshardSpec>> AnnotatedTraining::reshards(const Bindings& bindings, int only_rank) const {
  const Graph& g = *model.graph;
  std::vector<std::pair<int, ReshardSpec>> out;
  for (int id = 0; id < g.num_nodes(); ++id) {
    const Node& n = g.node(id);
    if (n.op == nullptr || !ops::is_reshard(n)) continue;
    if (only_rank >= 0 && !annotated->of(n.inputs[0]).contains(only_rank) &&
        !annotated->of(n.output(0)).contains(only_rank))
      continue;
    ReshardSpec spec;
    spec.name = reshard_name(n);
    spec.shape = concrete_shape(n.outputs[0].shape, bindings, spec.name);
    spec.dtype = n.outputs[0].dtype;
    if (const ReshardPoint* point = model.point(id); point && point->kind == ReshardKind::kGradSync)
      spec.dtype = precision.grad_reduce;
    spec.src = annotated->of(n.inputs[0]);
    spec.dst = annotated->of(n.output(0));
    out.emplace_back(id, std::move(spec));
  }
  return out;
}

std::vector<PlannedReshard> dry_run(const AnnotationPlan& plan, const Topology& topology,
                                    std::vector<PlannedOpTraffic>* traffic) {
  check_world(plan, topology);
  const AnnotatedTraining t = annotate_training_graph(plan);
  if (traffic) *traffic = op_traffic(plan, t);
  ResolutionCache resolve_cached(topology);
  return resolve_all(plan, t, resolve_cached);
}

std::vector<PlannedReshard> rank_dry_run(const AnnotationPlan& plan, const Topology& topology, int rank,
                                         std::vector<PlannedOpTraffic>* traffic) {
  check_world(plan, topology);
  HSPMD_CHECK(rank >= 0 && rank < plan.world_size, "rank ", rank, " outside the world of ", plan.world_size);
  ResolutionCache resolve_cached(topology, rank);
  return rank_dry_run(plan, annotate_training_graph(plan), resolve_cached, traffic);
}

std::vector<PlannedReshard> rank_dry_run(const AnnotationPlan& plan, const AnnotatedTraining& training,
                                         ResolutionCache& resolve_cached, std::vector<PlannedOpTraffic>* traffic) {
  check_world(plan, resolve_cached.topology());
  const int rank = resolve_cached.only_rank();
  HSPMD_CHECK(rank >= 0 && rank < plan.world_size, "rank ", rank, " outside the world of ", plan.world_size);
  if (traffic) *traffic = op_traffic(plan, training, rank);
  return resolve_all(plan, training, resolve_cached);
}

std::vector<PlannedOpTraffic> op_traffic(const AnnotationPlan& plan) {
  return op_traffic(plan, annotate_training_graph(plan));
}

std::vector<PlannedOpTraffic> op_traffic(const AnnotationPlan& plan, const AnnotatedTraining& t, int only_rank) {
  const Graph& g = *t.model.graph;
  const int loss = t.model.loss.node_id();
  std::map<std::pair<std::string, std::string>, PlannedOpTraffic> by_op;  // (phase, op type)
  for (int id = 0; id < g.num_nodes(); ++id) {
    const Node& node = g.node(id);
    if (!node.op->may_communicate()) continue;
    const std::string phase = id <= loss ? "forward" : "backward";
    const Annotation& out = t.annotated->of(node.output(0));
    if (only_rank >= 0 && !out.contains(only_rank)) continue;
    bool counted = false;
    for (int rank : only_rank >= 0 ? std::vector<int>{only_rank} : out.all_ranks()) {
      const OpTraffic traffic = node.op->traffic(shard_context(*t.annotated, node, plan.bindings, rank));
      if (!traffic.any()) continue;
      PlannedOpTraffic& entry = by_op[{phase, node.op->type()}];
      entry.op = node.op->type();
      entry.kind = traffic.kind;
      entry.phase = phase;
      if (!counted) ++entry.calls, counted = true;
      OpTraffic& mine = entry.ranks[rank];
      if (mine.group.empty()) mine.kind = traffic.kind, mine.group = traffic.group;
      mine.sent += traffic.sent;
      mine.received += traffic.received;
    }
  }
  std::vector<PlannedOpTraffic> out;
  for (const std::string phase : {"forward", "backward"})
    for (auto& [key, entry] : by_op)
      if (key.first == phase) out.push_back(std::move(entry));
  return out;
}

}  // namespace hspmd
