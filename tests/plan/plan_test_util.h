// Builders shared by the plan tests: a tiny Llama config and strategy stages.
#pragma once

#include <utility>
#include <vector>

#include "hspmd/models/config.h"
#include "hspmd/plan/strategy.h"

namespace hspmd::testing {

inline LlamaConfig tiny_config(int layers = 4) {
  return LlamaConfig{.vocab_size = 64,
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

}  // namespace hspmd::testing
