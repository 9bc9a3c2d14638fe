// The distributed trainer's set-up: the run's checks before any data is
// read (flags, model memory, outputs, the cluster, every plan), then
// prepare(): the data, the resume or the initial weights, and the first
// plan specialized (errors before any step).
#include <filesystem>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "hspmd/io/safetensors.h"
#include "hspmd/models/model.h"
#include "hspmd/planner/profiler.h"
#include "train/dist_trainer.h"
#include "train/resume_checks.h"

namespace hspmd::dist {

DistTrainer::DistTrainer(const TrainOptions& o, Communicator& world)
    : o_(o), world_(world), config_(ModelConfig::load(o.model_path)), checkpoints_(o, world), meter_(world) {
  check_run_options();
  set_up_emulation();
  load_plans();
  if (!o.events_path.empty()) elastic_ = std::make_unique<ElasticController>(*this);
  if (o.batch_tokens > 0) tokens_ = std::make_unique<TokenSteps>(*this);
}

DistTrainer::~DistTrainer() = default;

void DistTrainer::check_run_options() const {
  const TrainOptions& o = o_;
  validate(o);  // the options' own rules (a front end ran them already; a run built in code did not)
  // Before any graph or parameter is built: one process holds the whole
  // training state; each of several ranks at least the full f32 model it initializes from.
  if (world_.size() == 1)
    check_parameters_fit_memory(config_, o.model_path, 16, "f32 weights, gradients and Adam moments");
  else
    check_parameters_fit_memory(config_, o.model_path);
  check_sequence_length(o, config_);
  // Padded rows (packed documents, token budgets) are routed like any token,
  // and how many there are depends on the plan's sequence granularity: the
  // auxiliary loss's statistics would too (docs/moe.md).
  if (config_.moe.aux_loss() && (o.pack_documents || o.batch_tokens > 0))
    fail_option(o.pack_documents ? "pack_documents" : "batch_tokens", ": ", o.model_path,
                " has the mixture-of-experts auxiliary loss (output_router_logits), whose router statistics would "
                "count the padding the plan adds; train it on fixed-length samples or without the loss");
  if (o.cuda_graphs && o.device.type != DeviceType::CUDA)
    fail_option("cuda_graphs", " needs a CUDA device (a graph records a GPU stream's work); the run is on ",
                o.device.str());
  train_common::check_outputs(o, world_.rank());
  check_checkpoint_directory(o);
}

// The cluster (--cluster, else uniform), and with --cluster or --trace a
// virtual clock per rank (docs/emulation.md); --clock model times ops by
// the profile's model (docs/profiling.md).
void DistTrainer::set_up_emulation() {
  const TrainOptions& o = o_;
  algorithm_ = parse_switch_algorithm(o.switch_algorithm);
  topology_ = std::make_shared<const Topology>(o.cluster_path.empty() ? Topology::uniform(world_.size())
                                                                      : Topology::load(o.cluster_path));
  if (topology_->world_size() != world_.size())
    fail("[cluster] ", o.cluster_path, " has ", topology_->world_size(), " ranks but the job has ", world_.size());
  if (o.model_clock) {  // validate() checked its cluster and profile are given
    profile_ = Profile::load(o.profile_path);
    check_profile_model(*profile_, config_, o.profile_path, o.model_path);
    check_profile_precision(*profile_, o.precision, o.profile_path);
    time_model_ = std::make_shared<const OpTimeModel>(profile_->ops, o.profile_path);
  }
  if (!o.cluster_path.empty() || !o.trace_path.empty()) {  // emulate: a virtual clock per rank
    clock_ = std::make_unique<VirtualClock>(topology_->rank(world_.rank()).slowdown,
                                            o.model_clock ? ClockMode::kModel : ClockMode::kCpu);
    clock_->set_tracing(!o.trace_path.empty());
  }
}

// The first plan and one per --switch, each checked before the first step.
void DistTrainer::load_plans() {
  const TrainOptions& o = o_;
  plans_.push_back(o.strategy ? compile(*o.strategy)
                              : load_plan_file(o.plan_path.empty() ? o.strategy_path : o.plan_path));
  int64_t last = 0;
  for (const TrainOptions::Switch& sw : o.switches) {
    if (sw.step <= last || sw.step >= o.steps)
      fail_option("switch", " ", sw.step, ":", sw.path, ": steps must ascend within (0, ", option_name("steps"), " ", o.steps, ")");
    for (int r : sw.lost_ranks)
      if (r < 0 || r >= world_.size()) fail_option("switch_lost", " ", sw.step, ": rank ", r, " is outside the world");
    last = sw.step;
    plans_.push_back(load_named_plan_file(sw.path, (option_name("switch") + " ") + std::to_string(sw.step)));
    if (o.batch_tokens == 0 && plans_.back()->strategy->global_batch() != plans_[0]->strategy->global_batch())
      fail_option("switch", " ", sw.step, ":", sw.path, ": global batch ", plans_.back()->strategy->global_batch(),
           ", the run's is ", plans_[0]->strategy->global_batch(), " (a switch keeps the global batch)");
  }
  for (const auto& p : plans_)
    if (o.batch_tokens == 0 && o.global_batch != 0 && o.global_batch != p->strategy->global_batch())
      fail_option("global_batch", " ", o.global_batch, " differs from the strategy's global batch ",
           p->strategy->global_batch());
}

void DistTrainer::prepare() {
  data_ = std::make_unique<TokenData>(TokenData::load(o_.data_path, config_.vocab_size));
  if (tokens_) {
    tokens_->load_pieces(*data_);
    if (elastic_) elastic_->check_token_events(*tokens_);
  } else {
    source_ = std::make_unique<train_common::SampleSource>(*data_, o_.seq_len, o_.pack_documents,
                                                           config_.eos_token_id);
  }
  int64_t start = 0;
  std::unique_ptr<CheckpointReader> reader;
  if (!o_.resume_dir.empty()) {
    reader = std::make_unique<CheckpointReader>(o_.resume_dir);
    start = reader->index().step;
    checkpoints_.resumed_from(*reader);
    if (start >= o_.steps)
      fail("[checkpoint] ", o_.resume_dir, ": it is at step ", start, ", not before ", option_name("steps"), " ", o_.steps);
    // Before any state is read: the meta's fields, and the model and data
    // mode it was written under (docs/checkpoint.md, "What a resume checks").
    train_common::read_resume_cursor(reader->index().meta, o_.resume_dir);
    train_common::check_resume_matches(reader->index().meta, config_, o_, o_.resume_dir);
  }
  plan_index_ = plan_at(start);
  const std::shared_ptr<const AnnotationPlan> first =
      reader && elastic() ? resume_plan(*reader, start) : plans_[plan_index_];
  // The dispatch's cost model: the speeds as the planner assumes them.
  if (tokens_) tokens_->set_speeds(elastic_ ? elastic_->assumed() : *topology_);
  const auto t0 = Clock::now();
  rt_ = specialize(first);
  if (reader && elastic()) elastic_->replan_failed_at_resume(start);
  last_specialize_s_ = seconds_since(t0);
  if (tokens_) tokens_->specialize_choices();
  // Every switch is planned now, so that one that cannot be done (a lost
  // rank's slices with no checkpoint) fails before the first step.
  for (size_t k = plan_index_ + 1; k < plans_.size(); ++k)
    switch_plans_.get(*plans_[k - 1], *plans_[k], *topology_, switch_options(k));
  load_state(reader.get(), start);
}

// Elastic: the plan in force when the checkpoint was written (re-planned,
// perhaps), and the cluster as the events before the step left it.
std::shared_ptr<const AnnotationPlan> DistTrainer::resume_plan(const CheckpointReader& reader, int64_t start) {
  const nlohmann::json& meta = reader.index().meta;
  std::shared_ptr<const AnnotationPlan> first = plans_[plan_index_];
  if (tokens_ && !tokens_->choices().empty() && meta.contains("strategies"))  // the set in force
    first = tokens_->resume_choices(meta);
  else if (meta.contains("strategy"))
    first = compile(strategy_from_json(meta.at("strategy")));
  elastic_->resume_at(start);
  return first;
}

void DistTrainer::load_state(CheckpointReader* reader, int64_t start) {
  if (reader) {
    state_ = TrainingState::load(rt_->plan, world_.rank(), *reader);
    state_->move_to_device(o_.device);
    state_->step = start;
    const train_common::ResumeCursor cursor = train_common::read_resume_cursor(reader->index().meta, o_.resume_dir);
    state_->samples = cursor.samples;
    state_->seed = cursor.seed;
    return;
  }
  std::map<std::string, NDArray> full =
      o_.init_path.empty()
          ? init_model_parameters(config_, o_.seed)
          : validate_model_weights(config_, load_safetensors(o_.init_path), o_.init_path);
  if (!o_.init_path.empty()) train_common::check_finite_weights(full, o_.init_path);
  state_ = TrainingState::from_full(rt_->plan, world_.rank(), full);
  state_->move_to_device(o_.device);
  state_->seed = o_.seed;
}

}  // namespace hspmd::dist
