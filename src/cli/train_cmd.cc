// hspmd train: flags -> TrainOptions -> train().
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "commands.h"
#include "flags.h"
#include "host_heartbeat.h"
#include "launcher.h"
#include "mps.h"
#include "hspmd/comm/communicator.h"
#include "hspmd/core/error.h"
#include "hspmd/models/model.h"
#include "hspmd/options/train_options.h"
#include "hspmd/io/output_file.h"
#include "hspmd/train/trainer.h"

namespace hspmd::cli {

namespace {

// Exclusive locks (flock) on the outputs that several runs could write at
// once: the --log file and the --checkpoint directory. Held until the
// process exits; a file or directory created only to be locked is removed
// again unless keep() is called (a failed setup leaves nothing behind).
class OutputLocks {
 public:
  ~OutputLocks() {
    for (const Held& h : held_) {
      struct stat st {};
      if (!keep_ && h.created && fstat(h.fd, &st) == 0 && (S_ISDIR(st.st_mode) || st.st_size == 0))
        S_ISDIR(st.st_mode) ? rmdir(h.path.c_str()) : unlink(h.path.c_str());
      close(h.fd);
    }
  }
  void keep() { keep_ = true; }
  // Locks the run's outputs; returns a one-line error naming the first that
  // another live run holds, or "". Paths that cannot be opened are left to
  // the trainer's own output checks.
  std::string lock_all(const TrainOptions& o) {
    if (!o.log_path.empty() && !lock(o.log_path, false))
      return "[flags] --log " + o.log_path + " is being written by another running hspmd job (it holds the "
             "file's lock); give another --log";
    if (!o.checkpoint_dir.empty() && !lock(o.checkpoint_dir, true))
      return "[flags] --checkpoint " + o.checkpoint_dir + " is being written by another running hspmd job (it "
             "holds the directory's lock); give another --checkpoint";
    return "";
  }

 private:
  struct Held {
    int fd;
    bool created;
    std::string path;
  };
  bool lock(const std::string& path, bool dir) {
    bool created = dir ? mkdir(path.c_str(), 0777) == 0 : false;
    int fd = -1;
    if (dir) {
      fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    } else {
      fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      created = fd >= 0;
      if (fd < 0 && errno == EEXIST) fd = open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    }
    if (fd < 0) return true;
    held_.push_back({fd, created, path});
    struct stat st {};
    if (fstat(fd, &st) != 0 || !(S_ISREG(st.st_mode) || S_ISDIR(st.st_mode))) return true;  // /dev/null: shared
    return flock(fd, LOCK_EX | LOCK_NB) == 0 || errno != EWOULDBLOCK;
  }

  std::vector<Held> held_;
  bool keep_ = false;
};

// How the ranks of a CUDA run communicate (--comm, docs/comm.md).
struct CommChoice {
  std::string flag = "auto";  // auto | nccl | mpi
  std::string device = "cpu";  // the --device text
};

// Two ranks on one device of one machine, or none (-1, -1).
std::pair<int, int> ranks_sharing_a_device(Communicator& world, Device device) {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const int64_t key = static_cast<int64_t>(std::hash<std::string>{}(host) & 0xffffffffffffULL) * 4096 + device.index;
  std::vector<int64_t> keys(world.size());
  world.all_gather(&key, keys.data(), std::vector<int64_t>(world.size(), 1));
  for (int a = 0; a < world.size(); ++a)
    for (int b = a + 1; b < world.size(); ++b)
      if (keys[a] == keys[b]) return {a, b};
  return {-1, -1};
}

// The communicator the ranks train over: the (staged) MPI world, or NCCL
// on top of it (auto: when every rank has a GPU of its own and NCCL loads on
// every rank). Collective over the world.
std::unique_ptr<Communicator> device_communicator(Communicator& world, Device device, const std::string& flag) {
  if (device.type != DeviceType::CUDA || world.size() == 1 || flag == "mpi") return nullptr;
  const auto [a, b] = ranks_sharing_a_device(world, device);
  if (a >= 0) {
    if (flag == "nccl")
      fail("[train] --comm nccl: ranks ", a, " and ", b, " share ", device.str(),
           " (NCCL needs a GPU per rank and refuses two ranks of a communicator on one device); use --comm mpi, "
           "which stages device buffers through host memory");
    return nullptr;  // auto: the staged MPI world
  }
  double unavailable = 0;  // every rank must agree, or the NCCL bootstrap would hang
  std::string why;
  try {
    (void)nccl_version();
  } catch (const Error& e) {
    unavailable = 1;
    why = e.what();
  }
  world.all_reduce(&unavailable, 1, DType::F64);
  if (unavailable != 0) {
    if (flag == "nccl") fail("[train] --comm nccl: ", why.empty() ? "NCCL cannot be loaded on every rank" : why);
    return nullptr;
  }
  return make_nccl_communicator(world, device);
}

// Distributed training on the MPI world: a failing rank prints its error and
// ends the whole job, never leaving the others waiting.
int train_on_ranks(const TrainOptions& o, const CommChoice& comm_choice) {
  std::unique_ptr<Communicator> world = make_world_communicator();
  RankSupervision supervision(world->rank());
  const HostHeartbeat heartbeat(*world, o.heartbeat_timeout_s, o.heartbeat_max_loss);  // across hosts only
  TrainOptions mine = o;
  if (world->rank() != 0) mine.progress = false;
  mine.on_step = [&](int64_t step) { supervision.step_done(step); };
  OutputLocks locks;
  try {
    std::string busy;
    if (world->rank() == 0) busy = locks.lock_all(o);
    double failed = busy.empty() ? 0 : 1;  // every rank learns that rank 0 cannot write
    world->all_reduce(&failed, 1, DType::F64);
    if (failed != 0) throw SetupFailure(busy, world->rank() == 0);
    mine.device = rank_device(comm_choice.device, "--device", world->rank());
    require_device(mine.device);
    std::unique_ptr<Communicator> nccl = device_communicator(*world, mine.device, comm_choice.flag);
    train_distributed(mine, nccl ? *nccl : *world);
    locks.keep();
  } catch (const SetupFailure& e) {
    if (world->size() == 1) {
      claim_report(std::string("hspmd: error: ") + e.what());  // main() prints it; the launcher must know
      throw;
    }
    const std::string line = std::string("hspmd: error: ") + e.what();
    if (e.reporter() && claim_report(line)) std::fprintf(stderr, "%s\n", line.c_str());
    return 1;
  } catch (const std::exception& e) {
    if (world->size() == 1) {
      claim_report(std::string("hspmd: error: ") + e.what());  // main() prints it; the launcher must know
      throw;
    }
    const std::string line = "hspmd: error: rank " + std::to_string(world->rank()) + ": " + e.what();
    // HSPMD_TEST_LOSE_ERROR_LINE=1 (tests): claim without printing, as if
    // mpirun had lost the line; the launcher must print it from the claim.
    if (claim_report(line) && std::getenv("HSPMD_TEST_LOSE_ERROR_LINE") == nullptr) {
      std::fprintf(stderr, "%s\n", line.c_str());
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

// The number of ranks of the MPI job this process is part of (1 outside one).
int mpi_world_size() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"})
    if (const char* v = std::getenv(var)) return std::max(1, std::atoi(v));
  return 1;
}

// The launcher's own flags and the inputs (the options' rules are
// validate()'s, hspmd/options/train_options.h).
void check_values(const FlagSet& f, const TrainOptions& o, int64_t nproc, double timeout, int64_t max_restarts) {
  if (f.given("nproc") && (nproc < 1 || nproc > kMaxThreads))
    fail("[flags] --nproc must lie in [1, ", kMaxThreads, "], got ", nproc);
  if (!(timeout >= 0)) fail("[flags] --timeout must be >= 0 seconds, got ", timeout);
  check_max_restarts(max_restarts);
  if (f.given("max-restarts") && !f.given("nproc") && !f.given("hostfile"))
    fail("[flags] --max-restarts needs --nproc or --hostfile (the launcher restarts the ranks)");
  if (f.given("max-restarts") && (o.checkpoint_dir.empty() || o.save_every <= 0))
    fail("[flags] --max-restarts needs --checkpoint DIR with --save-every N (a restart resumes from the last "
         "checkpoint)");
  const std::pair<const char*, const std::string*> inputs[] = {
      {"--model", &o.model_path},       {"--data", &o.data_path},   {"--init", &o.init_path},
      {"--strategy", &o.strategy_path}, {"--plan", &o.plan_path},   {"--cluster", &o.cluster_path},
      {"--profile", &o.profile_path},   {"--events", &o.events_path}};
  for (const auto& [flag, path] : inputs) check_input_file(flag, *path);
  for (const std::string& s : o.strategy_choices) check_input_file("--strategies", s);
}

// No output may be an input or another output (docs/reliability.md), and a
// checkpoint directory of another run is neither replaced nor resumed
// unless the flags say so: the library's rules (every run's setup checks
// them too), here before any rank is started.
void check_files(const FlagSet& f, const TrainOptions& o) {
  (void)f;
  check_run_files_apart(o);
  check_checkpoint_directory(o);
}

// Flags that only mean something together with others are errors alone,
// never silently ignored.
void check_combinations(const FlagSet& f, bool distributed) {
  if (distributed && f.given("micro-batches"))
    fail("[flags] --micro-batches is not read under --strategy or --plan: each pipeline's \"micro_batches\" "
         "comes from the strategy");
  if (f.given("timeout") && !f.given("nproc") && !f.given("hostfile"))
    fail("[flags] --timeout needs --nproc or --hostfile (it is the launcher's watchdog)");
}

// The ranks' flags: these without the launcher's own (--nproc, --hostfile,
// --timeout, --max-restarts, --mps-percent), and --threads cores / N unless
// given (the test hosts share this machine's cores).
std::vector<std::string> rank_args(const FlagSet& f, const std::vector<std::string>& args, int64_t nproc) {
  static const char* const kLauncherFlags[] = {"--nproc", "--hostfile", "--timeout", "--max-restarts",
                                               "--mps-percent"};
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    bool own = false;
    for (const char* flag : kLauncherFlags) {
      if (args[i] == flag) own = true, ++i;
      else if (args[i].rfind(std::string(flag) + "=", 0) == 0) own = true;
      if (own) break;
    }
    if (!own) out.push_back(args[i]);
  }
  if (!f.given("threads")) {
    const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
    out.insert(out.end(), {"--threads", std::to_string(std::max<int64_t>(1, cores / nproc))});
  }
  return out;
}

// What hspmd train's flags are read into: the options (their flags made
// from the schema, train_option_table) and the command line's own flags.
struct TrainFlags {
  TrainOptions o = default_train_options();
  bool quiet = false;
  int64_t nproc = 0, max_seq_len = 0;
  std::string device = "cpu", mps_percent, hostfile;
  CommChoice comm_choice;
  bool overlap = false, no_overlap = false;
  std::vector<std::string> switches, lost;
  double timeout = 300;
  int64_t max_restarts = 0;
};

// A schema field as a flag name: seq_len -> seq-len.
std::string dashed(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return name;
}

// A row's doc as the command line reads it: the options it names with an
// underscore (batch_tokens) spelled as flags (--batch-tokens); one-word
// names (model, checkpoint) stay words.
std::string flag_doc(const std::string& doc, const std::vector<OptionSpec<TrainOptions>>& table) {
  std::string out;
  size_t i = 0;
  while (i < doc.size()) {
    size_t j = i;
    while (j < doc.size() && (std::islower(static_cast<unsigned char>(doc[j])) || doc[j] == '_')) ++j;
    if (j == i) {
      out += doc[i++];
      continue;
    }
    const std::string word = doc.substr(i, j - i);
    const bool named = word.find('_') != std::string::npos &&
                       std::any_of(table.begin(), table.end(), [&](const auto& s) { return word == s.name; });
    out += named ? "--" + dashed(word) : word;
    i = j;
  }
  return out;
}

// Every option of the schema as a flag.
void add_option_flags(FlagSet& f, TrainFlags& t) {
  const std::vector<OptionSpec<TrainOptions>> table = train_option_table();
  for (const OptionSpec<TrainOptions>& spec : table)
    f.add_value(dashed(spec.name), spec.type, flag_doc(spec.doc, table), spec.required, spec.range,
                [&t, set = spec.set](const OptionValue& v) { set(t.o, v); });
}

// The options the command line gave, by field.
GivenOptions given_options(const FlagSet& f) {
  GivenOptions given;
  for (const OptionSpec<TrainOptions>& spec : train_option_table())
    if (f.given(dashed(spec.name))) given.insert(spec.name);
  return given;
}

// The command line's own flags: the longest piece of token budgets, the
// device and how ranks share and talk over it, the overlap's switches,
// switches at set steps, and the launcher's.
void add_command_line_flags(FlagSet& f, TrainFlags& t) {
  f.add_int("max-seq-len", &t.max_seq_len, "with --batch-tokens: the longest piece (documents are cut into pieces of "
            "at most this many tokens)");
  f.add_bool("quiet", &t.quiet, "no progress line on stderr");
  f.add_string("device", &t.device,
               "cpu (default), cuda or cuda:N: where the model computes (docs/cuda.md); with several ranks, cuda "
               "spreads a machine's ranks over its GPUs and cuda:N puts them all on GPU N");
  f.add_string("mps-percent", &t.mps_percent,
               "with --nproc and --device cuda:N: give the ranks these shares of the GPU's SMs through CUDA MPS, "
               "one percentage per rank (e.g. 50,25,25); the launcher starts and stops the MPS daemon");
  f.add_string("comm", &t.comm_choice.flag,
               "with --device cuda and several ranks: auto (default: NCCL when every rank has a GPU of its own, "
               "else MPI), nccl, or mpi (device buffers staged through pinned host memory; ranks may share a GPU)");
  f.add_bool("overlap", &t.overlap,
             "synchronize each gradient on a communication thread as soon as the last backward computes it "
             "(default with a device other than the CPU; docs/comm.md)");
  f.add_bool("no-overlap", &t.no_overlap, "synchronize the gradients after the schedule (default on the CPU)");
  f.add_list("switch", &t.switches,
             "STEP:FILE: from step STEP on, train under FILE (a strategy or plan), moving the training state "
             "without a restart (docs/switching.md)");
  f.add_list("switch-lost", &t.lost,
             "STEP:R1,R2,...: at the switch of step STEP, the memory of these ranks counts as gone (their "
             "slices come from the --checkpoint)");
  f.add_int("nproc", &t.nproc,
            "start this many local ranks through mpirun (with --strategy); without --threads, each rank gets "
            "max(1, cores / N) threads");
  f.add_string("hostfile", &t.hostfile,
               "run the ranks on these hosts through mpirun (Open MPI's hostfile: NAME slots=N a line; --nproc "
               "at most the slots, default all of them; docs/multi_host.md)");
  f.add_double("timeout", &t.timeout,
               "with --nproc or --hostfile: end the job when no step finishes or a rank stops responding for this "
               "many seconds (setup and step 0: 3x, at least 120 s; default 300; 0 = off)");
  f.add_int("max-restarts", &t.max_restarts,
            "with --nproc or --hostfile, --checkpoint and --save-every: when a rank dies (killed by a signal), "
            "restart the job from the last checkpoint, at most this many times (default 0)");
}

// The device first, before any work: a build without CUDA, no GPU, an
// index that does not exist, each in one line; then --comm, which needs it.
Device read_device(const FlagSet& f, TrainFlags& t) {
  const Device where = parse_device_name(t.device, "--device");
  require_device(where);
  if (where.type == DeviceType::CUDA) {
    // The emulated cluster bills CPU time to virtual clocks: a CPU feature.
    for (const char* flag : {"cluster", "trace"})
      if (f.given(flag))
        fail("[train] --device ", where.str(), ": --", flag, " emulates a cluster on the CPU (virtual clocks); "
             "it does not run on CUDA (docs/cuda.md)");
  }
  if (f.given("comm")) {
    if (t.comm_choice.flag != "auto" && t.comm_choice.flag != "nccl" && t.comm_choice.flag != "mpi")
      fail("[flags] --comm: '", t.comm_choice.flag, "' (expected auto, nccl or mpi)");
    if (where.type != DeviceType::CUDA)
      fail("[flags] --comm is read only with --device cuda (CPU ranks communicate through MPI)");
  }
  t.comm_choice.device = t.device;
  return where;
}

void read_overlap(TrainFlags& t) {
  if (t.overlap && t.no_overlap) fail("[flags] give --overlap or --no-overlap, not both");
  if (t.overlap || t.no_overlap) t.o.overlap = t.overlap;
}

// --mps-percent: the ranks' shares of the GPU's SMs (none without the flag).
std::vector<int> mps_shares(const FlagSet& f, const TrainFlags& t, Device where) {
  std::vector<int> mps_percents;
  if (f.given("mps-percent")) {
    if (!f.given("nproc")) fail("[flags] --mps-percent needs --nproc (the launcher runs the MPS daemon)");
    if (f.given("hostfile")) fail("[flags] --mps-percent runs one machine's MPS daemon: not with --hostfile");
    mps_percents = parse_mps_percents(t.mps_percent, t.nproc, where);
  }
  return mps_percents;
}

// The command line names a token budget's longest piece --max-seq-len (the
// options' seq_len); a step is --global-batch samples of --seq-len tokens,
// or a budget of --batch-tokens tokens in pieces of at most --max-seq-len.
void read_step_size(const FlagSet& f, TrainFlags& t) {
  if (f.given("batch-tokens")) {
    if (!f.given("max-seq-len")) fail("[flags] --batch-tokens needs --max-seq-len L (the longest piece)");
    if (t.max_seq_len <= 0) fail("[flags] --max-seq-len must be positive, got ", t.max_seq_len);
    if (f.given("seq-len")) fail("[flags] --seq-len is not read with --batch-tokens (give --max-seq-len)");
    t.o.seq_len = t.max_seq_len;
  } else if (f.given("max-seq-len")) {
    fail("[flags] --max-seq-len is read only with --batch-tokens");
  } else if (!f.given("seq-len")) {
    fail("[flags] --seq-len is required (or --batch-tokens T --max-seq-len L)");
  }
}

// --switch / --switch-lost, and --strategies (whose first file is the
// strategy the run starts under).
void read_run_flags(const FlagSet& f, TrainFlags& t) {
  check_values(f, t.o, t.nproc, t.timeout, t.max_restarts);
  t.o.progress = !t.quiet;
  t.o.switches = parse_switches(t.switches, t.lost);
  for (const TrainOptions::Switch& sw : t.o.switches) check_input_file("--switch", sw.path);
}

// --nproc: start the local ranks through mpirun (and the MPS daemon of
// --mps-percent) and wait for the job.
int launch_local_ranks(const FlagSet& f, const std::vector<std::string>& args, const TrainFlags& t,
                       const std::vector<int>& mps_percents) {
  Hostfile hosts;
  int64_t nproc = t.nproc;
  if (f.given("hostfile")) {
    hosts = read_hostfile(t.hostfile);
    if (!f.given("nproc")) nproc = hosts.slots();
  }
  std::vector<std::string> ranks = rank_args(f, args, nproc);
  std::optional<MpsDaemon> mps;  // stopped when the job ends, however it ends
  if (!mps_percents.empty()) mps.emplace(mps_percents);
  LaunchOptions launch{nproc, std::move(ranks), t.timeout, t.max_restarts, t.o.log_path,
                       t.o.checkpoint_dir, t.o.resume_dir, {}, std::move(hosts), {}};
  if (t.o.strategy_choices.empty() && t.o.events_path.empty() && t.o.batch_tokens == 0)  // a lost host: re-plan
    launch.replan = {t.o.model_path, t.o.strategy_path, t.o.seq_len};
  return launch_ranks(launch);
}

// Training in this one process, without a strategy.
int train_alone(const TrainOptions& o) {
  OutputLocks locks;
  if (const std::string busy = locks.lock_all(o); !busy.empty()) fail(busy);
  train(o);
  locks.keep();
  return 0;
}

}  // namespace

int train_command(const std::vector<std::string>& args) {
  TrainFlags t;
  FlagSet f("train", "Train a model of a registered family (model_type " + registered_model_types() +
                         "; Hugging Face config and weights) on a token file.");
  add_option_flags(f, t);
  add_command_line_flags(f, t);
  if (!f.parse(args)) return 0;
  const Device where = read_device(f, t);
  read_overlap(t);
  const std::vector<int> mps_percents = mps_shares(f, t, where);
  t.o.device = where;
  read_step_size(f, t);
  read_run_flags(f, t);
  validate(t.o, given_options(f));
  check_files(f, t.o);
  const bool distributed = !t.o.strategy_path.empty() || !t.o.plan_path.empty();
  if (!distributed && mpi_world_size() > 1) {
    if (std::getenv("OMPI_COMM_WORLD_RANK") && std::string(std::getenv("OMPI_COMM_WORLD_RANK")) != "0") return 1;
    fail("[flags] this is one of ", mpi_world_size(), " MPI ranks but no --strategy or --plan was given: "
         "each rank would train alone and write the same files");
  }
  check_combinations(f, distributed);
  if (f.given("nproc") || f.given("hostfile")) {
    if (!distributed) fail("[flags] --", f.given("nproc") ? "nproc" : "hostfile", " needs --strategy or --plan");
    return launch_local_ranks(f, args, t, mps_percents);
  }
  if (!distributed) return train_alone(t.o);
  return train_on_ranks(t.o, t.comm_choice);
}

}  // namespace hspmd::cli
