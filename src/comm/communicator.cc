// The backend-independent part of the communicator: blocking forms, byte
// accounting, and the single-process stub.
#include "hspmd/comm/communicator.h"

#include <algorithm>
#include <string>

#include "hspmd/core/error.h"

namespace hspmd {

void Communicator::all_reduce(float* data, int64_t count) {
  std::vector<Request> r;
  r.push_back(start_all_reduce(data, count));
  wait_all(r);
}

void Communicator::reduce_scatter(const float* send, float* recv, const std::vector<int64_t>& counts) {
  std::vector<Request> r;
  r.push_back(start_reduce_scatter(send, recv, counts));
  wait_all(r);
}

void Communicator::all_gather(const float* send, float* recv, const std::vector<int64_t>& counts) {
  std::vector<Request> r;
  r.push_back(start_all_gather(send, recv, counts));
  wait_all(r);
}

void Communicator::broadcast(float* data, int64_t count, int root) {
  std::vector<Request> r;
  r.push_back(start_broadcast(data, count, root));
  wait_all(r);
}

void Communicator::send(const float* data, int64_t count, int peer, int tag) {
  std::vector<Request> r;
  r.push_back(start_send(data, count, peer, tag));
  wait_all(r);
}

void Communicator::recv(float* data, int64_t count, int peer, int tag) {
  std::vector<Request> r;
  r.push_back(start_recv(data, count, peer, tag));
  wait_all(r);
}

void Communicator::batched_send_recv(const std::vector<SendBuffer>& sends, const std::vector<RecvBuffer>& recvs,
                                     int tag) {
  std::vector<Request> r;
  // Receives first: a library may then match incoming data without buffering.
  for (const RecvBuffer& b : recvs) r.push_back(start_recv(b.data, b.count, b.peer, tag));
  for (const SendBuffer& b : sends) r.push_back(start_send(b.data, b.count, b.peer, tag));
  wait_all(r);
}

void Communicator::count_all_reduce(int64_t count) {
  const int64_t n = size();
  const int64_t bytes = count * 4 * 2 * (n - 1) / n;
  counters_->sent += bytes;
  counters_->received += bytes;
}

void Communicator::count_reduce_scatter(const std::vector<int64_t>& counts) {
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  const int64_t mine = counts[rank()];
  counters_->sent += (total - mine) * 4;
  counters_->received += (size() - 1) * mine * 4;
}

void Communicator::count_all_gather(const std::vector<int64_t>& counts) {
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  const int64_t mine = counts[rank()];
  counters_->sent += (size() - 1) * mine * 4;
  counters_->received += (total - mine) * 4;
}

void Communicator::count_broadcast(int64_t count, int root) {
  if (rank() == root)
    counters_->sent += (size() - 1) * count * 4;
  else
    counters_->received += count * 4;
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

  Request start_all_reduce(float*, int64_t count) override {
    check_count(count, "all_reduce");
    return {};
  }
  Request start_reduce_scatter(const float* send, float* recv, const std::vector<int64_t>& counts) override {
    check_counts(counts, "reduce_scatter");
    std::copy(send, send + counts[0], recv);
    return {};
  }
  Request start_all_gather(const float* send, float* recv, const std::vector<int64_t>& counts) override {
    check_counts(counts, "all_gather");
    std::copy(send, send + counts[0], recv);
    return {};
  }
  Request start_broadcast(float*, int64_t count, int root) override {
    check_count(count, "broadcast");
    if (root != 0) fail("[comm] broadcast from rank ", root, " ", kNeedsMpi);
    return {};
  }
  Request start_send(const float*, int64_t, int peer, int) override {
    fail("[comm] send to rank ", peer, " ", kNeedsMpi);
  }
  Request start_recv(float*, int64_t, int peer, int) override {
    fail("[comm] recv from rank ", peer, " ", kNeedsMpi);
  }
  void wait_all(std::vector<Request>& requests) override { requests.clear(); }
  void barrier() override {}
  void abort(int) override {}

 private:
  static void check_count(int64_t count, const char* call) {
    if (count < 0) fail("[comm] ", call, ": negative count ", count);
  }
  static void check_counts(const std::vector<int64_t>& counts, const char* call) {
    if (counts.size() != 1) fail("[comm] ", call, ": ", counts.size(), " counts for a communicator of 1 rank");
    check_count(counts[0], call);
  }
};

}  // namespace

std::unique_ptr<Communicator> make_single_process_communicator() {
  return std::make_unique<SingleProcessCommunicator>();
}

}  // namespace hspmd
