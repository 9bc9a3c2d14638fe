// Builders shared by the plan tests: a tiny Llama config, stages, pipelines
// and strategies.
#pragma once

#include <utility>
#include <vector>

#include "hspmd/models/config.h"
#include "hspmd/plan/strategy.h"

namespace hspmd::testing {

inline ModelConfig tiny_config(int layers = 4) {
  return ModelConfig{.vocab_size = 64,
                     .hidden_size = 32,
                     .intermediate_size = 64,
                     .num_hidden_layers = layers,
                     .num_attention_heads = 4,
                     .num_key_value_heads = 4,
                     .max_position_embeddings = 16};
}

inline Stage stage(std::vector<int> ranks, int first, int last, int cp = 1) {
  Stage s;
  s.ranks = std::move(ranks);
  s.first_layer = first;
  s.last_layer = last;
  s.cp = cp;
  return s;
}

// A pipeline of two micro-batches of `micro_batch_size` samples.
inline Pipeline pipeline(std::vector<Stage> stages, int micro_batch_size = 1) {
  Pipeline p;
  p.micro_batch_size = micro_batch_size;
  p.micro_batches = 2;
  p.stages = std::move(stages);
  return p;
}

inline Strategy strategy(std::vector<Pipeline> pipelines, bool zero = false) {
  Strategy s;
  s.zero = zero;
  s.pipelines = std::move(pipelines);
  return s;
}

}  // namespace hspmd::testing
