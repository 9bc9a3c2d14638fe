// Pieces shared by the single-process and the distributed training loops.
#pragma once

#include <cstdio>
#include <string>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "hspmd/core/error.h"
#include "hspmd/data/token_data.h"
#include "hspmd/graph/executor.h"
#include "hspmd/train/trainer.h"

namespace hspmd::train_common {

inline void check_output_path(const std::string& flag, const std::string& path) {
  if (path.empty()) return;
  auto dir = std::filesystem::absolute(path).parent_path();
  if (!std::filesystem::is_directory(dir))
    fail("[flags] ", flag, " ", path, ": directory ", dir.string(), " does not exist");
}

// The feeds of one micro-batch: `count` consecutive samples from `first`.
inline ValueMap make_batch(const TokenData& data, int64_t first, int64_t count, int64_t seq_len,
                    float normalizer) {
  NDArray ids = NDArray::empty({count, seq_len}, DType::I32);
  NDArray targets = NDArray::empty({count, seq_len}, DType::I32);
  NDArray positions = NDArray::empty({count, seq_len}, DType::I32);
  for (int64_t b = 0; b < count; ++b) {
    data.sample(first + b, seq_len, ids.data<int32_t>() + b * seq_len,
                targets.data<int32_t>() + b * seq_len);
    for (int64_t s = 0; s < seq_len; ++s) positions.data<int32_t>()[b * seq_len + s] = s;
  }
  NDArray norm = NDArray::empty({}, DType::F32);
  norm.fill(normalizer);
  return {{"input_ids", ids}, {"targets", targets}, {"positions", positions}, {"normalizer", norm}};
}

inline void print_progress(const StepRecord& r, int64_t steps, double elapsed_s) {
  const double eta = elapsed_s / (r.step + 1) * (steps - r.step - 1);
  std::string emulated;
  if (!r.emulated_compute_s.empty())
    emulated = "  emulated step " + std::to_string(r.emulated_step_time_s) + "s";
  std::fprintf(stderr, "step %lld/%lld  loss %.4f  lr %.3g  grad_norm %.3f  %.0f tokens/s%s  eta %.0fs\n",
               static_cast<long long>(r.step + 1), static_cast<long long>(steps), r.loss, r.lr,
               r.grad_norm, r.tokens_per_s, emulated.c_str(), eta);
}

inline nlohmann::json record_json(const StepRecord& r) {
  nlohmann::json j = {{"step", r.step},           {"loss", r.loss}, {"tokens", r.tokens},
                      {"step_time_s", r.step_time_s}, {"tokens_per_s", r.tokens_per_s},
                      {"lr", r.lr},               {"grad_norm", r.grad_norm}};
  if (!r.bytes_sent.empty()) {
    j["bytes_sent"] = r.bytes_sent;
    j["reshard_bytes_sent"] = r.reshard_bytes_sent;
    j["predicted_reshard_bytes"] = r.predicted_reshard_bytes;
    j["peak_memory_bytes"] = r.peak_memory_bytes;
  }
  if (!r.emulated_compute_s.empty()) {
    j["emulated_step_time_s"] = r.emulated_step_time_s;
    j["emulated_compute_s"] = r.emulated_compute_s;
  }
  return j;
}

}  // namespace hspmd::train_common
