// Choosing where a mixture of experts' experts live under expert
// parallelism (docs/moe.md, "Choosing a placement"): from the tokens each
// expert took (a step record's expert_tokens), how many replicas each expert
// gets and which members of a group hold them, so that the busiest member
// has as little to do as the loads allow.
#pragma once

#include <cstdint>
#include <vector>

#include "hspmd/plan/strategy.h"

namespace hspmd {

// One sparse layer: loads[e] the tokens expert e took, `members` the group's
// size, speeds[m] member m's relative speed (empty: all equal). Returns, per
// expert, the members holding it (ascending): a replicated expert's tokens
// are split evenly between its replicas, as the executor splits them.
// Greedy: every expert starts with one replica; pieces (an expert's load
// over its replicas) go largest first to the member that ends least loaded
// relative to its speed, never two of one expert on one member; then the
// expert with the largest piece gains a replica, again and again (at most E x
// members times), and the placement whose busiest member is least busy wins;
// every member gets at least one piece. Throws hspmd::Error
// "[experts] ..." for no experts, members < 1, a negative load or a speed
// that is not positive.
std::vector<std::vector<int>> place_layer_experts(const std::vector<double>& loads, int members,
                                                  const std::vector<double>& speeds = {});

// The busiest member's time under `placement` (per expert its members):
// max over members of (sum of its experts' load / replicas) / speed.
double placement_bottleneck(const std::vector<std::vector<int>>& placement, const std::vector<double>& loads,
                            int members, const std::vector<double>& speeds = {});

// Sparse layer `layer`'s placement under `strategy`: per expert (of
// `experts`) its members (expert_members).
std::vector<std::vector<int>> layer_placement(const Strategy& strategy, int64_t layer, int64_t experts);
// Appends layer `layer`'s placement to `out`, extending the last entry when
// it ends at the layer before with the same placement.
void append_placement(std::vector<ExpertPlacement>& out, int layer, std::vector<std::vector<int>> members);

// The placement of every sparse layer of `strategy` (expert_parallel > 1)
// from loads[i] of the i-th sparse layer (`sparse_layers`, ascending): one
// ExpertPlacement per run of consecutive sparse layers that get the same
// placement. Throws like place_layer_experts, and "[experts] ..." when the
// loads do not have one list of E per sparse layer.
std::vector<ExpertPlacement> place_experts(const std::vector<int64_t>& sparse_layers,
                                           const std::vector<std::vector<double>>& loads, int members,
                                           int64_t experts, const std::vector<double>& speeds = {});

}  // namespace hspmd
