#include "hspmd/optim/adam.h"

#include <cmath>

#include "hspmd/core/error.h"

namespace hspmd {

namespace {

// Below this many elements the OpenMP fork costs more than the loop.
constexpr int64_t kParallelThreshold = 1 << 15;

// Returns the moment buffer for `name`, zero-created on first use.
NDArray& moment(std::map<std::string, NDArray>& moments, const std::string& name,
                const Shape& shape) {
  auto it = moments.find(name);
  if (it == moments.end())
    it = moments.emplace(name, NDArray::zeros(shape, DType::F32)).first;
  HSPMD_CHECK(it->second.shape() == shape, "optimizer state '", name, "' has shape ",
              shape_str(it->second.shape()), " but the parameter has ", shape_str(shape));
  return it->second;
}

// Scalar factors of one step, computed in double then narrowed once.
struct StepFactors {
  float beta1, beta2, eps;
  float one_minus_beta1, one_minus_beta2;
  float l2;            // Adam: added wd * p to the gradient
  float decay_scale;   // AdamW: p *= 1 - lr*wd
  float sqrt_bc2;      // sqrt(1 - beta2^t)
  float step_size;     // lr / (1 - beta1^t)
};

StepFactors step_factors(const AdamConfig& c, int64_t step, double lr, bool decay) {
  const double wd = decay ? c.weight_decay : 0.0;
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(step));
  StepFactors f;
  f.beta1 = static_cast<float>(c.beta1);
  f.beta2 = static_cast<float>(c.beta2);
  f.eps = static_cast<float>(c.eps);
  f.one_minus_beta1 = static_cast<float>(1.0 - c.beta1);
  f.one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  f.l2 = c.decoupled_weight_decay ? 0.0f : static_cast<float>(wd);
  f.decay_scale = c.decoupled_weight_decay ? static_cast<float>(1.0 - lr * wd) : 1.0f;
  f.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  f.step_size = static_cast<float>(lr / bc1);
  return f;
}

// a - b * c, rounded once where the CPU has FMA: the rounding GCC chose for
// the scalar loop. Vectorized, it would fuse a's own product (p * decay)
// instead, and the bf16 runs of tests/exec compare one process with
// multi-rank runs closely enough to see the difference.
inline float minus_product(float a, float b, float c) {
#ifdef FP_FAST_FMAF
  return std::fma(-b, c, a);
#else
  return a - b * c;
#endif
}

void adam_kernel(float* p, const float* g, float* m, float* v, int64_t n,
                 const StepFactors& f) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelThreshold)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] + f.l2 * p[i];
    const float pi = p[i] * f.decay_scale;
    const float mi = f.beta1 * m[i] + f.one_minus_beta1 * gi;
    const float vi = f.beta2 * v[i] + f.one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    // Same operation order as torch: denom = sqrt(v) / sqrt(bc2) + eps.
    p[i] = minus_product(pi, f.step_size, mi / (std::sqrt(vi) / f.sqrt_bc2 + f.eps));
  }
}

}  // namespace

Adam::Adam(AdamConfig config) : config_(config) {}

void Adam::begin_step() { ++step_; }

void Adam::update(const std::string& name, NDArray& param, const NDArray& grad, double lr,
                  bool decay) {
  HSPMD_CHECK(step_ > 0, "Adam::update('", name, "') before begin_step()");
  HSPMD_CHECK(param.dtype() == DType::F32 && grad.dtype() == DType::F32,
              "Adam::update('", name, "') needs f32 param and grad");
  HSPMD_CHECK(param.is_contiguous() && grad.is_contiguous(), "Adam::update('", name,
              "') needs contiguous param and grad");
  HSPMD_CHECK(param.shape() == grad.shape(), "Adam::update('", name, "'): param ",
              shape_str(param.shape()), " vs grad ", shape_str(grad.shape()));
  NDArray& m = moment(m_, name, param.shape());
  NDArray& v = moment(v_, name, param.shape());
  adam_kernel(param.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(),
              param.numel(), step_factors(config_, step_, lr, decay));
}

void Adam::import_moments(const std::string& name, NDArray exp_avg, NDArray exp_avg_sq) {
  for (const NDArray* a : {&exp_avg, &exp_avg_sq})
    HSPMD_CHECK(a->dtype() == DType::F32 && a->is_contiguous(), "Adam::import_moments('", name,
                "') needs contiguous f32 moments");
  HSPMD_CHECK(exp_avg.shape() == exp_avg_sq.shape(), "Adam::import_moments('", name, "'): shapes differ");
  m_[name] = std::move(exp_avg);
  v_[name] = std::move(exp_avg_sq);
}

std::pair<NDArray, NDArray> Adam::export_moments(const std::string& name) {
  auto m = m_.find(name);
  auto v = v_.find(name);
  if (m == m_.end() || v == v_.end()) return {};
  std::pair<NDArray, NDArray> out{std::move(m->second), std::move(v->second)};
  m_.erase(m);
  v_.erase(v);
  return out;
}

}  // namespace hspmd
