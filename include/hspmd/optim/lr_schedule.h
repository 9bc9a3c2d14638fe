// Learning-rate schedules and gradient clipping.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "hspmd/core/ndarray.h"

namespace hspmd {

enum class LrScheduleKind { Constant, Cosine };

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::Constant;
  double lr = 1e-3;        // peak learning rate
  double min_lr = 0.0;     // cosine floor
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;

  // Learning rate of step `step` (0-based): linear warmup lr*(step+1)/warmup
  // for step < warmup_steps, then constant or cosine decay from lr to min_lr
  // reached at step total_steps (and kept after it). Cosine is
  // min_lr + (lr - min_lr) * (1 + cos(pi * (step - warmup) / (total - warmup))) / 2;
  // when total_steps <= warmup_steps it yields min_lr after warmup.
  double at(int64_t step) const;

  // The one check of the two rates, for every way in (the CLI's flags, the
  // Python Trainer's options): lr a finite number > 0 first, then min_lr a
  // finite number in [0, lr], so that a bad lr is named as itself, never as
  // min_lr's bound. Throws hspmd::Error "[flags] <lr_name> must be positive,
  // got -1" (or "... must be a finite number, got inf", "[flags]
  // <min_lr_name> 0.1 must lie in [0, <lr_name> 0.01]"); the names as the
  // caller's user spells them ("--lr" on the command line, "lr" in Python).
  void check_rates(const std::string& lr_name, const std::string& min_lr_name) const;

  // Parses "constant", "warmup" (= constant after warmup) or "cosine".
  // Throws hspmd::Error "[flags] --lr-schedule: ..." otherwise.
  static LrScheduleKind parse_kind(const std::string& name);
};

// Gradient clipping, the one implementation the trainer and tests share
// (the elements are touched by kernels only: kernels::sum_of_squares and
// kernels::scale, on the stream of the gradients' device).
//
// The factor clipping scales every gradient by, given the global norm:
// max_norm / (norm + 1e-6) when max_norm > 0 and norm > max_norm (as
// torch.nn.utils.clip_grad_norm_), else 1 (no clipping).
float clip_coefficient(double norm, double max_norm);
// Multiplies every gradient by `coef` (nothing when coef == 1).
void scale_grads(std::map<std::string, NDArray>& grads, float coef);

// Global L2 norm of all gradients (squares accumulated in double, in map
// order). Gradients must be contiguous f32 (else hspmd::InternalError).
double global_grad_norm(const std::map<std::string, NDArray>& grads);
// Clips by clip_coefficient(global_grad_norm(grads), max_norm); returns the
// norm before clipping. max_norm <= 0 disables clipping.
double clip_grad_norm(std::map<std::string, NDArray>& grads, double max_norm);

}  // namespace hspmd
