// The distributed trainer (docs/training.md): one rank's training loop. The
// loop itself (dist_trainer.cc) reads as the system's step: apply the
// changes due (an elastic event, a --switch), dispatch the step's data,
// run the schedule's micro-batches on this rank's executable graph, sync
// the gradients, update, report, checkpoint. The parts it composes each own
// their state:
//   - the runtime builder (hspmd/exec/runtime.h): a plan specialized for this rank;
//   - the gradient sync (hspmd/exec/grad_sync.h): buckets, overlap, ZeRO scatter;
//   - token-budget steps (train/token_steps.h): pieces, dispatch, strategy selection;
//   - elastic training (train/elastic.h): events, re-plans, rollbacks, stragglers;
//   - checkpoints (train/checkpoint_saver.h) and the step log (train/step_log.h).
// Plans and switches (plan files, compile, the move between runtimes) are
// run_plans.cc; the run's checks before step 0 are setup.cc; saving and
// gathering weights is dist_checkpoints.cc.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/error.h"
#include "hspmd/data/token_data.h"
#include "hspmd/exec/exec_graph.h"
#include "hspmd/exec/grad_sync.h"
#include "hspmd/exec/runtime.h"
#include "hspmd/exec/virtual_clock.h"
#include "hspmd/optim/adam.h"
#include "hspmd/optim/lr_schedule.h"
#include "hspmd/plan/plan.h"
#include "hspmd/plan/switch.h"
#include "hspmd/planner/profile.h"
#include "hspmd/train/trainer.h"
#include "hspmd/train/training_state.h"
#include "train/router_stats.h"
#include "train/checkpoint_saver.h"
#include "train/collectives.h"
#include "train/elastic.h"
#include "train/step_log.h"
#include "train/token_steps.h"
#include "train/train_common.h"

namespace hspmd::dist {

class DistTrainer {
 public:
  // Checks the options, the model, the cluster and every plan of the run
  // (errors before any data is read).
  DistTrainer(const TrainOptions& o, Communicator& world);
  ~DistTrainer();

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
  void settle_checkpoint() { checkpoints_.finish(true); }
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
  // --replace-experts (expert_replacement.cc): before step `step`, the
  // placement of the last step's routing, switched to when worth it.
  void maybe_replace_experts(int64_t step);
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
  friend class TokenSteps;
  friend class ElasticController;

  // Setup (setup.cc): the flags, the cluster and emulation, the plans.
  void check_run_options() const;
  void set_up_emulation();
  void load_plans();
  // Resume (setup.cc): the checkpoint's step and state; the plan in force then.
  std::shared_ptr<const AnnotationPlan> resume_plan(const CheckpointReader& reader, int64_t start);
  void load_state(CheckpointReader* reader, int64_t start);

  // Plans (run_plans.cc). A strategy (compiled) or a trainable plan for this job.
  std::shared_ptr<const AnnotationPlan> load_plan_file(const std::string& path) const;
  // The same, its errors naming the flag and the file: "[flags] --switch 3:
  // s.json: <the error>" unless the error names the file already.
  std::shared_ptr<const AnnotationPlan> load_named_plan_file(const std::string& path, const std::string& flag) const;
  std::shared_ptr<const AnnotationPlan> compile(const Strategy& strategy) const;
  std::unique_ptr<Runtime> specialize(std::shared_ptr<const AnnotationPlan> plan) const;
  // The switch options every move of this run shares (algorithm, bucket size).
  SwitchOptions base_switch_options() const;
  // How the switch to plans_[index] is planned: the checkpoint serves lost
  // ranks' slices when one is written at that very step.
  SwitchOptions switch_options(size_t index) const;
  // The index into plans_ in force at `step`.
  size_t plan_at(int64_t step) const;
  void switch_to(size_t index, int64_t step);
  // Specializes `plan` and moves the training state to it; returns the log
  // fields every switch record shares.
  nlohmann::json move_to(std::shared_ptr<const AnnotationPlan> plan, const SwitchOptions& so);
  // The same for a plan specialized already; the old runtime goes to
  // *keep_old when given (--strategies keeps every choice's graphs).
  nlohmann::json move_runtime(std::unique_ptr<Runtime> next, const SwitchOptions& so, double specialize_s,
                              std::unique_ptr<Runtime>* keep_old);

  // The step (dist_trainer.cc, micro_batches.cc).
  // The target tokens of the step about to train (the same on every rank;
  // a step with none is an error).
  int64_t counted_targets(int64_t step) const;
  // What the micro-batches and the gradient sync measured.
  struct StepWork {
    size_t activations = 0;  // the schedule's peak above what the rank held before it
    double post0 = 0;        // emulation: the clock when the schedule's compute was done
    double grad_sync_s = 0;  // wall time of the sync after the schedule
    int64_t overlapped = 0;  // gradients handed to the overlap during the backward
    int64_t duplicate_sent = 0;  // bytes the overlap sent over the duplicate world
    // The step's loss terms on the device, not read yet (reads_after_update);
    // empty when compute_and_sync read them.
    std::vector<NDArray> loss_terms;
    bool loss_deferred = false;
    Clock::time_point t0{};  // the step's start
    int64_t graph_peak_bytes = 0;  // a replayed CUDA graph: the allocator's peak at its capture
  };
  // Whether this step reads the loss and the gradient norm only after the
  // update is queued (one process, no emulated clock, no mixture-of-experts
  // statistics, no bucket switching): the clip's coefficient and the guard
  // against a non-finite step are computed on the device
  // (kernels::clip_control), so the host queues the whole step without a
  // wait; the multi-rank path all-reduces both on the host first.
  bool reads_after_update() const;
  // This rank's micro-batches and the gradient sync into `synced`; the
  // step's loss into `r`.
  StepWork compute_and_sync(int64_t step, float normalizer, std::map<std::string, NDArray>& synced, StepRecord& r);
  // The update after the sync: clipping, the skip of a non-finite step,
  // AdamW, ZeRO gathers; the data cursor moves past the step.
  void update(int64_t step, std::map<std::string, NDArray>& synced, const StepWork& work, StepRecord& r);
  // The record's measurements, its log line and progress; --op-times.
  void report(int64_t step, StepRecord& r, const StepWork& work,
              std::vector<ExecGraph::OpTiming>* op_timings);
  // After the record: the checkpoint due, the straggler watch, on_step.
  void after_step(int64_t step, const StepRecord& r);
  // This rank's placeholders for micro-batch `micro` of the step (the loss
  // divided by `normalizer`), and the bindings of their symbolic dims (S
  // varies with packed documents).
  ValueMap feeds(int micro, float normalizer, Bindings& bindings) const;
  // The gradients counted in the global norm: each once over the ranks.
  std::vector<NDArray> norm_terms(const std::map<std::string, NDArray>& synced) const;
  double global_grad_norm(const std::map<std::string, NDArray>& synced) const;
  // `control`: clip_control's array (the coefficient and the guard read on
  // the device; grad_scale unused), or nullptr.
  void optimizer_step(Adam& adam, std::map<std::string, NDArray>& synced, double lr, float grad_scale,
                      const NDArray* control = nullptr);
  // The weights' bf16 compute copies written by the update (docs/
  // precision.md, "The weights' bf16 copies"): under mixed precision,
  // without an emulated clock and without anything that changes the
  // parameters between two steps but the optimizer (an elastic run, plan
  // switches, expert replacement), AdamW rewrites each cast weight's bf16
  // copy in its own pass and the next step's StepScope takes those copies
  // instead of running the casts.
  bool optimizer_writes_copies() const;
  // This step's cast outputs, by parameter: its cast node and the array
  // (accumulate_schedule keeps them for the update).
  std::map<std::string, std::pair<int, NDArray>> step_casts_;
  // What the last update wrote, by cast node, for `graph` at step `step`
  // only: any other graph or step takes none of them. Each copy keeps the
  // parameter array it was made from (`source`, held: no later array can
  // take its place in memory): a step takes a copy only while the state's
  // parameter is that array, so weights replaced between two steps (the
  // Python API's load_parameters, a switch, a restore) are cast again.
  struct WeightCopy {
    std::string param;
    NDArray source;
    NDArray copy;
  };
  struct WeightCopies {
    const ExecGraph* graph = nullptr;
    int64_t step = -1;
    std::map<int, WeightCopy> by_node;
  };
  WeightCopies copies_;
  int64_t current_step_ = -1;  // the step compute_and_sync runs

  // CUDA graphs of the step (--cuda-graphs; step_graphs.cc, docs/cuda.md
  // "CUDA graphs"). The step recorded once and replayed: its graph, the
  // allocator pool its arrays live in, the arrays it reads and writes in
  // place (held, so that none is freed and its memory given to another),
  // the device feeds a replay copies the next batch into, and the outputs
  // read after each launch.
  struct CapturedStep {
    std::shared_ptr<void> graph;
    std::shared_ptr<void> pool;
    const ExecGraph* exec = nullptr;
    struct Held {
      std::string name;
      StateSlot slot;
      NDArray array;
    };
    std::vector<Held> held;  // the state's arrays at the capture
    std::vector<ValueMap> feeds;                          // per micro-batch (device leaves)
    std::vector<Bindings> bindings;
    NDArray control;  // clip_control's
    std::vector<NDArray> loss_terms;
    size_t activations = 0;  // the captured step's peak above what the rank held
    int64_t peak_bytes = 0;  // the allocator's peak during the capture
    int64_t captured_at = -1;
  };
  std::optional<CapturedStep> captured_;
  std::string graphs_off_;        // why the steps run uncaptured ("" when they may be captured)
  int64_t graph_warmup_end_ = 0;  // the first step that may be captured
  int recaptures_ = 0;            // new captures after the first (the batch's shape changed)
  bool capture_audit_ = false;    // HSPMD_CAPTURE_AUDIT on a CPU device (step_graphs.cc)
  const CapturedStep* capturing_ = nullptr;  // the capture under way: its device feeds (accumulate_schedule)
  // At begin(): whether this run may capture (else the note), and AdamW's
  // factors through device memory.
  void begin_graphs();
  // Why this run's steps cannot be captured ("" when they can).
  std::string graphs_unavailable() const;
  // Stops capturing for the rest of the run, with a note saying why.
  void graphs_off(const std::string& why);
  // The step through a CUDA graph (captured now, or replayed), the record's
  // loss, norm and data fields filled as update() fills them; false: the
  // step must run uncaptured (nothing of it has run).
  bool graph_step(int64_t step, float normalizer, StepRecord& r, StepWork& work);
  bool capture_step(int64_t step, float normalizer, const std::vector<ValueMap>& host,
                    const std::vector<Bindings>& bindings, StepRecord& r);
  bool captured_fits(const std::vector<ValueMap>& host, const std::vector<Bindings>& bindings) const;
  // The copies for `graph` at the current step (moved out: none is given
  // twice), and the step's casts kept from `scope` for the update.
  std::map<int, NDArray> take_weight_copies(const ExecGraph& graph);
  void keep_step_casts(const ExecGraph& graph, const ExecGraph::StepScope& scope);
  // One step's schedule of micro-batches on this rank; `overlap` (optional):
  // the last backward hands each final gradient to it. `loss_terms`
  // (optional): the micro-batches' loss arrays go there, unread, and `loss`
  // is left as it is.
  void accumulate_schedule(std::map<std::string, NDArray>& raw, double& loss, float normalizer,
                           GradOverlap* overlap = nullptr, std::vector<NDArray>* loss_terms = nullptr);
  // Whether the steps overlap their gradient synchronization (TrainOptions::overlap).
  bool overlapping() const {
    return o_.overlap.value_or(!(o_.device == Device::cpu())) && !clock_ && world_.size() > 1;
  }
  // Stops the run (`skipped` steps so far beyond --skip-nonfinite-steps) or
  // marks the record skipped when its loss or gradient norm is not finite;
  // the same on every rank (both are all-reduced). True: skip the update.
  bool skip_nonfinite(StepRecord& r, int64_t& skipped) const;
  bool elastic() const { return elastic_ && elastic_->active(); }

  // Checkpoints and saved weights (dist_checkpoints.cc).
  // Copies this rank's shards and writes them on a background thread
  // (synchronously with --checkpoint-sync); committed by finish_checkpoint.
  // Refused first, on every rank, when `dir` holds another run's committed
  // checkpoint (`what` names the writer).
  void save_checkpoint_to(const std::string& dir, const std::string& what);
  void finish_checkpoint(bool wait) { checkpoints_.finish(wait); }
  // The first parameter (in the model's order) holding a NaN or infinity on
  // any rank, or "" (collective): weights are checked before they are written.
  std::string nonfinite_parameter();
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
  StepRouterResult step_router_;  // this step's mixture-of-experts router results (accumulate_schedule)
  SwitchAlgorithm algorithm_ = SwitchAlgorithm::kFused;
  std::shared_ptr<const Topology> topology_;
  std::unique_ptr<VirtualClock> clock_;            // emulation: this rank's virtual clock
  std::optional<Profile> profile_;                 // --clock model: the profile ...
  std::shared_ptr<const OpTimeModel> time_model_;  // ... and its per-op model
  std::vector<std::shared_ptr<const AnnotationPlan>> plans_;  // the first, then one per switch
  size_t plan_index_ = 0;
  std::unique_ptr<Runtime> rt_;  // the plan in force, specialized
  double last_specialize_s_ = 0;
  SwitchPlanCache switch_plans_;
  std::optional<TrainingState> state_;
  std::unique_ptr<TokenData> data_;
  std::unique_ptr<train_common::SampleSource> source_;  // fixed-size samples (not token-budget steps)
  // The parts.
  std::unique_ptr<TokenSteps> tokens_;          // --batch-tokens
  std::unique_ptr<ElasticController> elastic_;  // --events
  CheckpointSaver checkpoints_;
  StepLog log_;
  StepMeter meter_;
  std::optional<GradSync> grad_sync_;  // begin() makes it (collective)
  // The loop's own state (begin / step / end).
  std::optional<Adam> adam_;
  LrSchedule schedule_;
  int64_t next_step_ = 0;
  int64_t skipped_ = 0;  // non-finite steps skipped so far
  std::vector<StepRecord> records_;
  Clock::time_point start_;
};

}  // namespace hspmd::dist
