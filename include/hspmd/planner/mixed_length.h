// Planning for mixed lengths (docs/planner.md "Mixed lengths"): from the
// piece lengths of a token file, one strategy per maximum-length bucket for
// token-budget steps (docs/mixed_length.md), each made of pipelines tailored
// to length intervals, as the paper's scenario-(c) planner does.
//
// Per bucket, a dynamic program over length intervals x devices assigns
// pipelines (single device class, tp x cp stages inside nodes, pp stages of
// evenly split layers) to contiguous runs of length intervals so that the
// slowest run's predicted time for the step's expected pieces is least; a
// pipeline only takes pieces its memory holds. Times come from
// CostModel::stage_cost per piece, memory from CostModel::stage_memory.
#pragma once

#include <cstdint>
#include <string>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/planner/cost_model.h"
#include "hspmd/plan/strategy.h"
#include "hspmd/planner/token_dispatch.h"

namespace hspmd {

struct MixedLengthOptions {
  int64_t batch_tokens = 0;  // T: tokens per step
  int64_t max_seq_len = 0;   // L: the longest piece
  int buckets = 2;           // at most this many maximum-length buckets (the top one is L)
  int max_cp = 0;            // largest context-parallel degree; 0 = up to the node size
  bool zero = false;         // ZeRO-1 across the strategy's pipelines
  bool allow_recompute = true;
  // One layout per bucket (every pipeline the same tp, cp, pp and maximum,
  // as many as the ranks place): the homogeneous strategies of a
  // bucket-switching baseline (HotSPa), the best such per bucket.
  bool homogeneous = false;
  std::set<int> unavailable;  // ranks that take no work (failed devices): no pipeline is placed on them
  // How the steps' pieces are dispatched when plans are scored (the
  // trainer's --dispatch): kSymmetric for a symmetric baseline's plans.
  DispatchRule dispatch = DispatchRule::kCost;
};

// One length interval (lo, hi] of a bucket and what a step is expected to
// hold there.
struct LengthInterval {
  int64_t lo = 0, hi = 0;
  double pieces = 0, tokens = 0, squares = 0;  // per step: count, sum of lengths, sum of squared lengths
};

struct LengthBucket {
  int64_t max_seq_len = 0;               // m_b: the longest piece the strategy accepts
  int steps = 0;                         // steps of the file whose longest piece falls in this bucket
  std::vector<LengthInterval> intervals; // longest first
  Strategy strategy;                     // strategy.max_seq_len = m_b
  double dp_step_s = 0;                  // the dynamic program's objective (expected pieces)
  double sync_s = 0;                     // gradient sync and optimizer after the pipelines
  // Median over the bucket's steps of predict_token_step + sync_s (the
  // expected-step prediction when the bucket has no step of its own).
  double predicted_step_s = 0;
};

// One step of the file: its longest piece, tokens, and per bucket the
// predicted step (predict_token_step + sync_s; negative where the bucket's
// strategy does not accept the longest piece).
struct StepPrediction {
  int64_t longest = 0, tokens = 0;
  std::vector<double> bucket_s;
};

struct MixedLengthPlan {
  int64_t pieces = 0, steps = 0;  // of the file, steps as the trainer forms them (no wrap)
  std::vector<StepPrediction> step_predictions;  // every step of the file
  std::vector<LengthBucket> buckets;  // ascending max_seq_len; the last has max_seq_len = L
  double planning_s = 0;
  nlohmann::json to_json() const;
};

// Plans every bucket. `pieces`: piece lengths in file order (documents cut
// at eos, pieces of at most L; PackedDocuments' pieces). Throws hspmd::Error
// "[search] ..." for a piece longer than L, no piece, a batch smaller than
// the longest piece, or when no pipeline of any device class can hold a
// piece of the bucket's maximum length (naming the length and the memory),
// or when every rank is unavailable.
MixedLengthPlan plan_mixed_lengths(const CostModel& model, const std::vector<int64_t>& pieces,
                                   const MixedLengthOptions& options);

}  // namespace hspmd
