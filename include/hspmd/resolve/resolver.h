// Communication resolution (paper §5, DESIGN §5): turns one Reshard — a
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
// current one. Inside a phase, ops may run in any order or concurrently
// (they are matched across ranks by their order in the phase):
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
//                      One message per peer: same-pair boxes are merged.
// The split_* kinds are the top-tier collectives: each of their ops works
// like the bottom-tier op of the same name (split_all_reduce = all_reduce
// over the finest slice `box`), and one rank may take part in several.
// After the last phase, every rank of the destination holds exactly its
// local_box(dst) (the sum of its partial terms is the tensor where dst is
// partial); ranks only in the source hold nothing (out_box empty).
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
};

// What one rank executes for one Reshard.
struct RankResolution {
  int rank = -1;
  CommKind kind = CommKind::kIdentity;  // the headline kind (the top-tier kind when any)
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
  CommKind kind = CommKind::kIdentity;   // the headline kind over all ranks
  std::string tier;                      // "bottom", "top" or "bsr"
  std::map<int, RankResolution> ranks;   // every rank of src or dst
  int64_t total_bytes = 0;               // sum of bytes_sent over ranks
};

// Resolves `spec` (DESIGN §5):
//  1. same hsize and hdim, per subgroup: same states -> identity (same
//     devices) or pairwise send/recv; different states on the same devices
//     -> all_reduce / reduce_scatter / all_gather / local_slice; otherwise
//     BSR inside the subgroup;
//  2. same hsize and subgroup devices, different hdim -> split_all_reduce
//     (-2 -> -1), split_reduce_scatter (-2 -> d), split_all_gather (d -> -1),
//     after bottom-tier alignment phases when the states differ;
//  3. anything else without partial -> BSR over the finest slices, choosing
//     for each needed slice: a copy the receiver already owns, else the owner
//     with the fastest link, then the fewest bytes sent so far.
// Throws hspmd::Error "[resolve] reshard '<name>': unsupported reshard from
// <src> to <dst>: <why>" when partial values cannot be resolved, and
// "[resolve] reshard '<name>': ..." when an annotation does not fit the shape
// or names a rank outside the topology.
Resolution resolve(const ReshardSpec& spec, const Topology& topology);

// JSON report of one resolution (what `plan explain --json` prints for it):
// {"name", "kind", "tier", "total_bytes", "ranks": [{"rank", "kind",
// "bytes_sent", "bytes_received", "ops": [{"kind", "group" | "peers",
// "bytes"}]}]}; `only_rank` >= 0 keeps that rank alone.
nlohmann::json to_json(const Resolution& resolution, int only_rank = -1);

}  // namespace hspmd
