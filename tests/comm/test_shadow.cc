// The shadow communicator (comm/shadow.h): one member of a group run alone.
// Collectives keep or place the local data, receives are zeros, sends are
// discarded, groups are shadows of their size, bytes count as a real
// backend's would.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "hspmd/comm/shadow.h"
#include "hspmd/core/error.h"
#include "test_util.h"

namespace hspmd {
namespace {

using testing::error_of;

TEST(ShadowCommunicator, CollectivesKeepOrPlaceTheLocalData) {
  auto comm = make_shadow_communicator(4, 2);
  EXPECT_EQ(comm->size(), 4);
  EXPECT_EQ(comm->rank(), 2);
  std::vector<float> a = {1, 2, 3};
  comm->all_reduce(a.data(), 3);
  EXPECT_EQ(a, (std::vector<float>{1, 2, 3}));
  std::vector<float> pieces = {1, 2, 3, 4, 5, 6, 7, 8}, mine(2, -1.0f);
  comm->reduce_scatter(pieces.data(), mine.data(), {2, 2, 2, 2});
  EXPECT_EQ(mine, (std::vector<float>{5, 6}));
  std::vector<float> gathered(5, -1.0f), own = {9, 8};
  comm->all_gather(own.data(), gathered.data(), {1, 1, 2, 1});
  EXPECT_EQ(gathered, (std::vector<float>{0, 0, 9, 8, 0}));
  comm->broadcast(a.data(), 3, 0);
  EXPECT_EQ(a, (std::vector<float>{1, 2, 3}));
}

TEST(ShadowCommunicator, ReceivesAreZerosAndSendsVanish) {
  auto comm = make_shadow_communicator(3, 0);
  std::vector<int64_t> in(4, 7);
  std::vector<Request> r;
  r.push_back(comm->start_recv(in.data(), 4, DType::I64, 1, 3));
  r.push_back(comm->start_send(in.data(), 4, DType::I64, 2, 3));
  comm->wait_all(r);
  EXPECT_TRUE(r.empty());
  EXPECT_EQ(in, std::vector<int64_t>(4, 0));
  EXPECT_EQ(comm->bytes().sent, 32);
  EXPECT_EQ(comm->bytes().received, 32);
}

TEST(ShadowCommunicator, GroupsAreShadowsOfTheirSizeSharingTheCounters) {
  auto comm = make_shadow_communicator(8, 5);
  Communicator& g = comm->group({1, 5, 7});
  EXPECT_EQ(g.size(), 3);
  EXPECT_EQ(g.rank(), 1);
  EXPECT_EQ(&g, &comm->group({1, 5, 7}));  // cached
  std::vector<float> x(6, 1.0f);
  g.all_reduce(x.data(), 6);  // ring volume 2 (n-1)/n * 24 bytes
  EXPECT_EQ(comm->bytes().sent, 32);
  EXPECT_NE(error_of([&] { comm->group({1, 2}); }).find("not a member"), std::string::npos);
  EXPECT_NE(error_of([&] { comm->group({5, 9}); }).find("outside"), std::string::npos);
  EXPECT_NE(error_of([&] { comm->start_send(x.data(), 1, 8, 0); }).find("outside"), std::string::npos);
  EXPECT_NE(error_of([] { make_shadow_communicator(2, 2); }).find("[comm] shadow"), std::string::npos);
}

}  // namespace
}  // namespace hspmd
