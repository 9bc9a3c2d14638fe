// Elastic training (docs/elastic.md): events, re-plans, reconfiguration,
// rollback to the last checkpoint, and the straggler watch.
#include "train/elastic.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "hspmd/planner/cost_model.h"
#include "hspmd/planner/mixed_length.h"
#include "hspmd/planner/search.h"
#include "train/dist_trainer.h"
#include "train/resume_checks.h"

namespace hspmd::dist {

ElasticController::ElasticController(DistTrainer& trainer) : t_(trainer) {
  events_ = load_events(t_.o_.events_path, t_.world_.size(), t_.o_.steps);
  const std::vector<int> first = t_.plans_[0]->strategy->ranks();
  for (const ElasticEvent& e : events_) {
    if (e.strategy_path.empty()) continue;
    auto plan = t_.load_plan_file(e.strategy_path);
    const std::set<int> down = failed_after(events_, e.step);
    for (int r : plan->strategy->ranks())
      if (down.count(r))
        fail("[events] ", t_.o_.events_path, ": step ", e.step, ": strategy ", e.strategy_path, " uses rank ", r,
             ", which has failed by then");
    if (t_.o_.batch_tokens == 0 && plan->strategy->global_batch() != t_.plans_[0]->strategy->global_batch())
      fail("[events] ", t_.o_.events_path, ": step ", e.step, ": strategy ", e.strategy_path, " has global batch ",
           plan->strategy->global_batch(), ", the run ", t_.plans_[0]->strategy->global_batch());
    event_plans_[e.step] = plan;
  }
  assumed_ = t_.topology_;
}

namespace {

// Rank 0 runs `plan` (a re-plan; its answer as JSON) and every rank gets the
// answer; an error there becomes every rank's one-line error. planning_s:
// the time since t0 when the answer is known.
nlohmann::json agree_on_plan(Communicator& world, int64_t step, const std::string& cause, Clock::time_point t0,
                             double& planning_s, const std::function<nlohmann::json()>& plan) {
  std::string text;
  if (world.rank() == 0) {
    try {
      text = plan().dump();
    } catch (const Error& e) {
      text = std::string("!") + e.what();
    }
  }
  broadcast_text(text, world);
  planning_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!text.empty() && text[0] == '!')
    fail("[elastic] step ", step, " (", cause, "): re-planning failed: ", text.substr(1));
  return nlohmann::json::parse(text);
}

}  // namespace

Strategy ElasticController::replan(const Topology& topology, int64_t step, const std::string& cause, double& planning_s) {
  const auto t0 = Clock::now();
  const nlohmann::json answer = agree_on_plan(t_.world_, step, cause, t0, planning_s, [&] {
    const CostModel model = CostModel::load(t_.config_, topology, t_.o_.profile_path);
    SearchOptions so;
    so.global_batch = static_cast<int>(t_.rt_->strategy.global_batch());
    so.seq_len = t_.o_.seq_len;
    so.zero = t_.rt_->strategy.zero;
    so.schedule = t_.rt_->strategy.schedule;
    so.unavailable = failed_;
    so.top_k = 1;
    // Redundancy the run had stays: with two pipelines (no ZeRO) every
    // slice lives on two disjoint rank sets, so the next failure is served
    // by the survivors instead of the checkpoint. One pipeline only when
    // no plan of two fits.
    const int wanted = !t_.rt_->strategy.zero && t_.rt_->strategy.pipelines.size() >= 2 ? 2 : 1;
    // Two searches: pruned by the current plan (the planner's re-plan
    // mode: its TP per device class and micro-batch size; fast), then from
    // scratch within the time left (it finds what the pruning excludes,
    // e.g. another micro-batch size); the faster prediction wins.
    std::optional<SearchCandidate> best_found;
    std::string error;
    for (int min = wanted; min >= 1 && !best_found; --min) {
      so.min_pipelines = min;
      const Strategy* current = &t_.rt_->strategy;
      for (const Strategy* previous : {current, static_cast<const Strategy*>(nullptr)}) {
        so.previous = previous;
        so.time_limit_s = std::max(0.05, t_.o_.replan_time_limit_s -
                                             std::chrono::duration<double>(Clock::now() - t0).count());
        try {
          SearchCandidate c = search_strategy(model, so).best.at(0);
          if (!best_found || c.predicted_step_s < best_found->predicted_step_s) best_found = std::move(c);
        } catch (const Error& e) {
          error = e.what();
        }
      }
    }
    if (!best_found) fail(error);
    Strategy best = best_found->strategy;
    best.description = "re-planned before step " + std::to_string(step) + " (" + cause + ")";
    return to_json(best);
  });
  return strategy_from_json(answer);
}

int64_t ElasticController::reconfigure(std::shared_ptr<const AnnotationPlan> plan, int64_t step, const std::string& cause,
                                 double planning_s, std::unique_ptr<Runtime> ready,
                                 double ready_specialize_s, const nlohmann::json& extra) {
  SwitchOptions so = t_.base_switch_options();
  so.lost_ranks = failed_;
  so.have_checkpoint = t_.checkpoints_.committed_at(step);
  if (!so.have_checkpoint && t_.checkpoints_.own_committed()) {
    bool servable = true;  // the same answer on every rank: the switch plan is a pure function
    try {
      t_.switch_plans_.get(*t_.rt_->plan, *plan, *t_.topology_, so);
    } catch (const Error&) {
      servable = false;
    }
    if (!servable)
      return rollback(std::move(plan), step, cause, planning_s, std::move(ready), ready_specialize_s, extra);
  }
  nlohmann::json moved;
  try {
    moved = ready ? t_.move_runtime(std::move(ready), so, ready_specialize_s, nullptr) : t_.move_to(std::move(plan), so);
  } catch (const Error& e) {
    fail("[elastic] step ", step, " (", cause, "): ", e.what(),
         so.have_checkpoint ? std::string()
                            : " (no training checkpoint was committed before this step: " + option_name("checkpoint") +
                                  " DIR " + option_name("save_every") +
                                  " N writes them; the run then rolls back to the last one)");
  }
  nlohmann::json j = {{"event", "reconfigure"}, {"step", step}, {"cause", cause}, {"planning_s", planning_s}};
  j.update(moved);
  j["from_checkpoint_bytes"] = j["checkpoint_bytes"];
  j["failed"] = std::vector<int>(failed_.begin(), failed_.end());
  j["strategy"] = to_json(t_.rt_->strategy);
  j.update(extra);
  t_.log_.write(j);
  return step;
}

int64_t ElasticController::rollback(std::shared_ptr<const AnnotationPlan> plan, int64_t step, const std::string& cause,
                              double planning_s, std::unique_ptr<Runtime> ready,
                              double ready_specialize_s, const nlohmann::json& extra) {
  CheckpointReader reader(t_.o_.checkpoint_dir);
  const int64_t back = reader.index().step;
  if (t_.tokens_) t_.tokens_->before_plan_change();  // the next step's preparation reads the plan
  t_.rt_.reset();
  t_.state_.reset();  // every slice comes from the checkpoint
  const auto t0 = Clock::now();
  t_.rt_ = ready ? std::move(ready) : t_.specialize(std::move(plan));
  const double specialize_s =
      ready_specialize_s > 0 ? ready_specialize_s : std::chrono::duration<double>(Clock::now() - t0).count();
  t_.last_specialize_s_ = specialize_s;
  const auto t1 = Clock::now();
  t_.state_ = TrainingState::load(t_.rt_->plan, t_.world_.rank(), reader);
  t_.state_->move_to_device(t_.o_.device);  // loaded on the host
  const nlohmann::json& meta = reader.index().meta;
  t_.state_->step = back;
  const train_common::ResumeCursor cursor = train_common::read_resume_cursor(meta, t_.o_.checkpoint_dir);
  t_.state_->samples = cursor.samples;
  t_.state_->seed = cursor.seed;
  const double load_s = std::chrono::duration<double>(Clock::now() - t1).count();
  const std::vector<int64_t> read = gather_counts({t_.state_->bytes()}, t_.world_)[0];
  if (t_.clock_) t_.meter_.set_emulated_end(static_cast<int64_t>(t_.clock_->now() * 1e9));
  after_plan_change();
  t_.log_.drop_steps_from(back);  // the log keeps one record per step: those trained again go
  nlohmann::json j = {{"event", "reconfigure"}, {"step", step}, {"cause", cause}, {"planning_s", planning_s},
                      {"specialize_s", specialize_s}, {"switch_s", load_s},
                      {"bytes_sent", std::vector<int64_t>(t_.world_.size(), 0)},
                      {"from_checkpoint_bytes", read}, {"rollback_to", back},
                      {"failed", std::vector<int>(failed_.begin(), failed_.end())},
                      {"strategy", to_json(t_.rt_->strategy)}};
  j.update(extra);
  t_.log_.write(j);
  return back;
}

// Resume under events: the checkpoint's plan may predate the events'
// failures (a checkpoint of a run without them, or from before them), and a
// rank the events failed before the resumed step must get no work. Re-plans
// now, as the event would have; the state is then read from the checkpoint
// under the new plan, and the record is logged once the log is open.
void ElasticController::replan_failed_at_resume(int64_t start) {
  std::vector<int> lost;
  for (int r : t_.rt_->strategy.ranks())
    if (failed_.count(r)) lost.push_back(r);
  if (lost.empty()) return;
  std::string names;
  for (int r : lost) names += (names.empty() ? "" : ",") + std::to_string(r);
  const std::string cause =
      "resume: failed rank" + std::string(lost.size() > 1 ? "s " : " ") + names + " in the checkpoint's plan";
  if (t_.tokens_)
    fail("[events] ", t_.o_.events_path, ": rank ", lost.front(), " failed before step ", start, ", but the checkpoint ",
         t_.o_.resume_dir, " was written under strategies that give it work; with ", option_name("batch_tokens"),
         ", resume with the events the checkpoint's run went through");
  double planning_s = 0;
  const Strategy next = replan(assumed_ ? *assumed_ : *t_.topology_, start, cause, planning_s);
  resume_replan_ = {{"event", "reconfigure"}, {"step", start}, {"cause", cause}, {"planning_s", planning_s},
                    {"failed", std::vector<int>(failed_.begin(), failed_.end())}, {"strategy", to_json(next)},
                    // nothing moves between ranks: every rank reads its state from the checkpoint
                    {"bytes_sent", std::vector<int64_t>(t_.world_.size(), 0)},
                    {"predicted_bytes", std::vector<int64_t>(t_.world_.size(), 0)}, {"from_checkpoint", true}};
  t_.rt_ = t_.specialize(t_.compile(next));
}

int64_t ElasticController::apply_event(const ElasticEvent& ev, int64_t step) {
  for (const auto& [r, factor] : ev.slowdown) {
    if (r == t_.world_.rank() && t_.clock_) t_.clock_->set_slowdown(factor);
  }
  for (int r : ev.fail) failed_.insert(r);
  for (int r : ev.join) failed_.erase(r);
  if (t_.tokens_) return apply_token_event(ev, step);
  const std::string cause = ev.cause();
  if (!ev.strategy_path.empty()) {
    return reconfigure(event_plans_.at(step), step, cause, 0.0);
  }
  if (!ev.slowdown.empty()) {  // steps before the change say nothing about the speeds now
    window_.clear();
    window_steps_.clear();
  }
  if (!ev.changes_ranks()) {  // a speed change alone: the straggler watch decides
    nlohmann::json speeds = nlohmann::json::object();
    for (const auto& [r, factor] : ev.slowdown) speeds[std::to_string(r)] = factor;
    t_.log_.write({{"event", "slowdown"}, {"step", step}, {"slowdown", speeds}});
    return step;
  }
  double planning_s = 0;
  const Strategy next = replan(*assumed_, step, cause, planning_s);
  return reconfigure(t_.compile(next), step, cause, planning_s);
}

std::vector<Strategy> ElasticController::replan_tokens(const Topology& topology, int64_t step, const std::string& cause,
                                                 double& planning_s) {
  const auto t0 = Clock::now();
  const nlohmann::json answer = agree_on_plan(t_.world_, step, cause, t0, planning_s, [&] {
    const CostModel model = CostModel::load(t_.config_, topology, t_.o_.profile_path);
    const PackedDocuments& pieces = t_.tokens_->pieces();
    std::vector<int64_t> lengths(static_cast<size_t>(pieces.num_pieces()));
    for (int64_t i = 0; i < pieces.num_pieces(); ++i) lengths[static_cast<size_t>(i)] = pieces.piece_size(i);
    MixedLengthOptions mo;
    mo.batch_tokens = t_.o_.batch_tokens;
    // The planner wants the budget to hold a piece of its top length; every
    // piece fits the budget (checked before the first step).
    mo.max_seq_len = std::min(t_.o_.seq_len, t_.o_.batch_tokens);
    mo.buckets = t_.tokens_->replan_buckets();
    mo.zero = t_.rt_->strategy.zero;
    mo.unavailable = failed_;
    MixedLengthPlan plan = plan_mixed_lengths(model, lengths, mo);
    nlohmann::json all = nlohmann::json::array();
    for (LengthBucket& b : plan.buckets) {
      b.strategy.description = "re-planned before step " + std::to_string(step) + " (" + cause +
                               "): pieces up to " + std::to_string(b.max_seq_len) + " tokens, predicted step " +
                               detail::concat(b.predicted_step_s) + " s";
      all.push_back(to_json(b.strategy));
    }
    return all;
  });
  std::vector<Strategy> out;
  for (const nlohmann::json& j : answer) out.push_back(strategy_from_json(j));
  return out;
}

int64_t ElasticController::apply_token_event(const ElasticEvent& ev, int64_t step) {
  const std::string cause = ev.cause();
  // Nothing prepared for this step survives: the set, the speeds the
  // dispatch reads and the piece costs may all change below.
  TokenSteps& tokens = *t_.tokens_;
  tokens.discard_prepared();
  window_.clear();  // steps before an event say nothing about the speeds after it
  if (!ev.slowdown.empty() && !watching()) {  // no watch to find the new speeds: taken as known
    Topology t = *assumed_;
    for (const auto& [r, factor] : ev.slowdown) t = t.with_slowdown(r, factor);
    assumed_ = std::make_shared<const Topology>(std::move(t));
  }
  tokens.set_speeds(*assumed_);
  if (!ev.changes_ranks() && ev.strategy_path.empty()) {  // a speed change alone: the dispatch follows it
    nlohmann::json speeds = nlohmann::json::object();
    for (const auto& [r, factor] : ev.slowdown) speeds[std::to_string(r)] = factor;
    t_.log_.write({{"event", "slowdown"}, {"step", step}, {"slowdown", speeds}});
    return step;
  }
  // The new strategy set: the event's strategy alone, or the mixed-length
  // planner's (one strategy per length bucket) for the available ranks.
  std::vector<std::shared_ptr<const AnnotationPlan>> set;
  double planning_s = 0;
  if (!ev.strategy_path.empty()) {
    set.push_back(event_plans_.at(step));
  } else {
    const std::vector<Strategy> planned = replan_tokens(*assumed_, step, cause, planning_s);
    for (size_t i = 0; i < planned.size(); ++i) {
      try {
        set.push_back(t_.compile(planned[i]));
      } catch (const Error& e) {
        fail("[elastic] step ", step, " (", cause, "): re-planned strategy ", i, ": ", e.what());
      }
    }
    std::vector<const Strategy*> all;
    for (const auto& p : set) all.push_back(&*p->strategy);
    const int64_t longest = tokens.longest_piece(), most = tokens.most_accepted(all);
    if (most < longest)
      fail("[elastic] step ", step, " (", cause, "): a piece of ", longest, " tokens, but no re-planned strategy "
           "accepts more than ", most, " (its max_seq_len)");
  }
  nlohmann::json described = nlohmann::json::array();
  for (const auto& p : set) described.push_back(to_json(*p->strategy));
  nlohmann::json extra = {{"strategies", described}};
  if (tokens.choices().empty()) {  // one strategy: it replaces the plan (K = 1)
    HSPMD_CHECK(set.size() == 1, "a re-plan for one strategy made ", set.size());
    return reconfigure(set[0], step, cause, planning_s, nullptr, 0.0, extra);
  }
  // --strategies: the old choices' graphs go; every new choice is
  // specialized now and the state moves to the one this step picks.
  double specialize_s = 0;
  std::unique_ptr<Runtime> ready = tokens.replace_choices(std::move(set), t_.state_->samples, specialize_s, extra);
  return reconfigure(tokens.choices()[tokens.choice()], step, cause, planning_s, std::move(ready), specialize_s,
                     extra);
}

std::vector<double> ElasticController::predicted_compute(const Topology& topology) const {
  std::vector<double> out(t_.world_.size(), 0.0);
  try {
    const CostModel model = CostModel::load(t_.config_, topology, t_.o_.profile_path);
    for (const RankCost& rc : model.evaluate(t_.rt_->strategy, t_.o_.seq_len).ranks)
      if (rc.rank >= 0 && rc.rank < t_.world_.size()) out[rc.rank] = rc.compute_s;
  } catch (const Error&) {
    return {};
  }
  return out;
}

// Per rank, the median of its compute over the window divided by what the
// cost model predicts under the assumed speeds; relative to the median rank,
// a rank off by more than the threshold has another speed than assumed. The
// assumed speeds are then corrected, the planner searches under them, and
// the run switches when the predicted gain over the horizon exceeds the
// switch's cost (planning, specialization, the switch plan's time).
std::optional<Topology> ElasticController::corrected_speeds(const std::vector<int>& active,
                                                      const std::vector<double>& ratio) const {
  std::vector<double> ratios;
  for (int k : active) ratios.push_back(ratio[k]);
  if (ratios.empty()) return std::nullopt;
  const double mid = median(ratios);
  if (!(mid > 0)) return std::nullopt;
  Topology estimated = *assumed_;
  bool off = false;
  for (int k : active) {
    const double rel = ratio[k] / mid;
    if (std::abs(rel - 1) <= t_.o_.straggler_threshold) continue;
    off = true;
    estimated = estimated.with_slowdown(k, assumed_->rank(k).slowdown * rel);
  }
  if (!off) return std::nullopt;
  return estimated;
}

namespace {

// The straggler records' "role_factors": per role, the cost model's learned
// error (the role's ratio seen / predicted relative to the median rank).
nlohmann::json role_factors(const StragglerWindow& window) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [role, f] : window.factors()) out[role.name()] = f;
  return out;
}

}  // namespace

bool ElasticController::watching() const {
  return !events_.empty() && t_.clock_ && t_.o_.straggler_window > 0 && !t_.o_.bucket_switching;
}

// Token-budget steps: a step's compute follows its pieces, so each step is
// predicted from its own dispatch (token_step_rank_compute, under the
// assumed speeds) and the window compares sums: per rank, the compute seen
// over the window divided by the compute predicted; relative to the median
// rank, one off by more than the threshold has another speed than assumed.
// The corrected speeds go to the dispatch from the next step on (pieces
// move off a slowed pipeline) and to the next re-plan; the strategy set is
// kept (docs/elastic.md, "Token-budget steps").
void ElasticController::watch_token_stragglers(int64_t step, const StepRecord& r) {
  TokenSteps& tokens = *t_.tokens_;
  if (!tokens.has_step()) return;
  if (std::exchange(skip_next_, false)) return;  // a switch's step: its time is not the pieces'
  window_.add(r.emulated_compute_s, tokens.step_rank_compute(t_.rt_->strategy, t_.world_.size()),
              straggler_roles(t_.rt_->strategy, t_.world_.size()));
  window_steps_.push_back(r.emulated_step_time_s);
  if (static_cast<int64_t>(window_.size()) < t_.o_.straggler_window) return;
  std::vector<int> active;
  const std::vector<double> ratio = window_.ratios(failed_, true, active);
  const double observed_step = window_steps_.empty() ? r.emulated_step_time_s : median(window_steps_);
  window_.clear();
  window_steps_.clear();
  std::optional<Topology> estimated = corrected_speeds(active, ratio);
  if (!estimated) return;
  tokens.discard_prepared();  // step + 1 was dispatched under the old speeds
  assumed_ = std::make_shared<const Topology>(std::move(*estimated));
  tokens.set_speeds(*assumed_);
  nlohmann::json speeds = nlohmann::json::object();
  for (int k : active) speeds[std::to_string(k)] = assumed_->rank(k).slowdown;
  t_.log_.write({{"event", "straggler"}, {"step", step + 1}, {"estimated_slowdown", speeds},
                  {"role_factors", role_factors(window_)}, {"observed_step_s", observed_step}, {"switch", false},
                  {"dispatch", "re-weighted"}});
}

void ElasticController::watch_stragglers(int64_t step, const StepRecord& r) {
  if (!watching() || step + 1 >= t_.o_.steps) return;
  if (t_.tokens_) return watch_token_stragglers(step, r);
  if (std::exchange(skip_next_, false)) return;
  if (predicted_.empty()) predicted_ = predicted_compute(*assumed_);
  if (predicted_.empty()) return;
  window_.add(r.emulated_compute_s, predicted_, straggler_roles(t_.rt_->strategy, t_.world_.size()));
  window_steps_.push_back(r.emulated_step_time_s);
  if (static_cast<int64_t>(window_.size()) < t_.o_.straggler_window) return;
  std::vector<int> active;
  const std::vector<double> ratio = window_.ratios(failed_, false, active);
  const double observed_step = median(window_steps_);
  window_.clear();
  window_steps_.clear();
  std::optional<Topology> estimated = corrected_speeds(active, ratio);
  if (!estimated) return;
  const int64_t next_step = step + 1;
  std::string cause = "straggler:";
  for (int k : active)  // the ranks whose speed was corrected
    if (estimated->rank(k).slowdown != assumed_->rank(k).slowdown)
      cause += " rank " + std::to_string(k) + " x" + detail::concat(estimated->rank(k).slowdown);
  assumed_ = std::make_shared<const Topology>(std::move(*estimated));
  const std::vector<double> current = predicted_compute(*assumed_);
  double planning_s = 0;
  const Strategy next = replan(*assumed_, next_step, cause, planning_s);
  predicted_ = current;
  // A straggler re-plan keeps every rank's memory: never a rollback.
  if (auto plan = straggler_decision(next, next_step, observed_step, planning_s, active))
    reconfigure(plan, next_step, cause, planning_s);
}

std::shared_ptr<const AnnotationPlan> ElasticController::straggler_decision(const Strategy& next, int64_t next_step,
                                                                            double observed_step, double planning_s,
                                                                            const std::vector<int>& active) {
  const TrainOptions& o = t_.o_;
  const CostModel model = CostModel::load(t_.config_, *assumed_, o.profile_path);
  const double now_s = model.evaluate(t_.rt_->strategy, o.seq_len).predicted_step_s;
  const double next_s = model.evaluate(next, o.seq_len).predicted_step_s;
  const int64_t horizon = std::min(o.straggler_horizon, o.steps - next_step);
  // The model's prediction scaled to what the run observes.
  const double gain_s = now_s > 0 ? observed_step * (1 - next_s / now_s) * static_cast<double>(horizon) : 0.0;
  std::shared_ptr<const AnnotationPlan> plan;
  double switch_s = 0;
  const bool differs = !same_execution(next, t_.rt_->strategy);
  if (differs) {
    plan = t_.compile(next);
    SwitchOptions so = t_.base_switch_options();
    so.lost_ranks = failed_;
    switch_s = t_.switch_plans_.get(*t_.rt_->plan, *plan, *t_.topology_, so).predicted_s;
  }
  const double cost_s = planning_s + t_.last_specialize_s_ + switch_s;
  // The wall-clock parts of the cost differ between ranks: rank 0 decides.
  int64_t decision = differs && gain_s > cost_s ? 1 : 0;
  t_.world_.broadcast(&decision, 1, 0);
  const bool go = decision != 0;
  nlohmann::json speeds = nlohmann::json::object();
  for (int k : active) speeds[std::to_string(k)] = assumed_->rank(k).slowdown;
  t_.log_.write({{"event", "straggler"}, {"step", next_step}, {"estimated_slowdown", speeds},
                 {"role_factors", role_factors(window_)}, {"predicted_step_s", now_s}, {"replanned_step_s", next_s},
                 {"observed_step_s", observed_step}, {"horizon_steps", horizon}, {"gain_s", gain_s},
                 {"cost_s", cost_s}, {"switch", go}});
  return go ? plan : nullptr;
}

// ---- The part's life: checks before step 0, resume, the loop's hooks ----

void ElasticController::check_token_events(const TokenSteps& tokens) const {
  const TrainOptions& o = t_.o_;
  for (const ElasticEvent& e : events_) {  // an event's strategy becomes the only choice: it takes every piece
    if (e.strategy_path.empty()) continue;
    const Strategy& s = *event_plans_.at(e.step)->strategy;
    const int64_t longest = tokens.longest_piece(), most = tokens.most_accepted({&s});
    if (most < longest)
      fail("[events] ", o.events_path, ": step ", e.step, ": strategy ", e.strategy_path, ": a piece of ", longest,
           " tokens of ", o.data_path, ", but no pipeline accepts more than ", most, " (its max_seq_len)");
    try {
      tokens.check_pieces({&s}, "its strategy");
    } catch (const Error& err) {
      fail("[events] ", o.events_path, ": step ", e.step, ": strategy ", e.strategy_path, ": ", err.what());
    }
  }
}

void ElasticController::resume_at(int64_t start) {
  failed_ = failed_after(events_, start - 1);
  events_done_ = start - 1;
  for (const ElasticEvent& e : events_) {
    if (e.step >= start) break;
    for (const auto& [r, factor] : e.slowdown) {
      if (r == t_.world_.rank() && t_.clock_) t_.clock_->set_slowdown(factor);
      assumed_ = std::make_shared<const Topology>(assumed_->with_slowdown(r, factor));
    }
  }
}

int64_t ElasticController::before_step(int64_t step) {
  auto ev = std::find_if(events_.begin(), events_.end(), [&](const ElasticEvent& e) { return e.step == step; });
  if (ev == events_.end() || step <= events_done_) return step;
  events_done_ = step;
  return apply_event(*ev, step);
}

void ElasticController::after_step(int64_t step, const StepRecord& r) { watch_stragglers(step, r); }

void ElasticController::after_plan_change() {
  skip_next_ = true;
  window_.clear();
  window_steps_.clear();
  predicted_.clear();
}

}  // namespace hspmd::dist
