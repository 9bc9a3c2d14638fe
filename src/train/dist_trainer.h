// The distributed trainer's internals (src/train only): the DistTrainer
// class, its runtime pieces and the small collective helpers its parts
// share. The loop itself is dist_trainer.cc; elastic training (events,
// re-plans, rollbacks, stragglers) is elastic.cc; token-budget steps
// (dispatch, strategy selection, bucket switching) are token_steps.cc.
#pragma once

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
#include "train/grad_overlap.h"
#include "train/schedules.h"
#include "train/straggler_window.h"
#include "train/train_common.h"

namespace hspmd::dist {

using Clock = std::chrono::steady_clock;

// The pipeline a rank belongs to, or -1 when idle.
inline int pipeline_of(const Strategy& s, int rank) {
  for (size_t p = 0; p < s.pipelines.size(); ++p)
    for (const Stage& st : s.pipelines[p].stages)
      for (int r : st.ranks)
        if (r == rank) return static_cast<int>(p);
  return -1;
}

// Every rank's values of `mine`: out[i][r] is rank r's mine[i].
inline std::vector<std::vector<int64_t>> gather_counts(const std::vector<int64_t>& mine, Communicator& world) {
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
  int64_t grad_sync_ns = 0;       // wall time of the gradient synchronization after the schedule
  int64_t sm_percent = 0;         // CUDA MPS: the rank's share of the GPU's SMs (0: none set)
  int64_t grad_sync_overlapped = 0;  // gradients handed to the communication thread during the backward
  int64_t attention_fallbacks = 0;   // attention calls cuDNN did not take so far (CUDA, bf16 products)
};
constexpr int kStepMetricFields = sizeof(StepMetrics) / sizeof(int64_t);
static_assert(sizeof(StepMetrics) == kStepMetricFields * sizeof(int64_t));

inline std::vector<StepMetrics> gather_metrics(const StepMetrics& mine, Communicator& world) {
  std::vector<StepMetrics> all(world.size());
  world.all_gather(reinterpret_cast<const int64_t*>(&mine), reinterpret_cast<int64_t*>(all.data()),
                   std::vector<int64_t>(world.size(), kStepMetricFields));
  return all;
}


inline double all_reduce_scalar(double v, Communicator& world) {
  world.all_reduce(&v, 1);
  return v;
}

// Rank 0's `text` on every rank.
inline void broadcast_text(std::string& text, Communicator& world) {
  int64_t n = static_cast<int64_t>(text.size());
  world.broadcast(&n, 1, 0);
  std::vector<int64_t> words((n + 7) / 8, 0);
  if (world.rank() == 0 && n > 0) std::copy(text.begin(), text.end(), reinterpret_cast<char*>(words.data()));
  if (!words.empty()) world.broadcast(words.data(), static_cast<int64_t>(words.size()), 0);
  text.assign(reinterpret_cast<const char*>(words.data()), static_cast<size_t>(n));
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// Two strategies that execute alike (the description aside).
inline bool same_execution(Strategy a, Strategy b) {
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
  std::map<std::string, DType> gather_dtypes;  // ZeRO-1 gathers (zero_gather_dtypes)
  int pipeline = -1;
  int stage = 0, stages = 1;         // this rank's stage and its pipeline's stage count
  int64_t granularity = 1;           // every micro-batch's sequence length is a multiple of it
  int micro_batches() const { return pipeline < 0 ? 0 : strategy.pipelines[pipeline].micro_batches; }
};


// A checkpoint being written by this rank's background thread: the shards
// were copied, so the steps go on while the disk works.
struct PendingCheckpoint {
  int64_t step = 0;
  std::string dir;  // where it is committed
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
  // A communication thread let go after an error may still be inside a
  // collective on the duplicate world: that world is left alive (the job
  // is ending; the rank aborts it).
  ~DistTrainer() {
    if (GradOverlap::any_abandoned()) (void)grad_world_.release();
  }
  DistTrainer(const TrainOptions& o, Communicator& world)
      : o_(o), world_(world), config_(ModelConfig::load(o.model_path)) {
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
    if (o.overlap.value_or(false) && (!o.cluster_path.empty() || !o.trace_path.empty()))
      fail("[flags] --overlap with --", o.cluster_path.empty() ? "trace" : "cluster",
           ": the emulated clock bills one thread per rank (no communication thread); drop --overlap");
    train_common::check_outputs(o, world.rank());
    check_checkpoint_directory(o);
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
      check_profile_precision(*profile_, o.precision, o.profile_path);
      time_model_ = std::make_shared<const OpTimeModel>(profile_->ops, o.profile_path);
    } else if (!o.profile_path.empty() && o.events_path.empty() && o.batch_tokens == 0) {
      fail("[flags] --profile is read only with --clock model, --events or --batch-tokens (the cost model's "
           "profile)");
    }
    if (o.bucket_switching && !o.events_path.empty())
      fail("[flags] --events does not go with --bucket-switching yet (each step's per-bucket plans are fixed)");
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
      plans_.push_back(load_named_plan_file(sw.path, "--switch " + std::to_string(sw.step)));
      if (o.batch_tokens == 0 && plans_.back()->strategy->global_batch() != plans_[0]->strategy->global_batch())
        fail("[flags] --switch ", sw.step, ":", sw.path, ": global batch ", plans_.back()->strategy->global_batch(),
             ", the run's is ", plans_[0]->strategy->global_batch(), " (a switch keeps the global batch)");
    }
    for (const auto& p : plans_)  // every plan is checked before the first step
      if (o.batch_tokens == 0 && o.global_batch != 0 && o.global_batch != p->strategy->global_batch())
        fail("[flags] --global-batch ", o.global_batch, " differs from the strategy's global batch ",
             p->strategy->global_batch());
    if (!o.events_path.empty()) load_elastic_events();
    if (!o.strategy_choices.empty()) {
      if (o.batch_tokens == 0) fail("[flags] --strategies needs --batch-tokens (a strategy is chosen per step)");
      if (!o.switches.empty()) fail("[flags] --strategies does not go with --switch");
      choices_.push_back(plans_[0]);
      replan_buckets_ = static_cast<int>(o.strategy_choices.size());
      for (size_t i = 1; i < o.strategy_choices.size(); ++i)
        choices_.push_back(load_named_plan_file(o.strategy_choices[i], "--strategies"));
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
  // The whole loop: begin(), step() until done(), end().
  std::vector<StepRecord> run();
  // The loop in parts (the Python API's Trainer drives it step by step):
  // begin() agrees on the run id and opens the log; step() trains the next
  // step (after the events or switches due before it) and returns its
  // record; end() waits for the last checkpoint, writes --save and --trace
  // and returns every step's record. All collective.
  void begin();
  bool done() const { return next_step_ >= o_.steps; }
  int64_t next_step() const { return next_step_; }
  StepRecord step();
  std::vector<StepRecord> end();
  // Collective: the weights as full tensors with Hugging Face names
  // (vocabulary padding dropped), the same on every rank.
  std::map<std::string, NDArray> full_parameters();
  // Collective: writes a training checkpoint of the state now into `dir`
  // and commits it (waits for the disk).
  void checkpoint_now(const std::string& dir);
  // Collective: commits the pending background checkpoint, if any (waits).
  void settle_checkpoint() { finish_checkpoint(true); }
  // A switch between two steps (the Python Trainer's switch_to): `plan`
  // checked as a --switch plan is (trainable, this world, this model, the
  // run's global batch), then the run moved to it before the next step
  // with the --switch algorithm and its {"event": "switch"} log record.
  // Refused in runs with --switch, --events or --strategies (their plans
  // follow the step count). check_switch throws on a bad plan (no
  // communication); switch_now is collective.
  void check_switch(const AnnotationPlan& plan, const std::string& source) const;
  // `plan` (from `source`) as a plan this run can train: it carries its
  // strategy, is compiled for this world and this model; the run's precision.
  std::shared_ptr<const AnnotationPlan> trainable_plan(AnnotationPlan plan, const std::string& source) const;
  void switch_now(std::shared_ptr<const AnnotationPlan> plan);
  // A strategy compiled for this run (its world, --seq-len, --precision),
  // or a strategy or plan file read as --switch reads it.
  std::shared_ptr<const AnnotationPlan> compile_strategy(const Strategy& strategy) const { return compile(strategy); }
  std::shared_ptr<const AnnotationPlan> load_switch_plan(const std::string& path) const {
    return load_named_plan_file(path, "switch_to");
  }
  // Collective: replaces the weights with `full` (the model's full f32
  // tensors, checked as --init's are); the optimizer moments restart at
  // zero, as a fresh run's.
  void load_weights(const std::map<std::string, NDArray>& full);
  Communicator& world() const { return world_; }
  // The plan in force (the one the next step trains under).
  const AnnotationPlan& plan_in_force() const { return *rt_->plan; }

 private:
  // A strategy (compiled) or a trainable plan for this job.
  std::shared_ptr<const AnnotationPlan> load_plan_file(const std::string& path) const;
  // The same, its errors naming the flag and the file: "[flags] --switch 3:
  // s.json: <the error>" unless the error names the file already.
  std::shared_ptr<const AnnotationPlan> load_named_plan_file(const std::string& path, const std::string& flag) const {
    try {
      return load_plan_file(path);
    } catch (const Error& e) {
      const std::string what = e.what();
      if (what.find(path) != std::string::npos) throw;
      fail("[flags] ", flag, ": ", path, ": ", what);
    }
  }
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
  // `ready`: the plan specialized already (token-budget steps specialize
  // every re-planned choice) and its specialization seconds; `extra` goes
  // into the logged record.
  int64_t reconfigure(std::shared_ptr<const AnnotationPlan> plan, int64_t step, const std::string& cause,
                      double planning_s, std::ofstream& log, std::unique_ptr<Runtime> ready = nullptr,
                      double ready_specialize_s = 0, const nlohmann::json& extra = nlohmann::json::object());
  // Slices only failed ranks held and no checkpoint of `step`: the whole
  // state is loaded under `plan` from the last checkpoint (an earlier
  // step), whose steps are trained again. Returns that step.
  int64_t rollback(std::shared_ptr<const AnnotationPlan> plan, int64_t step, const std::string& cause,
                   double planning_s, std::ofstream& log, std::unique_ptr<Runtime> ready, double ready_specialize_s,
                   const nlohmann::json& extra);
  // Token-budget steps (docs/elastic.md, "Token-budget steps"): the event's
  // changes with the strategy set re-planned by the mixed-length planner
  // (or the event's strategy as the only choice). Returns as apply_event.
  int64_t apply_token_event(const ElasticEvent& ev, int64_t step, std::ofstream& log);
  // Rank 0 runs the mixed-length planner (plan_mixed_lengths) on the run's
  // pieces for the available ranks under `topology`; every rank gets its
  // strategies (one per length bucket, at most replan_buckets_).
  std::vector<Strategy> replan_tokens(const Topology& topology, int64_t step, const std::string& cause,
                                      double& planning_s);
  // Waits for the next step's preparation and drops it, before the strategy
  // set, the dispatch model or the piece costs change; bumps the generation.
  void discard_prepared();
  // The pieces' longest, and the longest piece any pipeline of `strategies` accepts.
  int64_t longest_piece() const;
  int64_t most_accepted(const std::vector<const Strategy*>& strategies) const;
  // Whether the committed training checkpoint is the one of `step`.
  bool checkpoint_at(int64_t step);
  // Whether --checkpoint holds a committed checkpoint of this run (its
  // meta.run_id is run_id_, or it is the checkpoint this run resumed):
  // another run's is never read back.
  bool own_checkpoint() const;
  // The run's id (TrainOptions::run_id), agreed on by every rank.
  void agree_on_run_id();
  // Stragglers: after `step`, with its record; may re-plan and switch.
  void watch_stragglers(int64_t step, const StepRecord& r, std::ofstream& log);
  // ... with token-budget steps: each step predicted from its own dispatch;
  // a straggler's corrected speed goes to the dispatch (no re-plan).
  void watch_token_stragglers(int64_t step, const StepRecord& r, std::ofstream& log);
  // Whether the straggler watch runs (--events, an emulated cluster, a
  // window; not with --bucket-switching).
  bool watching() const;
  // The assumed speeds corrected by the window's per-rank ratios of seen to
  // predicted compute: a rank off the median ratio by more than the
  // threshold gets its slowdown scaled by its ratio over the median. None
  // when no rank is off (or nothing was seen).
  std::optional<Topology> corrected_speeds(const std::vector<int>& active, const std::vector<double>& ratio) const;
  // Per rank, the cost model's compute seconds per step of the current plan
  // under the assumed speeds (0 for idle ranks); empty when it cannot say.
  std::vector<double> predicted_compute(const Topology& topology) const;
  // This rank's placeholders for micro-batch `micro` of the step (the loss
  // divided by `normalizer`), and the bindings of their symbolic dims (S
  // varies with packed documents).
  ValueMap feeds(int micro, float normalizer, Bindings& bindings) const;
  double global_grad_norm(std::map<std::string, NDArray>& synced) const;
  void optimizer_step(Adam& adam, std::map<std::string, NDArray>& synced, double lr);
  // `overlap` (optional): the last backward hands each final gradient to it.
  void accumulate_schedule(std::map<std::string, NDArray>& raw, double& loss, float normalizer,
                           GradOverlap* overlap = nullptr);
  // Whether the steps overlap their gradient synchronization (TrainOptions::overlap).
  bool overlapping() const {
    return o_.overlap.value_or(!(o_.device == Device::cpu())) && !clock_ && world_.size() > 1;
  }

  // Token-budget steps (docs/mixed_length.md).
  struct TokenStep {
    std::vector<std::vector<std::vector<int64_t>>> micro;  // per pipeline, per micro-batch: its pieces
    int64_t pieces = 0, tokens = 0, counted = 0;
    std::vector<int64_t> pipeline_tokens;
    double predicted_s = 0;  // the slowest pipeline's predicted compute
  };
  // Checks the budget against the longest piece, each pipeline's capacity,
  // and that some pipeline of `strategies` accepts the longest piece.
  void check_pieces(const std::vector<const Strategy*>& strategies, const std::string& what) const;
  // The pieces of the step starting at piece `cursor` (or the given
  // pieces), dispatched over the pipelines of `s` (dispatch_token_step:
  // longest first to the accepting pipeline that finishes first, packed
  // first-fit decreasing). `key`: the index of `s` among --strategies, -1
  // for the current plan's. The same on every rank.
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
  // choice_switch_s_ for choices_: every pair's switch plan, predicted.
  void plan_choice_switches();
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
    uint64_t generation = 0;               // the strategy set's (and dispatch model's) when it was made
    std::vector<std::optional<TokenStep>> by_choice;  // --strategies; else [0] = the current plan's
    int pick = 0;
  };
  // current < 0: no switch cost for any choice (after a re-plan, every
  // choice is a switch from the old plan).
  Prepared prepare_token_step(int64_t cursor, int current, const AnnotationPlan* plan) const;
  // The step's dispatch, from the prepared one when it fits (else worked
  // out now); with --strategies, rank 0's pick and the switch to it.
  // Returns the seconds the training thread spent on it.
  double select_and_dispatch(int64_t step, std::ofstream& log);
  // Copies this rank's shards and writes them on a background thread
  // (synchronously with --checkpoint-sync); committed by finish_checkpoint.
  // Refused first, on every rank, when `dir` holds another run's committed
  // checkpoint (check_checkpoint_owner; `what` names the writer).
  void save_checkpoint() { save_checkpoint_to(o_.checkpoint_dir, "[checkpoint] --checkpoint"); }
  void save_checkpoint_to(const std::string& dir, const std::string& what);
  // check_checkpoint_owner for this run writing into `dir`: rank 0 reads
  // the index, every rank throws the same error.
  void check_checkpoint_owner_agreed(const std::string& dir, const std::string& what);
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
  // A resume under events whose checkpoint plan gives a failed rank work:
  // re-plans before the first step (elastic.cc).
  void replan_failed_at_resume(int64_t start);
  // The reconfigure record of a re-plan at the resume (failed ranks in the
  // checkpoint's plan), logged once the log is open; null when none.
  nlohmann::json resume_replan_;
  // The ranks' metrics into the record (the emulated step from the clocks).
  void fill_record(const std::vector<StepMetrics>& all, StepRecord& r);
  void save();
  void gather_and_write(const std::string& path, const std::string& prefix,
                        const std::function<std::pair<Annotation, NDArray>(const std::string&)>& local,
                        DType dtype) const;
  void write_trace() const;

  const TrainOptions& o_;
  // The run's precision as its device computes it (Precision::for_device):
  // what every plan of the run is compiled with.
  Precision precision() const { return o_.precision.for_device(o_.device); }
  Communicator& world_;
  ModelConfig config_;
  std::string run_id_;  // stamped into every checkpoint this run commits
  // With --resume the --checkpoint directory itself: the run id of the
  // checkpoint resumed (it counts as this run's own until replaced).
  std::optional<std::string> resumed_run_id_;
  // With --resume: the run id of the checkpoint resumed, wherever it is.
  std::optional<std::string> resume_run_id_;
  SwitchAlgorithm algorithm_ = SwitchAlgorithm::kFused;
  std::shared_ptr<const Topology> topology_;
  std::vector<std::shared_ptr<const AnnotationPlan>> plans_;  // the first, then one per switch
  std::unique_ptr<Runtime> rt_;
  size_t plan_index_ = 0;
  std::optional<TrainingState> state_;
  SwitchPlanCache switch_plans_;
  std::unique_ptr<VirtualClock> clock_;
  std::unique_ptr<Communicator> grad_world_;  // overlapping: the world's duplicate, for GradOverlap
  std::optional<Profile> profile_;                 // --clock model: the profile ...
  std::shared_ptr<const OpTimeModel> time_model_;  // ... and its per-op model
  bool warned_attention_fallback_ = false;   // the warning of a cuDNN attention fallback, once
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
  uint64_t generation_ = 0;  // bumped whenever choices_, the dispatch model or piece_costs_ change
  int replan_buckets_ = 1;   // K: the strategies a token-mode re-plan makes (the run's --strategies count)
  std::optional<TokenStep> token_step_;  // this step's
  // Elastic training.
  std::vector<ElasticEvent> events_;
  std::map<int64_t, std::shared_ptr<const AnnotationPlan>> event_plans_;  // step -> the event's strategy
  std::set<int> failed_;                   // ranks whose devices are gone now
  int64_t events_done_ = -1;               // events up to this step have happened
  std::shared_ptr<const Topology> assumed_;  // the planner's view: speeds as last estimated
  double last_specialize_s_ = 0;
  // Stragglers: per step in the window, per rank compute seen and predicted
  // and its role (token-budget steps: predicted from the step's dispatch,
  // kept across choice switches); the roles' model factors stay.
  StragglerWindow window_;
  std::vector<double> window_steps_;         // ... and the emulated step times
  std::vector<double> predicted_;            // per rank compute of the current plan (assumed speeds)
  bool skip_next_ = true;                    // the first step after a (re)start or switch is not watched
  // The loop's own state (begin / step / end).
  std::optional<Adam> adam_;
  LrSchedule schedule_;
  std::ofstream log_;
  int64_t next_step_ = 0;
  int64_t skipped_ = 0;  // non-finite steps skipped so far
  std::vector<StepRecord> records_;
  Clock::time_point start_;
};


}  // namespace hspmd::dist
