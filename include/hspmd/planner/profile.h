// A measured profile of one model on one device (docs/planner.md
// "Profiling"): what `hspmd profile` writes and the cost model reads.
//
// Times are seconds of one rank of a tensor-parallel (x context-parallel)
// group, measured with the real executor; each part is fitted in the
// sequence length s and micro-batch size b as
//     t(s, b) = a * b * s^2 + c * b * s + d
// (least squares over the measured samples). The fit error of every part is
// kept beside it, so a reader sees how far the regression is from what was
// measured.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/exec/op_fit.h"
#include "hspmd/models/config.h"

namespace hspmd {

// The parts of a model the profile times (forward and backward each).
//   embed: the token embedding (vocabulary-parallel under TP)
//   block: one transformer block
//   head:  the final norm, LM head and loss
inline constexpr const char* kProfileParts[] = {"embed_fwd", "embed_bwd", "block_fwd",
                                                "block_bwd", "head_fwd",  "head_bwd"};

struct FitSample {
  int64_t s = 0, b = 0;
  double seconds = 0;  // the median of the repetitions
};

struct PartFit {
  double a = 0, c = 0, d = 0;  // t = a*b*s^2 + c*b*s + d
  double max_rel_error = 0;    // max over samples of |fit - measured| / measured
  double mean_rel_error = 0;
  std::vector<FitSample> samples;

  double at(int64_t s, int64_t b) const {
    const double bs = static_cast<double>(b) * static_cast<double>(s);
    return a * bs * static_cast<double>(s) + c * bs + d;
  }
  // Least squares over `samples` (sets a, c, d and the errors); with fewer
  // than three distinct (s, b) points the higher terms are dropped first.
  void fit();
};

// One tensor-parallel x context-parallel configuration.
struct ProfileEntry {
  int tp = 1, cp = 1;
  std::map<std::string, PartFit> parts;  // keys: kProfileParts
  // Calibration to the emulated cluster (docs/profiling.md "Emulation
  // factor"): the compute CPU time a rank of this degree bills when
  // Profile::emulation_ranks emulated ranks share this machine's cores, over
  // what the parts (and the optimizer fit) predict for the same work
  // measured alone; 1 when not calibrated. The cost model scales this
  // degree's compute by it.
  double emulation_factor = 1;
};

// The optimizer step (AdamW, fp32) on n parameters: t = per_param_s * n + fixed_s.
struct OptimizerFit {
  double per_param_s = 0, fixed_s = 0;
  double max_rel_error = 0;
  std::vector<std::pair<int64_t, double>> samples;  // (n, seconds)
};

// OpFit and kAnyOp (Profile::ops) are declared by the exec layer, whose
// model clock uses them: hspmd/exec/op_fit.h.

// Bytes of one transformer block on one rank at tp x cp (docs/planner.md
// "Memory"): measured by the profiler, next to the cost model's formula.
struct LayerMemory {
  int tp = 1, cp = 1;
  int64_t param_bytes = 0;                      // the layer's parameters on the rank (fp32)
  int64_t grad_bytes = 0;
  int64_t optimizer_bytes = 0;                  // Adam states without ZeRO
  double activation_bytes_per_token = 0;        // kept by the forward for the backward
  double activation_bytes_per_token_recompute = 0;
  // What a stage keeps per token besides its layers' share (the intercept of
  // the fit over layer counts; with recomputation, the stage's input).
  // Optional in the JSON (0 when absent).
  double stage_activation_bytes_per_token = 0;
  double stage_activation_bytes_per_token_recompute = 0;
};

struct Profile {
  std::string model;        // the model file the profile was made for (informational)
  ModelConfig config;       // its dimensions: a profile only serves the same shapes
  std::string device;       // e.g. the CPU model name
  int threads = 1;          // kernel threads per rank during the measurement
  // The precision the model computed in ("fp32" or "bf16", hspmd train
  // --precision): its op times serve runs of that precision only.
  std::string precision = "fp32";
  int repetitions = 0;
  std::vector<ProfileEntry> entries;
  OptimizerFit optimizer;
  std::map<std::string, OpFit> ops;  // op type -> fit
  std::vector<LayerMemory> memory;
  // How many emulated ranks the entries' emulation factors were measured
  // with (0: not calibrated).
  int emulation_ranks = 0;
  // How quiet the machine was while the parts were timed (hspmd profile):
  // the share of its cores the measurement got (process CPU time over wall
  // time x threads; 1 on a quiet machine) and the 1-minute load average
  // before and after, on `cores` cores. 0 when not recorded.
  double cpu_share = 0, load_before = 0, load_after = 0;
  int cores = 0;
  // Whether the machine was busy: cpu_share below 0.75 (the load average,
  // which trails by a minute, is recorded for information only).
  bool measured_under_load() const;
  // "it got 52% of its cores, load 3.1 on 2 cores" (for warnings).
  std::string load_summary() const;

  // The entry for (tp, cp), or nullptr.
  const ProfileEntry* find(int tp, int cp) const;

  nlohmann::json to_json() const;
  // Throws hspmd::Error "[profile] <source>: <rule>" for a malformed document.
  static Profile from_json(const nlohmann::json& j, const std::string& source);
  static Profile load(const std::string& path);
  // Written by `hspmd profile` through write_output_file (include/hspmd/io/text_output.h).
};

}  // namespace hspmd
