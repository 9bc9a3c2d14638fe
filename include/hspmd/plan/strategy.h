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
  // Activation recomputation: the stage's forward keeps only what its
  // backward cannot recompute locally and re-runs the rest before the
  // backward (docs/execution.md).
  bool recompute = false;

  int tp() const { return static_cast<int>(ranks.size()) / cp; }
  int num_layers() const { return last_layer - first_layer + 1; }
  bool operator==(const Stage&) const = default;
};

struct Pipeline {
  int micro_batch_size = 1;
  int micro_batches = 1;
  std::vector<Stage> stages;
  // Token-budget steps (docs/mixed_length.md); 0 = the default. The longest
  // piece the pipeline takes (default: the strategy's max_seq_len), and the
  // tokens of one micro-batch (default: its max_seq_len). micro_batch_size
  // and micro_batches are not read then (and may be left out).
  int max_seq_len = 0;
  int micro_batch_tokens = 0;

  int batch() const { return micro_batch_size * micro_batches; }  // samples per step
  bool operator==(const Pipeline&) const = default;
};

// Expert parallelism's placement of one range of sparse layers (docs/moe.md):
// per expert, the members of each group (0 .. expert_parallel - 1) that hold
// it; more than one: replicas, which split the expert's tokens.
struct ExpertPlacement {
  int first_layer = 0, last_layer = 0;
  std::vector<std::vector<int>> members;
  bool operator==(const ExpertPlacement&) const = default;
};

struct Strategy {
  std::string description;        // free text, e.g. the paper table it comes from (optional)
  std::string schedule = "1f1b";  // "1f1b" or "gpipe"
  bool zero = false;              // ZeRO-1: split fp32 master weights and Adam states across DP
  std::vector<Pipeline> pipelines;
  int max_seq_len = 0;            // token-budget steps: the longest piece it accepts (0: --max-seq-len)
  // Expert parallelism (docs/moe.md): each sparse layer's experts split
  // over groups of this many token slots (1: every rank holds every expert).
  int expert_parallel = 1;
  // Placements of sparse layers; a layer none covers has the default: member
  // m of a group holds experts [m E/G, (m+1) E/G).
  std::vector<ExpertPlacement> expert_placement;

  int global_batch() const;  // sum of the pipelines' batch()
  // Every rank named by some stage, ascending.
  std::vector<int> ranks() const;
  bool operator==(const Strategy&) const = default;
};

// Parses the strategy JSON of docs/strategy.md: top level
// {"description"?, "schedule"? = "1f1b", "zero"? = false, "pipelines"}, each
// pipeline {"micro_batch_size", "micro_batches", "stages"}, each stage
// {"ranks", "layers": [first, last] (inclusive), "cp"? = 1, "recompute"? =
// false}. Checks the JSON
// structure and types only (see validate() for the rules). Unknown fields
// are errors. Throws hspmd::Error "[strategy] <where>: <rule>" (one line),
// e.g. "[strategy] pipeline 1 stage 0: field 'layers' must be [first, last]".
Strategy strategy_from_json(const nlohmann::json& j);
// Reads and parses a file. Every error names the file: "[strategy] <path>:
// cannot open file", "[strategy] <path>: not valid JSON (...)", "[strategy]
// <path>: pipeline 1 stage 0: ...".
Strategy load_strategy(const std::string& path);
// Every field, "cp" only when not 1, "recompute" only when true,
// "description" only when not empty;
// strategy_from_json reads it back to an equal Strategy.
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
// Also throws "[strategy] world size must be positive" for world_size < 1.
void validate(const Strategy& strategy, const ModelConfig& config, int world_size);

// Expert parallelism of sparse layer `layer` under strategy.expert_parallel
// = G (docs/moe.md): the layer's token slots, pipeline by pipeline and in
// each the cp chunks of the stage holding the layer (a slot: the tp ranks
// holding the same tokens), cut into groups of G consecutive slots; member
// m of a group owns experts [m E/G, (m+1) E/G). expert_group_slots[j] lists
// group j's slots, each its ranks; pipeline_of[j] the pipelines they lie in.
struct ExpertGroups {
  std::vector<std::vector<std::vector<int>>> slots;  // [group][member]: ranks
  std::vector<std::vector<int>> pipelines;           // [group]: the pipelines its slots lie in, ascending
};
ExpertGroups expert_groups(const Strategy& strategy, int64_t layer);
// The members of each group holding expert `expert` of sparse layer
// `layer` (one of `experts`), ascending: the layer's placement or the default.
std::vector<int> expert_members(const Strategy& strategy, int64_t layer, int64_t expert, int64_t experts);

// Ranks of [0, world_size) that no stage names (they stay idle), ascending.
// Ranks outside the world are ignored (validate() rejects them).
std::vector<int> idle_ranks(const Strategy& strategy, int world_size);

// The multiple every sequence length under the strategy must be: the least
// common multiple, over every stage of every pipeline, of cp x tp (sequence
// parallelism splits the sequence over the stage's ranks) and, when cp > 1,
// 2 x cp (context-parallel attention's load-balanced chunks).
int64_t sequence_granularity(const Strategy& strategy);

// How a token-budget step's pieces go to the pipelines (docs/
// mixed_length.md "Per step"). kCost: longest first to the accepting
// pipeline that would finish first by the cost model (device speeds
// included), then first-fit decreasing into micro-batches of the
// pipeline's capacity. kSymmetric: data parallelism blind to device speeds,
// as a homogeneous SPMD system runs it (the HotSPa-like baseline): packed
// first-fit decreasing into micro-batches of the pipelines' smallest
// capacity, each micro-batch to the pipeline with the fewest tokens so far.
enum class DispatchRule { kCost, kSymmetric };
// "cost" / "symmetric"; hspmd::Error naming the option dispatch else.
DispatchRule parse_dispatch_rule(const std::string& name);

// Compact range form of a sorted rank list: {0,1,2,3,5,8,9} -> "0-3,5,8-9";
// "" for an empty list. Used in reports (idle ranks, stage ranks).
std::string format_ranks(const std::vector<int>& ranks);

}  // namespace hspmd
