// The planner's cost model (docs/planner.md "Cost model"): predicted compute,
// communication, pipeline bubble, step time and memory of every rank for a
// strategy on a cluster.
//
// Compute comes from a measured profile (planner/profile.h) times the rank's
// emulation slowdown, or, for a device type with no profile, from a roofline
// (FLOPs / (tflops x efficiency)). Communication is an alpha-beta model over
// the topology's links, with the volumes the resolver gives this system's
// reshards (fp32 activations and gradients). Each pipeline is simulated with
// its schedule (1F1B or GPipe), stage by stage and micro-batch by
// micro-batch; gradient synchronisation, the optimizer step and the ZeRO
// gather follow. The step time is the slowest rank's.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/models/config.h"
#include "hspmd/models/model.h"
#include "hspmd/planner/profile.h"
#include "hspmd/plan/strategy.h"
#include "hspmd/resolve/topology.h"

namespace hspmd {

struct MemoryBreakdown {
  double params = 0;       // the compute copy of the rank's parameters
  double grads = 0;        // raw (accumulated) and synchronised gradients
  double optimizer = 0;    // Adam moments, and the fp32 master shard under ZeRO
  double activations = 0;  // what the schedule keeps alive for the backward
  double total() const { return params + grads + optimizer + activations; }
};

struct RankCost {
  int rank = 0;
  int pipeline = -1, stage = -1;  // -1: idle
  double compute_s = 0;  // forward, backward (and recomputation), optimizer
  double comm_s = 0;     // reshards and op-internal collectives, stage sends, gradient sync, ZeRO gather
  double bubble_s = 0;   // waiting: step_s - compute_s - comm_s
  double step_s = 0;     // when the rank's step ends
  MemoryBreakdown memory;
  double capacity_bytes = 0;  // device memory (or emulation cap); 0 = unknown
};

struct CostReport {
  double predicted_step_s = 0;
  std::vector<RankCost> ranks;       // every rank of the world
  std::vector<double> pipeline_s;    // when each pipeline's last backward ends
  std::vector<std::string> notes;    // extrapolations and assumptions used
  // The rank whose memory exceeds its capacity by the most bytes, or -1.
  int overflow_rank() const;
  nlohmann::json to_json() const;  // {"predicted_step_s", "ranks": [{"rank", "compute_s", ...}], ...}
};

// One stage's cost per micro-batch, on its slowest rank.
struct StageCost {
  double fwd = 0, bwd = 0;            // compute (bwd includes the recomputed forward)
  double fwd_comm = 0, bwd_comm = 0;  // collectives inside the stage's forward / backward
  double send_fwd = 0, send_bwd = 0;  // sending the activation on / the gradient back
  // One micro-batch through the stage: compute and the stage's collectives.
  double piece() const { return fwd + bwd + fwd_comm + bwd_comm; }
};

// How a search describes a stage without building a Strategy.
struct StageShape {
  std::vector<int> ranks;  // tp x cp ranks
  int cp = 1;
  int layers = 1;
  bool first = false, last = false;  // holds the embedding / the head
  bool recompute = false;
  // Expert parallelism (docs/moe.md): the stage's sparse layers, the
  // strategy's expert_parallel, and the ranks of the expert group of the
  // stage's first rank (the strategy's expert_groups).
  int sparse_layers = 0;
  int expert_parallel = 1;
  std::vector<int> expert_group;
  int tp() const { return static_cast<int>(ranks.size()) / cp; }
};

class CostModel {
 public:
  // `profiles`: device type name -> its profile (types absent use `fallback`;
  // with no fallback either, the roofline). Every profile must be of the
  // model's dimensions (throws "[cost] ..." otherwise).
  CostModel(ModelConfig model, Topology topology,
            std::map<std::string, std::shared_ptr<const Profile>> profiles = {},
            std::shared_ptr<const Profile> fallback = nullptr);
  // Loads the catalog's profiles (DeviceSpec::profile) and, when
  // `profile_path` is not empty, a fallback profile for the other types.
  static CostModel load(const ModelConfig& model, const Topology& topology, const std::string& profile_path);

  const ModelConfig& model() const { return model_; }
  const Topology& topology() const { return topology_; }

  // Seconds of one profiled part ("block_fwd", ... kProfileParts) on `rank`
  // at tp x cp for a micro-batch of b sequences of s tokens.
  double part_seconds(int rank, const std::string& part, int tp, int cp, int64_t s, int64_t b) const;
  // The optimizer step over n fp32 parameters on `rank`.
  double optimizer_seconds(int rank, int64_t n) const;
  // Whether `rank`'s device is timed from a profile (else the roofline).
  bool profiled(int rank) const;
  // Whether `rank` overlaps its gradient sync with its last backward, as
  // hspmd train does by default on a device (--overlap, docs/comm.md): a
  // roofline GPU, or one profiled on CUDA (`hspmd profile --device cuda`);
  // not a rank profiled on the CPU, which syncs after its schedule.
  bool overlaps_grad_sync(int rank) const;
  // Throws "[plan] <cluster>: rank R (device type T) is emulated on this CPU
  // ... but has no profile ..." in one line when a rank whose node gives
  // "slowdown" or "memory_cap_gib" (a device emulated on this CPU) would be
  // timed by the catalog's roofline: its tflops say nothing about this CPU,
  // and the emulator would then measure something else entirely.
  void require_profiles_for_emulation(const std::string& cluster) const;
  // Bytes of an activation element on `rank`: 4 on a device profiled in
  // fp32, 2 on one profiled in bf16 (--precision bf16 carries bf16
  // activations) and on a roofline device (bf16 mixed precision, as its
  // tflops are bf16 figures).
  double activation_element_bytes(int rank) const;

  // Alpha-beta times. `bytes` is what each member sends (ring collectives:
  // the (n-1)/n share already applied by the caller or not, see .cc).
  double link_seconds(int a, int b, double bytes) const;
  double group_seconds(const std::vector<int>& ranks, double bytes_per_member) const;

  // Per micro-batch cost of a stage (slowest rank), and the link cost of
  // sending the activation from stage `from` to stage `to`.
  StageCost stage_cost(const StageShape& stage, int64_t s, int64_t b) const;
  // One rank's (forward, backward) compute per micro-batch on the stage, at
  // its own speed (the backward includes a recomputed forward).
  std::pair<double, double> rank_compute(int rank, const StageShape& stage, int64_t s, int64_t b) const;
  double boundary_seconds(const StageShape& from, const StageShape& to, int64_t s, int64_t b) const;

  // Parameters (elements) one rank of the stage holds.
  int64_t stage_params(const StageShape& stage) const;
  int64_t layer_params() const { return layer_params_; }   // one block, unsharded
  int64_t layer_tp_params() const { return layer_tp_params_; }  // the part of it TP splits
  // Activation bytes one micro-batch keeps alive on a rank of the stage.
  double activation_bytes(const StageShape& stage, int64_t s, int64_t b) const;
  // Memory of a rank of the stage: `in_flight` micro-batches alive at once;
  // `zero_share` = how many ranks share its optimizer states (1 without ZeRO).
  MemoryBreakdown stage_memory(const StageShape& stage, int64_t s, int64_t b, int in_flight,
                               double zero_share, bool zero) const;
  double capacity_bytes(int rank) const;

  CostReport evaluate(const Strategy& strategy, int64_t seq_len) const;

 private:
  const Profile* profile_of(int rank) const;
  // (latency of a ring over the group, seconds per byte on its slowest link).
  std::pair<double, double> group_link(const std::vector<int>& ranks) const;
  double roofline_seconds(int rank, const std::string& part, int tp, int cp, int64_t s, int64_t b) const;

  ModelConfig model_;
  Topology topology_;
  std::map<std::string, std::shared_ptr<const Profile>> profiles_;
  std::shared_ptr<const Profile> fallback_;
  int64_t layer_params_ = 0, layer_tp_params_ = 0, embed_params_ = 0, head_params_ = 0, head_rep_params_ = 0;
  ModelFamily::LayerCompute layer_compute_;  // the roofline's matmul parameters per token and layer
  int64_t expert_params_ = 0;                // every expert's weights of one sparse layer
  mutable std::vector<std::string> notes_;
};

}  // namespace hspmd
