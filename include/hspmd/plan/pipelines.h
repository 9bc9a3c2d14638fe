// Pipeline discovery (docs/plan.md "Discovered pipelines", paper appendix
// A.2): the pipelines of a plan are not declared but read off its
// annotations and its forward communication. Ranks that run a collective
// together, or share the subgroup of a parameter, form one stage; a stage
// that sends the forward activations to another precedes it. A pure function of the plan and its dry run (or
// of the plan and its forward Reshards): the executor (each rank's schedule), `plan explain` and the tests
// use it alike.
#pragma once

#include <vector>

#include "hspmd/plan/plan.h"

namespace hspmd {

struct DiscoveredStage {
  std::vector<int> ranks;  // ascending
  // The transformer blocks whose parameters the stage's ranks hold
  // (model.layers.{i}.*), inclusive; both -1 when it holds none.
  int first_layer = -1;
  int last_layer = -1;
  bool operator==(const DiscoveredStage&) const = default;
};

struct DiscoveredPipeline {
  std::vector<DiscoveredStage> stages;  // in forward order
  bool operator==(const DiscoveredPipeline&) const = default;
};

// Discovers the pipelines of `plan` from `reshards` (its dry run, see
// dry_run(); only the "forward" ones are read):
//  * stages: union of the ranks of each subgroup of each parameter
//    annotation (plan.tensors), and of each group of a bottom-tier collective
//    (all_gather, reduce_scatter, all_reduce) of a forward Reshard;
//  * order: a send / recv / BSR of the activations between blocks
//    (model.layers.{i}.input, lm_head.input) from a rank of stage A to a
//    rank of stage B makes B the next stage after A. The tied embedding's
//    transfer (lm_head.weight, first stage -> last stage) orders nothing;
//  * pipelines: the chains from each stage without a predecessor, which must
//    hold input_ids, ordered by the input_ids subgroup they hold (for a
//    compiled plan: the strategy's pipeline order).
// Ranks in none of these are idle and appear in no stage. For a plan compiled
// from a strategy the result is the strategy's pipelines (stage ranks sorted).
// Throws hspmd::Error "[plan] ..." (one line, naming the stages by their
// ranks) when the structure is not a set of chains: a stage with two
// successors or two predecessors, a cycle, a pipeline head without
// input_ids, or a stage whose layers are not one contiguous range.
std::vector<DiscoveredPipeline> discover_pipelines(const AnnotationPlan& plan,
                                                   const std::vector<PlannedReshard>& reshards);
// The same pipelines without a dry run: from an annotated training graph of
// `plan` (an ExecGraph's), resolving over `topology` only the forward
// Reshards, one at a time (alike ones once), and keeping only their stage
// collectives' groups and activation transfers. For a rank that specializes
// itself (rank_dry_run holds only its own Reshards). Throws the errors above
// and the resolver's for a forward Reshard.
std::vector<DiscoveredPipeline> discover_pipelines(const AnnotationPlan& plan, const Topology& topology,
                                                   const AnnotatedTraining& training);

// Where one rank sits in the discovered pipelines.
struct PipelinePosition {
  int pipeline = -1;  // -1: idle
  int stage = -1;
  bool idle() const { return pipeline < 0; }
  bool operator==(const PipelinePosition&) const = default;
};

// One position per rank of [0, world_size) (idle for ranks in no stage).
// Throws InternalError when a stage names a rank outside the world.
std::vector<PipelinePosition> pipeline_positions(const std::vector<DiscoveredPipeline>& pipelines,
                                                 int world_size);

}  // namespace hspmd
