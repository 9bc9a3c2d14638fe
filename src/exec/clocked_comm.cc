#include "exec/clocked_comm.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <numeric>

#include "hspmd/core/error.h"

namespace hspmd {

namespace {

int64_t bytes_of(int64_t count, DType dtype) { return count * static_cast<int64_t>(dtype_size(dtype)); }

}  // namespace

// One operation: the real request, its clock exchange, and what decides
// when it completes.
struct ClockedCommunicator::Impl : Request::Impl {
  enum Kind { kSend, kRecv, kCollective } kind = kSend;
  Request data, clock;
  std::vector<double> clocks;  // send: own start clock; recv: the sender's; collective: [own, all members']
  double start = 0;            // own clock at the start
  double seconds = 0;          // transfer time on the link(s)
};

ClockedCommunicator::ClockedCommunicator(Communicator& inner, VirtualClock& clock,
                                         const Topology& topology, std::vector<int> world_ranks)
    : Communicator(std::make_shared<ByteCounters>()), inner_(inner), clock_(clock),
      topology_(topology), world_ranks_(std::move(world_ranks)) {
  HSPMD_CHECK(static_cast<int>(world_ranks_.size()) == inner.size(),
              "clocked communicator: one world rank per member");
}

double ClockedCommunicator::start_clock() {
  clock_.end_compute();
  clock_.begin_compute();
  return clock_.now();
}

double ClockedCommunicator::link_seconds(int peer, int64_t bytes) const {
  const int me = world_ranks_.at(rank()), other = world_ranks_.at(peer);
  return me == other ? 0.0 : static_cast<double>(bytes) / (topology_.bandwidth(me, other) * 1e9);
}

double ClockedCommunicator::group_seconds(int64_t bytes) const {
  double slowest = 0;
  for (int m = 0; m < size(); ++m)
    if (m != rank()) slowest = std::max(slowest, link_seconds(m, bytes));
  return slowest;
}

// Every member contributes its start clock to an all-gather started beside
// the data collective (the same order on every member).
Request ClockedCommunicator::collective(Request data, int64_t bytes) {
  auto impl = std::make_unique<Impl>();
  impl->kind = Impl::kCollective;
  impl->data = std::move(data);
  impl->start = clock_.now();
  impl->seconds = group_seconds(bytes);
  impl->clocks.resize(size() + 1);
  impl->clocks[0] = impl->start;
  impl->clock = inner_.start_all_gather(impl->clocks.data(), impl->clocks.data() + 1,
                                        std::vector<int64_t>(size(), 1), DType::F64);
  return Request(std::move(impl));
}

Request ClockedCommunicator::do_all_reduce(Stream& stream, void* data, int64_t count, DType dtype, ReduceOp op) {
  start_clock();
  const int n = size();
  return collective(inner_.start_all_reduce(stream, data, count, dtype, op),
                    2 * (n - 1) * bytes_of(count, dtype) / std::max(n, 1));
}

Request ClockedCommunicator::do_reduce_scatter(Stream& stream, const void* send, void* recv,
                                                  const std::vector<int64_t>& counts, DType dtype) {
  start_clock();
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  return collective(inner_.start_reduce_scatter(stream, send, recv, counts, dtype),
                    bytes_of(total - counts.at(rank()), dtype));
}

Request ClockedCommunicator::do_all_gather(Stream& stream, const void* send, void* recv,
                                              const std::vector<int64_t>& counts, DType dtype) {
  start_clock();
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  return collective(inner_.start_all_gather(stream, send, recv, counts, dtype),
                    bytes_of(total - counts.at(rank()), dtype));
}

Request ClockedCommunicator::do_broadcast(Stream& stream, void* data, int64_t count, DType dtype, int root) {
  start_clock();
  return collective(inner_.start_broadcast(stream, data, count, dtype, root), bytes_of(count, dtype));
}

Request ClockedCommunicator::do_send(Stream& stream, const void* data, int64_t count, DType dtype, int peer, int tag) {
  HSPMD_CHECK(tag >= 0 && tag < kClockTagOffset, "clocked communicator: tag ", tag, " too large");
  auto impl = std::make_unique<Impl>();
  impl->kind = Impl::kSend;
  impl->start = start_clock();
  impl->seconds = link_seconds(peer, bytes_of(count, dtype));
  impl->data = inner_.start_send(stream, data, count, dtype, peer, tag);
  impl->clocks = {impl->start};
  impl->clock = inner_.start_send(impl->clocks.data(), 1, DType::F64, peer, tag + kClockTagOffset);
  return Request(std::move(impl));
}

Request ClockedCommunicator::do_recv(Stream& stream, void* data, int64_t count, DType dtype, int peer, int tag) {
  HSPMD_CHECK(tag >= 0 && tag < kClockTagOffset, "clocked communicator: tag ", tag, " too large");
  auto impl = std::make_unique<Impl>();
  impl->kind = Impl::kRecv;
  impl->start = start_clock();
  impl->seconds = link_seconds(peer, bytes_of(count, dtype));
  impl->data = inner_.start_recv(stream, data, count, dtype, peer, tag);
  impl->clocks.resize(1);
  impl->clock = inner_.start_recv(impl->clocks.data(), 1, DType::F64, peer, tag + kClockTagOffset);
  return Request(std::move(impl));
}

void ClockedCommunicator::wait_all(std::vector<Request>& requests) {
  clock_.end_compute();
  std::vector<Request> real;
  std::vector<Impl*> ops;
  for (Request& r : requests) {
    auto* op = dynamic_cast<Impl*>(r.impl());
    if (op == nullptr) {
      if (r.pending()) real.push_back(std::move(r));
      continue;
    }
    ops.push_back(op);
    real.push_back(std::move(op->data));
    real.push_back(std::move(op->clock));
  }
  inner_.wait_all(real);
  double done = clock_.now();
  for (const Impl* op : ops) {
    double from = op->start;
    if (op->kind == Impl::kRecv) from = op->clocks[0];
    if (op->kind == Impl::kCollective)
      for (int m = 0; m < size(); ++m) from = std::max(from, op->clocks[m + 1]);
    done = std::max(done, from + op->seconds);
  }
  requests.clear();
  const double t0 = clock_.now();
  clock_.communicate(done, 0.0);
  if (clock_.now() > t0) clock_.record("op-internal communication", "comm", t0);
  clock_.begin_compute();
}

}  // namespace hspmd
