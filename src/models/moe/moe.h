// The mixture-of-experts MLP the MoE families share (Mixtral, Qwen2-MoE;
// docs/moe.md): a router, top-k experts (SwiGLU MLPs) over the tokens routed
// to them, and optionally a shared expert behind a sigmoid gate. The
// decoder (models/decoder.cc) builds it in place of the dense MLP of every
// sparse layer (ModelConfig::Moe::sparse_layer).
#pragma once

#include <cstdint>
#include <vector>

#include "hspmd/models/model.h"

namespace hspmd {

class ConfigFields;

// The router statistics and the auxiliary loss's terms of the layers built
// so far, summed over the layers (invalid before the first sparse layer).
struct MoeTotals {
  Tensor counts;     // [E]: (token, slot) pairs per expert
  Tensor prob_sums;  // [E]: the router's probabilities summed over the tokens
  Tensor aux_seed;   // the auxiliary loss's gradient seeds (a zero scalar)
};

// The sparse layer i's parameters, in Hugging Face order, through `add`.
void append_moe_parameters(const ModelConfig& c, int64_t i, std::vector<ModelParameter>& out);
// The sparse MLP of layer i on x [B, S, H] (the compute dtype): its output
// [B, S, H] in that dtype. `aux_weights` ([E], valid when c.moe.aux_loss())
// is the placeholder of the auxiliary loss's per-expert weights.
Tensor build_moe_mlp(const ModelConfig& c, const ModelBuildOptions& o, int64_t i, const Tensor& x,
                     const Tensor& aux_weights, Graph& g, MoeTotals& totals);

// Reads and checks the fields both families share (num_experts_per_tok,
// norm_topk_prob where the family has it, output_router_logits,
// router_aux_loss_coef) after the family set num_experts and the sizes.
void read_moe_common(const ConfigFields& r, ModelConfig& c);
void write_moe_common(const ModelConfig& c, nlohmann::json& j);

}  // namespace hspmd
