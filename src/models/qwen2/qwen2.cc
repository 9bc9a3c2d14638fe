// Qwen2 (model_type "qwen2"): the shared decoder with biases on the q, k and
// v projections (self_attn.{q,k,v}_proj.bias; o_proj has none), as Hugging
// Face's Qwen2Attention builds them. Sliding-window layers
// (use_sliding_window: true, which Qwen2 applies from layer
// max_window_layers on) are not built and refused.
#include "models/qwen2/qwen2.h"

#include "models/config_fields.h"
#include "models/decoder.h"

namespace hspmd {

namespace {

class Qwen2Family final : public DecoderFamily {
 public:
  std::string model_type() const override { return "qwen2"; }
  void set_defaults(ModelConfig& c) const override {
    c.max_position_embeddings = 32768;  // Qwen2Config's defaults
    c.attention_bias = true;
  }
  void read_config(const ConfigFields& r, ModelConfig& c) const override {
    bool sliding = false;
    r.boolean("use_sliding_window", sliding);
    if (sliding)
      r.fail_rule("use_sliding_window=true is not supported (Qwen2's per-layer sliding window from "
                  "max_window_layers on; only false)");
    c.attention_bias = true;
    c.sliding_window = 0;
  }
  void write_config(const ModelConfig&, nlohmann::json& j) const override { j["use_sliding_window"] = false; }
};

}  // namespace

const ModelFamily& qwen2_family() {
  static const Qwen2Family family;
  return family;
}

}  // namespace hspmd
