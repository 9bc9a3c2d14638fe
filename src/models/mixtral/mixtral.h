#pragma once

#include "hspmd/models/model.h"

namespace hspmd {

// Hugging Face MixtralForCausalLM: the Mistral decoder whose every MLP is a
// sparse mixture of experts (block_sparse_moe).
const ModelFamily& mixtral_family();

}  // namespace hspmd
