// A distributed run's step records (docs/training.md, "The log"): what each
// rank measured in a step, gathered into the step's record, and the JSON
// lines of --log (rank 0 writes them).
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/tcp_traffic.h"
#include "hspmd/comm/communicator.h"
#include "hspmd/exec/exec_graph.h"
#include "hspmd/exec/virtual_clock.h"
#include "hspmd/train/trainer.h"

namespace hspmd::dist {

// What one rank measured in a step; every field an int64, gathered from all
// ranks in one all-gather.
struct StepMetrics {
  int64_t bytes_sent = 0;         // all communication
  int64_t reshard_sent = 0;       // inside Reshards, measured ...
  int64_t reshard_predicted = 0;  // ... and as the resolutions predict
  int64_t op_sent = 0;            // inside ops, measured ...
  int64_t op_predicted = 0;       // ... and as Op::traffic predicts
  int64_t clock_ns = 0;           // emulation: the virtual clock at the step's end
  int64_t compute_ns = 0;         // emulation: virtual compute so far
  int64_t peak_bytes = 0;         // peak bytes of tensors in the step
  int64_t activation_bytes = 0;   // the micro-batches' peak above what the rank held before them
  int64_t grad_sync_ns = 0;       // wall time of the gradient synchronization after the schedule
  int64_t sm_percent = 0;         // CUDA MPS: the rank's share of the GPU's SMs (0: none set)
  int64_t grad_sync_overlapped = 0;  // gradients handed to the communication thread during the backward
  int64_t attention_fallbacks = 0;   // attention calls cuDNN did not take so far (CUDA, bf16 products)
  int64_t expert_sent = 0;           // expert parallelism's token exchange, measured ...
  int64_t expert_predicted = 0;      // ... and as the resolver predicted it from the routing counts
};

// The step's measurements across ranks: this rank's metrics (with the
// warning, once, when attention fell back from cuDNN), gathered into the
// record; under emulation the step is the cluster's, from the last rank's
// end to the last rank's end, and compute is each rank's since the last step.
//
// Across hosts (docs/multi_host.md): when the job's ranks run on more than
// one host (Open MPI's local size below its world size), each record also
// holds what every rank sent to other hosts since the record before (the
// first: since the meter was made, so it includes the setup's traffic), as
// its TCP sockets count it, gathered in one more all-gather. On one host
// nothing of it runs.
class StepMeter {
 public:
  // Reads this process's TCP counters when the job spans hosts (no
  // communication).
  explicit StepMeter(Communicator& world);
  // This rank's metrics after the step: the communicator's and the graph's
  // counters, the clock, the allocator's peak; `activations` and the sync's
  // figures as the step measured them.
  StepMetrics measure(const ExecGraph& graph, const VirtualClock* clock, int64_t extra_sent, size_t activations,
                      double grad_sync_s, int64_t overlapped);
  // Collective: every rank's metrics into `r`.
  void fill(const StepMetrics& mine, const VirtualClock* clock, StepRecord& r);
  // The emulated end of the step before (ns): a switch or rollback moves it
  // to the clock's now; bucket switching keeps a step's switches in it.
  int64_t emulated_end() const { return emulated_end_; }
  void set_emulated_end(int64_t ns) { emulated_end_ = ns; }

 private:
  // Collective: every rank's TCP bytes and segments to other hosts since the
  // last record into `r` (read after the step's own metrics were gathered).
  void fill_cross_host(StepRecord& r);

  Communicator& world_;
  bool warned_attention_fallback_ = false;  // the warning of a cuDNN attention fallback, once
  int64_t emulated_end_ = 0;                // ns, the previous step's end
  std::vector<int64_t> emulated_compute_;   // ns, per rank, up to the previous step
  bool spans_hosts_ = false;                // the job's ranks run on more than one host
  TcpTraffic tcp_;                          // this process's TCP counters at the last record
};

// --log: one JSON line per record, each stamped with the wall-clock time it
// was written (seconds since the epoch: spans between records, and across a
// restart, are measured on one clock). Only rank 0 opens the file; writes
// elsewhere do nothing. A write error ends the run.
class StepLog {
 public:
  // `append`: a resumed run adds to the log of the steps before.
  void open(const std::string& path, int rank, bool append);
  void write(const nlohmann::json& record);
  // A rollback to step `back`: the records of the steps trained again go
  // (every event record stays).
  void drop_steps_from(int64_t back);

 private:
  std::string path_;
  std::ofstream out_;
};

}  // namespace hspmd::dist
