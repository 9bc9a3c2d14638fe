// One rank's specialization equals the whole world's, cut to the rank: for
// several plans and every rank, rank_dry_run (and ExecGraph::dry_run) lists
// exactly the Reshards of dry_run() the rank takes part in, each with the
// same headline and the same primitives for the rank; op traffic and the
// discovered pipelines agree; resolve_for_rank keeps one entry.
#include <gtest/gtest.h>

#include <sstream>

#include "hspmd/exec/exec_graph.h"
#include "hspmd/plan/pipelines.h"
#include "plan/plan_test_util.h"

namespace hspmd {
namespace {

const std::string kRoot = HSPMD_SOURCE_DIR;

using testing::pipeline;
using testing::stage;
using testing::strategy;

// Every field of a rank's primitives, so that equal strings mean equal plans.
std::string describe(const std::vector<Box>& boxes) {
  std::string s;
  for (const Box& b : boxes) s += to_string(b) + " ";
  return s;
}

std::string describe(const std::vector<Transfer>& transfers) {
  std::string s;
  for (const Transfer& t : transfers) s += std::to_string(t.peer) + ":" + describe(t.boxes) + std::to_string(t.bytes) + " ";
  return s;
}

std::string describe(const RankResolution& rr) {
  std::ostringstream os;
  os << "rank " << rr.rank << " " << kind_name(rr.kind) << " " << rr.bytes_sent << "/" << rr.bytes_received;
  for (const CommPhase& ph : rr.phases) {
    os << "\n phase in " << (ph.in_box ? to_string(*ph.in_box) : "-") << " out "
       << (ph.out_box ? to_string(*ph.out_box) : "-") << (ph.zero_fill ? " zero_fill" : "");
    for (const CommOp& op : ph.ops) {
      os << "\n  " << kind_name(op.kind) << " group";
      for (int m : op.group) os << " " << m;
      os << " box " << to_string(op.box) << " pieces " << describe(op.pieces) << " contributes "
         << op.contributes << " sends " << describe(op.sends) << " recvs " << describe(op.recvs) << " keeps "
         << describe(op.keeps) << " bytes " << op.bytes_sent << "/" << op.bytes_received;
    }
  }
  return os.str();
}

// The full resolution's headline and its entry for `rank` (none: "absent").
std::string describe(const PlannedReshard& r, int rank) {
  const Resolution& res = r.resolution();
  std::string s = r.name + " [" + r.phase + "] " + res.name + " " + kind_name(res.kind) + " " + res.tier + " " +
                  std::to_string(res.total_bytes) + (res.crosses_subgroups ? " crosses" : "") + "\n";
  auto it = res.ranks.find(rank);
  return s + (it == res.ranks.end() ? "absent" : describe(it->second));
}

// For `ranks` (empty: every rank of the world).
void expect_rank_equals_full(const AnnotationPlan& plan, const Topology& topology, std::vector<int> ranks = {}) {
  std::vector<PlannedOpTraffic> full_traffic;
  const std::vector<PlannedReshard> full = dry_run(plan, topology, &full_traffic);
  const auto pipelines = discover_pipelines(plan, full);
  const AnnotatedTraining training = annotate_training_graph(plan);
  EXPECT_EQ(discover_pipelines(plan, topology, training), pipelines);
  if (ranks.empty())
    for (int rank = 0; rank < plan.world_size; ++rank) ranks.push_back(rank);
  for (int rank : ranks) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    std::vector<std::string> want;
    for (const PlannedReshard& r : full)
      if (r.resolution().ranks.count(rank)) want.push_back(describe(r, rank));
    std::vector<PlannedOpTraffic> traffic;
    const std::vector<PlannedReshard> mine = rank_dry_run(plan, topology, rank, &traffic);
    std::vector<std::string> got;
    for (const PlannedReshard& r : mine) {
      EXPECT_LE(r.resolution().ranks.size(), 1u) << r.name << " holds other ranks' primitives";
      got.push_back(describe(r, rank));
    }
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[i]);
    // Op traffic: the rank's group and bytes per (op, phase), as the full one has them.
    std::map<std::string, std::string> traffic_want, traffic_got;
    for (const PlannedOpTraffic& t : full_traffic)
      if (auto it = t.ranks.find(rank); it != t.ranks.end())
        traffic_want[t.op + t.phase] = ::testing::PrintToString(it->second.group) +
                                       std::to_string(it->second.sent) + "/" + std::to_string(it->second.received);
    for (const PlannedOpTraffic& t : traffic) {
      ASSERT_EQ(t.ranks.size(), 1u);
      const OpTraffic& o = t.ranks.at(rank);
      traffic_got[t.op + t.phase] = ::testing::PrintToString(o.group) + std::to_string(o.sent) + "/" +
                                    std::to_string(o.received);
    }
    EXPECT_EQ(traffic_got, traffic_want);
    // The executable graph's own dry run (its cache, its deduction) is the same.
    ExecGraph graph(plan, topology, rank, Bindings(plan.bindings.begin(), plan.bindings.end()));
    std::vector<std::string> from_graph;
    for (const PlannedReshard& r : graph.dry_run()) from_graph.push_back(describe(r, rank));
    EXPECT_EQ(from_graph, want);
    EXPECT_EQ(graph.discover_pipelines(), pipelines);
  }
}

ModelConfig example_model(const std::string& name) {
  return ModelConfig::load(kRoot + "/examples/models/" + name + ".json");
}

AnnotationPlan example_plan(const std::string& model, const std::string& strategy, int world) {
  return compile_plan(example_model(model), load_strategy(kRoot + "/examples/strategies/" + strategy + ".json"),
                      world);
}

TEST(RankDryRun, ExampleStrategiesOfTheTinyModel) {
  for (const char* name : {"tiny_hetero_8", "tiny_zero_8", "tiny_cp_8"}) {
    SCOPED_TRACE(name);
    expect_rank_equals_full(example_plan("llama-tiny-8l", name, 8), Topology::uniform(8, 4));
  }
  SCOPED_TRACE("tiny_cp_packed_6");
  expect_rank_equals_full(example_plan("../tiny-llama/config", "tiny_cp_packed_6", 6), Topology::uniform(6));
}

// Tied embeddings (a BSR from the first stage to the last), TP changing
// along a pipeline, ZeRO across pipelines of different TP, an idle rank.
TEST(RankDryRun, HandBuiltPlans) {
  ModelConfig tied = testing::tiny_config();
  tied.tie_word_embeddings = true;
  const Strategy hetero = strategy({pipeline({stage({0, 1}, 0, 1), stage({2, 3}, 2, 3)}, 2),
                                    pipeline({stage({4}, 0, 1), stage({5}, 2, 2), stage({6}, 3, 3)})},
                                   true);
  expect_rank_equals_full(compile_plan(tied, hetero, 8), Topology::uniform(8, 4));
  const Strategy shrinking = strategy({pipeline({stage({0, 1, 2, 3}, 0, 1, 2), stage({4, 5}, 2, 3)}),
                                       pipeline({stage({6}, 0, 3)})},
                                      true);
  expect_rank_equals_full(compile_plan(testing::tiny_config(), shrinking, 7), Topology::uniform(7, 2));
}

// The paper's 70B plan on its heterogeneous cluster (48 ranks, ZeRO): the
// first and last rank of every stage.
TEST(RankDryRun, PaperPlanOnItsCluster) {
  expect_rank_equals_full(example_plan("llama-70b", "hetero_70b_16h800_32h20", 48),
                          Topology::load(kRoot + "/examples/clusters/16h800_32h20.json"),
                          {0, 7, 8, 15, 16, 23, 24, 31, 32, 39, 40, 47});
}

TEST(ResolveForRank, KeepsOneEntryAndTheHeadline) {
  Annotation src, dst;
  src.subgroups = {Subgroup{DeviceGroup{{0, 1}}, DistStates{{{kPartial, 2}}, {kPartial}}}};
  dst.subgroups = {Subgroup{DeviceGroup{{0, 1}}, DistStates{{{0, 2}}, {0}}}};
  const ReshardSpec spec{"x", {4, 4}, DType::F32, src, dst};
  const Topology topology = Topology::uniform(4);
  const Resolution full = resolve(spec, topology);
  const Resolution one = resolve_for_rank(spec, topology, 1);
  ASSERT_EQ(one.ranks.size(), 1u);
  EXPECT_EQ(describe(one.ranks.at(1)), describe(full.ranks.at(1)));
  EXPECT_EQ(one.kind, full.kind);
  EXPECT_EQ(one.tier, full.tier);
  EXPECT_EQ(one.total_bytes, full.total_bytes);
  EXPECT_TRUE(resolve_for_rank(spec, topology, 3).ranks.empty());  // in neither annotation
}

}  // namespace
}  // namespace hspmd
