// hspmd train: flags -> TrainOptions -> train().
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <memory>
#include <thread>

#include "commands.h"
#include "flags.h"
#include "hspmd/comm/communicator.h"
#include "hspmd/core/error.h"
#include "hspmd/train/trainer.h"

extern char** environ;

namespace hspmd::cli {

namespace {

// Re-runs this command under `mpirun -np N` (without --nproc) and returns its
// exit code: the job fails when any rank fails.
int launch_ranks(int64_t nproc, const std::vector<std::string>& args) {
  if (nproc < 1) fail("[flags] --nproc must be >= 1, got ", nproc);
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) fail("[launch] cannot find the hspmd executable");
  self[n] = '\0';
  std::vector<std::string> argv = {"mpirun", "--quiet", "--allow-run-as-root", "--oversubscribe", "-np",
                                   std::to_string(nproc), self, "train"};
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--nproc") {
      ++i;
      continue;
    }
    if (args[i].rfind("--nproc=", 0) != 0) argv.push_back(args[i]);
  }
  // Ranks failing at once (say two out of memory) report once: the first to
  // create this file prints (claim_report below); the launcher removes it.
  char report[] = "/tmp/hspmd-report-XXXXXX";
  const int fd = mkstemp(report);
  if (fd >= 0) {
    close(fd);
    std::remove(report);
    setenv("HSPMD_REPORT_FILE", report, 1);
  }
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  pid_t pid;
  if (posix_spawnp(&pid, "mpirun", nullptr, nullptr, cargv.data(), environ) != 0)
    fail("[launch] cannot start mpirun (is Open MPI installed?)");
  int status = 0;
  waitpid(pid, &status, 0);
  if (fd >= 0) std::remove(report);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}

// Whether this rank prints its failure: under the launcher, only the first
// failing rank of the job (O_EXCL creation of the job's report file).
bool claim_report() {
  const char* path = std::getenv("HSPMD_REPORT_FILE");
  if (path == nullptr) return true;
  const int fd = open(path, O_CREAT | O_EXCL | O_WRONLY, 0600);
  if (fd < 0) return false;
  close(fd);
  return true;
}

// Distributed training on the MPI world: a failing rank prints its error and
// ends the whole job, never leaving the others waiting.
int train_on_ranks(const TrainOptions& o) {
  std::unique_ptr<Communicator> world = make_world_communicator();
  TrainOptions mine = o;
  if (world->rank() != 0) mine.progress = false;
  try {
    train_distributed(mine, *world);
  } catch (const SetupFailure& e) {
    if (world->size() == 1) throw;
    if (e.reporter()) std::fprintf(stderr, "hspmd: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    if (world->size() == 1) throw;
    if (claim_report()) {
      std::fprintf(stderr, "hspmd: error: rank %d: %s\n", world->rank(), e.what());
      std::fflush(stderr);
    }
    world->abort(1);
  }
  return 0;
}

// "STEP:FILE" switches, and "STEP:R1,R2" lost ranks attached to them.
std::vector<TrainOptions::Switch> parse_switches(const std::vector<std::string>& specs,
                                                 const std::vector<std::string>& lost) {
  auto split = [](const std::string& spec, const char* flag) {
    const size_t colon = spec.find(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == spec.size())
      fail("[flags] --", flag, " '", spec, "': expected STEP:", std::string(flag) == "switch" ? "FILE" : "RANKS");
    return std::pair{parse_int(flag, spec.substr(0, colon)), spec.substr(colon + 1)};
  };
  std::vector<TrainOptions::Switch> out;
  for (const std::string& s : specs) {
    auto [step, path] = split(s, "switch");
    out.push_back({step, path, {}});
  }
  for (const std::string& s : lost) {
    auto [step, ranks] = split(s, "switch-lost");
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& sw) { return sw.step == step; });
    if (it == out.end()) fail("[flags] --switch-lost ", s, ": no --switch at step ", step);
    for (int r : parse_ranks(ranks, 0, "--switch-lost")) it->lost_ranks.push_back(r);
  }
  return out;
}

}  // namespace

int train_command(const std::vector<std::string>& args) {
  TrainOptions o;
  std::string schedule = "constant", save_dtype = "f32", optimizer = "adamw";
  int64_t seed = 0, warmup = 0, threads = std::max(1u, std::thread::hardware_concurrency());
  double lr = 3e-4, min_lr = 0.0;
  bool quiet = false;
  int64_t nproc = 0;
  FlagSet f("train", "Train a Llama model (Hugging Face config and weights) on a token file.");
  f.add_string("model", &o.model_path, "Hugging Face config.json of the model", true);
  f.add_string("data", &o.data_path, "token file (.bin, little-endian uint32 ids)", true);
  f.add_int("seq-len", &o.seq_len, "tokens per sample (with --pack-documents: at most)", true);
  f.add_bool("pack-documents", &o.pack_documents,
             "pack whole documents (cut at eos) into samples; attention and loss stay inside each document");
  f.add_int("global-batch", &o.global_batch,
            "samples per optimizer step (required without --strategy; with it, must match)");
  f.add_int("steps", &o.steps, "optimizer steps", true);
  f.add_int("micro-batches", &o.micro_batches, "gradient accumulation steps per optimizer step (default 1)");
  f.add_string("optimizer", &optimizer, "adamw (default) or adam (L2 weight decay)");
  f.add_double("lr", &lr, "peak learning rate (default 3e-4)");
  f.add_double("min-lr", &min_lr, "final learning rate of the cosine schedule (default 0)");
  f.add_string("lr-schedule", &schedule, "constant (default), warmup or cosine");
  f.add_int("warmup-steps", &warmup, "linear warmup steps (default 0)");
  f.add_double("weight-decay", &o.adam.weight_decay, "weight decay of matrices (default 0)");
  f.add_double("beta1", &o.adam.beta1, "Adam beta1 (default 0.9)");
  f.add_double("beta2", &o.adam.beta2, "Adam beta2 (default 0.95)");
  f.add_double("eps", &o.adam.eps, "Adam epsilon (default 1e-8)");
  f.add_double("clip-grad", &o.clip_grad, "global gradient-norm clipping, 0 = off (default)");
  f.add_int("skip-nonfinite-steps", &o.skip_nonfinite_steps,
            "skip up to N steps whose loss or gradient norm is not finite (no update), then stop (default 0: "
            "stop at the first)");
  f.add_int("seed", &seed, "seed of the initialization (default 0)");
  f.add_string("init", &o.init_path, "initial weights (safetensors, F32 or BF16)");
  f.add_string("save", &o.save_path, "write the final weights here (safetensors)");
  f.add_string("save-dtype", &save_dtype, "f32 (default) or bf16");
  f.add_string("log", &o.log_path, "write one JSON object per step here (JSONL)");
  f.add_string("dump-grads", &o.dump_grads_path, "write the step-0 gradients here (safetensors)");
  f.add_int("threads", &threads, "CPU threads (default: all cores)");
  f.add_bool("quiet", &quiet, "no progress line on stderr");
  f.add_string("strategy", &o.strategy_path, "parallel strategy JSON (docs/strategy.md): train on the MPI ranks");
  f.add_string("cluster", &o.cluster_path, "cluster JSON (docs/cluster.md) for the resolver's topology");
  f.add_string("trace", &o.trace_path, "write the emulated cluster's timeline here (Chrome trace JSON)");
  std::string clock = "cpu";
  f.add_string("clock", &clock,
               "emulated compute time: cpu (measured CPU time, default) or model (predicted from --profile: "
               "deterministic, independent of the machine's load)");
  f.add_string("profile", &o.profile_path, "profile JSON made by `hspmd profile` (with --clock model)");
  f.add_string("plan", &o.plan_path, "annotation plan JSON to train (docs/plan.md), instead of --strategy");
  std::vector<std::string> switches, lost;
  f.add_list("switch", &switches,
             "STEP:FILE: from step STEP on, train under FILE (a strategy or plan), moving the training state "
             "without a restart (docs/switching.md)");
  f.add_string("switch-algorithm", &o.switch_algorithm, "naive, per-tensor or fused (default)");
  f.add_double("switch-bucket-mb", &o.switch_bucket_mb,
               "fused switches: MiB of state tensors (full logical size) per round, at least one layer group "
               "(default 256; 0: everything in one round)");
  f.add_list("switch-lost", &lost,
             "STEP:R1,R2,...: at the switch of step STEP, the memory of these ranks counts as gone (their "
             "slices come from the --checkpoint)");
  f.add_string("checkpoint", &o.checkpoint_dir, "directory of sharded training checkpoints (docs/checkpoint.md)");
  f.add_int("save-every", &o.save_every, "write a training checkpoint after every N steps (with --checkpoint)");
  f.add_string("resume", &o.resume_dir, "continue from the training checkpoint in this directory");
  f.add_int("nproc", &nproc, "start this many local ranks through mpirun (with --strategy)");
  if (!f.parse(args)) return 0;

  if (optimizer != "adamw" && optimizer != "adam")
    fail("[flags] --optimizer: unknown optimizer '", optimizer, "' (expected adamw or adam)");
  o.adam.decoupled_weight_decay = optimizer == "adamw";
  if (save_dtype != "f32" && save_dtype != "bf16")
    fail("[flags] --save-dtype: '", save_dtype, "' (expected f32 or bf16)");
  o.save_dtype = save_dtype == "bf16" ? DType::BF16 : DType::F32;
  if (clock != "cpu" && clock != "model") fail("[flags] --clock: '", clock, "' (expected cpu or model)");
  o.model_clock = clock == "model";
  if (seed < 0) fail("[flags] --seed must be >= 0, got ", seed);
  if (warmup < 0) fail("[flags] --warmup-steps must be >= 0, got ", warmup);
  if (threads < 1) fail("[flags] --threads must be >= 1, got ", threads);
  o.seed = static_cast<uint64_t>(seed);
  o.threads = static_cast<int>(threads);
  o.schedule.kind = LrSchedule::parse_kind(schedule);
  o.schedule.lr = lr;
  o.schedule.min_lr = min_lr;
  o.schedule.warmup_steps = warmup;
  o.progress = !quiet;
  o.switches = parse_switches(switches, lost);
  const bool distributed = !o.strategy_path.empty() || !o.plan_path.empty();
  if (!o.strategy_path.empty() && !o.plan_path.empty()) fail("[flags] give --strategy or --plan, not both");
  if (nproc != 0) {
    if (!distributed) fail("[flags] --nproc needs --strategy or --plan");
    return launch_ranks(nproc, args);
  }
  if (!distributed) {
    if (o.global_batch == 0) fail("[flags] --global-batch is required (without --strategy)");
    train(o);
    return 0;
  }
  return train_on_ranks(o);
}

}  // namespace hspmd::cli
