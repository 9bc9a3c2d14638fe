// Communication resolution (paper §5, docs/resolver.md): turns one Reshard — a
// tensor moving from a source annotation to a destination annotation — into
// the primitives every rank executes. A pure function of the annotations, the
// concrete global shape and the topology: no process, no MPI.
//
// EXECUTION MODEL (the contract the simulator and the MPI executor follow).
// Before the Reshard, every rank of the source annotation holds one buffer:
// its local_box(src) of the global tensor (a partial term where
// holds_partial_sum(src)). A rank's plan is a list of phases, run in order.
// A phase reads the rank's current buffer (box `in_box`) and writes a fresh
// buffer (box `out_box`); when the phase ends, the fresh buffer becomes the
// current one, and every element of out_box has been written. Inside a
// phase, ops may run in any order or concurrently:
//   * all_reduce:      reads `box` (⊆ in_box), sums it over `group` and writes
//                      the sum to `box` (⊆ out_box). contributes=false: this
//                      rank adds zeros (it holds a copy another member adds).
//   * reduce_scatter:  reads `box`, sums over `group`, member i writes
//                      pieces[i] (⊆ box) of the sum. contributes as above.
//   * all_gather:      member i reads pieces[i]; every member writes all of
//                      `box` (the union of the pieces, which tile it).
//   * local_slice:     copies `box` from the current to the fresh buffer.
//   * send / recv / bsr: `sends` are read from the current buffer, `recvs`
//                      written into the fresh one, `keeps` copied locally.
//                      One message per peer and phase: same-pair boxes are
//                      merged, and both sides list them in the same order.
// The split_* kinds are the top-tier collectives: each of their ops works
// like the bottom-tier op of the same name (split_all_reduce = all_reduce
// over the finest slice `box`), and one rank may take part in several. In
// split ops a piece may be empty (numel 0: that member sends or receives
// nothing), and split_reduce_scatter pieces repeat where a subgroup holds the
// slice on several ranks (each of them receives it).
// Matching. The phases of all ranks come from one global sequence; a rank
// lists only the phases where it runs an op or its box changes (no phase at
// all: the buffer is kept as it is). Hence two ranks list the ops they share
// in the same relative order: a collective is matched across the members of
// its group by its order among the rank's ops of the same kind and group,
// and messages per (sender, receiver) pair in order.
// After the last phase, every rank of the destination holds exactly its
// local_box(dst) (the sum of its partial terms is the tensor where dst is
// partial); ranks only in the source hold nothing (out_box empty).
// Bytes (what a rank puts on / takes off links, ring-algorithm volumes):
// all_reduce 2(n-1)/n·|box| each way; reduce_scatter sends Σ|pieces|-|piece|
// (= |box|-|piece| when the pieces tile the box; repeated pieces are packed
// once per member), receives (n-1)·|piece|; all_gather sends (n-1)·|piece|, receives
// |box|-|piece|; point-to-point the exact transfer sizes; local_slice 0.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/annotation/annotation.h"
#include "hspmd/core/dtype.h"
#include "hspmd/resolve/topology.h"

namespace hspmd {

enum class CommKind {
  kIdentity,
  kSend,
  kRecv,
  kLocalSlice,
  kAllReduce,
  kReduceScatter,
  kAllGather,
  kSplitAllReduce,
  kSplitReduceScatter,
  kSplitAllGather,
  kBsr,
};
// "identity", "send", "recv", "local_slice", "all_reduce", "reduce_scatter",
// "all_gather", "split_all_reduce", "split_reduce_scatter", "split_all_gather",
// "bsr" (the names `plan explain` prints).
std::string kind_name(CommKind kind);
// Families of collective kinds (bottom and top tier alike).
bool is_collective(CommKind kind);
bool is_all_reduce(CommKind kind);      // all_reduce, split_all_reduce
bool is_reduce_scatter(CommKind kind);  // reduce_scatter, split_reduce_scatter
bool is_all_gather(CommKind kind);      // all_gather, split_all_gather

// Boxes exchanged with one peer in one message.
struct Transfer {
  int peer = -1;
  std::vector<Box> boxes;
  int64_t bytes = 0;  // sum of the boxes' sizes in bytes
};

// One primitive of one rank.
struct CommOp {
  CommKind kind = CommKind::kIdentity;
  std::vector<int> group;        // collectives: members in order (this rank included)
  Box box;                       // see the execution model
  std::vector<Box> pieces;       // reduce_scatter / all_gather: one per member of group
  bool contributes = true;       // all_reduce / reduce_scatter
  std::vector<Transfer> sends;   // send / bsr
  std::vector<Transfer> recvs;   // recv / bsr
  std::vector<Box> keeps;        // bsr / send / recv: boxes kept locally
  int64_t bytes_sent = 0;        // what this rank puts on links for this op
  int64_t bytes_received = 0;
};

struct CommPhase {
  std::optional<Box> in_box;     // nullopt: the rank holds nothing before the phase
  std::optional<Box> out_box;    // nullopt: the rank holds nothing after it
  std::vector<CommOp> ops;
  // The parts of out_box that no op writes are zeros: the rank holds a zero
  // partial term (a non-partial value made partial keeps it on the ranks of
  // partial coordinate 0 only).
  bool zero_fill = false;
};

// What one rank executes for one Reshard.
struct RankResolution {
  int rank = -1;
  // The headline kind: the largest of the rank's ops in the order identity <
  // local_slice < recv < send < all_gather < reduce_scatter < all_reduce <
  // bsr < split_all_gather < split_reduce_scatter < split_all_reduce (so the
  // top-tier kind when any).
  CommKind kind = CommKind::kIdentity;
  std::vector<CommPhase> phases;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
};

// One Reshard to resolve: a tensor of concrete global `shape` and `dtype`
// going from `src` to `dst`. Top-tier part sizes come from each annotation's
// part_weights (or equal parts).
struct ReshardSpec {
  std::string name;  // for error messages and reports
  Shape shape;
  DType dtype = DType::F32;
  Annotation src;
  Annotation dst;
};

struct Resolution {
  std::string name;
  DType dtype = DType::F32;  // of the elements it moves (the spec's)
  // The headline kind over all ranks (same order as RankResolution::kind):
  // "send" for point-to-point between one pair or pairwise by position,
  // "bsr" for a BSR among several pairs, "local_slice" when nothing moves.
  CommKind kind = CommKind::kIdentity;
  std::string tier;                      // "bottom" (case 1), "top" (case 2) or "bsr" (case 3 and fallbacks)
  std::map<int, RankResolution> ranks;   // every rank of src or dst (resolve_for_rank: one)
  int64_t total_bytes = 0;               // sum of bytes_sent over ranks
  // Whether some rank exchanges data with a rank of another subgroup of the
  // source or of the destination (a rank in neither counts as apart): for a
  // compiled plan, communication across pipelines or stages.
  bool crosses_subgroups = false;
};

// Resolves `spec` (docs/resolver.md, "The rules"):
//  1. same hsize, hdim and top-tier parts, per subgroup: same states ->
//     identity (same devices) or pairwise send/recv by position; other
//     states on the same devices -> partial terms reduced first (all_reduce,
//     or reduce_scatter when the targets tile the box), then local_slice /
//     all_gather, or a BSR inside the subgroup when neither fits; other
//     devices and other states (no partial) -> BSR inside the subgroup;
//  2. same hsize and subgroup device sets, different hdim -> split_all_reduce
//     (-2 -> -1), split_reduce_scatter (-2 -> d), split_all_gather (d -> -1)
//     over the finest slices, after bottom-tier alignment phases when the
//     states differ; -1 -> d: each subgroup keeps its part (local_slice);
//     no clean rule and no partial -> BSR;
//  3. anything else without partial -> BSR over the finest slices, choosing
//     for each needed slice: a copy the receiver already owns, else the owner
//     with the fastest link, then the fewest bytes sent so far, then the
//     lowest rank; O(slices x receivers).
// Cost: boxes only, never per element; O(slices x group sizes) in each tier.
// Throws hspmd::Error "[resolve] reshard '<name>': unsupported reshard from
// <src> to <dst>: <why>" when partial values cannot be resolved, and
// "[resolve] reshard '<name>': source|destination annotation: <rule>" when an
// annotation is invalid, does not fit the shape, or names a rank outside the
// topology.
Resolution resolve(const ReshardSpec& spec, const Topology& topology);

// resolve() as one rank sees it: `ranks` holds `rank`'s entry alone (none
// when the rank is in neither annotation), equal to resolve()'s entry for
// it; name, kind, tier, total_bytes and crosses_subgroups are resolve()'s
// (they describe every rank). It takes resolve()'s time but keeps one rank's
// primitives, so a rank that holds the Reshards it takes part in this way
// holds nothing per other rank. Throws what resolve() throws.
Resolution resolve_for_rank(const ReshardSpec& spec, const Topology& topology, int rank);

// JSON report of one resolution (what `plan explain --json` prints for it):
// {"name", "kind", "tier", "total_bytes", "ranks": [{"rank", "kind",
// "bytes_sent", "bytes_received", "ops": [{"phase", "kind", "group" |
// "peers", "box", "bytes", "bytes_sent", "bytes_received"}]}]}; "group" for
// collectives, "peers" (sorted, both directions) for send / recv / bsr, "box"
// for collectives and local slices, "bytes" = sent + received. `only_rank`
// >= 0 keeps that rank alone (none when it is not in the resolution).
nlohmann::json to_json(const Resolution& resolution, int only_rank = -1);

}  // namespace hspmd
