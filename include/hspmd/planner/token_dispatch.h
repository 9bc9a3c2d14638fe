// Token-budget steps (docs/mixed_length.md): how a step's pieces are cut
// into steps, which pipelines take them, how they are dispatched and packed
// into micro-batches, and what the cost model predicts for a step, as the
// trainer runs it and as the mixed-length planner (planner/mixed_length.h)
// scores its candidates.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "hspmd/planner/cost_model.h"
#include "hspmd/plan/strategy.h"

namespace hspmd {

// DispatchRule (how a token-budget step's pieces go to the pipelines) is
// declared with the strategy (hspmd/plan/strategy.h): the options name it too.

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
