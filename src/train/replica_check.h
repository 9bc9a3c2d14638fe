// Weights given per rank (Trainer.load_state_dict: every rank passes its own
// full arrays) must agree wherever two ranks hold the same elements under the
// plan: replicas trained from different weights would diverge silently and
// state_dict() would return one rank's copy as the run's (docs/reliability.md,
// "Loaded weights agree among their holders").
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "hspmd/annotation/annotation.h"
#include "hspmd/core/ndarray.h"
#include "hspmd/plan/plan.h"

namespace hspmd {

class Communicator;

// One piece of a tensor that several ranks hold: the cells of the grid cut by
// every holder's box boundaries (each cell lies wholly inside or outside each
// rank's box), so partly overlapping boxes (a TP2 stage beside a TP1
// replica) are compared where they overlap.
struct SharedCell {
  size_t tensor = 0;       // index into the plan's parameter list
  Box box;                 // in the coordinates of the given (unpadded) array
  std::vector<int> holders;  // ascending; at least two
};

// The cells of `plan`'s parameters held by two ranks or more, where a rank
// holds the boxes of its parameter slot and ZeRO master slot (what
// TrainingState::from_full slices from the full arrays), cut to the given
// arrays' shapes `array_shapes` (a padded vocabulary's padding rows are
// zeros on every rank). The same on every rank: it reads only the plan.
std::vector<SharedCell> shared_weight_cells(const AnnotationPlan& plan, int world_size,
                                            const std::map<std::string, Shape>& array_shapes);

// A 64-bit hash of `box` of the contiguous f32 host array `array` (the
// elements' bytes in row-major order, -0.0 read as +0.0).
uint64_t box_checksum(const NDArray& array, const Box& box);

// Collective over `world`: each rank hashes the shared cells it holds in its
// `full` (validated f32 host arrays, Hugging Face names) and the (cell,
// checksum) lists are all-gathered; every rank then finds the same first
// cell whose holders disagree and throws SetupFailure on every rank:
// "[weights] <source>: <tensor> differs between ranks A and B, which both
// hold its elements [..] under the plan; ...". Returns when all agree.
void check_weight_replicas(const AnnotationPlan& plan, Communicator& world,
                           const std::map<std::string, NDArray>& full, const std::string& source);

}  // namespace hspmd
