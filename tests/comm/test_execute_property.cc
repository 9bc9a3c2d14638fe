// The acceptance property of the MPI executor (mpirun -np 8): for 300
// random (source, destination) annotation pairs — the resolver property
// test's own generator — every rank resolves the same pair, builds its source
// shard from the same global tensor, executes its part over MPI, and checks
// its output against the destination contract (check_shards, with the other
// ranks' outputs from the simulator), bit for bit against the simulator, and
// its byte counters against the resolver's predictions. Ranks agree on the
// verdict through an all_reduce; rank 0 reports the first failing case.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>

#include "comm/mpi_test_main.h"
#include "hspmd/comm/execute.h"
#include "hspmd/core/error.h"
#include "resolve/resolve_test_util.h"

#include "resolve/random_annotations.h"

namespace hspmd::comm_test {
namespace {

using namespace hspmd::testing;

// "" when `mine` is what this rank must hold, else why not.
std::string check_rank(const ReshardSpec& s, const Resolution& res, int rank, const NDArray& global,
                       const std::map<int, NDArray>& inputs, const NDArray& mine) {
  std::map<int, NDArray> expected = simulate(res, inputs);
  auto it = expected.find(rank);
  if (it == expected.end() && mine.valid()) return "holds " + shape_str(mine.shape()) + ", expected nothing";
  if (it != expected.end()) {
    if (!mine.valid()) return "holds nothing";
    if (mine.shape() != it->second.shape() || mine.to_vector() != it->second.to_vector())
      return "differs from the simulator";
    it->second = mine;
  }
  return check_shards(global, s.dst, expected);
}

// What the cases came to on this rank.
struct ExecTally {
  int checked = 0;
  std::map<std::string, int> kinds;         // headline kinds of the resolutions run
  int repeated_pieces = 0;                  // ranks (here: this one) in a reduce_scatter with repeated pieces
};

// What execute() sends beyond the resolver's |box| - |piece| per reduce_scatter:
// pieces that repeat (split_reduce_scatter) travel once per member.
int64_t extra_sent_bytes(const RankResolution& rr) {
  int64_t extra = 0;
  for (const CommPhase& ph : rr.phases)
    for (const CommOp& op : ph.ops) {
      if ((op.kind != CommKind::kReduceScatter && op.kind != CommKind::kSplitReduceScatter) || op.group.size() < 2)
        continue;
      int64_t pieces = 0;
      for (const Box& b : op.pieces) pieces += b.numel();
      extra += (pieces - op.box.numel()) * 4;
    }
  return extra;
}

// Resolves, executes and checks one case on this rank: "" or what failed.
std::string execute_case(const ReshardSpec& s, const Topology& topology, uint64_t seed, ExecTally& tally) {
  Resolution res;
  try {
    res = resolve(s, topology);
  } catch (const Error&) {
    return "";  // unsupported pairs: the resolver's property test covers them
  }
  ++tally.checked;
  ++tally.kinds[kind_name(res.kind)];
  const int rank = test_world().rank();
  test_world().reset_bytes();
  const NDArray global = testing::iota(s.shape);
  const std::map<int, NDArray> inputs = make_shards(global, s.src, seed);
  try {
    const NDArray mine = execute(res, rank, inputs.count(rank) ? inputs.at(rank) : NDArray(), test_world());
    const ByteCounters bytes = test_world().bytes();
    auto rr = res.ranks.find(rank);
    const int64_t want_sent = rr == res.ranks.end() ? 0 : rr->second.bytes_sent;
    const int64_t want_received = rr == res.ranks.end() ? 0 : rr->second.bytes_received;
    if (bytes.sent != want_sent || bytes.received != want_received)
      return "counted " + std::to_string(bytes.sent) + " bytes sent, " + std::to_string(bytes.received) +
             " received; the resolver says " + std::to_string(want_sent) + ", " + std::to_string(want_received);
    tally.repeated_pieces += rr != res.ranks.end() && extra_sent_bytes(rr->second) > 0;
    return check_rank(s, res, rank, global, inputs, mine);
  } catch (const std::exception& e) {
    return e.what();  // a local failure; a partner failing mid-phase may hang (CTest's timeout)
  }
}

// HSPMD_COMM_CASES and HSPMD_COMM_SEED run a longer soak.
TEST(ExecuteProperty, RandomPairsEndWithTheirDestinationShards) {
  Communicator& world = test_world();
  if (world.size() != kWorld) GTEST_SKIP() << "needs mpirun -np " << kWorld;
  const Topology topology = Topology::uniform(kWorld, 4);
  ExecTally tally;
  const int cases = for_each_random_pair("HSPMD_COMM_SEED", "HSPMD_COMM_CASES", 300,
                                         [&](const ReshardSpec& s, int n) {
    const std::string diff = execute_case(s, topology, n, tally);
    float failed = diff.empty() ? 0.0f : 1.0f;
    world.all_reduce(&failed, 1);
    if (!diff.empty()) std::cerr << "[rank " << world.rank() << "] " << s.name << ": " << diff << "\n";
    if (failed == 0) return true;
    if (world.rank() == 0)
      ADD_FAILURE() << s.name << " failed on " << failed << " rank(s): " << to_string(s.src) << " -> "
                    << to_string(s.dst) << " shape " << shape_str(s.shape);
    else
      ADD_FAILURE();
    return false;
  });
  EXPECT_GE(tally.checked, cases * 6 / 10);
  for (const char* kind : {"identity", "send", "local_slice", "all_reduce", "reduce_scatter", "all_gather",
                           "split_all_reduce", "split_reduce_scatter", "split_all_gather", "bsr"})
    EXPECT_GE(tally.kinds[kind], 1) << kind;
  if (world.rank() != 0) return;
  std::cout << "checked " << tally.checked << " of " << cases << " cases on " << kWorld << " ranks;";
  for (const auto& [k, c] : tally.kinds) std::cout << " " << k << "=" << c;
  std::cout << "\nrank 0: bytes as the resolver says; " << tally.repeated_pieces
            << " times more for repeated reduce_scatter pieces\n";
}

}  // namespace
}  // namespace hspmd::comm_test
