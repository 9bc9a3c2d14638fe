#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <numbers>
#include <string>
#include <vector>

#include "hspmd/core/error.h"
#include "hspmd/optim/adam.h"
#include "hspmd/optim/lr_schedule.h"

namespace hspmd {
namespace {

// Independent scalar double reference of torch.optim.Adam / AdamW.
struct RefAdam {
  AdamConfig c;
  std::vector<double> p, m, v;
  int64_t t = 0;

  void step(const std::vector<double>& g, double lr, bool decay) {
    ++t;
    const double wd = decay ? c.weight_decay : 0.0;
    const double bc1 = 1.0 - std::pow(c.beta1, t);
    const double bc2 = 1.0 - std::pow(c.beta2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      double gi = g[i];
      if (c.decoupled_weight_decay)
        p[i] *= 1.0 - lr * wd;
      else
        gi += wd * p[i];
      m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * gi;
      v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * gi * gi;
      const double denom = std::sqrt(v[i]) / std::sqrt(bc2) + c.eps;
      p[i] -= lr / bc1 * m[i] / denom;
    }
  }
};

std::vector<float> pattern(int64_t n, float scale, float phase) {
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = scale * std::sin(0.37f * i + phase);
  return x;
}

// Runs `steps` updates of our Adam and the reference on the same gradients
// and compares parameters and moments after every step.
void check_against_reference(AdamConfig config, bool decay, int64_t n, int steps) {
  const Shape shape{n};
  NDArray param = NDArray::from_vector(shape, pattern(n, 0.5f, 0.1f));
  RefAdam ref{config, {}, std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
  for (float x : param.to_vector()) ref.p.push_back(x);

  Adam adam(config);
  for (int s = 0; s < steps; ++s) {
    const std::vector<float> g = pattern(n, 0.01f * (s + 1), 0.7f * s);
    const double lr = 1e-2 * (s + 1);
    adam.begin_step();
    adam.update("w", param, NDArray::from_vector(shape, g), lr, decay);
    ref.step(std::vector<double>(g.begin(), g.end()), lr, decay);

    const std::vector<float> got = param.to_vector();
    const std::vector<float> m = adam.exp_avg().at("w").to_vector();
    const std::vector<float> v = adam.exp_avg_sq().at("w").to_vector();
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(got[i], ref.p[i], 2e-6 + 2e-6 * std::abs(ref.p[i])) << "step " << s << " i " << i;
      ASSERT_NEAR(m[i], ref.m[i], 1e-7 + 1e-5 * std::abs(ref.m[i]));
      ASSERT_NEAR(v[i], ref.v[i], 1e-10 + 1e-5 * std::abs(ref.v[i]));
    }
  }
  EXPECT_EQ(adam.step_count(), steps);
}

TEST(Adam, AdamWMatchesReferenceWithDecay) {
  AdamConfig c;
  c.weight_decay = 0.1;
  check_against_reference(c, /*decay=*/true, 37, 5);
}

TEST(Adam, AdamWMatchesReferenceWithoutDecay) {
  AdamConfig c;
  c.weight_decay = 0.1;
  check_against_reference(c, /*decay=*/false, 37, 5);
}

TEST(Adam, AdamL2MatchesReference) {
  AdamConfig c;
  c.beta1 = 0.8;
  c.beta2 = 0.999;
  c.eps = 1e-6;
  c.weight_decay = 0.05;
  c.decoupled_weight_decay = false;
  check_against_reference(c, /*decay=*/true, 37, 5);
}

TEST(Adam, LargeTensorTakesParallelPathAndMatches) {
  AdamConfig c;
  c.weight_decay = 0.01;
  check_against_reference(c, /*decay=*/true, 100003, 3);
}

TEST(Adam, FirstStepIsSignedLrForDefaultConfig) {
  // With zero moments, step 1 moves each weight by lr * g / (|g| + eps').
  Adam adam(AdamConfig{});
  NDArray p = NDArray::from_vector({3}, {1.0f, 1.0f, 1.0f});
  adam.begin_step();
  adam.update("w", p, NDArray::from_vector({3}, {0.5f, -2.0f, 0.0f}), 0.1, true);
  const std::vector<float> got = p.to_vector();
  EXPECT_NEAR(got[0], 0.9f, 1e-6);
  EXPECT_NEAR(got[1], 1.1f, 1e-6);
  EXPECT_FLOAT_EQ(got[2], 1.0f);
}

TEST(Adam, FactorsOnDeviceAreTheSameUpdate) {
  // set_factors_on_device (CUDA graphs): the varying factors reach the
  // update through an array per weight-decay group, refreshed at each call:
  // the same bits as kernel arguments, step after step, lr changing, both
  // groups.
  AdamConfig c;
  c.weight_decay = 0.1;
  Adam on(c), off(c);
  on.set_factors_on_device(true);
  NDArray p1 = NDArray::from_vector({4}, {1.0f, -2.0f, 0.5f, 3.0f}), p2 = p1.clone();
  NDArray q1 = NDArray::from_vector({2}, {0.25f, 4.0f}), q2 = q1.clone();
  for (int step = 0; step < 4; ++step) {
    const double lr = 0.1 / (step + 1);
    const NDArray g = NDArray::from_vector({4}, {0.5f, -1.0f + step, 0.125f, 2.0f});
    const NDArray h = NDArray::from_vector({2}, {1.0f * step, -0.5f});
    for (Adam* adam : {&on, &off}) {
      adam->begin_step();
      NDArray& p = adam == &on ? p1 : p2;
      NDArray& q = adam == &on ? q1 : q2;
      adam->update_group({{"p", &p, &g}}, lr, true);
      adam->update_group({{"q", &q, &h}}, lr, false);
    }
    EXPECT_EQ(p1.to_vector(), p2.to_vector()) << "step " << step;
    EXPECT_EQ(q1.to_vector(), q2.to_vector()) << "step " << step;
  }
  on.refresh_factors(0.5);  // the host side of a replay: no update, nothing moves
  EXPECT_EQ(p1.to_vector(), p2.to_vector());
}

TEST(Adam, MomentsAreKeptPerName) {
  Adam adam(AdamConfig{});
  NDArray a = NDArray::from_vector({2}, {1.0f, 2.0f});
  NDArray b = NDArray::from_vector({3}, {1.0f, 2.0f, 3.0f});
  adam.begin_step();
  adam.update("a", a, NDArray::from_vector({2}, {1.0f, 1.0f}), 0.1, false);
  adam.update("b", b, NDArray::from_vector({3}, {0.0f, 0.0f, 0.0f}), 0.1, false);
  EXPECT_EQ(adam.exp_avg().size(), 2u);
  EXPECT_EQ(adam.exp_avg_sq().at("b").shape(), Shape({3}));
  EXPECT_EQ(adam.exp_avg().at("b").to_vector(), std::vector<float>(3, 0.0f));
}

TEST(Adam, ShapeMismatchForExistingNameIsInternalError) {
  Adam adam(AdamConfig{});
  NDArray a = NDArray::from_vector({2}, {1.0f, 2.0f});
  adam.begin_step();
  adam.update("w", a, NDArray::from_vector({2}, {1.0f, 1.0f}), 0.1, false);
  NDArray b = NDArray::from_vector({3}, {1.0f, 2.0f, 3.0f});
  EXPECT_THROW(adam.update("w", b, NDArray::from_vector({3}, {1.0f, 1.0f, 1.0f}), 0.1, false),
               InternalError);
}

TEST(Adam, GradShapeMismatchAndMissingBeginStepAreInternalErrors) {
  Adam adam(AdamConfig{});
  NDArray a = NDArray::from_vector({2}, {1.0f, 2.0f});
  EXPECT_THROW(adam.update("w", a, NDArray::from_vector({2}, {1.0f, 1.0f}), 0.1, false),
               InternalError);
  adam.begin_step();
  EXPECT_THROW(adam.update("w", a, NDArray::from_vector({3}, {1.0f, 1.0f, 1.0f}), 0.1, false),
               InternalError);
}

TEST(LrSchedule, ConstantIgnoresStep) {
  LrSchedule s;
  s.lr = 3e-4;
  s.total_steps = 100;
  EXPECT_DOUBLE_EQ(s.at(0), 3e-4);
  EXPECT_DOUBLE_EQ(s.at(99), 3e-4);
  EXPECT_DOUBLE_EQ(s.at(500), 3e-4);
}

TEST(LrSchedule, WarmupIsLinearThenConstant) {
  LrSchedule s;
  s.lr = 1.0;
  s.warmup_steps = 4;
  s.total_steps = 10;
  EXPECT_DOUBLE_EQ(s.at(0), 0.25);
  EXPECT_DOUBLE_EQ(s.at(1), 0.5);
  EXPECT_DOUBLE_EQ(s.at(3), 1.0);
  EXPECT_DOUBLE_EQ(s.at(4), 1.0);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
}

TEST(LrSchedule, CosineEndpointsAndMidpoint) {
  LrSchedule s;
  s.kind = LrScheduleKind::Cosine;
  s.lr = 1.0;
  s.min_lr = 0.1;
  s.warmup_steps = 10;
  s.total_steps = 110;
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);  // warmup: 1 * 1/10
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(60), 0.55, 1e-12);
  EXPECT_NEAR(s.at(35), 0.1 + 0.45 * (1.0 + std::cos(std::numbers::pi / 4)), 1e-12);
  EXPECT_NEAR(s.at(110), 0.1, 1e-12);
  EXPECT_NEAR(s.at(1000), 0.1, 1e-12);
}

TEST(LrSchedule, CosineWithoutWarmupStartsAtPeak) {
  LrSchedule s;
  s.kind = LrScheduleKind::Cosine;
  s.lr = 2.0;
  s.total_steps = 4;
  EXPECT_DOUBLE_EQ(s.at(0), 2.0);
  EXPECT_NEAR(s.at(2), 1.0, 1e-12);
  EXPECT_NEAR(s.at(4), 0.0, 1e-12);
}

TEST(LrSchedule, ParseKind) {
  EXPECT_EQ(LrSchedule::parse_kind("constant"), LrScheduleKind::Constant);
  EXPECT_EQ(LrSchedule::parse_kind("warmup"), LrScheduleKind::Constant);
  EXPECT_EQ(LrSchedule::parse_kind("cosine"), LrScheduleKind::Cosine);
  try {
    LrSchedule::parse_kind("linear");
    FAIL() << "expected hspmd::Error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "[flags] --lr-schedule: unknown schedule 'linear' (expected constant, "
                 "warmup or cosine)");
  }
}

std::map<std::string, NDArray> grads_3_4() {
  std::map<std::string, NDArray> g;
  g["a"] = NDArray::from_vector({2}, {3.0f, 0.0f});
  g["b"] = NDArray::from_vector({1, 1}, {4.0f});
  return g;
}

TEST(ClipGradNorm, GlobalNormSpansAllTensors) {
  EXPECT_DOUBLE_EQ(global_grad_norm(grads_3_4()), 5.0);
  std::map<std::string, NDArray> big;
  big["x"] = NDArray::from_vector({100000}, std::vector<float>(100000, 0.5f));
  EXPECT_NEAR(global_grad_norm(big), std::sqrt(25000.0), 1e-9);
}

TEST(ClipGradNorm, ScalesWhenAboveMax) {
  auto g = grads_3_4();
  EXPECT_DOUBLE_EQ(clip_grad_norm(g, 1.0), 5.0);
  const double coef = 1.0 / (5.0 + 1e-6);
  EXPECT_FLOAT_EQ(g["a"].to_vector()[0], static_cast<float>(3.0 * coef));
  EXPECT_FLOAT_EQ(g["b"].to_vector()[0], static_cast<float>(4.0 * coef));
  EXPECT_NEAR(global_grad_norm(g), 1.0, 1e-6);
}

TEST(ClipGradNorm, UntouchedBelowMaxOrWhenDisabled) {
  for (double max_norm : {10.0, 0.0, -1.0}) {
    auto g = grads_3_4();
    EXPECT_DOUBLE_EQ(clip_grad_norm(g, max_norm), 5.0);
    EXPECT_EQ(g["a"].to_vector(), std::vector<float>({3.0f, 0.0f}));
    EXPECT_EQ(g["b"].to_vector(), std::vector<float>({4.0f}));
  }
}

}  // namespace
}  // namespace hspmd
