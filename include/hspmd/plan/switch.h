// Dynamic graph switching (docs/switching.md): the plan that moves a run's
// training state (weights, FP32 master weights, Adam moments) from the
// layouts of one annotation plan to those of another with batched
// send/receive over finest slices. A pure function of the holdings and the
// topology: no process, no MPI. The trainer executes it
// (train/switch_exec), `hspmd plan switch` reports it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/annotation/annotation.h"
#include "hspmd/core/dtype.h"
#include "hspmd/resolve/topology.h"

namespace hspmd {

struct AnnotationPlan;

// naive: every slice a needer does not hold comes from its lowest-ranked
//   owner, one BSR round per tensor (the paper's baseline);
// per-tensor: one BSR round per tensor, each with the sender heuristics of
//   fused but its own load counters;
// fused: one BSR round per bucket for all its tensors, load counted over the
//   whole switch: same-node owners first, then the owner whose link load
//   (bytes sent so far / link bandwidth, intra- and inter-node counted
//   separately) is least, then the lowest rank.
enum class SwitchAlgorithm { kNaive, kPerTensor, kFused };
std::string algorithm_name(SwitchAlgorithm algorithm);  // "naive", "per-tensor", "fused"
// Throws hspmd::Error "[flags] <flag>: unknown switch algorithm '<s>' (expected naive, per-tensor or fused)".
SwitchAlgorithm parse_switch_algorithm(const std::string& s, const std::string& flag = "--switch-algorithm");

// Local arrays a rank keeps for one parameter (a "slot" of its state).
enum class StateSlot : int {
  kParam = 0,     // the compute copy, parameter layout
  kMaster = 1,    // FP32 master weight, optimizer-state layout (ZeRO only)
  kExpAvg = 2,    // Adam m, optimizer-state layout (parameter layout without ZeRO)
  kExpAvgSq = 3,  // Adam v, same layout
};
std::string slot_name(StateSlot slot);  // "param", "master", "exp_avg", "exp_avg_sq"

// The layout of `param`'s slot under `plan`: kParam the parameter's
// annotation; kMaster the optimizer-state annotation (nullptr without ZeRO);
// the moments the optimizer-state annotation, or the parameter's without
// ZeRO. Throws hspmd::Error "[switch] plan: parameter '<name>' has no
// annotation".
const Annotation* slot_layout(const AnnotationPlan& plan, const std::string& param, StateSlot slot);
// The name of a state tensor: `param` for the weights (kParam, kMaster),
// param + ".exp_avg" / ".exp_avg_sq" for the moments.
std::string state_tensor_name(const std::string& param, StateSlot kind);

// One box of a state tensor in one of a rank's slots.
struct StateHolding {
  int rank = -1;
  Box box;
  StateSlot slot = StateSlot::kParam;
};

// What a switch moves: one logical tensor of the training state (a
// parameter's weights, or one of its Adam moments) and where its copies live
// before (owners) and after (needers). A rank may appear several times on
// either side with other slots (the compute copy and the ZeRO master of a
// weight hold the same values).
struct StateTensor {
  std::string param;          // Hugging Face parameter name
  StateSlot kind = StateSlot::kParam;  // kParam: the weights (slots kParam and kMaster); kExpAvg; kExpAvgSq
  Shape shape;                // the destination plan's global shape
  // The source plan's global shape: it may differ from `shape` along dim 0
  // only (a vocabulary padded differently); elements outside it are zeros
  // and elements of the source outside `shape` are dropped.
  Shape source_shape;
  DType dtype = DType::F32;
  int group = 0;              // layer group (embedding first, then layers, then the head); buckets never split one
  std::vector<StateHolding> owners;
  std::vector<StateHolding> needers;

  std::string name() const { return state_tensor_name(param, kind); }
};

// Every state tensor of a switch from plan `from` to plan `to` (same model,
// same world size): per parameter its weights (owners: `from`'s parameter
// layout in slot kParam and, with ZeRO, its optimizer-state layout in slot
// kMaster; needers likewise under `to`) and its two Adam moments (the
// optimizer-state layout, which is the parameter layout without ZeRO; slots
// kExpAvg and kExpAvgSq). Groups: embedding 0, layer i -> i + 1, final norm
// and LM head L + 1. Throws hspmd::Error "[switch] ..." when the plans'
// models or world sizes differ.
std::vector<StateTensor> state_tensors(const AnnotationPlan& from, const AnnotationPlan& to);

// One slice a message (or a keep, or a checkpoint read) carries.
struct SliceRef {
  int tensor = -1;                    // index into SwitchPlan::tensors
  Box box;                            // global coordinates of the destination shape
  StateSlot src_slot = StateSlot::kParam;  // the sender's (keeper's) slot it is read from; unused for reads
};
// One message between a pair in one round: both sides list the same slices
// in the same order, so the receiver unpacks what the sender packed.
struct SwitchMessage {
  int peer = -1;
  std::vector<SliceRef> slices;
  int64_t bytes = 0;
};
// What one rank does in one round. Every box received, kept or read is
// written by the executor into each of the rank's destination holdings (of
// that tensor) it overlaps; each element a rank needs arrives exactly once.
struct RankSwitchRound {
  std::vector<SwitchMessage> sends;
  std::vector<SwitchMessage> recvs;
  std::vector<SliceRef> keeps;         // copied from the rank's own src_slot
  std::vector<SliceRef> checkpoint;    // read from the training checkpoint
};
// One round of batched send/receive: every message of it is started at
// once and waited together.
struct SwitchRound {
  std::vector<int> tensors;            // the tensors completed by this round
  std::map<int, RankSwitchRound> ranks;
};

// Per-rank link volumes of a switch.
struct RankSwitchStats {
  int64_t intra_sent = 0, intra_received = 0;   // bytes over links inside the rank's node
  int64_t inter_sent = 0, inter_received = 0;   // bytes over the network
  int64_t checkpoint_read = 0;                  // bytes read from the checkpoint
  int messages_sent = 0, messages_received = 0;
  int64_t sent() const { return intra_sent + inter_sent; }
  int64_t received() const { return intra_received + inter_received; }
};

struct SwitchOptions {
  SwitchAlgorithm algorithm = SwitchAlgorithm::kFused;
  // Ranks whose memory is gone: their holdings are no source.
  std::set<int> lost_ranks;
  // Whether a training checkpoint can serve slices no available rank holds.
  bool have_checkpoint = false;
  // fused only: consecutive groups are packed into one round while the
  // round's tensors (full logical bytes) stay within this many bytes; a
  // group larger than it is a round of its own. 0: one round for all.
  int64_t bucket_bytes = 0;
};

struct SwitchPlan {
  SwitchAlgorithm algorithm = SwitchAlgorithm::kFused;
  std::vector<StateTensor> tensors;
  std::vector<SwitchRound> rounds;      // executed in order
  std::vector<RankSwitchStats> stats;   // per rank of the topology
  // max over ranks of max(max(intra_sent, intra_received) / intra bandwidth,
  // max(inter_sent, inter_received) / inter bandwidth), bandwidths of the
  // rank's device type (full duplex links: a rank sends and receives at once)
  double predicted_s = 0;
  // Per rank, the most bytes the switch holds beyond the old and new state
  // in any round: the round's new holdings plus its send and receive buffers.
  std::vector<int64_t> round_peak_bytes;
};

// Plans the switch. Throws hspmd::Error "[switch] tensor '<name>': slice <box>
// is held by no available rank (lost: <ranks>) and there is no checkpoint"
// when an element is needed that no available owner holds and
// have_checkpoint is false; "[switch] tensor '<name>': ..." for a box outside
// its shape or a rank outside the topology.
SwitchPlan plan_switch(std::vector<StateTensor> tensors, const Topology& topology, const SwitchOptions& options);

// The most memory `rank` holds during the switch beyond max(old state, new
// state): while round r runs, the rank holds the new arrays of the rounds up
// to r, the old arrays of the rounds from r on, round r's message buffers and
// one keep / checkpoint-read temporary. Small rounds (buckets) keep it near
// one round's new arrays and buffers; one round for everything costs up to
// min(old, new) plus all buffers.
int64_t switch_memory_bound(const SwitchPlan& sp, int rank);

// The lower bound of the issue: every needer takes each slice it lacks from
// its own node when any available rank there holds it, else over the
// network, with no limit on senders: max over ranks of max(intra received /
// intra bandwidth, inter received / inter bandwidth).
double switch_lower_bound(const std::vector<StateTensor>& tensors, const Topology& topology,
                          const std::set<int>& lost_ranks = {});

// The sending side's bound, under the same rule: a needer may take a slice
// from its slice's candidate senders only (its same-node available owners
// when there are any, over intra-node links; else every available owner,
// over the network). For every candidate set S that occurs, the slices whose
// candidates all lie in S must leave S over that link class: the bound is
// the max over such S and classes of those bytes / the summed bandwidth of
// S's ranks (a slice only one rank holds: that rank's sends). Plans that
// follow the rule (per-tensor, fused) have predicted_s >= max(lower bound,
// sender bound); with lost ranks the sender bound is often the larger.
double switch_sender_bound(const std::vector<StateTensor>& tensors, const Topology& topology,
                           const std::set<int>& lost_ranks = {});

// {"algorithm", "predicted_s", "max_rank_bytes", "total_bytes", "rounds",
//  "ranks": [{"rank", "intra_sent", "intra_received", "inter_sent",
//  "inter_received", "messages_sent", "messages_received", "checkpoint_read"}]}
// (max_rank_bytes: the most any rank sends; total_bytes: all ranks' sends).
nlohmann::json to_json(const SwitchPlan& plan);

// Caches switch plans by (from, to, algorithm, lost ranks, checkpoint): a
// run that switches back and forth plans each pair once.
class SwitchPlanCache {
 public:
  const SwitchPlan& get(const AnnotationPlan& from, const AnnotationPlan& to, const Topology& topology,
                        const SwitchOptions& options);
  int misses() const { return misses_; }

 private:
  std::map<std::string, SwitchPlan> cache_;
  int misses_ = 0;
};

}  // namespace hspmd
