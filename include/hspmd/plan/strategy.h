// Strategy: the high-level parallel plan a person or planner writes (DESIGN
// §7, the paper's appendix tables): data-parallel pipelines, each a chain of
// stages; a stage is a tensor-parallel group (optionally tp x cp) running an
// inclusive range of transformer blocks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/models/config.h"

namespace hspmd {

struct Stage {
  std::vector<int> ranks;  // the stage's devices; tp-major: rank index = cp_index * tp + tp_index
  int first_layer = 0;     // inclusive
  int last_layer = 0;      // inclusive
  int cp = 1;              // context-parallel degree; tp = ranks.size() / cp

  int tp() const { return static_cast<int>(ranks.size()) / cp; }
  int num_layers() const { return last_layer - first_layer + 1; }
};

struct Pipeline {
  int micro_batch_size = 1;
  int micro_batches = 1;
  std::vector<Stage> stages;

  int batch() const { return micro_batch_size * micro_batches; }  // samples per step
};

struct Strategy {
  std::string schedule = "1f1b";  // "1f1b" or "gpipe"
  bool zero = false;              // ZeRO-1: split fp32 master weights and Adam states across DP
  std::vector<Pipeline> pipelines;

  int global_batch() const;  // sum of the pipelines' batch()
  // Every rank named by some stage, ascending.
  std::vector<int> ranks() const;
};

// Parses the strategy JSON of DESIGN §7. Unknown fields are errors. Throws
// hspmd::Error "[strategy] <where>: <rule>" (one line), e.g.
// "[strategy] pipeline 1 stage 0: field 'layers' must be [first, last]".
Strategy strategy_from_json(const nlohmann::json& j);
// Reads and parses a file; JSON syntax errors name the file.
Strategy load_strategy(const std::string& path);
nlohmann::json to_json(const Strategy& strategy);

// Checks a parsed strategy against a model and a world size. Throws
// hspmd::Error "[strategy] pipeline P stage S: <rule>" for: no pipelines; a
// pipeline without stages; micro_batch_size or micro_batches < 1; a stage
// without ranks; a rank twice in the whole strategy; a rank outside
// [0, world_size); cp < 1 or not dividing the stage's size; layers out of
// [0, num_hidden_layers), reversed, or a pipeline whose stages leave a gap,
// overlap, or do not cover 0 .. L-1 in order; tp not dividing
// num_attention_heads, num_key_value_heads, intermediate_size or
// vocab_size; an unknown schedule.
void validate(const Strategy& strategy, const LlamaConfig& config, int world_size);

}  // namespace hspmd
