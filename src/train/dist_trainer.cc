// The distributed training loop: one ExecGraph per rank, pipelines fed with
// their own samples, gradient sync and the ZeRO gathers through the plan's
// Reshards, AdamW on local shards.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <numeric>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/error.h"
#include "hspmd/core/threads.h"
#include "hspmd/exec/exec_graph.h"
#include "hspmd/exec/virtual_clock.h"
#include "hspmd/io/checkpoint.h"
#include "hspmd/io/safetensors.h"
#include "hspmd/optim/adam.h"
#include "hspmd/plan/pipelines.h"
#include "hspmd/plan/plan.h"
#include "hspmd/plan/cost_model.h"
#include "hspmd/plan/mixed_length.h"
#include "hspmd/plan/search.h"
#include "hspmd/plan/switch.h"
#include "hspmd/train/events.h"
#include "hspmd/train/profiler.h"
#include "hspmd/train/training_state.h"
#include "kernels/kernels.h"
#include "train/schedules.h"
#include "train/train_common.h"

namespace hspmd {

namespace {

using Clock = std::chrono::steady_clock;

// The pipeline a rank belongs to, or -1 when idle.
int pipeline_of(const Strategy& s, int rank) {
  for (size_t p = 0; p < s.pipelines.size(); ++p)
    for (const Stage& st : s.pipelines[p].stages)
      for (int r : st.ranks)
        if (r == rank) return static_cast<int>(p);
  return -1;
}

// Every rank's values of `mine`: out[i][r] is rank r's mine[i].
std::vector<std::vector<int64_t>> gather_counts(const std::vector<int64_t>& mine, Communicator& world) {
  const int k = static_cast<int>(mine.size());
  std::vector<int64_t> all(static_cast<size_t>(k) * world.size());
  world.all_gather(mine.data(), all.data(), std::vector<int64_t>(world.size(), k));
  std::vector<std::vector<int64_t>> out(k, std::vector<int64_t>(world.size()));
  for (int r = 0; r < world.size(); ++r)
    for (int i = 0; i < k; ++i) out[i][r] = all[static_cast<size_t>(r) * k + i];
  return out;
}

// What one rank measured in a step; every field an int64, gathered from all
// ranks in one all-gather.
struct StepMetrics {
  int64_t bytes_sent = 0;         // all communication
  int64_t reshard_sent = 0;       // inside Reshards, measured ...
  int64_t reshard_predicted = 0;  // ... and as the resolutions predict
  int64_t op_sent = 0;            // inside ops, measured ...
  int64_t op_predicted = 0;       // ... and as Op::traffic predicts
  int64_t clock_ns = 0;           // emulation: the virtual clock at the step's end
  int64_t compute_ns = 0;         // emulation: virtual compute so far
  int64_t peak_bytes = 0;         // peak bytes of tensors in the step
  int64_t activation_bytes = 0;   // the micro-batches' peak above what the rank held before them
};
constexpr int kStepMetricFields = sizeof(StepMetrics) / sizeof(int64_t);
static_assert(sizeof(StepMetrics) == kStepMetricFields * sizeof(int64_t));

std::vector<StepMetrics> gather_metrics(const StepMetrics& mine, Communicator& world) {
  std::vector<StepMetrics> all(world.size());
  world.all_gather(reinterpret_cast<const int64_t*>(&mine), reinterpret_cast<int64_t*>(all.data()),
                   std::vector<int64_t>(world.size(), kStepMetricFields));
  return all;
}


double all_reduce_scalar(double v, Communicator& world) {
  world.all_reduce(&v, 1);
  return v;
}

// Rank 0's `text` on every rank.
void broadcast_text(std::string& text, Communicator& world) {
  int64_t n = static_cast<int64_t>(text.size());
  world.broadcast(&n, 1, 0);
  std::vector<int64_t> words((n + 7) / 8, 0);
  if (world.rank() == 0 && n > 0) std::memcpy(words.data(), text.data(), static_cast<size_t>(n));
  if (!words.empty()) world.broadcast(words.data(), static_cast<int64_t>(words.size()), 0);
  text.assign(reinterpret_cast<const char*>(words.data()), static_cast<size_t>(n));
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// Two strategies that execute alike (the description aside).
bool same_execution(Strategy a, Strategy b) {
  a.description.clear();
  b.description.clear();
  return a == b;
}

// One plan made executable on this rank: its ExecGraph and what the
// schedule needs (the pipeline and stage of the rank, micro-batches).
struct Runtime {
  std::shared_ptr<const AnnotationPlan> plan;
  Strategy strategy;                 // execution: schedule, micro-batches, recompute
  std::unique_ptr<ExecGraph> graph;
  std::map<std::string, Shape> shapes;  // parameters' global shapes (vocabulary padded for the plan)
  int pipeline = -1;
  int stage = 0, stages = 1;         // this rank's stage and its pipeline's stage count
  int64_t granularity = 1;           // every micro-batch's sequence length is a multiple of it
  int micro_batches() const { return pipeline < 0 ? 0 : strategy.pipelines[pipeline].micro_batches; }
};


// A checkpoint being written by this rank's background thread: the shards
// were copied, so the steps go on while the disk works.
struct PendingCheckpoint {
  int64_t step = 0;
  nlohmann::json meta;
  std::thread writer;
  std::atomic<bool> done{false};
  std::string error;  // the writer's failure, or ""
  ~PendingCheckpoint() {
    if (writer.joinable()) writer.join();
  }
};

class DistTrainer {
 public:
  DistTrainer(const TrainOptions& o, Communicator& world)
      : o_(o), world_(world), config_(LlamaConfig::load(o.model_path)) {
    train_common::check_finite_options(o);
    // Before any graph or parameter is built: one process holds the whole
    // training state; each of several ranks at least the full f32 model it initializes from.
    if (world.size() == 1)
      check_parameters_fit_memory(config_, o.model_path, 16, "f32 weights, gradients and Adam moments");
    else
      check_parameters_fit_memory(config_, o.model_path);
    if (o.seq_len <= 0 || o.seq_len > config_.max_position_embeddings)
      fail("[flags] --seq-len ", o.seq_len, " must be in [1, max_position_embeddings ",
           config_.max_position_embeddings, "] of ", o.model_path);
    if (o.steps <= 0) fail("[flags] --steps must be positive, got ", o.steps);
    if (o.clip_grad < 0) fail("[flags] --clip-grad must be >= 0, got ", o.clip_grad);
    if (!(o.schedule.lr > 0)) fail("[flags] --lr must be positive, got ", o.schedule.lr);
    if (o.save_every < 0) fail("[flags] --save-every must be >= 0, got ", o.save_every);
    if (o.save_every > 0 && o.checkpoint_dir.empty()) fail("[flags] --save-every needs --checkpoint DIR");
    if (o.skip_nonfinite_steps < 0)
      fail("[flags] --skip-nonfinite-steps must be >= 0, got ", o.skip_nonfinite_steps);
    train_common::check_outputs(o, world.rank());
    algorithm_ = parse_switch_algorithm(o.switch_algorithm);
    topology_ = std::make_shared<const Topology>(o.cluster_path.empty() ? Topology::uniform(world.size())
                                                                        : Topology::load(o.cluster_path));
    if (topology_->world_size() != world.size())
      fail("[cluster] ", o.cluster_path, " has ", topology_->world_size(), " ranks but the job has ",
           world.size());
    if (o.model_clock) {  // docs/profiling.md
      if (o.cluster_path.empty()) fail("[flags] --clock model needs --cluster (it times an emulated cluster)");
      if (o.profile_path.empty()) fail("[flags] --clock model needs --profile P.json (made by hspmd profile)");
      profile_ = Profile::load(o.profile_path);
      check_profile_model(*profile_, config_, o.profile_path, o.model_path);
      time_model_ = std::make_shared<const OpTimeModel>(profile_->ops, o.profile_path);
    } else if (!o.profile_path.empty() && o.events_path.empty() && o.batch_tokens == 0) {
      fail("[flags] --profile is read only with --clock model, --events or --batch-tokens (the cost model's "
           "profile)");
    }
    if (o.batch_tokens > 0 && !o.events_path.empty())
      fail("[flags] --events does not go with --batch-tokens yet (a re-plan is for a batch of samples)");
    if (o.batch_tokens > 0 && o.pack_documents)
      fail("[flags] --pack-documents does not go with --batch-tokens (token-budget steps cut documents into "
           "pieces themselves)");
    if (!o.cluster_path.empty() || !o.trace_path.empty()) {  // emulate: a virtual clock per rank
      clock_ = std::make_unique<VirtualClock>(topology_->rank(world.rank()).slowdown,
                                              o.model_clock ? ClockMode::kModel : ClockMode::kCpu);
      clock_->set_tracing(!o.trace_path.empty());
    }
    plans_.push_back(o.strategy ? compile(*o.strategy)
                                : load_plan_file(o.plan_path.empty() ? o.strategy_path : o.plan_path));
    int64_t last = 0;
    for (const TrainOptions::Switch& sw : o.switches) {
      if (sw.step <= last || sw.step >= o.steps)
        fail("[flags] --switch ", sw.step, ":", sw.path, ": steps must ascend within (0, --steps ", o.steps, ")");
      for (int r : sw.lost_ranks)
        if (r < 0 || r >= world.size()) fail("[flags] --switch-lost ", sw.step, ": rank ", r, " is outside the world");
      last = sw.step;
      plans_.push_back(load_plan_file(sw.path));
    }
    for (const auto& p : plans_)  // every plan is checked before the first step
      if (o.batch_tokens == 0 && o.global_batch != 0 && o.global_batch != p->strategy->global_batch())
        fail("[flags] --global-batch ", o.global_batch, " differs from the strategy's global batch ",
             p->strategy->global_batch());
    if (!o.events_path.empty()) load_elastic_events();
    if (!o.strategy_choices.empty()) {
      if (o.batch_tokens == 0) fail("[flags] --strategies needs --batch-tokens (a strategy is chosen per step)");
      if (!o.switches.empty() || !o.events_path.empty())
        fail("[flags] --strategies does not go with --switch or --events");
      choices_.push_back(plans_[0]);
      for (size_t i = 1; i < o.strategy_choices.size(); ++i) choices_.push_back(load_plan_file(o.strategy_choices[i]));
    }
    if (o.bucket_switching) {
      if (choices_.empty()) fail("[flags] --bucket-switching needs --strategies (one strategy per length bucket)");
      for (const auto& c : choices_)  // gradients move between the plans' layouts: one vocabulary padding
        if (c->model.padded_vocab_size != choices_[0]->model.padded_vocab_size)
          fail("[flags] --bucket-switching: the strategies pad the vocabulary differently (", c->model.padded_vocab_size,
               " and ", choices_[0]->model.padded_vocab_size, " rows: their tensor-parallel degrees); give strategies "
               "whose vocabulary splits alike");
    }
  }

  // Reads the data and the initial weights or checkpoint, specializes the
  // first plan (errors before any step).
  void prepare();
  std::vector<StepRecord> run();

 private:
  // A strategy (compiled) or a trainable plan for this job.
  std::shared_ptr<const AnnotationPlan> load_plan_file(const std::string& path) const;
  std::shared_ptr<const AnnotationPlan> compile(const Strategy& strategy) const;
  std::unique_ptr<Runtime> specialize(std::shared_ptr<const AnnotationPlan> plan) const;
  // How the switch to plans_[index] is planned: the checkpoint serves lost
  // ranks' slices when one is written at that very step.
  SwitchOptions switch_options(size_t index) const;
  void create_groups(const std::vector<PlannedReshard>& reshards,
                     const std::vector<PlannedOpTraffic>& traffic) const;
  // The index into plans_ in force at `step`.
  size_t plan_at(int64_t step) const;
  void switch_to(size_t index, int64_t step, std::ofstream& log);
  // Specializes `plan` and moves the training state to it; returns the log
  // fields every switch record shares.
  nlohmann::json move_to(std::shared_ptr<const AnnotationPlan> plan, const SwitchOptions& so);
  // The same for a plan specialized already; the old runtime goes to
  // *keep_old when given (--strategies keeps every choice's graphs).
  nlohmann::json move_runtime(std::unique_ptr<Runtime> next, const SwitchOptions& so, double specialize_s,
                              std::unique_ptr<Runtime>* keep_old);

  // Elastic training (docs/elastic.md).
  void load_elastic_events();
  // The event's changes before `step`: speeds, failed ranks, then the next
  // plan (the event's strategy, or a re-plan when ranks changed).
  // Returns the step the run continues at: `step`, or an earlier one after
  // a rollback to the last checkpoint.
  int64_t apply_event(const ElasticEvent& ev, int64_t step, std::ofstream& log);
  // Rank 0 searches for the available ranks under `topology`; every rank gets
  // its answer (a search stopped by its time limit is not repeatable).
  Strategy replan(const Topology& topology, int64_t step, const std::string& cause, double& planning_s);
  // Moves to `plan` before `step`: the failed ranks' memory is gone.
  // Returns the step to continue at (as apply_event).
  int64_t reconfigure(std::shared_ptr<const AnnotationPlan> plan, int64_t step, const std::string& cause,
                      double planning_s, std::ofstream& log);
  // Slices only failed ranks held and no checkpoint of `step`: the whole
  // state is loaded under `plan` from the last checkpoint (an earlier
  // step), whose steps are trained again. Returns that step.
  int64_t rollback(std::shared_ptr<const AnnotationPlan> plan, int64_t step, const std::string& cause,
                   double planning_s, std::ofstream& log);
  // Whether the committed training checkpoint is the one of `step`.
  bool checkpoint_at(int64_t step);
  // Stragglers: after `step`, with its record; may re-plan and switch.
  void watch_stragglers(int64_t step, const StepRecord& r, std::ofstream& log);
  // Per rank, the cost model's compute seconds per step of the current plan
  // under the assumed speeds (0 for idle ranks); empty when it cannot say.
  std::vector<double> predicted_compute(const Topology& topology) const;
  // This rank's placeholders for micro-batch `micro` of the step (the loss
  // divided by `normalizer`), and the bindings of their symbolic dims (S
  // varies with packed documents).
  ValueMap feeds(int micro, float normalizer, Bindings& bindings) const;
  double global_grad_norm(std::map<std::string, NDArray>& synced) const;
  void optimizer_step(Adam& adam, std::map<std::string, NDArray>& synced, double lr);
  void accumulate_schedule(std::map<std::string, NDArray>& raw, double& loss, float normalizer);

  // Token-budget steps (docs/mixed_length.md).
  struct TokenStep {
    std::vector<std::vector<std::vector<int64_t>>> micro;  // per pipeline, per micro-batch: its pieces
    int64_t pieces = 0, tokens = 0, counted = 0;
    std::vector<int64_t> pipeline_tokens;
    double predicted_s = 0;  // the slowest pipeline's predicted compute
  };
  // Checks that every piece fits the budget and some pipeline of `s`.
  // Checks the budget against the longest piece, each pipeline's capacity,
  // and that some pipeline of `strategies` accepts the longest piece.
  void check_pieces(const std::vector<const Strategy*>& strategies, const std::string& what) const;
  // The pieces of the step starting at piece `cursor`, dispatched over the
  // current plan's pipelines: longest first, each to the pipeline that
  // accepts it and would finish first by the cost model; then packed into
  // micro-batches first-fit decreasing. The same on every rank.
  TokenStep plan_token_step(int64_t cursor) const { return plan_token_step(cursor, rt_->strategy, -1); }
  // The same under strategy `s` (`key`: its index among --strategies, -1
  // for the current plan's).
  TokenStep plan_token_step(int64_t cursor, const Strategy& s, int key) const;
  TokenStep plan_pieces(const std::vector<int64_t>& pieces, const Strategy& s, int key) const;
  // --bucket-switching (the HotSPa-like baseline): the step's pieces in
  // buckets, each the pieces whose smallest accepting strategy is that one;
  // bucket by bucket (shortest first) the run switches to its strategy,
  // trains its micro-batches and syncs their gradients, which add up across
  // the buckets (moved to each next plan's gradient layout). Returns the
  // step's loss; `synced` ends in the last plan's layout; `whole` describes
  // the step.
  double run_buckets(int64_t step, float normalizer, std::ofstream& log, std::map<std::string, NDArray>& synced,
                     size_t held, size_t& activations, TokenStep& whole);
  // Moves the run to --strategies choice `pick` (its graphs specialized
  // already) and logs the switch.
  void switch_choice(int pick, int64_t step, const std::string& cause, std::ofstream& log);
  const PieceCosts& piece_costs(const Strategy& s, int key) const;
  // The pieces of the step from `cursor` (file order, within the budget).
  std::vector<int64_t> step_pieces(int64_t cursor) const;
  // A step's selection and dispatch, worked out ahead (on a background
  // thread while the step before trains): per strategy that accepts the
  // step's longest piece (--strategies; else the current plan's alone) its
  // dispatch, and the pick (lowest predicted time plus the switch's, from
  // the current choice). Touches only const state and the piece-cost cache.
  struct Prepared {
    int64_t cursor = 0;
    const AnnotationPlan* plan = nullptr;  // the plan in force when it was made
    int current = 0;                       // the choice it switches from
    std::vector<std::optional<TokenStep>> by_choice;  // --strategies; else [0] = the current plan's
    int pick = 0;
  };
  Prepared prepare_token_step(int64_t cursor, int current, const AnnotationPlan* plan) const;
  // The step's dispatch, from the prepared one when it fits (else worked
  // out now); with --strategies, rank 0's pick and the switch to it.
  // Returns the seconds the training thread spent on it.
  double select_and_dispatch(int64_t step, std::ofstream& log);
  // Copies this rank's shards and writes them on a background thread
  // (synchronously with --checkpoint-sync); committed by finish_checkpoint.
  void save_checkpoint();
  // Collective. When every rank's writer is done (or `wait`: after waiting
  // for them), rank 0 commits the pending checkpoint; a writer's error ends
  // the run. Does nothing without a pending checkpoint.
  void finish_checkpoint(bool wait);
  // The first parameter (in the model's order) holding a NaN or infinity on
  // any rank, or "" (collective): weights are checked before they are written.
  std::string nonfinite_parameter();
  // Stops the run (`skipped` steps so far beyond --skip-nonfinite-steps) or
  // marks the record skipped when its loss or gradient norm is not finite;
  // the same on every rank (both are all-reduced). True: skip the update.
  bool skip_nonfinite(StepRecord& r, int64_t& skipped) const;
  // One JSON line to the log (rank 0); a write error ends the run.
  void write_log(std::ofstream& log, const nlohmann::json& j) const;
  // The ranks' metrics into the record (the emulated step from the clocks).
  void fill_record(const std::vector<StepMetrics>& all, StepRecord& r);
  void save();
  void gather_and_write(const std::string& path, const std::string& prefix,
                        const std::function<std::pair<Annotation, NDArray>(const std::string&)>& local,
                        DType dtype) const;
  void write_trace() const;

  const TrainOptions& o_;
  Communicator& world_;
  LlamaConfig config_;
  SwitchAlgorithm algorithm_ = SwitchAlgorithm::kFused;
  std::shared_ptr<const Topology> topology_;
  std::vector<std::shared_ptr<const AnnotationPlan>> plans_;  // the first, then one per switch
  std::unique_ptr<Runtime> rt_;
  size_t plan_index_ = 0;
  std::optional<TrainingState> state_;
  SwitchPlanCache switch_plans_;
  std::unique_ptr<VirtualClock> clock_;
  std::optional<Profile> profile_;                 // --clock model: the profile ...
  std::shared_ptr<const OpTimeModel> time_model_;  // ... and its per-op model
  int64_t emulated_end_ = 0;                 // ns, the previous step's end
  std::vector<int64_t> emulated_compute_;    // ns, per rank, up to the previous step
  std::unique_ptr<TokenData> data_;
  std::unique_ptr<train_common::SampleSource> source_;
  std::unique_ptr<PendingCheckpoint> pending_;
  std::unique_ptr<PackedDocuments> pieces_;  // token-budget steps
  std::optional<CostModel> dispatch_model_;
  mutable std::map<int, std::unique_ptr<PieceCosts>> piece_costs_;  // per strategy key (see plan_token_step)
  std::vector<std::shared_ptr<const AnnotationPlan>> choices_;  // --strategies, compiled
  int choice_ = 0;                                              // the one in force
  std::vector<std::unique_ptr<Runtime>> choice_rt_;  // the others' graphs, specialized before step 0
  std::vector<std::vector<double>> choice_switch_s_;  // [from][to]: the switch plan's predicted seconds
  std::future<Prepared> next_;                       // the next step's, being prepared
  std::optional<TokenStep> token_step_;  // this step's
  // Elastic training.
  std::vector<ElasticEvent> events_;
  std::map<int64_t, std::shared_ptr<const AnnotationPlan>> event_plans_;  // step -> the event's strategy
  std::set<int> failed_;                   // ranks whose devices are gone now
  int64_t events_done_ = -1;               // events up to this step have happened
  std::shared_ptr<const Topology> assumed_;  // the planner's view: speeds as last estimated
  double last_specialize_s_ = 0;
  std::vector<std::vector<double>> window_;  // stragglers: per step in the window, per rank compute
  std::vector<double> window_steps_;         // ... and the emulated step times
  std::vector<double> predicted_;            // per rank compute of the current plan (assumed speeds)
  bool skip_next_ = true;                    // the first step after a (re)start or switch is not watched
};

std::shared_ptr<const AnnotationPlan> DistTrainer::load_plan_file(const std::string& path) const {
  if (is_plan_file(path)) {
    AnnotationPlan plan = load_plan(path);
    if (!plan.strategy)
      fail("[plan] ", path, ": no \"strategy\" field: a trainable plan carries its execution (schedule, "
           "pipelines' micro-batches, recompute); compile one with `hspmd plan compile`");
    if (plan.world_size != world_.size())
      fail("[plan] ", path, ": compiled for ", plan.world_size, " ranks but the job has ", world_.size());
    LlamaConfig padded = config_;
    padded.padded_vocab_size = plan.model.padded_vocab_size;
    if (plan.model.to_json() != padded.to_json())
      fail("[plan] ", path, ": its model differs from --model ", o_.model_path);
    return std::make_shared<const AnnotationPlan>(std::move(plan));
  }
  return compile(load_strategy(path));
}

std::shared_ptr<const AnnotationPlan> DistTrainer::compile(const Strategy& strategy) const {
  const int64_t g = sequence_granularity(strategy);
  if (!o_.pack_documents && o_.batch_tokens == 0 && o_.seq_len % g != 0)
    fail("[strategy] --seq-len ", o_.seq_len, " must be a multiple of ", g,
         " (stages split the sequence over their cp x tp ranks, and cp > 1 into 2 x cp chunks)");
  CompileOptions co;
  co.seq_len = (o_.seq_len + g - 1) / g * g;  // packed lengths vary: compile for the longest, rounded up
  return std::make_shared<const AnnotationPlan>(compile_plan(config_, strategy, world_.size(), co));
}

std::unique_ptr<Runtime> DistTrainer::specialize(std::shared_ptr<const AnnotationPlan> plan) const {
  auto rt = std::make_unique<Runtime>();
  rt->plan = plan;
  rt->strategy = *plan->strategy;
  for (auto& [name, shape] : llama_parameter_shapes(plan->model)) rt->shapes[name] = shape;
  // Every rank's view of the stacked micro-batch must divide along every
  // pipeline's splits, so the granularity is common to all pipelines.
  rt->granularity = sequence_granularity(rt->strategy);
  const int64_t seq = (o_.seq_len + rt->granularity - 1) / rt->granularity * rt->granularity;
  int64_t batch = 0;
  for (const Pipeline& p : rt->strategy.pipelines) batch += p.micro_batch_size;
  rt->graph = std::make_unique<ExecGraph>(plan, topology_, world_.rank(), Bindings{{"B", batch}, {"S", seq}});
  // Pipelines are discovered from the resolved plan (appendix A.2), not
  // read from the strategy; the strategy only gives micro-batch counts.
  std::vector<PlannedOpTraffic> traffic;
  const std::vector<PlannedReshard> reshards = rt->graph->dry_run(&traffic);  // this rank's Reshards only
  create_groups(reshards, traffic);
  const auto pipelines = rt->graph->discover_pipelines();
  const PipelinePosition at = pipeline_positions(pipelines, world_.size()).at(world_.rank());
  HSPMD_CHECK(at.pipeline == pipeline_of(rt->strategy, world_.rank()),
              "discovered pipeline ", at.pipeline, " of rank ", world_.rank(), " differs from the strategy's");
  rt->pipeline = at.pipeline;
  if (!at.idle()) {
    rt->stage = at.stage;
    rt->stages = static_cast<int>(pipelines[at.pipeline].stages.size());
    for (const Stage& st : rt->strategy.pipelines[rt->pipeline].stages)
      if (std::count(st.ranks.begin(), st.ranks.end(), world_.rank())) rt->graph->set_recompute(st.recompute);
  }
  rt->graph->set_deferred_sends(true);
  if (clock_) {
    rt->graph->set_clock(clock_.get());
    rt->graph->set_op_time_model(time_model_);
    rt->graph->set_memory_cap(static_cast<size_t>(topology_->rank(world_.rank()).memory_cap_gib * 1024.0 *
                                                  1024.0 * 1024.0));
  }
  return rt;
}

SwitchOptions DistTrainer::switch_options(size_t index) const {
  const TrainOptions::Switch& sw = o_.switches.at(index - 1);
  SwitchOptions so;
  so.algorithm = algorithm_;
  so.bucket_bytes = static_cast<int64_t>(o_.switch_bucket_mb * 1024 * 1024);
  so.lost_ranks = std::set<int>(sw.lost_ranks.begin(), sw.lost_ranks.end());
  so.have_checkpoint = !o_.checkpoint_dir.empty() && o_.save_every > 0 && sw.step % o_.save_every == 0;
  return so;
}

// Every communicator group the plan's Reshards and ops use on this rank,
// created now in sorted member-list order: creation is collective over the
// members, and one global order on every rank cannot deadlock (the smallest
// group still waited for has all its members at it).
void DistTrainer::create_groups(const std::vector<PlannedReshard>& reshards,
                                const std::vector<PlannedOpTraffic>& traffic) const {
  std::set<std::vector<int>> groups;
  for (const PlannedReshard& r : reshards) {
    auto it = r.resolution().ranks.find(world_.rank());
    if (it == r.resolution().ranks.end()) continue;
    for (const CommPhase& phase : it->second.phases)
      for (const CommOp& op : phase.ops)
        if (is_collective(op.kind) && op.group.size() > 1) groups.insert(op.group);
  }
  for (const PlannedOpTraffic& t : traffic) {
    auto it = t.ranks.find(world_.rank());
    if (it != t.ranks.end() && it->second.group.size() > 1) groups.insert(it->second.group);
  }
  for (const std::vector<int>& g : groups) world_.group(g);
}

size_t DistTrainer::plan_at(int64_t step) const {
  size_t k = 0;
  for (size_t i = 0; i < o_.switches.size(); ++i)
    if (o_.switches[i].step <= step) k = i + 1;
  return k;
}

// The conceptual micro-batch step stacks every pipeline's micro-batch (part
// k = pipeline k's samples); the rank reads only its own pipeline's samples
// into it and keeps its local box. Rows are as wide as the pipeline's
// widest sample, rounded up to the granularity (packed documents), so
// pipelines see different lengths; they never exchange activations.
ValueMap DistTrainer::feeds(int micro, float normalizer, Bindings& bindings) const {
  const Strategy& strategy = rt_->strategy;
  int64_t rows = 0, row = 0, width = 0;
  std::function<void(int32_t*, int32_t*, int32_t*)> fill;  // this pipeline's rows, from row `row` on
  if (pieces_) {  // token-budget steps: one row per pipeline, its packed pieces
    const std::vector<int64_t>& mine = token_step_->micro.at(rt_->pipeline).at(micro);
    int64_t n = 0;
    for (int64_t p : mine) n += pieces_->piece_size(p);
    width = (std::max<int64_t>(n, 1) + rt_->granularity - 1) / rt_->granularity * rt_->granularity;
    rows = static_cast<int64_t>(strategy.pipelines.size());
    row = rt_->pipeline;
    fill = [&](int32_t* ids, int32_t* targets, int32_t* positions) {
      pieces_->pack(mine, width, ids, targets, positions);
    };
  } else {
    int64_t mine = 0, first = state_->samples;
    for (int k = 0; k < static_cast<int>(strategy.pipelines.size()); ++k) {
      const Pipeline& p = strategy.pipelines[k];
      if (k == rt_->pipeline) row = rows, mine = first + micro * p.micro_batch_size;
      rows += p.micro_batch_size;
      first += p.batch();
    }
    const int count = strategy.pipelines.at(rt_->pipeline).micro_batch_size;
    width = source_->width(mine, count, rt_->granularity);
    fill = [&, mine, count](int32_t* ids, int32_t* targets, int32_t* positions) {
      for (int b = 0; b < count; ++b)
        source_->fill(mine + b, width, ids + b * width, targets + b * width, positions + b * width);
    };
  }
  NDArray ids = NDArray::zeros({rows, width}, DType::I32);
  NDArray targets = NDArray::zeros({rows, width}, DType::I32);
  NDArray positions = NDArray::zeros({rows, width}, DType::I32);
  const int64_t at = row * width;
  fill(ids.data<int32_t>() + at, targets.data<int32_t>() + at, positions.data<int32_t>() + at);
  NDArray norm = NDArray::empty({}, DType::F32);
  norm.fill(normalizer);
  bindings = Bindings{{"B", rows}, {"S", width}};
  ValueMap v;
  for (const std::string& name : rt_->graph->model().names) {
    const Shard& sh = state_->slot(name, StateSlot::kParam);
    if (sh.held()) v[name] = sh.data;
  }
  for (auto& [name, full] : ValueMap{{"input_ids", ids}, {"targets", targets},
                                     {"positions", positions}, {"normalizer", norm}})
    if (auto box = rt_->graph->local_box(name, full.shape())) v[name] = box_slice(full, *box);
  return v;
}

double DistTrainer::global_grad_norm(std::map<std::string, NDArray>& synced) const {
  double sumsq = 0;
  for (const auto& [name, g] : synced) {
    if (!is_representative(rt_->graph->annotation("grad." + name), world_.rank())) continue;
    const float* x = g.data<float>();
    for (int64_t i = 0; i < g.numel(); ++i) sumsq += static_cast<double>(x[i]) * x[i];
  }
  const double norm = std::sqrt(all_reduce_scalar(sumsq, world_));
  if (o_.clip_grad > 0 && norm > o_.clip_grad) {
    const float scale = static_cast<float>(o_.clip_grad / (norm + 1e-6));
    for (auto& [name, g] : synced)
      for (int64_t i = 0; i < g.numel(); ++i) g.data<float>()[i] *= scale;
  }
  return norm;
}

// AdamW on the rank's optimized shards, with the state's moments (imported
// into the optimizer for the update only); ZeRO then gathers the parameter.
void DistTrainer::optimizer_step(Adam& adam, std::map<std::string, NDArray>& synced, double lr) {
  adam.set_step_count(state_->step);
  adam.begin_step();
  state_->step = adam.step_count();
  const AnnotationPlan& plan = *rt_->plan;
  // Model clock: the profile's optimizer fit, its fixed part once per step.
  const OptimizerFit* modeled = clock_ && clock_->modeled() ? &profile_->optimizer : nullptr;
  double fixed_s = modeled ? modeled->fixed_s : 0.0;
  for (const std::string& name : rt_->graph->model().names) {  // the same order on every rank
    const bool decay = rt_->shapes.at(name).size() >= 2;
    Shard& target = state_->optimized(name);
    auto g = synced.find(name);
    if (g != synced.end() && target.held()) {
      if (clock_) clock_->begin_compute();
      adam.import_moments(name, state_->slot(name, StateSlot::kExpAvg).data,
                          state_->slot(name, StateSlot::kExpAvgSq).data);
      adam.update(name, target.data, g->second, lr, decay);
      adam.export_moments(name);
      if (clock_) clock_->end_compute();
      if (modeled) {
        clock_->advance(std::exchange(fixed_s, 0.0) +
                        modeled->per_param_s * static_cast<double>(target.data.numel()));
      }
    }
    auto st = plan.optimizer_states.find(name);
    if (st == plan.optimizer_states.end()) continue;
    Shard& param = state_->slot(name, StateSlot::kParam);
    NDArray gathered = rt_->graph->reshard("zero_gather." + name, rt_->shapes.at(name), st->second,
                                           rt_->graph->annotation(name), target.data, world_);
    if (gathered.valid()) param.data = gathered;
  }
}

// Per parameter, its local array under `layout(name)` gathered to rank 0
// (padding rows dropped) and written there at once: rank 0 holds one full
// tensor at a time.
void DistTrainer::gather_and_write(const std::string& path, const std::string& prefix,
                                   const std::function<std::pair<Annotation, NDArray>(const std::string&)>& local,
                                   DType dtype) const {
  Annotation rank0;
  rank0.subgroups = {Subgroup{DeviceGroup{{0}}, DistStates{}}};
  std::unique_ptr<SafetensorsWriter> writer;
  if (world_.rank() == 0) {
    std::map<std::string, SafetensorsWriter::Declared> declared;
    for (const auto& [name, shape] : llama_parameter_shapes(config_)) declared[name] = {dtype, shape};
    writer = std::make_unique<SafetensorsWriter>(path, declared);
  }
  for (const LlamaParameter& p : llama_parameters(rt_->plan->model)) {
    const std::string& name = p.name;
    auto [layout, array] = local(name);
    NDArray full = rt_->graph->reshard(prefix + name, p.shape, layout, rank0, array, world_);
    if (!writer) continue;
    if (p.role == ParamRole::kVocabulary && full.dim(0) != config_.vocab_size)
      full = full.slice(0, 0, config_.vocab_size).contiguous();  // drop the padding rows
    writer->write(name, full.to(dtype));
  }
  if (writer) writer->finish();
}

std::string DistTrainer::nonfinite_parameter() {
  const std::vector<std::string>& names = rt_->graph->model().names;
  int64_t mine = static_cast<int64_t>(names.size());
  for (size_t k = 0; k < names.size() && mine == static_cast<int64_t>(names.size()); ++k) {
    const Shard& s = state_->slot(names[k], StateSlot::kParam);
    if (s.held() && train_common::first_nonfinite(s.data) >= 0) mine = static_cast<int64_t>(k);
  }
  const std::vector<int64_t> all = gather_counts({mine}, world_)[0];
  const int64_t first = *std::min_element(all.begin(), all.end());
  return first < static_cast<int64_t>(names.size()) ? names[first] : "";
}

bool DistTrainer::skip_nonfinite(StepRecord& r, int64_t& skipped) const {
  if (std::isfinite(r.loss) && std::isfinite(r.grad_norm)) return false;
  const auto num = [](double v) { return std::isnan(v) ? std::string("nan") : detail::concat(v); };  // not "-nan"
  if (skipped >= o_.skip_nonfinite_steps)
    fail("[train] step ", r.step, ": loss ", num(r.loss), ", gradient norm ", num(r.grad_norm),
         ": not finite; stopped before updating the weights",
         o_.skip_nonfinite_steps > 0 ? " (--skip-nonfinite-steps " + std::to_string(o_.skip_nonfinite_steps) +
                                           " already skipped)"
                                     : std::string(" (--skip-nonfinite-steps N skips such steps)"));
  ++skipped;
  r.skipped = true;
  if (world_.rank() == 0)
    std::fprintf(stderr, "hspmd: warning: step %lld: loss %s, gradient norm %s: not finite; step skipped (%lld of "
                 "--skip-nonfinite-steps %lld)\n", static_cast<long long>(r.step), num(r.loss).c_str(),
                 num(r.grad_norm).c_str(),
                 static_cast<long long>(skipped), static_cast<long long>(o_.skip_nonfinite_steps));
  return true;
}

void DistTrainer::write_log(std::ofstream& log, const nlohmann::json& j) const {
  if (!log.is_open()) return;
  log << j.dump() << "\n" << std::flush;
  if (!log) fail("[train] --log ", o_.log_path, ": write failed (disk full or I/O error)");
}

void DistTrainer::save() {
  if (const std::string bad = nonfinite_parameter(); !bad.empty())
    fail("[train] --save ", o_.save_path, ": parameter '", bad, "' holds non-finite values after step ",
         state_->step - 1, "; not written (an existing file is kept)");
  gather_and_write(o_.save_path, "save.", [&](const std::string& name) {
    return std::pair{rt_->graph->annotation(name), state_->slot(name, StateSlot::kParam).data};
  }, o_.save_dtype);
}

void DistTrainer::prepare() {
  data_ = std::make_unique<TokenData>(TokenData::load(o_.data_path, config_.vocab_size));
  if (o_.batch_tokens > 0) {
    pieces_ = std::make_unique<PackedDocuments>(*data_, o_.seq_len, config_.eos_token_id);
    dispatch_model_.emplace(CostModel::load(config_, *topology_, o_.profile_path));
    if (!choices_.empty()) {
      std::vector<const Strategy*> all;
      for (const auto& c : choices_) all.push_back(&*c->strategy);
      check_pieces(all, "any of --strategies");
    } else {
      for (const auto& p : plans_) check_pieces({&*p->strategy}, "the strategy");
    }
  } else {
    source_ = std::make_unique<train_common::SampleSource>(*data_, o_.seq_len, o_.pack_documents,
                                                           config_.eos_token_id);
  }
  int64_t start = 0;
  std::unique_ptr<CheckpointReader> reader;
  if (!o_.resume_dir.empty()) {
    reader = std::make_unique<CheckpointReader>(o_.resume_dir);
    start = reader->index().step;
    if (start >= o_.steps)
      fail("[checkpoint] ", o_.resume_dir, ": it is at step ", start, ", not before --steps ", o_.steps);
  }
  plan_index_ = plan_at(start);
  std::shared_ptr<const AnnotationPlan> first = plans_[plan_index_];
  if (reader && !events_.empty()) {
    // Elastic: the plan in force when the checkpoint was written (re-planned,
    // perhaps), and the cluster as the events before the step left it.
    const nlohmann::json& meta = reader->index().meta;
    if (meta.contains("strategy")) first = compile(strategy_from_json(meta.at("strategy")));
    failed_ = failed_after(events_, start - 1);
    events_done_ = start - 1;
    for (const ElasticEvent& e : events_) {
      if (e.step >= start) break;
      for (const auto& [r, factor] : e.slowdown) {
        if (r == world_.rank() && clock_) clock_->set_slowdown(factor);
        assumed_ = std::make_shared<const Topology>(assumed_->with_slowdown(r, factor));
      }
    }
  }
  const auto t0 = Clock::now();
  rt_ = specialize(first);
  last_specialize_s_ = std::chrono::duration<double>(Clock::now() - t0).count();
  // --strategies: every choice specialized now (the same order on every
  // rank: creating communicator groups is collective); a per-step switch
  // then only moves the state.
  choice_rt_.resize(choices_.size());
  for (size_t i = 1; i < choices_.size(); ++i) choice_rt_[i] = specialize(choices_[i]);
  choice_switch_s_.assign(choices_.size(), std::vector<double>(choices_.size(), 0.0));
  for (size_t i = 0; i < choices_.size(); ++i)
    for (size_t j = 0; j < choices_.size(); ++j) {
      if (i == j) continue;
      SwitchOptions so;
      so.algorithm = algorithm_;
      so.bucket_bytes = static_cast<int64_t>(o_.switch_bucket_mb * 1024 * 1024);
      choice_switch_s_[i][j] = switch_plans_.get(*choices_[i], *choices_[j], *topology_, so).predicted_s;
    }
  // Every switch is planned now, so that one that cannot be done (a lost
  // rank's slices with no checkpoint) fails before the first step.
  for (size_t k = plan_index_ + 1; k < plans_.size(); ++k)
    switch_plans_.get(*plans_[k - 1], *plans_[k], *topology_, switch_options(k));
  if (reader) {
    state_ = TrainingState::load(rt_->plan, world_.rank(), *reader);
    const nlohmann::json& meta = reader->index().meta;
    state_->step = start;
    state_->samples = meta.at("samples").get<int64_t>();
    state_->seed = meta.at("seed").get<uint64_t>();
    return;
  }
  std::map<std::string, NDArray> full =
      o_.init_path.empty()
          ? init_llama_parameters(config_, o_.seed)
          : validate_llama_weights(config_, load_safetensors(o_.init_path), o_.init_path);
  if (!o_.init_path.empty()) train_common::check_finite_weights(full, o_.init_path);
  state_ = TrainingState::from_full(rt_->plan, world_.rank(), full);
  state_->seed = o_.seed;
}

nlohmann::json DistTrainer::move_to(std::shared_ptr<const AnnotationPlan> plan, const SwitchOptions& so) {
  finish_checkpoint(true);  // the switch may read the checkpoint of this step
  const auto t0 = Clock::now();
  std::unique_ptr<Runtime> next = specialize(std::move(plan));
  const double specialize_s = std::chrono::duration<double>(Clock::now() - t0).count();
  last_specialize_s_ = specialize_s;
  return move_runtime(std::move(next), so, specialize_s, nullptr);
}

nlohmann::json DistTrainer::move_runtime(std::unique_ptr<Runtime> next, const SwitchOptions& so, double specialize_s,
                                         std::unique_ptr<Runtime>* keep_old) {
  finish_checkpoint(true);
  if (next_.valid()) next_.wait();  // the next step's preparation reads the plan's piece costs
  std::unique_ptr<CheckpointReader> reader;
  if (so.have_checkpoint) reader = std::make_unique<CheckpointReader>(o_.checkpoint_dir);
  const SwitchPlan& sp = switch_plans_.get(*rt_->plan, *next->plan, *topology_, so);
  if (keep_old) *keep_old = std::move(rt_);
  rt_.reset();  // the old graph goes before the state moves: less memory at the peak
  SwitchReport rep;
  state_ = std::move(*state_).reshard_to(next->plan, sp, *topology_, world_, reader.get(), clock_.get(), &rep);
  rt_ = std::move(next);
  piece_costs_.erase(-1);  // the current plan's
  const auto all = gather_counts({rep.bytes_sent, rep.predicted_bytes, rep.checkpoint_bytes, rep.peak_extra_bytes,
                                  rep.bound_bytes}, world_);
  if (clock_) emulated_end_ = static_cast<int64_t>(clock_->now() * 1e9);
  skip_next_ = true;
  window_.clear();
  window_steps_.clear();
  predicted_.clear();
  nlohmann::json j = {{"algorithm", algorithm_name(algorithm_)},
                      {"specialize_s", specialize_s}, {"switch_s", rep.switch_s},
                      {"bytes_sent", all[0]},     {"predicted_bytes", all[1]},
                      {"checkpoint_bytes", all[2]}, {"peak_extra_bytes", all[3]},
                      {"extra_bytes_bound", all[4]}, {"rounds", sp.rounds.size()},
                      {"predicted_switch_s", sp.predicted_s}};
  if (clock_) j["emulated_switch_s"] = rep.emulated_s;
  return j;
}

// Moves the run to plans_[index] at `step` (--switch).
void DistTrainer::switch_to(size_t index, int64_t step, std::ofstream& log) {
  nlohmann::json j = {{"event", "switch"}, {"step", step}};
  j.update(move_to(plans_[index], switch_options(index)));
  plan_index_ = index;
  write_log(log, j);
}

void DistTrainer::load_elastic_events() {
  if (!o_.switches.empty())
    fail("[flags] give --events or --switch, not both (an event may name its \"strategy\")");
  if (o_.straggler_window < 0) fail("[flags] --straggler-window must be >= 0, got ", o_.straggler_window);
  if (!(o_.straggler_threshold > 0)) fail("[flags] --straggler-threshold must be > 0, got ", o_.straggler_threshold);
  if (o_.straggler_horizon < 1) fail("[flags] --straggler-horizon must be >= 1, got ", o_.straggler_horizon);
  if (!(o_.replan_time_limit_s > 0)) fail("[flags] --replan-time-limit must be > 0, got ", o_.replan_time_limit_s);
  events_ = load_events(o_.events_path, world_.size(), o_.steps);
  const std::vector<int> first = plans_[0]->strategy->ranks();
  for (const ElasticEvent& e : events_) {
    if (e.strategy_path.empty()) continue;
    auto plan = load_plan_file(e.strategy_path);
    const std::set<int> down = failed_after(events_, e.step);
    for (int r : plan->strategy->ranks())
      if (down.count(r))
        fail("[events] ", o_.events_path, ": step ", e.step, ": strategy ", e.strategy_path, " uses rank ", r,
             ", which has failed by then");
    if (plan->strategy->global_batch() != plans_[0]->strategy->global_batch())
      fail("[events] ", o_.events_path, ": step ", e.step, ": strategy ", e.strategy_path, " has global batch ",
           plan->strategy->global_batch(), ", the run ", plans_[0]->strategy->global_batch());
    event_plans_[e.step] = plan;
  }
  assumed_ = topology_;
}

bool DistTrainer::checkpoint_at(int64_t step) {
  finish_checkpoint(true);
  if (o_.checkpoint_dir.empty()) return false;
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::path(o_.checkpoint_dir) / "index.json", ec)) return false;
  return CheckpointReader(o_.checkpoint_dir).index().step == step;
}

Strategy DistTrainer::replan(const Topology& topology, int64_t step, const std::string& cause, double& planning_s) {
  const auto t0 = Clock::now();
  std::string text;
  if (world_.rank() == 0) {
    try {
      const CostModel model = CostModel::load(config_, topology, o_.profile_path);
      SearchOptions so;
      so.global_batch = static_cast<int>(rt_->strategy.global_batch());
      so.seq_len = o_.seq_len;
      so.zero = rt_->strategy.zero;
      so.schedule = rt_->strategy.schedule;
      so.unavailable = failed_;
      so.top_k = 1;
      // Redundancy the run had stays: with two pipelines (no ZeRO) every
      // slice lives on two disjoint rank sets, so the next failure is served
      // by the survivors instead of the checkpoint. One pipeline only when
      // no plan of two fits.
      const int wanted = !rt_->strategy.zero && rt_->strategy.pipelines.size() >= 2 ? 2 : 1;
      // Two searches: pruned by the current plan (the planner's re-plan
      // mode: its TP per device class and micro-batch size; fast), then from
      // scratch within the time left (it finds what the pruning excludes,
      // e.g. another micro-batch size); the faster prediction wins.
      std::optional<SearchCandidate> best_found;
      std::string error;
      for (int min = wanted; min >= 1 && !best_found; --min) {
        so.min_pipelines = min;
        const Strategy* current = &rt_->strategy;
        for (const Strategy* previous : {current, static_cast<const Strategy*>(nullptr)}) {
          so.previous = previous;
          so.time_limit_s = std::max(0.05, o_.replan_time_limit_s -
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
      text = to_json(best).dump();
    } catch (const Error& e) {
      text = std::string("!") + e.what();
    }
  }
  broadcast_text(text, world_);
  planning_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!text.empty() && text[0] == '!')
    fail("[elastic] step ", step, " (", cause, "): re-planning failed: ", text.substr(1));
  return strategy_from_json(nlohmann::json::parse(text));
}

int64_t DistTrainer::reconfigure(std::shared_ptr<const AnnotationPlan> plan, int64_t step, const std::string& cause,
                                 double planning_s, std::ofstream& log) {
  SwitchOptions so;
  so.algorithm = algorithm_;
  so.bucket_bytes = static_cast<int64_t>(o_.switch_bucket_mb * 1024 * 1024);
  so.lost_ranks = failed_;
  so.have_checkpoint = checkpoint_at(step);
  if (!so.have_checkpoint && !o_.checkpoint_dir.empty() &&
      std::filesystem::exists(std::filesystem::path(o_.checkpoint_dir) / "index.json")) {
    bool servable = true;  // the same answer on every rank: the switch plan is a pure function
    try {
      switch_plans_.get(*rt_->plan, *plan, *topology_, so);
    } catch (const Error&) {
      servable = false;
    }
    if (!servable) return rollback(std::move(plan), step, cause, planning_s, log);
  }
  nlohmann::json moved;
  try {
    moved = move_to(std::move(plan), so);
  } catch (const Error& e) {
    fail("[elastic] step ", step, " (", cause, "): ", e.what(),
         so.have_checkpoint ? "" : " (no training checkpoint was committed before this step: --checkpoint DIR "
                                   "--save-every N writes them; the run then rolls back to the last one)");
  }
  nlohmann::json j = {{"event", "reconfigure"}, {"step", step}, {"cause", cause}, {"planning_s", planning_s}};
  j.update(moved);
  j["from_checkpoint_bytes"] = j["checkpoint_bytes"];
  j["failed"] = std::vector<int>(failed_.begin(), failed_.end());
  j["strategy"] = to_json(rt_->strategy);
  write_log(log, j);
  return step;
}

int64_t DistTrainer::rollback(std::shared_ptr<const AnnotationPlan> plan, int64_t step, const std::string& cause,
                              double planning_s, std::ofstream& log) {
  CheckpointReader reader(o_.checkpoint_dir);
  const int64_t back = reader.index().step;
  rt_.reset();
  state_.reset();  // every slice comes from the checkpoint
  const auto t0 = Clock::now();
  rt_ = specialize(std::move(plan));
  const double specialize_s = std::chrono::duration<double>(Clock::now() - t0).count();
  last_specialize_s_ = specialize_s;
  const auto t1 = Clock::now();
  state_ = TrainingState::load(rt_->plan, world_.rank(), reader);
  const nlohmann::json& meta = reader.index().meta;
  state_->step = back;
  state_->samples = meta.at("samples").get<int64_t>();
  state_->seed = meta.at("seed").get<uint64_t>();
  const double load_s = std::chrono::duration<double>(Clock::now() - t1).count();
  const std::vector<int64_t> read = gather_counts({state_->bytes()}, world_)[0];
  if (clock_) emulated_end_ = static_cast<int64_t>(clock_->now() * 1e9);
  skip_next_ = true;
  window_.clear();
  window_steps_.clear();
  predicted_.clear();
  // The log keeps one record per step: those of the steps trained again go.
  if (log.is_open()) {
    log.close();
    std::vector<std::string> kept;
    {
      std::ifstream in(o_.log_path);
      for (std::string line; std::getline(in, line);) {
        const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
        if (!j.is_discarded() && j.contains("loss") && j.value("step", int64_t{0}) >= back) continue;
        kept.push_back(line);
      }
    }
    const std::string tmp = o_.log_path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      for (const std::string& line : kept) out << line << "\n";
      out.close();
      if (!out) fail("[train] --log ", o_.log_path, ": write failed (disk full or I/O error)");
    }
    std::filesystem::rename(tmp, o_.log_path);
    log.open(o_.log_path, std::ios::app);
    if (!log) fail("[train] --log ", o_.log_path, ": cannot reopen for writing: ", std::strerror(errno));
  }
  nlohmann::json j = {{"event", "reconfigure"}, {"step", step}, {"cause", cause}, {"planning_s", planning_s},
                      {"specialize_s", specialize_s}, {"switch_s", load_s},
                      {"bytes_sent", std::vector<int64_t>(world_.size(), 0)},
                      {"from_checkpoint_bytes", read}, {"rollback_to", back},
                      {"failed", std::vector<int>(failed_.begin(), failed_.end())},
                      {"strategy", to_json(rt_->strategy)}};
  write_log(log, j);
  return back;
}

int64_t DistTrainer::apply_event(const ElasticEvent& ev, int64_t step, std::ofstream& log) {
  for (const auto& [r, factor] : ev.slowdown) {
    if (r == world_.rank() && clock_) clock_->set_slowdown(factor);
  }
  for (int r : ev.fail) failed_.insert(r);
  for (int r : ev.join) failed_.erase(r);
  const std::string cause = ev.cause();
  if (!ev.strategy_path.empty()) {
    return reconfigure(event_plans_.at(step), step, cause, 0.0, log);
  }
  if (!ev.slowdown.empty()) {  // steps before the change say nothing about the speeds now
    window_.clear();
    window_steps_.clear();
  }
  if (!ev.changes_ranks()) {  // a speed change alone: the straggler watch decides
    nlohmann::json speeds = nlohmann::json::object();
    for (const auto& [r, factor] : ev.slowdown) speeds[std::to_string(r)] = factor;
    write_log(log, {{"event", "slowdown"}, {"step", step}, {"slowdown", speeds}});
    return step;
  }
  double planning_s = 0;
  const Strategy next = replan(*assumed_, step, cause, planning_s);
  return reconfigure(compile(next), step, cause, planning_s, log);
}

std::vector<double> DistTrainer::predicted_compute(const Topology& topology) const {
  std::vector<double> out(world_.size(), 0.0);
  try {
    const CostModel model = CostModel::load(config_, topology, o_.profile_path);
    for (const RankCost& rc : model.evaluate(rt_->strategy, o_.seq_len).ranks)
      if (rc.rank >= 0 && rc.rank < world_.size()) out[rc.rank] = rc.compute_s;
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
void DistTrainer::watch_stragglers(int64_t step, const StepRecord& r, std::ofstream& log) {
  if (events_.empty() || !clock_ || o_.straggler_window == 0 || step + 1 >= o_.steps) return;
  if (std::exchange(skip_next_, false)) return;
  if (predicted_.empty()) predicted_ = predicted_compute(*assumed_);
  if (predicted_.empty()) return;
  window_.push_back(r.emulated_compute_s);
  window_steps_.push_back(r.emulated_step_time_s);
  if (static_cast<int64_t>(window_.size()) < o_.straggler_window) return;
  std::vector<int> active;
  std::vector<double> ratio(world_.size(), 0.0);
  for (int k = 0; k < world_.size(); ++k) {
    if (predicted_[k] <= 0 || failed_.count(k)) continue;
    std::vector<double> seen;
    for (const auto& w : window_) seen.push_back(w.at(k));
    ratio[k] = median(seen) / predicted_[k];
    active.push_back(k);
  }
  std::vector<double> ratios;
  for (int k : active) ratios.push_back(ratio[k]);
  const double mid = median(ratios);
  const double observed_step = median(window_steps_);
  window_.clear();
  window_steps_.clear();
  if (active.empty() || !(mid > 0)) return;
  Topology estimated = *assumed_;
  bool off = false;
  for (int k : active) {
    const double rel = ratio[k] / mid;
    if (std::abs(rel - 1) <= o_.straggler_threshold) continue;
    off = true;
    estimated = estimated.with_slowdown(k, assumed_->rank(k).slowdown * rel);
  }
  if (!off) return;
  const int64_t next_step = step + 1;
  assumed_ = std::make_shared<const Topology>(std::move(estimated));
  const std::vector<double> current = predicted_compute(*assumed_);
  double planning_s = 0;
  std::string cause = "straggler:";
  for (int k : active)
    if (std::abs(ratio[k] / mid - 1) > o_.straggler_threshold)
      cause += " rank " + std::to_string(k) + " x" + detail::concat(assumed_->rank(k).slowdown);
  const Strategy next = replan(*assumed_, next_step, cause, planning_s);
  predicted_ = current;
  const CostModel model = CostModel::load(config_, *assumed_, o_.profile_path);
  const double now_s = model.evaluate(rt_->strategy, o_.seq_len).predicted_step_s;
  const double next_s = model.evaluate(next, o_.seq_len).predicted_step_s;
  const int64_t horizon = std::min(o_.straggler_horizon, o_.steps - next_step);
  // The model's prediction scaled to what the run observes.
  const double gain_s = now_s > 0 ? observed_step * (1 - next_s / now_s) * static_cast<double>(horizon) : 0.0;
  std::shared_ptr<const AnnotationPlan> plan;
  double switch_s = 0;
  const bool differs = !same_execution(next, rt_->strategy);
  if (differs) {
    plan = compile(next);
    SwitchOptions so;
    so.algorithm = algorithm_;
    so.bucket_bytes = static_cast<int64_t>(o_.switch_bucket_mb * 1024 * 1024);
    so.lost_ranks = failed_;
    switch_s = switch_plans_.get(*rt_->plan, *plan, *topology_, so).predicted_s;
  }
  const double cost_s = planning_s + last_specialize_s_ + switch_s;
  // The wall-clock parts of the cost differ between ranks: rank 0 decides.
  int64_t decision = differs && gain_s > cost_s ? 1 : 0;
  world_.broadcast(&decision, 1, 0);
  const bool go = decision != 0;
  nlohmann::json speeds = nlohmann::json::object();
  for (int k : active) speeds[std::to_string(k)] = assumed_->rank(k).slowdown;
  write_log(log, {{"event", "straggler"}, {"step", next_step}, {"estimated_slowdown", speeds},
                  {"predicted_step_s", now_s}, {"replanned_step_s", next_s}, {"observed_step_s", observed_step},
                  {"horizon_steps", horizon}, {"gain_s", gain_s}, {"cost_s", cost_s}, {"switch", go}});
  // A straggler re-plan keeps every rank's memory: never a rollback.
  if (go) reconfigure(plan, next_step, cause, planning_s, log);
}

// Every rank writes its shards, then rank 0 commits the index (the
// checkpoint's atomic point) once all have.
void DistTrainer::save_checkpoint() {
  finish_checkpoint(true);  // one write at a time
  if (const std::string bad = nonfinite_parameter(); !bad.empty())
    fail("[train] --checkpoint ", o_.checkpoint_dir, ": parameter '", bad, "' holds non-finite values after step ",
         state_->step - 1, "; checkpoint not written (the last one is kept)");
  std::vector<CheckpointShard> shards;
  for (TrainingState::NamedShard& s : state_->checkpoint_shards())  // copies: the next steps update the state
    shards.push_back(CheckpointShard{s.tensor, s.shape, s.shard.box, s.shard.data.clone()});
  auto p = std::make_unique<PendingCheckpoint>();
  p->step = state_->step;
  p->meta = {{"samples", state_->samples}, {"seed", state_->seed}, {"world_size", world_.size()},
             {"strategy", to_json(rt_->strategy)}};
  PendingCheckpoint* raw = p.get();
  const int rank = world_.rank();
  p->writer = std::thread([raw, rank, dir = o_.checkpoint_dir, shards = std::move(shards)] {
    try {
      write_checkpoint_shards(dir, raw->step, rank, shards);
    } catch (const std::exception& e) {
      raw->error = e.what();
    }
    raw->done = true;
  });
  pending_ = std::move(p);
  if (o_.checkpoint_sync) finish_checkpoint(true);
}

void DistTrainer::finish_checkpoint(bool wait) {
  if (!pending_) return;  // the same on every rank: saves are collective
  int64_t busy = !wait && !pending_->done ? 1 : 0;
  world_.all_reduce(&busy, 1, ReduceOp::kMax);
  if (busy) return;
  pending_->writer.join();
  int64_t failed = pending_->error.empty() ? 0 : 1;
  world_.all_reduce(&failed, 1, ReduceOp::kMax);
  if (failed) {
    const std::string error = pending_->error;
    pending_.reset();
    fail(error.empty() ? std::string("[checkpoint] ") + o_.checkpoint_dir + ": another rank failed to write its shards"
                       : error);
  }
  if (world_.rank() == 0) commit_checkpoint(o_.checkpoint_dir, pending_->step, world_.size(), pending_->meta);
  world_.barrier();  // committed before any rank reads index.json
  pending_.reset();
}

void DistTrainer::check_pieces(const std::vector<const Strategy*>& strategies, const std::string& what) const {
  int64_t longest = 0;
  for (int64_t i = 0; i < pieces_->num_pieces(); ++i) longest = std::max(longest, pieces_->piece_size(i));
  if (o_.batch_tokens < longest)
    fail("[flags] --batch-tokens ", o_.batch_tokens, " is smaller than the longest piece of ", o_.data_path, " (",
         longest, " tokens; pieces are at most --max-seq-len ", o_.seq_len, ")");
  int64_t most = 0;
  for (const Strategy* s : strategies)
    for (size_t k = 0; k < s->pipelines.size(); ++k) {
      const Pipeline& p = s->pipelines[k];
      const int64_t takes = accepted_piece(*s, p, o_.seq_len), holds = micro_batch_capacity(*s, p, o_.seq_len);
      if (holds < takes)
        fail("[strategy] pipeline ", k, ": micro_batch_tokens=", holds, " cannot hold a piece of ", takes,
             " tokens, the longest it accepts");
      most = std::max(most, takes);
    }
  if (most < longest)
    fail("[data] ", o_.data_path, ": a piece of ", longest, " tokens, but no pipeline of ", what,
         " accepts more than ", most, " (its max_seq_len)");
}

const PieceCosts& DistTrainer::piece_costs(const Strategy& s, int key) const {
  std::unique_ptr<PieceCosts>& c = piece_costs_[key];
  if (!c) c = std::make_unique<PieceCosts>(*dispatch_model_, s);
  return *c;
}

std::vector<int64_t> DistTrainer::step_pieces(int64_t cursor) const {
  const int64_t n = pieces_->num_pieces();
  std::vector<int64_t> chosen;
  int64_t tokens = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t piece = (cursor + k) % n;
    const int64_t size = pieces_->piece_size(piece);
    if (!chosen.empty() && tokens + size > o_.batch_tokens) break;
    chosen.push_back(piece);
    tokens += size;
  }
  return chosen;
}

DistTrainer::TokenStep DistTrainer::plan_token_step(int64_t cursor, const Strategy& s, int key) const {
  return plan_pieces(step_pieces(cursor), s, key);
}

DistTrainer::TokenStep DistTrainer::plan_pieces(const std::vector<int64_t>& chosen, const Strategy& s, int key) const {
  std::vector<int64_t> lengths;
  for (int64_t piece : chosen) lengths.push_back(pieces_->piece_size(piece));
  const TokenDispatch d = dispatch_token_step(piece_costs(s, key), s, lengths, o_.seq_len);
  TokenStep t;
  t.pieces = static_cast<int64_t>(chosen.size());
  for (int64_t n : lengths) t.tokens += n;
  t.counted = t.tokens - t.pieces;
  t.pipeline_tokens = d.pipeline_tokens;
  t.predicted_s = d.predicted_s;
  t.micro.resize(d.micro.size());
  for (size_t p = 0; p < d.micro.size(); ++p)
    for (const std::vector<size_t>& mb : d.micro[p]) {
      t.micro[p].emplace_back();
      for (size_t i : mb) t.micro[p].back().push_back(chosen[i]);
    }
  return t;
}

DistTrainer::Prepared DistTrainer::prepare_token_step(int64_t cursor, int current,
                                                     const AnnotationPlan* plan) const {
  Prepared pr;
  pr.cursor = cursor;
  pr.plan = plan;
  pr.current = current;
  if (choices_.empty()) {
    pr.by_choice.push_back(plan_token_step(cursor, *plan->strategy, -1));
    return pr;
  }
  int64_t longest = 0;
  for (int64_t piece : step_pieces(cursor)) longest = std::max(longest, pieces_->piece_size(piece));
  pr.by_choice.resize(choices_.size());
  pr.pick = -1;
  double best = 0;
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Strategy& s = *choices_[i]->strategy;
    int64_t most = 0;
    for (const Pipeline& p : s.pipelines) most = std::max(most, accepted_piece(s, p, o_.seq_len));
    if (most < longest) continue;
    pr.by_choice[i] = plan_token_step(cursor, s, static_cast<int>(i));
    const double cost = pr.by_choice[i]->predicted_s + choice_switch_s_[current][i];  // graphs specialized already
    if (pr.pick < 0 || cost < best) pr.pick = static_cast<int>(i), best = cost;
  }
  HSPMD_CHECK(pr.pick >= 0, "no strategy accepts the step's longest piece (checked before the first step)");
  return pr;
}

void DistTrainer::switch_choice(int pick, int64_t step, const std::string& cause, std::ofstream& log) {
  SwitchOptions so;
  so.algorithm = algorithm_;
  so.bucket_bytes = static_cast<int64_t>(o_.switch_bucket_mb * 1024 * 1024);
  nlohmann::json j = {{"event", "switch"}, {"step", step}, {"strategy", pick}, {"cause", cause}};
  const int old = choice_;
  j.update(move_runtime(std::move(choice_rt_[pick]), so, 0.0, &choice_rt_[old]));
  choice_ = pick;
  write_log(log, j);
}

double DistTrainer::run_buckets(int64_t step, float normalizer, std::ofstream& log,
                                std::map<std::string, NDArray>& synced, size_t held, size_t& activations,
                                TokenStep& whole) {
  const std::vector<int64_t> chosen = step_pieces(state_->samples);
  std::vector<int64_t> longest(choices_.size(), 0);  // per choice, the longest piece it accepts
  for (size_t c = 0; c < choices_.size(); ++c)
    for (const Pipeline& p : choices_[c]->strategy->pipelines)
      longest[c] = std::max(longest[c], accepted_piece(*choices_[c]->strategy, p, o_.seq_len));
  std::vector<int> order(choices_.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return longest[a] < longest[b]; });
  std::map<int, std::vector<int64_t>> buckets;
  for (int64_t piece : chosen)
    for (int c : order)
      if (pieces_->piece_size(piece) <= longest[c]) {
        buckets[c].push_back(piece);
        break;
      }
  whole = TokenStep{};
  whole.pieces = static_cast<int64_t>(chosen.size());
  for (int64_t piece : chosen) whole.tokens += pieces_->piece_size(piece);
  whole.counted = whole.tokens - whole.pieces;
  double loss_total = 0;
  std::map<std::string, Annotation> layout;  // where the gradients summed so far lie
  // The switches inside the step belong to it: the emulated step runs from
  // the previous step's end through every bucket and switch.
  const int64_t step_start = emulated_end_;
  for (int c : order) {
    auto bucket = buckets.find(c);
    if (bucket == buckets.end()) continue;
    if (c != choice_) switch_choice(c, step, "bucket of pieces up to " + std::to_string(longest[c]) + " tokens", log);
    token_step_ = plan_pieces(bucket->second, rt_->strategy, c);
    whole.predicted_s += token_step_->predicted_s;
    whole.pipeline_tokens.insert(whole.pipeline_tokens.end(), token_step_->pipeline_tokens.begin(),
                                 token_step_->pipeline_tokens.end());
    std::map<std::string, NDArray> raw;
    double loss = 0;
    accumulate_schedule(raw, loss, normalizer);
    ExecGraph& graph = *rt_->graph;
    graph.wait_sends(world_);
    activations = std::max(activations, allocator_for(Device::cpu()).peak_bytes() - held);
    loss_total += all_reduce_scalar(is_representative(graph.loss_annotation(), world_.rank()) ? loss : 0.0, world_);
    std::map<std::string, NDArray> now = graph.sync_gradients(raw, world_);
    for (const std::string& name : graph.model().names) {  // the same order on every rank
      const Annotation& to = graph.annotation("grad." + name);
      NDArray sum;
      if (auto was = layout.find(name); was != layout.end()) {
        auto held_sum = synced.find(name);
        sum = graph.reshard("bucket_sum." + name, rt_->shapes.at(name), was->second, to,
                            held_sum == synced.end() ? NDArray() : held_sum->second, world_);
      }
      auto g = now.find(name);
      if (g != now.end()) {
        if (sum.valid()) kernels::accumulate(g->second, sum);
        else sum = g->second;
      }
      if (sum.valid()) synced[name] = sum;
      else synced.erase(name);
      layout.insert_or_assign(name, to);
    }
  }
  emulated_end_ = step_start;
  return loss_total;
}

double DistTrainer::select_and_dispatch(int64_t step, std::ofstream& log) {
  const auto t0 = Clock::now();
  double spent_before_switch = -1;  // the switch itself is not selection or dispatch
  const int64_t cursor = state_->samples;
  std::optional<Prepared> pr;
  if (next_.valid()) pr = next_.get();
  if (!pr || pr->cursor != cursor || pr->plan != rt_->plan.get() || pr->current != choice_)
    pr = prepare_token_step(cursor, choice_, rt_->plan.get());  // a switch or resume came between
  if (!choices_.empty()) {
    int64_t pick = pr->pick;
    world_.broadcast(&pick, 1, 0);  // one decision for all ranks
    if (pick != choice_) {
      spent_before_switch = std::chrono::duration<double>(Clock::now() - t0).count();
      switch_choice(static_cast<int>(pick), step, "the step's pieces (strategy " + std::to_string(pick) + ")", log);
    }
    token_step_ = *pr->by_choice.at(choice_);
  } else {
    token_step_ = std::move(*pr->by_choice.at(0));
  }
  const double spent =
      spent_before_switch >= 0 ? spent_before_switch : std::chrono::duration<double>(Clock::now() - t0).count();
  // The next step's, while this one trains.
  if (step + 1 < o_.steps)
    next_ = std::async(std::launch::async, [this, next = cursor + token_step_->pieces, c = choice_,
                                            plan = rt_->plan.get()] { return prepare_token_step(next, c, plan); });
  return spent;
}

void DistTrainer::fill_record(const std::vector<StepMetrics>& all, StepRecord& r) {
  int64_t end = 0;
  emulated_compute_.resize(all.size(), 0);
  for (size_t k = 0; k < all.size(); ++k) {
    const StepMetrics& m = all[k];
    r.bytes_sent.push_back(m.bytes_sent);
    r.reshard_bytes_sent.push_back(m.reshard_sent);
    r.predicted_reshard_bytes.push_back(m.reshard_predicted);
    r.op_bytes_sent.push_back(m.op_sent);
    r.predicted_op_bytes.push_back(m.op_predicted);
    r.peak_memory_bytes.push_back(m.peak_bytes);
    r.peak_activation_bytes.push_back(m.activation_bytes);
    end = std::max(end, m.clock_ns);
    if (!clock_) continue;
    r.emulated_compute_s.push_back((m.compute_ns - emulated_compute_[k]) * 1e-9);
    emulated_compute_[k] = m.compute_ns;
  }
  if (!clock_) return;
  // The emulated cluster's step: from the last rank's end to the last rank's end.
  r.emulated_step_time_s = (end - emulated_end_) * 1e-9;
  emulated_end_ = end;
}

// One step's micro-batches under the plan's schedule.
void DistTrainer::accumulate_schedule(std::map<std::string, NDArray>& raw, double& loss, float normalizer) {
  ExecGraph& graph = *rt_->graph;
  auto accumulate = [&](const ExecGraph::MicroBatch& mb) {
    if (mb.loss) loss += *mb.loss;
    for (auto& [name, g] : mb.raw_grads) {
      auto it = raw.find(name);
      if (it == raw.end()) raw.emplace(name, g.clone());
      else kernels::accumulate(g, it->second);
    }
  };
  auto forward = [&](int micro) {
    const double t0 = clock_ ? clock_->now() : 0;
    Bindings bindings;
    const ValueMap values = feeds(micro, normalizer, bindings);
    ExecGraph::Activations a = graph.forward(values, world_, bindings);
    if (clock_) clock_->record("F" + std::to_string(micro), "forward", t0);
    return a;
  };
  auto backward = [&](ExecGraph::Activations a, int micro) {
    const double t0 = clock_ ? clock_->now() : 0;
    accumulate(graph.backward(std::move(a), world_));
    if (clock_) clock_->record("B" + std::to_string(micro), "backward", t0);
  };
  // Sends are deferred (set_deferred_sends): a stage sending activations
  // never waits on a neighbour sending gradients.
  const int micro_batches = !pieces_ ? rt_->micro_batches()
                            : rt_->pipeline < 0 ? 0
                                                : static_cast<int>(token_step_->micro.at(rt_->pipeline).size());
  schedule_by_name(rt_->strategy.schedule)(SchedulePosition{rt_->stage, rt_->stages, micro_batches},
                                           forward, backward);
  if (micro_batches == 0 && rt_->pipeline >= 0) {
    // A pipeline that got no piece this step contributes zero gradients.
    for (const std::string& name : graph.model().names) {
      const Shard& sh = state_->slot(name, StateSlot::kParam);
      if (sh.held() && !raw.count(name)) raw.emplace(name, NDArray::zeros(sh.data.shape(), DType::F32));
    }
  }
}

std::vector<StepRecord> DistTrainer::run() {
  Adam adam(o_.adam);
  LrSchedule schedule = o_.schedule;
  schedule.total_steps = o_.steps;
  std::ofstream log;
  if (world_.rank() == 0 && !o_.log_path.empty()) {
    log.open(o_.log_path, state_->step > 0 ? std::ios::app : std::ios::trunc);
    if (!log) fail("[train] --log ", o_.log_path, ": cannot open for writing: ", std::strerror(errno));
  }
  int64_t skipped = 0;
  std::vector<StepRecord> records;
  const auto start = Clock::now();
  for (int64_t step = state_->step; step < o_.steps; ++step) {
    if (!events_.empty()) {
      auto ev = std::find_if(events_.begin(), events_.end(), [&](const ElasticEvent& e) { return e.step == step; });
      if (ev != events_.end() && step > events_done_) {
        events_done_ = step;
        const int64_t from = apply_event(*ev, step, log);
        if (from != step) {  // rolled back: those steps are trained again
          std::erase_if(records, [&](const StepRecord& r) { return r.step >= from; });
          step = from;
        }
      }
    } else if (plan_at(step) != plan_index_) {
      switch_to(plan_at(step), step, log);
    }
    const auto t0 = Clock::now();
    world_.reset_bytes();
    rt_->graph->reset_ledger();
    allocator_for(Device::cpu()).reset_peak();
    const int64_t global_batch = pieces_ ? 0 : rt_->strategy.global_batch();
    const int64_t first = state_->samples;
    const bool bucketed = pieces_ && o_.bucket_switching;
    const double dispatch_s = pieces_ && !bucketed ? select_and_dispatch(step, log) : 0.0;
    int64_t counted = 0;
    if (bucketed)
      for (int64_t piece : step_pieces(first)) counted += pieces_->piece_size(piece) - 1;
    else if (pieces_)
      counted = token_step_->counted;
    const float normalizer = pieces_ ? static_cast<float>(std::max<int64_t>(1, counted))
                                     : source_->normalizer(first, global_batch);
    // What the rank holds before its micro-batches: parameters, optimizer
    // states; the schedule's peak above it is activations (and raw grads).
    const size_t held = allocator_for(Device::cpu()).current_bytes();
    StepRecord r;
    r.step = step;
    std::map<std::string, NDArray> synced;
    size_t activations = 0;
    double post0 = 0;
    if (bucketed) {
      TokenStep whole;
      r.loss = run_buckets(step, normalizer, log, synced, held, activations, whole);
      token_step_ = std::move(whole);
      post0 = clock_ ? clock_->now() : 0;
    } else {
      std::map<std::string, NDArray> raw;
      double loss = 0;
      accumulate_schedule(raw, loss, normalizer);
      rt_->graph->wait_sends(world_);
      activations = allocator_for(Device::cpu()).peak_bytes() - held;
      r.loss = all_reduce_scalar(is_representative(rt_->graph->loss_annotation(), world_.rank()) ? loss : 0.0,
                                 world_);
      post0 = clock_ ? clock_->now() : 0;
      synced = rt_->graph->sync_gradients(raw, world_);
    }
    ExecGraph& graph = *rt_->graph;
    if (step == 0 && !o_.dump_grads_path.empty())
      gather_and_write(o_.dump_grads_path, "dump.", [&](const std::string& name) {
        auto g = synced.find(name);
        return std::pair{graph.annotation("grad." + name), g == synced.end() ? NDArray() : g->second};
      }, DType::F32);
    r.grad_norm = global_grad_norm(synced);
    r.lr = schedule.at(step);
    if (skip_nonfinite(r, skipped)) state_->step = step + 1;  // weights and moments stay as they were
    else optimizer_step(adam, synced, r.lr);
    state_->samples += pieces_ ? token_step_->pieces : global_batch;
    if (clock_) clock_->record("step " + std::to_string(step) + " post", "post", post0);
    if (pieces_) {
      r.tokens = token_step_->tokens;
      r.pieces = token_step_->pieces;
      r.pipeline_tokens = token_step_->pipeline_tokens;
      r.predicted_step_s = token_step_->predicted_s;
      r.dispatch_s = dispatch_s;
      if (!choices_.empty()) r.strategy = choice_;
    } else {
      r.tokens = source_->tokens(first, global_batch);
    }
    graph.wait_sends(world_);
    const auto ns = [](double s) { return static_cast<int64_t>(s * 1e9); };
    StepMetrics mine;
    mine.bytes_sent = world_.bytes().sent;
    mine.reshard_sent = graph.ledger().measured;
    mine.reshard_predicted = graph.ledger().predicted;
    mine.op_sent = graph.ledger().op_measured;
    mine.op_predicted = graph.ledger().op_predicted;
    mine.clock_ns = clock_ ? ns(clock_->now()) : 0;
    mine.compute_ns = clock_ ? ns(clock_->compute_s()) : 0;
    mine.peak_bytes = static_cast<int64_t>(allocator_for(Device::cpu()).peak_bytes());
    mine.activation_bytes = static_cast<int64_t>(activations);
    fill_record(gather_metrics(mine, world_), r);
    r.step_time_s = std::chrono::duration<double>(Clock::now() - t0).count();
    r.tokens_per_s = r.tokens / r.step_time_s;
    write_log(log, train_common::record_json(r));
    if (world_.rank() == 0 && o_.progress)
      train_common::print_progress(r, o_.steps,
                                   std::chrono::duration<double>(Clock::now() - start).count());
    records.push_back(r);
    finish_checkpoint(false);
    if (o_.save_every > 0 && (step + 1) % o_.save_every == 0) save_checkpoint();
    watch_stragglers(step, r, log);
    if (o_.on_step) o_.on_step(step);
  }
  finish_checkpoint(true);
  if (!o_.save_path.empty()) save();
  if (!o_.trace_path.empty()) write_trace();
  return records;
}

// Each rank writes its spans next to the trace, then rank 0 merges them into
// one Chrome-trace JSON (one process per rank, virtual microseconds).
void DistTrainer::write_trace() const {
  const std::string part = o_.trace_path + ".rank" + std::to_string(world_.rank());
  {
    nlohmann::json events = nlohmann::json::array();
    for (const TraceEvent& e : clock_->events())
      events.push_back({{"name", e.name}, {"cat", e.category}, {"ph", "X"}, {"pid", world_.rank()},
                        {"tid", 0}, {"ts", e.begin * 1e6}, {"dur", (e.end - e.begin) * 1e6}});
    std::ofstream out(part);
    out << events.dump();
    out.close();
    if (!out) fail("[train] --trace ", o_.trace_path, ": cannot write ", part, " (disk full or I/O error)");
  }
  world_.barrier();
  if (world_.rank() != 0) return;
  nlohmann::json all = nlohmann::json::array();
  for (int r = 0; r < world_.size(); ++r) {
    const std::string p = o_.trace_path + ".rank" + std::to_string(r);
    all.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", r},
                   {"args", {{"name", "rank " + std::to_string(r) + " (emulated)"}}}});
    std::ifstream in(p);
    for (auto& e : nlohmann::json::parse(in)) all.push_back(std::move(e));
    std::remove(p.c_str());
  }
  std::ofstream out(o_.trace_path);
  out << nlohmann::json{{"traceEvents", all},
                        {"displayTimeUnit", "ms"},
                        {"otherData", {{"clock", "virtual time of the EMULATED cluster (hspmd --cluster)"}}}}
             .dump();
  out.close();
  if (!out) fail("[train] --trace ", o_.trace_path, ": write failed (disk full or I/O error)");
}

}  // namespace

std::vector<StepRecord> train_distributed(const TrainOptions& options, Communicator& world) {
  set_num_threads(options.threads);
  // Setup errors (strategy, world size, data, weights) are agreed on by all
  // ranks before any step: the lowest failing rank reports, every rank exits.
  std::unique_ptr<DistTrainer> trainer;
  std::string error;
  try {
    trainer = std::make_unique<DistTrainer>(options, world);
    trainer->prepare();
  } catch (const Error& e) {
    error = e.what();
  }
  std::vector<int32_t> failed(world.size(), 0);
  const int32_t mine = error.empty() ? 0 : 1;
  world.all_gather(&mine, failed.data(), std::vector<int64_t>(world.size(), 1));
  const auto first = std::find(failed.begin(), failed.end(), 1);
  if (first != failed.end())
    throw SetupFailure(error.empty() ? "[train] setup failed on another rank" : error,
                       first - failed.begin() == world.rank());
  return trainer->run();
}

}  // namespace hspmd
