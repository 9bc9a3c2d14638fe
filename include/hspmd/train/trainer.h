// Training: options, step records, and the one training loop (a single
// process is a world of one) over data, pipelines, AdamW and checkpoints.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hspmd/core/device.h"
#include "hspmd/core/dtype.h"
#include "hspmd/core/error.h"
#include "hspmd/core/ndarray.h"
#include "hspmd/optim/adam.h"
#include "hspmd/models/model.h"
#include "hspmd/optim/lr_schedule.h"
#include "hspmd/options/train_options.h"
#include "hspmd/plan/strategy.h"

namespace hspmd {

struct StepRecord {
  int64_t step = 0;
  double loss = 0.0;
  int64_t tokens = 0;
  double step_time_s = 0.0;
  double tokens_per_s = 0.0;
  double lr = 0.0;
  double grad_norm = 0.0;
  bool skipped = false;  // non-finite loss or gradient norm: no update (skip_nonfinite_steps)
  // Distributed runs, per rank: bytes sent this step (all communication), the
  // part sent inside Reshards, and the resolver's prediction of that part.
  std::vector<int64_t> bytes_sent, reshard_bytes_sent, predicted_reshard_bytes;
  // ... and the part sent inside ops (ring attention, vocab-parallel loss),
  // measured and as the ops predict it (Op::traffic).
  std::vector<int64_t> op_bytes_sent, predicted_op_bytes;
  // ... of which expert parallelism's token exchange (docs/moe.md), measured
  // and as the resolver predicted it from the step's routing counts; in
  // the records only when some rank exchanged tokens.
  std::vector<int64_t> expert_bytes_sent, predicted_expert_bytes;
  // When the ranks run on several hosts, per rank: the TCP stream bytes sent
  // to other hosts since the record before, and the segments carrying them
  // (docs/multi_host.md); empty on one host.
  std::vector<int64_t> cross_host_bytes_sent, cross_host_segments;
  // A mixture-of-experts model: per sparse layer (in layer order), the
  // (token, slot) pairs each expert took over the step's global batch
  // (docs/moe.md); empty for a dense model.
  std::vector<std::vector<int64_t>> expert_tokens;
  // With --cluster: the EMULATED cluster's step time (virtual clocks) and each
  // rank's virtual compute seconds in the step; 0 / empty otherwise.
  std::vector<int64_t> peak_memory_bytes;  // per rank: peak bytes of tensors in the step
  // per rank: the micro-batches' peak above what the rank held before them
  // (activations, kept for the backward or recomputed, and raw gradients)
  std::vector<int64_t> peak_activation_bytes;
  // per rank: seconds of the gradient synchronization after the schedule
  // (the rank's streams drained first), communication nothing overlaps: the
  // exposed part of the step's gradient reduction (with --overlap, what the
  // communication thread had left when the schedule ended). 0 in bucketed
  // token-budget steps, which synchronize per bucket (not measured).
  std::vector<double> grad_sync_s;
  // per rank: gradients whose synchronization was handed to the
  // communication thread during the last backward (--overlap; 0 without).
  std::vector<int64_t> grad_sync_overlapped;
  // per rank: its CUDA MPS share of the GPU's SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
  // --mps-percent); empty when no rank has one.
  std::vector<int64_t> sm_percent;
  // per rank: attention calls so far (bf16 products, CUDA) that cuDNN's
  // fused attention did not take and hspmd's own, much slower kernels ran
  // (kernels::fused_attention_report); written only when a rank has one.
  std::vector<int64_t> attention_fallbacks;
  // Token-budget steps: pieces in the step, real tokens per pipeline, and
  // the cost model's prediction of the dispatch's slowest pipeline.
  int64_t pieces = 0;
  std::vector<int64_t> pipeline_tokens;
  double predicted_step_s = 0.0;
  int strategy = -1;  // --strategies: the index of the step's strategy
  // Seconds the training thread spent on the step's selection and dispatch
  // (prepared on a background thread during the step before: ~0 when hidden).
  double dispatch_s = 0.0;
  // Seconds from the step's start until the host had queued all of its work
  // (the update included) and first waited for the device: set when a
  // single-process step read nothing back before its end (the loss and the
  // gradient norm after the update is queued; docs/cuda.md), else 0. On an
  // asynchronous device, how far ahead of the device the host ran.
  double queued_s = 0.0;
  // --cuda-graphs: "captured" (the step recorded its CUDA graph, then ran it),
  // "replayed" (it ran the graph recorded before), "eager" (it ran op by
  // op); empty without the flag.
  std::string cuda_graph;
  double emulated_step_time_s = 0.0;
  std::vector<double> emulated_compute_s;
};

// Single-process training: a world of one. Validates the single-process
// flags (--global-batch, --micro-batches), then runs train_distributed on the
// single-process communicator under a strategy of one rank (one pipeline of
// one stage; micro-batches of global_batch / micro_batches samples). Returns
// one record per step. Throws hspmd::Error (one line, naming the object and
// the rule) on any bad input, before the first step; nothing is written then:
// this includes non-finite float options, non-finite initial weights, and
// outputs (--save, --log, --trace, --checkpoint, --dump-grads) that cannot be
// created or that a rename would put over a device, FIFO or directory. Also
// throws during the run, naming the step, for a non-finite loss or gradient
// norm (beyond skip_nonfinite_steps of them), for non-finite weights about to
// be saved (the file or checkpoint is not written), and for a write error
// on the log or trace (docs/reliability.md).
std::vector<StepRecord> train(const TrainOptions& options);

// A fresh run id: 16 random hex digits.
std::string new_run_id();

// The run id stamped into the committed checkpoint of `dir` (its
// index.json's meta.run_id), "" when it has none (an older checkpoint);
// throws like load_checkpoint_index when the index cannot be read.
std::string checkpoint_run_id(const std::string& dir);

// Who writes a committed checkpoint into a directory, for
// check_checkpoint_owner.
struct CheckpointWriter {
  // Names the writer in the error: "[flags] --checkpoint",
  // "[train] save_checkpoint".
  std::string what;
  // Replacing another run's checkpoint was asked for (--overwrite-checkpoint).
  bool overwrite = false;
  // The checkpoint the run continues ("": none): writing over it is allowed
  // ...
  std::string resume_dir;
  // ... while it still holds the run id read at the resume (nullopt: before
  // the resume has read it, any).
  std::optional<std::string> resume_run_id;
  // The writing run's id (nullopt: before it has one): the checkpoints it
  // committed itself are its own.
  std::optional<std::string> run_id;
  // What the error suggests, after "; ".
  std::string fix;
};

// The one rule that keeps a run from destroying another run's checkpoint,
// which every writer of a committed checkpoint goes through (the options'
// check below, the periodic --checkpoint saves, TrainingRun::save_checkpoint):
// throws hspmd::Error "<what> DIR: holds the committed checkpoint of step K
// of another run; <fix>" when `dir` holds a committed checkpoint (an
// unreadable index counts as another run's) unless the writer overwrites,
// `dir` is the checkpoint it resumed (by inode), or the checkpoint carries
// the writer's run id. An empty `dir` is accepted.
void check_checkpoint_owner(const std::string& dir, const CheckpointWriter& writer);

// The rule for the options: check_checkpoint_owner for
// options.checkpoint_dir, which throws hspmd::Error "[flags] --checkpoint
// DIR: holds the committed checkpoint of step K of another run; give
// --resume DIR to continue it, --overwrite-checkpoint to replace it, or
// another directory" unless options.resume_dir is that same directory (by
// inode) or options.overwrite_checkpoint is set.
void check_checkpoint_directory(const TrainOptions& options);

// The model's rule for the sequence: seq_len (with token budgets the
// longest piece) in [1, max_position_embeddings of `config`]. Every run's
// setup checks it (one process before its strategy is built).
void check_sequence_length(const TrainOptions& options, const ModelConfig& config);

// The rule that no output of a run is one of its inputs or another output
// (docs/reliability.md): check_outputs_apart over the options' inputs
// (model, data, init, strategy, plan, cluster, profile, events, switches,
// strategies) and outputs (save, dump_grads, log, trace, op_times), named by
// their flags: "[flags] --log d.bin: is the same file as --data d.bin;
// writing it would destroy that input". Every way in goes through it: the
// setup of every run (train(), train_distributed, TrainingRun: the command
// line and the Python Trainer) and the command line before it starts ranks.
void check_run_files_apart(const TrainOptions& options);

class Communicator;
struct AnnotationPlan;

// A setup error of distributed training, known to every rank; `reporter` is
// true on the one rank that should print it (the lowest failing rank).
class SetupFailure : public Error {
 public:
  SetupFailure(const std::string& what, bool reporter) : Error(what), reporter_(reporter) {}
  bool reporter() const { return reporter_; }

 private:
  bool reporter_;
};

// Distributed training under a strategy (options.strategy_path) on the ranks
// of `world`: compiles the annotation plan for world.size() ranks, builds this
// rank's ExecGraph, feeds each pipeline its own samples of the global batch,
// syncs gradients by the plan's Reshards, runs AdamW on the rank's own shards
// (ZeRO-1: on the optimizer-state shards, then gathers the parameters), and
// reports the global loss. Every rank returns the same records; rank 0 writes
// the log and the saved weights (full tensors, gathered through Reshards).
// Throws hspmd::Error before the first step for a bad strategy, a world size
// that does not fit it, or a --global-batch other than the strategy's; with
// model_clock, for a missing cluster_path or profile_path or a profile made
// for other model dimensions.
// With switches, the run changes plans at the given steps without a
// restart: it specializes the next plan's ExecGraph and moves the training
// state to it (TrainingState::reshard_to), and logs one
// {"event": "switch", ...} record per switch. With --checkpoint and
// --save-every, every rank writes its shards of the training state; with
// --resume, the state is loaded under the run's plan (any plan and world).
std::vector<StepRecord> train_distributed(const TrainOptions& options, Communicator& world);

// The options train() runs train_distributed with: the single-process flags
// checked, and the strategy of one rank (one pipeline of one stage,
// micro-batches of global_batch / micro_batches samples) set. Throws
// hspmd::Error as train() does for bad flags.
TrainOptions single_process_options(const TrainOptions& options);

// One step's record as the JSON object the --log file gets per step (without
// its "unix_time" stamp), as text.
std::string step_record_json(const StepRecord& record);

namespace dist {
class DistTrainer;
}

// train_distributed in parts, driven one step at a time (the Python API's
// Trainer): train_distributed(o, w) is exactly
//   TrainingRun run(o, w); while (!run.done()) run.step(); return run.finish();
// Every member is collective: all ranks of `world` call it in the same order.
class TrainingRun {
 public:
  // The setup of train_distributed: threads, plan, data, initial weights or
  // options.resume_dir's checkpoint, the log opened. `world` must outlive the
  // run. Throws SetupFailure (on every rank) for any setup error, and
  // hspmd::Error when the log cannot be opened.
  TrainingRun(const TrainOptions& options, Communicator& world);
  ~TrainingRun();
  TrainingRun(const TrainingRun&) = delete;
  TrainingRun& operator=(const TrainingRun&) = delete;

  // Whether every step up to options.steps has been trained.
  bool done() const;
  // The step the next step() trains (the resumed step at first).
  int64_t next_step() const;
  // Trains the next step (after the switches or elastic events due before
  // it), logs its record (rank 0) and returns it. Throws hspmd::Error as
  // train_distributed does during a run, and when done() or finished().
  StepRecord step();
  // Waits for the last checkpoint and writes options.save_path and the
  // trace; returns every step's record. Once: the run is finished() after
  // it (even when it throws), and step(), switch_to(), load_parameters()
  // and finish() throw hspmd::Error then (what finish wrote stays the
  // run's result); parameters() and save_checkpoint() still read it.
  std::vector<StepRecord> finish();
  bool finished() const { return finished_; }
  // Commits the pending background checkpoint (--save-every), waiting for
  // its writers; throws hspmd::Error for a write error (the pending
  // checkpoint is dropped, the run goes on).
  void wait_for_checkpoint();
  // The weights as full f32 tensors with Hugging Face names (the masters
  // under mixed precision), the same on every rank.
  std::map<std::string, NDArray> parameters();
  // Writes the training state now as a committed checkpoint in `dir`
  // (docs/checkpoint.md), waiting for the disk; a run with resume_dir = dir
  // continues from it. Throws hspmd::Error for non-finite weights or a write
  // error.
  void save_checkpoint(const std::string& dir);
  // What switch_to moves the run to: a strategy (compiled for the run), a
  // compiled plan, or else the strategy or plan file `source`; `source`
  // names it in errors.
  struct SwitchTarget {
    std::optional<Strategy> strategy;
    std::shared_ptr<const AnnotationPlan> plan;
    std::string source;
  };
  // Moves the run to `target` before the next step, as --switch STEP:FILE
  // at that step does (the --switch-algorithm, the {"event": "switch"} log
  // record); the same global batch. Throws SetupFailure on every rank for a
  // bad target (the run goes on under its plan), or in a run with --switch,
  // --events or --strategies.
  void switch_to(const SwitchTarget& target);
  // Replaces the weights with `weights` (full tensors, Hugging Face names,
  // every rank the same; checked as --init's are, errors naming `source`):
  // each rank keeps its slices. The Adam moments restart at zero; the step
  // count (schedule, bias correction) and the data cursor continue. Before
  // the first step this is the run --init with these weights would be.
  // Throws SetupFailure on every rank for bad weights (nothing changed).
  void load_parameters(std::map<std::string, NDArray> weights, const std::string& source);

 private:
  // Throws "[train] <call>: the run has finished ..." once finished_.
  void check_not_finished(const char* call) const;

  TrainOptions options_;  // the trainer keeps a reference to it
  std::unique_ptr<dist::DistTrainer> trainer_;
  bool finished_ = false;
};

}  // namespace hspmd
