// The NCCL backend (communicator.h, docs/comm.md): device buffers, one GPU
// per rank. Built with CUDA when nccl.h is found (HSPMD_HAVE_NCCL); the
// library (libnccl.so.2) is opened at the first NCCL communicator, not
// linked, so that processes that never use it do not map it.
//
// Every operation is deferred: start_* checks and counts it and queues it;
// the first wait (wait_all or wait_on) issues everything queued by this
// world and its groups inside one ncclGroupStart / ncclGroupEnd, each on the
// stream it was started with, then records an event per stream. So
// collectives of several groups and point-to-point messages of one phase
// never deadlock whatever order the ranks start them in (NCCL progresses a
// group's operations together), as MPI's non-blocking calls do. Buffers stay
// the caller's until waited (the contract), so issuing at the wait reads the
// send buffers the caller left. Unequal pieces of reduce_scatter and
// all_gather become one ncclReduce / ncclBroadcast per member in the group.
// Host buffers (the CPU's stream: the trainer's agreements, logged values)
// pass through to the host library, whose counters this backend shares.
// NCCL has no tags and no message sizes: messages between a pair match in
// issue order per communicator, and a receive of the wrong size is not
// detected (the staged MPI path checks it; every plan runs there in tests).
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/error.h"

namespace hspmd {
namespace {

// The NCCL entry points this backend calls, from dlopen.
struct Nccl {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclReduceScatter) reduce_scatter = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclReduce) reduce = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
};

const Nccl& nccl() {
  static std::once_flag once;
  static Nccl lib;
  static std::string why;
  std::call_once(once, [] {
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      why = dlerror();
      return;
    }
    bool ok = true;
    auto load = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (fn == nullptr) {
        ok = false;
        why = std::string("no symbol ") + name;
      }
    };
    load(lib.get_version, "ncclGetVersion");
    load(lib.get_unique_id, "ncclGetUniqueId");
    load(lib.comm_init_rank, "ncclCommInitRank");
    load(lib.comm_destroy, "ncclCommDestroy");
    load(lib.comm_abort, "ncclCommAbort");
    load(lib.all_reduce, "ncclAllReduce");
    load(lib.reduce_scatter, "ncclReduceScatter");
    load(lib.all_gather, "ncclAllGather");
    load(lib.reduce, "ncclReduce");
    load(lib.broadcast, "ncclBroadcast");
    load(lib.send, "ncclSend");
    load(lib.recv, "ncclRecv");
    load(lib.group_start, "ncclGroupStart");
    load(lib.group_end, "ncclGroupEnd");
    load(lib.error_string, "ncclGetErrorString");
    if (!ok) lib = Nccl{};
  });
  if (lib.group_end == nullptr) fail("[comm] NCCL: cannot load libnccl.so.2 (", why, ")");
  return lib;
}

void check(ncclResult_t rc, const char* call) {
  if (rc != ncclSuccess) fail("[comm] ", call, ": ", nccl().error_string(rc));
}

void check_cuda(cudaError_t rc, const char* call) {
  if (rc != cudaSuccess) fail("[comm] ", call, ": ", cudaGetErrorString(rc));
}

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    case DType::BF16: return ncclBfloat16;
  }
  HSPMD_CHECK(false, "no NCCL type for dtype ", static_cast<int>(dtype));
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kMax ? ncclMax : ncclSum; }

cudaStream_t native(Stream& s) { return static_cast<cudaStream_t>(s.native_handle()); }

// The completion of one flush on one stream, shared by its requests.
struct Completion {
  cudaEvent_t event = nullptr;
  ~Completion() {
    if (event != nullptr) (void)cudaEventDestroy(event);
  }
};

// Operations queued until the next wait, shared by a world and its groups.
struct Queue {
  struct Op {
    Stream* stream;
    std::function<void()> issue;  // the NCCL call(s), inside the group
    std::shared_ptr<std::shared_ptr<Completion>> done;  // filled at the flush
  };
  std::vector<Op> ops;
  int device = 0;

  // Issues every queued operation in one NCCL group; each request then
  // holds its stream's event.
  void flush() {
    if (ops.empty()) return;
    std::vector<Op> now;
    now.swap(ops);
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    check(nccl().group_start(), "ncclGroupStart");
    try {
      for (Op& op : now) op.issue();
    } catch (...) {
      (void)nccl().group_end();
      throw;
    }
    check(nccl().group_end(), "ncclGroupEnd");
    std::map<Stream*, std::shared_ptr<Completion>> per_stream;
    for (Op& op : now) {
      auto& c = per_stream[op.stream];
      if (!c) {
        c = std::make_shared<Completion>();
        check_cuda(cudaEventCreateWithFlags(&c->event, cudaEventDisableTiming), "cudaEventCreate");
        check_cuda(cudaEventRecord(c->event, native(*op.stream)), "cudaEventRecord");
      }
      *op.done = c;
    }
  }
};

class NcclRequest final : public Request::Impl {
 public:
  std::shared_ptr<std::shared_ptr<Completion>> done = std::make_shared<std::shared_ptr<Completion>>();
};

class NcclCommunicator final : public Communicator {
 public:
  // The world over `host`'s ranks (host kept alive by the caller).
  NcclCommunicator(Communicator& host, Device device)
      : Communicator(counters_of(host)), host_(host), device_(device),
        queue_(std::make_shared<Queue>()) {
    queue_->device = device.index;
    init();
  }
  // A duplicate world: owns its host library's world (`owned`, a duplicate).
  NcclCommunicator(std::unique_ptr<Communicator> owned, Device device)
      : Communicator(counters_of(*owned)), owned_(std::move(owned)), host_(*owned_), device_(device),
        queue_(std::make_shared<Queue>()) {
    queue_->device = device.index;
    init();
  }
  // A group: `host` is the host library's group of the same members.
  NcclCommunicator(Communicator& host, Device device, std::shared_ptr<Queue> queue,
                   std::shared_ptr<ByteCounters> counters)
      : Communicator(std::move(counters)), host_(host), device_(device), queue_(std::move(queue)) {
    init();
  }
  ~NcclCommunicator() override {
    groups_.clear();
    if (comm_ == nullptr) return;
    // Unwinding after a failure, the peers may be gone: destroy would wait
    // for them, abort does not.
    if (std::uncaught_exceptions() > 0)
      (void)nccl().comm_abort(comm_);
    else
      (void)nccl().comm_destroy(comm_);
  }

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }

  Communicator& group(const std::vector<int>& ranks) override {
    auto it = groups_.find(ranks);
    if (it != groups_.end()) return *it->second;
    Communicator& inner = host_.group(ranks);  // checks the members; collective over them
    if (&inner == &host_) return *this;
    auto made = std::make_unique<NcclCommunicator>(inner, device_, queue_, counters_of(inner));
    return *groups_.emplace(ranks, std::move(made)).first->second;
  }

  void wait_all(std::vector<Request>& requests) override {
    queue_->flush();
    std::vector<Request> host = host_requests(requests);
    for (Request& r : requests)
      if (auto* n = static_cast<NcclRequest*>(r.impl()); n != nullptr && *n->done)
        check_cuda(cudaEventSynchronize((*n->done)->event), "cudaEventSynchronize");
    requests.clear();
    host_.wait_all(host);
  }

  void wait_on(std::vector<Request>& requests, Stream& stream) override {
    queue_->flush();
    std::vector<Request> host = host_requests(requests);
    for (Request& r : requests)
      if (auto* n = static_cast<NcclRequest*>(r.impl()); n != nullptr && *n->done) {
        if (stream.device().type == DeviceType::CUDA)
          check_cuda(cudaStreamWaitEvent(native(stream), (*n->done)->event, 0), "cudaStreamWaitEvent");
        else
          check_cuda(cudaEventSynchronize((*n->done)->event), "cudaEventSynchronize");
      }
    requests.clear();
    host_.wait_all(host);
  }

  void barrier() override {
    queue_->flush();
    host_.barrier();
  }
  // Of a world only: its own host world and NCCL communicator.
  std::unique_ptr<Communicator> duplicate() override {
    queue_->flush();
    return std::make_unique<NcclCommunicator>(host_.duplicate(), device_);
  }
  void abort(int code) override {
    if (comm_ != nullptr) (void)nccl().comm_abort(comm_);
    comm_ = nullptr;
    host_.abort(code);
  }

 protected:
  Request do_all_reduce(Stream& stream, void* data, int64_t count, DType dtype, ReduceOp op) override {
    if (on_host(stream)) return host_.start_all_reduce(stream, data, count, dtype, op);
    check_stream(stream, "ncclAllReduce");
    check_count(count, "ncclAllReduce");
    count_all_reduce(count, dtype);
    return enqueue(stream, [=, this, s = &stream] {
      if (count > 0)
        check(nccl().all_reduce(data, data, count, nccl_type(dtype), nccl_op(op), comm_, native(*s)),
              "ncclAllReduce");
    });
  }

  Request do_reduce_scatter(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                            DType dtype) override {
    if (on_host(stream)) return host_.start_reduce_scatter(stream, send, recv, counts, dtype);
    check_stream(stream, "ncclReduceScatter");
    check_counts(counts, "ncclReduceScatter");
    count_reduce_scatter(counts, dtype);
    const size_t esize = dtype_size(dtype);
    const int me = rank();
    return enqueue(stream, [=, this, s = &stream] {
      if (equal(counts)) {
        if (counts[0] > 0)
          check(nccl().reduce_scatter(send, recv, counts[0], nccl_type(dtype), ncclSum, comm_, native(*s)),
                "ncclReduceScatter");
        return;
      }
      // Unequal pieces: piece i reduced to member i.
      int64_t offset = 0;
      for (int i = 0; i < static_cast<int>(counts.size()); ++i) {
        const auto* piece = static_cast<const char*>(send) + offset * esize;
        if (counts[i] > 0)
          check(nccl().reduce(piece, i == me ? recv : nullptr, counts[i], nccl_type(dtype), ncclSum, i, comm_,
                              native(*s)),
                "ncclReduce");
        offset += counts[i];
      }
    });
  }

  Request do_all_gather(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                        DType dtype) override {
    if (on_host(stream)) return host_.start_all_gather(stream, send, recv, counts, dtype);
    check_stream(stream, "ncclAllGather");
    check_counts(counts, "ncclAllGather");
    count_all_gather(counts, dtype);
    const size_t esize = dtype_size(dtype);
    const int me = rank();
    return enqueue(stream, [=, this, s = &stream] {
      if (equal(counts)) {
        if (counts[0] > 0)
          check(nccl().all_gather(send, recv, counts[0], nccl_type(dtype), comm_, native(*s)), "ncclAllGather");
        return;
      }
      // Unequal pieces: member i broadcasts its piece into its place.
      int64_t offset = 0;
      for (int i = 0; i < static_cast<int>(counts.size()); ++i) {
        auto* place = static_cast<char*>(recv) + offset * esize;
        if (counts[i] > 0)
          check(nccl().broadcast(i == me ? send : place, place, counts[i], nccl_type(dtype), i, comm_,
                                 native(*s)),
                "ncclBroadcast");
        offset += counts[i];
      }
    });
  }

  Request do_broadcast(Stream& stream, void* data, int64_t count, DType dtype, int root) override {
    if (on_host(stream)) return host_.start_broadcast(stream, data, count, dtype, root);
    check_stream(stream, "ncclBroadcast");
    check_count(count, "ncclBroadcast");
    check_peer(root, "ncclBroadcast");
    count_broadcast(count, dtype, root);
    return enqueue(stream, [=, this, s = &stream] {
      if (count > 0)
        check(nccl().broadcast(data, data, count, nccl_type(dtype), root, comm_, native(*s)), "ncclBroadcast");
    });
  }

  Request do_send(Stream& stream, const void* data, int64_t count, DType dtype, int peer, int tag) override {
    if (on_host(stream)) return host_.start_send(stream, data, count, dtype, peer, tag);
    check_stream(stream, "ncclSend");
    check_count(count, "ncclSend");
    check_peer(peer, "ncclSend");
    count_send(count, dtype);
    return enqueue(stream, [=, this, s = &stream] {
      check(nccl().send(data, count, nccl_type(dtype), peer, comm_, native(*s)), "ncclSend");
    });
  }

  Request do_recv(Stream& stream, void* data, int64_t count, DType dtype, int peer, int tag) override {
    if (on_host(stream)) return host_.start_recv(stream, data, count, dtype, peer, tag);
    check_stream(stream, "ncclRecv");
    check_count(count, "ncclRecv");
    check_peer(peer, "ncclRecv");
    count_recv(count, dtype);
    return enqueue(stream, [=, this, s = &stream] {
      check(nccl().recv(data, count, nccl_type(dtype), peer, comm_, native(*s)), "ncclRecv");
    });
  }

 private:
  // This member's NCCL communicator: member 0 makes the unique id, the host
  // library broadcasts it, every member joins (collective over the members).
  void init() {
    ncclUniqueId id{};
    if (rank() == 0) check(nccl().get_unique_id(&id), "ncclGetUniqueId");
    std::vector<int32_t> bytes(sizeof id / sizeof(int32_t) + 1, 0);
    std::memcpy(bytes.data(), &id, sizeof id);
    host_.broadcast(bytes.data(), static_cast<int64_t>(bytes.size()), 0);
    std::memcpy(&id, bytes.data(), sizeof id);
    check_cuda(cudaSetDevice(device_.index), "cudaSetDevice");
    check(nccl().comm_init_rank(&comm_, size(), id, rank()), "ncclCommInitRank");
  }

  // Moves the host library's requests (host buffers) out of `requests`,
  // leaving NCCL's (and empty ones).
  static std::vector<Request> host_requests(std::vector<Request>& requests) {
    std::vector<Request> host;
    for (Request& r : requests)
      if (r.pending() && dynamic_cast<NcclRequest*>(r.impl()) == nullptr) host.push_back(std::move(r));
    return host;
  }

  Request enqueue(Stream& stream, std::function<void()> issue) {
    auto r = std::make_unique<NcclRequest>();
    queue_->ops.push_back(Queue::Op{&stream, std::move(issue), r->done});
    return Request(std::move(r));
  }

  static bool on_host(const Stream& stream) { return stream.device().type == DeviceType::CPU; }
  void check_stream(const Stream& stream, const char* call) const {
    if (!(stream.device() == device_))
      fail("[comm] ", call, ": a stream of ", stream.device().str(), " on an NCCL communicator of ", device_.str(),
           " (NCCL communicates device buffers of its own GPU)");
  }
  static void check_count(int64_t count, const char* call) {
    if (count < 0) fail("[comm] ", call, ": negative count ", count);
  }
  void check_counts(const std::vector<int64_t>& counts, const char* call) const {
    if (static_cast<int>(counts.size()) != size())
      fail("[comm] ", call, ": ", counts.size(), " counts for a communicator of ", size());
    for (int64_t c : counts) check_count(c, call);
  }
  void check_peer(int peer, const char* call) const {
    if (peer < 0 || peer >= size()) fail("[comm] ", call, ": rank ", peer, " outside a communicator of ", size());
  }
  static bool equal(const std::vector<int64_t>& counts) {
    return std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; });
  }

  std::unique_ptr<Communicator> owned_;  // a duplicate world's host world (else the caller keeps host_)
  Communicator& host_;
  Device device_;
  std::shared_ptr<Queue> queue_;
  ncclComm_t comm_ = nullptr;
  std::map<std::vector<int>, std::unique_ptr<NcclCommunicator>> groups_;
};

}  // namespace

bool built_with_nccl() { return true; }

int nccl_version() {
  int v = 0;
  check(nccl().get_version(&v), "ncclGetVersion");
  return v;
}

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host_world, Device device) {
  if (device.type != DeviceType::CUDA) fail("[comm] NCCL: ", device.str(), " is not a CUDA device");
  require_device(device);
  (void)nccl();  // a missing library: one line, before any collective
  return std::make_unique<NcclCommunicator>(host_world, device);
}

}  // namespace hspmd
