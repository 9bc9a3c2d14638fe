// The distributed trainer's plans: plan and strategy files, compiling a
// strategy for this run, specializing a plan for this rank, and the moves
// between plans (--switch, switch_to, and the parts' switches: a
// --strategies choice, an elastic reconfiguration).
#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "train/dist_trainer.h"

namespace hspmd::dist {

std::shared_ptr<const AnnotationPlan> DistTrainer::load_plan_file(const std::string& path) const {
  if (is_plan_file(path)) return trainable_plan(load_plan(path), path);
  return compile(load_strategy(path));
}

std::shared_ptr<const AnnotationPlan> DistTrainer::load_named_plan_file(const std::string& path,
                                                                        const std::string& flag) const {
  try {
    return load_plan_file(path);
  } catch (const Error& e) {
    const std::string what = e.what();
    if (what.find(path) != std::string::npos) throw;
    fail(options_tag(), " ", flag, ": ", path, ": ", what);
  }
}

std::shared_ptr<const AnnotationPlan> DistTrainer::compile(const Strategy& strategy) const {
  const int64_t g = sequence_granularity(strategy);
  if (!o_.pack_documents && o_.batch_tokens == 0 && o_.seq_len % g != 0)
    fail("[strategy] ", option_name("seq_len"), " ", o_.seq_len, " must be a multiple of ", g,
         " (stages split the sequence over their cp x tp ranks, and cp > 1 into 2 x cp chunks)");
  CompileOptions co;
  co.seq_len = (o_.seq_len + g - 1) / g * g;  // packed lengths vary: compile for the longest, rounded up
  co.precision = precision();
  return std::make_shared<const AnnotationPlan>(compile_plan(config_, strategy, world_.size(), co));
}

std::unique_ptr<Runtime> DistTrainer::specialize(std::shared_ptr<const AnnotationPlan> plan) const {
  return hspmd::specialize(std::move(plan), world_,
                           SpecializeOptions{topology_, o_.seq_len, o_.device, clock_.get(), time_model_});
}

std::shared_ptr<const AnnotationPlan> DistTrainer::trainable_plan(AnnotationPlan plan, const std::string& source) const {
  if (!plan.strategy)
    fail("[plan] ", source, ": no \"strategy\" field: a trainable plan carries its execution (schedule, "
         "pipelines' micro-batches, recompute); compile one with `hspmd plan compile`");
  if (plan.world_size != world_.size())
    fail("[plan] ", source, ": compiled for ", plan.world_size, " ranks but the job has ", world_.size());
  ModelConfig padded = config_;
  padded.padded_vocab_size = plan.model.padded_vocab_size;
  if (plan.model.to_json() != padded.to_json())
    fail("[plan] ", source, ": its model differs from ", option_name("model"), " ", o_.model_path);
  plan.precision = precision();  // the run's flags (and device) decide how it computes
  return std::make_shared<const AnnotationPlan>(std::move(plan));
}

SwitchOptions DistTrainer::base_switch_options() const {
  SwitchOptions so;
  so.algorithm = algorithm_;
  so.bucket_bytes = static_cast<int64_t>(o_.switch_bucket_mb * 1024 * 1024);
  return so;
}

SwitchOptions DistTrainer::switch_options(size_t index) const {
  const TrainOptions::Switch& sw = o_.switches.at(index - 1);
  SwitchOptions so = base_switch_options();
  so.lost_ranks = std::set<int>(sw.lost_ranks.begin(), sw.lost_ranks.end());
  so.have_checkpoint = !o_.checkpoint_dir.empty() && o_.save_every > 0 && sw.step % o_.save_every == 0;
  return so;
}

size_t DistTrainer::plan_at(int64_t step) const {
  size_t k = 0;
  for (size_t i = 0; i < o_.switches.size(); ++i)
    if (o_.switches[i].step <= step) k = i + 1;
  return k;
}

// Moves the run to plans_[index] at `step` (--switch).
void DistTrainer::switch_to(size_t index, int64_t step) {
  nlohmann::json j = {{"event", "switch"}, {"step", step}};
  j.update(move_to(plans_[index], switch_options(index)));
  plan_index_ = index;
  log_.write(j);
}

void DistTrainer::check_switch(const AnnotationPlan& plan, const std::string& source) const {
  if (!o_.switches.empty() || !o_.events_path.empty() || !o_.strategy_choices.empty())
    fail("[train] switch_to ", source, ": this run switches by its own ", option_name("switch"), ", ", option_name("events"), " or ", option_name("strategies"));
  if (o_.batch_tokens == 0 && plan.strategy->global_batch() != plans_[0]->strategy->global_batch())
    fail(options_tag(), " switch_to ", source, ": global batch ", plan.strategy->global_batch(), ", the run's is ",
         plans_[0]->strategy->global_batch(), " (a switch keeps the global batch)");
}

// As switch_to(index, ...) for a --switch, with the options a --switch
// without lost ranks gets.
void DistTrainer::switch_now(std::shared_ptr<const AnnotationPlan> plan) {
  SwitchOptions so = base_switch_options();
  so.have_checkpoint = !o_.checkpoint_dir.empty() && o_.save_every > 0 && next_step_ % o_.save_every == 0;
  nlohmann::json j = {{"event", "switch"}, {"step", next_step_}};
  j.update(move_to(plan, so));
  plans_.push_back(std::move(plan));
  plan_index_ = plans_.size() - 1;
  log_.write(j);
}

nlohmann::json DistTrainer::move_to(std::shared_ptr<const AnnotationPlan> plan, const SwitchOptions& so) {
  finish_checkpoint(true);  // the switch may read the checkpoint of this step
  const auto t0 = Clock::now();
  std::unique_ptr<Runtime> next = specialize(std::move(plan));
  const double specialize_s = seconds_since(t0);
  last_specialize_s_ = specialize_s;
  return move_runtime(std::move(next), so, specialize_s, nullptr);
}

nlohmann::json DistTrainer::move_runtime(std::unique_ptr<Runtime> next, const SwitchOptions& so, double specialize_s,
                                         std::unique_ptr<Runtime>* keep_old) {
  finish_checkpoint(true);
  if (tokens_) tokens_->before_plan_change();
  std::unique_ptr<CheckpointReader> reader;
  if (so.have_checkpoint) reader = std::make_unique<CheckpointReader>(o_.checkpoint_dir);
  const SwitchPlan& sp = switch_plans_.get(*rt_->plan, *next->plan, *topology_, so);
  if (keep_old) *keep_old = std::move(rt_);
  rt_.reset();  // the old graph goes before the state moves: less memory at the peak
  copies_ = {};  // the weights' bf16 copies were the old plan's
  SwitchReport rep;
  state_ = std::move(*state_).reshard_to(next->plan, sp, *topology_, world_, reader.get(), clock_.get(), &rep);
  rt_ = std::move(next);
  if (tokens_) tokens_->after_plan_change();
  const auto all = gather_counts({rep.bytes_sent, rep.predicted_bytes, rep.checkpoint_bytes, rep.peak_extra_bytes,
                                  rep.bound_bytes}, world_);
  if (clock_) meter_.set_emulated_end(static_cast<int64_t>(clock_->now() * 1e9));
  if (elastic_) elastic_->after_plan_change();
  nlohmann::json j = {{"algorithm", algorithm_name(algorithm_)},
                      {"specialize_s", specialize_s}, {"switch_s", rep.switch_s},
                      {"bytes_sent", all[0]},     {"predicted_bytes", all[1]},
                      {"checkpoint_bytes", all[2]}, {"peak_extra_bytes", all[3]},
                      {"extra_bytes_bound", all[4]}, {"rounds", sp.rounds.size()},
                      {"predicted_switch_s", sp.predicted_s}};
  if (clock_) j["emulated_switch_s"] = rep.emulated_s;
  return j;
}

}  // namespace hspmd::dist
