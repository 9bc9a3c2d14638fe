// Mixtral (model_type "mixtral"): the shared decoder with a sparse mixture
// of experts in every layer, as Hugging Face's MixtralSparseMoeBlock builds
// it: block_sparse_moe.gate routes each token to num_experts_per_tok of
// num_local_experts experts (softmax, top-k, the k weights renormalized to
// sum to 1), expert N is the SwiGLU MLP w2(silu(w1 x) * w3 x) of
// intermediate_size. sliding_window as Mistral reads it, but null by
// default (MixtralConfig's). router_jitter_noise must be 0.
#include "models/mixtral/mixtral.h"

#include "models/config_fields.h"
#include "models/decoder.h"
#include "models/moe/moe.h"

namespace hspmd {

namespace {

class MixtralFamily final : public MoeDecoderFamily {
 public:
  std::string model_type() const override { return "mixtral"; }
  void set_defaults(ModelConfig& c) const override {
    c.max_position_embeddings = 4096 * 32;  // MixtralConfig's defaults
    c.rope_theta = 1e6;
    c.eos_token_id = 2;
  }
  void read_config(const ConfigFields& r, ModelConfig& c) const override {
    c.sliding_window = 0;
    r.integer("sliding_window", c.sliding_window, false);
    if (r.given("sliding_window") && c.sliding_window <= 0)
      r.fail_rule("sliding_window=", c.sliding_window, " must be positive (or null: no window)");
    ModelConfig::Moe& m = c.moe;
    m.names = ModelConfig::Moe::Names::kMixtral;
    m.num_experts = 8;
    m.top_k = 2;
    r.integer("num_local_experts", m.num_experts, false);
    if (m.num_experts < 1) r.fail_rule("num_local_experts=", m.num_experts, " must be positive");
    m.expert_intermediate_size = c.intermediate_size;
    m.norm_topk_prob = true;
    read_moe_common(r, c);
  }
  void write_config(const ModelConfig& c, nlohmann::json& j) const override {
    j["sliding_window"] = c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr);
    j["num_local_experts"] = c.moe.num_experts;
    write_moe_common(c, j);
  }
  double attention_pairs(const ModelConfig& c, double s) const override {
    const double w = static_cast<double>(c.sliding_window);
    if (w <= 0 || w >= s) return ModelFamily::attention_pairs(c, s);
    return s * w - w * w / 2;
  }
};

}  // namespace

const ModelFamily& mixtral_family() {
  static const MixtralFamily family;
  return family;
}

}  // namespace hspmd
