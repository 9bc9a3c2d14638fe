#pragma once

#include "hspmd/models/model.h"

namespace hspmd {

// A model defined by the user (model_type "hspmd_custom"): its config's
// "program" field lists the parameters with their roles and the ops of the
// embedding, of one block (instantiated for every layer) and of the head
// (docs/models.md, "Custom models"; hspmd.models.Builder writes it).
const ModelFamily& custom_family();

}  // namespace hspmd
