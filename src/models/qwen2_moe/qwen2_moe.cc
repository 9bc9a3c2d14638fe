// Qwen2-MoE (model_type "qwen2_moe"): the Qwen2 decoder (q/k/v biases) whose
// MLP is, on layer i when (i + 1) % decoder_sparse_step == 0 and i is not in
// mlp_only_layers, Hugging Face's Qwen2MoeSparseMoeBlock: mlp.gate routes
// each token to num_experts_per_tok of num_experts experts (softmax, top-k,
// renormalized only with norm_topk_prob), experts of moe_intermediate_size,
// plus mlp.shared_expert (shared_expert_intermediate_size) scaled by
// sigmoid(mlp.shared_expert_gate x). Other layers keep the dense MLP of
// intermediate_size. use_sliding_window=true is refused as for Qwen2.
#include "models/qwen2_moe/qwen2_moe.h"

#include "models/config_fields.h"
#include "models/decoder.h"
#include "models/moe/moe.h"

namespace hspmd {

namespace {

class Qwen2MoeFamily final : public MoeDecoderFamily {
 public:
  std::string model_type() const override { return "qwen2_moe"; }
  void set_defaults(ModelConfig& c) const override {
    c.max_position_embeddings = 32768;  // Qwen2MoeConfig's defaults
    c.attention_bias = true;
  }
  void read_config(const ConfigFields& r, ModelConfig& c) const override {
    bool sliding = false;
    r.boolean("use_sliding_window", sliding);
    if (sliding)
      r.fail_rule("use_sliding_window=true is not supported (Qwen2-MoE's per-layer sliding window; only false)");
    c.attention_bias = true;
    c.sliding_window = 0;
    ModelConfig::Moe& m = c.moe;
    m.names = ModelConfig::Moe::Names::kQwen2Moe;
    m.num_experts = 60;
    m.top_k = 4;
    m.expert_intermediate_size = 1408;
    m.shared_expert_intermediate_size = 5632;
    m.norm_topk_prob = false;
    r.integer("num_experts", m.num_experts, false);
    r.integer("moe_intermediate_size", m.expert_intermediate_size, false);
    r.integer("shared_expert_intermediate_size", m.shared_expert_intermediate_size, false);
    r.boolean("norm_topk_prob", m.norm_topk_prob);
    r.integer("decoder_sparse_step", m.decoder_sparse_step, false);
    if (m.decoder_sparse_step < 1) r.fail_rule("decoder_sparse_step=", m.decoder_sparse_step, " must be positive");
    if (m.num_experts > 0 && m.shared_expert_intermediate_size <= 0)
      r.fail_rule("shared_expert_intermediate_size=", m.shared_expert_intermediate_size, " must be positive");
    m.mlp_only_layers.clear();
    if (r.given("mlp_only_layers")) {
      const nlohmann::json& v = r.object()["mlp_only_layers"];
      if (!v.is_array()) r.fail_rule("field 'mlp_only_layers' must be a list of layer indices");
      for (const nlohmann::json& e : v) {
        if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() >= c.num_hidden_layers)
          r.fail_rule("mlp_only_layers: ", e.dump(), " is not a layer index in [0, ", c.num_hidden_layers, ")");
        m.mlp_only_layers.push_back(e.get<int64_t>());
      }
    }
    read_moe_common(r, c);
  }
  void write_config(const ModelConfig& c, nlohmann::json& j) const override {
    j["use_sliding_window"] = false;
    j["num_experts"] = c.moe.num_experts;
    j["moe_intermediate_size"] = c.moe.expert_intermediate_size;
    j["shared_expert_intermediate_size"] = c.moe.shared_expert_intermediate_size;
    j["norm_topk_prob"] = c.moe.norm_topk_prob;
    j["decoder_sparse_step"] = c.moe.decoder_sparse_step;
    j["mlp_only_layers"] = c.moe.mlp_only_layers;
    write_moe_common(c, j);
  }
};

}  // namespace

const ModelFamily& qwen2_moe_family() {
  static const Qwen2MoeFamily family;
  return family;
}

}  // namespace hspmd
