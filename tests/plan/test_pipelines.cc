// discover_pipelines: the pipelines read off a plan's annotations and forward
// communication are the strategy's pipelines, for every example strategy and
// for hand-built ones (TP changes, tied embeddings, ZeRO, cp); structures
// that are not chains are errors.
#include <gtest/gtest.h>

#include <chrono>

#include "hspmd/core/error.h"
#include "hspmd/plan/pipelines.h"
#include "plan/plan_test_util.h"

namespace hspmd {
namespace {

const std::string kRoot = HSPMD_SOURCE_DIR;

ModelConfig tiny(int layers = 4) { return testing::tiny_config(layers); }
using testing::stage;

using testing::pipeline;
using testing::strategy;

// docs/strategy.md's example on 4 layers: TP2 x 2 stages, then 3 single devices; rank 7 idle.
Strategy hetero(bool zero = false) {
  return strategy({pipeline({stage({0, 1}, 0, 1), stage({2, 3}, 2, 3)}, 2),
                   pipeline({stage({4}, 0, 1), stage({5}, 2, 2), stage({6}, 3, 3)})},
                  zero);
}

// The strategy's pipelines as discovery reports them: stage ranks sorted.
std::vector<DiscoveredPipeline> expected(const Strategy& s) {
  std::vector<DiscoveredPipeline> out;
  for (const Pipeline& p : s.pipelines) {
    DiscoveredPipeline d;
    for (const Stage& st : p.stages) {
      std::vector<int> ranks = st.ranks;
      std::sort(ranks.begin(), ranks.end());
      d.stages.push_back({ranks, st.first_layer, st.last_layer});
    }
    out.push_back(d);
  }
  return out;
}

std::string describe(const std::vector<DiscoveredPipeline>& pipelines) {
  std::string s;
  for (size_t p = 0; p < pipelines.size(); ++p) {
    s += "\n  pipeline " + std::to_string(p) + ":";
    for (const DiscoveredStage& st : pipelines[p].stages)
      s += " [" + format_ranks(st.ranks) + " L" + std::to_string(st.first_layer) + "-" +
           std::to_string(st.last_layer) + "]";
  }
  return s;
}

// Discovery reproduces `s` exactly, and the ranks it names nowhere are idle.
void expect_discovers(const ModelConfig& config, const Strategy& s, int world,
                      const Topology& topology) {
  const AnnotationPlan plan = compile_plan(config, s, world);
  const auto found = discover_pipelines(plan, dry_run(plan, topology));
  EXPECT_EQ(found, expected(s)) << "found:" << describe(found) << "\nexpected:" << describe(expected(s));
  const std::vector<PipelinePosition> where = pipeline_positions(found, world);
  for (int r : idle_ranks(s, world)) EXPECT_TRUE(where[r].idle()) << "rank " << r;
  for (size_t p = 0; p < s.pipelines.size(); ++p)
    for (size_t st = 0; st < s.pipelines[p].stages.size(); ++st)
      for (int r : s.pipelines[p].stages[st].ranks)
        EXPECT_EQ(where[r], (PipelinePosition{static_cast<int>(p), static_cast<int>(st)})) << "rank " << r;
}

void expect_discovers(const ModelConfig& config, const Strategy& s, int world) {
  expect_discovers(config, s, world, Topology::uniform(world));
}

std::string error_of(const AnnotationPlan& plan, const std::vector<PlannedReshard>& reshards) {
  try {
    discover_pipelines(plan, reshards);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

#define EXPECT_MESSAGE(message, needle) \
  EXPECT_NE(std::string(message).find(needle), std::string::npos) << (message)

TEST(DiscoverPipelines, EveryExampleStrategy) {
  struct Example {
    std::string strategy, model;
    int world;
  };
  const std::vector<Example> examples = {
      {"hetero_32b_16h800_16h20", "llama-32b", 32}, {"hetero_32b_16h800_24h20", "llama-32b", 40},
      {"hetero_32b_16h800_32h20", "llama-32b", 48}, {"hetero_70b_16h800_16h20", "llama-70b", 32},
      {"hetero_70b_16h800_24h20", "llama-70b", 40}, {"hetero_70b_16h800_32h20", "llama-70b", 48},
      {"elastic_c1_32h20", "llama-32b", 32},        {"elastic_c2_31h20", "llama-32b", 31},
      {"elastic_c3_24h20", "llama-32b", 24},        {"elastic_c4_16h800_32h20", "llama-32b", 48},
      {"elastic_c5_16h800_24h20", "llama-32b", 40}, {"elastic_c6_15h800_24h20", "llama-32b", 40},
      {"elastic_c7_8h800_24h20", "llama-32b", 40},  {"tiny_hetero_8", "llama-tiny-8l", 8},
      {"tiny_zero_8", "llama-tiny-8l", 8},          {"tiny_cp_8", "llama-tiny-8l", 8},
      {"tiny_example_hetero_5", "../tiny-llama/config", 5},
      {"tiny_cp_packed_6", "../tiny-llama/config", 6},
  };
  const auto start = std::chrono::steady_clock::now();
  for (const Example& e : examples) {
    SCOPED_TRACE(e.strategy);
    expect_discovers(ModelConfig::load(kRoot + "/examples/models/" + e.model + ".json"),
                     load_strategy(kRoot + "/examples/strategies/" + e.strategy + ".json"), e.world);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Reported, not asserted: speed belongs to the benchmarks (under ASan
  // this takes about 6 s, in a Release build about 1 s).
  ::testing::Test::RecordProperty("seconds", std::to_string(seconds));
}

TEST(DiscoverPipelines, OneStage) {
  expect_discovers(tiny(), strategy({pipeline({stage({0, 1}, 0, 3)})}), 2);
  expect_discovers(tiny(), strategy({pipeline({stage({0}, 0, 3)})}), 3);  // ranks 1, 2 idle
}

TEST(DiscoverPipelines, TensorParallelDegreeShrinksAlongThePipeline) {
  expect_discovers(tiny(), strategy({pipeline({stage({0, 1}, 0, 1), stage({2}, 2, 2), stage({3}, 3, 3)})}),
                   5);
}

TEST(DiscoverPipelines, HeteroPipelinesAndZero) {
  expect_discovers(tiny(), hetero(), 8);
  expect_discovers(tiny(), hetero(true), 8);
}

// The tied embedding travels from the first stage to the last one; it does
// not make the last stage a successor of the first.
TEST(DiscoverPipelines, TiedEmbeddings) {
  ModelConfig c = tiny();
  c.tie_word_embeddings = true;
  expect_discovers(c, hetero(), 8);
  expect_discovers(c, strategy({pipeline({stage({0, 1, 2, 3}, 0, 1, 2), stage({4, 5, 6, 7}, 2, 3, 2)})}), 8);
}

// Stages listed in another order than their ranks, pipelines not sorted by rank.
TEST(DiscoverPipelines, OrderComesFromTheDataFlowNotFromRankNumbers) {
  expect_discovers(tiny(), strategy({pipeline({stage({6, 7}, 0, 0), stage({0}, 1, 3)}),
                                     pipeline({stage({3}, 0, 2), stage({2, 1}, 3, 3)}, 2)}),
                   8);
}

// A forward transfer of activations from `from` to `to`, as a hand-edited
// plan's dry run would list it.
PlannedReshard transfer(const std::string& name, int from, int to) {
  auto res = std::make_shared<Resolution>();
  res->name = name;
  res->kind = CommKind::kSend;
  auto add = [&](int rank, CommKind kind, int peer) {
    CommOp op;
    op.kind = kind;
    (kind == CommKind::kSend ? op.sends : op.recvs).push_back(Transfer{peer, {}, 8});
    RankResolution& rr = res->ranks[rank];
    rr.rank = rank;
    rr.kind = kind;
    rr.phases.resize(1);
    rr.phases[0].ops.push_back(op);
  };
  add(from, CommKind::kSend, to);
  add(to, CommKind::kRecv, from);
  return {name, "forward", res};
}

TEST(DiscoverPipelines, StructuresThatAreNotChainsAreErrors) {
  const AnnotationPlan plan = compile_plan(tiny(), hetero(), 8);
  const std::vector<PlannedReshard> base = dry_run(plan, Topology::uniform(8));
  auto with = [&](std::vector<PlannedReshard> extra) {
    std::vector<PlannedReshard> all = base;
    all.insert(all.end(), extra.begin(), extra.end());
    return error_of(plan, all);
  };
  // Stage {4} would feed both {5} and {6}.
  EXPECT_MESSAGE(with({transfer("model.layers.3.input", 4, 6)}),
                 "[plan] stage of ranks 4 sends the forward activations to two stages (ranks 5 and 6)");
  // Stage {5} would be fed by both {4} and {2,3}.
  EXPECT_MESSAGE(with({transfer("model.layers.2.input", 3, 5)}),
                 "stage of ranks 5 receives the forward activations from two stages");
  // {6} -> {4} closes a cycle.
  EXPECT_MESSAGE(with({transfer("lm_head.input", 6, 4)}), "ranks 4-6 flow in a cycle");
  // Backward and other forward reshards order nothing.
  PlannedReshard backward = transfer("backward.model.layers.3.input", 4, 6);
  backward.phase = "backward";
  EXPECT_EQ(with({backward, transfer("model.layers.3.positions", 4, 6)}), "no error");
}

TEST(DiscoverPipelines, HandEditedPlanErrors) {
  const AnnotationPlan good = compile_plan(tiny(), hetero(), 8);
  const std::vector<PlannedReshard> reshards = dry_run(good, Topology::uniform(8));
  AnnotationPlan plan = good;
  // Rank 4 (layers 0-1) also holds a weight of layer 3: not one range.
  plan.tensors.at("model.layers.3.input_layernorm.weight").subgroups[1].devices.ranks = {4};
  EXPECT_MESSAGE(error_of(plan, reshards),
                 "[plan] stage of ranks 4 holds parameters of layers 0 .. 3 with gaps");
  plan = good;
  plan.tensors.erase("input_ids");
  EXPECT_MESSAGE(error_of(plan, reshards), "stage of ranks 0-1 starts a pipeline");
}

TEST(PipelinePositions, IdleRanksAndStages) {
  const std::vector<DiscoveredPipeline> pipelines = {{{{{2, 3}, 0, 1}, {{0}, 2, 3}}}};
  const auto where = pipeline_positions(pipelines, 5);
  ASSERT_EQ(where.size(), 5u);
  EXPECT_EQ(where[0], (PipelinePosition{0, 1}));
  EXPECT_TRUE(where[1].idle());
  EXPECT_EQ(where[3], (PipelinePosition{0, 0}));
  EXPECT_TRUE(where[4].idle());
  EXPECT_THROW(pipeline_positions(pipelines, 3), InternalError);
}

}  // namespace
}  // namespace hspmd
