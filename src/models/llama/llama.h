#pragma once

#include "hspmd/models/model.h"

namespace hspmd {

// Hugging Face LlamaForCausalLM.
const ModelFamily& llama_family();

}  // namespace hspmd
