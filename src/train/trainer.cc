#include "hspmd/train/trainer.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/cpu_isa.h"
#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "hspmd/core/threads.h"
#include "hspmd/io/checkpoint.h"
#include "hspmd/io/output_file.h"
#include "hspmd/models/config.h"
#include "kernels/basic.h"
#include "train/dist_trainer.h"
#include "train/replica_check.h"
#include "train/train_common.h"

namespace hspmd {

namespace {

// One process trains the model alone: the step's samples as one pipeline's
// micro-batches (token-budget steps have none).
void check_one_process_batch(const TrainOptions& o, const ModelConfig& c) {
  check_sequence_length(o, c);
  if (o.batch_tokens > 0) return;
  if (o.global_batch <= 0)
    fail_option("global_batch", " is required without a strategy or plan (samples per step), got ", o.global_batch);
  if (o.micro_batches <= 0 || o.global_batch % o.micro_batches != 0)
    fail_option("micro_batches", " ", o.micro_batches, " must divide ", option_name("global_batch"), " ",
                o.global_batch);
}

// Runs `check` on every rank; when it throws on any, every rank throws
// SetupFailure with the lowest failing rank's message (nothing changed);
// `elsewhere` is the message of the ranks whose check passed.
void agreed(Communicator& world, const std::function<void()>& check,
            const char* elsewhere = "[train] the check failed on another rank") {
  std::string error;
  try {
    check();
  } catch (const Error& e) {
    error = e.what();
  }
  std::vector<int32_t> failed(world.size(), 0);
  const int32_t mine = error.empty() ? 0 : 1;
  world.all_gather(&mine, failed.data(), std::vector<int64_t>(world.size(), 1));
  const auto first = std::find(failed.begin(), failed.end(), 1);
  if (first != failed.end())
    throw SetupFailure(error.empty() ? elsewhere : error,
                       first - failed.begin() == world.rank());
}

}  // namespace

std::string new_run_id() {
  std::random_device device;
  std::seed_seq seed{device(), device(), device(), device(),
                     static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count())};
  std::mt19937_64 gen(seed);
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(gen()));
  return buf;
}

std::string checkpoint_run_id(const std::string& dir) {
  const CheckpointIndex index = load_checkpoint_index(dir);
  const auto it = index.meta.find("run_id");
  return it != index.meta.end() && it->is_string() ? it->get<std::string>() : "";
}

void check_checkpoint_owner(const std::string& dir, const CheckpointWriter& w) {
  if (dir.empty() || w.overwrite || !checkpoint_exists(dir)) return;
  int64_t step = -1;
  std::optional<std::string> id;  // unreadable: still another run's files
  try {
    const CheckpointIndex index = load_checkpoint_index(dir);
    step = index.step;
    const auto it = index.meta.find("run_id");
    id = it != index.meta.end() && it->is_string() ? it->get<std::string>() : "";
  } catch (const Error&) {
  }
  if (id && w.run_id && *id == *w.run_id) return;  // the writer's own
  std::error_code ec;
  if (!w.resume_dir.empty() && std::filesystem::equivalent(w.resume_dir, dir, ec) &&
      (!w.resume_run_id || (id && *id == *w.resume_run_id)))
    return;  // the checkpoint the run continues
  if (step >= 0)
    fail(w.what, " ", dir, ": holds the committed checkpoint of step ", step, " of another run; ", w.fix);
  fail(w.what, " ", dir, ": holds a committed checkpoint of another run; ", w.fix);
}

void check_checkpoint_directory(const TrainOptions& o) {
  CheckpointWriter w;
  w.what = (options_tag() + " " + option_name("checkpoint"));
  w.overwrite = o.overwrite_checkpoint;
  w.resume_dir = o.resume_dir;
  w.fix = ("give " + option_name("resume") + " ") + o.checkpoint_dir +
          (" to continue it, " + option_name("overwrite_checkpoint") + " to replace it, or another directory");
  check_checkpoint_owner(o.checkpoint_dir, w);
}

void check_run_files_apart(const TrainOptions& o) {
  std::vector<NamedPath> in = {{option_name("model"), o.model_path},       {option_name("data"), o.data_path},   {option_name("init"), o.init_path},
                               {option_name("strategy"), o.strategy_path}, {option_name("plan"), o.plan_path},   {option_name("cluster"), o.cluster_path},
                               {option_name("profile"), o.profile_path},   {option_name("events"), o.events_path}};
  for (const TrainOptions::Switch& sw : o.switches) in.push_back({option_name("switch"), sw.path});
  for (const std::string& s : o.strategy_choices) in.push_back({option_name("strategies"), s});
  check_outputs_apart(in, {{option_name("save"), o.save_path}, {option_name("dump_grads"), o.dump_grads_path}, {option_name("log"), o.log_path},
                           {option_name("trace"), o.trace_path}, {option_name("op_times"), o.op_times_path}});
}

void check_sequence_length(const TrainOptions& o, const ModelConfig& c) {
  // With token budgets seq_len is the longest piece (the command line's --max-seq-len).
  const char* field = o.batch_tokens > 0 && option_spelling() == OptionSpelling::kFlag ? "max_seq_len" : "seq_len";
  if (o.seq_len <= 0) fail_option(field, " must be positive, got ", o.seq_len);
  if (o.seq_len > c.max_position_embeddings)
    fail_option(field, " ", o.seq_len, " exceeds max_position_embeddings ", c.max_position_embeddings, " of ",
                o.model_path);
}

TrainOptions single_process_options(const TrainOptions& o) {
  const ModelConfig config = ModelConfig::load(o.model_path);
  check_one_process_batch(o, config);
  TrainOptions one = o;
  Strategy strategy;
  strategy.description = "one process";
  Pipeline p;
  if (o.batch_tokens <= 0) {
    p.micro_batch_size = static_cast<int>(o.global_batch / o.micro_batches);
    p.micro_batches = static_cast<int>(o.micro_batches);
  }
  p.stages.push_back(Stage{{0}, 0, static_cast<int>(config.num_hidden_layers) - 1});
  strategy.pipelines.push_back(p);
  one.strategy = strategy;
  return one;
}

std::vector<StepRecord> train(const TrainOptions& o) {
  const TrainOptions one = single_process_options(o);
  std::unique_ptr<Communicator> world = make_single_process_communicator();
  return train_distributed(one, *world);
}

std::string step_record_json(const StepRecord& record) { return train_common::record_json(record).dump(); }

TrainingRun::TrainingRun(const TrainOptions& options, Communicator& world) : options_(options) {
  set_num_threads(options_.threads);
  // Setup errors (strategy, world size, data, weights) are agreed on by all
  // ranks before any step: the lowest failing rank reports, every rank exits.
  agreed(
      world,
      [&] {
        cpu_isa();  // a bad HSPMD_CPU_ISA: one line before the setup (Python's Trainer too)
        trainer_ = std::make_unique<dist::DistTrainer>(options_, world);
        trainer_->prepare();
      },
      "[train] setup failed on another rank");
  trainer_->begin();
  // Once the run is set up: an error stays the one line it is (the note says
  // nothing about why a run was refused).
  if (options_.precision.mixed() && kernels::bf16_gemm_emulated() && world.rank() == 0)
    std::fprintf(stderr, "hspmd: note: %s bf16: bf16 GEMMs run emulated: no bf16 GEMM instructions (avx512_bf16 or "
                 "amx_bf16 with oneDNN) or HSPMD_GEMM_BF16=emulate; same roundings, f32 speed: %s\n",
                 option_name("precision").c_str(), kernels::gemm_isa_description().c_str());
}

TrainingRun::~TrainingRun() = default;

bool TrainingRun::done() const { return trainer_->done(); }
int64_t TrainingRun::next_step() const { return trainer_->next_step(); }

void TrainingRun::check_not_finished(const char* call) const {
  if (finished_)
    fail("[train] ", call, ": the run has finished (finish() wrote its save and trace); a finished run takes no "
         "more steps, switches or weights");
}

StepRecord TrainingRun::step() {
  check_not_finished("step");
  if (done()) fail("[train] step ", next_step(), ": the run has trained its ", options_.steps, " steps already");
  return trainer_->step();
}

std::vector<StepRecord> TrainingRun::finish() {
  check_not_finished("finish");
  finished_ = true;
  return trainer_->end();
}
void TrainingRun::wait_for_checkpoint() { trainer_->settle_checkpoint(); }
std::map<std::string, NDArray> TrainingRun::parameters() { return trainer_->full_parameters(); }
void TrainingRun::save_checkpoint(const std::string& dir) { trainer_->checkpoint_now(dir); }



void TrainingRun::switch_to(const SwitchTarget& target) {
  check_not_finished("switch_to");
  std::shared_ptr<const AnnotationPlan> plan;
  agreed(trainer_->world(), [&] {
    if (done()) fail("[train] switch_to: the run has trained its ", options_.steps, " steps already");
    if (target.strategy) plan = trainer_->compile_strategy(*target.strategy);
    else if (target.plan) plan = trainer_->trainable_plan(*target.plan, target.source);
    else plan = trainer_->load_switch_plan(target.source);
    trainer_->check_switch(*plan, target.source);
  });
  trainer_->switch_now(std::move(plan));
}

void TrainingRun::load_parameters(std::map<std::string, NDArray> weights, const std::string& source) {
  check_not_finished("load_parameters");
  std::map<std::string, NDArray> full;
  agreed(trainer_->world(), [&] {
    full = validate_model_weights(ModelConfig::load(options_.model_path), std::move(weights), source);
    train_common::check_finite_weights(full, source);
  });
  // Each rank passed its own arrays: where two ranks hold the same elements
  // they must agree (refused on every rank otherwise, nothing loaded).
  check_weight_replicas(trainer_->plan_in_force(), trainer_->world(), full, source);
  trainer_->load_weights(full);
}

std::vector<StepRecord> train_distributed(const TrainOptions& options, Communicator& world) {
  TrainingRun run(options, world);
  while (!run.done()) run.step();
  return run.finish();
}

}  // namespace hspmd
