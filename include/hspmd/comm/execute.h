// Runs one rank's part of a resolved Reshard (resolver.h) over a
// communicator: the distributed twin of the tests' simulate()
// (tests/resolve/simulator/simulate.h), following the same EXECUTION MODEL
// phase by phase.
#pragma once

#include <cstddef>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/ndarray.h"
#include "hspmd/resolve/resolver.h"

namespace hspmd {

// Executes the phases of rank `rank` in `resolution` and returns its final
// buffer: a fresh contiguous f32 array of its local_box(dst) (a partial term
// where dst is partial), or an empty NDArray (valid() false) when it holds
// nothing afterwards. `local_input` is its source shard (local_box(src), as
// make_shards gives; ignored when it holds nothing before).
//
// `world` is the communicator whose ranks are the resolution's ranks: with
// more than one member, `rank` must be world.rank(); a single-process world
// runs any one rank whose phases need no other rank (identity, local_slice,
// collectives over a group of one), and throws hspmd::Error "[comm] ... needs
// MPI" otherwise. Every rank of the resolution must call execute with the
// same resolution (ranks outside it need not), and ranks that share several
// resolutions execute them in the same order. Collectives run on
// world.group(op.group): the groups this rank needs are created up front in
// sorted member-list order (deadlock-free creation); then in each phase every
// collective and message is started non-blocking and all are waited together,
// so ranks in several collectives of one phase cannot deadlock. Collectives of
// one group are issued in the rank's op order, which the resolver keeps
// consistent across members; messages use one tag on `world` and are matched
// per pair in order (MPI's non-overtaking rule).
//
// Throws hspmd::Error for a non-f32 input or one whose shape is not the
// rank's in_box, and on communication failures; InternalError when the
// resolution is inconsistent (a phase whose in_box is not what the rank
// holds, a box outside the buffer it reads or writes).
//
// `deferred` (optional): the rank's point-to-point sends are not waited;
// their requests and packed buffers move into it, and execute returns as soon
// as its receives and collectives are done. A pipeline schedule uses this so
// that a stage sending forward activations never blocks on a neighbour that
// is itself sending backward gradients (1F1B); call deferred->wait() before
// the buffers' owner goes away (e.g. at the end of the step).
class PendingSends;
//
// `stream` (optional, default the CPU's): where packing, unpacking and the
// communication are ordered (the arrays' device).
NDArray execute(const Resolution& resolution, int rank, const NDArray& local_input, Communicator& world,
                PendingSends* deferred = nullptr, Stream* stream = nullptr);

// Sends still in flight after execute(..., deferred): owns their buffers.
class PendingSends {
 public:
  PendingSends() = default;
  PendingSends(const PendingSends&) = delete;
  PendingSends& operator=(const PendingSends&) = delete;
  ~PendingSends();  // waits what is left (errors there are swallowed: call wait())
  // Waits every pending send, then frees the buffers. Throws like wait_all.
  void wait(Communicator& world);
  bool empty() const { return requests_.empty(); }
  // Starts sending `data` (a contiguous array, kept here until the send
  // completes) to `peer` of `world`, ordered on `stream`.
  void send(Stream& stream, NDArray data, int peer, int tag, Communicator& world);
  // The same for f32 host values (copied into a host array).
  void send(const std::vector<float>& data, int peer, int tag, Communicator& world);

 private:
  friend class PhaseRun;
  std::vector<NDArray> buffers_;
  std::vector<Request> requests_;
  Communicator* world_ = nullptr;
};

// The point-to-point tag execute() uses on `world`.
inline constexpr int kReshardTag = 0x5253;

}  // namespace hspmd
