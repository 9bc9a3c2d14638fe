// Builders shared by the plan tests: a tiny Llama config and strategy stages.
#pragma once

#include <utility>
#include <vector>

#include "hspmd/models/config.h"
#include "hspmd/plan/strategy.h"

namespace hspmd::testing {

inline LlamaConfig tiny_config(int layers = 4) {
  LlamaConfig c;
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.max_position_embeddings = 16;
  return c;
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
