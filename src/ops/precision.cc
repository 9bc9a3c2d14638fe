// Precision's device policy (ops/precision.h): the attention kernels say
// whether they round O to bf16; HSPMD_ATTENTION_IO overrides them.
#include "hspmd/ops/precision.h"

#include <cstdlib>

#include "hspmd/core/error.h"
#include "kernels/attention.h"

namespace hspmd {

DType parse_precision_name(const std::string& name, const std::string& what) {
  if (name == "fp32" || name == "f32") return DType::F32;
  if (name == "bf16") return DType::BF16;
  fail("[precision] ", what, ": '", name, "' (expected fp32 or bf16)");
}

Precision Precision::for_device(const Device& device) const {
  const char* io = std::getenv("HSPMD_ATTENTION_IO");
  const std::string mode = io ? io : "auto";
  if (mode != "auto" && mode != "bf16" && mode != "f32")
    fail("[precision] HSPMD_ATTENTION_IO: '", mode, "' (expected auto; bf16 for the GPU's bf16 attention "
         "output and gradients on any device; f32 to keep them f32 on a GPU too)");
  Precision p = *this;
  const bool bf16_io = mode == "bf16" || (mode == "auto" && kernels::fused_attention_rounds_output(device));
  p.attention_output = mixed() && bf16_io ? DType::BF16 : DType::F32;
  return p;
}

}  // namespace hspmd
