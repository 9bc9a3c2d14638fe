// The search's micro-batch sizes pass (internal to planner/): see
// micro_batch_sizes.cc and docs/planner.md, "Micro-batch sizes per pipeline".
#pragma once

#include <optional>

#include "hspmd/planner/cost_model.h"
#include "hspmd/planner/search.h"
#include "hspmd/plan/strategy.h"

namespace hspmd {

// `st` with every pipeline's micro-batch size and count chosen anew (its
// stages and layers kept): per pipeline and sample count the best (size,
// count) by the stage costs, the global batch split over the pipelines to
// minimise the slowest, sizes from o.micro_batch_sizes or 1 .. min(G, 64)
// up to the first that overflows a rank's memory. nullopt when nothing
// changes, nothing fits, or P x G^2 exceeds 5e7.
std::optional<Strategy> resize_micro_batches(const CostModel& model, const SearchOptions& o, const Strategy& st);

}  // namespace hspmd
