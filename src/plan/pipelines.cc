// discover_pipelines: stages by union-find over the ranks that share a
// parameter subgroup or a forward collective, then chains along the
// point-to-point transfers of the activations (paper appendix A.2).
#include "hspmd/plan/pipelines.h"

#include <algorithm>
#include <climits>
#include <map>
#include <numeric>
#include <set>

#include "hspmd/core/error.h"

namespace hspmd {

namespace {

// Union-find over the ranks of the world; `present` marks the ranks seen.
class RankSets {
 public:
  explicit RankSets(int world) : parent_(world), present_(world, false) {
    std::iota(parent_.begin(), parent_.end(), 0);
  }
  int find(int r) {
    HSPMD_CHECK(r >= 0 && r < static_cast<int>(parent_.size()), "rank ", r);
    while (parent_[r] != r) r = parent_[r] = parent_[parent_[r]];
    return r;
  }
  void mark(int r) {
    find(r);  // checks the range
    present_[r] = true;
  }
  void join(const std::vector<int>& ranks) {
    for (int r : ranks) {
      mark(r);
      parent_[find(r)] = find(ranks.front());
    }
  }
  bool present(int r) const { return present_[r]; }
  int world() const { return static_cast<int>(parent_.size()); }

 private:
  std::vector<int> parent_;
  std::vector<bool> present_;
};

// Bottom-tier collectives only: their members form one stage (split_*
// collectives join pipelines, e.g. in gradient sync).
bool is_stage_collective(CommKind k) {
  return k == CommKind::kAllGather || k == CommKind::kReduceScatter || k == CommKind::kAllReduce;
}

bool is_point_to_point(CommKind k) {
  return k == CommKind::kSend || k == CommKind::kRecv || k == CommKind::kBsr;
}

// The names of the Reshard points that carry the activations from one block
// (or stage) to the next.
std::set<std::string> activation_points(const ModelConfig& model) {
  std::set<std::string> names;
  for (const ReshardPoint& p : model_reshard_points(model))
    if (p.carries_activations()) names.insert(p.name);
  return names;
}

template <typename F>
void for_each_op(const Resolution& res, F&& f) {
  for (const auto& [rank, rr] : res.ranks)
    for (const CommPhase& phase : rr.phases)
      for (const CommOp& op : phase.ops) f(rank, op);
}

void merge_parameter_subgroups(const AnnotationPlan& plan, RankSets& sets) {
  // Expert weights say nothing of stages: under expert parallelism a
  // replicated expert's subgroup spans slots of several pipelines (its
  // layer's router weight places the stage).
  std::set<std::string> experts;
  const ModelConfig& c = plan.model;
  for (int64_t l = 0; l < c.num_hidden_layers && c.moe.num_experts > 0; ++l)
    if (c.moe.sparse_layer(l))
      for (int64_t e = 0; e < c.moe.num_experts; ++e)
        for (const std::string& w : moe_expert_weight_names(c, l, e)) experts.insert(w);
  for (const auto& [name, shape] : model_parameter_shapes(plan.model)) {
    if (experts.count(name)) continue;
    auto it = plan.tensors.find(name);
    if (it == plan.tensors.end()) continue;
    for (const Subgroup& sg : it->second.subgroups)
      if (!sg.devices.ranks.empty()) sets.join(sg.devices.ranks);
  }
}

void merge_collectives(const Resolution& r, RankSets& sets) {
  for_each_op(r, [&](int, const CommOp& op) {
    if (is_stage_collective(op.kind) && !op.group.empty()) sets.join(op.group);
  });
}

// (sender, receiver) rank pairs of the point-to-point transfers of `r`.
void add_transfers(const Resolution& r, std::set<std::pair<int, int>>& pairs) {
  for_each_op(r, [&](int rank, const CommOp& op) {
    if (!is_point_to_point(op.kind)) return;
    for (const Transfer& t : op.sends) pairs.insert({rank, t.peer});
    for (const Transfer& t : op.recvs) pairs.insert({t.peer, rank});
  });
}

// What discovery reads of the forward Reshards: the stage collectives joined
// into `sets`, and the activation transfers.
struct ForwardLinks {
  RankSets sets;
  std::set<std::pair<int, int>> transfers;
};

// Layers of one stage repeat alike resolutions: visit each shared one once.
ForwardLinks links_of(const AnnotationPlan& plan, const std::vector<PlannedReshard>& reshards) {
  ForwardLinks links{RankSets(plan.world_size), {}};
  merge_parameter_subgroups(plan, links.sets);
  const std::set<std::string> activations = activation_points(plan.model);
  std::set<const Resolution*> seen, seen_activation;
  for (const PlannedReshard& r : reshards) {
    if (r.phase != "forward") continue;
    if (seen.insert(&r.resolution()).second) merge_collectives(r.resolution(), links.sets);
    if (activations.count(r.name) && seen_activation.insert(&r.resolution()).second)
      add_transfers(r.resolution(), links.transfers);
  }
  return links;
}

// The same from the forward Reshards of `training`, resolved one at a time
// and dropped (alike ones, by ResolutionCache::key, once).
ForwardLinks links_of(const AnnotationPlan& plan, const Topology& topology, const AnnotatedTraining& training) {
  ForwardLinks links{RankSets(plan.world_size), {}};
  merge_parameter_subgroups(plan, links.sets);
  const std::set<std::string> activations = activation_points(plan.model);
  std::set<std::string> seen, seen_activation;
  for (const auto& [id, spec] : training.reshards(plan.bindings)) {
    if (training.phase(id) != "forward") continue;
    const std::string key = ResolutionCache::key(spec);
    const bool collectives = !seen.count(key);
    const bool transfers = activations.count(spec.name) && !seen_activation.count(key);
    if (!collectives && !transfers) continue;
    const Resolution r = resolve(spec, topology);
    if (collectives) merge_collectives(r, links.sets), seen.insert(key);
    if (transfers) add_transfers(r, links.transfers), seen_activation.insert(key);
  }
  return links;
}

// The stages (roots of the rank sets) and their order.
struct StageGraph {
  std::map<int, std::vector<int>> ranks;  // root -> ascending ranks
  std::map<int, int> next, previous;      // root -> root
};

std::string stage_name(const StageGraph& g, int root) {
  return "stage of ranks " + format_ranks(g.ranks.at(root));
}

void link(StageGraph& g, int from, int to) {
  auto [it, added] = g.next.emplace(from, to);
  if (!added && it->second != to)
    fail("[plan] ", stage_name(g, from), " sends the forward activations to two stages (ranks ",
         format_ranks(g.ranks.at(it->second)), " and ", format_ranks(g.ranks.at(to)),
         "): pipelines must be chains");
  auto [jt, added_back] = g.previous.emplace(to, from);
  if (!added_back && jt->second != from)
    fail("[plan] ", stage_name(g, to), " receives the forward activations from two stages (ranks ",
         format_ranks(g.ranks.at(jt->second)), " and ", format_ranks(g.ranks.at(from)),
         "): pipelines must be chains");
}

StageGraph build_stage_graph(RankSets& sets, const std::set<std::pair<int, int>>& transfers) {
  for (const auto& [from, to] : transfers) sets.mark(from), sets.mark(to);
  StageGraph g;
  for (int r = 0; r < sets.world(); ++r)
    if (sets.present(r)) g.ranks[sets.find(r)].push_back(r);
  for (const auto& [from, to] : transfers)
    if (sets.find(from) != sets.find(to)) link(g, sets.find(from), sets.find(to));
  return g;
}

// Root -> the blocks whose parameters its ranks hold, ascending.
std::map<int, std::set<int>> stage_layers(const AnnotationPlan& plan, RankSets& sets) {
  std::map<int, std::set<int>> layers;
  for (const ModelParameter& p : model_parameters(plan.model)) {
    auto it = plan.tensors.find(p.name);
    if (it == plan.tensors.end() || p.part != ModelPart::kBlock) continue;
    for (int r : it->second.all_ranks()) layers[sets.find(r)].insert(static_cast<int>(p.layer));
  }
  return layers;
}

DiscoveredStage make_stage(const StageGraph& g, int root, const std::set<int>& layers) {
  DiscoveredStage s;
  s.ranks = g.ranks.at(root);
  if (layers.empty()) return s;
  s.first_layer = *layers.begin();
  s.last_layer = *layers.rbegin();
  if (static_cast<int>(layers.size()) != s.last_layer - s.first_layer + 1)
    fail("[plan] ", stage_name(g, root), " holds parameters of layers ", s.first_layer, " .. ",
         s.last_layer, " with gaps: a stage must hold one contiguous range of layers");
  return s;
}

// The input_ids subgroup a pipeline head holds: its sort key.
int input_subgroup(const AnnotationPlan& plan, const StageGraph& g, int root) {
  auto it = plan.tensors.find("input_ids");
  int best = INT_MAX;
  if (it != plan.tensors.end())
    for (int r : g.ranks.at(root))
      if (int sg = it->second.subgroup_of(r); sg >= 0) best = std::min(best, sg);
  if (best == INT_MAX)
    fail("[plan] ", stage_name(g, root),
         " starts a pipeline (no stage sends it activations) but holds no input_ids");
  return best;
}

// Stages, their order and layers, then the chains (see discover_pipelines).
std::vector<DiscoveredPipeline> discover(const AnnotationPlan& plan, ForwardLinks links) {
  RankSets& sets = links.sets;
  const StageGraph g = build_stage_graph(sets, links.transfers);
  const std::map<int, std::set<int>> layers = stage_layers(plan, sets);

  std::vector<std::pair<std::pair<int, int>, DiscoveredPipeline>> keyed;
  std::set<int> placed;
  for (const auto& [root, ranks] : g.ranks) {
    if (g.previous.count(root)) continue;
    DiscoveredPipeline p;
    for (int s = root;; s = g.next.at(s)) {
      auto it = layers.find(s);
      p.stages.push_back(make_stage(g, s, it == layers.end() ? std::set<int>{} : it->second));
      placed.insert(s);
      if (!g.next.count(s)) break;
    }
    keyed.push_back({{input_subgroup(plan, g, root), ranks.front()}, std::move(p)});
  }
  // Every stage has one predecessor at most, so the unplaced ones lie on cycles.
  if (placed.size() != g.ranks.size()) {
    std::vector<int> cyclic;
    for (const auto& [root, ranks] : g.ranks)
      if (!placed.count(root)) cyclic.insert(cyclic.end(), ranks.begin(), ranks.end());
    std::sort(cyclic.begin(), cyclic.end());
    fail("[plan] the forward activations of ranks ", format_ranks(cyclic),
         " flow in a cycle: pipelines must be chains from a stage holding input_ids");
  }
  std::sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<DiscoveredPipeline> out;
  for (auto& [key, p] : keyed) out.push_back(std::move(p));
  return out;
}

}  // namespace

std::vector<DiscoveredPipeline> discover_pipelines(const AnnotationPlan& plan,
                                                   const std::vector<PlannedReshard>& reshards) {
  return discover(plan, links_of(plan, reshards));
}

std::vector<DiscoveredPipeline> discover_pipelines(const AnnotationPlan& plan, const Topology& topology,
                                                   const AnnotatedTraining& training) {
  return discover(plan, links_of(plan, topology, training));
}

std::vector<PipelinePosition> pipeline_positions(const std::vector<DiscoveredPipeline>& pipelines,
                                                 int world_size) {
  std::vector<PipelinePosition> out(std::max(world_size, 0));
  for (size_t p = 0; p < pipelines.size(); ++p)
    for (size_t s = 0; s < pipelines[p].stages.size(); ++s)
      for (int r : pipelines[p].stages[s].ranks) {
        HSPMD_CHECK(r >= 0 && r < world_size, "rank ", r, " outside the world of ", world_size);
        out[r] = {static_cast<int>(p), static_cast<int>(s)};
      }
  return out;
}

}  // namespace hspmd
