#pragma once

#include "hspmd/models/model.h"

namespace hspmd {

// Hugging Face Qwen2ForCausalLM: the Llama decoder with q/k/v biases.
const ModelFamily& qwen2_family();

}  // namespace hspmd
