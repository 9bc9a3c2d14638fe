// compile_plan, the plan's JSON form and the dry run: the annotations a
// strategy compiles to, and the primitives each Reshard resolves into.
#include <gtest/gtest.h>

#include <set>

#include "hspmd/core/error.h"
#include "hspmd/plan/plan.h"
#include "plan/plan_test_util.h"

namespace hspmd {
namespace {

ModelConfig tiny(int layers = 4) { return testing::tiny_config(layers); }
using testing::stage;

Pipeline pipeline(int mbs, int micro, std::vector<Stage> stages) {
  Pipeline p;
  p.micro_batch_size = mbs;
  p.micro_batches = micro;
  p.stages = std::move(stages);
  return p;
}

// docs/strategy.md's example on 4 layers: pipeline 0 = TP2 x 2 stages, pipeline 1 = 3 single
// devices with uneven layers; rank 7 idle.
Strategy hetero(bool zero = false) {
  Strategy s;
  s.zero = zero;
  s.pipelines = {pipeline(2, 2, {stage({0, 1}, 0, 1), stage({2, 3}, 2, 3)}),
                 pipeline(1, 4, {stage({4}, 0, 1), stage({5}, 2, 2), stage({6}, 3, 3)})};
  return s;
}

// One pipeline of one stage: tp 2 x cp 2 over ranks 0-3.
Strategy strategy_with_cp() {
  Strategy s;
  s.pipelines = {pipeline(2, 2, {stage({0, 1, 2, 3}, 0, 3, 2)})};
  return s;
}

const PlannedReshard& find(const std::vector<PlannedReshard>& all, const std::string& name) {
  for (const auto& r : all)
    if (r.name == name) return r;
  ADD_FAILURE() << "no reshard " << name;
  static PlannedReshard none;
  return none;
}

CommKind kind_on(const PlannedReshard& r, int rank) {
  auto it = r.resolution().ranks.find(rank);
  return it == r.resolution().ranks.end() ? CommKind::kIdentity : it->second.kind;
}

TEST(CompilePlan, AnnotatesPipelinesAndStages) {
  const AnnotationPlan plan = compile_plan(tiny(), hetero(), 8);
  const Annotation& q = plan.tensors.at("model.layers.2.self_attn.q_proj.weight");
  ASSERT_EQ(q.hsize(), 2);
  EXPECT_EQ(q.hdim, kDup);
  EXPECT_EQ(q.subgroups[0].devices.ranks, (std::vector<int>{2, 3}));
  EXPECT_EQ(q.subgroups[0].states.degree(0), 2);  // column parallel
  EXPECT_EQ(q.subgroups[1].devices.ranks, (std::vector<int>{5}));
  const Annotation& o = plan.tensors.at("model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(o.subgroups[0].states.degree(1), 2);  // row parallel
  const Annotation& ids = plan.tensors.at("input_ids");
  EXPECT_EQ(ids.hdim, 0);
  EXPECT_EQ(ids.part_weights, (std::vector<int64_t>{2, 1}));  // micro-batch sizes 2 and 1
  EXPECT_EQ(plan.bindings.at("B"), 3);
  EXPECT_EQ(plan.bindings.at("S"), 16);
  EXPECT_TRUE(plan.optimizer_states.empty());
}

// The compiler annotates exactly the model's leaves and declared Reshard
// points, each parameter split as its declared role says on the stage of its
// declared layer, and the dry run's grad_sync phase is the declared
// gradient-sync points.
TEST(CompilePlan, FollowsTheModelsDeclarations) {
  for (bool tied : {false, true}) {
    ModelConfig c = tiny();
    c.tie_word_embeddings = tied;
    const AnnotationPlan plan = compile_plan(c, hetero(), 8);
    std::set<std::string> expected = {"input_ids", "targets", "positions", "normalizer"};
    for (const ModelParameter& p : model_parameters(plan.model)) {
      expected.insert(p.name);
      const Subgroup& pipeline1 = plan.tensors.at(p.name).subgroups[1];  // ranks 4, 5, 6: one each
      const int rank = p.part == ModelPart::kEmbedding ? 4
                       : p.part == ModelPart::kHead    ? 6
                                                       : (p.layer < 2 ? 4 : p.layer == 2 ? 5 : 6);
      EXPECT_EQ(pipeline1.devices.ranks, std::vector<int>{rank}) << p.name;
      const DistStates& tp2 = plan.tensors.at(p.name).subgroups[0].states;  // a tp-2 stage
      const int dim = p.role == ParamRole::kRowParallel ? 1 : p.role == ParamRole::kReplicated ? -1 : 0;
      EXPECT_EQ(dim < 0 ? tp2.degree(kDup) : tp2.degree(dim), 2) << p.name;
    }
    std::set<std::string> grad_syncs;
    for (const ReshardPoint& p : model_reshard_points(plan.model)) {
      expected.insert(p.name);
      if (p.kind == ReshardKind::kGradSync) grad_syncs.insert(p.name);
    }
    std::set<std::string> annotated;
    for (const auto& [name, a] : plan.tensors) annotated.insert(name);
    EXPECT_EQ(annotated, expected);
    std::set<std::string> synced;
    for (const PlannedReshard& r : dry_run(plan, Topology::uniform(8)))
      if (r.phase == "grad_sync") synced.insert(r.name);
    EXPECT_EQ(synced, grad_syncs);
  }
}

// A vocabulary tp does not divide is padded to a multiple of every stage's
// tp: the tables gain zero rows, the loss masks their logits, and the plan's
// JSON keeps the padding.
TEST(CompilePlan, PadsTheVocabularyForTensorParallelism) {
  ModelConfig c = tiny();
  c.vocab_size = 63;
  const AnnotationPlan plan = compile_plan(c, hetero(), 8);  // tp 2 and 1
  EXPECT_EQ(plan.model.vocab_size, 63);
  EXPECT_EQ(plan.model.table_rows(), 64);
  const AnnotationPlan back = plan_from_json(to_json(plan));
  EXPECT_EQ(back.model.table_rows(), 64);
  const ModelGraph m = build_model(plan.model);
  EXPECT_EQ(m.params[0].shape()[0], SymDim(64));  // model.embed_tokens.weight
  EXPECT_NO_THROW(dry_run(plan, Topology::uniform(8)));
  EXPECT_EQ(compile_plan(tiny(), hetero(), 8).model.table_rows(), 64);  // 64 divides: no padding
  EXPECT_EQ(compile_plan(tiny(), hetero(), 8).model.padded_vocab_size, 0);
}

TEST(CompilePlan, RejectsAnInvalidStrategy) {
  Strategy s = hetero();
  s.pipelines[1].stages[1].first_layer = 3;  // gap after layer 1
  EXPECT_THROW(compile_plan(tiny(), s, 8), Error);
  EXPECT_THROW(compile_plan(tiny(), hetero(), 6), Error);  // rank 6 outside the world
}

// Sequence lengths must divide along every stage's splits: cp x tp, and
// 2 x cp for context-parallel attention's chunks.
TEST(CompilePlan, SequenceGranularity) {
  EXPECT_EQ(sequence_granularity(hetero()), 2);  // TP2 stages
  Strategy s;
  s.pipelines = {pipeline(1, 2, {stage({0, 1, 2, 3}, 0, 3, 2)}), pipeline(1, 2, {stage({4, 5, 6}, 0, 3)})};
  EXPECT_EQ(sequence_granularity(s), 12);  // lcm(cp 2 x tp 2, 2 x cp 2, tp 3)
  CompileOptions o;
  o.seq_len = 6;
  try {
    compile_plan(tiny(), strategy_with_cp(), 4, o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "[plan] sequence length 6 must be a multiple of 4 (stages split the "
                           "sequence over their cp x tp ranks, and cp > 1 into 2 x cp chunks)");
  }
  o.seq_len = 8;
  EXPECT_NO_THROW(compile_plan(tiny(), strategy_with_cp(), 4, o));
}

// The communication inside ops, per micro-batch: ring attention over the cp
// pairs {0, 2} and {1, 3} in every layer, the vocab-parallel loss over the
// tp pairs {0, 1} and {2, 3}. Sizes worked by hand: S 16 in halves of 4, a
// rank's chunk of 8 tokens, B 2, 2 local heads (q and kv) of 8.
TEST(DryRun, OpTrafficOfContextAndVocabParallelism) {
  const std::vector<PlannedOpTraffic> traffic = op_traffic(compile_plan(tiny(), strategy_with_cp(), 4));
  ASSERT_EQ(traffic.size(), 3u);  // attention, cross_entropy forward; attention_grad backward
  std::map<std::string, const PlannedOpTraffic*> by_op;
  for (const auto& t : traffic) by_op[t.op] = &t;
  const PlannedOpTraffic& fwd = *by_op.at("attention");
  EXPECT_EQ(fwd.phase, "forward");
  EXPECT_EQ(fwd.kind, "ring_attention");
  EXPECT_EQ(fwd.calls, 4);
  ASSERT_EQ(fwd.ranks.size(), 4u);
  EXPECT_EQ(fwd.ranks.at(0).group, (std::vector<int>{0, 2}));
  EXPECT_EQ(fwd.ranks.at(3).group, (std::vector<int>{1, 3}));
  // Per call: 8 B agreeing on errors, one half of q, k, v and the document
  // starts to the zigzag owner (392 floats), one hop of k, v (512 floats),
  // one half of out and lse back (144 floats).
  for (int r = 0; r < 4; ++r) EXPECT_EQ(fwd.ranks.at(r).sent, 4 * (8 + 392 * 4 + 512 * 4 + 144 * 4));
  EXPECT_EQ(by_op.at("attention_grad")->phase, "backward");
  const PlannedOpTraffic& loss = *by_op.at("cross_entropy");
  EXPECT_EQ(loss.kind, "vocab_parallel_loss");
  EXPECT_EQ(loss.calls, 1);
  EXPECT_EQ(loss.ranks.at(2).group, (std::vector<int>{2, 3}));
  EXPECT_EQ(loss.ranks.at(2).sent, 16 * 4 + 16 * 4);  // all-gather and all-reduce of 16 rows
  // Without cp or vocab-parallel heads nothing communicates inside ops.
  Strategy dp;
  dp.pipelines = {pipeline(1, 2, {stage({0}, 0, 3)}), pipeline(1, 2, {stage({1}, 0, 3)})};
  EXPECT_TRUE(op_traffic(compile_plan(tiny(), dp, 2)).empty());
}

TEST(DryRun, HeteroPipelinesResolveToTheExpectedPrimitives) {
  const AnnotationPlan plan = compile_plan(tiny(), hetero(), 8);
  const auto all = dry_run(plan, Topology::uniform(8));
  // Tensor (+ sequence) parallelism inside stage {0,1}: gather the sequence
  // shards before the column-parallel linears, reduce-scatter after the
  // row-parallel ones, and the reverse in the backward.
  EXPECT_EQ(kind_on(find(all, "model.layers.0.attn_input"), 0), CommKind::kAllGather);
  EXPECT_EQ(kind_on(find(all, "model.layers.0.attn_output"), 0), CommKind::kReduceScatter);
  EXPECT_EQ(kind_on(find(all, "model.embed_tokens.out"), 1), CommKind::kReduceScatter);
  EXPECT_EQ(kind_on(find(all, "backward.model.layers.0.mlp_input"), 0),
            CommKind::kReduceScatter);
  EXPECT_EQ(kind_on(find(all, "backward.model.layers.0.mlp_output"), 1), CommKind::kAllGather);
  // The single-device pipeline needs no communication inside its stages.
  EXPECT_EQ(kind_on(find(all, "model.layers.0.attn_output"), 4), CommKind::kIdentity);
  // Between stages: point to point.
  const CommKind between = kind_on(find(all, "model.layers.2.input"), 2);
  EXPECT_TRUE(between == CommKind::kRecv || between == CommKind::kBsr) << kind_name(between);
  const CommKind single = kind_on(find(all, "model.layers.3.input"), 6);
  EXPECT_TRUE(single == CommKind::kRecv || single == CommKind::kBsr) << kind_name(single);
  // Gradient sync across pipelines of different TP degrees.
  const auto& grad = find(all, "grad.model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(grad.phase, "grad_sync");
  EXPECT_EQ(kind_on(grad, 0), CommKind::kSplitAllReduce);
  EXPECT_EQ(kind_on(grad, 4), CommKind::kSplitAllReduce);
  EXPECT_GT(grad.resolution().total_bytes, 0);
  EXPECT_EQ(grad.resolution().ranks.count(7), 0u);  // the idle rank does nothing
}

TEST(DryRun, ZeroUsesSplitReduceScatterAndSplitAllGather) {
  const AnnotationPlan plan = compile_plan(tiny(), hetero(true), 8);
  EXPECT_FALSE(plan.optimizer_states.empty());
  const auto all = dry_run(plan, Topology::uniform(8));
  const auto& grad = find(all, "grad.model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(kind_on(grad, 0), CommKind::kSplitReduceScatter);
  const auto& gather = find(all, "zero_gather.model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(gather.phase, "zero_gather");
  EXPECT_EQ(kind_on(gather, 4), CommKind::kSplitAllGather);
}

TEST(DryRun, ContextParallelStage) {
  Strategy s;
  s.pipelines = {pipeline(1, 2, {stage({0, 1, 2, 3}, 0, 1, 2), stage({4, 5}, 2, 3)})};
  const AnnotationPlan plan = compile_plan(tiny(), s, 6);
  // Attention's input: the sequence split over cp, copies over tp; the
  // residual stream: split over cp x tp (sequence parallelism).
  EXPECT_EQ(plan.tensors.at("model.layers.0.attn_input").subgroups[0].states.degree(1), 2);
  EXPECT_EQ(plan.tensors.at("model.layers.0.input").subgroups[0].states.degree(1), 4);
  const auto all = dry_run(plan, Topology::uniform(6));
  // Weight gradients are partial over the cp ranks: summed at gradient sync.
  EXPECT_EQ(kind_on(find(all, "grad.model.layers.0.mlp.up_proj.weight"), 0),
            CommKind::kAllReduce);
  const CommKind between = kind_on(find(all, "model.layers.2.input"), 4);
  EXPECT_TRUE(between == CommKind::kBsr || between == CommKind::kRecv) << kind_name(between);
  // Gathering the tp shards inside each cp half.
  EXPECT_EQ(kind_on(find(all, "model.layers.0.attn_input"), 1), CommKind::kAllGather);
}

// Tied embeddings: the first stage's embedding goes to the last stage as the
// LM head, and its gradient comes back (still partial across pipelines) to
// be summed with the embedding's own at gradient sync.
TEST(DryRun, TiedEmbeddingsTravelBetweenStages) {
  ModelConfig c = tiny();
  c.tie_word_embeddings = true;
  const auto all = dry_run(compile_plan(c, hetero(), 8), Topology::uniform(8));
  const CommKind forward = kind_on(find(all, "lm_head.weight"), 2);
  EXPECT_TRUE(forward == CommKind::kRecv || forward == CommKind::kBsr) << kind_name(forward);
  EXPECT_EQ(kind_on(find(all, "lm_head.weight"), 4), CommKind::kSend);  // rank 4 -> rank 6
  EXPECT_EQ(kind_on(find(all, "backward.lm_head.weight"), 6), CommKind::kSend);
  EXPECT_EQ(kind_on(find(all, "grad.model.embed_tokens.weight"), 0), CommKind::kSplitAllReduce);
}

// Tied embeddings with cp: the LM head's gradient is partial over the cp
// ranks; it travels back pairwise and is summed at gradient sync.
TEST(DryRun, TiedEmbeddingsWithContextParallel) {
  ModelConfig c = tiny();
  c.tie_word_embeddings = true;
  Strategy s;
  s.pipelines = {pipeline(1, 2, {stage({0, 1, 2, 3}, 0, 1, 2), stage({4, 5, 6, 7}, 2, 3, 2)})};
  const auto all = dry_run(compile_plan(c, s, 8), Topology::uniform(8));
  EXPECT_EQ(kind_on(find(all, "backward.lm_head.weight"), 4), CommKind::kSend);
  EXPECT_EQ(kind_on(find(all, "grad.model.embed_tokens.weight"), 0), CommKind::kAllReduce);
}

TEST(PlanJson, RoundTripsAndDryRunsTheSame) {
  const AnnotationPlan plan = compile_plan(tiny(), hetero(true), 8);
  const AnnotationPlan back = plan_from_json(to_json(plan));
  EXPECT_EQ(back.tensors, plan.tensors);
  EXPECT_EQ(back.optimizer_states, plan.optimizer_states);
  EXPECT_EQ(back.bindings, plan.bindings);
  EXPECT_EQ(back.world_size, 8);
  EXPECT_EQ(dry_run(back, Topology::uniform(8)).size(), dry_run(plan, Topology::uniform(8)).size());
}

void expect_plan_error(nlohmann::json j, const std::string& fragment) {
  try {
    plan_from_json(j);
    ADD_FAILURE() << "accepted a plan that should fail with: " << fragment;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(PlanJson, RejectsMalformedPlans) {
  const nlohmann::json good = to_json(compile_plan(tiny(), hetero(), 8));
  nlohmann::json j = good;
  j["tensors"]["model.layers.9.input"] = j["tensors"]["model.layers.0.input"];
  expect_plan_error(j, "not a leaf or Reshard point");
  j = good;
  j["tensors"]["input_ids"]["subgroups"][0]["ranks"] = {0, 8};
  expect_plan_error(j, "outside the world");
  j = good;
  j["tensors"]["model.norm.weight"]["hdim"] = -2;
  expect_plan_error(j, "parameter");
  j = good;
  j["format"] = "something else";
  expect_plan_error(j, "format");
  j = good;
  j["extra"] = 1;
  expect_plan_error(j, "unknown field 'extra'");
  j = good;
  j["world_size"] = 1000000000;
  expect_plan_error(j, "field 'world_size' 1000000000 is above the limit of 1048576 ranks");
  j = good;
  j["tensors"].erase("targets");
  try {
    dry_run(plan_from_json(j), Topology::uniform(8));
    ADD_FAILURE() << "a plan without targets dry-ran";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("targets"), std::string::npos) << e.what();
  }
}

// A world of 64 ranks and an 80-layer model: two pipelines of 8 TP4 stages
// (10 layers each) on 32 ranks each. Only annotations and boxes are handled,
// so the big shapes cost nothing.
TEST(DryRun, SixtyFourRanksEightyLayers) {
  ModelConfig c = tiny(80);
  c.hidden_size = 8192;
  c.intermediate_size = 28672;
  c.num_attention_heads = 64;
  c.num_key_value_heads = 8;
  c.vocab_size = 32000;
  c.max_position_embeddings = 4096;
  Strategy s;
  for (int p = 0; p < 2; ++p) {
    std::vector<Stage> stages;
    for (int k = 0; k < 8; ++k) {
      const int base = p * 32 + k * 4;
      stages.push_back(stage({base, base + 1, base + 2, base + 3}, k * 10, k * 10 + 9));
    }
    s.pipelines.push_back(pipeline(1, 8, stages));
  }
  const auto all = dry_run(compile_plan(c, s, 64), Topology::uniform(64));
  std::set<std::string> phases;
  for (const auto& r : all) phases.insert(r.phase);
  EXPECT_EQ(phases, (std::set<std::string>{"forward", "backward", "grad_sync"}));
  EXPECT_GT(all.size(), 80u * 6);
}

}  // namespace
}  // namespace hspmd
