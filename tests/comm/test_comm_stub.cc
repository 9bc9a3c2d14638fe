// The single-process communicator and execute() on a world of one rank:
// copies for collectives over one member (every dtype), clear errors for
// anything needing another rank; box packing.
#include <gtest/gtest.h>

#include <string>

#include "hspmd/comm/communicator.h"
#include "hspmd/comm/execute.h"
#include "hspmd/comm/pack.h"
#include "hspmd/core/error.h"
#include "resolve/resolve_test_util.h"
#include "test_util.h"

namespace hspmd {
namespace {

using namespace hspmd::testing;

using testing::error_of;

TEST(SingleProcessCommunicator, CollectivesOverOneMemberAreCopies) {
  auto comm = make_single_process_communicator();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  std::vector<float> a = {1, 2, 3}, b(3, 0.0f);
  comm->all_reduce(a.data(), 3);
  EXPECT_EQ(a, (std::vector<float>{1, 2, 3}));
  comm->reduce_scatter(a.data(), b.data(), {3});
  EXPECT_EQ(b, a);
  std::fill(b.begin(), b.end(), 0.0f);
  comm->all_gather(a.data(), b.data(), {2});
  EXPECT_EQ(b, (std::vector<float>{1, 2, 0}));
  comm->broadcast(a.data(), 3, 0);
  comm->barrier();
  EXPECT_EQ(&comm->group({0}), comm.get());
  EXPECT_EQ(comm->bytes().sent, 0);
}

TEST(SingleProcessCommunicator, AnythingNeedingAnotherRankThrows) {
  auto comm = make_single_process_communicator();
  float x = 0;
  EXPECT_EQ(error_of([&] { comm->group({0, 1}); }), "[comm] group of 2 ranks needs MPI (single-process communicator)");
  EXPECT_EQ(error_of([&] { comm->send(&x, 1, 1); }), "[comm] send to rank 1 needs MPI (single-process communicator)");
  EXPECT_EQ(error_of([&] { comm->recv(&x, 1, 0); }), "[comm] recv from rank 0 needs MPI (single-process communicator)");
  EXPECT_NE(error_of([&] { comm->all_gather(&x, &x, {1, 1}); }), "");
}

// The staged wrapper in its host-buffer test mode: every operation goes
// through separate staging blocks; results appear only once waited, and are
// the stub's (copies) then.
TEST(StagedCommunicator, HostBuffersTakeTheStagingPathAndArriveAtTheWait) {
  auto comm = make_staged_communicator(make_single_process_communicator(), /*stage_host_buffers=*/true);
  std::vector<float> a = {1, 2, 3}, b(3, 0.0f);
  std::vector<Request> pending;
  pending.push_back(comm->start_reduce_scatter(a.data(), b.data(), {3}, DType::F32));
  EXPECT_EQ(b, (std::vector<float>(3, 0.0f)));  // staged: written back at the wait
  comm->wait_all(pending);
  EXPECT_TRUE(pending.empty());
  EXPECT_EQ(b, a);
  std::fill(b.begin(), b.end(), 0.0f);
  comm->all_gather(a.data(), b.data(), {2});
  EXPECT_EQ(b, (std::vector<float>{1, 2, 0}));
  std::vector<uint16_t> h = {f32_to_bf16(1.5f), f32_to_bf16(-2.0f)};
  comm->all_reduce(h.data(), 2);
  comm->broadcast(h.data(), 2, 0);
  EXPECT_EQ(bf16_to_f32(h[0]), 1.5f);
  EXPECT_EQ(bf16_to_f32(h[1]), -2.0f);
  EXPECT_EQ(&comm->group({0}), comm.get());
  float x = 0;
  EXPECT_EQ(error_of([&] { comm->send(&x, 1, 1); }), "[comm] send to rank 1 needs MPI (single-process communicator)");
  EXPECT_EQ(error_of([&] { comm->all_reduce(&x, -1); }), "[comm] all_reduce: negative count -1");
}

static_assert(comm_dtype<float>() == DType::F32 && comm_dtype<double>() == DType::F64 &&
              comm_dtype<int32_t>() == DType::I32 && comm_dtype<int64_t>() == DType::I64 &&
              comm_dtype<uint16_t>() == DType::BF16);
static_assert(!CommElement<int8_t> && !CommElement<const float> && !CommElement<uint32_t>);

TEST(SingleProcessCommunicator, EveryDtypeThroughEveryCollectiveIsACopy) {
  auto comm = make_single_process_communicator();
  const int64_t big = (int64_t{1} << 62) + 1;  // beyond f64's 2^53: must stay exact
  std::vector<int64_t> i64 = {big, -big, 7}, i64_out(3, 0);
  comm->all_reduce(i64.data(), 3);
  comm->all_reduce(i64.data(), 3, ReduceOp::kMax);
  EXPECT_EQ(i64, (std::vector<int64_t>{big, -big, 7}));
  comm->reduce_scatter(i64.data(), i64_out.data(), {3});
  EXPECT_EQ(i64_out, i64);
  std::fill(i64_out.begin(), i64_out.end(), 0);
  comm->all_gather(i64.data(), i64_out.data(), {2});
  EXPECT_EQ(i64_out, (std::vector<int64_t>{big, -big, 0}));
  comm->broadcast(i64.data(), 3, 0);
  EXPECT_EQ(i64[0], big);

  std::vector<double> f64 = {1.0 + 0x1p-40, 3.5}, f64_out(2);
  comm->all_reduce(f64.data(), 2);
  comm->all_gather(f64.data(), f64_out.data(), {2});
  EXPECT_EQ(f64_out, f64);
  std::vector<int32_t> i32 = {-5, 1 << 30}, i32_out(2);
  comm->reduce_scatter(i32.data(), i32_out.data(), {2});
  EXPECT_EQ(i32_out, i32);
  std::vector<uint16_t> bf16 = {f32_to_bf16(1.5f), f32_to_bf16(-2.0f)}, bf16_out(2);
  comm->all_reduce(bf16.data(), 2);
  comm->all_gather(bf16.data(), bf16_out.data(), {2});
  EXPECT_EQ(bf16_out, bf16);

  // The void* forms take the dtype explicitly; in-place pieces are fine.
  comm->reduce_scatter(f64.data(), f64.data(), {2}, DType::F64);
  comm->all_gather(static_cast<const void*>(bf16.data()), bf16_out.data(), {1}, DType::BF16);
  EXPECT_EQ(f64[1], 3.5);
  std::vector<Request> r;
  r.push_back(comm->start_all_reduce(i32.data(), 2, DType::I32, ReduceOp::kMax));
  r.push_back(comm->start_broadcast(bf16.data(), 2, DType::BF16, 0));
  comm->wait_all(r);
  EXPECT_EQ(i32, (std::vector<int32_t>{-5, 1 << 30}));
  comm->batched_send_recv({}, {});
  EXPECT_EQ(comm->bytes().sent, 0);
  EXPECT_EQ(comm->bytes().received, 0);
}

TEST(SingleProcessCommunicator, TypedCallsNeedingAnotherRankThrow) {
  auto comm = make_single_process_communicator();
  int64_t x = 0;
  EXPECT_EQ(error_of([&] { comm->send(&x, 1, 1); }), "[comm] send to rank 1 needs MPI (single-process communicator)");
  EXPECT_EQ(error_of([&] { comm->recv(&x, 1, DType::I64, 2); }),
            "[comm] recv from rank 2 needs MPI (single-process communicator)");
  EXPECT_EQ(error_of([&] { comm->batched_send_recv({SendBuffer{1, &x, 1, DType::I64}}, {}); }),
            "[comm] send to rank 1 needs MPI (single-process communicator)");
  EXPECT_EQ(error_of([&] { comm->broadcast(&x, 1, 1); }),
            "[comm] broadcast from rank 1 needs MPI (single-process communicator)");
  EXPECT_EQ(error_of([&] { comm->all_reduce(&x, -1); }), "[comm] all_reduce: negative count -1");
  EXPECT_EQ(error_of([&] { comm->all_gather(&x, &x, {1, 1}); }),
            "[comm] all_gather: 2 counts for a communicator of 1 rank");
}

TEST(SingleProcessCommunicator, BuffersDefaultToF32) {
  float f = 1.0f;
  const SendBuffer s{0, &f, 1};
  const RecvBuffer r{0, &f, 1};
  EXPECT_EQ(s.dtype, DType::F32);
  EXPECT_EQ(r.dtype, DType::F32);
  EXPECT_EQ(dtype_size(DType::F64), 8u);
  EXPECT_STREQ(dtype_name(DType::F64), "f64");
}

TEST(SingleProcessCommunicator, WorldWithoutALauncherIsTheStub) {
  if (std::getenv("OMPI_COMM_WORLD_SIZE")) GTEST_SKIP() << "launched by mpirun";
  EXPECT_EQ(make_world_communicator()->size(), 1);
}

TEST(Pack, BoxesRoundTrip) {
  const NDArray global = iota({6, 4});
  const Box whole{{0, 0}, {6, 4}}, region{{1, 1}, {4, 3}};
  Stream& s = default_stream(Device::cpu());
  NDArray buf = NDArray::zeros({8}, DType::F32);  // room to spare: the first 6 are used
  EXPECT_EQ(pack_box(s, global, whole, region, buf), 6);
  EXPECT_EQ(buf.to_vector(), (std::vector<float>{-120, -119, -116, -115, -112, -111, 0, 0}));
  NDArray back = NDArray::zeros({6, 4}, DType::F32);
  EXPECT_EQ(unpack_box(s, buf, back, whole, region), 6);
  EXPECT_EQ(back.to_vector()[5], -120.0f);
  EXPECT_EQ(back.to_vector()[4], 0.0f);
  EXPECT_EQ(pack_box(s, global, whole, Box{{2, 0}, {2, 4}}, buf), 0);
  EXPECT_THROW(pack_box(s, global, region, whole, buf), InternalError);
  NDArray small = NDArray::zeros({5}, DType::F32);
  EXPECT_THROW(pack_box(s, global, whole, region, small), InternalError);
}

// Runs every rank of `s` alone on a single-process world and checks the outputs.
std::string run_alone(const ReshardSpec& s) {
  const Resolution res = resolve(s, Topology::uniform(4, 4));
  const NDArray global = iota(s.shape);
  std::map<int, NDArray> in = make_shards(global, s.src, 3), out;
  auto world = make_single_process_communicator();
  for (const auto& [rank, rr] : res.ranks) {
    NDArray o = execute(res, rank, in.count(rank) ? in.at(rank) : NDArray(), *world);
    if (o.valid()) out[rank] = o;
  }
  return check_shards(global, s.dst, out);
}

TEST(ExecuteAlone, IdentityAndLocalSlicesNeedNoOtherRank) {
  const Annotation split = ann({sg({0, 1, 2, 3}, {{S0, 4}})});
  const Annotation dup = ann({sg({0, 1, 2, 3}, {{DUP, 4}})});
  const Annotation dup_split = ann({sg({0, 1, 2, 3}, {{DUP, 2}, {S1, 2}})});
  EXPECT_EQ(run_alone(spec({8, 4}, split, split)), "");
  EXPECT_EQ(run_alone(spec({8, 4}, dup, split)), "");
  EXPECT_EQ(run_alone(spec({8, 4}, dup, dup_split)), "");
  EXPECT_EQ(run_alone(spec({8, 4}, dup_split, ann({sg({0, 1, 2, 3}, {{S1, 2}, {S0, 2}})}))), "");
}

TEST(ExecuteAlone, CommunicationNeedsMpi) {
  const Annotation split = ann({sg({0, 1, 2, 3}, {{S0, 4}})});
  const Annotation dup = ann({sg({0, 1, 2, 3}, {{DUP, 4}})});
  const std::string e = error_of([&] { run_alone(spec({8, 4}, split, dup)); });
  EXPECT_NE(e.find("needs MPI"), std::string::npos) << e;
}

TEST(ExecuteAlone, RanksOutsideTheResolutionHoldNothing) {
  const Annotation a = ann({sg({0, 1}, {{S0, 2}})});
  const Resolution res = resolve(spec({4}, a, a), Topology::uniform(4, 4));
  auto world = make_single_process_communicator();
  EXPECT_FALSE(execute(res, 3, NDArray(), *world).valid());
  const NDArray shard = NDArray::from_vector({2}, {5, 6});
  EXPECT_EQ(execute(res, 1, shard, *world).to_vector(), shard.to_vector());
}

TEST(ExecuteAlone, WrongInputShapeThrows) {
  const Annotation dup = ann({sg({0, 1}, {{DUP, 2}})});
  const Annotation split = ann({sg({0, 1}, {{S0, 2}})});
  const Resolution res = resolve(spec({4}, dup, split), Topology::uniform(4, 4));
  auto world = make_single_process_communicator();
  const std::string e = error_of([&] { execute(res, 0, NDArray::zeros({3}, DType::F32), *world); });
  EXPECT_NE(e.find("needs an f32 input of shape [4]"), std::string::npos) << e;
}

}  // namespace
}  // namespace hspmd
