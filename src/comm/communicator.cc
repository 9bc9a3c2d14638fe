// The backend-independent part of the communicator: blocking forms, byte
// accounting, and the single-process stub.
#include "hspmd/comm/communicator.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "hspmd/core/device_code.h"
#include "hspmd/core/error.h"

namespace hspmd {

namespace {

// The buffer of an NDArray form: contiguous and on the stream's device.
void* array_buffer(const NDArray& a, const Stream& stream, const char* call) {
  if (!a.valid() || !a.is_contiguous())
    fail("[comm] ", call, ": the buffer must be a valid contiguous array");
  if (!(a.device() == stream.device()))
    fail("[comm] ", call, ": the array lives on ", a.device().str(), " but the stream on ",
         stream.device().str());
  const DeviceCodeScope code;  // a device's pointer, for the library (device_code.h)
  return a.raw_data();
}

}  // namespace

std::unique_ptr<Communicator> Communicator::duplicate() {
  fail("[comm] this backend cannot duplicate its world (no second world for a communication thread)");
}

Request Communicator::start_all_reduce(Stream& stream, NDArray& data, ReduceOp op) {
  return start_all_reduce(stream, array_buffer(data, stream, "all_reduce"), data.numel(), data.dtype(), op);
}

Request Communicator::start_reduce_scatter(Stream& stream, const NDArray& send, NDArray& recv,
                                           const std::vector<int64_t>& counts) {
  if (send.dtype() != recv.dtype()) fail("[comm] reduce_scatter: send and recv dtypes differ");
  return start_reduce_scatter(stream, array_buffer(send, stream, "reduce_scatter"),
                              array_buffer(recv, stream, "reduce_scatter"), counts, send.dtype());
}

Request Communicator::start_all_gather(Stream& stream, const NDArray& send, NDArray& recv,
                                       const std::vector<int64_t>& counts) {
  if (send.dtype() != recv.dtype()) fail("[comm] all_gather: send and recv dtypes differ");
  return start_all_gather(stream, array_buffer(send, stream, "all_gather"),
                          array_buffer(recv, stream, "all_gather"), counts, send.dtype());
}

Request Communicator::start_broadcast(Stream& stream, NDArray& data, int root) {
  return start_broadcast(stream, array_buffer(data, stream, "broadcast"), data.numel(), data.dtype(), root);
}

Request Communicator::start_send(Stream& stream, const NDArray& data, int peer, int tag) {
  return start_send(stream, array_buffer(data, stream, "send"), data.numel(), data.dtype(), peer, tag);
}

Request Communicator::start_recv(Stream& stream, NDArray& data, int peer, int tag) {
  return start_recv(stream, array_buffer(data, stream, "recv"), data.numel(), data.dtype(), peer, tag);
}

void Communicator::all_reduce(void* data, int64_t count, DType dtype, ReduceOp op) {
  std::vector<Request> r;
  r.push_back(start_all_reduce(data, count, dtype, op));
  wait_all(r);
}

void Communicator::reduce_scatter(const void* send, void* recv, const std::vector<int64_t>& counts, DType dtype) {
  std::vector<Request> r;
  r.push_back(start_reduce_scatter(send, recv, counts, dtype));
  wait_all(r);
}

void Communicator::all_gather(const void* send, void* recv, const std::vector<int64_t>& counts, DType dtype) {
  std::vector<Request> r;
  r.push_back(start_all_gather(send, recv, counts, dtype));
  wait_all(r);
}

void Communicator::broadcast(void* data, int64_t count, DType dtype, int root) {
  std::vector<Request> r;
  r.push_back(start_broadcast(data, count, dtype, root));
  wait_all(r);
}

void Communicator::send(const void* data, int64_t count, DType dtype, int peer, int tag) {
  std::vector<Request> r;
  r.push_back(start_send(data, count, dtype, peer, tag));
  wait_all(r);
}

void Communicator::recv(void* data, int64_t count, DType dtype, int peer, int tag) {
  std::vector<Request> r;
  r.push_back(start_recv(data, count, dtype, peer, tag));
  wait_all(r);
}

void Communicator::batched_send_recv(const std::vector<SendBuffer>& sends, const std::vector<RecvBuffer>& recvs,
                                     int tag) {
  batched_send_recv(host_stream(), sends, recvs, tag);
}

void Communicator::batched_send_recv(Stream& stream, const std::vector<SendBuffer>& sends,
                                     const std::vector<RecvBuffer>& recvs, int tag) {
  std::vector<Request> r;
  // Receives first: a library may then match incoming data without buffering.
  for (const RecvBuffer& b : recvs) r.push_back(start_recv(stream, b.data, b.count, b.dtype, b.peer, tag));
  for (const SendBuffer& b : sends) r.push_back(start_send(stream, b.data, b.count, b.dtype, b.peer, tag));
  wait_all(r);
}

SendBuffer send_buffer(int peer, const NDArray& a) {
  if (!a.valid() || !a.is_contiguous()) fail("[comm] send: the buffer must be a valid contiguous array");
  const DeviceCodeScope code;
  return SendBuffer{peer, a.raw_data(), a.numel(), a.dtype()};
}

RecvBuffer recv_buffer(int peer, NDArray& a) {
  if (!a.valid() || !a.is_contiguous()) fail("[comm] recv: the buffer must be a valid contiguous array");
  const DeviceCodeScope code;
  return RecvBuffer{peer, a.raw_data(), a.numel(), a.dtype()};
}

void Communicator::count_all_reduce(int64_t count, DType dtype) {
  const int64_t n = size();
  const int64_t bytes = count * element_bytes(dtype) * 2 * (n - 1) / n;
  counters_->sent += bytes;
  counters_->received += bytes;
}

void Communicator::count_reduce_scatter(const std::vector<int64_t>& counts, DType dtype) {
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  const int64_t mine = counts[rank()], e = element_bytes(dtype);
  counters_->sent += (total - mine) * e;
  counters_->received += (size() - 1) * mine * e;
}

void Communicator::count_all_gather(const std::vector<int64_t>& counts, DType dtype) {
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  const int64_t mine = counts[rank()], e = element_bytes(dtype);
  counters_->sent += (size() - 1) * mine * e;
  counters_->received += (total - mine) * e;
}

void Communicator::count_broadcast(int64_t count, DType dtype, int root) {
  if (rank() == root)
    counters_->sent += (size() - 1) * count * element_bytes(dtype);
  else
    counters_->received += count * element_bytes(dtype);
}

namespace {

constexpr const char* kNeedsMpi = "needs MPI (single-process communicator)";

// Size 1: every collective is a copy, nothing else is possible.
class SingleProcessCommunicator final : public Communicator {
 public:
  SingleProcessCommunicator() : Communicator(std::make_shared<ByteCounters>()) {}


  int rank() const override { return 0; }
  int size() const override { return 1; }

  Communicator& group(const std::vector<int>& ranks) override {
    if (ranks != std::vector<int>{0}) fail("[comm] group of ", ranks.size(), " ranks ", kNeedsMpi);
    return *this;
  }

  Request do_all_reduce(Stream& stream, void*, int64_t count, DType, ReduceOp) override {
    stream.synchronize();
    check_count(count, "all_reduce");
    return {};
  }
  Request do_reduce_scatter(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                               DType dtype) override {
    stream.synchronize();
    check_counts(counts, "reduce_scatter");
    copy(send, recv, counts[0], dtype);
    return {};
  }
  Request do_all_gather(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                           DType dtype) override {
    stream.synchronize();
    check_counts(counts, "all_gather");
    copy(send, recv, counts[0], dtype);
    return {};
  }
  Request do_broadcast(Stream& stream, void*, int64_t count, DType, int root) override {
    stream.synchronize();
    check_count(count, "broadcast");
    if (root != 0) fail("[comm] broadcast from rank ", root, " ", kNeedsMpi);
    return {};
  }
  Request do_send(Stream& stream, const void*, int64_t, DType, int peer, int) override {
    stream.synchronize();
    fail("[comm] send to rank ", peer, " ", kNeedsMpi);
  }
  Request do_recv(Stream& stream, void*, int64_t, DType, int peer, int) override {
    stream.synchronize();
    fail("[comm] recv from rank ", peer, " ", kNeedsMpi);
  }
  void wait_all(std::vector<Request>& requests) override { requests.clear(); }
  void barrier() override {}
  void abort(int) override {}
  std::unique_ptr<Communicator> duplicate() override { return std::make_unique<SingleProcessCommunicator>(); }

 private:
  static void check_count(int64_t count, const char* call) {
    if (count < 0) fail("[comm] ", call, ": negative count ", count);
  }
  static void check_counts(const std::vector<int64_t>& counts, const char* call) {
    if (counts.size() != 1) fail("[comm] ", call, ": ", counts.size(), " counts for a communicator of 1 rank");
    check_count(counts[0], call);
  }
  // The one member's piece: a byte copy (in place when send is recv).
  static void copy(const void* send, void* recv, int64_t count, DType dtype) {
    const size_t bytes = static_cast<size_t>(count) * dtype_size(dtype);
    if (bytes > 0 && send != recv) std::memmove(recv, send, bytes);
  }
};

}  // namespace

std::unique_ptr<Communicator> make_single_process_communicator() {
  return make_staged_communicator(std::make_unique<SingleProcessCommunicator>(), stage_host_buffers_requested());
}

bool job_spans_hosts() {
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  return local && size && std::atoi(local) < std::atoi(size);
}

}  // namespace hspmd
