// Restart points, the restarted ranks' flags and the --log edits (restart.h).
#include "restart.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "hspmd/core/error.h"
#include "hspmd/io/checkpoint.h"
#include "hspmd/models/config.h"
#include "hspmd/plan/strategy.h"
#include "hspmd/planner/search.h"
#include "hspmd/resolve/topology.h"

namespace hspmd::cli {

namespace {

constexpr size_t kSlotWidth = 20;  // characters reserved for recovery_s's value

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Through a temporary file and a rename, so that a launcher killed meanwhile
// leaves the old log whole.
void replace_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".restart.tmp";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  bool ok = fd >= 0;
  for (size_t done = 0; ok && done < text.size();) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    ok = n > 0;
    if (ok) done += static_cast<size_t>(n);
  }
  ok = ok && fsync(fd) == 0;
  if (fd >= 0) close(fd);
  if (!ok || rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    unlink(tmp.c_str());
    fail("[launch] --log ", path, ": cannot rewrite it for the restart: ", std::strerror(e));
  }
}

// Whether a log line is a step record of a step >= from_step (re-run by the
// restarted attempt).
bool rerun_step(const std::string& line, int64_t from_step) {
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (!j.is_object() || j.contains("event")) return false;
  const auto step = j.find("step");
  return step != j.end() && step->is_number_integer() && step->get<int64_t>() >= from_step;
}

std::string format_seconds(double s) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6f", s);
  return buf;
}

}  // namespace

RestartPoint find_restart_point(const std::string& checkpoint_dir, const std::string& resume_dir,
                                const std::string& run_id) {
  if (!checkpoint_dir.empty() && checkpoint_exists(checkpoint_dir)) {
    const CheckpointIndex index = load_checkpoint_index(checkpoint_dir);
    const auto id = index.meta.find("run_id");
    if (id != index.meta.end() && id->is_string() && id->get<std::string>() == run_id)
      return {index.step, checkpoint_dir};
  }
  if (!resume_dir.empty() && checkpoint_exists(resume_dir)) return {load_checkpoint_index(resume_dir).step, resume_dir};
  if (!resume_dir.empty()) load_checkpoint_index(resume_dir);  // throws its "no checkpoint" error
  return {};
}

std::vector<std::string> with_resume(const std::vector<std::string>& args, const std::string& dir) {
  if (dir.empty()) return args;
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--resume") ++i;
    else if (args[i].rfind("--resume=", 0) != 0) out.push_back(args[i]);
  }
  out.insert(out.end(), {"--resume", dir});
  return out;
}

std::string lost_host(const std::string& report) {
  static const std::string kHead = "[heartbeat] host ";
  const size_t at = report.find(kHead);
  if (at == std::string::npos) return "";
  const size_t start = at + kHead.size(), space = report.find(' ', start);
  // "H (ranks a-b) ...", or "H (this host) ..." from the host that lost the others.
  if (space == std::string::npos ||
      (report.compare(space, 8, " (ranks ") != 0 && report.compare(space, 13, " (this host) ") != 0))
    return "";
  return report.substr(start, space - start);
}

Hostfile without_host(const Hostfile& hostfile, const std::string& host) {
  Hostfile out;
  out.path = hostfile.path;
  for (const HostSlots& h : hostfile.hosts)
    if (h.name != host) out.hosts.push_back(h);
  return out;
}

void replan_for_hosts(const ReplanInputs& in, const Hostfile& hosts, int64_t nproc, const std::string& out) {
  const std::string what = "[launch] re-plan for the " + std::to_string(nproc) + " ranks of hosts " + hosts.summary();
  try {
    const Strategy old = load_strategy(in.strategy_path);
    int64_t batch = 0;
    for (const Pipeline& p : old.pipelines) batch += static_cast<int64_t>(p.micro_batch_size) * p.micro_batches;
    // A node per host with its ranks under --map-by slot; one generic device
    // type (memory ample: the launcher cannot know the devices' facts).
    nlohmann::json nodes = nlohmann::json::array();
    int64_t next = 0;
    for (const HostSlots& h : hosts.hosts) {
      const int64_t n = std::min(h.slots, nproc - next);
      if (n <= 0) break;
      nodes.push_back({{"type", "host"}, {"ranks", {next, next + n - 1}}});
      next += n;
    }
    const nlohmann::json cluster = {
        {"catalog", {{"host", {{"tflops", 1}, {"memory_gib", 1024}, {"intra_node_gbps", 100}, {"inter_node_gbps", 1}}}}},
        {"nodes", nodes}};
    const CostModel model(ModelConfig::load(in.model_path), Topology::from_json(cluster));
    SearchOptions so;
    so.global_batch = static_cast<int>(batch);
    so.seq_len = in.seq_len;
    so.zero = old.zero;
    so.schedule = old.schedule;
    so.time_limit_s = 10;
    so.top_k = 1;
    const SearchResult r = search_strategy(model, so);
    if (r.best.empty()) fail("no strategy found");
    std::ofstream f(out);
    f << to_json(r.best.front().strategy).dump(2) << "\n";
    if (!f) fail("cannot write ", out);
  } catch (const Error& e) {
    fail(what, ": ", e.what());
  }
}

std::vector<std::string> with_strategy(const std::vector<std::string>& args, const std::string& path) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--strategy" && i + 1 < args.size()) out.insert(out.end(), {args[i], path}), ++i;
    else if (args[i].rfind("--strategy=", 0) == 0) out.push_back("--strategy=" + path);
    else out.push_back(args[i]);
  }
  return out;
}

RestartLog::RestartLog(std::string path) {
  if (path.empty()) return;
  // Symbolic links are followed (the rename replaces the file, not the
  // link); a device such as /dev/null is written in place by the ranks and
  // left alone here.
  struct stat st {};
  char real[PATH_MAX];
  if (stat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode) || realpath(path.c_str(), real) == nullptr) return;
    path = real;
  }
  path_ = path;
}

void RestartLog::begin(int64_t attempt, int64_t from_step, const std::string& reason, double detect_s) {
  if (path_.empty()) return;
  const std::string old = read_all(path_);
  std::string kept;
  for (size_t at = 0, nl; (nl = old.find('\n', at)) != std::string::npos; at = nl + 1) {
    const std::string line = old.substr(at, nl - at);
    if (!rerun_step(line, from_step)) kept += line + "\n";
  }
  const std::string detect = detect_s >= 0 ? format_seconds(detect_s) : "null";
  kept += "{\"event\":\"restart\",\"attempt\":" + std::to_string(attempt) +
          ",\"from_step\":" + std::to_string(from_step) + ",\"reason\":" + nlohmann::json(reason).dump() +
          ",\"detect_s\":" + detect + ",\"recovery_s\":";
  slot_offset_ = kept.size();
  kept += "null" + std::string(kSlotWidth - 4, ' ') + "}\n";
  replace_file(path_, kept);
  kept_ = kept;
  from_step_ = from_step;
  recovery_set_ = false;
}

void RestartLog::set_recovery(double seconds) {
  if (path_.empty() || from_step_ < 0 || recovery_set_) return;
  std::string value = format_seconds(seconds);
  value.resize(kSlotWidth, ' ');
  kept_.replace(slot_offset_, kSlotWidth, value);
  recovery_set_ = true;
  if (from_step_ == 0) return;
  const int fd = open(path_.c_str(), O_WRONLY | O_CLOEXEC);
  const bool ok = fd >= 0 && pwrite(fd, value.data(), value.size(), static_cast<off_t>(slot_offset_)) ==
                                 static_cast<ssize_t>(value.size());
  if (fd >= 0) close(fd);
  if (!ok) std::fprintf(stderr, "hspmd: warning: [launch] --log %s: cannot write the restart's recovery_s\n",
                        path_.c_str());
}

void RestartLog::end() {
  if (path_.empty() || from_step_ < 0) return;
  const std::string now = read_all(path_);
  if (now.compare(0, kept_.size(), kept_) != 0) replace_file(path_, kept_ + now);
  from_step_ = -1;
}

}  // namespace hspmd::cli
