// The planner's cost model (docs/planner.md): the simulated schedules against
// their closed forms, slowdowns, the roofline, the communication volumes
// against the resolver's dry run, memory and ZeRO; and the search against
// exhaustive enumeration of the space it covers.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>

#include "hspmd/core/error.h"
#include "hspmd/planner/cost_model.h"
#include "hspmd/planner/token_dispatch.h"
#include "hspmd/plan/plan.h"
#include "hspmd/planner/search.h"
#include "plan/plan_test_util.h"
#include "test_util.h"

namespace hspmd {
namespace {

using testing::stage;

ModelConfig model8() {
  ModelConfig c = testing::tiny_config(8);
  c.max_position_embeddings = 64;
  return c;
}

// A profile whose parts take fixed times: block 1 ms forward, 2 ms
// backward at tp 1 (halved per TP doubling), embedding and head free,
// optimizer free.
std::shared_ptr<const Profile> flat_profile(const ModelConfig& c, double head = 0) {
  auto p = std::make_shared<Profile>();
  p->config = c;
  for (int tp : {1, 2, 4})
    for (int cp : {1, 2}) {
      ProfileEntry e;
      e.tp = tp;
      e.cp = cp;
      for (const char* part : kProfileParts) e.parts[part] = PartFit{};
      e.parts["block_fwd"].d = 1e-3 / (tp * cp);
      e.parts["block_bwd"].d = 2e-3 / (tp * cp);
      e.parts["head_fwd"].d = head / (tp * cp);
      e.parts["head_bwd"].d = 2 * head / (tp * cp);
      p->entries.push_back(e);
    }
  return p;
}

// `n` ranks in nodes of 4 consecutive ranks (one slowdown per node), every
// link `gbps` (by default so fast that transfers vanish).
Topology cluster(int n, double gbps = 1e9, std::vector<double> slowdown = {}, double cap_gib = 0) {
  nlohmann::json nodes = nlohmann::json::array();
  for (int r = 0; r < n; r += 4) {
    const int last = std::min(n, r + 4) - 1;
    nlohmann::json node = {{"type", "d"}, {"ranks", {r, last}}};
    if (!slowdown.empty()) node["slowdown"] = slowdown[r];
    if (cap_gib > 0) node["memory_cap_gib"] = cap_gib;
    nodes.push_back(node);
  }
  return Topology::from_json({{"catalog", {{"d", {{"tflops", 1}, {"memory_gib", 1}, {"intra_node_gbps", gbps},
                                                  {"inter_node_gbps", gbps}}}}},
                              {"nodes", nodes}});
}

Strategy make(std::vector<Pipeline> pipes, std::string schedule = "1f1b", bool zero = false) {
  Strategy s;
  s.schedule = std::move(schedule);
  s.zero = zero;
  s.pipelines = std::move(pipes);
  return s;
}

Pipeline pipe(std::vector<Stage> stages, int micro_batches, int bs = 1) {
  Pipeline p;
  p.micro_batch_size = bs;
  p.micro_batches = micro_batches;
  p.stages = std::move(stages);
  return p;
}

TEST(CostModel, OneF1BAndGPipeMatchTheirClosedFormWithEqualStages) {
  const ModelConfig c = model8();
  const CostModel cm(c, cluster(4), {}, flat_profile(c));
  for (const char* schedule : {"1f1b", "gpipe"})
    for (int m : {1, 4, 7}) {
      const Strategy s = make({pipe({stage({0}, 0, 1), stage({1}, 2, 3), stage({2}, 4, 5), stage({3}, 6, 7)}, m)},
                              schedule);
      const CostReport r = cm.evaluate(s, 16);
      // (m + K - 1) slots of one stage's forward + backward (2 layers x 3 ms).
      EXPECT_NEAR(r.predicted_step_s, (m + 3) * 6e-3, 1e-9) << schedule << " m=" << m;
      EXPECT_NEAR(r.ranks[0].compute_s, m * 6e-3, 1e-9);
      EXPECT_NEAR(r.ranks[0].bubble_s, 3 * 6e-3, 1e-9);
    }
}

TEST(CostModel, SlowestStageSetsThePaceAndSlowdownScalesCompute) {
  const ModelConfig c = model8();
  // The second node (ranks 4-7) is slowed down 2x.
  const CostModel cm(c, cluster(8, 1e9, {1, 1, 1, 1, 2, 2, 2, 2}), {}, flat_profile(c));
  const Strategy s = make({pipe({stage({0}, 0, 3), stage({4}, 4, 7)}, 8)});
  const CostReport r = cm.evaluate(s, 16);
  // Stage 0: 4 x 3 ms = 12 ms; stage 1: 24 ms per micro-batch. 1F1B with a
  // bottleneck last stage: first forward of stage 0 (4 ms), then 8 x 24 ms,
  // then stage 0's last backward (8 ms).
  EXPECT_NEAR(r.predicted_step_s, 4e-3 + 8 * 24e-3 + 8e-3, 1e-9);
  EXPECT_NEAR(r.ranks[4].compute_s, 8 * 24e-3, 1e-9);
  EXPECT_NEAR(r.ranks[0].compute_s, 8 * 12e-3, 1e-9);
}

TEST(CostModel, DataParallelPipelinesEndTogetherAtTheSlowest) {
  const ModelConfig c = model8();
  const CostModel cm(c, cluster(8, 1e9, {1, 1, 1, 1, 3, 3, 3, 3}), {}, flat_profile(c));
  const Strategy s = make({pipe({stage({0}, 0, 7)}, 3), pipe({stage({4}, 0, 7)}, 1)});
  const CostReport r = cm.evaluate(s, 16);
  EXPECT_NEAR(r.pipeline_s[0], 3 * 24e-3, 1e-9);
  EXPECT_NEAR(r.pipeline_s[1], 72e-3, 1e-9);
  EXPECT_NEAR(r.predicted_step_s, 72e-3, 1e-6);  // balanced: 3 fast micro-batches = 1 slow one
}

TEST(CostModel, RooflineHalvesBlockWorkUnderTwoWayTensorParallelism) {
  const ModelConfig c = model8();
  const CostModel cm(c, cluster(4), {}, nullptr);
  const double t1 = cm.part_seconds(0, "block_fwd", 1, 1, 32, 2);
  const double t2 = cm.part_seconds(0, "block_fwd", 2, 1, 32, 2);
  EXPECT_GT(t1, 0);
  EXPECT_NEAR(t2, t1 / 2, t1 * 1e-12);
  EXPECT_NEAR(cm.part_seconds(0, "block_bwd", 1, 1, 32, 2), 2 * t1, t1 * 1e-12);
  // FLOPs / (1 TFLOP/s x default efficiency 0.5).
  const double h = 32, f = 64, s = 32, b = 2;
  const double flops = 2 * b * s * (2 * h * h + 2 * h * h + 3 * h * f) + 2 * b * s * s * h;
  EXPECT_NEAR(t1, flops / 0.5e12, t1 * 1e-9);
}

// A GPU (a roofline rank, or one profiled on CUDA) overlaps its gradient
// sync with the last micro-batch's backward, as hspmd train --overlap does:
// the sync ends at max(end - hide + sync, end + sync / L), hide = one
// backward x (L-1)/L; a rank profiled on the CPU syncs after its schedule,
// as training there does by default.
TEST(CostModel, GpuGradientSyncOverlapsTheLastBackward) {
  const ModelConfig c = model8();
  const Strategy s = make({pipe({stage({0}, 0, 7)}, 2), pipe({stage({1}, 0, 7)}, 2)});
  auto on_cuda = std::make_shared<Profile>(*flat_profile(c));
  on_cuda->device = "cuda:0";  // what `hspmd profile --device cuda` records
  // A slow network, so that the sync is not negligible.
  const CostModel gpu(c, cluster(2, 1e-3), {}, nullptr), cpu(c, cluster(2, 1e-3), {}, flat_profile(c)),
      profiled_gpu(c, cluster(2, 1e-3), {}, on_cuda);
  EXPECT_TRUE(gpu.overlaps_grad_sync(0));
  EXPECT_TRUE(profiled_gpu.overlaps_grad_sync(0));
  EXPECT_FALSE(cpu.overlaps_grad_sync(0));
  for (const CostModel* cm : {&gpu, &cpu, &profiled_gpu}) {
    const CostReport rep = cm->evaluate(s, 32);
    const RankCost& r = rep.ranks[0];
    StageShape sh{{0}, 1, 8, true, true, false};
    const StageCost sc = cm->stage_cost(sh, 32, 1);
    const double end = 2 * sc.piece();  // two micro-batches, nothing else on the rank
    const double opt = cm->optimizer_seconds(0, cm->stage_params(sh));
    const double sync = r.comm_s;
    ASSERT_GT(sync, 0.1 * end);
    const double want = cm != &cpu ? std::max(end - (sc.bwd + sc.bwd_comm) * 7 / 8 + sync, end + sync / 8) + opt
                                   : end + sync + opt;
    EXPECT_NEAR(r.step_s, want, want * 1e-9) << (cm == &gpu ? "gpu" : cm == &cpu ? "cpu profile" : "cuda profile");
  }
  EXPECT_LT(gpu.evaluate(s, 32).predicted_step_s,
            gpu.evaluate(s, 32).ranks[0].compute_s + gpu.evaluate(s, 32).ranks[0].comm_s);
}

// The collectives inside a stage take the time the emulator bills for the
// dry run's resolutions of the same plan (max of sent and received over the
// slowest link per collective), within a few percent (the model rounds the
// vocabulary-parallel loss's scalars).
TEST(CostModel, StageCollectivesMatchTheDryRun) {
  ModelConfig c = model8();
  c.vocab_size = 64;
  const double gbps = 1;  // every link 1 GB/s
  const Topology topo = cluster(8, gbps);
  const CostModel cm(c, topo, {}, flat_profile(c));
  struct Case {
    std::vector<int> ranks;
    int cp;
  };
  for (const Case& k : {Case{{0, 1}, 1}, Case{{0, 1, 2, 3}, 1}, Case{{0, 1, 2, 3}, 2}}) {
    const Strategy s = make({pipe({stage(k.ranks, 0, 7, k.cp)}, 1)});
    const AnnotationPlan plan = compile_plan(c, s, 8, CompileOptions{16, {}});
    std::vector<PlannedOpTraffic> traffic;
    const std::vector<PlannedReshard> dr = dry_run(plan, topo, &traffic);
    double fwd = 0, bwd = 0;
    const int me = k.ranks.front();
    for (const PlannedReshard& p : dr) {
      if (p.phase != "forward" && p.phase != "backward") continue;
      auto it = p.resolution().ranks.find(me);
      if (it == p.resolution().ranks.end()) continue;
      double t = 0;
      for (const CommPhase& ph : it->second.phases)
        for (const CommOp& op : ph.ops) {
          if (op.group.size() > 1) t += std::max(op.bytes_sent, op.bytes_received) / (gbps * 1e9);
          for (const Transfer& x : op.sends) t += x.bytes / (gbps * 1e9);
          for (const Transfer& x : op.recvs) t += x.bytes / (gbps * 1e9);
        }
      (p.phase == "forward" ? fwd : bwd) += t;
    }
    for (const PlannedOpTraffic& t : traffic) {
      auto it = t.ranks.find(me);
      if (it == t.ranks.end()) continue;
      (t.phase == "forward" ? fwd : bwd) += std::max(it->second.sent, it->second.received) / (gbps * 1e9);
    }
    StageShape sh{k.ranks, k.cp, 8, true, true, false};
    const StageCost sc = cm.stage_cost(sh, 16, 1);
    EXPECT_NEAR(sc.fwd_comm, fwd, 0.1 * fwd) << "tp x cp = " << k.ranks.size() << " cp " << k.cp;
    EXPECT_NEAR(sc.bwd_comm, bwd, 0.1 * bwd) << "tp x cp = " << k.ranks.size() << " cp " << k.cp;
  }
}

TEST(CostModel, ZeroShrinksOptimizerStatesAndCapsAreReported) {
  const ModelConfig c = model8();
  const Topology topo = cluster(4, 1e9, {}, 0.0001);  // 0.1 MiB per rank
  const CostModel cm(c, topo, {}, flat_profile(c));
  const std::vector<Pipeline> pipes = {pipe({stage({0}, 0, 7)}, 1), pipe({stage({1}, 0, 7)}, 1),
                                       pipe({stage({2}, 0, 7)}, 1), pipe({stage({3}, 0, 7)}, 1)};
  const CostReport plain = cm.evaluate(make(pipes), 16);
  const CostReport zero = cm.evaluate(make(pipes, "1f1b", true), 16);
  EXPECT_NEAR(zero.ranks[0].memory.optimizer, plain.ranks[0].memory.optimizer * 3 / 2 / 4, 1e-6);
  EXPECT_EQ(plain.ranks[0].memory.params, zero.ranks[0].memory.params);
  EXPECT_GE(plain.overflow_rank(), 0);  // a whole model in 0.1 MiB does not fit
}

TEST(CostModel, ProfileOfOtherDimensionsIsRejected) {
  const ModelConfig c = model8();
  ModelConfig other = c;
  other.hidden_size = 64;
  try {
    CostModel cm(c, cluster(2), {}, flat_profile(other));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[cost] --profile: the profile was made for another model"),
              std::string::npos)
        << e.what();
  }
}

// ---- search ----

SearchOptions options(int batch) {
  SearchOptions o;
  o.global_batch = batch;
  o.seq_len = 16;
  o.time_limit_s = 60;
  o.top_k = 3;
  return o;
}

// The search (ILPs) against scoring every layer split and micro-batch
// split of the same configurations with the full model: within 5%.
TEST(Search, IlpSecondLevelIsWithinFivePercentOfExhaustive) {
  const ModelConfig c = model8();
  struct Case {
    std::vector<double> slowdown;
    int batch;
  };
  for (const Case& k : {Case{{1, 1, 1, 1, 2, 2, 2, 2}, 8}, Case{{1, 1, 1, 1, 3, 3, 3, 3}, 6}}) {
    const CostModel cm(c, cluster(8, 25, k.slowdown), {}, flat_profile(c, 0.5e-3));
    SearchOptions o = options(k.batch);
    o.tp_degrees = {1, 2};
    o.micro_batch_sizes = {1};
    const SearchResult fast = search_strategy(cm, o);
    o.exhaustive = true;
    const SearchResult full = search_strategy(cm, o);
    ASSERT_FALSE(fast.best.empty());
    ASSERT_FALSE(full.best.empty());
    EXPECT_LE(full.best[0].predicted_step_s, fast.best[0].predicted_step_s * (1 + 1e-12));
    EXPECT_LE(fast.best[0].predicted_step_s, full.best[0].predicted_step_s * 1.05)
        << "searched " << to_json(fast.best[0].strategy).dump() << "\nexhaustive "
        << to_json(full.best[0].strategy).dump();
    validate(fast.best[0].strategy, c, 8);
    EXPECT_EQ(fast.best[0].strategy.global_batch(), k.batch);
  }
}

// Three device classes (ranks 0-3 at full speed, 4-5 at 1/1.5, 6-7 at
// 1/2.5, each pair its own node).
TEST(Search, ThreeDeviceClassesWithinFivePercentOfExhaustive) {
  const ModelConfig c = model8();
  const nlohmann::json nodes = {{{"type", "d"}, {"ranks", {0, 3}}},
                                {{"type", "d"}, {"ranks", {4, 5}}, {"slowdown", 1.5}},
                                {{"type", "d"}, {"ranks", {6, 7}}, {"slowdown", 2.5}}};
  const Topology topo = Topology::from_json(
      {{"catalog", {{"d", {{"tflops", 1}, {"memory_gib", 1}, {"intra_node_gbps", 25}, {"inter_node_gbps", 5}}}}},
       {"nodes", nodes}});
  const CostModel cm(c, topo, {}, flat_profile(c, 0.5e-3));
  SearchOptions o = options(8);
  o.tp_degrees = {1, 2};
  o.micro_batch_sizes = {1};
  const SearchResult fast = search_strategy(cm, o);
  o.exhaustive = true;
  const SearchResult full = search_strategy(cm, o);
  EXPECT_LE(full.best[0].predicted_step_s, fast.best[0].predicted_step_s * (1 + 1e-12));
  EXPECT_LE(fast.best[0].predicted_step_s, full.best[0].predicted_step_s * 1.05)
      << "searched " << to_json(fast.best[0].strategy).dump() << "\nexhaustive "
      << to_json(full.best[0].strategy).dump();
  // It uses the speed differences: faster than symmetric strategies.
  std::vector<Pipeline> dp8, pp2;
  for (int r = 0; r < 8; ++r) dp8.push_back(pipe({stage({r}, 0, 7)}, 1));
  for (int r = 0; r < 4; ++r) pp2.push_back(pipe({stage({2 * r}, 0, 3), stage({2 * r + 1}, 4, 7)}, 2));
  EXPECT_LT(fast.best[0].predicted_step_s, cm.evaluate(make(dp8), 16).predicted_step_s);
  EXPECT_LT(fast.best[0].predicted_step_s, cm.evaluate(make(pp2), 16).predicted_step_s);
}

TEST(Search, TimeLimitKeepsTheBestSoFar) {
  const ModelConfig c = model8();
  const CostModel cm(c, cluster(8, 25, {1, 1, 1, 1, 2, 2, 2, 2}), {}, flat_profile(c));
  SearchOptions o = options(8);
  o.time_limit_s = 1e-9;
  try {
    const SearchResult r = search_strategy(cm, o);
    EXPECT_TRUE(r.timed_out);
  } catch (const Error& e) {  // nothing scored before the limit: one line saying so
    EXPECT_NE(std::string(e.what()).find("within the time limit"), std::string::npos) << e.what();
  }
}

TEST(Search, NeverReturnsAStrategyThatOverflowsAndNamesTheShortfall) {
  const ModelConfig c = model8();
  const CostModel roomy(c, cluster(8, 25, {}, 1), {}, flat_profile(c));
  const SearchResult r = search_strategy(roomy, options(8));
  ASSERT_FALSE(r.best.empty());
  // A cap that a single rank cannot meet with the whole model but a deep
  // pipeline can: every returned candidate fits.
  const CostReport whole = roomy.evaluate(make({pipe({stage({0}, 0, 7)}, 8)}), 16);
  const double cap_gib = whole.ranks[0].memory.total() * 0.6 / (1024.0 * 1024 * 1024);
  const CostModel tight(c, cluster(8, 25, {}, cap_gib), {}, flat_profile(c));
  const SearchResult t = search_strategy(tight, options(8));
  for (const SearchCandidate& cand : t.best) EXPECT_EQ(tight.evaluate(cand.strategy, 16).overflow_rank(), -1);
  // Nothing fits in a few bytes: one line naming a rank and the bytes.
  const CostModel tiny(c, cluster(8, 25, {}, 1e-9), {}, flat_profile(c));
  try {
    search_strategy(tiny, options(8));
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("[search] no strategy fits in memory"), std::string::npos) << what;
    EXPECT_NE(what.find("on rank"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos);
  }
}

TEST(Search, ReplanAvoidsUnavailableRanks) {
  const ModelConfig c = model8();
  const CostModel cm(c, cluster(8, 25, {1, 1, 1, 1, 2, 2, 2, 2}), {}, flat_profile(c));
  const SearchResult first = search_strategy(cm, options(8));
  SearchOptions o = options(8);
  o.unavailable = {1, 6};
  o.previous = &first.best[0].strategy;
  const SearchResult again = search_strategy(cm, o);
  for (const SearchCandidate& cand : again.best)
    for (int r : cand.strategy.ranks()) EXPECT_FALSE(o.unavailable.count(r)) << r;
  EXPECT_GE(again.best[0].predicted_step_s, first.best[0].predicted_step_s * (1 - 1e-9));
}

// A cluster where one big pipeline is best: with min_pipelines 2 every
// candidate has two or more, and none beats the unconstrained best.
TEST(Search, MinPipelinesKeepsReplicas) {
  const ModelConfig c = model8();
  const CostModel cm(c, cluster(8, 25, {1, 1, 1, 1, 1, 1, 1, 1}), {}, flat_profile(c));
  SearchOptions o = options(8);
  o.unavailable = {7};
  const SearchResult free = search_strategy(cm, o);
  o.min_pipelines = 2;
  const SearchResult two = search_strategy(cm, o);
  ASSERT_FALSE(two.best.empty());
  for (const SearchCandidate& cand : two.best) EXPECT_GE(cand.strategy.pipelines.size(), 2u);
  EXPECT_GE(two.best[0].predicted_step_s, free.best[0].predicted_step_s * (1 - 1e-9));
  o.min_pipelines = 9;  // more pipelines than ranks: nothing to build
  EXPECT_THROW(search_strategy(cm, o), Error);
}

TEST(Search, CbcAndExactSolversAgree) {
  const ModelConfig c = model8();
  const CostModel cm(c, cluster(8, 25, {1, 1, 1, 1, 2, 2, 2, 2}), {}, flat_profile(c, 1e-3));
  SearchOptions o = options(8);
  o.solver = IlpSolver::kCbc;
  const SearchResult a = search_strategy(cm, o);
  o.solver = IlpSolver::kExact;
  const SearchResult b = search_strategy(cm, o);
  EXPECT_NEAR(a.best[0].predicted_step_s, b.best[0].predicted_step_s, 1e-12);
}


// Token-budget dispatch (planner/token_dispatch.h): a micro-batch packs its pieces
// into one call of every op, so a call's fixed cost is paid once per
// micro-batch and each piece adds only its marginal cost. Block forward
// 1 ms + 10 us per token, backward 2 ms, 8 layers, one rank: a piece of s
// tokens alone costs 24 ms + 80 us * s.
TEST(TokenDispatch, FixedCostOncePerMicroBatch) {
  const ModelConfig c = model8();
  auto prof = std::make_shared<Profile>(*flat_profile(c));
  for (ProfileEntry& e : prof->entries) e.parts["block_fwd"].c = 1e-5 / (e.tp * e.cp);
  const CostModel cm(c, cluster(4), {}, prof);
  Pipeline one = pipe({stage({0}, 0, 7)}, 1);
  one.max_seq_len = 64;
  one.micro_batch_tokens = 64;
  Strategy s = make({one});
  const PieceCosts costs(cm, s);
  EXPECT_NEAR(costs.seconds(0, 8), 24e-3 + 8 * 80e-6, 1e-9);
  EXPECT_NEAR(costs.per_micro_batch(0), 24e-3, 1e-9);
  EXPECT_NEAR(costs.marginal(0, 8), 8 * 80e-6, 1e-9);
  // Eight pieces of 8 fill one micro-batch of 64; sixteen fill two.
  TokenDispatch d = dispatch_token_step(costs, s, std::vector<int64_t>(8, 8));
  ASSERT_EQ(d.micro.at(0).size(), 1u);
  EXPECT_NEAR(d.predicted_s, 24e-3 + 64 * 80e-6, 1e-9);
  d = dispatch_token_step(costs, s, std::vector<int64_t>(16, 8));
  ASSERT_EQ(d.micro.at(0).size(), 2u);
  EXPECT_NEAR(d.predicted_s, 2 * 24e-3 + 128 * 80e-6, 1e-9);
  // Two such pipelines: eight short pieces go four and four, one
  // micro-batch each (not all to one, whose per-piece cost is the same).
  Pipeline two = one;
  two.stages = {stage({1}, 0, 7)};
  s = make({one, two});
  const PieceCosts both(cm, s);
  d = dispatch_token_step(both, s, std::vector<int64_t>(8, 8));
  EXPECT_EQ(d.pipeline_tokens, (std::vector<int64_t>{32, 32}));
  EXPECT_NEAR(d.predicted_s, 24e-3 + 32 * 80e-6, 1e-9);
}

// The symmetric rule (the baselines' SPMD data parallelism) is blind to
// device speeds: against a rank at half speed the cost rule gives the fast
// pipeline twice the tokens, the symmetric one the same tokens to each, in
// micro-batches packed to the capacity, and predicts the slow pipeline's
// time.
TEST(TokenDispatch, SymmetricRuleIgnoresDeviceSpeeds) {
  const ModelConfig c = model8();
  auto prof = std::make_shared<Profile>(*flat_profile(c));
  for (ProfileEntry& e : prof->entries) e.parts["block_fwd"].c = 1e-4 / (e.tp * e.cp);
  const CostModel cm(c, cluster(8, 1e9, {1, 1, 1, 1, 2, 2, 2, 2}), {}, prof);
  Pipeline fast = pipe({stage({0}, 0, 7)}, 1), slow = pipe({stage({4}, 0, 7)}, 1);
  fast.max_seq_len = slow.max_seq_len = 32;
  fast.micro_batch_tokens = slow.micro_batch_tokens = 32;
  const Strategy s = make({fast, slow});
  const PieceCosts costs(cm, s);
  const std::vector<int64_t> pieces(24, 16);  // 384 tokens, micro-batches of two pieces
  const TokenDispatch by_cost = dispatch_token_step(costs, s, pieces);
  EXPECT_EQ(by_cost.pipeline_tokens, (std::vector<int64_t>{256, 128}));
  const TokenDispatch sym = dispatch_token_step(costs, s, pieces, 0, DispatchRule::kSymmetric);
  EXPECT_EQ(sym.pipeline_tokens, (std::vector<int64_t>{192, 192}));
  ASSERT_EQ(sym.micro.at(0).size(), 6u);
  for (const auto& mb : sym.micro.at(1)) EXPECT_EQ(mb.size(), 2u);
  // Six micro-batches on the slow rank: 2 x (24 ms + 32 x 0.8 ms) each.
  EXPECT_NEAR(sym.predicted_s, 6 * 2 * (24e-3 + 32 * 8e-4), 1e-9);
  EXPECT_LT(by_cost.predicted_s, sym.predicted_s);
  EXPECT_EQ(parse_dispatch_rule("symmetric"), DispatchRule::kSymmetric);
  EXPECT_NE(testing::error_of([] { parse_dispatch_rule("fast"); }).find("[flags] --dispatch must be cost or symmetric"),
            std::string::npos);
}

// The straggler watch's per-rank prediction of a token-budget step: each
// micro-batch of the rank's pipeline on its stage (the fixed part once,
// each piece's marginal part), idle ranks nothing; the optimizer is free in
// this profile. Two stages of 4 layers: per stage 12 ms fixed + 40 us a
// token.
TEST(TokenDispatch, RankComputeFollowsThePieces) {
  const ModelConfig c = model8();
  auto prof = std::make_shared<Profile>(*flat_profile(c));
  for (ProfileEntry& e : prof->entries) e.parts["block_fwd"].c = 1e-5 / (e.tp * e.cp);
  const CostModel cm(c, cluster(4), {}, prof);
  Pipeline one = pipe({stage({0}, 0, 7)}, 1), two = pipe({stage({1}, 0, 3), stage({2}, 4, 7)}, 1);
  one.max_seq_len = two.max_seq_len = 32;
  const Strategy s = make({one, two});
  const std::vector<double> t = token_step_rank_compute(cm, s, {{{8, 8}, {16}}, {{4}}}, 4);
  ASSERT_EQ(t.size(), 4u);
  EXPECT_NEAR(t[0], 2 * 24e-3 + 32 * 80e-6, 1e-9);
  EXPECT_NEAR(t[1], 12e-3 + 4 * 40e-6, 1e-9);
  EXPECT_NEAR(t[2], 12e-3 + 4 * 40e-6, 1e-9);
  EXPECT_EQ(t[3], 0.0);
}

}  // namespace
}  // namespace hspmd

namespace hspmd {
namespace {

// A part's fit is a sum of non-negative costs: measurements whose unconstrained
// least squares has a negative intercept (as `hspmd profile` once produced,
// embed_bwd d = -4e-5) give a fit with every coefficient >= 0, still close.
TEST(ProfileFit, CoefficientsAreNeverNegative) {
  PartFit f;
  // t = 1e-6 * b * s exactly, minus a little at the small points: the free
  // fit's intercept goes below zero.
  for (int64_t s : {16, 32, 64, 128})
    for (int64_t b : {1, 2}) f.samples.push_back({s, b, 1e-6 * static_cast<double>(b * s) * (s <= 16 ? 0.8 : 1.0)});
  f.fit();
  EXPECT_GE(f.a, 0);
  EXPECT_GE(f.c, 0);
  EXPECT_GE(f.d, 0);
  EXPECT_LT(f.max_rel_error, 0.35);
  for (const FitSample& x : f.samples) EXPECT_GE(f.at(x.s, x.b), 0);
}

// A loaded profile with a negative fitted time is refused, naming the field.
TEST(ProfileFit, NegativeCoefficientsAreRefusedOnLoad) {
  Profile p;
  p.config.vocab_size = 64;
  p.config.hidden_size = 32;
  p.config.intermediate_size = 64;
  p.config.num_hidden_layers = 2;
  p.config.num_attention_heads = 4;
  ProfileEntry e;
  PartFit fit;
  fit.a = 1e-9;
  fit.c = 1e-7;
  fit.d = 1e-5;
  for (const char* part : kProfileParts) e.parts[part] = fit;
  p.entries.push_back(e);
  nlohmann::json j = p.to_json();
  Profile::from_json(j, "p.json");  // valid
  j["entries"][0]["parts"]["embed_bwd"]["d"] = -4e-5;
  try {
    Profile::from_json(j, "p.json");
    FAIL() << "accepted a negative fit";
  } catch (const Error& err) {
    EXPECT_STREQ(err.what(),
                 "[profile] p.json: entries[0].embed_bwd.d: -4e-05 is not a finite number >= 0 (a fitted time; "
                 "profile again)");
  }
}

}  // namespace
}  // namespace hspmd

namespace hspmd {
namespace {

// A cluster emulated on this CPU ("slowdown" or "memory_cap_gib" in a node)
// must be timed from a profile of this CPU: without one the roofline's
// prediction contradicts what the emulator measures (94% off), so plan
// search / cost refuse in one line naming `hspmd profile`.
TEST(CostModel, EmulatedRanksNeedAProfile) {
  const ModelConfig c = model8();
  auto topo = [](nlohmann::json extra) {
    nlohmann::json slow = {{"type", "d"}, {"ranks", {4, 7}}};
    if (extra.is_object()) slow.update(extra);
    return Topology::from_json(
        {{"catalog", {{"d", {{"tflops", 1}, {"memory_gib", 1}, {"intra_node_gbps", 25}, {"inter_node_gbps", 5}}}}},
         {"nodes", {{{"type", "d"}, {"ranks", {0, 3}}}, slow}}});
  };
  const std::string e = testing::error_of(
      [&] { CostModel(c, topo({{"slowdown", 2.0}}), {}, nullptr).require_profiles_for_emulation("c.json"); });
  EXPECT_EQ(e.rfind("[plan] c.json: rank 4 (device type 'd') is emulated on this CPU", 0), 0u) << e;
  EXPECT_NE(e.find("hspmd profile"), std::string::npos);
  EXPECT_THROW(CostModel(c, topo({{"memory_cap_gib", 4}}), {}, nullptr).require_profiles_for_emulation("c.json"),
               Error);
  // With a profile, or on a cluster that emulates nothing, no error; and
  // the mark survives the cluster's JSON round trip (slowdown 1 included).
  EXPECT_NO_THROW(CostModel(c, topo({{"slowdown", 2.0}}), {}, flat_profile(c, 0.5e-3))
                      .require_profiles_for_emulation("c.json"));
  EXPECT_NO_THROW(CostModel(c, topo(nlohmann::json::object()), {}, nullptr).require_profiles_for_emulation("c.json"));
  EXPECT_TRUE(Topology::from_json(topo({{"slowdown", 1.0}}).to_json()).rank(5).emulated);
  EXPECT_FALSE(Topology::from_json(topo(nlohmann::json::object()).to_json()).rank(5).emulated);
}

// A mixture of experts' roofline (docs/moe.md): the experts a token goes to
// (its top k of E, not all E) and the router, whole on every tp rank (the
// experts are replicated over tp), beside the attention that tp divides.
TEST(CostModel, RooflinePricesTheTopKExpertsWholeOnEveryTpRank) {
  const ModelConfig dense = model8();
  ModelConfig moe = dense;
  moe.model_type = "mixtral";
  moe.moe.num_experts = 4;
  moe.moe.top_k = 2;
  moe.moe.expert_intermediate_size = dense.intermediate_size;
  const double h = 32, f = 64, attention = 4 * h * h;  // q, k, v, o at 4 heads of 8, no GQA
  const ModelFamily::LayerCompute lc = model_family("mixtral").layer_compute(moe);
  EXPECT_DOUBLE_EQ(lc.tp_split, attention);
  EXPECT_DOUBLE_EQ(lc.whole, 4 * h + 2 * 3 * h * f);  // the router, then 2 experts of 3 matmuls
  EXPECT_DOUBLE_EQ(model_family("llama").layer_compute(dense).tp_split, attention + 3 * h * f);
  const Topology t = cluster(4);
  const CostModel d(dense, t, {}, nullptr), m(moe, t, {}, nullptr);
  const int64_t s = 16, b = 2;
  const double pairs = s * s / 2.0;
  // The device's rate from the dense model's time at tp 1.
  const double rate = (2.0 * b * s * (attention + 3 * h * f) + 4.0 * b * pairs * h) /
                      d.part_seconds(0, "block_fwd", 1, 1, s, b);
  for (int tp : {1, 2, 4}) {
    const double want = (2.0 * b * s / tp * attention + 2.0 * b * s * lc.whole + 4.0 * b * pairs * h / tp) / rate;
    EXPECT_NEAR(m.part_seconds(0, "block_fwd", tp, 1, s, b), want, 1e-9 * want) << "tp " << tp;
  }
  // Memory and gradient sync count every expert: 4 of them where one token uses 2.
  EXPECT_EQ(m.layer_params() - d.layer_params(), static_cast<int64_t>(4 * h + 4 * 3 * h * f - 3 * h * f));
}

// Expert parallelism (docs/moe.md): a rank holds 1 / G of every sparse
// layer's experts, and each sparse layer of a micro-batch exchanges the
// (G - 1) / G of its k rows a token that go to other members (at uniform
// routing) with its group: rows out and outputs (f32) back in the forward,
// rows and output gradients out and input gradients back in the backward.
TEST(CostModel, ExpertParallelismDividesTheExpertsAndPricesTheExchange) {
  ModelConfig moe = model8();
  moe.model_type = "mixtral";
  moe.moe.num_experts = 4;
  moe.moe.top_k = 2;
  moe.moe.expert_intermediate_size = 48;
  const double h = 32, f = 48;
  const CostModel m(moe, cluster(4, 10), {}, nullptr);  // 10 GB/s links
  std::vector<Pipeline> pipes;
  for (int r = 0; r < 4; ++r) pipes.push_back(pipe({stage({r}, 0, 7)}, 2));
  Strategy ep = make(pipes);
  ep.expert_parallel = 2;
  StageShape sh{{0}, 1, 8, true, true, false};
  const int64_t whole = m.stage_params(sh);
  sh.expert_parallel = 2;
  sh.sparse_layers = 8;
  sh.expert_group = {0, 1};
  EXPECT_EQ(whole - m.stage_params(sh), static_cast<int64_t>(8 * 2 * 3 * h * f));  // 2 of the 4 experts a layer
  const int64_t s = 16, b = 2;
  const double rows = b * s * 2 * 0.5 * h, act = 2;  // bf16 activations on the roofline (no profile)
  StageShape plain = sh;
  plain.expert_parallel = 1;
  const StageCost with = m.stage_cost(sh, s, b), without = m.stage_cost(plain, s, b);
  EXPECT_NEAR(with.fwd_comm - without.fwd_comm, 8 * m.group_seconds({0, 1}, rows * (act + 4)), 1e-15);
  EXPECT_NEAR(with.bwd_comm - without.bwd_comm, 8 * m.group_seconds({0, 1}, rows * (2 * act + 4)), 1e-15);
  EXPECT_GT(with.fwd_comm, 0);
  // evaluate() places the groups: ranks 0-1 and 2-3, each rank's experts halved.
  Strategy replicated = ep;
  replicated.expert_parallel = 1;
  const CostReport a = m.evaluate(replicated, 16), e = m.evaluate(ep, 16);
  EXPECT_LT(e.ranks[0].memory.params, a.ranks[0].memory.params);
  EXPECT_NEAR(a.ranks[0].memory.params - e.ranks[0].memory.params, 8 * 2 * 3 * h * f * 2, 1e-6);  // bf16 params
}

}  // namespace
}  // namespace hspmd
