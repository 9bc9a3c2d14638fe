// The staged communicator (communicator.h, docs/comm.md): device buffers
// through a host library. Each operation on a device stream becomes
//   1. device -> staging host copies of what is sent, in the stream's order;
//   2. a wait for those copies (the host library reads them next);
//   3. the host library's operation on the host copies (non-blocking);
//   4. at wait_all: the host library's wait, then host -> device copies of
//      what was received, in the stream's order, and a wait for them (the
//      staging blocks go back to the allocator afterwards).
// Operations on the CPU's stream pass through to the host library unless the
// wrapper stages host buffers too (the test mode).
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/error.h"

namespace hspmd {
namespace {

// One staging block of host memory, returned to its allocator when dropped.
class HostBlock {
 public:
  explicit HostBlock(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) ptr_ = staging_host_allocator().allocate(bytes_);
  }
  ~HostBlock() {
    if (ptr_ != nullptr) staging_host_allocator().deallocate(ptr_, bytes_);
  }
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;
  char* get() const { return static_cast<char*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A staged operation in flight: the host library's request, the staging
// blocks it reads and writes, and where its result goes back.
class StagedRequest final : public Request::Impl {
 public:
  Request inner;
  Stream* stream = nullptr;
  std::unique_ptr<HostBlock> send, recv;
  void* result = nullptr;        // device buffer receiving recv's bytes (none: nullptr)
  size_t result_bytes = 0;
};

size_t bytes_of(int64_t count, DType dtype) { return static_cast<size_t>(count) * dtype_size(dtype); }

int64_t total_of(const std::vector<int64_t>& counts) {
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return total;
}

// Counts the host library would refuse: it is then called with the caller's
// buffers and raises its own error before touching them.
bool bad_count(int64_t count) { return count < 0; }
bool bad_counts(const std::vector<int64_t>& counts, int size) {
  if (static_cast<int>(counts.size()) != size) return true;
  for (int64_t c : counts)
    if (c < 0) return true;
  return false;
}

class StagedCommunicator final : public Communicator {
 public:
  // The world: owns the host library's world.
  StagedCommunicator(std::unique_ptr<Communicator> owned, bool stage_host)
      : Communicator(counters_of(*owned)), owned_(std::move(owned)), host_(*owned_), stage_host_(stage_host) {}
  // A group: the host library's group, owned by its world.
  StagedCommunicator(Communicator& host, bool stage_host)
      : Communicator(counters_of(host)), host_(host), stage_host_(stage_host) {}

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }

  Communicator& group(const std::vector<int>& ranks) override {
    auto it = groups_.find(ranks);
    if (it != groups_.end()) return *it->second;
    Communicator& inner = host_.group(ranks);
    if (&inner == &host_) return *this;  // the stub's group({0}) is itself
    auto made = std::make_unique<StagedCommunicator>(inner, stage_host_);
    return *groups_.emplace(ranks, std::move(made)).first->second;
  }

  void wait_all(std::vector<Request>& requests) override;
  void barrier() override { host_.barrier(); }
  void abort(int code) override { host_.abort(code); }
  std::unique_ptr<Communicator> duplicate() override {
    HSPMD_CHECK(owned_ != nullptr, "duplicate() of a group");
    return std::make_unique<StagedCommunicator>(owned_->duplicate(), stage_host_);
  }

 protected:
  Request do_all_reduce(Stream& stream, void* data, int64_t count, DType dtype, ReduceOp op) override {
    if (!staged(stream) || bad_count(count)) return host_.start_all_reduce(stream, data, count, dtype, op);
    const size_t bytes = bytes_of(count, dtype);
    auto r = begin(stream, bytes, 0);
    copy_in(stream, r->send->get(), data, bytes);
    r->inner = host_.start_all_reduce(r->send->get(), count, dtype, op);
    r->result = data;
    r->result_bytes = bytes;
    r->recv = std::move(r->send);  // in place: the result is the send block
    return Request(std::move(r));
  }

  Request do_reduce_scatter(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                            DType dtype) override {
    if (!staged(stream) || bad_counts(counts, size()))
      return host_.start_reduce_scatter(stream, send, recv, counts, dtype);
    const size_t in = bytes_of(total_of(counts), dtype), out = bytes_of(counts[rank()], dtype);
    auto r = begin(stream, in, out);
    copy_in(stream, r->send->get(), send, in);
    r->inner = host_.start_reduce_scatter(r->send->get(), r->recv->get(), counts, dtype);
    r->result = recv;
    r->result_bytes = out;
    return Request(std::move(r));
  }

  Request do_all_gather(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                        DType dtype) override {
    if (!staged(stream) || bad_counts(counts, size()))
      return host_.start_all_gather(stream, send, recv, counts, dtype);
    const size_t in = bytes_of(counts[rank()], dtype), out = bytes_of(total_of(counts), dtype);
    auto r = begin(stream, in, out);
    copy_in(stream, r->send->get(), send, in);
    r->inner = host_.start_all_gather(r->send->get(), r->recv->get(), counts, dtype);
    r->result = recv;
    r->result_bytes = out;
    return Request(std::move(r));
  }

  Request do_broadcast(Stream& stream, void* data, int64_t count, DType dtype, int root) override {
    if (!staged(stream) || bad_count(count) || root < 0 || root >= size())
      return host_.start_broadcast(stream, data, count, dtype, root);
    const size_t bytes = bytes_of(count, dtype);
    auto r = begin(stream, bytes, 0);
    if (rank() == root)
      copy_in(stream, r->send->get(), data, bytes);
    else  // what a host library that writes nothing here (the shadow) delivers: zeros, as its receives
      std::memset(r->send->get(), 0, bytes);
    r->inner = host_.start_broadcast(r->send->get(), count, dtype, root);
    if (rank() != root) {
      r->result = data;
      r->result_bytes = bytes;
    }
    r->recv = std::move(r->send);
    return Request(std::move(r));
  }

  Request do_send(Stream& stream, const void* data, int64_t count, DType dtype, int peer, int tag) override {
    if (!staged(stream) || bad_count(count)) return host_.start_send(stream, data, count, dtype, peer, tag);
    const size_t bytes = bytes_of(count, dtype);
    auto r = begin(stream, bytes, 0);
    copy_in(stream, r->send->get(), data, bytes);
    r->inner = host_.start_send(r->send->get(), count, dtype, peer, tag);
    return Request(std::move(r));
  }

  Request do_recv(Stream& stream, void* data, int64_t count, DType dtype, int peer, int tag) override {
    if (!staged(stream) || bad_count(count)) return host_.start_recv(stream, data, count, dtype, peer, tag);
    const size_t bytes = bytes_of(count, dtype);
    auto r = begin(stream, 0, bytes);
    r->inner = host_.start_recv(r->recv->get(), count, dtype, peer, tag);
    r->result = data;
    r->result_bytes = bytes;
    return Request(std::move(r));
  }

 private:
  bool staged(const Stream& stream) const {
    return !(stream.device() == Device::cpu()) || stage_host_;
  }

  static std::unique_ptr<StagedRequest> begin(Stream& stream, size_t send_bytes, size_t recv_bytes) {
    auto r = std::make_unique<StagedRequest>();
    r->stream = &stream;
    r->send = std::make_unique<HostBlock>(send_bytes);
    r->recv = std::make_unique<HostBlock>(recv_bytes);
    return r;
  }

  // The send buffer as the stream's work leaves it, in host memory now.
  static void copy_in(Stream& stream, void* host, const void* data, size_t bytes) {
    copy_bytes(stream, host, data, bytes);
    stream.synchronize();
  }

  std::unique_ptr<Communicator> owned_;
  Communicator& host_;
  bool stage_host_;
  std::map<std::vector<int>, std::unique_ptr<StagedCommunicator>> groups_;
};

void StagedCommunicator::wait_all(std::vector<Request>& requests) {
  std::vector<Request> inner;
  std::vector<Request> keep;  // the staged requests, until their copies are done
  std::vector<StagedRequest*> staged;
  for (Request& r : requests) {
    if (!r.pending()) continue;
    if (auto* s = dynamic_cast<StagedRequest*>(r.impl())) {
      staged.push_back(s);
      if (s->inner.pending()) inner.push_back(std::move(s->inner));
    } else {
      inner.push_back(std::move(r));
    }
  }
  // Own the staged requests before anything can throw: their blocks must
  // outlive the host library's use of them.
  for (Request& r : requests)
    if (r.pending()) keep.push_back(std::move(r));
  requests.clear();
  host_.wait_all(inner);
  std::set<Stream*> streams;
  for (StagedRequest* s : staged) {
    if (s->result == nullptr || s->result_bytes == 0) continue;
    copy_bytes(*s->stream, s->result, s->recv->get(), s->result_bytes);
    streams.insert(s->stream);
  }
  for (Stream* stream : streams) stream->synchronize();  // the blocks are freed next
}

}  // namespace

std::unique_ptr<Communicator> make_staged_communicator(std::unique_ptr<Communicator> host, bool stage_host_buffers) {
  HSPMD_CHECK(host != nullptr, "make_staged_communicator: no communicator to wrap");
  return std::make_unique<StagedCommunicator>(std::move(host), stage_host_buffers);
}

bool stage_host_buffers_requested() {
  const char* v = std::getenv("HSPMD_COMM_STAGE_HOST");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace hspmd
