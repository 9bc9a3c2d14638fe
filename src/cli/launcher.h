// `hspmd train --nproc N`: the launcher that runs the ranks under mpirun and
// supervises them, and its counterpart inside each rank (docs/execution.md,
// "Supervision").
//
// The launcher and its ranks share a job directory (HSPMD_JOB_DIR):
//  * `alive`: a FIFO the launcher holds open for writing; a rank's watcher
//    thread sees its hang-up when the launcher is gone (even killed with
//    SIGKILL) and ends the rank. PR_SET_PDEATHSIG cannot be used: the ranks
//    are children of mpirun, not of the launcher.
//  * `heartbeat`: one slot per rank (pid, a tick of its watcher thread, the
//    last finished step and when) that the launcher's watchdog reads.
//  * `report`: created by the first rank that prints its error, so that a
//    job fails with one message.
//  * `exit`: "R C", left by the first rank whose process exits with a
//    failure status C while MPI is up; it then calls MPI_Abort instead of
//    waiting in MPI_Finalize for ranks that wait for it
//    (src/comm/mpi_communicator.cc).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "hostfile.h"
#include "restart.h"

namespace hspmd::cli {

struct LaunchOptions {
  int64_t nproc = 1;
  std::vector<std::string> rank_args;  // the `train` flags of every rank (without --nproc)
  double timeout_s = 300;              // watchdog: a step's allowance; 0 turns it off
  int64_t max_restarts = 0;            // restarts after a rank's death by a signal
  std::string log_path;                // the ranks' --log ("" = none): rewritten at a restart
  std::string checkpoint_dir;          // the ranks' --checkpoint: a restart resumes from it
  std::string resume_dir;              // the ranks' own --resume ("" = none)
  // What every rank runs before rank_args: empty for this executable's
  // `train` (hspmd train --nproc); `hspmd launch` gives {python, script}.
  std::vector<std::string> command;
  // --hostfile: the hosts (no host = this machine alone). mpirun then reads
  // them (with --map-by slot), starts the other hosts' ranks through its rsh
  // agent (ssh, or OMPI_MCA_plm_rsh_agent: scripts/netns_cluster.sh for the
  // test hosts), uses TCP between hosts and shared memory within one, and
  // passes the launcher's HSPMD_* variables to every rank.
  Hostfile hostfile;
  // hspmd train --strategy: when the heartbeat between hosts ends an attempt
  // naming a lost host, --max-restarts restarts on the other hosts under a
  // strategy re-planned for them (docs/multi_host.md, "Restart without a
  // lost host"). Empty strategy_path: no such restart.
  ReplanInputs replan;
};

// The most ranks (processes) one job may run on this machine: 32 per core.
// Beyond that the ranks measure the scheduler (1,000 ranks on 2 cores ran
// the machine to a load of 199).
int64_t max_local_ranks();

// The one bound on local process counts: hspmd::Error "<what> <n> must lie
// in [<least>, max_local_ranks()] on this machine (32 per core: each rank is
// a process here)" otherwise. `hspmd launch --nproc`, `hspmd train --nproc`
// (launch_ranks) and `hspmd profile --emulated-ranks` go through it.
void check_local_ranks(const std::string& what, int64_t n, int64_t least);

// hspmd::Error "[flags] --max-restarts must be >= 0, got K" when k < 0.
void check_max_restarts(int64_t k);

// The executable `name` as execvp would find it on PATH; "" when none is.
std::string find_in_path(const std::string& name);

// This process's executable (/proc/self/exe); hspmd::Error when unknown.
std::string self_executable();

// Runs `mpirun -np N hspmd train <rank_args>` (or `<command> <rank_args>`)
// in its own process group and
// returns the job's exit code: 0 when every rank succeeded; 1 when a rank
// failed (its error, or "[launch] rank R was killed by signal S", printed
// once; "rank R on host H" under a hostfile) or the watchdog ended the job;
// 128+S when the launcher got SIGINT or SIGTERM (forwarded to mpirun, which
// ends the ranks; SIGKILL after 10 s).
// mpirun gets SIGTERM when the launcher dies however (PR_SET_PDEATHSIG), so a
// killed launcher takes its ranks with it. Throws hspmd::Error when mpirun
// cannot be started or options.nproc fails check_local_ranks (without a
// hostfile) or check_hostfile_ranks (with one).
int launch_ranks(const LaunchOptions& options);

// `hspmd launch [--nproc N] [--hostfile F] [--timeout S] [--max-restarts K]
// [--python PY] script.py [args]`: launch_ranks running `PY script.py args`
// on N ranks (default: the hostfile's slots), with PYTHONPATH starting at
// the hspmd module's directory (build/python in a build tree). A rank
// killed by a signal restarts the script from its start, at most K times.
int launch_command(const std::vector<std::string>& args);

// Whether this rank prints its failure: under the launcher, only the first
// failing rank of the job; otherwise always. `message`, the line the rank
// prints (without its newline), is kept with the claim: the launcher prints
// it itself when the rank's own output was lost (mpirun tearing the job
// down at the abort before it relayed the line).
bool claim_report(const std::string& message = "");

// A rank's side of the supervision: when started by the launcher, a thread
// that ends this process (exit 1) once the launcher is gone and ticks the
// rank's heartbeat; step_done() records progress. Without the launcher,
// does nothing.
class RankSupervision {
 public:
  explicit RankSupervision(int rank);
  ~RankSupervision();
  RankSupervision(const RankSupervision&) = delete;
  RankSupervision& operator=(const RankSupervision&) = delete;

  // Records that `step` has finished on this rank (thread-safe, cheap).
  void step_done(int64_t step);

 private:
  void watch();
  [[noreturn]] void launcher_gone();

  struct Slot* slot_ = nullptr;
  size_t map_bytes_ = 0;
  void* map_ = nullptr;
  int fifo_ = -1;
  int rank_ = 0;
  int launcher_pid_ = 0;
  std::string dir_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace hspmd::cli
