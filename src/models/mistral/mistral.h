#pragma once

#include "hspmd/models/model.h"

namespace hspmd {

// Hugging Face MistralForCausalLM: the Llama decoder with sliding-window
// attention.
const ModelFamily& mistral_family();

}  // namespace hspmd
