// Annotation deduction of the model ops (embedding, norms, RoPE, attention,
// cross-entropy), constants, Reshards and whole annotated backward graphs.
#include <gtest/gtest.h>

#include "hspmd/models/model.h"
#include "hspmd/ops/autodiff.h"
#include "hspmd/ops/ops.h"
#include "deduce/deduce_test_util.h"

namespace hspmd {
namespace {

using namespace deduce_test;

// ---- model ops ----

TEST(DeduceEmbedding, VocabHiddenAndTokenSplits) {
  Graph g;
  Tensor w = g.parameter("w", {16, 4});
  Tensor ids = g.placeholder("ids", {B, S}, DType::I32);
  Tensor y = ops::embedding(w, ids);
  const Annotation dup = on({0, 1}, {{kDup, 2}}, {kDup});
  EXPECT_EQ(deduce(g, {{"w", on({0, 1}, {{0, 2}}, {0})}, {"ids", dup}}, 2).of(y),
            on({0, 1}, {{kP, 2}}, {kP}));
  EXPECT_EQ(deduce(g, {{"w", on({0, 1}, {{1, 2}}, {1})}, {"ids", dup}}, 2).of(y),
            on({0, 1}, {{2, 2}}, {2}));
  EXPECT_EQ(deduce(g, {{"w", dup}, {"ids", on({0, 1}, {{0, 2}}, {0})}}, 2).of(y),
            on({0, 1}, {{0, 2}}, {0}));
}

TEST(DeduceEmbedding, GradientIsPartialOverTokensAndSplitLikeTheVocab) {
  Graph g;
  Tensor w = g.parameter("w", {16, 4});
  Tensor ids = g.placeholder("ids", {B, S}, DType::I32);
  Tensor y = ops::reshard(ops::embedding(w, ids), "emb.out");
  Tensor dw = gradients(ops::reduce_sum(y), {w})[0];
  // DP 2 (slow digit) x vocab-parallel 2 (fast digit)
  Plan plan{{"w", on({0, 1, 2, 3}, {{kDup, 2}, {0, 2}}, {kDup, 0})},
            {"ids", on({0, 1, 2, 3}, {{0, 2}, {kDup, 2}}, {0, kDup})},
            {"emb.out", on({0, 1, 2, 3}, {{0, 2}, {kDup, 2}}, {0, kDup})}};
  AnnotatedGraph ag = deduce(g, plan, 4);
  EXPECT_EQ(ag.of(dw), on({0, 1, 2, 3}, {{kP, 2}, {0, 2}}, {kP, 0}));
}

TEST(DeduceNorm, HiddenDimMustBeWholeAndNoPartial) {
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 4}, DType::F32);
  Tensor w = g.parameter("w", {4});
  Tensor y = ops::rms_norm(x, w, 1e-6f);
  const Annotation dup = on({0, 1}, {{kDup, 2}}, {kDup});
  EXPECT_EQ(deduce(g, {{"x", on({0, 1}, {{1, 2}}, {1})}, {"w", dup}}, 2).of(y),
            on({0, 1}, {{1, 2}}, {1}));
  expect_error(
      g, {{"x", on({0, 1}, {{2, 2}}, {2})}, {"w", on({0, 1}, {{0, 2}}, {0})}}, 2,
      {"op 'rms_norm' (node 2): input 0 (x) is split along dim 2", "rms_norm normalizes over it"});
  expect_error(g, {{"x", on({0, 1}, {{kP, 2}}, {kP})}, {"w", dup}}, 2,
               {"input 0 is partial; insert a Reshard to reduce it first"});
}

TEST(DeduceNorm, WeightGradientIsPartialOverTokenSplits) {
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 4}, DType::F32);
  Tensor w = g.parameter("w", {4});
  std::vector<Tensor> grads = gradients(ops::reduce_sum(ops::rms_norm(x, w, 1e-6f)), {x, w});
  AnnotatedGraph ag =
      deduce(g, {{"x", on({0, 1}, {{0, 2}}, {0})}, {"w", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2);
  EXPECT_EQ(ag.of(grads[0]), on({0, 1}, {{0, 2}}, {0}));
  EXPECT_EQ(ag.of(grads[1]), on({0, 1}, {{kP, 2}}, {kP}));
  EXPECT_EQ(find_node(g, "rms_norm_grad").op->type(), "rms_norm_grad");
}

TEST(DeduceRope, PositionsFollowTheTokenSplits) {
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 4, 2}, DType::F32);
  Tensor pos = g.placeholder("pos", {B, S}, DType::I32);
  Tensor y = ops::rope(x, pos, 10000.0f);
  AnnotatedGraph ag =
      deduce(g, {{"x", on({0, 1}, {{1, 2}}, {1})}, {"pos", on({0, 1}, {{1, 2}}, {1})}}, 2);
  EXPECT_EQ(ag.of(y), on({0, 1}, {{1, 2}}, {1}));
  AnnotatedGraph heads =
      deduce(g, {{"x", on({0, 1}, {{2, 2}}, {2})}, {"pos", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2);
  EXPECT_EQ(heads.of(y), on({0, 1}, {{2, 2}}, {2}));
  AnnotatedGraph partial =
      deduce(g, {{"x", on({0, 1}, {{kP, 2}}, {kP})}, {"pos", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2);
  EXPECT_EQ(partial.of(y), on({0, 1}, {{kP, 2}}, {kP}));
  expect_error(g, {{"x", on({0, 1}, {{1, 2}}, {1})}, {"pos", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2,
               {"input 0 (x) splits dim 1 by 2 but input 1 (positions) splits dim 1 by 1"});
  expect_error(g, {{"x", on({0, 1}, {{3, 2}}, {3})}, {"pos", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2,
               {"rope rotates pairs"});
}

struct AttentionGraph {
  explicit AttentionGraph(bool cp) {
    out = ops::attention(q, k, k, Tensor(), 0.5f, cp);
    lse = Tensor(&g, out.node_id(), 1);
  }
  Graph g;
  Tensor q = g.placeholder("q", {B, S, 4, 2}, DType::F32);
  Tensor k = g.placeholder("k", {B, S, 2, 2}, DType::F32);  // GQA: 2 kv heads for 4 query heads
  Tensor out, lse;
};

TEST(DeduceAttention, HeadsSplitConsistentlyAndBatchPasses) {
  AttentionGraph m(false);
  AnnotatedGraph ag =
      deduce(m.g, {{"q", on({0, 1}, {{2, 2}}, {2})}, {"k", on({0, 1}, {{2, 2}}, {2})}}, 2);
  EXPECT_EQ(ag.of(m.out), on({0, 1}, {{2, 2}}, {2}));
  EXPECT_EQ(ag.of(m.lse), on({0, 1}, {{1, 2}}, {1}));
  AnnotatedGraph dp =
      deduce(m.g, {{"q", on({0, 1}, {{0, 2}}, {0})}, {"k", on({0, 1}, {{0, 2}}, {0})}}, 2);
  EXPECT_EQ(dp.of(m.lse), on({0, 1}, {{0, 2}}, {0}));
  expect_error(m.g, {{"q", on({0, 1}, {{2, 2}}, {2})}, {"k", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2,
               {"input 0 (q) splits dim 2 by 2 but input 1 (k) splits dim 2 by 1"});
  expect_error(m.g, {{"q", on({0, 1}, {{3, 2}}, {3})}, {"k", on({0, 1}, {{3, 2}}, {3})}}, 2,
               {"attention contracts the head dim"});
  expect_error(m.g, {{"q", on({0, 1}, {{kP, 2}}, {kP})}, {"k", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2,
               {"input 0 is partial"});
}

TEST(DeduceAttention, SequenceSplitOnlyWithContextParallel) {
  const Annotation seq = on({0, 1}, {{1, 2}}, {1});
  AttentionGraph plain(false);
  expect_error(plain.g, {{"q", seq}, {"k", seq}}, 2, {"context_parallel"});
  AttentionGraph cp(true);
  AnnotatedGraph ag = deduce(cp.g, {{"q", seq}, {"k", seq}}, 2);
  EXPECT_EQ(ag.of(cp.out), seq);
  EXPECT_EQ(ag.of(cp.lse), on({0, 1}, {{2, 2}}, {2}));
}

TEST(DeduceAttention, GradientFollowsTheForward) {
  AttentionGraph m(true);
  std::vector<Tensor> grads = gradients(ops::reduce_sum(m.out), {m.q, m.k});
  const Annotation a = on({0, 1, 2, 3}, {{1, 2}, {2, 2}}, {1, 2});
  AnnotatedGraph ag = deduce(m.g, {{"q", a}, {"k", a}}, 4);
  EXPECT_EQ(ag.of(grads[0]), a);
  EXPECT_EQ(ag.of(grads[1]), a);
}

struct CrossEntropyGraph {
  Graph g;
  Tensor logits = g.placeholder("logits", {B, S, 8}, DType::F32);
  Tensor targets = g.placeholder("targets", {B, S}, DType::I32);
  Tensor norm = g.placeholder("norm", {}, DType::F32);
  Tensor loss = ops::cross_entropy(logits, targets, norm);
  Tensor lse = Tensor(&g, loss.node_id(), 1);
};

TEST(DeduceCrossEntropy, TokenSplitsMakeTheLossPartial) {
  CrossEntropyGraph m;
  const Annotation batch = on({0, 1}, {{0, 2}}, {0});
  AnnotatedGraph ag = deduce(
      m.g, {{"logits", batch}, {"targets", batch}, {"norm", on({0, 1}, {{kDup, 2}}, {kDup})}}, 2);
  EXPECT_EQ(ag.of(m.loss), on({0, 1}, {{kP, 2}}, {kP}));
  EXPECT_EQ(ag.of(m.lse), batch);
}

TEST(DeduceCrossEntropy, VocabParallelLossIsDupOverTheVocabGroup) {
  CrossEntropyGraph m;
  // DP 2 x vocab-parallel 2
  Plan plan{{"logits", on({0, 1, 2, 3}, {{0, 2}, {2, 2}}, {0, 2})},
            {"targets", on({0, 1, 2, 3}, {{0, 2}, {kDup, 2}}, {0, kDup})},
            {"norm", on({0, 1, 2, 3}, {{kDup, 4}}, {kDup})}};
  AnnotatedGraph ag = deduce(m.g, plan, 4);
  EXPECT_EQ(ag.of(m.loss), on({0, 1, 2, 3}, {{kP, 2}, {kDup, 2}}, {kP, kDup}));
  EXPECT_EQ(ag.of(m.lse), on({0, 1, 2, 3}, {{0, 2}, {kDup, 2}}, {0, kDup}));
  // d(loss) is dup everywhere; dlogits is split like the logits
  Tensor dlogits = gradients(m.loss, {m.logits})[0];
  AnnotatedGraph bw = deduce(m.g, plan, 4);
  EXPECT_EQ(bw.of(find_node(m.g, "fill_like").output(0)), on({0, 1, 2, 3}, {{kDup, 4}}, {kDup}));
  EXPECT_EQ(bw.of(dlogits), plan["logits"]);
}

TEST(DeduceCrossEntropy, TopTierTokensGiveAPartialLossAcrossSubgroups) {
  CrossEntropyGraph m;
  const Annotation top = hetero({sub({0, 1}, {{2, 2}}, {2}), sub({2})}, 0, {3, 1});
  Plan plan{{"logits", top},
            {"targets", hetero({sub({0, 1}, {{kDup, 2}}, {kDup}), sub({2})}, 0, {3, 1})},
            {"norm", hetero({sub({0, 1}, {{kDup, 2}}, {kDup}), sub({2})}, kDup)}};
  AnnotatedGraph ag = deduce(m.g, plan, 3);
  EXPECT_EQ(ag.of(m.loss), hetero({sub({0, 1}, {{kDup, 2}}, {kDup}), sub({2})}, kPartial));
  Tensor dlogits = gradients(m.loss, {m.logits})[0];
  EXPECT_EQ(deduce(m.g, plan, 3).of(dlogits), top);
}

TEST(DeduceCrossEntropy, Errors) {
  CrossEntropyGraph m;
  const Annotation dup = on({0, 1}, {{kDup, 2}}, {kDup});
  expect_error(m.g, {{"logits", on({0, 1}, {{kP, 2}}, {kP})}, {"targets", dup}, {"norm", dup}}, 2,
               {"op 'cross_entropy' (node 3): input 0 is partial"});
  expect_error(m.g, {{"logits", dup}, {"targets", dup}, {"norm", on({0, 1}, {{kP, 2}}, {kP})}}, 2,
               {"input 2 is partial"});
  expect_error(m.g, {{"logits", on({0, 1}, {{0, 2}}, {0})}, {"targets", dup}, {"norm", dup}}, 2,
               {"input 0 (logits) splits dim 0 by 2 but input 1 (targets) splits dim 0 by 1"});
  const Annotation top_dup = hetero({sub({0}), sub({1})}, kDup);
  expect_error(
      m.g, {{"logits", hetero({sub({0}), sub({1})}, 2)}, {"targets", top_dup}, {"norm", top_dup}},
      2, {"across subgroups, but the op reduces over it only inside a subgroup"});
}

// ---- constants ----

TEST(DeduceFill, FillLikeTurnsPartialIntoDup) {
  Graph g;
  Tensor x = g.placeholder("x", {}, DType::F32);
  Tensor one = ops::fill_like(x, 1.0f);
  EXPECT_EQ(deduce(g, {{"x", on({0, 1, 2, 3}, {{kP, 2}, {kDup, 2}}, {kP, kDup})}}, 4).of(one),
            on({0, 1, 2, 3}, {{kDup, 4}}, {kDup}));
  EXPECT_EQ(
      deduce(g, {{"x", hetero({sub({0, 1}, {{kP, 2}}, {kP}), sub({2})}, kPartial)}}, 3).of(one),
      hetero({sub({0, 1}, {{kDup, 2}}, {kDup}), sub({2})}, kDup));
  Graph h;
  Tensor y = h.placeholder("y", {B, 4}, DType::F32);
  ops::fill_like(y, 0.0f);
  expect_error(h,
               {{"y", on({0, 1, 2, 3, 4, 5, 6, 7}, {{kP, 2}, {0, 2}, {kDup, 2}}, {kP, 0, kDup})}},
               8, {"op 'fill_like'", "not adjacent"});
}

TEST(DeduceFill, FillNeedsANameInThePlan) {
  Graph g;
  ops::fill(g, {2}, 1.0f);
  expect_error(g, {}, 1, {"op 'fill' (node 0)", "use fill_like"});
  Graph h;
  Tensor c = ops::fill(h, {2}, 1.0f, "ones");
  EXPECT_EQ(deduce(h, {{"ones", on({0})}}, 1).of(c), on({0}));
}

// ---- reshards ----

TEST(DeduceReshard, NamedFromPlanUnnamedIdentity) {
  Graph g;
  Tensor x = g.placeholder("x", {B, 4}, DType::F32);
  Tensor same = ops::reshard(x);
  Tensor moved = ops::reshard(x, "moved");
  const Annotation there = on({2, 3}, {{0, 2}}, {0});
  AnnotatedGraph ag = deduce(g, {{"x", on({0, 1}, {{kDup, 2}}, {kDup})}, {"moved", there}}, 4);
  EXPECT_EQ(ag.of(same), on({0, 1}, {{kDup, 2}}, {kDup}));
  EXPECT_EQ(ag.of(moved), there);
  expect_error(g, {{"x", on({0})}}, 4, {"[deduce] tensor 'moved' has no annotation in the plan"});
  expect_error(g, {{"x", on({0})}, {"moved", on({0}, {{3, 1}})}}, 4,
               {"[annotation] tensor 'moved'"});
}

TEST(DeduceReshard, GradientOfAReshardMirrorsTheForwardInput) {
  Graph g;
  Tensor x = g.placeholder("x", {B, 4}, DType::F32);
  Tensor w = g.parameter("w", {4, 4});
  Tensor y = ops::linear(x, w);  // row parallel: partial
  Tensor r = ops::reshard(y, "reduced");
  Tensor dx = gradients(ops::reduce_sum(ops::mul(r, r)), {x})[0];
  const Node& mirror = find_node(g, "reshard", r.node_id());
  EXPECT_EQ(mirror.name, "backward.reduced");
  EXPECT_EQ(ops::reshard_mirror_of(mirror), r.node_id());
  EXPECT_EQ(ops::reshard_mirror_of(r.node()), -1);
  Plan plan{{"x", on({0, 1}, {{1, 2}}, {1})},
            {"w", on({0, 1}, {{1, 2}}, {1})},
            {"reduced", on({0, 1}, {{kDup, 2}}, {kDup})}};
  AnnotatedGraph ag = deduce(g, plan, 2);
  EXPECT_EQ(ag.of(y), on({0, 1}, {{kP, 2}}, {kP}));
  // partial forward input -> the full gradient, dup
  EXPECT_EQ(ag.of(mirror.output(0)), on({0, 1}, {{kDup, 2}}, {kDup}));
  EXPECT_EQ(ag.of(dx), plan["x"]);
}

TEST(DeduceReshard, MirrorKeepsPartialSumsAcrossPipelines) {
  Graph g;
  Tensor x = g.placeholder("x", {B, 4}, DType::F32);
  Tensor w = g.parameter("w", {4, 4});
  Tensor wr = ops::reshard(w, "w.use");
  Tensor dw = gradients(ops::reduce_sum(ops::matmul(x, wr)), {w})[0];
  const Annotation w_ann = hetero({sub({0}), sub({1})}, kDup);
  Plan plan{{"x", hetero({sub({0}), sub({1})}, 0, {3, 1})}, {"w", w_ann}, {"w.use", w_ann}};
  AnnotatedGraph ag = deduce(g, plan, 2);
  // the weight gradient of each pipeline is a partial sum: it stays one
  EXPECT_EQ(ag.of(dw), hetero({sub({0}), sub({1})}, kPartial));
  EXPECT_EQ(ops::reshard_mirror_of(dw.node()), wr.node_id());
}

// ---- whole graphs ----

// Megatron MLP over 4 ranks: data parallel 2 (slow digit) x tensor parallel 2.
TEST(DeduceGradients, TensorParallelMlp) {
  Graph g;
  Tensor x = g.placeholder("x", {B, S, 4}, DType::F32);
  Tensor wn = g.parameter("norm", {4});
  Tensor w1 = g.parameter("gate", {8, 4});
  Tensor w3 = g.parameter("up", {8, 4});
  Tensor w2 = g.parameter("down", {4, 8});
  Tensor h = ops::reshard(ops::rms_norm(x, wn, 1e-6f), "mlp.input");
  Tensor act = ops::swiglu(ops::linear(h, w1), ops::linear(h, w3));
  Tensor down = ops::linear(act, w2);
  Tensor out = ops::reshard(down, "mlp.output");
  Tensor loss = ops::reduce_sum(out);
  const int forward_nodes = g.num_nodes();
  std::vector<Tensor> grads = gradients(loss, {wn, w1, w3, w2, x});

  const std::vector<int> ranks = {0, 1, 2, 3};
  const Annotation tokens = on(ranks, {{0, 2}, {kDup, 2}}, {0, kDup});
  Plan plan{{"x", tokens},
            {"norm", on(ranks, {{kDup, 4}}, {kDup})},
            {"gate", on(ranks, {{kDup, 2}, {0, 2}}, {kDup, 0})},
            {"up", on(ranks, {{kDup, 2}, {0, 2}}, {kDup, 0})},
            {"down", on(ranks, {{kDup, 2}, {1, 2}}, {kDup, 1})},
            {"mlp.input", tokens},
            {"mlp.output", tokens}};
  AnnotatedGraph ag = deduce(g, plan, 4);
  EXPECT_EQ(ag.of(act), on(ranks, {{0, 2}, {2, 2}}, {0, 2}));
  EXPECT_EQ(ag.of(down), on(ranks, {{0, 2}, {kP, 2}}, {0, kP}));
  EXPECT_EQ(ag.of(loss), on(ranks, {{kP, 2}, {kDup, 2}}, {kP, kDup}));

  // weight gradients: partial over the data-parallel replicas, split like the weights
  EXPECT_EQ(ag.of(grads[0]), on(ranks, {{kP, 2}, {kDup, 2}}, {kP, kDup}));
  EXPECT_EQ(ag.of(grads[1]), on(ranks, {{kP, 2}, {0, 2}}, {kP, 0}));
  EXPECT_EQ(ag.of(grads[2]), on(ranks, {{kP, 2}, {0, 2}}, {kP, 0}));
  EXPECT_EQ(ag.of(grads[3]), on(ranks, {{kP, 2}, {1, 2}}, {kP, 1}));
  EXPECT_EQ(ag.of(grads[4]), tokens);

  // the backward of the reshard after the norm is a mirror: it all-reduces
  // the partial gradient of the column-parallel linears back to the norm's layout
  int mirrors = 0;
  for (int id = forward_nodes; id < g.num_nodes(); ++id) {
    const Node& n = g.node(id);
    if (!ops::is_reshard(n)) continue;
    ++mirrors;
    ASSERT_GE(ops::reshard_mirror_of(n), 0);
    if (n.name != "backward.mlp.input") continue;
    EXPECT_EQ(ag.of(n.inputs[0]), on(ranks, {{0, 2}, {kP, 2}}, {0, kP}));
    EXPECT_EQ(ag.of(n.output(0)), tokens);
  }
  EXPECT_EQ(mirrors, 2);
}

ModelConfig tiny_llama() {
  return ModelConfig{.vocab_size = 32,
                     .hidden_size = 16,
                     .intermediate_size = 32,
                     .num_hidden_layers = 2,
                     .num_attention_heads = 4,
                     .num_key_value_heads = 2};
}

// Data parallel over 2 ranks needs no Reshard: the whole training graph
// deduces, and every parameter gradient is a partial sum over the replicas.
TEST(DeduceGradients, DataParallelLlama) {
  const ModelConfig c = tiny_llama();
  ModelGraph m = build_model(c);
  const Annotation batch = on({0, 1}, {{0, 2}}, {0});
  const Annotation dup = on({0, 1}, {{kDup, 2}}, {kDup});
  Plan plan{{"input_ids", batch}, {"targets", batch}, {"positions", batch}, {"normalizer", dup}};
  for (const auto& name : m.names) plan[name] = dup;
  AnnotatedGraph ag = deduce(*m.graph, plan, 2);
  EXPECT_EQ(ag.of(m.loss), on({0, 1}, {{kP, 2}}, {kP}));
  for (size_t i = 0; i < m.grads.size(); ++i)
    EXPECT_EQ(ag.of(m.grads[i]), on({0, 1}, {{kP, 2}}, {kP})) << m.names[i];
}

// On one device everything is trivially annotated.
TEST(DeduceGradients, SingleDeviceLlama) {
  ModelGraph m = build_model(tiny_llama(), true);
  Plan plan{{"input_ids", on({0})},
            {"targets", on({0})},
            {"positions", on({0})},
            {"normalizer", on({0})}};
  for (const auto& name : m.names) plan[name] = on({0});
  AnnotatedGraph ag = deduce(*m.graph, plan, 1);
  for (int id = 0; id < m.graph->num_nodes(); ++id)
    for (int i = 0; i < static_cast<int>(m.graph->node(id).outputs.size()); ++i)
      EXPECT_EQ(ag.of(Tensor(m.graph.get(), id, i)), on({0})) << "node " << id;
}

}  // namespace
}  // namespace hspmd
