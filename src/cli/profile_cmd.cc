// hspmd profile: measure a model's parts on this machine -> profile JSON
// (docs/profiling.md).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "launcher.h"
#include "mps.h"
#include "flags.h"
#include "hspmd/models/model.h"
#include "hspmd/comm/communicator.h"
#include "hspmd/core/error.h"
#include "hspmd/io/output_file.h"
#include "hspmd/io/text_output.h"
#include "hspmd/core/ndarray.h"
#include "hspmd/models/model.h"
#include "hspmd/planner/link_profile.h"
#include "hspmd/planner/profiler.h"
#include "hostfile.h"

namespace hspmd::cli {

namespace {

// "1,2,4" -> {1, 2, 4}; "[profile] --<flag>: ..." for anything else.
std::vector<int64_t> parse_list(const std::string& flag, const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t digits = !item.empty() && item[0] == '-' ? 1 : 0;
    if (item.size() == digits || item.find_first_not_of("0123456789", digits) != std::string::npos)
      fail("[profile] --", flag, ": '", item, "' in '", text, "' is not an integer");
    const int64_t v = parse_int(flag, item);  // one beyond 64 bits is refused with the range
    if (v < 1) fail("[profile] --", flag, ": ", v, " must be positive");
    check_int_range("[profile] --" + flag, v, kPositiveInt);  // --tp and --cp are read as ints
    out.push_back(v);
  }
  if (out.empty() || text.back() == ',') fail("[profile] --", flag, ": '", text, "' is not a list like 1,2,4");
  return out;
}

std::vector<int> to_ints(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

void print_table(const Profile& p, double seconds) {
  std::fprintf(stderr, "%-10s %3s %3s %12s %12s %12s %8s\n", "part", "tp", "cp", "a", "c", "d", "max err");
  for (const ProfileEntry& e : p.entries)
    for (const char* part : kProfileParts) {
      const PartFit& f = e.parts.at(part);
      std::fprintf(stderr, "%-10s %3d %3d %12.4e %12.4e %12.4e %7.1f%%\n", part, e.tp, e.cp, f.a, f.c, f.d,
                   100 * f.max_rel_error);
    }
  std::fprintf(stderr, "optimizer: %.4e s/param + %.4e s (max err %.1f%%)\n", p.optimizer.per_param_s,
               p.optimizer.fixed_s, 100 * p.optimizer.max_rel_error);
  for (const LayerMemory& m : p.memory)
    std::fprintf(stderr, "memory tp %d cp %d: layer params %lld B, activations %.1f B/token (recompute %.1f)\n", m.tp,
                 m.cp, static_cast<long long>(m.param_bytes), m.activation_bytes_per_token,
                 m.activation_bytes_per_token_recompute);
  std::fprintf(stderr, "op fits: %zu op types; profiled in %.1f s\n", p.ops.size() - p.ops.count(kAnyOp), seconds);
}

// The calibration directories of profiles that were killed (SIGKILL leaves
// them): hspmd-calibrate-<pid> in the temporary directory whose process is
// gone.
void remove_stale_calibrations() {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string prefix = "hspmd-calibrate-";
  for (const auto& e : fs::directory_iterator(fs::temp_directory_path(), ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + prefix.size(), &end, 10);
    if (pid <= 0 || *end != '\0' || pid == getpid()) continue;
    if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) fs::remove_all(e.path(), ec);
  }
}

// The emulation factor of one profiled degree (docs/profiling.md): trains
// `ranks` emulated ranks as ranks / (tp * cp) whole-model pipelines of one
// tp x cp stage and one micro-batch (b = 1, s = the longest profiled
// length) for a few steps on random tokens, and divides the compute a rank
// bills per step (the median over ranks and steps after the first) by what
// the entry's parts and the optimizer fit predict for that work.
double emulation_factor(const Profile& p, const ProfileEntry& e, const std::string& model_path, int ranks,
                        int64_t s) {
  namespace fs = std::filesystem;
  const int group = e.tp * e.cp, pipelines = ranks / group;
  if (pipelines < 1) fail("[profile] --emulated-ranks ", ranks, " is smaller than tp x cp = ", group);
  remove_stale_calibrations();
  const fs::path dir = fs::temp_directory_path() / ("hspmd-calibrate-" + std::to_string(getpid()));
  fs::create_directories(dir);
  struct Cleanup {
    fs::path dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{dir};
  const int64_t layers = p.config.num_hidden_layers;
  {
    std::ofstream data(dir / "data.bin", std::ios::binary);
    uint32_t x = 2463534242u;
    for (int64_t i = 0; i < 16 * static_cast<int64_t>(pipelines) * (s + 1); ++i) {
      x ^= x << 13, x ^= x >> 17, x ^= x << 5;
      const uint32_t id = x % static_cast<uint32_t>(p.config.vocab_size);
      data.write(reinterpret_cast<const char*>(&id), sizeof id);
    }
    nlohmann::json pipes = nlohmann::json::array();
    for (int q = 0; q < pipelines; ++q) {
      std::vector<int> members;
      for (int m = 0; m < group; ++m) members.push_back(q * group + m);
      pipes.push_back({{"micro_batch_size", 1}, {"micro_batches", 1},
                       {"stages", {{{"ranks", members}, {"layers", {0, layers - 1}}, {"cp", e.cp}}}}});
    }
    std::ofstream(dir / "strategy.json") << nlohmann::json{{"pipelines", pipes}}.dump();
    std::ofstream(dir / "cluster.json")
        << nlohmann::json{{"catalog", {{"cpu", {{"tflops", 1}, {"memory_gib", 1024}}}}},
                          {"nodes", {{{"type", "cpu"}, {"ranks", {0, pipelines * group - 1}}}}}}
               .dump();
  }
  const std::string log = (dir / "log.jsonl").string();
  const int rc = train_command({"--model", model_path, "--data", (dir / "data.bin").string(), "--seq-len",
                                std::to_string(s), "--global-batch", std::to_string(pipelines), "--steps", "4",
                                "--strategy", (dir / "strategy.json").string(), "--cluster",
                                (dir / "cluster.json").string(), "--nproc", std::to_string(pipelines * group),
                                "--threads", "1", "--quiet", "--log", log, "--precision", p.precision});
  if (rc != 0) fail("[profile] the calibration run of tp ", e.tp, " cp ", e.cp, " failed");
  std::vector<double> measured;
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json r = nlohmann::json::parse(line);
    if (r.at("step").get<int>() == 0) continue;  // first-touch costs
    for (double c : r.at("emulated_compute_s")) measured.push_back(c);
  }
  if (measured.empty()) fail("[profile] the calibration run logged no step after the first");
  std::sort(measured.begin(), measured.end());
  const double median = measured[measured.size() / 2];
  int64_t params = 0;  // on one rank of the stage
  for (const ModelParameter& q : model_parameters(p.config)) {
    const int64_t n = shape_numel(q.shape);
    params += q.role == ParamRole::kReplicated ? n : n / e.tp;
  }
  auto at = [&](const char* part) { return e.parts.at(part).at(s, 1); };
  const double predicted = at("embed_fwd") + at("embed_bwd") + at("head_fwd") + at("head_bwd") +
                           static_cast<double>(layers) * (at("block_fwd") + at("block_bwd")) +
                           p.optimizer.per_param_s * static_cast<double>(params) + p.optimizer.fixed_s;
  return median / predicted;
}

struct ProfileFlags {
  std::string model, output, tp = "1", cp = "1", seqs = "16,32,64", batches = "1,2";
  int repetitions = 5, threads = 1;  // ints: the parser refuses what does not fit
  int64_t emulated_ranks = 0;
  std::string precision = "fp32", device = "cpu", mps_percent;
};

void add_profile_flags(FlagSet& f, ProfileFlags& c) {
  f.add_string("model", &c.model, "Hugging Face config.json of the model", true);
  f.add_string("output", &c.output, "profile JSON to write (also -o)", true);
  f.add_string("tp", &c.tp, "tensor-parallel degrees, e.g. 1,2,4 (default 1)");
  f.add_string("cp", &c.cp, "context-parallel degrees (default 1)");
  f.add_string("seq-lens", &c.seqs, "sequence lengths (default 16,32,64)");
  f.add_string("micro-batch-sizes", &c.batches, "micro-batch sizes (default 1,2)");
  f.add_int("repetitions", &c.repetitions, "timed runs per point after one warm-up; the median counts (default 5)",
            false, kPositiveInt);
  f.add_int("threads", &c.threads, "kernel threads, as the emulated ranks run (default 1)", false, {1, 1024});
  f.add_string("precision", &c.precision, "fp32 (default) or bf16: the precision of the runs it serves (--precision)");
  f.add_string("device", &c.device,
               "cpu (default), cuda or cuda:N: where the parts run (on a GPU: timed with CUDA events,\n"
               "docs/cuda.md)");
  f.add_string("mps-percent", &c.mps_percent,
               "with --device cuda:N: profile a CUDA MPS partition of this share of the GPU's SMs (a private MPS\n"
               "daemon runs for the profile; docs/cuda.md)");
  f.add_int("emulated-ranks", &c.emulated_ranks,
            "also calibrate to an emulated cluster of this many ranks on this machine: the compute\n"
            "they bill over what the parts predict (default 0: no calibration)");
}

// The device first, before any work: a build without CUDA, no GPU, an
// index that does not exist. `mps` holds the MPS daemon of --mps-percent.
Device profile_device(const FlagSet& f, const ProfileFlags& c, std::optional<MpsDaemon>& mps) {
  const Device where = parse_device_name(c.device, "--device");
  // An MPS partition: the daemon, then this process's share, both before
  // the first CUDA call (require_device's).
  if (f.given("mps-percent")) {
    const std::vector<int> share = parse_mps_percents(c.mps_percent, 1, where);
    mps.emplace(share);
    setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", std::to_string(share[0]).c_str(), 1);
  }
  require_device(where);
  const bool on_cpu = where == Device::cpu();
  if (!on_cpu && c.emulated_ranks > 0)
    fail("[profile] --device ", where.str(), ": --emulated-ranks calibrates emulated CPU ranks (profile on the "
         "CPU for it)");
  return where;
}

// The files and lists of the flags, checked: the options of profile_model.
ProfileOptions profile_options(const ProfileFlags& c, Device where) {
  // Each emulated rank is a process on this machine: beyond 32 per core
  // the calibration measures the scheduler, and 1000 ranks on 2 cores ran
  // the machine to a load of 199.
  check_local_ranks("[profile] --emulated-ranks", c.emulated_ranks, 0);  // the launcher's bound
  if (!std::filesystem::is_regular_file(c.model)) fail("[profile] --model ", c.model, ": no such file");
  check_outputs({{"--model", c.model}}, {{"--output", c.output}});
  ProfileOptions o;
  o.model_path = c.model;
  o.config = ModelConfig::load(c.model);
  o.tp = to_ints(parse_list("tp", c.tp));
  o.cp = to_ints(parse_list("cp", c.cp));
  o.seq_lens = parse_list("seq-lens", c.seqs);
  o.micro_batch_sizes = parse_list("micro-batch-sizes", c.batches);
  o.repetitions = c.repetitions;
  o.threads = c.threads;
  o.precision.compute = parse_precision_name(c.precision, "--precision");
  o.device = where;
  check_profile_options(o);
  o.progress = [](const std::string& what) { std::fprintf(stderr, "[profile] %s\n", what.c_str()); };
  return o;
}

// Profiles the parts, recording how quiet the machine was: a profile taken
// while other processes share its cores times the scheduler as much as the
// model. `t0` is when the profile started.
Profile measured_profile(const ProfileOptions& o, bool on_cpu, int threads,
                         std::chrono::steady_clock::time_point t0) {
  double load[1] = {0};
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const double load_before = getloadavg(load, 1) == 1 ? load[0] : 0;
  const double cpu0 = process_cpu_seconds();
  Profile p = profile_model(o);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // On a device the host waits for events: its CPU share says nothing (0: not recorded).
  p.cpu_share = on_cpu && wall > 0 ? (process_cpu_seconds() - cpu0) / (wall * static_cast<double>(threads)) : 0;
  p.load_before = load_before;
  p.load_after = getloadavg(load, 1) == 1 ? load[0] : 0;
  p.cores = cores;
  if (p.measured_under_load())
    std::fprintf(stderr,
                 "[profile] warning: the machine was busy while the parts were timed (%s): the times may "
                 "be too slow or uneven; profile again on a quiet machine (the profile records it, and plan "
                 "search / plan cost will say so)\n",
                 p.load_summary().c_str());
  return p;
}

// --emulated-ranks: each entry's emulation factor, at the longest profiled
// length.
void calibrate_emulation(Profile& p, const ProfileFlags& c, const std::vector<int64_t>& seq_lens) {
  if (c.threads != 1) fail("[profile] --emulated-ranks needs --threads 1 (how emulated ranks run)");
  p.emulation_ranks = static_cast<int>(c.emulated_ranks);
  const int64_t s = *std::max_element(seq_lens.begin(), seq_lens.end());
  for (ProfileEntry& e : p.entries) {
    e.emulation_factor = emulation_factor(p, e, c.model, p.emulation_ranks, s);
    std::fprintf(stderr, "[profile] tp %d cp %d: emulation factor %.3f (%d emulated ranks)\n", e.tp, e.cp,
                 e.emulation_factor, p.emulation_ranks);
  }
}

// A double as text that reads back to the same value.
std::string json_number(double x) { return nlohmann::json(x).dump(); }

struct LinkFlags {
  bool links = false;
  std::string hostfile, output;
  int repetitions = 5;
  double link_seconds = 0.1;
};

void add_link_flags(FlagSet& f, LinkFlags& c) {
  f.add_bool("links", &c.links, "measure the links between the hosts of --hostfile and within each");
  f.add_string("hostfile", &c.hostfile, "the hosts (Open MPI's hostfile: NAME slots=N a line; docs/multi_host.md)");
  f.add_string("output", &c.output, "links JSON to write (also -o)", true);
  f.add_int("repetitions", &c.repetitions, "timed ping-pongs per message size; the median counts (default 5)", false,
            {1, 1000});
  f.add_double("link-seconds", &c.link_seconds,
               "the largest message of a link takes about this long one way (default 0.1)");
}

// One rank of the measurement (under mpirun): rank 0 writes the table.
int links_rank(const LinkFlags& c) {
  std::unique_ptr<Communicator> world = make_world_communicator();
  RankSupervision supervision(world->rank());
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  LinkProbeOptions o;
  o.repeats = c.repetitions;
  o.target_seconds = c.link_seconds;
  const LinkTable t = measure_links(*world, name, o);
  if (world->rank() != 0) return 0;
  write_output_file("[profile] --output", c.output, t.to_json().dump(1) + "\n");
  for (const HostLink& l : t.links)
    std::fprintf(stderr, "%s <-> %s: %.4g MB/s, latency %.1f us\n", t.hosts[l.a].c_str(), t.hosts[l.b].c_str(),
                 l.gbps * 1e3, l.latency_us);
  std::fprintf(stderr, "wrote %s\n", c.output.c_str());
  return 0;
}

// `hspmd profile --links`: with --hostfile, runs itself on up to two ranks
// per host through the launcher; under mpirun, is one of those ranks.
int links_command(const std::vector<std::string>& args) {
  LinkFlags c;
  FlagSet f("profile --links",
            "Measure bandwidth and latency between every two hosts and within each, over the\n"
            "transport the ranks use (MPI point-to-point; docs/cluster.md, \"Measured links\"):\n"
            "plan search and plan cost read the file with --links.");
  add_link_flags(f, c);
  // --help wins over anything else given (the mode's help, as `hspmd plan
  // search --lengths x --help` prints its own).
  for (const std::string& a : args)
    if (a == "--help" || a == "-h") {
      f.parse({"--help"});
      return 0;
    }
  if (!f.parse(expand_short_output(args))) return 0;
  if (!(c.link_seconds > 0) || c.link_seconds > 10)
    fail("[flags] --link-seconds must lie in (0, 10], got ", c.link_seconds);
  check_outputs({{"--hostfile", c.hostfile}}, {{"--output", c.output}});
  if (c.hostfile.empty()) {
    if (std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr)
      fail("[flags] profile --links needs --hostfile (or to run under mpirun)");
    return links_rank(c);
  }
  Hostfile hosts = read_hostfile(c.hostfile);
  for (HostSlots& h : hosts.hosts) h.slots = std::min<int64_t>(h.slots, 2);
  const std::string out = std::filesystem::absolute(c.output).string();
  std::vector<std::string> ranks = {"--links", "--output", out, "--repetitions", std::to_string(c.repetitions),
                                    "--link-seconds", json_number(c.link_seconds)};
  LaunchOptions o;
  o.nproc = hosts.slots();
  o.rank_args = std::move(ranks);
  o.timeout_s = 0;  // the ranks report no steps
  o.command = {self_executable(), "profile"};
  o.hostfile = std::move(hosts);
  return launch_ranks(o);
}

}  // namespace

int profile_command(const std::vector<std::string>& args) {
  for (const std::string& a : args)
    if (a == "--links") return links_command(args);
  ProfileFlags c;
  FlagSet f("profile",
            "Measure a model's embedding, block and head (forward and backward) on one rank of a\n"
            "tensor-parallel x context-parallel group with the real executor, and fit them\n"
            "(docs/profiling.md). Times are the CPU time the emulator bills for the same work\n"
            "(--device cuda: the GPU's time, from CUDA events).");
  add_profile_flags(f, c);
  const std::vector<std::string> expanded = expand_short_output(args);
  if (!f.parse(expanded)) return 0;
  std::optional<MpsDaemon> mps;  // --mps-percent's daemon, stopped when the command returns
  const Device where = profile_device(f, c, mps);
  const ProfileOptions o = profile_options(c, where);
  const auto t0 = std::chrono::steady_clock::now();
  Profile p = measured_profile(o, where == Device::cpu(), c.threads, t0);
  if (c.emulated_ranks > 0) calibrate_emulation(p, c, o.seq_lens);
  write_output_file("[profile] --output", c.output, p.to_json().dump(1) + "\n");
  print_table(p, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::fprintf(stderr, "wrote %s\n", c.output.c_str());
  return 0;
}

}  // namespace hspmd::cli
