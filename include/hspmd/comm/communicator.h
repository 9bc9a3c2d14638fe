// The communicator: the one seam between hspmd and a communication library
// (docs/comm.md). The resolver and planner never see it; the executor of
// resolved Reshards (execute.h) and the trainer talk to it only. Two
// backends: MPI (mpi_communicator.cc, when built with HSPMD_MPI and launched
// under mpirun) and a single-process stub (size 1) that runs everything a
// lone rank can.
//
// Contract shared by every backend:
//  * Data is typed and contiguous: every operation takes a DType (f32, bf16,
//    i32, i64, f64) and counts in elements of it; bf16 travels as its
//    16-bit pattern (uint16_t, as NDArray stores it). All members of a
//    collective, and both ends of a message, use the same dtype. Buffers
//    handed to a start_* call belong to the caller and must stay alive and
//    untouched until the request is waited. The float* overloads are the
//    f32 forms of the typed calls.
//  * Reductions (all_reduce, reduce_scatter) combine in the buffer's own type:
//    f32 and f64 sums in floating point, i32 and i64 sums exact (they must
//    stay in range), bf16 through a user-defined operation that adds two
//    values in f32 and rounds the result back to bf16 (nearest even,
//    f32_to_bf16) at every combining step, so a bf16 sum is exact when every
//    partial sum is representable in bf16 and otherwise depends on the
//    library's reduction order. all_reduce also takes ReduceOp::kMax.
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
//  * Stream order: every operation is enqueued on a Stream (device.h), the
//    one it is started with: it begins after the work issued to that stream
//    so far (it reads its send buffer as that work leaves it), and its
//    completion is its Request, waited on the host by wait_all, or ordered
//    before later work of a stream by wait_on (on the host where a backend
//    has no device queue). The forms without a stream are for host
//    buffers: they use the CPU's default stream. The NDArray forms take the
//    count and dtype from the array (contiguous, on the stream's device).
//    MPI, a host library, synchronizes the stream before it posts the
//    operation (a no-op on the CPU, whose streams run inline), then behaves
//    as before; a device library (NCCL) enqueues on the stream itself.
//  * Not thread-safe: one thread drives a communicator and its groups.
#pragma once

#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "hspmd/core/device.h"
#include "hspmd/core/dtype.h"
#include "hspmd/core/ndarray.h"

namespace hspmd {

// The C++ element types the typed helpers accept, and their DType: float,
// double, int32_t, int64_t, and uint16_t for bf16 (its bit pattern).
template <class T>
concept CommElement = std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, int32_t> ||
                      std::is_same_v<T, int64_t> || std::is_same_v<T, uint16_t>;

template <CommElement T>
constexpr DType comm_dtype() {
  if constexpr (std::is_same_v<T, float>) return DType::F32;
  else if constexpr (std::is_same_v<T, double>) return DType::F64;
  else if constexpr (std::is_same_v<T, int32_t>) return DType::I32;
  else if constexpr (std::is_same_v<T, int64_t>) return DType::I64;
  else return DType::BF16;
}

// How all_reduce combines the members' values (elementwise).
enum class ReduceOp : uint8_t { kSum, kMax };

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

// One message of a batch: `count` elements of `dtype` at `data` to / from
// `peer`. A float* converts to `data`; dtype defaults to f32.
struct SendBuffer {
  int peer = -1;
  const void* data = nullptr;
  int64_t count = 0;
  DType dtype = DType::F32;
};
struct RecvBuffer {
  int peer = -1;
  void* data = nullptr;
  int64_t count = 0;
  DType dtype = DType::F32;
};

// A whole array (valid, contiguous; hspmd::Error otherwise) as a batch's
// message: its elements, count and dtype.
SendBuffer send_buffer(int peer, const NDArray& a);
RecvBuffer recv_buffer(int peer, NDArray& a);

// Bytes this rank handed to the library since the last reset, over a world
// communicator and all its groups, as elements times their dtype's size.
// Collectives count the ring-algorithm volumes of resolver.h (all_reduce
// 2(n-1)/n·bytes each way; reduce_scatter sends total - own piece, receives
// (n-1)·own piece; all_gather sends (n-1)·own piece, receives total - own
// piece; broadcast: the root sends the buffer once per other member),
// point-to-point the exact message sizes, so that they compare with the
// resolver's predictions (bytes of the tensor's dtype) whatever algorithm the
// library picks. For collectives they therefore confirm the sizes of the
// calls, not the traffic the library puts on the wire.
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

  // Non-blocking collectives and point-to-point (see the contract above),
  // over `count` elements of `dtype`, enqueued on `stream`; each forwards to
  // its do_* (what a backend implements, below), so overloads never hide one
  // another.
  // all_reduce: combines `count` elements in place over the members (`op`).
  Request start_all_reduce(Stream& stream, void* data, int64_t count, DType dtype,
                           ReduceOp op = ReduceOp::kSum) {
    return do_all_reduce(stream, data, count, dtype, op);
  }
  // reduce_scatter: `send` holds size() consecutive pieces, piece i of
  // counts[i] elements (0 allowed); member i receives the sum of piece i into
  // `recv` (counts[rank()] elements). Every member passes the same counts.
  Request start_reduce_scatter(Stream& stream, const void* send, void* recv,
                               const std::vector<int64_t>& counts, DType dtype) {
    return do_reduce_scatter(stream, send, recv, counts, dtype);
  }
  // all_gather: member i contributes counts[i] elements from `send`; every
  // member receives all pieces, consecutive in member order, into `recv`.
  Request start_all_gather(Stream& stream, const void* send, void* recv,
                           const std::vector<int64_t>& counts, DType dtype) {
    return do_all_gather(stream, send, recv, counts, dtype);
  }
  // broadcast: `count` elements from member `root` to every member, in place.
  Request start_broadcast(Stream& stream, void* data, int64_t count, DType dtype, int root) {
    return do_broadcast(stream, data, count, dtype, root);
  }
  // send / recv: one message to / from `peer` (a rank of this communicator).
  // A received message must have exactly `count` elements (else hspmd::Error).
  Request start_send(Stream& stream, const void* data, int64_t count, DType dtype, int peer, int tag) {
    return do_send(stream, data, count, dtype, peer, tag);
  }
  Request start_recv(Stream& stream, void* data, int64_t count, DType dtype, int peer, int tag) {
    return do_recv(stream, data, count, dtype, peer, tag);
  }

  // The same on arrays (contiguous, on the stream's device; the whole array
  // is the buffer; hspmd::Error otherwise). all_gather and reduce_scatter
  // take the pieces' counts as above.
  Request start_all_reduce(Stream& stream, NDArray& data, ReduceOp op = ReduceOp::kSum);
  Request start_reduce_scatter(Stream& stream, const NDArray& send, NDArray& recv,
                               const std::vector<int64_t>& counts);
  Request start_all_gather(Stream& stream, const NDArray& send, NDArray& recv,
                           const std::vector<int64_t>& counts);
  Request start_broadcast(Stream& stream, NDArray& data, int root);
  Request start_send(Stream& stream, const NDArray& data, int peer, int tag);
  Request start_recv(Stream& stream, NDArray& data, int peer, int tag);

  // Host buffers: the forms above on the CPU's default stream.
  Request start_all_reduce(void* data, int64_t count, DType dtype, ReduceOp op = ReduceOp::kSum) {
    return start_all_reduce(host_stream(), data, count, dtype, op);
  }
  Request start_reduce_scatter(const void* send, void* recv, const std::vector<int64_t>& counts, DType dtype) {
    return start_reduce_scatter(host_stream(), send, recv, counts, dtype);
  }
  Request start_all_gather(const void* send, void* recv, const std::vector<int64_t>& counts, DType dtype) {
    return start_all_gather(host_stream(), send, recv, counts, dtype);
  }
  Request start_broadcast(void* data, int64_t count, DType dtype, int root) {
    return start_broadcast(host_stream(), data, count, dtype, root);
  }
  Request start_send(const void* data, int64_t count, DType dtype, int peer, int tag) {
    return start_send(host_stream(), data, count, dtype, peer, tag);
  }
  Request start_recv(void* data, int64_t count, DType dtype, int peer, int tag) {
    return start_recv(host_stream(), data, count, dtype, peer, tag);
  }
  // Waits every request (of this communicator, its world or any group of
  // that world), then empties `requests`. Throws on the first failure.
  virtual void wait_all(std::vector<Request>& requests) = 0;
  // Orders every request before the work issued to `stream` after this
  // call, then empties `requests`. The default (backends without device
  // queues: MPI, the stub) waits them on the host, which orders them before
  // anything; a device backend makes the stream wait for their events.
  virtual void wait_on(std::vector<Request>& requests, Stream& stream) {
    (void)stream;
    wait_all(requests);
  }
  virtual void barrier() = 0;
  // A new world of the same members and ranks, independent of this one:
  // its operations are ordered, matched and waited apart from this world's
  // and its groups' (MPI: MPI_Comm_dup; NCCL: a communicator of its own),
  // with byte counters of its own, so that another thread may drive it while
  // one drives this world (the overlapped gradient synchronization,
  // docs/comm.md). Collective over every member: all call it at the same
  // point. Only for a world (not a group); backends that cannot run two
  // worlds from two threads (MPI initialized below MPI_THREAD_MULTIPLE, the
  // emulator's clocked groups) throw hspmd::Error "[comm] ...".
  virtual std::unique_ptr<Communicator> duplicate();
  // Ends the whole job with exit code `code` after a rank failed, so that no
  // other rank waits forever (MPI_Abort). Single process: returns.
  virtual void abort(int code) = 0;

  // Non-blocking conveniences: the f32 forms.
  Request start_all_reduce(float* data, int64_t count) { return start_all_reduce(data, count, DType::F32); }
  Request start_reduce_scatter(const float* send, float* recv, const std::vector<int64_t>& counts) {
    return start_reduce_scatter(send, recv, counts, DType::F32);
  }
  Request start_all_gather(const float* send, float* recv, const std::vector<int64_t>& counts) {
    return start_all_gather(send, recv, counts, DType::F32);
  }
  Request start_broadcast(float* data, int64_t count, int root) {
    return start_broadcast(data, count, DType::F32, root);
  }
  Request start_send(const float* data, int64_t count, int peer, int tag) {
    return start_send(data, count, DType::F32, peer, tag);
  }
  Request start_recv(float* data, int64_t count, int peer, int tag) {
    return start_recv(data, count, DType::F32, peer, tag);
  }

  // Blocking forms: start, then wait.
  void all_reduce(void* data, int64_t count, DType dtype, ReduceOp op = ReduceOp::kSum);
  void reduce_scatter(const void* send, void* recv, const std::vector<int64_t>& counts, DType dtype);
  void all_gather(const void* send, void* recv, const std::vector<int64_t>& counts, DType dtype);
  void broadcast(void* data, int64_t count, DType dtype, int root);
  void send(const void* data, int64_t count, DType dtype, int peer, int tag = 0);
  void recv(void* data, int64_t count, DType dtype, int peer, int tag = 0);
  // Every send and receive of the batch (each with its own dtype) started at
  // once, then waited together: any pattern of pairwise exchanges completes
  // without deadlock.
  void batched_send_recv(const std::vector<SendBuffer>& sends, const std::vector<RecvBuffer>& recvs, int tag = 0);
  // The same with device buffers, ordered on `stream`.
  void batched_send_recv(Stream& stream, const std::vector<SendBuffer>& sends, const std::vector<RecvBuffer>& recvs,
                         int tag = 0);

  // Blocking f32 forms.
  void all_reduce(float* data, int64_t count) { all_reduce(data, count, DType::F32); }
  void reduce_scatter(const float* send, float* recv, const std::vector<int64_t>& counts) {
    reduce_scatter(send, recv, counts, DType::F32);
  }
  void all_gather(const float* send, float* recv, const std::vector<int64_t>& counts) {
    all_gather(send, recv, counts, DType::F32);
  }
  void broadcast(float* data, int64_t count, int root) { broadcast(data, count, DType::F32, root); }
  void send(const float* data, int64_t count, int peer, int tag = 0) { send(data, count, DType::F32, peer, tag); }
  void recv(float* data, int64_t count, int peer, int tag = 0) { recv(data, count, DType::F32, peer, tag); }

  // Blocking forms with the dtype taken from the element type, e.g.
  // all_reduce(int64_t* data, n) or all_reduce(double* data, n, ReduceOp::kMax).
  template <CommElement T>
  void all_reduce(T* data, int64_t count, ReduceOp op = ReduceOp::kSum) {
    all_reduce(static_cast<void*>(data), count, comm_dtype<T>(), op);
  }
  template <CommElement T>
  void reduce_scatter(const T* send, T* recv, const std::vector<int64_t>& counts) {
    reduce_scatter(static_cast<const void*>(send), static_cast<void*>(recv), counts, comm_dtype<T>());
  }
  template <CommElement T>
  void all_gather(const T* send, T* recv, const std::vector<int64_t>& counts) {
    all_gather(static_cast<const void*>(send), static_cast<void*>(recv), counts, comm_dtype<T>());
  }
  template <CommElement T>
  void broadcast(T* data, int64_t count, int root) {
    broadcast(static_cast<void*>(data), count, comm_dtype<T>(), root);
  }
  template <CommElement T>
  void send(const T* data, int64_t count, int peer, int tag = 0) {
    send(static_cast<const void*>(data), count, comm_dtype<T>(), peer, tag);
  }
  template <CommElement T>
  void recv(T* data, int64_t count, int peer, int tag = 0) {
    recv(static_cast<void*>(data), count, comm_dtype<T>(), peer, tag);
  }

  // This rank's byte counters (shared by a world and all its groups).
  ByteCounters bytes() const { return *counters_; }
  void reset_bytes() { *counters_ = ByteCounters{}; }

 protected:
  // The backend's operations behind start_* (same contracts).
  virtual Request do_all_reduce(Stream& stream, void* data, int64_t count, DType dtype, ReduceOp op) = 0;
  virtual Request do_reduce_scatter(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                                    DType dtype) = 0;
  virtual Request do_all_gather(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                                DType dtype) = 0;
  virtual Request do_broadcast(Stream& stream, void* data, int64_t count, DType dtype, int root) = 0;
  virtual Request do_send(Stream& stream, const void* data, int64_t count, DType dtype, int peer, int tag) = 0;
  virtual Request do_recv(Stream& stream, void* data, int64_t count, DType dtype, int peer, int tag) = 0;

  explicit Communicator(std::shared_ptr<ByteCounters> counters) : counters_(std::move(counters)) {}
  // The CPU's default stream, where host buffers are ordered.
  static Stream& host_stream() { return default_stream(Device::cpu()); }
  // Adds the ring-model volumes of one operation (counts in elements of
  // `dtype`) to the counters.
  void count_all_reduce(int64_t count, DType dtype);
  void count_reduce_scatter(const std::vector<int64_t>& counts, DType dtype);
  void count_all_gather(const std::vector<int64_t>& counts, DType dtype);
  void count_broadcast(int64_t count, DType dtype, int root);
  void count_send(int64_t count, DType dtype) { counters_->sent += count * element_bytes(dtype); }
  void count_recv(int64_t count, DType dtype) { counters_->received += count * element_bytes(dtype); }
  static int64_t element_bytes(DType dtype) { return static_cast<int64_t>(dtype_size(dtype)); }
  // For a backend's groups, which share their world's counters.
  const std::shared_ptr<ByteCounters>& shared_counters() const { return counters_; }
  // Another communicator's counters: a wrapper (the staged communicator)
  // counts through the communicator it wraps.
  static const std::shared_ptr<ByteCounters>& counters_of(const Communicator& c) { return c.counters_; }

 private:
  std::shared_ptr<ByteCounters> counters_;
};

// The world: MPI's (a duplicate of MPI_COMM_WORLD, errors returned as
// hspmd::Error) when built with MPI and either MPI is already initialized or
// the process was launched by mpirun / an MPI launcher (MPI is then
// initialized here and finalized at exit); otherwise the single-process stub.
// Either way staged (make_staged_communicator), so that device buffers work.
std::unique_ptr<Communicator> make_world_communicator();

// The single-process stub (size 1, rank 0): collectives over its one member
// are copies; group({0}) is itself; point-to-point and any other group throw
// hspmd::Error "[comm] ... needs MPI (single-process communicator)".
std::unique_ptr<Communicator> make_single_process_communicator();

// Device buffers through a host library (docs/comm.md): wraps `host` (MPI
// or the stub; taken over) so that an operation on a stream of a device
// other than the CPU copies its send buffer into staging host memory
// (staging_host_allocator: pinned with CUDA) in the stream's order, waits
// for the copy, runs `host`'s operation on the host copies, and, once the
// request is waited (wait_all), copies what was received back to the device
// buffer in the stream's order and waits for that copy. The contract above
// holds unchanged; byte counters are `host`'s. Operations on the CPU's
// stream pass straight through, unless `stage_host_buffers` (a test of the
// staging itself on machines without a GPU: CPU buffers take the same path
// through separate host copies). Groups are staged likewise.
std::unique_ptr<Communicator> make_staged_communicator(std::unique_ptr<Communicator> host,
                                                       bool stage_host_buffers = false);

// Whether HSPMD_COMM_STAGE_HOST=1 asks make_world_communicator to stage CPU
// buffers too (make_staged_communicator's stage_host_buffers).
bool stage_host_buffers_requested();

// The NCCL backend (docs/comm.md): a communicator over the ranks of
// `host_world` (MPI or the stub; it must outlive the result and stays the
// host library for bootstrapping, groups and abort) whose operations run on
// NCCL, on device buffers of this rank's `device` (a CUDA device, one per
// rank: NCCL refuses two ranks of one communicator on one GPU). Operations
// are queued and issued together, in one NCCL group, at the next wait;
// wait_on orders them before a stream's later work without the host.
// Operations on host buffers (the CPU's stream) go to host_world's library
// as before; the byte counters are host_world's.
// Collective over host_world (the unique id travels through it). Throws
// "[comm] NCCL: ..." in a build without NCCL or when libnccl.so.2 cannot
// be loaded.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host_world, Device device);
// Whether this build has the NCCL backend (CUDA and nccl.h found), and the
// loaded library's version (NCCL_VERSION_CODE form; throws without it).
bool built_with_nccl();
int nccl_version();

// Whether this build has the MPI backend (HSPMD_MPI).
bool built_with_mpi();

// Whether this process belongs to an MPI job whose ranks run on more than
// one host: Open MPI tells each rank how many of the job's ranks share its
// host (OMPI_COMM_WORLD_LOCAL_SIZE), fewer than all on every host exactly
// when there are several, so every rank agrees. Readable before MPI_Init;
// false outside an Open MPI job.
bool job_spans_hosts();

}  // namespace hspmd
