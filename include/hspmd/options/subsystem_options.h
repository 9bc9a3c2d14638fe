// The training options of one subsystem each: the model and data, the
// optimizer, outputs and precision, the parallel layout and its emulation,
// strategy switching, elastic training, checkpoints. Each struct has one
// table (a row per option: its field name, type, help line with the default,
// and the setter that writes the member; the member's initializer is the
// default) and one validate() of the rules that read nothing but that
// struct, whose errors name the field (fail_option: "[flags] --seq-len ..."
// on the command line, "[options] seq_len ..." from Python). TrainOptions
// (hspmd/options/train_options.h) is all of them together, its table their
// tables in this order and its validate() theirs plus the rules between
// subsystems. docs/training.md, "Options".
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hspmd/core/device.h"
#include "hspmd/core/dtype.h"
#include "hspmd/core/options.h"
#include "hspmd/ops/precision.h"
#include "hspmd/optim/adam.h"
#include "hspmd/optim/lr_schedule.h"
#include "hspmd/plan/strategy.h"

namespace hspmd {

// The most threads a rank (and ranks a machine's launcher) may take: far
// beyond any core count (100000 crashed libgomp).
inline constexpr int64_t kMaxThreads = 1024;

// The model, the data and the size of a step.
struct DataOptions {
  std::string model_path;  // Hugging Face config.json
  std::string data_path;   // token file (.bin)
  int64_t seq_len = 0;
  // Token-budget steps (docs/mixed_length.md): when batch_tokens > 0, each
  // step takes the next document pieces (at most seq_len tokens each) while
  // their tokens stay within batch_tokens, and dispatches them over the
  // strategy's pipelines; global_batch is not read.
  int64_t batch_tokens = 0;
  bool pack_documents = false;  // packed-documents samples (docs/data.md)
  int64_t global_batch = 0;
  int64_t micro_batches = 1;  // gradient accumulation: must divide global_batch
  int64_t steps = 0;
};

// The optimizer, its learning-rate schedule and what a step does with its
// gradients.
struct OptimizerOptions {
  AdamConfig adam;
  LrSchedule schedule;     // total_steps is set from `steps`
  double clip_grad = 0.0;  // 0 = off
  // Steps with a non-finite loss or gradient norm that are skipped (no
  // update of weights or moments; the batch is consumed) before the run
  // stops with an error; 0: the first one stops it.
  int64_t skip_nonfinite_steps = 0;
  uint64_t seed = 0;
};

// Weights in and out, precision, logs and threads.
struct OutputOptions {
  std::string init_path;        // optional safetensors with initial weights
  std::string save_path;        // optional safetensors written at the end
  DType save_dtype = DType::F32;
  Precision precision;          // precision, grad_reduce_dtype (docs/precision.md)
  std::string log_path;         // optional JSONL, one object per step
  std::string dump_grads_path;  // optional safetensors of the step-0 gradients
  std::string op_times_path;    // optional JSON: the last step's op times by type (docs/profiling.md)
  int threads = 1;
  bool progress = true;  // progress line on stderr
};

// Where the ranks run: the strategy or plan, the device, the emulated
// cluster and its clock.
struct ParallelOptions {
  std::string strategy_path;         // strategy JSON (train_distributed)
  std::optional<Strategy> strategy;  // a strategy given as a value (instead of strategy_path)
  std::string plan_path;             // an annotation plan JSON to train (instead of a strategy)
  std::string cluster_path;          // optional cluster JSON (emulated cluster)
  std::string trace_path;            // Chrome-trace timeline of the emulated cluster
  // Emulation (with cluster_path): what a rank's compute bills to its virtual
  // clock — its CPU time (false, clock cpu) or the per-op predictions of
  // the profile at profile_path (true, clock model; docs/profiling.md).
  bool model_clock = false;
  std::string profile_path;
  // Where the ranks' graphs and training states live. CUDA so far only for
  // one process without a cluster, events, switches or token budgets
  // (docs/cuda.md); the front end refuses the rest in one line.
  Device device = Device::cpu();
  // Overlap the gradient synchronization with the last micro-batch's
  // backward (docs/comm.md): a communication thread over a duplicate world.
  // Unset: on for a device other than the CPU (where communication and
  // compute use different engines), off on the CPU (whose cores compute).
  // Never under an emulated clock.
  std::optional<bool> overlap;
  // Capture the steady-state step in a CUDA graph and replay it (docs/
  // cuda.md, "CUDA graphs"): one process on a GPU with fixed-size batches;
  // elsewhere the steps run uncaptured and the first step's note says why.
  bool cuda_graphs = false;
};

// Strategies that change during a run: chosen per step, by length bucket, or
// switched to at given steps (docs/switching.md, docs/mixed_length.md).
struct SwitchingOptions {
  // With batch_tokens and several strategies (strategies; the run's
  // ParallelOptions::strategy_path is the first): per step the one the cost
  // model favours.
  std::vector<std::string> strategy_choices;
  // ... or the HotSPa-like baseline: every step's pieces in buckets by the
  // smallest strategy that accepts them, trained bucket by bucket, each on
  // its own strategy, switching inside the step (gradients accumulate).
  bool bucket_switching = false;
  // dispatch symmetric: a step's pieces go to the pipelines blind to device
  // speeds, packed micro-batches to the pipeline with the fewest tokens
  // (SPMD data parallelism, the baselines' rule); false: by the cost model
  // (planner/token_dispatch.h, DispatchRule).
  bool symmetric_dispatch = false;
  // Plan switches: from step `step` on, train under `path` (a strategy or an
  // annotation plan); ascending steps.
  struct Switch {
    int64_t step = 0;
    std::string path;
    std::vector<int> lost_ranks;  // ranks whose memory counts as gone at this switch
  };
  std::vector<Switch> switches;
  std::string switch_algorithm = "fused";  // naive, per-tensor or fused
  double switch_bucket_mb = 256;           // fused: MiB of state tensors per round (0: all in one round)
  // Expert parallelism (docs/moe.md, "Re-placing experts online"): after
  // each step, place the experts anew from its routing and switch to that
  // placement when the expected gain over the remaining steps beats the
  // switch's predicted cost.
  bool replace_experts = false;
};

// Elastic training (docs/elastic.md): devices that fail, join or slow down
// before given steps (include/hspmd/train/events.h); the run re-plans (or
// takes the event's strategy) and switches online.
struct ElasticOptions {
  std::string events_path;
  double replan_time_limit_s = 30;  // the planner's time limit per re-plan
  // Stragglers (with events and an emulated cluster): per-rank compute over
  // a sliding window of this many steps (0: off), a rank off its assumed
  // speed by more than `straggler_threshold` (relative) triggers a re-plan,
  // switched to when the gain over the next `straggler_horizon` steps
  // exceeds the switch's cost.
  int64_t straggler_window = 3;
  double straggler_threshold = 0.25;
  int64_t straggler_horizon = 100;
  // The heartbeat between hosts (docs/multi_host.md, "Heartbeat between
  // hosts"), for a job whose ranks span hosts: a host silent for this many
  // seconds (0: off), or one that lost more than `heartbeat_max_loss` of its
  // datagrams over that long, ends the job naming the host.
  double heartbeat_timeout_s = 10;
  double heartbeat_max_loss = 0.2;
};

// Sharded training checkpoints (docs/checkpoint.md).
struct CheckpointOptions {
  std::string checkpoint_dir;  // sharded training checkpoints are written here ...
  int64_t save_every = 0;      // ... after every this many steps (0: never)
  // Write checkpoints in the step (the state copied, then a background
  // thread writes while the next steps run: false, the default) or wait for
  // the disk (true).
  bool checkpoint_sync = false;
  std::string resume_dir;  // continue from the checkpoint in this directory
  // A checkpoint_dir that already holds a committed checkpoint is refused
  // (check_checkpoint_directory) unless the run resumes that very checkpoint
  // (resume_dir is the same directory) or this is set (overwrite_checkpoint:
  // the old checkpoint is replaced at the run's first commit).
  bool overwrite_checkpoint = false;
  // Stamped into every checkpoint the run commits (meta.run_id): a restart
  // resumes only checkpoints of its own run (docs/reliability.md). "": the
  // environment's HSPMD_RUN_ID (the launcher sets it for its ranks), else a
  // fresh id drawn by rank 0.
  std::string run_id;
};

// Each subsystem's table: its rows in the order of the command line's --help.
std::vector<OptionSpec<DataOptions>> data_option_table();
std::vector<OptionSpec<OptimizerOptions>> optimizer_option_table();
std::vector<OptionSpec<OutputOptions>> output_option_table();
std::vector<OptionSpec<ParallelOptions>> parallel_option_table();
std::vector<OptionSpec<SwitchingOptions>> switching_option_table();
std::vector<OptionSpec<ElasticOptions>> elastic_option_table();
std::vector<OptionSpec<CheckpointOptions>> checkpoint_option_table();

// Each subsystem's rules that read nothing but its own options (ranges,
// values that need or exclude each other). `given`: what the user gave
// (rules about a value given for nothing read it); a run built in code
// passes none. hspmd::Error naming the field (fail_option).
void validate(const DataOptions& o, const GivenOptions& given = {});
void validate(const OptimizerOptions& o, const GivenOptions& given = {});
void validate(const OutputOptions& o, const GivenOptions& given = {});
void validate(const ParallelOptions& o, const GivenOptions& given = {});
void validate(const SwitchingOptions& o, const GivenOptions& given = {});
void validate(const ElasticOptions& o, const GivenOptions& given = {});
void validate(const CheckpointOptions& o, const GivenOptions& given = {});

}  // namespace hspmd
