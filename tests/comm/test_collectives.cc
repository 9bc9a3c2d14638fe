// The communicator's collectives and point-to-point on 4 ranks (mpirun -np 4):
// uneven and empty pieces, groups (order, caching), overlapping collectives
// in flight at once, batched send/recv, byte counters and error paths; every
// dtype (f32, f64, i32, i64, bf16) through every operation, reduced in its
// own type.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
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
      EXPECT_NE(std::string(e.what()).find("[comm] MPI_Irecv: a message of 3 f32 elements from rank"),
                std::string::npos)
          << e.what();
    }
  } else {
    world().wait_all(reqs);
  }
}

// ---- typed buffers ----

constexpr int64_t kBig = (int64_t{1} << 62) + 1;  // far beyond f64's 2^53

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out;
  for (float x : v) out.push_back(f32_to_bf16(x));
  return out;
}

std::vector<float> from_bf16(const std::vector<uint16_t>& v) {
  std::vector<float> out;
  for (uint16_t x : v) out.push_back(bf16_to_f32(x));
  return out;
}

TEST_F(Collectives, AllReduceSumsInEachDtype) {
  const int r = rank();
  // i64: 2^60 + r on every rank sums to 2^62 + 6, exactly; f32 or f64 would round.
  std::vector<int64_t> i64 = {(int64_t{1} << 60) + r, r == 0 ? kBig : -r, -(int64_t{1} << 61)};
  world().all_reduce(i64.data(), 3);
  EXPECT_EQ(i64, (std::vector<int64_t>{(int64_t{1} << 62) + 6, kBig - 6, std::numeric_limits<int64_t>::min()}));
  // i32 near its range: 4·(2^28 + r), and the most negative value.
  std::vector<int32_t> i32 = {(1 << 28) + r, -(1 << 29)};
  world().all_reduce(i32.data(), 2);
  EXPECT_EQ(i32, (std::vector<int32_t>{(1 << 30) + 6, std::numeric_limits<int32_t>::min()}));
  // f64: 1 + (r + 1)·2^-40 sums exactly to 4 + 10·2^-40, which f32 rounds to 4.
  std::vector<double> f64 = {1.0 + (r + 1) * 0x1p-40, 1e300 * (r % 2 ? -1 : 1)};
  world().all_reduce(f64.data(), 2);
  EXPECT_EQ(f64[0], 4.0 + 10 * 0x1p-40);
  EXPECT_NE(static_cast<float>(f64[0]), f64[0]);
  EXPECT_EQ(f64[1], 0.0);
  // bf16: every partial sum representable, so the sum is exact in any order.
  std::vector<uint16_t> bf16 = to_bf16({static_cast<float>(r + 1), 0.5f * (r + 1), 128.0f * (r + 1), -0.25f});
  world().all_reduce(bf16.data(), 4);
  EXPECT_EQ(from_bf16(bf16), (std::vector<float>{10.0f, 5.0f, 1280.0f, -1.0f}));
  // The void* form with an explicit dtype.
  int64_t one = (int64_t{1} << 60) + 1;
  world().all_reduce(&one, 1, DType::I64);
  EXPECT_EQ(one, (int64_t{1} << 62) + 4);
}

TEST_F(Collectives, AllReduceMaxInEachDtype) {
  const int r = rank();
  std::vector<int64_t> i64 = {kBig + r, -kBig - r};
  world().all_reduce(i64.data(), 2, ReduceOp::kMax);
  EXPECT_EQ(i64, (std::vector<int64_t>{kBig + 3, -kBig}));
  std::vector<int32_t> i32 = {r == 2 ? 9 : -r};
  world().all_reduce(i32.data(), 1, ReduceOp::kMax);
  EXPECT_EQ(i32[0], 9);
  std::vector<double> f64 = {1.0 + r * 0x1p-50};
  world().all_reduce(f64.data(), 1, ReduceOp::kMax);
  EXPECT_EQ(f64[0], 1.0 + 3 * 0x1p-50);
  std::vector<float> f32 = {-1.0f * r};
  world().all_reduce(f32.data(), 1, ReduceOp::kMax);
  EXPECT_EQ(f32[0], 0.0f);
  std::vector<uint16_t> bf16 = to_bf16({-2.0f * r, r == 1 ? 3.5f : 1.0f, r == 3 ? NAN : 1.0f});
  world().all_reduce(bf16.data(), 3, ReduceOp::kMax);
  const std::vector<float> got = from_bf16(bf16);
  EXPECT_EQ(got[0], 0.0f);
  EXPECT_EQ(got[1], 3.5f);
  EXPECT_TRUE(std::isnan(got[2])) << "a NaN wins the bf16 max";
}

TEST_F(Collectives, ReduceScatterInEachDtype) {
  const std::vector<int64_t> counts = {1, 2, 0, 1};
  const int64_t offset = std::accumulate(counts.begin(), counts.begin() + rank(), int64_t{0});
  const int64_t mine = counts[rank()];
  std::vector<int64_t> i64(4), i64_out(mine + 1, -1);
  std::vector<double> f64(4), f64_out(mine + 1, -1);
  std::vector<int32_t> i32(4), i32_out(mine + 1, -1);
  std::vector<uint16_t> bf16(4), bf16_out(mine + 1, f32_to_bf16(-1.0f));
  for (int i = 0; i < 4; ++i) {
    i64[i] = (int64_t{1} << 60) + i * 1000 + rank();
    f64[i] = 1.0 + (i + 1) * 0x1p-45 * (rank() + 1);
    i32[i] = -(1 << 28) * (i % 2 ? 1 : -1) + rank();
    bf16[i] = f32_to_bf16(static_cast<float>(i + 1) * (rank() + 1));
  }
  world().reduce_scatter(i64.data(), i64_out.data(), counts);
  world().reduce_scatter(f64.data(), f64_out.data(), counts);
  world().reduce_scatter(i32.data(), i32_out.data(), counts);
  world().reduce_scatter(bf16.data(), bf16_out.data(), counts);
  for (int64_t k = 0; k < mine; ++k) {
    const int64_t i = offset + k;
    EXPECT_EQ(i64_out[k], (int64_t{1} << 62) + 4000 * i + 6) << i;
    EXPECT_EQ(f64_out[k], 4.0 + (i + 1) * 10 * 0x1p-45) << i;
    EXPECT_EQ(i32_out[k], -(1 << 30) * (i % 2 ? 1 : -1) + 6) << i;
    EXPECT_EQ(bf16_to_f32(bf16_out[k]), 10.0f * (i + 1)) << i;
  }
  EXPECT_EQ(i64_out.back(), -1);  // nothing written past the piece
  EXPECT_EQ(f64_out.back(), -1.0);
  EXPECT_EQ(i32_out.back(), -1);
  EXPECT_EQ(bf16_to_f32(bf16_out.back()), -1.0f);
}

TEST_F(Collectives, AllGatherAndBroadcastInEachDtype) {
  const std::vector<int64_t> counts = {2, 0, 1, 1};
  const int64_t mine = counts[rank()];
  std::vector<int64_t> i64(mine, kBig + rank()), i64_all(4, 0);
  std::vector<double> f64(mine, 1.0 + rank() * 0x1p-52), f64_all(4, 0);
  std::vector<int32_t> i32(mine, -rank()), i32_all(4, 7);
  std::vector<uint16_t> bf16(mine, static_cast<uint16_t>(0x7fc0 + rank())), bf16_all(4, 0);  // NaN payloads
  world().all_gather(i64.data(), i64_all.data(), counts);
  world().all_gather(f64.data(), f64_all.data(), counts);
  world().all_gather(i32.data(), i32_all.data(), counts);
  world().all_gather(bf16.data(), bf16_all.data(), counts);
  EXPECT_EQ(i64_all, (std::vector<int64_t>{kBig, kBig, kBig + 2, kBig + 3}));
  EXPECT_EQ(f64_all, (std::vector<double>{1.0, 1.0, 1.0 + 2 * 0x1p-52, 1.0 + 3 * 0x1p-52}));
  EXPECT_EQ(i32_all, (std::vector<int32_t>{0, 0, -2, -3}));
  EXPECT_EQ(bf16_all, (std::vector<uint16_t>{0x7fc0, 0x7fc0, 0x7fc2, 0x7fc3}));  // moved bit for bit

  std::vector<int64_t> b64 = {kBig * rank(), -kBig};
  world().broadcast(b64.data(), 2, 1);
  EXPECT_EQ(b64, (std::vector<int64_t>{kBig, -kBig}));
  std::vector<double> bf = {0.1 * rank()};
  world().broadcast(bf.data(), 1, 3);
  EXPECT_EQ(bf[0], 0.1 * 3);
  std::vector<uint16_t> bb = {static_cast<uint16_t>(rank())};
  world().broadcast(bb.data(), 1, DType::BF16, 2);
  EXPECT_EQ(bb[0], 2);
  int32_t bi = rank() * 11;
  world().broadcast(&bi, 1, 0);
  EXPECT_EQ(bi, 0);
}

TEST_F(Collectives, SendRecvInEachDtype) {
  const int peer = rank() ^ 1;
  const std::vector<int64_t> i64 = {kBig, -kBig, rank()};
  const std::vector<double> f64 = {1.0 + 0x1p-52, 1e-310};  // the second is subnormal
  const std::vector<int32_t> i32 = {std::numeric_limits<int32_t>::min(), rank()};
  const std::vector<uint16_t> bf16 = {0x3f81, 0xff80};  // 1 + 2^-7, -inf
  std::vector<int64_t> i64_in(3);
  std::vector<double> f64_in(2);
  std::vector<int32_t> i32_in(2);
  std::vector<uint16_t> bf16_in(2);
  std::vector<Request> reqs;
  reqs.push_back(world().start_recv(i64_in.data(), 3, DType::I64, peer, 3));
  reqs.push_back(world().start_recv(f64_in.data(), 2, DType::F64, peer, 3));
  reqs.push_back(world().start_recv(i32_in.data(), 2, DType::I32, peer, 3));
  reqs.push_back(world().start_recv(bf16_in.data(), 2, DType::BF16, peer, 3));
  reqs.push_back(world().start_send(i64.data(), 3, DType::I64, peer, 3));
  reqs.push_back(world().start_send(f64.data(), 2, DType::F64, peer, 3));
  reqs.push_back(world().start_send(i32.data(), 2, DType::I32, peer, 3));
  reqs.push_back(world().start_send(bf16.data(), 2, DType::BF16, peer, 3));
  world().wait_all(reqs);
  EXPECT_EQ(i64_in, (std::vector<int64_t>{kBig, -kBig, peer}));
  EXPECT_EQ(f64_in, f64);
  EXPECT_EQ(i32_in, (std::vector<int32_t>{std::numeric_limits<int32_t>::min(), peer}));
  EXPECT_EQ(bf16_in, bf16);
  // The blocking template forms: rank 0 -> 1 and 2 -> 3.
  int64_t x = kBig + rank();
  if (rank() % 2 == 0) world().send(&x, 1, peer, 4);
  else world().recv(&x, 1, peer, 4);
  EXPECT_EQ(x, kBig + (rank() & ~1));
}

// Each pair exchanges three messages of different dtypes and sizes in one
// batch; per pair they match in the order listed.
TEST_F(Collectives, BatchedSendRecvMixesDtypes) {
  std::vector<std::vector<int64_t>> out64(4), in64(4);
  std::vector<std::vector<uint16_t>> out16(4), in16(4);
  std::vector<std::vector<double>> outd(4), ind(4);
  std::vector<SendBuffer> sends;
  std::vector<RecvBuffer> recvs;
  for (int p = 0; p < 4; ++p) {
    if (p == rank()) continue;
    out64[p].assign(p + 1, kBig + 10 * rank() + p);
    in64[p].assign(rank() + 1, 0);
    out16[p].assign(rank() + 2, f32_to_bf16(static_cast<float>(rank() - p)));
    in16[p].assign(p + 2, 0);
    outd[p].assign(3, 1.0 / (rank() + 1));
    ind[p].assign(3, 0);
    sends.push_back({p, out64[p].data(), static_cast<int64_t>(out64[p].size()), DType::I64});
    sends.push_back({p, out16[p].data(), static_cast<int64_t>(out16[p].size()), DType::BF16});
    sends.push_back({p, outd[p].data(), 3, DType::F64});
    recvs.push_back({p, in64[p].data(), static_cast<int64_t>(in64[p].size()), DType::I64});
    recvs.push_back({p, in16[p].data(), static_cast<int64_t>(in16[p].size()), DType::BF16});
    recvs.push_back({p, ind[p].data(), 3, DType::F64});
  }
  world().reset_bytes();
  world().batched_send_recv(sends, recvs, 6);
  int64_t sent = 0, received = 0;
  for (int p = 0; p < 4; ++p) {
    if (p == rank()) continue;
    EXPECT_EQ(in64[p], std::vector<int64_t>(rank() + 1, kBig + 10 * p + rank())) << p;
    EXPECT_EQ(from_bf16(in16[p]), std::vector<float>(p + 2, static_cast<float>(p - rank()))) << p;
    EXPECT_EQ(ind[p], std::vector<double>(3, 1.0 / (p + 1))) << p;
    sent += (p + 1) * 8 + (rank() + 2) * 2 + 3 * 8;
    received += (rank() + 1) * 8 + (p + 2) * 2 + 3 * 8;
  }
  EXPECT_EQ(world().bytes().sent, sent);
  EXPECT_EQ(world().bytes().received, received);
}

TEST_F(Collectives, ByteCountersCountElementsTimesTheirSize) {
  const auto reset = [&] { world().reset_bytes(); };
  const auto expect = [&](int64_t sent, int64_t received, const char* what) {
    EXPECT_EQ(world().bytes().sent, sent) << what;
    EXPECT_EQ(world().bytes().received, received) << what;
  };
  std::vector<int64_t> i64(8, 1);
  std::vector<double> f64(8, 1);
  std::vector<int32_t> i32(8, 1);
  std::vector<uint16_t> bf16(8, f32_to_bf16(1.0f));
  reset();
  world().all_reduce(i64.data(), 8);  // 2·3/4 of 64 bytes each way
  expect(96, 96, "i64 all_reduce");
  reset();
  world().all_reduce(f64.data(), 8, ReduceOp::kMax);
  expect(96, 96, "f64 all_reduce max");
  reset();
  world().all_reduce(i32.data(), 8);
  expect(48, 48, "i32 all_reduce");
  reset();
  world().all_reduce(bf16.data(), 8);
  expect(24, 24, "bf16 all_reduce");
  reset();
  std::vector<uint16_t> bf16_all(8);
  world().all_gather(bf16.data(), bf16_all.data(), {2, 2, 2, 2});  // 3 x own piece out, 3 pieces in
  expect(12, 12, "bf16 all_gather");
  reset();
  std::vector<int64_t> piece(2);
  world().reduce_scatter(i64.data(), piece.data(), {2, 2, 2, 2});
  expect(48, 48, "i64 reduce_scatter");
  reset();
  world().broadcast(f64.data(), 8, 1);
  expect(rank() == 1 ? 3 * 64 : 0, rank() == 1 ? 0 : 64, "f64 broadcast");
  reset();
  if (rank() == 0) world().send(i64.data(), 5, 3);
  if (rank() == 3) world().recv(i64.data(), 5, 0);
  expect(rank() == 0 ? 40 : 0, rank() == 3 ? 40 : 0, "i64 send/recv");
}

TEST_F(Collectives, TypedMessageOfTheWrongSizeNamesTheDtype) {
  const int peer = rank() ^ 1;
  std::vector<int64_t> buf(5, 0);
  std::vector<uint16_t> odd(3, 0);
  // Round 1: a short i64 message. Round 2: 3 bf16 (6 bytes) where f32 are expected.
  for (int round = 0; round < 2; ++round) {
    std::vector<Request> reqs;
    if (rank() % 2) {
      if (round == 0) reqs.push_back(world().start_recv(buf.data(), 5, DType::I64, peer, 12));
      else reqs.push_back(world().start_recv(buf.data(), 2, DType::F32, peer, 12));
      try {
        world().wait_all(reqs);
        ADD_FAILURE() << "no error in round " << round;
      } catch (const Error& e) {
        const std::string want = round == 0
            ? "[comm] MPI_Irecv: a message of 3 i64 elements from rank " + std::to_string(peer) +
                  " where 5 were expected"
            : "[comm] MPI_Irecv: a message of 6 bytes (not whole f32 elements) from rank " + std::to_string(peer) +
                  " where 2 f32 elements were expected";
        EXPECT_EQ(std::string(e.what()), want);
      }
    } else {
      if (round == 0) world().send(buf.data(), 3, peer, 12);
      else world().send(odd.data(), 3, peer, 12);
    }
  }
}

}  // namespace
}  // namespace hspmd
