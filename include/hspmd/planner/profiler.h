// The profiler behind `hspmd profile` (docs/profiling.md): times the parts
// of a model (embedding, one block, head; forward and backward) on one rank
// of a tensor-parallel x context-parallel group with the real executor, and
// fits them into a Profile (planner/profile.h).
//
// What is measured is what the emulator bills to a rank's virtual clock
// for the same work: ExecGraph brackets every op with the clock, so a
// stage's time is the process CPU time spent inside its ops, at the same
// kernel thread count. On a CUDA device the clock's timer is CUDA events on
// the device's default stream (WorkTimer::events): an op's time is the
// device's time from the event before its launches to the event after
// them. One rank of a multi-rank group runs alone in this process on a
// shadow communicator (comm/shadow.h; staged through host memory for a
// device, make_staged_communicator): its compute is real, what it would
// receive is zeros.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hspmd/exec/exec_graph.h"
#include "hspmd/exec/op_work.h"
#include "hspmd/models/config.h"
#include "hspmd/planner/profile.h"

namespace hspmd {

struct ProfileOptions {
  std::string model_path;  // recorded in Profile::model
  ModelConfig config;      // the model's dimensions (its layer count is not used)
  std::vector<int> tp = {1}, cp = {1};
  std::vector<int64_t> seq_lens = {16, 32, 64};
  std::vector<int64_t> micro_batch_sizes = {1, 2};
  int repetitions = 5;  // timed runs per point, after one warm-up; their median counts
  int threads = 1;      // kernel threads (set_num_threads) while measuring
  Precision precision;  // how the model computes (hspmd train --precision)
  // Where the parts run: the CPU (process CPU time) or a CUDA device
  // (parameters, moments and inputs built there; CUDA events). The caller
  // checks it first (require_device).
  Device device = Device::cpu();
  // Progress lines ("tp 2 cp 1 ..."), when set.
  std::function<void(const std::string&)> progress;
};

// Throws hspmd::Error "[profile] <rule>" for options that cannot be
// profiled: an empty list, a non-positive value, tp not dividing the
// attention heads, KV heads or intermediate size, a sequence length that is
// not a multiple of a (tp, cp) pair's granularity (plan/strategy.h
// sequence_granularity) or above max_position_embeddings, repetitions or
// threads below 1.
void check_profile_options(const ProfileOptions& options);

// Measures and fits everything of a Profile: per (tp, cp) the parts over
// every (s, b), the layer memory; the optimizer step; the per-op fits
// (with the kAnyOp fallback). Throws check_profile_options' errors first.
Profile profile_model(const ProfileOptions& options);

// Whether a profile serves `model`: the same hidden size, attention and KV
// heads, intermediate size and vocabulary (the layer count may differ).
// Throws hspmd::Error "[profile] <source>: made for hidden 64, heads 8, kv
// heads 4, intermediate 128, vocab 256, but <model_source> has ..." otherwise.
// Throws hspmd::Error "[profile] ..." unless `profile` was measured in the
// run's precision.
void check_profile_precision(const Profile& profile, const Precision& precision, const std::string& source);
void check_profile_model(const Profile& profile, const ModelConfig& model, const std::string& source,
                         const std::string& model_source);

// One op a stage ran: its node, type, work and the compute seconds billed.
struct OpSample {
  int node = -1;
  std::string type;
  OpWork work;
  double seconds = 0;
};

// One micro-batch of a stage, forward then backward.
struct StageRun {
  double fwd_s = 0, bwd_s = 0;    // compute seconds billed to the rank's clock
  int64_t kept_bytes = 0;         // allocator bytes the forward left for the backward
  int64_t block_grad_bytes = 0;   // raw gradients of the stage's block parameters
  std::vector<OpSample> fwd_ops, bwd_ops;
};

// One rank of stage `stage` of a one-pipeline plan whose stages hold
// `stage_layers[k]` consecutive blocks of `config` (its layer count becomes
// their sum), each stage tp x cp ranks; the rank is the stage's first. Runs
// alone on a shadow communicator with its own virtual clock (slowdown 1):
// CPU mode, or model mode with `model` (then every op bills its predicted
// time and runs are deterministic). Parameters are local shards of
// arbitrary small values, on `device` (whose ops are timed with CUDA events
// in CPU mode, see above). Throws the plan compiler's errors.
class StageProbe {
 public:
  StageProbe(const ModelConfig& config, int tp, int cp, std::vector<int> stage_layers, int stage,
             int64_t max_seq_len, std::shared_ptr<const OpTimeModel> model = nullptr, Precision precision = {},
             Device device = Device::cpu());
  ~StageProbe();
  StageProbe(const StageProbe&) = delete;
  StageProbe& operator=(const StageProbe&) = delete;

  // One micro-batch of b sequences of s tokens (s a multiple of the stage's
  // granularity, at most max_seq_len), with or without recomputation.
  StageRun run(int64_t s, int64_t b, bool recompute = false);

  // Local shapes of the stage's block parameters, and their bytes (f32).
  std::vector<Shape> block_param_shapes() const;
  int64_t block_param_bytes() const;
  int rank() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Per part of kProfileParts, the seconds of one micro-batch from repeated
// runs of the first, a middle and the last stage of a pipeline of one-block
// stages: the block is the middle stage (median over the runs); the
// embedding (head) is what the first (last) stage's ops add to the middle
// stage's, matched by op type and work, each op at its median over the runs.
std::map<std::string, double> split_parts(const std::vector<StageRun>& first, const std::vector<StageRun>& middle,
                                          const std::vector<StageRun>& last);

// Seconds of a stage of `layers` blocks predicted by the parts:
// [first] embed + layers * block + [last] head, forward or backward.
double predict_stage(const std::map<std::string, double>& parts, int layers, bool first, bool last, bool backward);

// Least-squares fit of OpFit over samples of one op type, minimizing
// relative errors with non-negative coefficients (the best of the term
// subsets). Fewer than three distinct works: `fallback` scaled to the
// samples' median ratio.
OpFit fit_op(const std::vector<OpSample>& samples, const OpFit* fallback = nullptr);

}  // namespace hspmd
