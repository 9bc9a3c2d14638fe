// Each subsystem's options table and validate()
// (hspmd/options/subsystem_options.h).
#include "hspmd/options/subsystem_options.h"

#include <cmath>
#include <sstream>
#include <utility>

#include "hspmd/core/error.h"
#include "kernels/basic.h"

namespace hspmd {

namespace {

template <typename S>
using Setter = std::function<void(S&, const OptionValue&)>;

template <typename S>
Setter<S> text(std::string S::*member) {
  return [member](S& o, const OptionValue& v) { o.*member = option_string(v); };
}
template <typename S>
Setter<S> integer(int64_t S::*member) {
  return [member](S& o, const OptionValue& v) { o.*member = option_int(v); };
}
template <typename S>
Setter<S> number(double S::*member) {
  return [member](S& o, const OptionValue& v) { o.*member = option_double(v); };
}
template <typename S>
Setter<S> flag(bool S::*member) {
  return [member](S& o, const OptionValue& v) { o.*member = option_bool(v); };
}
template <typename S, typename Part, typename Field>
Setter<S> part(Part S::*p, Field Part::*f) {
  return [p, f](S& o, const OptionValue& v) {
    if constexpr (std::is_same_v<Field, double>) o.*p.*f = option_double(v);
    else o.*p.*f = option_int(v);
  };
}

void require_finite(const char* field, double v) {
  if (!std::isfinite(v)) fail_option(field, " must be a finite number, got ", v);
}

}  // namespace

// ---- Tables ----

std::vector<OptionSpec<DataOptions>> data_option_table() {
  using O = DataOptions;
  std::vector<OptionSpec<O>> t;
  t.push_back({"model", OptionType::kString, "Hugging Face config.json of the model", text(&O::model_path), true});
  t.push_back({"data", OptionType::kString, "token file (.bin, little-endian uint32 ids)", text(&O::data_path), true});
  t.push_back({"seq_len", OptionType::kInt,
               "tokens per sample (with pack_documents: at most); required without batch_tokens", integer(&O::seq_len)});
  t.push_back({"batch_tokens", OptionType::kInt,
               "token-budget steps: each step takes the next document pieces while their tokens stay within this "
               "(docs/mixed_length.md)",
               integer(&O::batch_tokens)});
  t.push_back({"pack_documents", OptionType::kBool,
               "pack whole documents (cut at eos) into samples; attention and loss stay inside each document",
               flag(&O::pack_documents)});
  t.push_back({"global_batch", OptionType::kInt,
               "samples per optimizer step (required without a strategy; with one, must match)",
               integer(&O::global_batch)});
  t.push_back({"steps", OptionType::kInt, "optimizer steps", integer(&O::steps), true});
  t.push_back({"micro_batches", OptionType::kInt, "gradient accumulation steps per optimizer step (default 1)",
               integer(&O::micro_batches)});
  return t;
}

std::vector<OptionSpec<OptimizerOptions>> optimizer_option_table() {
  using O = OptimizerOptions;
  std::vector<OptionSpec<O>> t;
  t.push_back({"optimizer", OptionType::kString, "adamw (default) or adam (L2 weight decay)",
               [](O& o, const OptionValue& v) {
                 const std::string& name = option_string(v);
                 if (name != "adamw" && name != "adam")
                   fail_option("optimizer", ": unknown optimizer '", name, "' (expected adamw or adam)");
                 o.adam.decoupled_weight_decay = name == "adamw";
               }});
  t.push_back({"lr", OptionType::kDouble, "peak learning rate (default 3e-4)", part(&O::schedule, &LrSchedule::lr)});
  t.push_back({"min_lr", OptionType::kDouble, "final learning rate of the cosine schedule (default 0)",
               part(&O::schedule, &LrSchedule::min_lr)});
  t.push_back({"lr_schedule", OptionType::kString, "constant (default), warmup or cosine",
               [](O& o, const OptionValue& v) { o.schedule.kind = LrSchedule::parse_kind(option_string(v)); }});
  t.push_back({"warmup_steps", OptionType::kInt, "linear warmup steps (default 0)",
               part(&O::schedule, &LrSchedule::warmup_steps)});
  t.push_back({"weight_decay", OptionType::kDouble, "weight decay of matrices (default 0)",
               part(&O::adam, &AdamConfig::weight_decay)});
  t.push_back({"beta1", OptionType::kDouble, "Adam beta1 (default 0.9)", part(&O::adam, &AdamConfig::beta1)});
  t.push_back({"beta2", OptionType::kDouble, "Adam beta2 (default 0.95)", part(&O::adam, &AdamConfig::beta2)});
  t.push_back({"eps", OptionType::kDouble, "Adam epsilon (default 1e-8)", part(&O::adam, &AdamConfig::eps)});
  t.push_back({"clip_grad", OptionType::kDouble, "global gradient-norm clipping, 0 = off (default)",
               number(&O::clip_grad)});
  t.push_back({"skip_nonfinite_steps", OptionType::kInt,
               "skip up to N steps whose loss or gradient norm is not finite (no update), then stop (default 0: "
               "stop at the first)",
               integer(&O::skip_nonfinite_steps)});
  t.push_back({"seed", OptionType::kInt, "seed of the initialization (default 0)", [](O& o, const OptionValue& v) {
                 const int64_t seed = option_int(v);
                 if (seed < 0) fail_option("seed", " must be >= 0, got ", seed);
                 o.seed = static_cast<uint64_t>(seed);
               }});
  return t;
}

std::vector<OptionSpec<OutputOptions>> output_option_table() {
  using O = OutputOptions;
  std::vector<OptionSpec<O>> t;
  t.push_back({"init", OptionType::kString, "initial weights (safetensors, F32 or BF16)", text(&O::init_path)});
  t.push_back({"save", OptionType::kString, "write the final weights here (safetensors)", text(&O::save_path)});
  t.push_back({"save_dtype", OptionType::kString, "f32 (default) or bf16", [](O& o, const OptionValue& v) {
                 const std::string& name = option_string(v);
                 if (name != "f32" && name != "bf16") fail_option("save_dtype", ": '", name, "' (expected f32 or bf16)");
                 o.save_dtype = name == "bf16" ? DType::BF16 : DType::F32;
               }});
  t.push_back({"precision", OptionType::kString,
               "fp32 (default), bf16 (bf16 GEMMs with fp32 accumulation, fp32 master weights; docs/precision.md) or "
               "auto (bf16 where this CPU has bf16 GEMM instructions, else fp32)",
               [](O& o, const OptionValue& v) {
                 std::string name = option_string(v);
                 if (name == "auto") name = kernels::bf16_gemm_native() ? "bf16" : "fp32";
                 o.precision.compute = parse_precision_name(name, option_name("precision"));
               }});
  t.push_back({"grad_reduce_dtype", OptionType::kString, "with precision bf16: fp32 (default) or bf16 gradient sync",
               [](O& o, const OptionValue& v) {
                 o.precision.grad_reduce = parse_precision_name(option_string(v), option_name("grad_reduce_dtype"));
               }});
  t.push_back({"log", OptionType::kString, "write one JSON object per step here (JSONL)", text(&O::log_path)});
  t.push_back({"dump_grads", OptionType::kString, "write the step-0 gradients here (safetensors)",
               text(&O::dump_grads_path)});
  t.push_back({"op_times", OptionType::kString,
               "write where the last step's time goes here (JSON: ops summed by type; FILE.rank<r> per rank)",
               text(&O::op_times_path)});
  t.push_back({"threads", OptionType::kInt, "CPU threads (default: the cores, shared by a node's ranks)",
               [](O& o, const OptionValue& v) { o.threads = static_cast<int>(option_int(v)); }, false, kIntRange});
  return t;
}

std::vector<OptionSpec<ParallelOptions>> parallel_option_table() {
  using O = ParallelOptions;
  std::vector<OptionSpec<O>> t;
  t.push_back({"strategy", OptionType::kString, "parallel strategy JSON (docs/strategy.md): train on the MPI ranks",
               text(&O::strategy_path)});
  t.push_back({"cluster", OptionType::kString, "cluster JSON (docs/cluster.md) for the resolver's topology",
               text(&O::cluster_path)});
  t.push_back({"trace", OptionType::kString, "write the emulated cluster's timeline here (Chrome trace JSON)",
               text(&O::trace_path)});
  t.push_back({"clock", OptionType::kString,
               "emulated compute time: cpu (measured CPU time, default) or model (predicted from the profile: "
               "deterministic, independent of the machine's load)",
               [](O& o, const OptionValue& v) {
                 const std::string& name = option_string(v);
                 if (name != "cpu" && name != "model") fail_option("clock", ": '", name, "' (expected cpu or model)");
                 o.model_clock = name == "model";
               }});
  t.push_back({"profile", OptionType::kString, "profile JSON made by `hspmd profile` (with clock model)",
               text(&O::profile_path)});
  t.push_back({"plan", OptionType::kString, "annotation plan JSON to train (docs/plan.md), instead of a strategy",
               text(&O::plan_path)});
  t.push_back({"cuda_graphs", OptionType::kBool,
               "on a CUDA device: capture the training step in a CUDA graph after two warm-up steps and replay it "
               "(one process, fixed-size batches; otherwise a note says why the steps run uncaptured; docs/cuda.md)",
               flag(&O::cuda_graphs)});
  return t;
}

std::vector<OptionSpec<SwitchingOptions>> switching_option_table() {
  using O = SwitchingOptions;
  std::vector<OptionSpec<O>> t;
  t.push_back({"bucket_switching", OptionType::kBool,
               "with strategies: each step's pieces in buckets by the smallest strategy that accepts them, run "
               "bucket by bucket, switching inside the step (the HotSPa-like baseline, docs/mixed_length.md)",
               flag(&O::bucket_switching)});
  t.push_back({"dispatch", OptionType::kString,
               "with batch_tokens: how a step's pieces go to the pipelines: cost (the cost model, device speeds "
               "included; default) or symmetric (blind to device speeds, as homogeneous SPMD data parallelism)",
               [](O& o, const OptionValue& v) {
                 o.symmetric_dispatch = parse_dispatch_rule(option_string(v)) == DispatchRule::kSymmetric;
               }});
  t.push_back({"strategies", OptionType::kString,
               "A.json,B.json,...: with batch_tokens, per step the strategy the cost model favours for its pieces, "
               "switched to online (docs/mixed_length.md); instead of a strategy",
               [](O& o, const OptionValue& v) {
                 const std::string& list = option_string(v);
                 o.strategy_choices.clear();
                 std::stringstream ss(list);
                 for (std::string item; std::getline(ss, item, ',');) {
                   if (item.empty()) fail_option("strategies", " '", list, "': an empty file name");
                   o.strategy_choices.push_back(item);
                 }
                 if (o.strategy_choices.empty()) fail_option("strategies", " needs at least one file");
               }});
  t.push_back({"switch_algorithm", OptionType::kString, "naive, per-tensor or fused (default)",
               text(&O::switch_algorithm)});
  t.push_back({"switch_bucket_mb", OptionType::kDouble,
               "fused switches: MiB of state tensors (full logical size) per round, at least one layer group "
               "(default 256; 0: everything in one round)",
               number(&O::switch_bucket_mb)});
  t.push_back({"replace_experts", OptionType::kBool,
               "expert parallelism: after each step, re-place the experts from its routing (replicas for the hot "
               "ones) and switch to that placement when the expected gain beats the switch's cost (docs/moe.md)",
               flag(&O::replace_experts)});
  return t;
}

std::vector<OptionSpec<ElasticOptions>> elastic_option_table() {
  using O = ElasticOptions;
  std::vector<OptionSpec<O>> t;
  t.push_back({"events", OptionType::kString,
               "elastic training: JSON list of {\"step\", \"fail\"|\"join\": [ranks], \"slowdown\": {rank: x}, "
               "\"strategy\"?}; the run re-plans and switches online (docs/elastic.md)",
               text(&O::events_path)});
  t.push_back({"replan_time_limit", OptionType::kDouble, "with events: seconds the planner may search (default 30)",
               number(&O::replan_time_limit_s)});
  t.push_back({"straggler_window", OptionType::kInt,
               "with events and a cluster: steps per straggler check (default 3; 0 = no straggler re-planning)",
               integer(&O::straggler_window)});
  t.push_back({"straggler_threshold", OptionType::kDouble,
               "a rank whose compute is off its assumed speed by more than this fraction is a straggler (default "
               "0.25)",
               number(&O::straggler_threshold)});
  t.push_back({"straggler_horizon", OptionType::kInt,
               "steps over which a straggler re-plan's gain must exceed the switch's cost (default 100)",
               integer(&O::straggler_horizon)});
  t.push_back({"heartbeat_timeout", OptionType::kDouble,
               "ranks on several hosts: a host that sends no heartbeat for this many seconds ends the job, naming it "
               "(default 10; 0 = off; docs/multi_host.md)",
               number(&O::heartbeat_timeout_s)});
  t.push_back({"heartbeat_max_loss", OptionType::kDouble,
               "ranks on several hosts: a host whose heartbeats are lost at more than this fraction over the "
               "heartbeat timeout (a lossy link) ends the job, naming it (default 0.2)",
               number(&O::heartbeat_max_loss)});
  return t;
}

std::vector<OptionSpec<CheckpointOptions>> checkpoint_option_table() {
  using O = CheckpointOptions;
  std::vector<OptionSpec<O>> t;
  t.push_back({"checkpoint", OptionType::kString,
               "directory of sharded training checkpoints (docs/checkpoint.md); without save_every, one after the "
               "last step",
               text(&O::checkpoint_dir)});
  t.push_back({"save_every", OptionType::kInt, "write a training checkpoint after every N steps (with checkpoint)",
               integer(&O::save_every)});
  t.push_back({"checkpoint_sync", OptionType::kBool,
               "write checkpoints inside the step (default: copy the shards, write them on a background thread)",
               flag(&O::checkpoint_sync)});
  t.push_back({"resume", OptionType::kString, "continue from the training checkpoint in this directory",
               text(&O::resume_dir)});
  t.push_back({"overwrite_checkpoint", OptionType::kBool,
               "with checkpoint: start anew in a directory that holds another run's checkpoint, replacing it at the "
               "first save (without it such a directory is refused unless resume names it)",
               flag(&O::overwrite_checkpoint)});
  return t;
}

// ---- Rules ----

// A step is global_batch samples of seq_len tokens, or a budget of
// batch_tokens tokens in pieces of at most seq_len.
void validate(const DataOptions& o, const GivenOptions& given) {
  const auto gave = [&](const char* name) { return given.count(name) > 0; };
  if (o.steps <= 0) fail_option("steps", " must be positive, got ", o.steps);
  if (gave("batch_tokens") && o.batch_tokens <= 0)
    fail_option("batch_tokens", " must be positive, got ", o.batch_tokens);
  if (o.batch_tokens > 0) {
    if (gave("global_batch"))
      fail_option("global_batch", " is not read with ", option_name("batch_tokens"), " (steps are token budgets)");
    if (gave("micro_batches")) fail_option("micro_batches", " is not read with ", option_name("batch_tokens"));
    if (o.pack_documents)
      fail_option("pack_documents", " does not go with ", option_name("batch_tokens"),
                  " (token-budget steps cut documents into pieces themselves)");
  }
  if (gave("global_batch") && o.global_batch <= 0)
    fail_option("global_batch", " must be positive, got ", o.global_batch);
}

void validate(const OptimizerOptions& o, const GivenOptions&) {
  const std::pair<const char*, double> values[] = {
      {"lr", o.schedule.lr}, {"min_lr", o.schedule.min_lr}, {"weight_decay", o.adam.weight_decay},
      {"beta1", o.adam.beta1}, {"beta2", o.adam.beta2},    {"eps", o.adam.eps},
      {"clip_grad", o.clip_grad}};
  for (const auto& [field, v] : values) require_finite(field, v);
  for (const auto& [field, beta] : {std::pair{"beta1", o.adam.beta1}, std::pair{"beta2", o.adam.beta2}})
    if (!(beta >= 0 && beta < 1)) fail_option(field, " must lie in [0, 1), got ", beta);
  o.schedule.check_rates(option_name("lr"), option_name("min_lr"));
  if (o.schedule.warmup_steps < 0) fail_option("warmup_steps", " must be >= 0, got ", o.schedule.warmup_steps);
  if (o.clip_grad < 0) fail_option("clip_grad", " must be >= 0, got ", o.clip_grad);
  if (o.skip_nonfinite_steps < 0) fail_option("skip_nonfinite_steps", " must be >= 0, got ", o.skip_nonfinite_steps);
}

void validate(const OutputOptions& o, const GivenOptions&) {
  if (o.threads < 1 || o.threads > kMaxThreads)
    fail_option("threads", " must lie in [1, ", kMaxThreads, "], got ", o.threads);
  if (o.precision.grad_reduce == DType::BF16 && !o.precision.mixed())
    fail_option("grad_reduce_dtype", " bf16 needs ", option_name("precision"), " bf16");
}

// Emulation: a virtual clock per rank with a cluster or a trace; the model
// clock reads a profile.
void validate(const ParallelOptions& o, const GivenOptions&) {
  const bool emulated = !o.cluster_path.empty() || !o.trace_path.empty();
  if (o.overlap.value_or(false) && emulated)
    fail_option("overlap", " with ", option_name(o.cluster_path.empty() ? "trace" : "cluster"),
                ": the emulated clock bills one thread per rank (no communication thread); drop ",
                option_name("overlap"));
  if (o.model_clock) {
    if (o.cluster_path.empty())
      fail_option("clock", " model needs ", option_name("cluster"), " (it times an emulated cluster)");
    if (o.profile_path.empty())
      fail_option("clock", " model needs ", option_name("profile"), " P.json (made by hspmd profile)");
  }
}

void validate(const SwitchingOptions& o, const GivenOptions&) {
  require_finite("switch_bucket_mb", o.switch_bucket_mb);
  if (!o.strategy_choices.empty() && !o.switches.empty())
    fail_option("strategies", " does not go with ", option_name("switch"));
  if (o.bucket_switching && o.strategy_choices.empty())
    fail_option("bucket_switching", " needs ", option_name("strategies"), " (one strategy per length bucket)");
  if (o.replace_experts && (!o.switches.empty() || !o.strategy_choices.empty()))
    fail_option("replace_experts", " does not go with ", option_name(o.switches.empty() ? "strategies" : "switch"),
                " (both choose the run's plans)");
}

// The heartbeat's settings always; the straggler watch's only with events.
void validate(const ElasticOptions& o, const GivenOptions&) {
  if (!(o.heartbeat_timeout_s >= 0 && o.heartbeat_timeout_s <= 3600))
    fail_option("heartbeat_timeout", " must be seconds in [0, 3600] (0: off), got ", o.heartbeat_timeout_s);
  if (!(o.heartbeat_max_loss > 0 && o.heartbeat_max_loss < 1))
    fail_option("heartbeat_max_loss", " must lie in (0, 1), got ", o.heartbeat_max_loss);
  if (o.events_path.empty()) return;
  if (o.straggler_window < 0) fail_option("straggler_window", " must be >= 0, got ", o.straggler_window);
  if (!(o.straggler_threshold > 0)) fail_option("straggler_threshold", " must be > 0, got ", o.straggler_threshold);
  if (o.straggler_horizon < 1) fail_option("straggler_horizon", " must be >= 1, got ", o.straggler_horizon);
  if (!(o.replan_time_limit_s > 0)) fail_option("replan_time_limit", " must be > 0, got ", o.replan_time_limit_s);
}

void validate(const CheckpointOptions& o, const GivenOptions& given) {
  if (o.save_every < 0) fail_option("save_every", " must be >= 0, got ", o.save_every);
  if (o.save_every > 0 && o.checkpoint_dir.empty())
    fail_option("save_every", " needs ", option_name("checkpoint"), " DIR");
  if (given.count("overwrite_checkpoint") && o.overwrite_checkpoint && o.checkpoint_dir.empty())
    fail_option("overwrite_checkpoint", " needs ", option_name("checkpoint"), " DIR");
}

}  // namespace hspmd
