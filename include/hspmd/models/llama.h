// The Llama model (Hugging Face LlamaForCausalLM semantics) as a defined graph.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hspmd/core/ndarray.h"
#include "hspmd/graph/graph.h"
#include "hspmd/models/config.h"

namespace hspmd {

// Names and shapes of the model's parameters, in Hugging Face order and naming
// (lm_head.weight only when the embeddings are not tied).
std::vector<std::pair<std::string, Shape>> llama_parameter_shapes(const LlamaConfig& config);

// The training graph of one model replica. Placeholders (B, S symbolic):
//   input_ids, targets, positions: i32 [B, S]; normalizer: f32 scalar (number
//   of counted target tokens of the whole global batch). With packed
//   documents, positions restart at 0 at each document and also mask the
//   attention to each token's own document (docs/data.md).
struct LlamaGraph {
  std::unique_ptr<Graph> graph = std::make_unique<Graph>();
  Tensor input_ids, targets, positions, normalizer;
  Tensor loss;                       // scalar: sum of token losses / normalizer
  std::vector<std::string> names;    // parameter names, same order as params/grads
  std::vector<Tensor> params;
  std::vector<Tensor> grads;         // d(loss)/d(param)
};

struct LlamaBuildOptions {
  bool packed_documents = false;  // attention masked per document by the positions
  // Add the named Reshard points an annotation plan refers to (docs/plan.md):
  //   model.embed_tokens.out                 embedding output (vocab-parallel sum)
  //   model.layers.{i}.input                 hidden state entering block i
  //   model.layers.{i}.positions             positions used by block i
  //   model.layers.{i}.attn_input / mlp_input    normed input of attention / MLP
  //   model.layers.{i}.attn_output / mlp_output  o_proj / down_proj output
  //   lm_head.input                          normed hidden state entering the LM head
  //   lm_head.weight                         (tied embeddings) the embedding as LM head
  //   grad.{parameter}                       each parameter's gradient (gradient sync)
  // On one device every Reshard is the identity: the loss is unchanged.
  bool reshard_points = false;
  bool context_parallel = false;  // attention may take a sequence-split input
};

// Builds the forward graph and its backward graph. Throws hspmd::Error for an
// invalid config. With reshard points, `grads` are the outputs of the
// grad.{parameter} Reshards.
LlamaGraph build_llama(const LlamaConfig& config, const LlamaBuildOptions& options);
LlamaGraph build_llama(const LlamaConfig& config, bool packed_documents = false);

// Initial parameters: linear and embedding weights ~ N(0, initializer_range^2),
// norm weights = 1. Each tensor depends only on (seed, its name).
std::map<std::string, NDArray> init_llama_parameters(const LlamaConfig& config, uint64_t seed);

// Checks that `weights` (e.g. loaded from safetensors) holds exactly the
// model's tensors with the right shapes, and converts them to f32. Extra
// tensors are an error too (except lm_head.weight when embeddings are tied,
// which must then equal nothing: it is ignored). Throws hspmd::Error
// "[weights] <source>: <tensor>: <rule>".
std::map<std::string, NDArray> validate_llama_weights(const LlamaConfig& config,
                                                      std::map<std::string, NDArray> weights,
                                                      const std::string& source);

}  // namespace hspmd
