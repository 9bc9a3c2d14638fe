// CUDA MPS partitions of one GPU for the ranks of a job (`hspmd train
// --nproc N --mps-percent P0,...`, docs/cuda.md "Partitions of one GPU"):
// real heterogeneous devices on one machine, each rank limited to a share of
// the GPU's SMs by the MPS server.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "hspmd/core/device.h"

namespace hspmd::cli {

// "50,25,25": one percentage of the SMs in [1, 100] per rank, nproc of them,
// for ranks on `device` (a CUDA device, or the test double cpu:1); anything
// else throws "[flags] --mps-percent ...".
std::vector<int> parse_mps_percents(const std::string& text, int64_t nproc, Device device);

// The launcher's side: starts an MPS control daemon (nvidia-cuda-mps-control
// -d, or the program named by HSPMD_MPS_CONTROL) with private pipe and log
// directories (CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY, exported to
// the ranks with HSPMD_MPS_PERCENTS), and stops it ("quit" on its control
// pipe) and removes the directories when destroyed: after the job, whether
// it succeeded, failed, or was stopped by SIGINT / SIGTERM (the launcher
// returns then). A guardian process (a shell in a session of its own)
// waits for this process to end and then stops the daemon, so a launcher
// killed outright (SIGKILL, its process group killed) does not leave it
// running either. Throws "[launch] --mps-percent: ..." when the daemon does
// not start.
class MpsDaemon {
 public:
  explicit MpsDaemon(const std::vector<int>& percents);
  ~MpsDaemon();
  MpsDaemon(const MpsDaemon&) = delete;
  MpsDaemon& operator=(const MpsDaemon&) = delete;

 private:
  std::string control_, dir_;
  pid_t guardian_ = 0;  // see start_guardian in mps.cc
};

// The rank's side, first thing in main(): under a launcher that set
// HSPMD_MPS_PERCENTS, sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE to this rank's
// entry (the MPI rank's) before any CUDA call.
void apply_mps_partition();

}  // namespace hspmd::cli
