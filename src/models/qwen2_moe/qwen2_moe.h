#pragma once

#include "hspmd/models/model.h"

namespace hspmd {

// Hugging Face Qwen2MoeForCausalLM: the Qwen2 decoder with sparse
// mixture-of-experts MLPs (and a gated shared expert) on the layers
// decoder_sparse_step and mlp_only_layers select.
const ModelFamily& qwen2_moe_family();

}  // namespace hspmd
