// The mixture-of-experts MLP the MoE families share (Mixtral, Qwen2-MoE;
// docs/moe.md): a router, top-k experts (SwiGLU MLPs) over the tokens routed
// to them, and optionally a shared expert behind a sigmoid gate. The
// decoder (models/decoder.cc) builds it in place of the dense MLP of every
// sparse layer (ModelConfig::Moe::sparse_layer).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hspmd/models/model.h"
#include "models/decoder.h"

namespace hspmd {

class ConfigFields;

// The router statistics of the sparse layers built so far, one [E] f32
// tensor per layer each (they live on their layer's devices).
struct MoeTotals {
  std::vector<Tensor> counts;     // (token, slot) pairs per expert
  std::vector<Tensor> prob_sums;  // the router's probabilities summed over the tokens
};

// The placeholder of layer i's auxiliary-loss weights (models/model.h, ModelGraph::aux_weights).
std::string moe_aux_weights_name(int64_t layer);

// The sparse layer i's parameters, in Hugging Face order, through `add`.
void append_moe_parameters(const ModelConfig& c, int64_t i, std::vector<ModelParameter>& out);
// The sparse MLP of layer i on x [B, S, H] (the compute dtype): its output
// [B, S, H] in that dtype. With c.moe.aux_loss() it adds the layer's
// placeholder moe_aux_weights_name(i) ([E] f32), which only the backward reads.
Tensor build_moe_mlp(const ModelConfig& c, const ModelBuildOptions& o, int64_t i, const Tensor& x, Graph& g,
                     MoeTotals& totals);

// The families whose sparse layers build_moe_mlp makes (Mixtral,
// Qwen2-MoE): the shared decoder, with the cost terms of the experts.
class MoeDecoderFamily : public DecoderFamily {
 public:
  // The dense model's, plus per token of a sparse layer what its experts
  // keep (whole on every tp rank): router logits and probabilities, the
  // permuted rows, the experts' gate, up and output rows for each of its k
  // experts, the shared expert's gate, up and output; averaged over the
  // layers. Recomputed: the dense model's (the block's input).
  double activation_bytes_per_token(const ModelConfig& c, double element_bytes, int tp, int cp,
                                    bool recompute) const override;
  // The attention's (and dense layers') TP-split parameters; whole: per
  // sparse layer the router, k experts and the shared expert with its gate.
  LayerCompute layer_compute(const ModelConfig& c) const override;
  std::vector<std::string> expert_weight_names(const ModelConfig& c, int64_t layer, int64_t expert) const override;
  std::string router_weight_name(const ModelConfig& c, int64_t layer) const override;
};

// Reads and checks the fields both families share (num_experts_per_tok,
// norm_topk_prob where the family has it, output_router_logits,
// router_aux_loss_coef) after the family set num_experts and the sizes.
void read_moe_common(const ConfigFields& r, ModelConfig& c);
void write_moe_common(const ModelConfig& c, nlohmann::json& j);

}  // namespace hspmd
