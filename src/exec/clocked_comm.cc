#include "exec/clocked_comm.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <numeric>

#include "hspmd/core/error.h"

namespace hspmd {

namespace {

// A virtual time as two floats (hi, lo): f32 is what the communicator moves.
void encode(double t, float* out) {
  out[0] = static_cast<float>(t);
  out[1] = static_cast<float>(t - out[0]);
}
double decode(const float* in) { return static_cast<double>(in[0]) + in[1]; }

}  // namespace

// One operation: the real request, its clock exchange, and what decides
// when it completes.
struct ClockedCommunicator::Impl : Request::Impl {
  enum Kind { kSend, kRecv, kCollective } kind = kSend;
  Request data, clock;
  std::vector<float> clocks;  // send: own start clock; recv: the sender's; collective: all members'
  double start = 0;           // own clock at the start
  double seconds = 0;         // transfer time on the link(s)
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
  impl->clocks.resize(2 * (size() + 1));
  encode(impl->start, impl->clocks.data());
  impl->clock = inner_.start_all_gather(impl->clocks.data(), impl->clocks.data() + 2,
                                        std::vector<int64_t>(size(), 2));
  return Request(std::move(impl));
}

Request ClockedCommunicator::start_all_reduce(float* data, int64_t count) {
  start_clock();
  const int n = size();
  return collective(inner_.start_all_reduce(data, count), 2 * (n - 1) * count * 4 / std::max(n, 1));
}

Request ClockedCommunicator::start_reduce_scatter(const float* send, float* recv,
                                                  const std::vector<int64_t>& counts) {
  start_clock();
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  return collective(inner_.start_reduce_scatter(send, recv, counts), (total - counts.at(rank())) * 4);
}

Request ClockedCommunicator::start_all_gather(const float* send, float* recv,
                                              const std::vector<int64_t>& counts) {
  start_clock();
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  return collective(inner_.start_all_gather(send, recv, counts), (total - counts.at(rank())) * 4);
}

Request ClockedCommunicator::start_broadcast(float* data, int64_t count, int root) {
  start_clock();
  return collective(inner_.start_broadcast(data, count, root), count * 4);
}

Request ClockedCommunicator::start_send(const float* data, int64_t count, int peer, int tag) {
  HSPMD_CHECK(tag >= 0 && tag < kClockTagOffset, "clocked communicator: tag ", tag, " too large");
  auto impl = std::make_unique<Impl>();
  impl->kind = Impl::kSend;
  impl->start = start_clock();
  impl->seconds = link_seconds(peer, count * 4);
  impl->data = inner_.start_send(data, count, peer, tag);
  impl->clocks.resize(2);
  encode(impl->start, impl->clocks.data());
  impl->clock = inner_.start_send(impl->clocks.data(), 2, peer, tag + kClockTagOffset);
  return Request(std::move(impl));
}

Request ClockedCommunicator::start_recv(float* data, int64_t count, int peer, int tag) {
  HSPMD_CHECK(tag >= 0 && tag < kClockTagOffset, "clocked communicator: tag ", tag, " too large");
  auto impl = std::make_unique<Impl>();
  impl->kind = Impl::kRecv;
  impl->start = start_clock();
  impl->seconds = link_seconds(peer, count * 4);
  impl->data = inner_.start_recv(data, count, peer, tag);
  impl->clocks.resize(2);
  impl->clock = inner_.start_recv(impl->clocks.data(), 2, peer, tag + kClockTagOffset);
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
    if (op->kind == Impl::kRecv) from = decode(op->clocks.data());
    if (op->kind == Impl::kCollective)
      for (int m = 0; m < size(); ++m) from = std::max(from, decode(op->clocks.data() + 2 * (m + 1)));
    done = std::max(done, from + op->seconds);
  }
  requests.clear();
  const double t0 = clock_.now();
  clock_.communicate(done, 0.0);
  if (clock_.now() > t0) clock_.record("op-internal communication", "comm", t0);
  clock_.begin_compute();
}

}  // namespace hspmd
