// Elastic training (docs/elastic.md): the run's events (failed, joined and
// slowed ranks, or a given strategy at a step), re-plans for the available
// ranks, the move to the next plan (or a rollback to the last checkpoint
// when the failed ranks' slices cannot be served), and the straggler watch
// that corrects the speeds the planner assumes and switches when the
// predicted gain over the horizon exceeds the switch's cost.
//
// The part owns the events, the failed ranks, the assumed speeds and the
// straggler window; it moves the run through the trainer.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/exec/runtime.h"
#include "hspmd/plan/plan.h"
#include "hspmd/resolve/topology.h"
#include "hspmd/train/events.h"
#include "hspmd/train/trainer.h"
#include "train/straggler_window.h"

namespace hspmd::dist {

class DistTrainer;
class TokenSteps;

class ElasticController {
 public:
  // Reads --events (checked against the world, the steps and the first
  // plan; each event's strategy compiled now).
  explicit ElasticController(DistTrainer& trainer);
  // Whether any event is given (an empty --events file trains as without).
  bool active() const { return !events_.empty(); }

  // Token-budget steps: an event's strategy becomes the only choice, so it
  // must take every piece (checked before the first step).
  void check_token_events(const TokenSteps& tokens) const;
  // A resume: the failed ranks and the speeds as the events before `start`
  // left them.
  void resume_at(int64_t start);
  // A resume whose checkpoint plan gives a failed rank work: re-plans
  // before the first step (the record is logged once the log is open:
  // resume_record()).
  void replan_failed_at_resume(int64_t start);
  const nlohmann::json& resume_record() const { return resume_replan_; }
  // The planner's view of the cluster: the speeds as last estimated.
  const Topology& assumed() const { return *assumed_; }

  // Before `step`: the event due then, if any (once). Returns the step the
  // run continues at: `step`, or an earlier one after a rollback.
  int64_t before_step(int64_t step);
  // After `step`, with its record: the straggler watch; may re-plan and switch.
  void after_step(int64_t step, const StepRecord& r);
  // The run moved to another plan: the watch starts over (the first step
  // after it is not watched).
  void after_plan_change();

 private:
  // The event's changes before `step`: speeds, failed ranks, then the next
  // plan (the event's strategy, or a re-plan when ranks changed).
  int64_t apply_event(const ElasticEvent& ev, int64_t step);
  // ... with token-budget steps: the strategy set re-planned by the
  // mixed-length planner (or the event's strategy as the only choice).
  int64_t apply_token_event(const ElasticEvent& ev, int64_t step);
  // Rank 0 searches for the available ranks under `topology`; every rank gets
  // its answer (a search stopped by its time limit is not repeatable).
  Strategy replan(const Topology& topology, int64_t step, const std::string& cause, double& planning_s);
  // Rank 0 runs the mixed-length planner on the run's pieces for the
  // available ranks; every rank gets its strategies (one per length bucket).
  std::vector<Strategy> replan_tokens(const Topology& topology, int64_t step, const std::string& cause,
                                      double& planning_s);
  // Moves to `plan` before `step`: the failed ranks' memory is gone.
  // Returns the step to continue at. `ready`: the plan specialized already
  // and its specialization seconds; `extra` goes into the logged record.
  int64_t reconfigure(std::shared_ptr<const AnnotationPlan> plan, int64_t step, const std::string& cause,
                      double planning_s, std::unique_ptr<Runtime> ready = nullptr, double ready_specialize_s = 0,
                      const nlohmann::json& extra = nlohmann::json::object());
  // Slices only failed ranks held and no checkpoint of `step`: the whole
  // state is loaded under `plan` from the last checkpoint (an earlier
  // step), whose steps are trained again. Returns that step.
  int64_t rollback(std::shared_ptr<const AnnotationPlan> plan, int64_t step, const std::string& cause,
                   double planning_s, std::unique_ptr<Runtime> ready, double ready_specialize_s,
                   const nlohmann::json& extra);
  // Whether the straggler watch runs (an emulated cluster, a window; not
  // with --bucket-switching).
  bool watching() const;
  void watch_stragglers(int64_t step, const StepRecord& r);
  // ... with token-budget steps: each step predicted from its own dispatch;
  // a straggler's corrected speed goes to the dispatch (no re-plan).
  void watch_token_stragglers(int64_t step, const StepRecord& r);
  // The assumed speeds corrected by the window's per-rank ratios of seen to
  // predicted compute: a rank off the median ratio by more than the
  // threshold gets its slowdown scaled by its ratio over the median. None
  // when no rank is off (or nothing was seen).
  std::optional<Topology> corrected_speeds(const std::vector<int>& active, const std::vector<double>& ratio) const;
  // Per rank, the cost model's compute seconds per step of the current plan
  // under the assumed speeds (0 for idle ranks); empty when it cannot say.
  std::vector<double> predicted_compute(const Topology& topology) const;
  // Whether the straggler re-plan `next` is worth switching to; logs the
  // straggler record and returns the plan to move to (null: stay).
  std::shared_ptr<const AnnotationPlan> straggler_decision(const Strategy& next, int64_t next_step,
                                                           double observed_step, double planning_s,
                                                           const std::vector<int>& active);

  DistTrainer& t_;
  std::vector<ElasticEvent> events_;
  std::map<int64_t, std::shared_ptr<const AnnotationPlan>> event_plans_;  // step -> the event's strategy
  std::set<int> failed_;                     // ranks whose devices are gone now
  int64_t events_done_ = -1;                 // events up to this step have happened
  std::shared_ptr<const Topology> assumed_;  // the planner's view: speeds as last estimated
  // The reconfigure record of a re-plan at the resume (failed ranks in the
  // checkpoint's plan), logged once the log is open; null when none.
  nlohmann::json resume_replan_;
  // Stragglers: per step in the window, per rank compute seen and predicted
  // and its role (token-budget steps: predicted from the step's dispatch,
  // kept across choice switches); the roles' model factors stay.
  StragglerWindow window_;
  std::vector<double> window_steps_;  // ... and the emulated step times
  std::vector<double> predicted_;     // per rank compute of the current plan (assumed speeds)
  bool skip_next_ = true;             // the first step after a (re)start or switch is not watched
};

}  // namespace hspmd::dist
