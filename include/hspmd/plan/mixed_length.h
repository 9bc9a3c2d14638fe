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
#include <map>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/plan/cost_model.h"
#include "hspmd/plan/strategy.h"

namespace hspmd {

// How a token-budget step's pieces go to the pipelines (docs/
// mixed_length.md "Per step"). kCost: longest first to the accepting
// pipeline that would finish first by the cost model (device speeds
// included), then first-fit decreasing into micro-batches of the
// pipeline's capacity. kSymmetric: data parallelism blind to device speeds,
// as a homogeneous SPMD system runs it (the HotSPa-like baseline): packed
// first-fit decreasing into micro-batches of the pipelines' smallest
// capacity, each micro-batch to the pipeline with the fewest tokens so far.
enum class DispatchRule { kCost, kSymmetric };

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

// Steps as `hspmd train --batch-tokens T` forms them from file order: the
// next pieces while their total stays within T, at least one; the pieces
// after the last full pass are not wrapped around (a last shorter step).
std::vector<std::vector<int64_t>> token_steps(const std::vector<int64_t>& pieces, int64_t batch_tokens);

// Token-budget steps (docs/mixed_length.md): the longest piece pipeline p
// of `s` takes (its max_seq_len, else the strategy's, else `default_max`)
// and the tokens of one of its micro-batches.
int64_t accepted_piece(const Strategy& s, const Pipeline& p, int64_t default_max = 0);
int64_t micro_batch_capacity(const Strategy& s, const Pipeline& p, int64_t default_max = 0);

// Stage k of pipeline p as the cost model sees it.
StageShape pipeline_stage_shape(const Pipeline& p, size_t k);

// Per rank of a world of `world`, the compute seconds the cost model
// predicts for one token-budget step: every micro-batch of the rank's
// pipeline on its stage (the fixed part of a call once, each piece's
// marginal part, as the dispatch costs them; on a context-parallel stage
// the micro-batch as one sequence of its tokens, as the model clock bills
// ring attention; `micro`: per pipeline, per micro-batch, the pieces'
// lengths) and the rank's optimizer step. The
// straggler watch of token-budget steps compares it with the emulated
// compute (docs/elastic.md).
std::vector<double> token_step_rank_compute(const CostModel& model, const Strategy& strategy,
                                            const std::vector<std::vector<std::vector<int64_t>>>& micro, int world);

// Seconds of one piece on each pipeline of a strategy: its slowest stage's
// stage_cost (forward, backward and their collectives) at s = the piece's
// length, b = 1; remembered per (pipeline, length).
class PieceCosts {
 public:
  PieceCosts(const CostModel& model, const Strategy& strategy) : model_(model), strategy_(strategy) {}
  // One micro-batch holding one piece of `length` tokens.
  double seconds(size_t pipeline, int64_t length) const;
  // The part of that paid once per micro-batch (the calls' fixed costs)...
  double per_micro_batch(size_t pipeline) const;
  // ... and the rest, what each piece packed into a micro-batch adds.
  double marginal(size_t pipeline, int64_t length) const;

 private:
  const CostModel& model_;
  const Strategy& strategy_;
  mutable std::map<std::pair<size_t, int64_t>, double> cache_;
  mutable std::vector<double> fixed_;  // per_micro_batch per pipeline (-1: not yet)
};

// "cost" / "symmetric"; throws hspmd::Error "[flags] --dispatch ..." else.
DispatchRule parse_dispatch_rule(const std::string& name);

// One token-budget step's dispatch under a DispatchRule, as the trainer
// runs it.

struct TokenDispatch {
  std::vector<std::vector<std::vector<size_t>>> micro;  // per pipeline, per micro-batch: indices into the lengths
  std::vector<int64_t> pipeline_tokens;
  // The slowest pipeline: its pieces' marginal costs, the fixed cost once
  // per micro-batch, and a fill and drain of (stages - 1) average
  // micro-batches.
  double predicted_s = 0;
};
// Throws hspmd::Error "[search] ..." when no pipeline accepts a piece.
TokenDispatch dispatch_token_step(const PieceCosts& costs, const Strategy& strategy,
                                  const std::vector<int64_t>& lengths, int64_t default_max = 0,
                                  DispatchRule rule = DispatchRule::kCost);

// dispatch_token_step's predicted_s.
double predict_token_step(const CostModel& model, const Strategy& strategy, const std::vector<int64_t>& pieces,
                          DispatchRule rule = DispatchRule::kCost);

// What follows the pipelines in a step: gradient sync, optimizer (and the
// ZeRO gather), from CostModel::evaluate.
double token_step_sync_seconds(const CostModel& model, const Strategy& strategy);

}  // namespace hspmd
