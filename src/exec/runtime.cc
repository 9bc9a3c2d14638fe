// The runtime builder (hspmd/exec/runtime.h): a plan specialized for this rank.
#include "hspmd/exec/runtime.h"

#include <algorithm>
#include <set>

#include "hspmd/core/error.h"
#include "hspmd/plan/pipelines.h"

namespace hspmd {

namespace {

// Every communicator group the plan's Reshards and ops use on this rank,
// created now in sorted member-list order: creation is collective over the
// members, and one global order on every rank cannot deadlock (the smallest
// group still waited for has all its members at it).
void create_groups(const std::vector<PlannedReshard>& reshards, const std::vector<PlannedOpTraffic>& traffic,
                   Communicator& world) {
  std::set<std::vector<int>> groups;
  for (const PlannedReshard& r : reshards) {
    auto it = r.resolution().ranks.find(world.rank());
    if (it == r.resolution().ranks.end()) continue;
    for (const CommPhase& phase : it->second.phases)
      for (const CommOp& op : phase.ops)
        if (is_collective(op.kind) && op.group.size() > 1) groups.insert(op.group);
  }
  for (const PlannedOpTraffic& t : traffic) {
    auto it = t.ranks.find(world.rank());
    if (it != t.ranks.end() && it->second.group.size() > 1) groups.insert(it->second.group);
  }
  for (const std::vector<int>& g : groups) world.group(g);
}

}  // namespace

int pipeline_of(const Strategy& s, int rank) {
  for (size_t p = 0; p < s.pipelines.size(); ++p)
    for (const Stage& st : s.pipelines[p].stages)
      for (int r : st.ranks)
        if (r == rank) return static_cast<int>(p);
  return -1;
}

std::unique_ptr<Runtime> specialize(std::shared_ptr<const AnnotationPlan> plan, Communicator& world,
                                    const SpecializeOptions& o) {
  const int rank = world.rank();
  auto rt = std::make_unique<Runtime>();
  rt->plan = plan;
  rt->strategy = *plan->strategy;
  for (auto& [name, shape] : model_parameter_shapes(plan->model)) rt->shapes[name] = shape;
  // Every rank's view of the stacked micro-batch must divide along every
  // pipeline's splits, so the granularity is common to all pipelines.
  rt->granularity = sequence_granularity(rt->strategy);
  const int64_t seq = (o.seq_len + rt->granularity - 1) / rt->granularity * rt->granularity;
  int64_t batch = 0;
  for (const Pipeline& p : rt->strategy.pipelines) batch += p.micro_batch_size;
  rt->graph = std::make_unique<ExecGraph>(plan, o.topology, rank, Bindings{{"B", batch}, {"S", seq}}, o.device);
  rt->gather_dtypes = zero_gather_dtypes(*plan, rt->graph->model());
  // Pipelines are discovered from the resolved plan (appendix A.2), not
  // read from the strategy; the strategy only gives micro-batch counts.
  std::vector<PlannedOpTraffic> traffic;
  const std::vector<PlannedReshard> reshards = rt->graph->dry_run(&traffic);  // this rank's Reshards only
  create_groups(reshards, traffic, world);
  const auto pipelines = rt->graph->discover_pipelines();
  const PipelinePosition at = pipeline_positions(pipelines, world.size()).at(rank);
  HSPMD_CHECK(at.pipeline == pipeline_of(rt->strategy, rank), "discovered pipeline ", at.pipeline, " of rank ", rank,
              " differs from the strategy's");
  rt->pipeline = at.pipeline;
  if (!at.idle()) {
    rt->stage = at.stage;
    rt->stages = static_cast<int>(pipelines[at.pipeline].stages.size());
    for (const Stage& st : rt->strategy.pipelines[rt->pipeline].stages)
      if (std::count(st.ranks.begin(), st.ranks.end(), rank)) rt->graph->set_recompute(st.recompute);
  }
  rt->graph->set_deferred_sends(true);
  if (o.clock != nullptr) {
    rt->graph->set_clock(o.clock);
    rt->graph->set_op_time_model(o.time_model);
    rt->graph->set_memory_cap(
        static_cast<size_t>(o.topology->rank(rank).memory_cap_gib * 1024.0 * 1024.0 * 1024.0));
  }
  rt->grad_buckets = grad_buckets(*rt->graph);  // after the clock: an emulated run syncs each parameter alone
  return rt;
}

}  // namespace hspmd
