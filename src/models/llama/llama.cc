// Llama (model_type "llama"): the shared decoder as it is.
#include "models/llama/llama.h"

#include "models/config_fields.h"
#include "models/decoder.h"

namespace hspmd {

namespace {

class LlamaFamily final : public DecoderFamily {
 public:
  std::string model_type() const override { return "llama"; }
  // attention_bias / mlp_bias true are refused with the shared fields.
  void read_config(const ConfigFields&, ModelConfig&) const override {}
  void write_config(const ModelConfig&, nlohmann::json&) const override {}
};

}  // namespace

const ModelFamily& llama_family() {
  static const LlamaFamily family;
  return family;
}

}  // namespace hspmd
