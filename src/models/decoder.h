// The pre-norm decoder the registered families share (Hugging Face
// LlamaForCausalLM's structure): embedding, blocks of RMSNorm, attention
// with RoPE and grouped-query heads, RMSNorm, SwiGLU MLP, residuals; a final
// RMSNorm and the LM head (tied or not). The config's family features vary
// it: q/k/v biases (attention_bias) and a sliding window (sliding_window).
// A family of another structure writes its own builder beside its
// registration (docs/models.md).
#pragma once

#include <vector>

#include "hspmd/models/model.h"

namespace hspmd {

std::vector<ModelParameter> decoder_parameters(const ModelConfig& c);
std::vector<ReshardPoint> decoder_reshard_points(const ModelConfig& c);
ModelGraph build_decoder(const ModelConfig& c, const ModelBuildOptions& o);

// A family built by the shared decoder: its parameters, points, graph and
// cost terms come from it; a subclass reads and writes its own config fields.
class DecoderFamily : public ModelFamily {
 public:
  std::vector<ModelParameter> parameters(const ModelConfig& c) const override { return decoder_parameters(c); }
  std::vector<ReshardPoint> reshard_points(const ModelConfig& c) const override {
    return decoder_reshard_points(c);
  }
  ModelGraph build(const ModelConfig& c, const ModelBuildOptions& o) const override { return build_decoder(c, o); }
};

}  // namespace hspmd
