// Restarting a `--nproc` job after a rank died (`--max-restarts K`,
// docs/reliability.md, "Restart after a crash"): where the new attempt
// resumes, its ranks' flags, and the launcher's edits of the `--log` file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hostfile.h"

namespace hspmd::cli {

// Where a restarted job continues.
struct RestartPoint {
  int64_t step = 0;        // the first step the new attempt runs
  std::string resume_dir;  // its --resume directory; "" = from the start
};

// The committed checkpoint of `checkpoint_dir` when there is one that this
// run committed (its meta.run_id is `run_id`), else the run's own --resume
// directory `resume_dir` when given, else the start: a checkpoint of another
// run is never resumed. Throws hspmd::Error when the chosen index.json
// cannot be loaded (malformed, a shard file missing).
RestartPoint find_restart_point(const std::string& checkpoint_dir, const std::string& resume_dir,
                                const std::string& run_id);

// `args` with every --resume (`--resume D`, `--resume=D`) removed and
// `--resume dir` appended; unchanged when dir is "".
std::vector<std::string> with_resume(const std::vector<std::string>& args, const std::string& dir);

// Restarting without a lost host (docs/multi_host.md, "Restart without a
// lost host"): what `hspmd train --strategy` gives the launcher to re-plan.
struct ReplanInputs {
  std::string model_path;     // --model
  std::string strategy_path;  // --strategy ("" = none: no re-plan)
  int64_t seq_len = 0;        // --seq-len
};

// The host that a heartbeat report names as lost ("[heartbeat] host H
// (ranks a-b) ...", or "[heartbeat] host H (this host) ...": the host that
// heard none of the others); "" for any other report.
std::string lost_host(const std::string& report);

// The hostfile without `host`.
Hostfile without_host(const Hostfile& hostfile, const std::string& host);

// Plans the strategy's model, global batch, schedule and ZeRO setting for
// `nproc` ranks on `hosts` (a node per host, its ranks as mpirun maps them,
// one generic device type: the launcher knows no device facts) with the
// planner's search, and writes the best strategy to `out`. Throws
// hspmd::Error "[launch] re-plan ...: <why>" when it cannot.
void replan_for_hosts(const ReplanInputs& in, const Hostfile& hosts, int64_t nproc, const std::string& out);

// `args` with the value of --strategy (`--strategy S`, `--strategy=S`)
// replaced by `path`.
std::vector<std::string> with_strategy(const std::vector<std::string>& args, const std::string& path);

// The launcher's edits of the --log file across restarts. Only called while
// no rank of the job runs, except set_recovery (see there).
class RestartLog {
 public:
  explicit RestartLog(std::string path);  // "" = no log: every call does nothing

  // Before restart number `attempt` from `from_step`: drops the step records
  // (objects with a "step" and no "event") of steps >= from_step and a torn
  // last line, keeps every other line as it is, and appends
  // {"event": "restart", "attempt", "from_step", "reason", "detect_s",
  // "recovery_s": null} (detect_s < 0 is written as null: the death was not
  // seen). Throws hspmd::Error when the log cannot be read or
  // replaced (it is rewritten through a temporary file and a rename).
  void begin(int64_t attempt, int64_t from_step, const std::string& reason, double detect_s);

  // Sets the pending record's recovery_s. With from_step > 0 the ranks only
  // append to the log (they resume), so the value is written into the
  // record's padded slot in place at once; from the start, rank 0 truncates
  // the log as a fresh run does, and end() puts the record back.
  void set_recovery(double seconds);

  // After the attempt: when rank 0 started the log anew, writes the lines
  // kept by begin() (with the restart record) in front of what it wrote.
  void end();

 private:
  std::string path_;
  std::string kept_;         // the log as begin() left it
  size_t slot_offset_ = 0;   // where the record's recovery_s value starts
  int64_t from_step_ = -1;   // -1: no record pending
  bool recovery_set_ = false;
};

}  // namespace hspmd::cli
