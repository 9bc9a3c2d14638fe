// Finite-difference gradient check for any op (or small composition of ops).
//
// The check builds loss = sum(output * W) with a fixed random W (in double
// precision, by test-only ops defined here), differentiates it with
// hspmd::gradients, and compares every sampled element of each f32 input's
// gradient with a central difference.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "hspmd/core/error.h"
#include "hspmd/core/rng.h"
#include "hspmd/graph/executor.h"
#include "hspmd/graph/op.h"
#include "hspmd/ops/autodiff.h"

namespace hspmd::testing {

// Weighted sum Σ x·w accumulated in double; gradient w.r.t. x is g·w.
class WeightedSumOp final : public Op {
 public:
  std::string type() const override { return "test_weighted_sum"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>&) const override {
    return {TensorMeta{{}, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    double s = 0;
    const float* x = in[0].data<float>();
    const float* w = in[1].data<float>();
    for (int64_t i = 0; i < in[0].numel(); ++i) s += static_cast<double>(x[i]) * w[i];
    out[0].data<float>()[0] = static_cast<float>(s);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override;
};

class ScaleByScalarOp final : public Op {
 public:
  std::string type() const override { return "test_scale_by_scalar"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    return {in[0]};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    const float s = in[1].data<float>()[0];
    for (int64_t i = 0; i < in[0].numel(); ++i)
      out[0].data<float>()[i] = in[0].data<float>()[i] * s;
  }
};

inline std::vector<Tensor> WeightedSumOp::gradient(const Node& node,
                                                   const std::vector<Tensor>& g) const {
  Tensor w = node.inputs[1];
  return {node.graph->add1(std::make_shared<ScaleByScalarOp>(), {w, g[0]}), Tensor()};
}

struct GradInput {
  std::string name;
  NDArray value;
  bool check = true;  // f32 inputs to differentiate; others (ids, offsets) are fixed
};

struct GradCheckOptions {
  double eps = 1e-2;
  double rtol = 3e-3;  // relative to the max |analytic gradient| of the input
  double atol = 1e-4;
  int max_elements = 48;  // sampled elements per input
  uint64_t seed = 7;
};

// Random f32 array with N(0, std^2) values.
inline NDArray random_array(const Shape& shape, uint64_t seed, float std = 1.0f) {
  NDArray a = NDArray::empty(shape, DType::F32);
  fill_normal(a, seed, "gradcheck", std);
  return a;
}

// `build` receives one placeholder per input (same order) and returns the
// output tensor (f32) to be checked.
inline void expect_gradients_match(
    const std::function<Tensor(Graph&, const std::vector<Tensor>&)>& build,
    std::vector<GradInput> inputs, GradCheckOptions opt = {}) {
  Graph g;
  std::vector<Tensor> phs;
  for (const auto& in : inputs)
    phs.push_back(g.placeholder(in.name, sym_shape(in.value.shape()), in.value.dtype()));
  Tensor out = build(g, phs);
  ASSERT_EQ(out.dtype(), DType::F32);
  Tensor w = g.placeholder("__w", out.shape(), DType::F32);
  Tensor loss = g.add1(std::make_shared<WeightedSumOp>(), {out, w});
  std::vector<Tensor> wrt;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].check) wrt.push_back(phs[i]);
  std::vector<Tensor> grads = gradients(loss, wrt);

  ValueMap values;
  for (const auto& in : inputs) values[in.name] = in.value;
  Executor fwd(g, {out});
  values["__w"] = random_array(fwd.run(values)[0].shape(), opt.seed + 1);
  std::vector<Tensor> fetch;
  for (const auto& t : grads) {
    ASSERT_TRUE(t.valid()) << "no gradient for an input";
    fetch.push_back(t);
  }
  Executor bwd(g, fetch);
  Executor loss_exec(g, {loss});
  std::vector<NDArray> analytic = bwd.run(values);

  Rng pick(opt.seed);
  size_t k = 0;
  for (auto& in : inputs) {
    if (!in.check) continue;
    const NDArray& ga = analytic[k++];
    ASSERT_EQ(ga.shape(), in.value.shape()) << in.name;
    std::vector<float> gv = ga.to_vector();
    double gmax = 0;
    for (float v : gv) gmax = std::max(gmax, std::fabs(static_cast<double>(v)));
    NDArray x = in.value.clone();
    values[in.name] = x;
    float* px = x.data<float>();
    const int64_t n = x.numel();
    const int samples = static_cast<int>(std::min<int64_t>(n, opt.max_elements));
    for (int s = 0; s < samples; ++s) {
      int64_t i = n <= opt.max_elements ? s : static_cast<int64_t>(pick.next_u64() % n);
      const float orig = px[i];
      px[i] = static_cast<float>(orig + opt.eps);
      double lp = loss_exec.run(values)[0].data<float>()[0];
      px[i] = static_cast<float>(orig - opt.eps);
      double lm = loss_exec.run(values)[0].data<float>()[0];
      px[i] = orig;
      double numeric = (lp - lm) / (2 * opt.eps);
      EXPECT_NEAR(gv[i], numeric, opt.atol + opt.rtol * gmax)
          << "input '" << in.name << "' element " << i;
    }
    values[in.name] = in.value;
  }
}

}  // namespace hspmd::testing
