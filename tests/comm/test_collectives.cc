// The communicator's collectives and point-to-point on 4 ranks (mpirun -np 4):
// uneven and empty pieces, groups (order, caching), overlapping collectives
// in flight at once, batched send/recv, byte counters and error paths.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "comm/mpi_test_main.h"
#include "hspmd/core/error.h"

namespace hspmd {
namespace {

using hspmd::testing::test_world;

class Collectives : public ::testing::Test {
 protected:
  void SetUp() override {
    if (test_world().size() != 4) GTEST_SKIP() << "needs mpirun -np 4";
    test_world().barrier();
  }
  Communicator& world() { return test_world(); }
  int rank() { return world().rank(); }
};

TEST_F(Collectives, AllReduceSums) {
  std::vector<float> v = {1.0f * rank(), 2.0f, -1.0f};
  world().all_reduce(v.data(), 3);
  EXPECT_EQ(v, (std::vector<float>{6, 8, -4}));
}

TEST_F(Collectives, ReduceScatterWithUnevenAndEmptyPieces) {
  const std::vector<int64_t> counts = {3, 0, 5, 1};
  std::vector<float> send(9);
  std::iota(send.begin(), send.end(), 10.0f * rank());
  std::vector<float> recv(counts[rank()] + 1, -1.0f);
  world().reduce_scatter(send.data(), recv.data(), counts);
  const int64_t offset = std::accumulate(counts.begin(), counts.begin() + rank(), int64_t{0});
  for (int64_t i = 0; i < counts[rank()]; ++i) EXPECT_EQ(recv[i], 60.0f + 4.0f * (offset + i)) << i;
  EXPECT_EQ(recv.back(), -1.0f);  // nothing written past the piece
}

TEST_F(Collectives, AllGatherWithUnevenAndEmptyPieces) {
  const std::vector<int64_t> counts = {2, 4, 0, 1};
  std::vector<float> send(counts[rank()], static_cast<float>(rank() + 1));
  std::vector<float> recv(7, -1.0f);
  world().all_gather(send.data(), recv.data(), counts);
  EXPECT_EQ(recv, (std::vector<float>{1, 1, 2, 2, 2, 2, 4}));
}

TEST_F(Collectives, BroadcastFromAnyRoot) {
  std::vector<float> v(5, static_cast<float>(rank()));
  world().broadcast(v.data(), 5, 2);
  EXPECT_EQ(v, std::vector<float>(5, 2.0f));
}

TEST_F(Collectives, GroupsKeepTheGivenOrderAndAreCached) {
  const std::vector<int> members = rank() % 2 == 0 ? std::vector<int>{2, 0} : std::vector<int>{3, 1};
  Communicator& g = world().group(members);
  EXPECT_EQ(&g, &world().group(members));
  EXPECT_EQ(g.size(), 2);
  EXPECT_EQ(g.rank(), rank() < 2 ? 1 : 0);
  // Reduce-scatter in group order: position 0 (rank 2 or 3) gets the first piece.
  std::vector<float> send = {1.0f * rank(), 100.0f * rank()}, recv(1);
  g.reduce_scatter(send.data(), recv.data(), {1, 1});
  const float pair_sum = rank() % 2 == 0 ? 2.0f : 4.0f;
  EXPECT_EQ(recv[0], g.rank() == 0 ? pair_sum : 100.0f * pair_sum);
  // The same members in another order are another communicator.
  std::vector<int> sorted = members;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(&world().group(sorted), &g);
  EXPECT_EQ(world().group(sorted).rank(), rank() < 2 ? 0 : 1);
  // Groups of groups: ranks are the group's own.
  Communicator& self = g.group({g.rank()});
  EXPECT_EQ(self.size(), 1);
}

// Every rank sits in two ring groups {r, r+1} and starts their all_reduces in
// opposite orders on even and odd ranks: fine when waited together.
TEST_F(Collectives, OverlappingCollectivesInFlightTogether) {
  const int r = rank(), next = (r + 1) % 4, prev = (r + 3) % 4;
  std::vector<int> ahead = {std::min(r, next), std::max(r, next)};
  std::vector<int> behind = {std::min(r, prev), std::max(r, prev)};
  // Creation in one global (sorted) order, as execute() does.
  std::vector<std::vector<int>> sorted = {ahead, behind};
  std::sort(sorted.begin(), sorted.end());
  for (const auto& g : sorted) world().group(g);
  float a = r + 1.0f, b = r + 1.0f;  // each group sums its two members' r + 1
  std::vector<Request> reqs;
  if (r % 2 == 0) {
    reqs.push_back(world().group(ahead).start_all_reduce(&a, 1));
    reqs.push_back(world().group(behind).start_all_reduce(&b, 1));
  } else {
    reqs.push_back(world().group(behind).start_all_reduce(&b, 1));
    reqs.push_back(world().group(ahead).start_all_reduce(&a, 1));
  }
  world().wait_all(reqs);
  EXPECT_TRUE(reqs.empty());
  EXPECT_EQ(a, r + next + 2.0f);
  EXPECT_EQ(b, r + prev + 2.0f);
}

TEST_F(Collectives, BatchedSendRecvAllToAll) {
  std::vector<std::vector<float>> out(4), in(4);
  std::vector<SendBuffer> sends;
  std::vector<RecvBuffer> recvs;
  for (int p = 0; p < 4; ++p) {
    if (p == rank()) continue;
    out[p].assign(p + 1 + rank(), 10.0f * rank() + p);  // sizes differ per pair
    in[p].assign(p + 1 + rank(), -1.0f);
    sends.push_back({p, out[p].data(), static_cast<int64_t>(out[p].size())});
    recvs.push_back({p, in[p].data(), static_cast<int64_t>(in[p].size())});
  }
  world().batched_send_recv(sends, recvs, 5);
  for (int p = 0; p < 4; ++p) {
    if (p != rank()) {
      EXPECT_EQ(in[p], std::vector<float>(p + 1 + rank(), 10.0f * p + rank())) << p;
    }
  }
}

TEST_F(Collectives, MessagesOfOnePairArriveInOrder) {
  std::vector<float> a = {1, 2}, b = {3}, x(2), y(1);
  const int peer = rank() ^ 1;
  std::vector<Request> reqs;
  reqs.push_back(world().start_recv(x.data(), 2, peer, 9));
  reqs.push_back(world().start_recv(y.data(), 1, peer, 9));
  reqs.push_back(world().start_send(a.data(), 2, peer, 9));
  reqs.push_back(world().start_send(b.data(), 1, peer, 9));
  world().wait_all(reqs);
  EXPECT_EQ(x, a);
  EXPECT_EQ(y, b);
}

TEST_F(Collectives, ByteCountersFollowTheRingModel) {
  world().reset_bytes();
  std::vector<float> v(8, 1.0f);
  world().all_reduce(v.data(), 8);  // 2·3/4·32 bytes each way
  EXPECT_EQ(world().bytes().sent, 48);
  EXPECT_EQ(world().bytes().received, 48);
  Communicator& pair = world().group({rank() & ~1, rank() | 1});
  std::vector<float> g(6);
  pair.all_gather(v.data(), g.data(), {2, 4});  // groups share the world's counters
  const int64_t mine = pair.rank() == 0 ? 2 : 4;
  EXPECT_EQ(world().bytes().sent, 48 + mine * 4);
  EXPECT_EQ(world().bytes().received, 48 + (6 - mine) * 4);
  world().reset_bytes();
  if (rank() == 0) world().send(v.data(), 5, 3);
  if (rank() == 3) world().recv(v.data(), 5, 0);
  EXPECT_EQ(world().bytes().sent, rank() == 0 ? 20 : 0);
  EXPECT_EQ(world().bytes().received, rank() == 3 ? 20 : 0);
}

TEST_F(Collectives, ErrorsNameTheCall) {
  EXPECT_THROW(world().group({(rank() + 1) % 4}), Error);
  EXPECT_THROW(world().group({rank(), rank()}), Error);
  float x = 0;
  EXPECT_THROW(world().start_send(&x, 1, 4, 0), Error);
  EXPECT_THROW(world().start_all_gather(&x, &x, {1, 1}), Error);
  // A message shorter than the receiver expects.
  std::vector<float> buf(5, 0.0f);
  const int peer = rank() ^ 1;
  std::vector<Request> reqs;
  reqs.push_back(world().start_recv(buf.data(), rank() % 2 ? 5 : 3, peer, 11));
  reqs.push_back(world().start_send(buf.data(), 3, peer, 11));
  if (rank() % 2) {
    try {
      world().wait_all(reqs);
      ADD_FAILURE() << "no error for a short message";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("[comm] MPI_Irecv: a message of 3 floats from rank"), std::string::npos)
          << e.what();
    }
  } else {
    world().wait_all(reqs);
  }
}

}  // namespace
}  // namespace hspmd
