// Pieces shared by the single-process and the distributed training loops.
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>
#include <cstdio>
#include <optional>
#include <string>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "hspmd/data/token_data.h"
#include "hspmd/graph/executor.h"
#include "hspmd/io/output_file.h"
#include "hspmd/train/trainer.h"
#include "kernels/memory.h"

namespace hspmd::train_common {

// Every output of a run, checked before step 0 (docs/reliability.md): none
// is an input or another output (every rank); on rank 0 the files it alone
// writes; on every rank the trace (each writes its part beside it) and the
// checkpoint directory.
inline void check_outputs(const TrainOptions& o, int rank) {
  check_run_files_apart(o);
  if (rank == 0) {
    check_output_file((options_tag() + " " + option_name("save")), o.save_path, OutputWrite::kRename);
    check_output_file((options_tag() + " " + option_name("dump_grads")), o.dump_grads_path, OutputWrite::kRename);
    check_output_file((options_tag() + " " + option_name("log")), o.log_path, OutputWrite::kStream);
  }
  check_output_file((options_tag() + " " + option_name("trace")), o.trace_path, OutputWrite::kStream);
  check_output_file((options_tag() + " " + option_name("op_times")), o.op_times_path, OutputWrite::kRename);
  check_output_directory((options_tag() + " " + option_name("checkpoint")), o.checkpoint_dir);
}

// A host copy of `a` (new storage), whatever device it lives on.
inline NDArray host_copy(const NDArray& a) {
  if (a.device() == Device::cpu()) return a.clone();
  return kernels::to_host(default_stream(a.device()), a);
}

// The index of the first NaN or infinite element of `a` (F32 or BF16), or -1.
inline int64_t first_nonfinite(const NDArray& a) {
  const NDArray h = kernels::to_host(default_stream(a.device()), a);
  const NDArray f = h.dtype() == DType::F32 ? h.contiguous() : h.to(DType::F32).contiguous();
  const float* x = f.host_data<float>("first_nonfinite");
  for (int64_t i = 0; i < f.numel(); ++i)
    if (!std::isfinite(x[i])) return i;
  return -1;
}

// Throws "[init] <path>: tensor '<name>' holds <value> at element <i>" for
// the first initial weight that is not finite.
inline void check_finite_weights(const std::map<std::string, NDArray>& weights, const std::string& path) {
  for (const auto& [name, t] : weights)
    if (const int64_t i = first_nonfinite(t); i >= 0)
      fail("[init] ", path, ": tensor '", name, "' holds ",
           kernels::to_host(default_stream(t.device()), t).to(DType::F32).to_vector()[i],
           " at element ", i, " (weights must be finite)");
}

// The samples a run trains on: fixed-length windows of the token file, or
// packed documents (--pack-documents; docs/data.md).
class SampleSource {
 public:
  SampleSource(const TokenData& data, int64_t seq_len, bool packed, int64_t eos_token_id)
      : data_(data), seq_len_(seq_len) {
    data.num_samples(seq_len);  // throws when the file is shorter than one sample
    if (packed) packed_.emplace(data, seq_len, eos_token_id);
  }
  bool packed() const { return packed_.has_value(); }
  // Tokens of sample i.
  int64_t length(int64_t i) const { return packed_ ? packed_->length(i) : seq_len_; }
  // Targets of sample i that count in the loss.
  int64_t counted_targets(int64_t i) const { return packed_ ? packed_->counted_targets(i) : seq_len_; }
  // The widest of `count` samples from `first`, rounded up to a multiple of
  // `granularity` (fixed-length samples are seq_len wide).
  int64_t width(int64_t first, int64_t count, int64_t granularity) const {
    int64_t w = 1;
    for (int64_t b = 0; b < count; ++b) w = std::max(w, length(first + b));
    return (w + granularity - 1) / granularity * granularity;
  }
  // Sample i into rows of `width` tokens (packed samples are padded).
  void fill(int64_t i, int64_t width, int32_t* ids, int32_t* targets, int32_t* positions) const {
    if (packed_) return packed_->sample(i, width, ids, targets, positions);
    HSPMD_CHECK(width == seq_len_, "fixed-length samples are seq_len wide");
    data_.sample(i, seq_len_, ids, targets);
    for (int64_t s = 0; s < seq_len_; ++s) positions[s] = static_cast<int32_t>(s);
  }
  // The loss normalizer of the `count` samples from `first` (a global
  // batch): their counted targets, at least 1; and their real tokens.
  float normalizer(int64_t first, int64_t count) const {
    return static_cast<float>(std::max<int64_t>(1, targets(first, count)));
  }
  // Their counted targets (0: nothing to predict, e.g. one-token documents).
  int64_t targets(int64_t first, int64_t count) const {
    int64_t n = 0;
    for (int64_t b = 0; b < count; ++b) n += counted_targets(first + b);
    return n;
  }
  int64_t tokens(int64_t first, int64_t count) const {
    int64_t n = 0;
    for (int64_t b = 0; b < count; ++b) n += length(first + b);
    return n;
  }

 private:
  const TokenData& data_;
  int64_t seq_len_;
  std::optional<PackedDocuments> packed_;
};

// The feeds of one micro-batch: `count` consecutive samples from `first`,
// in rows of `width` tokens.
inline ValueMap make_batch(const SampleSource& source, int64_t first, int64_t count, int64_t width,
                           float normalizer) {
  NDArray ids = NDArray::empty({count, width}, DType::I32);
  NDArray targets = NDArray::empty({count, width}, DType::I32);
  NDArray positions = NDArray::empty({count, width}, DType::I32);
  for (int64_t b = 0; b < count; ++b)
    source.fill(first + b, width, ids.host_data<int32_t>() + b * width,
                targets.host_data<int32_t>() + b * width, positions.host_data<int32_t>() + b * width);
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
  if (r.skipped) j["skipped"] = true;  // --skip-nonfinite-steps: no update (loss or grad_norm null)
  if (!r.bytes_sent.empty()) {
    j["bytes_sent"] = r.bytes_sent;
    j["reshard_bytes_sent"] = r.reshard_bytes_sent;
    j["predicted_reshard_bytes"] = r.predicted_reshard_bytes;
    j["op_bytes_sent"] = r.op_bytes_sent;
    j["predicted_op_bytes"] = r.predicted_op_bytes;
    if (std::any_of(r.predicted_expert_bytes.begin(), r.predicted_expert_bytes.end(), [](int64_t b) { return b > 0; })) {
      j["expert_bytes_sent"] = r.expert_bytes_sent;
      j["predicted_expert_bytes"] = r.predicted_expert_bytes;
    }
    j["peak_memory_bytes"] = r.peak_memory_bytes;
    j["peak_activation_bytes"] = r.peak_activation_bytes;
    j["grad_sync_s"] = r.grad_sync_s;
    if (!r.expert_tokens.empty()) j["expert_tokens"] = r.expert_tokens;
    if (!r.cross_host_bytes_sent.empty()) {
      j["cross_host_bytes_sent"] = r.cross_host_bytes_sent;
      j["cross_host_segments"] = r.cross_host_segments;
    }
    if (std::any_of(r.grad_sync_overlapped.begin(), r.grad_sync_overlapped.end(), [](int64_t n) { return n > 0; }))
      j["grad_sync_overlapped"] = r.grad_sync_overlapped;
    if (std::any_of(r.sm_percent.begin(), r.sm_percent.end(), [](int64_t p) { return p > 0; }))
      j["sm_percent"] = r.sm_percent;
    if (std::any_of(r.attention_fallbacks.begin(), r.attention_fallbacks.end(), [](int64_t n) { return n > 0; }))
      j["attention_fallbacks"] = r.attention_fallbacks;
  }
  if (r.pieces > 0) {  // token-budget steps
    j["pieces"] = r.pieces;
    j["pipeline_tokens"] = r.pipeline_tokens;
    j["predicted_step_s"] = r.predicted_step_s;
    if (r.strategy >= 0) j["strategy"] = r.strategy;
    j["dispatch_s"] = r.dispatch_s;
  }
  if (r.queued_s > 0) j["queued_s"] = r.queued_s;
  if (!r.cuda_graph.empty()) j["cuda_graph"] = r.cuda_graph;
  if (!r.emulated_compute_s.empty()) {
    j["emulated_step_time_s"] = r.emulated_step_time_s;
    j["emulated_compute_s"] = r.emulated_compute_s;
  }
  return j;
}

}  // namespace hspmd::train_common
