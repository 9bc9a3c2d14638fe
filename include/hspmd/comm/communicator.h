// The communicator: the one seam between hspmd and a communication library
// (STYLE §4). The resolver and planner never see it; the executor of resolved
// Reshards (execute.h) and the trainer talk to it only. Two backends: MPI
// (mpi_communicator.cc, when built with HSPMD_MPI and launched under mpirun)
// and a single-process stub (size 1) that runs everything a lone rank can.
//
// Contract shared by every backend:
//  * Data is f32 and contiguous; counts are in elements. Buffers handed to a
//    start_* call belong to the caller and must stay alive and untouched
//    until the request is waited.
//  * Collectives are issued by every member of the communicator, in the same
//    order on every member (MPI's rule). Non-blocking collectives of several
//    communicators may be in flight at once; wait them together with
//    wait_all to stay free of deadlocks when ranks take part in several.
//  * Point-to-point messages between one pair with one tag on one
//    communicator are matched in the order they were started.
//  * Failures raise hspmd::Error "[comm] <call>: <why>": a library error
//    (naming the MPI call), a peer or member outside the communicator,
//    counts that do not fit, or, on the stub, anything that needs another
//    rank ("[comm] send to rank 1 needs MPI ...").
//  * Not thread-safe: one thread drives a communicator and its groups.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace hspmd {

// A pending non-blocking operation, waited through Communicator::wait_all.
// Move-only; an empty Request (the stub's, or an operation that completed at
// once) needs no wait.
class Request {
 public:
  class Impl {
   public:
    virtual ~Impl() = default;
  };

  Request() = default;
  explicit Request(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
  bool pending() const { return impl_ != nullptr; }
  Impl* impl() const { return impl_.get(); }
  void reset() { impl_.reset(); }

 private:
  std::unique_ptr<Impl> impl_;
};

// One message of a batch: `count` floats at `data` to / from `peer`.
struct SendBuffer {
  int peer = -1;
  const float* data = nullptr;
  int64_t count = 0;
};
struct RecvBuffer {
  int peer = -1;
  float* data = nullptr;
  int64_t count = 0;
};

// Bytes this rank handed to the library since the last reset, over a world
// communicator and all its groups. Collectives count the ring-algorithm
// volumes of resolver.h (all_reduce 2(n-1)/n·bytes each way; reduce_scatter
// sends total - own piece, receives (n-1)·own piece; all_gather sends
// (n-1)·own piece, receives total - own piece; broadcast: the root sends the
// buffer once per other member), point-to-point the exact message sizes, so
// that they compare with the resolver's predictions whatever algorithm the
// library picks.
struct ByteCounters {
  int64_t sent = 0;
  int64_t received = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  // This rank's position in the communicator, and the number of members.
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // The sub-communicator of `ranks` (ranks of *this* communicator, distinct,
  // this rank among them), members in the given order: inside it, rank() is
  // this rank's position in `ranks`. Created on first use — collectively over
  // the members only, so every member must ask for it, and ranks that ask for
  // several new groups must ask in one consistent order (e.g. sorted member
  // lists) — then cached by member list: later calls return the same object.
  // Owned by *this; valid as long as it lives. Throws hspmd::Error for a
  // bad member list.
  virtual Communicator& group(const std::vector<int>& ranks) = 0;

  // Non-blocking collectives and point-to-point (see the contract above).
  // all_reduce: sums `count` floats in place over the members.
  virtual Request start_all_reduce(float* data, int64_t count) = 0;
  // reduce_scatter: `send` holds size() consecutive pieces, piece i of
  // counts[i] floats (0 allowed); member i receives the sum of piece i into
  // `recv` (counts[rank()] floats). Every member passes the same counts.
  virtual Request start_reduce_scatter(const float* send, float* recv, const std::vector<int64_t>& counts) = 0;
  // all_gather: member i contributes counts[i] floats from `send`; every
  // member receives all pieces, consecutive in member order, into `recv`.
  virtual Request start_all_gather(const float* send, float* recv, const std::vector<int64_t>& counts) = 0;
  // broadcast: `count` floats from member `root` to every member, in place.
  virtual Request start_broadcast(float* data, int64_t count, int root) = 0;
  // send / recv: one message to / from `peer` (a rank of this communicator).
  // A received message must have exactly `count` floats (else hspmd::Error).
  virtual Request start_send(const float* data, int64_t count, int peer, int tag) = 0;
  virtual Request start_recv(float* data, int64_t count, int peer, int tag) = 0;
  // Waits every request (of this communicator, its world or any group of
  // that world), then empties `requests`. Throws on the first failure.
  virtual void wait_all(std::vector<Request>& requests) = 0;
  virtual void barrier() = 0;
  // Ends the whole job with exit code `code` after a rank failed, so that no
  // other rank waits forever (MPI_Abort). Single process: returns.
  virtual void abort(int code) = 0;

  // Blocking forms: start, then wait.
  void all_reduce(float* data, int64_t count);
  void reduce_scatter(const float* send, float* recv, const std::vector<int64_t>& counts);
  void all_gather(const float* send, float* recv, const std::vector<int64_t>& counts);
  void broadcast(float* data, int64_t count, int root);
  void send(const float* data, int64_t count, int peer, int tag = 0);
  void recv(float* data, int64_t count, int peer, int tag = 0);
  // Every send and receive of the batch started at once, then waited
  // together: any pattern of pairwise exchanges completes without deadlock.
  void batched_send_recv(const std::vector<SendBuffer>& sends, const std::vector<RecvBuffer>& recvs, int tag = 0);

  // This rank's byte counters (shared by a world and all its groups).
  ByteCounters bytes() const { return *counters_; }
  void reset_bytes() { *counters_ = ByteCounters{}; }

 protected:
  explicit Communicator(std::shared_ptr<ByteCounters> counters) : counters_(std::move(counters)) {}
  // Adds the ring-model volumes of one operation to the counters.
  void count_all_reduce(int64_t count);
  void count_reduce_scatter(const std::vector<int64_t>& counts);
  void count_all_gather(const std::vector<int64_t>& counts);
  void count_broadcast(int64_t count, int root);
  void count_send(int64_t count) { counters_->sent += count * 4; }
  void count_recv(int64_t count) { counters_->received += count * 4; }
  // For a backend's groups, which share their world's counters.
  const std::shared_ptr<ByteCounters>& shared_counters() const { return counters_; }

 private:
  std::shared_ptr<ByteCounters> counters_;
};

// The world: MPI's (a duplicate of MPI_COMM_WORLD, errors returned as
// hspmd::Error) when built with MPI and either MPI is already initialized or
// the process was launched by mpirun / an MPI launcher (MPI is then
// initialized here and finalized at exit); otherwise the single-process stub.
std::unique_ptr<Communicator> make_world_communicator();

// The single-process stub (size 1, rank 0): collectives over its one member
// are copies; group({0}) is itself; point-to-point and any other group throw
// hspmd::Error "[comm] ... needs MPI (single-process communicator)".
std::unique_ptr<Communicator> make_single_process_communicator();

// Whether this build has the MPI backend (HSPMD_MPI).
bool built_with_mpi();

}  // namespace hspmd
