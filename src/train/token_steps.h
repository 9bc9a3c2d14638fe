// Token-budget steps (docs/mixed_length.md): each step takes the next
// pieces of the data within --batch-tokens, dispatches them over the
// pipelines by the cost model, and (with --strategies) picks the strategy
// whose predicted step, plus the switch to it, is least; the next step's
// selection is worked out on a background thread while this one trains.
// --bucket-switching is the HotSPa-like baseline (run_buckets).
//
// The part owns the pieces, the strategy set and every choice's specialized
// runtime, the dispatch's cost model and its piece costs, and the step in
// preparation; it moves the run between choices through the trainer.
#pragma once

#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/core/ndarray.h"
#include "hspmd/data/token_data.h"
#include "hspmd/exec/runtime.h"
#include "hspmd/plan/plan.h"
#include "hspmd/planner/cost_model.h"
#include "hspmd/planner/token_dispatch.h"
#include "hspmd/resolve/topology.h"

namespace hspmd::dist {

class DistTrainer;

class TokenSteps {
 public:
  // One step's pieces and their dispatch.
  struct Step {
    std::vector<std::vector<std::vector<int64_t>>> micro;  // per pipeline, per micro-batch: its pieces
    int64_t pieces = 0, tokens = 0, counted = 0;
    std::vector<int64_t> pipeline_tokens;
    double predicted_s = 0;  // the slowest pipeline's predicted compute
  };

  // Reads --strategies (the first is the run's first plan) and checks that
  // --bucket-switching's strategies pad the vocabulary alike.
  explicit TokenSteps(DistTrainer& trainer);

  // Before the first step: the data's pieces, checked against the budget
  // and the strategies (every plan of the run, or every choice).
  void load_pieces(const TokenData& data);
  // The dispatch's cost model under `speeds` (the piece costs follow).
  void set_speeds(const Topology& speeds);
  // With --strategies: every choice but the one in force specialized now
  // (the same order on every rank: creating communicator groups is
  // collective), and every pair's switch predicted.
  void specialize_choices();

  // The step's dispatch, from the prepared one when it fits (else worked
  // out now); with --strategies, rank 0's pick and the switch to it.
  // Returns the seconds the training thread spent on it.
  double select_and_dispatch(int64_t step);
  // --bucket-switching: the step's pieces in buckets, each the pieces whose
  // smallest accepting strategy is that one; bucket by bucket (shortest
  // first) the run switches to its strategy, trains its micro-batches and
  // syncs their gradients, which add up across the buckets (moved to each
  // next plan's gradient layout). Returns the step's loss; `synced` ends in
  // the last plan's layout.
  double run_buckets(int64_t step, float normalizer, std::map<std::string, NDArray>& synced, size_t held,
                     size_t& activations);
  // The target tokens of the step about to train.
  int64_t counted(int64_t cursor) const;
  // The step in force (dispatched, or the whole bucketed step).
  const Step& step() const { return *step_; }
  bool has_step() const { return step_.has_value(); }
  const PackedDocuments& pieces() const { return *pieces_; }
  // This rank's micro-batches in the step.
  int micro_batches(int pipeline) const;

  // The strategy set (--strategies), empty without; the one in force.
  const std::vector<std::shared_ptr<const AnnotationPlan>>& choices() const { return choices_; }
  int choice() const { return choice_; }
  // Resume under events: the set in force when the checkpoint was written
  // (re-planned, perhaps); returns the plan in force, or null when the
  // checkpoint carries no set.
  std::shared_ptr<const AnnotationPlan> resume_choices(const nlohmann::json& meta);
  // The checkpoint meta's "strategies" and "choice".
  void describe(nlohmann::json& meta) const;

  // The pieces' longest, and the longest piece any pipeline of `strategies` accepts.
  int64_t longest_piece() const;
  int64_t most_accepted(const std::vector<const Strategy*>& strategies) const;
  // Checks the budget against the longest piece, each pipeline's capacity,
  // and that some pipeline of `strategies` accepts the longest piece.
  void check_pieces(const std::vector<const Strategy*>& strategies, const std::string& what) const;
  // Per rank, the cost model's compute for the step in force under the
  // assumed speeds (the straggler watch's prediction).
  std::vector<double> step_rank_compute(const Strategy& strategy, int world_size) const;

  // Waits for the next step's preparation and drops it, before the strategy
  // set, the dispatch model or the piece costs change; bumps the generation.
  void discard_prepared();
  // Before the plan in force changes: the preparation reads its piece costs.
  void before_plan_change();
  // ... and after: the current plan's piece costs go.
  void after_plan_change() { piece_costs_.erase(-1); }
  // A re-planned strategy set (an elastic event): the old choices' graphs
  // go, every new one is specialized now and the step's pick is made (rank
  // 0's, every rank's). Returns the pick's runtime (the run moves to it)
  // and its index; `specialize_s` and the switch plans' seconds for the log.
  std::unique_ptr<Runtime> replace_choices(std::vector<std::shared_ptr<const AnnotationPlan>> set, int64_t cursor,
                                           double& specialize_s, nlohmann::json& extra);
  // The strategy count a token-mode re-plan makes (the run's --strategies count).
  int replan_buckets() const { return replan_buckets_; }

 private:
  // A step's selection and dispatch, worked out ahead (on a background
  // thread while the step before trains): per strategy that accepts the
  // step's longest piece (--strategies; else the current plan's alone) its
  // dispatch, and the pick (lowest predicted time plus the switch's, from
  // the current choice). Touches only const state and the piece-cost cache.
  struct Prepared {
    int64_t cursor = 0;
    const AnnotationPlan* plan = nullptr;  // the plan in force when it was made
    int current = 0;                       // the choice it switches from
    uint64_t generation = 0;               // the strategy set's (and dispatch model's) when it was made
    std::vector<std::optional<Step>> by_choice;  // --strategies; else [0] = the current plan's
    int pick = 0;
  };
  // current < 0: no switch cost for any choice (after a re-plan, every
  // choice is a switch from the old plan).
  Prepared prepare(int64_t cursor, int current, const AnnotationPlan* plan) const;
  // The pieces of the step starting at piece `cursor` (or the given
  // pieces), dispatched over the pipelines of `s` (dispatch_token_step:
  // longest first to the accepting pipeline that finishes first, packed
  // first-fit decreasing). `key`: the index of `s` among --strategies, -1
  // for the current plan's. The same on every rank.
  Step plan_step(int64_t cursor, const Strategy& s, int key) const;
  Step plan_pieces(const std::vector<int64_t>& pieces, const Strategy& s, int key) const;
  // The pieces of the step from `cursor` (file order, within the budget).
  std::vector<int64_t> step_pieces(int64_t cursor) const;
  const PieceCosts& piece_costs(const Strategy& s, int key) const;
  // choice_switch_s_ for choices_: every pair's switch plan, predicted.
  void plan_choice_switches();
  // Moves the run to choice `pick` (its graphs specialized already) and logs the switch.
  void switch_choice(int pick, int64_t step, const std::string& cause);
  // One bucket's micro-batches and gradient sync, added into `synced`
  // (moved from `layout`, where the sums so far lie).
  double train_bucket(const std::vector<int64_t>& pieces, int choice, float normalizer,
                      std::map<std::string, NDArray>& synced, std::map<std::string, Annotation>& layout,
                      size_t held, size_t& activations);

  DistTrainer& t_;
  std::unique_ptr<PackedDocuments> pieces_;
  std::optional<CostModel> dispatch_model_;
  mutable std::map<int, std::unique_ptr<PieceCosts>> piece_costs_;  // per strategy key (see plan_step)
  std::vector<std::shared_ptr<const AnnotationPlan>> choices_;      // --strategies, compiled
  int choice_ = 0;                                                  // the one in force
  std::vector<std::unique_ptr<Runtime>> choice_rt_;  // the others' graphs, specialized before step 0
  std::vector<std::vector<double>> choice_switch_s_;  // [from][to]: the switch plan's predicted seconds
  std::future<Prepared> next_;                        // the next step's, being prepared
  uint64_t generation_ = 0;  // bumped whenever choices_, the dispatch model or piece_costs_ change
  int replan_buckets_ = 1;   // K: the strategies a token-mode re-plan makes
  std::optional<Step> step_;  // this step's
};

}  // namespace hspmd::dist
