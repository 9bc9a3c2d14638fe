// A Communicator that bills op-internal communication to the emulated
// cluster's virtual clock (virtual_clock.h). Ops that communicate inside
// their kernels (vocab-parallel cross-entropy's all-reduces, ring attention's
// key/value ring) get it from ShardContext::group_along when the executor
// runs with a clock. It forwards every operation to the real communicator
// and, beside each one, exchanges the clocks of the participants at the
// moment the operation started:
//   * a receive completes at the sender's clock at its start_send plus the
//     message's transfer time over the link;
//   * a send completes at the sender's own start clock plus that time;
//   * a collective completes at the latest member's start clock plus its
//     ring volume over the group's slowest link.
// Volumes are in bytes of the operation's dtype (elements times its size);
// the clocks themselves travel as one f64 per member and message.
// wait_all stops billing compute, waits, moves the clock to the latest
// completion (computation that overlapped a transfer hides it, as on real
// hardware), draws the wait as a "comm" span in the trace when it took
// virtual time, and resumes billing compute. Byte counters stay with the real
// communicator; group() returns the real communicator's group (unclocked).
#pragma once

#include <vector>

#include "hspmd/comm/communicator.h"
#include "hspmd/exec/virtual_clock.h"
#include "hspmd/resolve/topology.h"

namespace hspmd {

class ClockedCommunicator final : public Communicator {
 public:
  // `inner`: the real communicator; `world_ranks[i]`: the world rank of its
  // member i (for the topology's links). The clock must be computing (inside
  // begin_compute / end_compute) whenever an operation starts or is waited.
  ClockedCommunicator(Communicator& inner, VirtualClock& clock, const Topology& topology,
                      std::vector<int> world_ranks);


  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Communicator& group(const std::vector<int>& ranks) override { return inner_.group(ranks); }
  Request do_all_reduce(Stream& stream, void* data, int64_t count, DType dtype, ReduceOp op) override;
  Request do_reduce_scatter(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                               DType dtype) override;
  Request do_all_gather(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                           DType dtype) override;
  Request do_broadcast(Stream& stream, void* data, int64_t count, DType dtype, int root) override;
  // Tags must be below kClockTagOffset: the clock travels on tag + offset.
  Request do_send(Stream& stream, const void* data, int64_t count, DType dtype, int peer, int tag) override;
  Request do_recv(Stream& stream, void* data, int64_t count, DType dtype, int peer, int tag) override;
  void wait_all(std::vector<Request>& requests) override;
  void barrier() override { inner_.barrier(); }
  void abort(int code) override { inner_.abort(code); }

  static constexpr int kClockTagOffset = 16384;

 private:
  struct Impl;
  double start_clock();  // the clock now (splits the running compute span)
  double link_seconds(int peer, int64_t bytes) const;
  double group_seconds(int64_t bytes) const;  // over the slowest link to another member
  Request collective(Request data, int64_t bytes);
  Communicator& inner_;
  VirtualClock& clock_;
  const Topology& topology_;
  std::vector<int> world_ranks_;
};

}  // namespace hspmd
