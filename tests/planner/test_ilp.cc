// The planner's two integer programs (docs/ilp.md): hand-checked optima,
// memory infeasibility and its explanation, CBC and the exact fast path
// against brute force on random instances, bounds, time limit, silence and
// the input errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "hspmd/core/error.h"
#include "hspmd/planner/ilp.h"

namespace hspmd {
namespace {

constexpr IlpSolver kSolvers[] = {IlpSolver::kCbc, IlpSolver::kExact};

LayerStage layer_stage(double time_per_layer, double fixed_time = 0, int min_layers = 1) {
  LayerStage s;
  s.time_per_layer = time_per_layer;
  s.fixed_time = fixed_time;
  s.min_layers = min_layers;
  return s;
}

LayerStage with_memory(LayerStage s, double per_layer, double fixed, double capacity) {
  s.memory_per_layer = per_layer;
  s.fixed_memory = fixed;
  s.memory_capacity = capacity;
  return s;
}

MicroBatchPipeline pipeline(int size, double per_micro_batch, double fixed = 0, int min = 1, int max = 0) {
  MicroBatchPipeline p;
  p.micro_batch_size = size;
  p.time_per_micro_batch = per_micro_batch;
  p.fixed_time = fixed;
  p.min_micro_batches = min;
  p.max_micro_batches = max;
  return p;
}

// Every constraint of the first program holds and max_stage_time is the max.
void expect_valid(const std::vector<LayerStage>& stages, int num_layers, const LayerAssignment& a) {
  ASSERT_TRUE(a.feasible);
  ASSERT_EQ(a.layers.size(), stages.size());
  int sum = 0;
  double t = 0;
  for (size_t k = 0; k < stages.size(); ++k) {
    const LayerStage& s = stages[k];
    EXPECT_GE(a.layers[k], s.min_layers) << "stage " << k;
    if (s.memory_capacity > 0) {
      EXPECT_LE(s.fixed_memory + s.memory_per_layer * a.layers[k], s.memory_capacity);
    }
    t = std::max(t, s.fixed_time + s.time_per_layer * a.layers[k]);
    sum += a.layers[k];
  }
  EXPECT_EQ(sum, num_layers);
  EXPECT_EQ(a.max_stage_time, t);
}

void expect_valid(const std::vector<MicroBatchPipeline>& pipelines, int global_batch, const MicroBatchAssignment& a) {
  ASSERT_TRUE(a.feasible);
  ASSERT_EQ(a.counts.size(), pipelines.size());
  int sum = 0;
  double t = 0;
  for (size_t k = 0; k < pipelines.size(); ++k) {
    const MicroBatchPipeline& p = pipelines[k];
    EXPECT_GE(a.counts[k], p.min_micro_batches) << "pipeline " << k;
    if (p.max_micro_batches > 0) {
      EXPECT_LE(a.counts[k], p.max_micro_batches) << "pipeline " << k;
    }
    t = std::max(t, p.fixed_time + p.time_per_micro_batch * a.counts[k]);
    sum += p.micro_batch_size * a.counts[k];
  }
  EXPECT_EQ(sum, global_batch);
  EXPECT_EQ(a.max_time, t);
}

bool same_optimum(double a, double b) { return std::abs(a - b) <= 1e-9 * std::max({1.0, std::abs(a), std::abs(b)}); }

// The typical planner instances of docs/ilp.md: 6 stages and 80 layers (first
// stage holds the embedding, last the head), 8 pipelines and a batch of 64.
std::vector<LayerStage> six_stages() {
  std::vector<LayerStage> stages;
  const double per_layer[] = {0.011, 0.012, 0.0105, 0.013, 0.0111, 0.0125};
  for (int k = 0; k < 6; ++k) stages.push_back(layer_stage(per_layer[k], k == 0 ? 0.02 : k == 5 ? 0.03 : 0.001));
  stages[3] = with_memory(stages[3], 1e9, 4e9, 2e10);  // at most 16 layers
  return stages;
}

std::vector<MicroBatchPipeline> eight_pipelines() {
  std::vector<MicroBatchPipeline> pipelines;
  for (int p = 0; p < 8; ++p)
    pipelines.push_back(pipeline(p < 4 ? 1 : 2, 0.05 + 0.013 * p, 0.2 + 0.05 * (p % 3), 2, p == 7 ? 4 : 0));
  return pipelines;
}

// ---------------------------------------------------------------------------
// Layers.

TEST(AssignLayers, HandCheckedOptima) {
  for (IlpSolver solver : kSolvers) {
    SCOPED_TRACE(solver == IlpSolver::kCbc ? "cbc" : "exact");
    // Equal stages split evenly.
    auto a = assign_layers({layer_stage(1), layer_stage(1)}, 8, 10, solver);
    EXPECT_EQ(a.layers, (std::vector<int>{4, 4}));
    EXPECT_EQ(a.max_stage_time, 4);
    EXPECT_TRUE(a.optimal);
    // The embedding's fixed time moves layers to the other stage: max(3 + x0, x1).
    a = assign_layers({layer_stage(1, 3), layer_stage(1)}, 9, 10, solver);
    EXPECT_EQ(a.layers, (std::vector<int>{3, 6}));
    EXPECT_EQ(a.max_stage_time, 6);
    // A stage twice as slow takes a third: max(x0, 2 x1).
    a = assign_layers({layer_stage(1), layer_stage(2)}, 9, 10, solver);
    EXPECT_EQ(a.layers, (std::vector<int>{6, 3}));
    EXPECT_EQ(a.max_stage_time, 6);
    // Memory caps stage 0 at 2 layers (4 + 3 * 2 <= 11 < 4 + 3 * 3).
    a = assign_layers({with_memory(layer_stage(1), 3, 4, 11), layer_stage(1)}, 8, 10, solver);
    EXPECT_EQ(a.layers, (std::vector<int>{2, 6}));
    EXPECT_EQ(a.max_stage_time, 6);
    // Exactly full: 0.7 * 3 fits in 0.7 * 3 bytes, though the quotient rounds to 2.999...
    a = assign_layers({with_memory(layer_stage(1), 0.7, 0, 0.7 * 3), layer_stage(1)}, 8, 10, solver);
    EXPECT_EQ(a.layers, (std::vector<int>{3, 5}));
    // min_layers binds on the slow stage: it would rather hold 0.
    a = assign_layers({layer_stage(1), layer_stage(10, 0, 2)}, 6, 10, solver);
    EXPECT_EQ(a.layers, (std::vector<int>{4, 2}));
    EXPECT_EQ(a.max_stage_time, 20);
    // min_layers = 0: a stage with only the head may hold no layer.
    a = assign_layers({layer_stage(1), layer_stage(1, 5, 0)}, 4, 10, solver);
    EXPECT_EQ(a.layers, (std::vector<int>{4, 0}));
    EXPECT_EQ(a.max_stage_time, 5);
    // One stage holds everything.
    a = assign_layers({layer_stage(0.5, 1)}, 5, 10, solver);
    EXPECT_EQ(a.layers, (std::vector<int>{5}));
    EXPECT_EQ(a.max_stage_time, 3.5);
  }
}

TEST(AssignLayers, StageThatCannotHoldItsMinimum) {
  // Stage 1 needs 10 + 4 = 14 bytes for its one layer and has 12; stage 2 is 1 byte short.
  const std::vector<LayerStage> stages = {layer_stage(1), with_memory(layer_stage(1), 4, 10, 12),
                                          with_memory(layer_stage(1), 4, 10, 13)};
  for (const LayerAssignment& a : {assign_layers(stages, 6), assign_layers(stages, 6, 10, IlpSolver::kExact),
                                   assign_layers_exhaustive(stages, 6)}) {
    EXPECT_FALSE(a.feasible);
    EXPECT_TRUE(a.layers.empty());
    EXPECT_EQ(a.worst_stage, 1);
    EXPECT_EQ(a.bytes_missing, 2);
  }
}

TEST(AssignLayers, TotalThatDoesNotFit) {
  // Each stage holds 3 layers (30 <= 35 < 40; 5 + 12 <= 17 < 21); 8 leaves 2 unplaced.
  // Stage 0 would need 50 - 35 = 15 more bytes for 5 layers, stage 1 25 - 17 = 8.
  const std::vector<LayerStage> stages = {with_memory(layer_stage(1), 10, 0, 35),
                                          with_memory(layer_stage(1), 4, 5, 17)};
  for (const LayerAssignment& a : {assign_layers(stages, 8), assign_layers(stages, 8, 10, IlpSolver::kExact),
                                   assign_layers_exhaustive(stages, 8)}) {
    EXPECT_FALSE(a.feasible);
    EXPECT_EQ(a.worst_stage, 1);
    EXPECT_EQ(a.bytes_missing, 8);
  }
  const LayerAssignment six = assign_layers(stages, 6);  // exactly full
  EXPECT_EQ(six.layers, (std::vector<int>{3, 3}));
}

// 200 random instances: CBC and the fast path reach the brute-force optimum.
TEST(AssignLayers, RandomInstancesMatchExhaustive) {
  std::mt19937 rng(20240611);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto real = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  int infeasible = 0;
  for (int trial = 0; trial < 200; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int num_stages = uniform(1, 5);
    const bool integral = trial % 3 == 0;  // small integer times: many ties
    std::vector<LayerStage> stages;
    int min_sum = 0;
    for (int k = 0; k < num_stages; ++k) {
      LayerStage s = integral ? layer_stage(uniform(0, 4), uniform(0, 6), uniform(0, 2))
                              : layer_stage(real(0.001, 0.02), real(0, 0.05), uniform(0, 2));
      if (uniform(0, 2) > 0) s = with_memory(s, uniform(1, 8) * 1e8, uniform(0, 4) * 1e9, 4e9 + uniform(0, 12) * 1e8 + 5e7);
      min_sum += s.min_layers;
      stages.push_back(s);
    }
    const int num_layers = std::max(min_sum, uniform(1, 16));
    const LayerAssignment ref = assign_layers_exhaustive(stages, num_layers);
    for (IlpSolver solver : kSolvers) {
      const LayerAssignment a = assign_layers(stages, num_layers, 10, solver);
      ASSERT_EQ(a.feasible, ref.feasible);
      if (!ref.feasible) {
        EXPECT_EQ(a.worst_stage, ref.worst_stage);
        EXPECT_EQ(a.bytes_missing, ref.bytes_missing);
        continue;
      }
      expect_valid(stages, num_layers, a);
      EXPECT_TRUE(a.optimal);
      EXPECT_TRUE(same_optimum(a.max_stage_time, ref.max_stage_time))
          << a.max_stage_time << " vs exhaustive " << ref.max_stage_time;
    }
    infeasible += !ref.feasible;
  }
  EXPECT_GT(infeasible, 5);  // the generator covers both outcomes
  EXPECT_LT(infeasible, 150);
}

// Instances too large to enumerate: CBC and the fast path agree.
TEST(AssignLayers, CbcAndExactAgreeOnPlannerSizes) {
  std::mt19937 rng(7);
  auto real = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  for (int trial = 0; trial < 40; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    std::vector<LayerStage> stages;
    const int num_stages = 2 + trial % 7;
    for (int k = 0; k < num_stages; ++k)
      stages.push_back(with_memory(layer_stage(real(0.005, 0.02), real(0, 0.04)), 1e9, real(1e9, 5e9), trial % 2 ? 3e10 : 0));
    const int num_layers = 24 + trial * 2;
    const LayerAssignment cbc = assign_layers(stages, num_layers);
    const LayerAssignment exact = assign_layers(stages, num_layers, 10, IlpSolver::kExact);
    ASSERT_EQ(cbc.feasible, exact.feasible);
    if (!cbc.feasible) continue;
    expect_valid(stages, num_layers, cbc);
    expect_valid(stages, num_layers, exact);
    EXPECT_TRUE(same_optimum(cbc.max_stage_time, exact.max_stage_time)) << cbc.max_stage_time << " vs " << exact.max_stage_time;
  }
  const auto stages = six_stages();
  const LayerAssignment cbc = assign_layers(stages, 80);
  const LayerAssignment exact = assign_layers(stages, 80, 10, IlpSolver::kExact);
  expect_valid(stages, 80, cbc);
  EXPECT_LE(cbc.layers[3], 16);
  EXPECT_TRUE(same_optimum(cbc.max_stage_time, exact.max_stage_time));
}

TEST(AssignLayers, DeterministicAndSilent) {
  const auto stages = six_stages();
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const LayerAssignment first = assign_layers(stages, 80);
  const LayerAssignment second = assign_layers(stages, 80);
  const LayerAssignment stopped = assign_layers(stages, 80, 1e-9);
  const std::string out = ::testing::internal::GetCapturedStdout();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(out, "");
  EXPECT_EQ(err, "");
  EXPECT_EQ(first.layers, second.layers);
  // A limit too short for a search: CBC's best so far or, before it has one,
  // the fast path's answer (optimal = false either way). Whether CBC gets to
  // an integer solution before it looks at the clock varies from run to run.
  expect_valid(stages, 80, stopped);
  EXPECT_GE(stopped.max_stage_time, first.max_stage_time * (1 - 1e-9));
  if (stopped.optimal) {
    EXPECT_TRUE(same_optimum(stopped.max_stage_time, first.max_stage_time));
  }
}

TEST(AssignLayers, InvalidInputThrows) {
  auto message = [](auto&& call) {
    try {
      call();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::vector<LayerStage> two = {layer_stage(1), layer_stage(1)};
  EXPECT_EQ(message([] { assign_layers({}, 4); }), "[ilp] assign_layers: no stages");
  EXPECT_EQ(message([] { assign_layers({layer_stage(-1)}, 4); }),
            "[ilp] stage 0: time_per_layer=-1 is negative or not finite");
  EXPECT_EQ(message([] { assign_layers({layer_stage(1), layer_stage(1, NAN)}, 4); }),
            "[ilp] stage 1: fixed_time=nan is negative or not finite");
  EXPECT_EQ(message([&] { assign_layers({layer_stage(1, 0, 3), layer_stage(1, 0, 2)}, 4); }),
            "[ilp] num_layers=4 is less than the sum of min_layers (5) over 2 stages");
  EXPECT_EQ(message([&] { assign_layers(two, 0); }), "[ilp] num_layers=0 is not positive");
  EXPECT_EQ(message([&] { assign_layers(two, 4, 0); }), "[ilp] time_limit_s=0 is not positive");
  EXPECT_EQ(message([] { assign_layers({layer_stage(1, 0, -1)}, 4); }), "[ilp] stage 0: min_layers=-1 is negative");
  EXPECT_THROW(assign_layers_exhaustive({layer_stage(1, 0, 5)}, 4), Error);
}

// ---------------------------------------------------------------------------
// Micro-batches.

TEST(AssignMicroBatches, HandCheckedOptima) {
  for (IlpSolver solver : kSolvers) {
    SCOPED_TRACE(solver == IlpSolver::kCbc ? "cbc" : "exact");
    auto a = assign_micro_batches({pipeline(1, 1), pipeline(1, 1)}, 8, 10, solver);
    EXPECT_EQ(a.counts, (std::vector<int>{4, 4}));
    EXPECT_EQ(a.max_time, 4);
    // Sizes 2 and 1: 2 n0 + n1 = 12, max(n0, n1) -> 4 each.
    a = assign_micro_batches({pipeline(2, 1), pipeline(1, 1)}, 12, 10, solver);
    EXPECT_EQ(a.counts, (std::vector<int>{4, 4}));
    EXPECT_EQ(a.max_time, 4);
    // A three times slower pipeline: max(n0, 3 n1) -> 6 + 2.
    a = assign_micro_batches({pipeline(1, 1), pipeline(1, 3)}, 8, 10, solver);
    EXPECT_EQ(a.counts, (std::vector<int>{6, 2}));
    EXPECT_EQ(a.max_time, 6);
    // ... unless memory keeps at most 5 micro-batches in flight on the fast one.
    a = assign_micro_batches({pipeline(1, 1, 0, 1, 5), pipeline(1, 3)}, 8, 10, solver);
    EXPECT_EQ(a.counts, (std::vector<int>{5, 3}));
    EXPECT_EQ(a.max_time, 9);
    // The slow pipeline has 4 stages, so at least 4 micro-batches.
    a = assign_micro_batches({pipeline(1, 1), pipeline(1, 3, 0, 4)}, 8, 10, solver);
    EXPECT_EQ(a.counts, (std::vector<int>{4, 4}));
    EXPECT_EQ(a.max_time, 12);
    // Fixed time (fill, drain, sync) shifts the balance: max(2 + n0, n1).
    a = assign_micro_batches({pipeline(1, 1, 2), pipeline(1, 1)}, 10, 10, solver);
    EXPECT_EQ(a.counts, (std::vector<int>{4, 6}));
    EXPECT_EQ(a.max_time, 6);
    // Sizes 4 and 3 reach 17 only as 2 * 4 + 3 * 3.
    a = assign_micro_batches({pipeline(4, 1), pipeline(3, 1)}, 17, 10, solver);
    EXPECT_EQ(a.counts, (std::vector<int>{2, 3}));
    // One pipeline.
    a = assign_micro_batches({pipeline(4, 0.5, 1)}, 32, 10, solver);
    EXPECT_EQ(a.counts, (std::vector<int>{8}));
    EXPECT_EQ(a.max_time, 5);
  }
}

TEST(AssignMicroBatches, MaximaThatExcludeEveryAssignment) {
  // 2 + 2 < 8; and a memory limit below the stage count.
  for (const auto& pipelines : {std::vector<MicroBatchPipeline>{pipeline(1, 1, 0, 1, 2), pipeline(1, 1, 0, 1, 2)},
                                std::vector<MicroBatchPipeline>{pipeline(1, 1, 0, 4, 3), pipeline(1, 1)}}) {
    for (const MicroBatchAssignment& a : {assign_micro_batches(pipelines, 8),
                                          assign_micro_batches(pipelines, 8, 10, IlpSolver::kExact),
                                          assign_micro_batches_exhaustive(pipelines, 8)}) {
      EXPECT_FALSE(a.feasible);
      EXPECT_TRUE(a.counts.empty());
    }
  }
}

// 200 random instances with sizes 1-4: CBC and the fast path reach the
// brute-force optimum and respect min/max.
TEST(AssignMicroBatches, RandomInstancesMatchExhaustive) {
  std::mt19937 rng(99);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto real = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  int infeasible = 0, mixed_sizes = 0;
  for (int trial = 0; trial < 200; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const bool integral = trial % 3 == 0;
    const bool equal_sizes = trial % 2 == 0;
    std::vector<MicroBatchPipeline> pipelines;
    int global_batch = 0;
    do {  // reachable by construction: the batch is a sum of counts the minima allow
      pipelines.clear();
      global_batch = 0;
      const int num_pipelines = uniform(1, 4), size = uniform(1, 4);
      for (int p = 0; p < num_pipelines; ++p) {
        const int mbs = equal_sizes ? size : uniform(1, 4), min = uniform(1, 2), count = min + uniform(0, 3);
        MicroBatchPipeline pl = integral ? pipeline(mbs, uniform(0, 4), uniform(0, 6), min)
                                         : pipeline(mbs, real(0.01, 0.2), real(0, 0.5), min);
        if (uniform(0, 3) == 0) pl.max_micro_batches = uniform(1, 5);
        pipelines.push_back(pl);
        global_batch += mbs * count;
      }
    } while (global_batch > 32);
    mixed_sizes += !equal_sizes;
    const MicroBatchAssignment ref = assign_micro_batches_exhaustive(pipelines, global_batch);
    for (IlpSolver solver : kSolvers) {
      const MicroBatchAssignment a = assign_micro_batches(pipelines, global_batch, 10, solver);
      ASSERT_EQ(a.feasible, ref.feasible);
      if (!ref.feasible) continue;
      expect_valid(pipelines, global_batch, a);
      EXPECT_TRUE(a.optimal);
      EXPECT_TRUE(same_optimum(a.max_time, ref.max_time)) << a.max_time << " vs exhaustive " << ref.max_time;
    }
    infeasible += !ref.feasible;
  }
  EXPECT_GT(infeasible, 3);
  EXPECT_GT(mixed_sizes, 50);
}

TEST(AssignMicroBatches, CbcAndExactAgreeOnPlannerSizes) {
  std::mt19937 rng(3);
  auto real = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  for (int trial = 0; trial < 40; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    std::vector<MicroBatchPipeline> pipelines;
    const int num_pipelines = 2 + trial % 7;
    for (int p = 0; p < num_pipelines; ++p)
      pipelines.push_back(pipeline(trial % 2 ? 1 + p % 3 : 2, real(0.02, 0.1), real(0, 0.5), 1 + p % 4, p % 3 ? 0 : 12));
    const int global_batch = 64 + 16 * (trial % 4);
    const MicroBatchAssignment cbc = assign_micro_batches(pipelines, global_batch);
    const MicroBatchAssignment exact = assign_micro_batches(pipelines, global_batch, 10, IlpSolver::kExact);
    ASSERT_EQ(cbc.feasible, exact.feasible);
    if (!cbc.feasible) continue;
    expect_valid(pipelines, global_batch, cbc);
    expect_valid(pipelines, global_batch, exact);
    EXPECT_TRUE(same_optimum(cbc.max_time, exact.max_time)) << cbc.max_time << " vs " << exact.max_time;
  }
  const auto pipelines = eight_pipelines();
  const MicroBatchAssignment cbc = assign_micro_batches(pipelines, 64);
  expect_valid(pipelines, 64, cbc);
  EXPECT_TRUE(same_optimum(cbc.max_time, assign_micro_batches(pipelines, 64, 10, IlpSolver::kExact).max_time));
}

TEST(AssignMicroBatches, DeterministicAndSilent) {
  const auto pipelines = eight_pipelines();
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const MicroBatchAssignment first = assign_micro_batches(pipelines, 64);
  const MicroBatchAssignment second = assign_micro_batches(pipelines, 64);
  const MicroBatchAssignment stopped = assign_micro_batches(pipelines, 64, 1e-9);
  const std::string out = ::testing::internal::GetCapturedStdout();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(out, "");
  EXPECT_EQ(err, "");
  EXPECT_EQ(first.counts, second.counts);
  expect_valid(pipelines, 64, stopped);
  EXPECT_GE(stopped.max_time, first.max_time * (1 - 1e-9));
  if (stopped.optimal) {
    EXPECT_TRUE(same_optimum(stopped.max_time, first.max_time));
  }
}

TEST(AssignMicroBatches, InvalidInputThrows) {
  auto message = [](auto&& call) {
    try {
      call();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message([] { assign_micro_batches({}, 8); }), "[ilp] assign_micro_batches: no pipelines");
  EXPECT_EQ(message([] { assign_micro_batches({pipeline(1, 1)}, 0); }), "[ilp] global_batch=0 is not positive");
  EXPECT_EQ(message([] { assign_micro_batches({pipeline(0, 1)}, 8); }),
            "[ilp] pipeline 0: micro_batch_size=0 is not positive");
  EXPECT_EQ(message([] { assign_micro_batches({pipeline(1, 1), pipeline(1, -2)}, 8); }),
            "[ilp] pipeline 1: time_per_micro_batch=-2 is negative or not finite");
  EXPECT_EQ(message([] { assign_micro_batches({pipeline(1, 1, 0, 0)}, 8); }),
            "[ilp] pipeline 0: min_micro_batches=0 is not positive");
  EXPECT_EQ(message([] { assign_micro_batches({pipeline(1, 1, 0, 1, -1)}, 8); }),
            "[ilp] pipeline 0: max_micro_batches=-1 is negative");
  EXPECT_EQ(message([] { assign_micro_batches({pipeline(2, 1, 0, 3), pipeline(1, 1, 0, 3)}, 8); }),
            "[ilp] global_batch=8 is below sum of micro_batch_size * min_micro_batches (9)");
  EXPECT_EQ(message([] { assign_micro_batches({pipeline(2, 1), pipeline(4, 1)}, 7); }),
            "[ilp] global_batch=7 is not reachable as sum of micro_batch_size * micro-batches (sizes 2, 4) "
            "with at least min_micro_batches each");
  EXPECT_EQ(message([] { assign_micro_batches({pipeline(1, 1)}, 8, -1); }), "[ilp] time_limit_s=-1 is not positive");
  EXPECT_THROW(assign_micro_batches_exhaustive({pipeline(2, 1), pipeline(4, 1)}, 7), Error);
}

}  // namespace
}  // namespace hspmd
