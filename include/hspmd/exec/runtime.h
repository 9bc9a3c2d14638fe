// Per-device specialization (paper §6.2, "specialize one executable graph
// per device"): one annotation plan made executable on this rank. The
// runtime builder builds the rank's ExecGraph, creates every communicator
// group its Reshards and ops use (collectively, in one global order),
// discovers the pipelines from the resolved plan and places the rank in
// one, and forms its gradient-sync buckets. A trainer holds one Runtime per
// plan it may run (a switch builds the next beside the last).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hspmd/comm/communicator.h"
#include "hspmd/exec/exec_graph.h"
#include "hspmd/exec/grad_sync.h"
#include "hspmd/exec/virtual_clock.h"
#include "hspmd/plan/plan.h"
#include "hspmd/plan/strategy.h"

namespace hspmd {

// The pipeline `rank` belongs to under `s`, or -1 when idle.
int pipeline_of(const Strategy& s, int rank);

// One plan made executable on this rank: its ExecGraph and what the step
// needs (the pipeline and stage of the rank, micro-batches, the gradient
// buckets).
struct Runtime {
  std::shared_ptr<const AnnotationPlan> plan;
  Strategy strategy;                 // execution: schedule, micro-batches, recompute
  std::unique_ptr<ExecGraph> graph;
  std::vector<GradBucket> grad_buckets;  // grad_buckets(*graph), formed once
  std::map<std::string, Shape> shapes;   // parameters' global shapes (vocabulary padded for the plan)
  std::map<std::string, DType> gather_dtypes;  // ZeRO-1 gathers (zero_gather_dtypes)
  int pipeline = -1;
  int stage = 0, stages = 1;         // this rank's stage and its pipeline's stage count
  int64_t granularity = 1;           // every micro-batch's sequence length is a multiple of it
  int micro_batches() const { return pipeline < 0 ? 0 : strategy.pipelines[pipeline].micro_batches; }
};

// What specialization needs besides the plan: the world and the cluster,
// the longest sequence (rounded up to the plan's granularity), the device,
// and under emulation the clock, its op-time model and the rank's memory cap.
struct SpecializeOptions {
  std::shared_ptr<const Topology> topology;
  int64_t seq_len = 0;
  Device device = Device::cpu();
  VirtualClock* clock = nullptr;
  std::shared_ptr<const OpTimeModel> time_model;
};

// Collective over the ranks the plan's groups hold (creating a group is).
// Throws the deduction's, resolver's and pipeline discovery's errors.
std::unique_ptr<Runtime> specialize(std::shared_ptr<const AnnotationPlan> plan, Communicator& world,
                                    const SpecializeOptions& o);

}  // namespace hspmd
