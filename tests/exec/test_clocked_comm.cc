// ClockedCommunicator under mpirun (2 ranks, one node per rank, 1 GB/s
// links): data arrives intact, a receiver's clock moves to the sender's
// clock at its send plus the transfer time, waiting is not billed as
// compute, computation overlapping a transfer hides it, collectives
// complete at the latest member's start plus their ring volume's time,
// typed buffers are billed by their bytes (elements times dtype size), and
// a model-mode clock reads no CPU time.
#include <gtest/gtest.h>

#include <ctime>
#include <vector>

#include "exec/clocked_comm.h"
#include "comm/mpi_test_main.h"

namespace hspmd {
namespace {

Topology two_nodes() {
  return Topology::from_json(nlohmann::json::parse(R"({
    "catalog": {"gpu": {"tflops": 1, "memory_gib": 1, "intra_node_gbps": 1, "inter_node_gbps": 1}},
    "nodes": [{"type": "gpu", "ranks": [0, 0]}, {"type": "gpu", "ranks": [1, 1]}]})"));
}

double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Burns `seconds` of process CPU time (what the virtual clock measures), so
// the figures hold however loaded the machine is.
void burn(double seconds) {
  const double until = cpu_seconds() + seconds;
  volatile double x = 0;
  while (cpu_seconds() < until) x = x + 1.0;
}

constexpr int64_t kFloats = 1 << 20;  // 4 MiB: 4.2 ms at 1 GB/s
constexpr double kTransfer = kFloats * 4 / 1e9;

TEST(ClockedComm, ReceiverWaitsForTheSendersClockPlusTransfer) {
  Communicator& world = testing::test_world();
  ASSERT_EQ(world.size(), 2);
  const Topology topo = two_nodes();
  VirtualClock clock(1.0);
  ClockedCommunicator comm(world, clock, topo, {0, 1});
  std::vector<float> buf(kFloats, world.rank() == 0 ? 3.0f : 0.0f);
  world.barrier();
  clock.begin_compute();
  std::vector<Request> r;
  double sent_at = 0;
  if (world.rank() == 0) {
    burn(0.05);  // the sender computes first
    r.push_back(comm.start_send(buf.data(), kFloats, 1, 5));
    sent_at = clock.now();
  } else {
    r.push_back(comm.start_recv(buf.data(), kFloats, 0, 5));
  }
  comm.wait_all(r);
  clock.end_compute();
  float theirs[2] = {static_cast<float>(sent_at), 0.0f};
  world.broadcast(theirs, 2, 0);
  if (world.rank() == 1) {
    EXPECT_EQ(buf[kFloats - 1], 3.0f);
    EXPECT_GE(clock.now(), theirs[0] + kTransfer - 1e-6);
    EXPECT_GE(theirs[0], 0.04);
    EXPECT_LT(clock.compute_s(), 0.02);  // waiting was not compute
    EXPECT_GE(clock.comm_s(), 0.04);
  } else {
    EXPECT_NEAR(clock.now(), sent_at + kTransfer, 0.02);  // the sender waits for its transfer only
  }
}

TEST(ClockedComm, ComputeOverlappingATransferHidesIt) {
  Communicator& world = testing::test_world();
  const Topology topo = two_nodes();
  VirtualClock clock(1.0);
  ClockedCommunicator comm(world, clock, topo, {0, 1});
  std::vector<float> buf(kFloats, 1.0f);
  world.barrier();
  clock.begin_compute();
  std::vector<Request> r;
  if (world.rank() == 0) r.push_back(comm.start_send(buf.data(), kFloats, 1, 6));
  else r.push_back(comm.start_recv(buf.data(), kFloats, 0, 6));
  burn(0.03);  // longer than the transfer: both ranks compute while it flies
  const double before = clock.now();
  comm.wait_all(r);
  clock.end_compute();
  EXPECT_LT(clock.comm_s(), 0.01);
  EXPECT_GE(clock.now(), before);
}

TEST(ClockedComm, CollectiveCompletesAtTheLatestMemberPlusItsVolume) {
  Communicator& world = testing::test_world();
  const Topology topo = two_nodes();
  VirtualClock clock(world.rank() == 1 ? 3.0 : 1.0);  // rank 1 is three times slower
  ClockedCommunicator comm(world, clock, topo, {0, 1});
  std::vector<float> buf(kFloats, static_cast<float>(world.rank() + 1));
  world.barrier();
  clock.begin_compute();
  if (world.rank() == 1) burn(0.02);
  clock.end_compute();  // the clock as the collective starts
  const double mine = clock.now();
  clock.begin_compute();
  comm.all_reduce(buf.data(), kFloats);
  clock.end_compute();
  EXPECT_EQ(buf[0], 3.0f);
  float latest = static_cast<float>(mine);
  float both[2];
  world.all_gather(&latest, both, {1, 1});
  const double all_reduce_time = 2.0 * (2 - 1) / 2 * kFloats * 4 / 1e9;
  EXPECT_GE(clock.now(), std::max(both[0], both[1]) + all_reduce_time - 1e-6);
  EXPECT_GE(std::max(both[0], both[1]), 0.05);  // 0.02 s of CPU x slowdown 3
}

TEST(ClockedComm, TypedBuffersAreBilledByTheirBytes) {
  Communicator& world = testing::test_world();
  const Topology topo = two_nodes();
  VirtualClock clock(1.0);
  ClockedCommunicator comm(world, clock, topo, {0, 1});
  constexpr int64_t kCount = 1 << 20;  // 8 MiB of i64: 8.4 ms at 1 GB/s (f32 would be 4.2 ms)
  constexpr double kI64Transfer = kCount * 8 / 1e9;
  const int64_t big = (int64_t{1} << 62) + 1;
  std::vector<int64_t> buf(kCount, world.rank() == 0 ? big : 0);
  world.barrier();
  world.reset_bytes();
  clock.begin_compute();
  std::vector<Request> r;
  double sent_at = 0;
  if (world.rank() == 0) {
    r.push_back(comm.start_send(buf.data(), kCount, DType::I64, 1, 7));
    sent_at = clock.now();
  } else {
    r.push_back(comm.start_recv(buf.data(), kCount, DType::I64, 0, 7));
  }
  comm.wait_all(r);
  clock.end_compute();
  // The data and one f64 clock went through the real communicator.
  EXPECT_EQ(world.bytes().sent, world.rank() == 0 ? kCount * 8 + 8 : 0);
  EXPECT_EQ(world.bytes().received, world.rank() == 1 ? kCount * 8 + 8 : 0);
  double theirs = sent_at;
  world.broadcast(&theirs, 1, 0);
  EXPECT_GE(clock.now(), theirs + kI64Transfer - 1e-4);
  if (world.rank() == 1) {
    EXPECT_EQ(buf[kCount - 1], big);
  }

  // A bf16 sum and an f64 max through the clocked communicator.
  std::vector<uint16_t> h(1000, f32_to_bf16(world.rank() + 1.0f));
  std::vector<double> d = {1.0 + world.rank() * 0x1p-50};
  const double before = clock.now();
  clock.begin_compute();
  comm.all_reduce(h.data(), 1000);
  comm.all_reduce(d.data(), 1, ReduceOp::kMax);
  clock.end_compute();
  EXPECT_EQ(bf16_to_f32(h[999]), 3.0f);
  EXPECT_EQ(d[0], 1.0 + 0x1p-50);
  EXPECT_GE(clock.now(), before + 2.0 * (2 - 1) / 2 * 1000 * 2 / 1e9);
}

// Model mode (--clock model): the brackets the communicator splits read no
// CPU time, so only the transfers and the peers' clocks move the clock; the
// sender's advance() (a predicted op time) reaches the receiver.
TEST(ClockedComm, ModelModeBillsNoCpuTime) {
  Communicator& world = testing::test_world();
  const Topology topo = two_nodes();
  VirtualClock clock(1.0, ClockMode::kModel);
  ClockedCommunicator comm(world, clock, topo, {0, 1});
  std::vector<float> buf(kFloats, 1.0f);
  world.barrier();
  clock.begin_compute();
  burn(0.02);
  if (world.rank() == 0) clock.advance(0.5);
  std::vector<Request> r;
  if (world.rank() == 0) r.push_back(comm.start_send(buf.data(), kFloats, 1, 8));
  else r.push_back(comm.start_recv(buf.data(), kFloats, 0, 8));
  burn(0.02);
  comm.wait_all(r);
  clock.end_compute();
  EXPECT_EQ(clock.compute_s(), world.rank() == 0 ? 0.5 : 0.0);
  EXPECT_DOUBLE_EQ(clock.now(), 0.5 + kTransfer);  // both: the send's start plus its transfer
}

}  // namespace
}  // namespace hspmd
