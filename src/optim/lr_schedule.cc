#include "hspmd/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "hspmd/core/error.h"

namespace hspmd {

namespace {

constexpr int64_t kParallelThreshold = 1 << 15;

double sum_of_squares(const NDArray& a) {
  HSPMD_CHECK(a.dtype() == DType::F32 && a.is_contiguous(),
              "gradient norm needs contiguous f32 arrays");
  const float* x = a.data<float>();
  const int64_t n = a.numel();
  double sum = 0.0;
#pragma omp parallel for simd reduction(+ : sum) schedule(static) if (n >= kParallelThreshold)
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  return sum;
}

void scale(NDArray& a, float factor) {
  float* x = a.data<float>();
  const int64_t n = a.numel();
#pragma omp parallel for simd schedule(static) if (n >= kParallelThreshold)
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

}  // namespace

double LrSchedule::at(int64_t step) const {
  if (step < warmup_steps)
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (kind == LrScheduleKind::Constant) return lr;
  // Cosine from lr (first step after warmup) down to min_lr at total_steps.
  const int64_t decay_steps = total_steps - warmup_steps;
  const double progress =
      decay_steps <= 0
          ? 1.0
          : std::clamp(static_cast<double>(step - warmup_steps) / decay_steps, 0.0, 1.0);
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

LrScheduleKind LrSchedule::parse_kind(const std::string& name) {
  if (name == "constant" || name == "warmup") return LrScheduleKind::Constant;
  if (name == "cosine") return LrScheduleKind::Cosine;
  fail("[flags] --lr-schedule: unknown schedule '", name,
       "' (expected constant, warmup or cosine)");
}

double global_grad_norm(const std::map<std::string, NDArray>& grads) {
  double sum = 0.0;
  for (const auto& [name, g] : grads) sum += sum_of_squares(g);
  return std::sqrt(sum);
}

double clip_grad_norm(std::map<std::string, NDArray>& grads, double max_norm) {
  const double norm = global_grad_norm(grads);
  if (max_norm <= 0.0) return norm;
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0)
    for (auto& [name, g] : grads) scale(g, static_cast<float>(coef));
  return norm;
}

}  // namespace hspmd
