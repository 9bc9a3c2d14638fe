// ExecGraph under mpirun (4 ranks): one executable graph runs micro-batches
// of different sizes and lengths (checked against the single-process graph
// executor on the same weights and data), activation recomputation gives
// bitwise the same loss and raw gradients with less activation memory, and a
// feed that disagrees with the bindings is a one-line error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "comm/mpi_test_main.h"
#include "hspmd/core/device.h"
#include "hspmd/core/error.h"
#include "hspmd/exec/exec_graph.h"
#include "hspmd/exec/grad_sync.h"
#include "hspmd/graph/executor.h"
#include "hspmd/models/model.h"
#include "hspmd/plan/plan.h"
#include "plan/plan_test_util.h"

namespace hspmd {
namespace {

using testing::stage;
using testing::test_world;

constexpr int kWorld = 4;

ModelConfig model(bool tied) {
  ModelConfig c = testing::tiny_config(2);
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 32;
  c.tie_word_embeddings = tied;
  return c;
}

Pipeline pipeline(int micro_batch_size, std::vector<Stage> stages) {
  Pipeline p;
  p.micro_batch_size = micro_batch_size;
  p.stages = std::move(stages);
  return p;
}

// Pipeline 0: TP2 (ranks 0, 1) for layer 0, then rank 2 for layer 1;
// pipeline 1: rank 3 alone. B is cut 1:1 between them.
Strategy hetero_pipelines() {
  Strategy s;
  s.pipelines = {pipeline(1, {stage({0, 1}, 0, 0), stage({2}, 1, 1)}),
                 pipeline(1, {stage({3}, 0, 1)})};
  return s;
}

// One pipeline, two TP2 stages: vocab-parallel embedding and loss, and the
// tied embedding travelling to the last stage as lm_head.weight.
Strategy tp2_pp2() {
  Strategy s;
  s.pipelines = {pipeline(2, {stage({0, 1}, 0, 0), stage({2, 3}, 1, 1)})};
  return s;
}

// The whole batch of one micro-batch step, as the single process sees it.
struct Batch {
  Bindings bindings;
  ValueMap arrays;  // input_ids, targets, positions, normalizer
};

Batch make_batch(int64_t b, int64_t s, int64_t vocab, uint32_t seed) {
  std::vector<int32_t> ids(b * s), targets(b * s), positions(b * s);
  uint32_t x = seed * 2654435761u + 12345u;
  for (int64_t i = 0; i < b * s; ++i) {
    x = x * 1664525u + 1013904223u;
    ids[i] = static_cast<int32_t>((x >> 8) % vocab);
    x = x * 1664525u + 1013904223u;
    targets[i] = static_cast<int32_t>((x >> 8) % vocab);
    positions[i] = static_cast<int32_t>(i % s);
  }
  NDArray norm = NDArray::empty({}, DType::F32);
  norm.fill(static_cast<float>(b * s));
  return {{{"B", b}, {"S", s}},
          {{"input_ids", NDArray::from_vector_i32({b, s}, ids)},
           {"targets", NDArray::from_vector_i32({b, s}, targets)},
           {"positions", NDArray::from_vector_i32({b, s}, positions)},
           {"normalizer", norm}}};
}

// A rank's ExecGraph with everything it refers to, and the full weights.
struct Rank {
  ModelConfig config;
  AnnotationPlan plan;
  Topology topology = Topology::uniform(kWorld);
  std::unique_ptr<ExecGraph> graph;
  std::map<std::string, NDArray> weights;

  Rank(const ModelConfig& c, const Strategy& s, Precision precision = {}) : config(c) {
    CompileOptions o;
    o.seq_len = 16;
    o.precision = precision;
    plan = compile_plan(config, s, kWorld, o);
    int64_t b = 0;
    for (const Pipeline& p : s.pipelines) b += p.micro_batch_size;
    graph = std::make_unique<ExecGraph>(plan, topology, test_world().rank(),
                                        Bindings{{"B", b}, {"S", 16}});
    weights = init_model_parameters(config, 7);
  }

  // This rank's local boxes of the weights and of the batch.
  ValueMap feeds(const Batch& batch) const {
    ValueMap v;
    for (const auto& [name, full] : weights)
      if (auto box = graph->local_box(name, full.shape())) v[name] = box_slice(full, *box);
    for (const auto& [name, full] : batch.arrays)
      if (auto box = graph->local_box(name, full.shape())) v[name] = box_slice(full, *box);
    return v;
  }
};

struct Reference {
  double loss = 0;
  std::map<std::string, NDArray> grads;
};

// The single-process graph executor on the whole batch.
Reference single_process(const ModelConfig& config, const std::map<std::string, NDArray>& weights,
                         const Batch& batch) {
  ModelGraph m = build_model(config);
  std::vector<Tensor> fetches = {m.loss};
  fetches.insert(fetches.end(), m.grads.begin(), m.grads.end());
  ValueMap values(weights.begin(), weights.end());
  for (const auto& [name, a] : batch.arrays) values[name] = a;
  const std::vector<NDArray> out = Executor(*m.graph, fetches).run(values);
  Reference r;
  r.loss = out[0].data<float>()[0];
  for (size_t i = 0; i < m.names.size(); ++i) r.grads[m.names[i]] = out[i + 1];
  return r;
}

float sum_over_ranks(float v) {
  test_world().all_reduce(&v, 1);
  return v;
}

// max |a - b| / max |b|.
double normalized_error(const NDArray& a, const NDArray& b) {
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a.data<float>()[i]) - b.data<float>()[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b.data<float>()[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

const std::vector<std::pair<int64_t, int64_t>> kShapes = {{2, 16}, {2, 32}, {2, 8}, {4, 8}};

// Every (B, S) through one ExecGraph: loss and synced gradients equal the
// single process's on the same batch.
void check_against_single_process(const Rank& r) {
  const int rank = test_world().rank();
  for (size_t k = 0; k < kShapes.size(); ++k) {
    const auto [b, s] = kShapes[k];
    SCOPED_TRACE("B=" + std::to_string(b) + " S=" + std::to_string(s));
    const Batch batch = make_batch(b, s, r.config.vocab_size, static_cast<uint32_t>(k));
    const Reference ref = single_process(r.config, r.weights, batch);
    const ExecGraph::MicroBatch mb = r.graph->run_micro_batch(r.feeds(batch), test_world(), batch.bindings);
    const bool counts = mb.loss && is_representative(r.graph->loss_annotation(), rank);
    const double loss = sum_over_ranks(counts ? *mb.loss : 0.0f);
    EXPECT_LE(std::fabs(loss - ref.loss), 1e-5 * std::fabs(ref.loss)) << loss << " vs " << ref.loss;
    const auto synced = sync_gradients(*r.graph, grad_buckets(*r.graph), mb.raw_grads, test_world());
    EXPECT_FALSE(synced.empty());
    for (const auto& [name, g] : synced) {
      const NDArray& full = ref.grads.at(name);
      auto box = r.graph->local_box("grad." + name, full.shape());
      ASSERT_TRUE(box.has_value()) << name;
      EXPECT_LE(normalized_error(g, box_slice(full, *box)), 1e-5) << name;
    }
  }
}

TEST(ExecGraphShapes, MicroBatchesOfEverySizeMatchOneProcess) {
  const Rank r(model(false), hetero_pipelines());
  check_against_single_process(r);
}

TEST(ExecGraphShapes, TensorParallelStagesAndTiedEmbeddings) {
  const Rank r(model(true), tp2_pp2());
  check_against_single_process(r);
}

// A copy outside the allocator's ledger, so that keeping results does not
// count as activation memory.
std::vector<float> snapshot(const NDArray& a) {
  const NDArray f = a.dtype() == DType::F32 ? a : a.to(DType::F32);
  return std::vector<float>(f.data<float>(), f.data<float>() + f.numel());
}

// What a GPipe-like schedule (every forward, then every backward) leaves:
// each micro-batch's loss term and raw gradients, and the memory it took.
struct Run {
  std::vector<std::optional<float>> losses;
  std::vector<std::map<std::string, std::vector<float>>> raw_grads;
  size_t held_after_forwards = 0;  // bytes above the baseline
  size_t peak = 0;                 // bytes above the baseline
};

Run run_all(const Rank& r, bool recompute) {
  std::vector<Batch> batches;
  std::vector<ValueMap> feeds;
  for (size_t k = 0; k < kShapes.size(); ++k) {
    batches.push_back(make_batch(kShapes[k].first, kShapes[k].second, r.config.vocab_size,
                                 static_cast<uint32_t>(k)));
    feeds.push_back(r.feeds(batches.back()));
  }
  Allocator& memory = allocator_for(Device::cpu());
  const size_t base = memory.current_bytes();
  memory.reset_peak();
  r.graph->set_recompute(recompute);
  Run run;
  std::vector<ExecGraph::Activations> kept;
  for (size_t k = 0; k < feeds.size(); ++k)
    kept.push_back(r.graph->forward(feeds[k], test_world(), batches[k].bindings));
  run.held_after_forwards = memory.current_bytes() - base;
  for (auto& a : kept) {
    const ExecGraph::MicroBatch mb = r.graph->backward(std::move(a), test_world());
    run.losses.push_back(mb.loss);
    run.raw_grads.emplace_back();
    for (const auto& [name, g] : mb.raw_grads) run.raw_grads.back()[name] = snapshot(g);
  }
  run.peak = memory.peak_bytes() - base;
  r.graph->set_recompute(false);
  return run;
}

void check_recompute(const Rank& r) {
  const int rank = test_world().rank();
  const Run plain = run_all(r, false);
  const Run recomputed = run_all(r, true);
  ASSERT_EQ(plain.losses.size(), kShapes.size());
  ASSERT_EQ(recomputed.losses.size(), kShapes.size());
  for (size_t k = 0; k < kShapes.size(); ++k) {
    const auto& a = plain.losses[k];
    const auto& b = recomputed.losses[k];
    ASSERT_EQ(a.has_value(), b.has_value());
    if (a) {
      EXPECT_EQ(std::memcmp(&*a, &*b, sizeof(float)), 0) << *a << " vs " << *b;
    }
    EXPECT_FALSE(plain.raw_grads[k].empty());
    EXPECT_EQ(plain.raw_grads[k], recomputed.raw_grads[k]) << "micro-batch " << k;  // bitwise (no NaN)
  }
  EXPECT_LT(recomputed.held_after_forwards, plain.held_after_forwards);
  EXPECT_LT(recomputed.peak, plain.peak);
  std::ostringstream line;
  line << "[rank " << rank << "] activations held after " << kShapes.size()
       << " forwards: " << plain.held_after_forwards << " -> " << recomputed.held_after_forwards
       << " bytes; peak: " << plain.peak << " -> " << recomputed.peak << " bytes (recompute off -> on)\n";
  std::cout << line.str() << std::flush;
}

TEST(ExecGraphRecompute, BitwiseEqualWithLessMemory) {
  const Rank r(model(false), hetero_pipelines());
  check_recompute(r);
}

TEST(ExecGraphRecompute, TensorParallelStagesAndTiedEmbeddings) {
  const Rank r(model(true), tp2_pp2());
  check_recompute(r);
}

// Under mixed precision the bf16 copies of the weights are the step's
// pre-processing: inside a StepScope they are computed by the first
// micro-batch only, and the others reuse them, with bitwise the same results
// and less memory held across the micro-batches.
TEST(ExecGraphPreProcessing, WeightCastsRunOncePerStep) {
  const Rank r(model(true), tp2_pp2(), Precision{DType::BF16, DType::F32});
  int casts = 0;
  r.graph->set_op_observer([&](const Node& n, const OpWork&, double) { casts += n.op->type() == "cast"; });
  const ::hspmd::Run plain = run_all(r, false);
  const int per_micro_batch = casts;
  casts = 0;
  ::hspmd::Run scoped;
  {
    const ExecGraph::StepScope step(*r.graph);
    EXPECT_THROW(ExecGraph::StepScope again(*r.graph), InternalError);
    scoped = run_all(r, false);
  }
  const int in_scope = casts;
  casts = 0;
  r.graph->set_op_observer(nullptr);
  int weight_casts = 0;  // this rank's casts of parameters
  for (int id = 0; id < r.graph->model().graph->num_nodes(); ++id)
    weight_casts += r.graph->parameter_only(id) && r.graph->model().graph->node(id).op &&
                    r.graph->model().graph->node(id).op->type() == "cast";
  ASSERT_GT(weight_casts, 0);
  const int micro_batches = static_cast<int>(kShapes.size());
  EXPECT_EQ(in_scope, per_micro_batch - (micro_batches - 1) * weight_casts)
      << "casts per run without a scope " << per_micro_batch << ", weight casts " << weight_casts;
  EXPECT_EQ(plain.losses, scoped.losses);
  EXPECT_EQ(plain.raw_grads, scoped.raw_grads);  // bitwise
  EXPECT_LT(scoped.held_after_forwards, plain.held_after_forwards);
}

// Gradient buckets: under data parallelism every parameter's sync is one
// all-reduce of the whole gradient over the same four ranks, so they share
// one bucket, in the reverse of the model's order; a plan whose syncs differ
// (tensor-parallel stages, the tied embedding's send to the last stage)
// still lists each of this rank's syncs once, in that order, and fuses only
// all-reduces over one group.
TEST(ExecGraphGradBuckets, DataParallelSyncsShareOneBucket) {
  Strategy dp;
  for (int r = 0; r < kWorld; ++r) dp.pipelines.push_back(pipeline(1, {stage({r}, 0, 1)}));
  const Rank d(model(false), dp);
  const auto buckets = grad_buckets(*d.graph);
  ASSERT_EQ(buckets.size(), 1u);
  EXPECT_EQ(buckets[0].group, (std::vector<int>{0, 1, 2, 3}));
  const std::vector<std::string>& names = d.graph->model().names;
  EXPECT_EQ(buckets[0].params, std::vector<std::string>(names.rbegin(), names.rend()));
  int64_t elements = 0;
  for (const std::string& n : names) elements += d.weights.at(n).numel();
  EXPECT_EQ(buckets[0].elements, elements);
  EXPECT_FALSE(buckets[0].scatter);
  // ZeRO: every sync a reduce-scatter into the same pieces' layout: one
  // reduce-scatter bucket.
  Strategy zero = dp;
  zero.zero = true;
  const Rank z(model(false), zero);
  const auto scattered = grad_buckets(*z.graph);
  ASSERT_EQ(scattered.size(), 1u);
  EXPECT_TRUE(scattered[0].scatter);
  EXPECT_EQ(scattered[0].group, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(scattered[0].params, buckets[0].params);

  for (bool tied : {false, true}) {
    const Rank r(model(tied), tp2_pp2());
    std::vector<std::string> order;
    for (const auto& b : grad_buckets(*r.graph)) {
      EXPECT_TRUE(b.group.empty() || b.params.size() > 1);  // a bucket of one runs its own resolution
      if (!b.group.empty())
        EXPECT_NE(std::find(b.group.begin(), b.group.end(), test_world().rank()), b.group.end());
      order.insert(order.end(), b.params.begin(), b.params.end());
    }
    std::vector<std::string> want;
    for (auto it = r.graph->model().names.rbegin(); it != r.graph->model().names.rend(); ++it)
      if (std::find(order.begin(), order.end(), *it) != order.end()) want.push_back(*it);
    EXPECT_EQ(order, want) << "tied " << tied;
    EXPECT_FALSE(order.empty());
  }
}

TEST(ExecGraphErrors, FeedDisagreeingWithTheBindings) {
  const Rank r(model(false), hetero_pipelines());
  const int rank = test_world().rank();
  const Batch batch = make_batch(2, 16, r.config.vocab_size, 0);
  std::string message;
  try {
    r.graph->forward(r.feeds(batch), test_world(), Bindings{{"B", 2}, {"S", 32}});
  } catch (const Error& e) {
    message = e.what();
  }
  // Every rank holds a [B, S] placeholder, so every rank fails before any
  // communication.
  const std::string prefix = "[exec] rank " + std::to_string(rank) + ": '";
  EXPECT_EQ(message.rfind(prefix, 0), 0u) << message;
  EXPECT_NE(message.find("' has local shape [1, 16] but the bindings give [1, 32]"), std::string::npos)
      << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  if (rank == 0) {
    EXPECT_EQ(message, "[exec] rank 0: 'input_ids' has local shape [1, 16] but the bindings give [1, 32]");
  }

  message.clear();
  try {
    r.graph->forward(r.feeds(batch), test_world(), Bindings{{"B", 2}});
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("symbol 'S' is not bound"), std::string::npos) << message;
  // The graph still runs afterwards.
  EXPECT_NO_THROW(r.graph->run_micro_batch(r.feeds(batch), test_world(), batch.bindings));
}

}  // namespace
}  // namespace hspmd
