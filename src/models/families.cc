// The built-in model families, registered while the program starts: one line
// each (docs/models.md, "Adding a family"). This file and the families live in
// the hspmd_model_families layer, which the plan and everything below it do
// not link: they reach a model through the contract (hspmd/models/model.h)
// only. Executables take the layer whole (hspmd_lib), so that the
// registration below is never dropped by the linker.
#include "hspmd/models/model.h"
#include "models/custom/custom.h"
#include "models/llama/llama.h"
#include "models/mistral/mistral.h"
#include "models/mixtral/mixtral.h"
#include "models/qwen2/qwen2.h"
#include "models/qwen2_moe/qwen2_moe.h"

namespace hspmd {
namespace {

[[maybe_unused]] const bool kRegistered = register_model_family(llama_family()) &&
                                          register_model_family(qwen2_family()) &&
                                          register_model_family(mistral_family()) &&
                                          register_model_family(mixtral_family()) &&
                                          register_model_family(qwen2_moe_family()) &&
                                          register_model_family(custom_family());

}  // namespace
}  // namespace hspmd
