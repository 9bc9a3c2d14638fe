#include "hspmd/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"

namespace hspmd {

namespace {

// The stream of the gradients' device (that of the first; kernels check the others).
Stream& grads_stream(const std::map<std::string, NDArray>& grads) {
  return default_stream(grads.empty() ? Device::cpu() : grads.begin()->second.device());
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

void LrSchedule::check_rates(const std::string& lr_name, const std::string& min_lr_name) const {
  if (!std::isfinite(lr)) fail(options_tag(), " ", lr_name, " must be a finite number, got ", lr);
  if (!(lr > 0)) fail(options_tag(), " ", lr_name, " must be positive, got ", lr);
  if (!std::isfinite(min_lr)) fail(options_tag(), " ", min_lr_name, " must be a finite number, got ", min_lr);
  if (!(min_lr >= 0 && min_lr <= lr))
    fail(options_tag(), " ", min_lr_name, " ", min_lr, " must lie in [0, ", lr_name, " ", lr, "]");
}

LrScheduleKind LrSchedule::parse_kind(const std::string& name) {
  if (name == "constant" || name == "warmup") return LrScheduleKind::Constant;
  if (name == "cosine") return LrScheduleKind::Cosine;
  fail(options_tag(), " ", option_name("lr_schedule"), ": unknown schedule '", name,
       "' (expected constant, warmup or cosine)");
}

float clip_coefficient(double norm, double max_norm) {
  if (max_norm > 0 && norm > max_norm) return static_cast<float>(max_norm / (norm + 1e-6));
  return 1.0f;
}

void scale_grads(std::map<std::string, NDArray>& grads, float coef) {
  if (coef == 1.0f) return;
  Stream& s = grads_stream(grads);
  for (auto& [name, g] : grads) kernels::scale(s, g, coef, g);
}

double global_grad_norm(const std::map<std::string, NDArray>& grads) {
  std::vector<NDArray> arrays;
  for (const auto& [name, g] : grads) arrays.push_back(g);
  return std::sqrt(kernels::sum_of_squares(grads_stream(grads), arrays));
}

double clip_grad_norm(std::map<std::string, NDArray>& grads, double max_norm) {
  const double norm = global_grad_norm(grads);
  scale_grads(grads, clip_coefficient(norm, max_norm));
  return norm;
}

}  // namespace hspmd
