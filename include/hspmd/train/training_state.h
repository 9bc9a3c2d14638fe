// TrainingState: one rank's whole training state under one annotation plan
// (docs/switching.md) — per parameter its local slots (the compute copy,
// with ZeRO the FP32 master shard, and Adam's moments), each a known box of
// a known layout, plus the step counter and the data cursor. A value: it can
// be resharded to another plan (a plan switch), saved as a sharded training
// checkpoint and loaded from one under any plan and world.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "hspmd/core/ndarray.h"
#include "hspmd/plan/plan.h"
#include "hspmd/plan/switch.h"

namespace hspmd {

class Communicator;
class CheckpointReader;
class VirtualClock;

// One local array of a slot and the global box it holds.
struct Shard {
  Box box;
  NDArray data;  // f32, contiguous, shape == box.shape(); invalid when the rank holds none
  bool held() const { return data.valid(); }
  // Whether the plan gives the rank this slot at all (`box` is set).
  bool placed() const { return !box.begin.empty(); }
};

// What a switch did on this rank (for the log's switch record).
struct SwitchReport {
  int64_t bytes_sent = 0;            // measured by the communicator's counters
  int64_t predicted_bytes = 0;       // the switch plan's
  int64_t checkpoint_bytes = 0;      // read from the checkpoint
  int64_t peak_extra_bytes = 0;      // the allocator's peak above max(old, new) state
  int64_t bound_bytes = 0;           // switch_memory_bound (plan/switch.h) for this rank
  double switch_s = 0;               // wall time of the transfer
  double emulated_s = 0;             // under a clock: virtual seconds from the switch's start
};


class TrainingState {
 public:
  // The state of `rank` under `plan` from full tensors (Hugging Face names;
  // vocabulary tables with the model's real row count, padded here to the
  // plan's table_rows with zero rows): its boxes of every slot, zero moments.
  static TrainingState from_full(std::shared_ptr<const AnnotationPlan> plan, int rank,
                                 const std::map<std::string, NDArray>& full);

  const AnnotationPlan& plan() const { return *plan_; }
  std::shared_ptr<const AnnotationPlan> plan_ptr() const { return plan_; }
  int rank() const { return rank_; }
  // The slot's shard of `param` (an empty Shard when not held; kMaster is
  // held only under ZeRO). Throws InternalError for an unknown parameter.
  Shard& slot(const std::string& param, StateSlot slot);
  const Shard& slot(const std::string& param, StateSlot slot) const;
  // The array the optimizer updates: the master shard under ZeRO, else the
  // compute copy.
  Shard& optimized(const std::string& param);
  bool zero(const std::string& param) const { return plan_->optimizer_states.count(param) > 0; }
  // Bytes of every array this rank holds.
  int64_t bytes() const;
  // The device its arrays live on: the host until move_to_device, then that
  // device, held even when the rank holds no array (an idle rank of one
  // plan receives its arrays there at a switch); a switch's new state keeps it.
  Device device() const { return device_; }
  // Moves every held shard to `device` (a copy on its default stream; shards
  // already there stay). A state is made and loaded on the host; a run on a
  // GPU moves it once.
  void move_to_device(Device device);

  int64_t step = 0;        // optimizer steps taken (Adam's bias-correction count)
  int64_t samples = 0;     // data cursor: samples the steps so far consumed
  uint64_t seed = 0;       // the initialization seed (no other randomness in training)

  // Executes `sp` (planned from this state's plan to `to`, same world) on
  // this rank and returns the state under `to`. Every rank of `world` calls
  // it with the same plan. Slices marked as checkpoint reads come from
  // `checkpoint` (required then). Old arrays of a round are freed when the
  // round ends, so the memory above max(old, new) stays within the round's
  // new holdings and buffers. With `clock`, advances it like the emulated
  // cluster would (packing as compute, transfers over the topology).
  // Throws hspmd::Error on communication or checkpoint failures.
  TrainingState reshard_to(std::shared_ptr<const AnnotationPlan> to, const SwitchPlan& sp,
                           const Topology& topology, Communicator& world, CheckpointReader* checkpoint,
                           VirtualClock* clock, SwitchReport* report) &&;

  // Loads the state of `rank` under `plan` from a checkpoint (a switch whose
  // only source is the checkpoint; no communication).
  static TrainingState load(std::shared_ptr<const AnnotationPlan> plan, int rank, CheckpointReader& checkpoint);
  // This rank's part of a checkpoint: the state tensors (weights from the
  // optimized slot, both moments) of which it holds the representative copy.
  struct NamedShard {
    std::string tensor;
    Shape shape;
    Shard shard;
  };
  std::vector<NamedShard> checkpoint_shards() const;

 private:
  TrainingState(std::shared_ptr<const AnnotationPlan> plan, int rank);
  void run_round(const SwitchRound& round, const SwitchPlan& sp, TrainingState& next, const Topology& topology,
                 Communicator& world, CheckpointReader* checkpoint, VirtualClock* clock, SwitchReport& rep);
  void copy_local(const RankSwitchRound& r, const SwitchPlan& sp, TrainingState& next,
                  CheckpointReader* checkpoint, SwitchReport& rep) const;
  std::shared_ptr<const AnnotationPlan> plan_;
  int rank_ = 0;
  Device device_ = Device::cpu();
  std::map<std::string, std::array<Shard, 4>> params_;  // indexed by StateSlot
};

}  // namespace hspmd
