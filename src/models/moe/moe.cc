// The mixture-of-experts MLP (moe.h): parameters, the graph, the shared
// config fields.
#include "models/moe/moe.h"

#include <string>

#include "hspmd/core/error.h"
#include "hspmd/ops/ops.h"
#include "models/config_fields.h"

namespace hspmd {

namespace {

using Names = ModelConfig::Moe::Names;

std::string prefix(const ModelConfig& c, int64_t i) {
  return "model.layers." + std::to_string(i) + (c.moe.names == Names::kMixtral ? ".block_sparse_moe." : ".mlp.");
}

// Expert e's three projections: (gate, up, down) in the family's names.
struct ExpertNames {
  std::string gate, up, down;
};

ExpertNames expert_names(const ModelConfig& c, int64_t i, int64_t e) {
  const std::string p = prefix(c, i) + "experts." + std::to_string(e) + ".";
  if (c.moe.names == Names::kMixtral) return {p + "w1.weight", p + "w3.weight", p + "w2.weight"};
  return {p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"};
}

}  // namespace

void append_moe_parameters(const ModelConfig& c, int64_t i, std::vector<ModelParameter>& out) {
  const int64_t H = c.hidden_size, E = c.moe.num_experts, F = c.moe.expert_intermediate_size;
  // Every tensor of the layer replicated over a stage's tensor-parallel
  // ranks (which then route and compute the same tokens): tensor
  // parallelism inside the experts and expert parallelism are not built yet
  // (docs/moe.md).
  const ParamRole col = ParamRole::kReplicated, row = ParamRole::kReplicated, rep = ParamRole::kReplicated;
  auto add = [&](std::string name, Shape shape, ParamRole role) {
    out.push_back({std::move(name), std::move(shape), role, ParamInit::kNormal, ModelPart::kBlock, i});
  };
  const std::string p = prefix(c, i);
  add(p + "gate.weight", {E, H}, rep);
  for (int64_t e = 0; e < E; ++e) {
    const ExpertNames n = expert_names(c, i, e);
    if (c.moe.names == Names::kMixtral) {  // w1, w2, w3: HF's registration order
      add(n.gate, {F, H}, col);
      add(n.down, {H, F}, row);
      add(n.up, {F, H}, col);
    } else {
      add(n.gate, {F, H}, col);
      add(n.up, {F, H}, col);
      add(n.down, {H, F}, row);
    }
  }
  if (const int64_t S = c.moe.shared_expert_intermediate_size; S > 0) {
    add(p + "shared_expert.gate_proj.weight", {S, H}, col);
    add(p + "shared_expert.up_proj.weight", {S, H}, col);
    add(p + "shared_expert.down_proj.weight", {H, S}, row);
    add(p + "shared_expert_gate.weight", {1, H}, rep);
  }
}

std::vector<std::string> MoeDecoderFamily::expert_weight_names(const ModelConfig& c, int64_t layer,
                                                               int64_t expert) const {
  const ExpertNames n = expert_names(c, layer, expert);
  return {n.gate, n.up, n.down};
}

std::string MoeDecoderFamily::router_weight_name(const ModelConfig& c, int64_t layer) const {
  return prefix(c, layer) + "gate.weight";
}

std::string moe_aux_weights_name(int64_t layer) { return "moe_aux_weights." + std::to_string(layer); }

Tensor build_moe_mlp(const ModelConfig& c, const ModelBuildOptions& o, int64_t i, const Tensor& x, Graph& g,
                     MoeTotals& totals) {
  const int64_t E = c.moe.num_experts;
  const DType act = o.precision.compute;
  const auto lo = [&](const std::string& name) { return ops::cast(g.find(name), act); };
  const std::string p = prefix(c, i);
  // The router in f32 (Hugging Face's softmax runs in float), its GEMM
  // operands in the compute dtype.
  const Tensor logits = ops::linear(x, lo(p + "gate.weight"), DType::F32);
  const ops::MoeRouting r = ops::moe_route(logits, c.moe.top_k, c.moe.norm_topk_prob);
  // The experts: each token's row once per chosen expert, in expert order;
  // every expert's SwiGLU MLP over its rows; back to the tokens weighted.
  const Tensor rows = ops::moe_permute(ops::cast(x, DType::F32), r.indices, E);
  std::vector<Tensor> gate, up, down;
  for (int64_t e = 0; e < E; ++e) {
    const ExpertNames n = expert_names(c, i, e);
    gate.push_back(lo(n.gate));
    up.push_back(lo(n.up));
    down.push_back(lo(n.down));
  }
  // The GEMMs' operands both in the compute dtype (bf16 x bf16 where the
  // precision says so, as the dense MLP's); their products and the rest f32.
  const Tensor rows_lo = ops::cast(rows, act);
  Tensor expert_out;
  if (o.expert_parallel) {  // the experts as one op, their weights on their owners
    expert_out = ops::moe_experts(rows_lo, r.indices, gate, up, down);
  } else {
    const Tensor hidden =
        ops::swiglu(ops::grouped_linear(rows_lo, r.indices, gate), ops::grouped_linear(rows_lo, r.indices, up));
    expert_out = ops::grouped_linear(ops::cast(hidden, act), r.indices, down);
  }
  Tensor y = ops::moe_combine(expert_out, r.indices, r.weights, E);
  if (c.moe.shared_expert_intermediate_size > 0) {
    const Tensor s = ops::linear(ops::swiglu(ops::linear(x, lo(p + "shared_expert.gate_proj.weight"), act),
                                             ops::linear(x, lo(p + "shared_expert.up_proj.weight"), act)),
                                 lo(p + "shared_expert.down_proj.weight"), DType::F32);
    const Tensor gate_logit = ops::linear(x, lo(p + "shared_expert_gate.weight"), DType::F32);
    y = ops::add(y, ops::sigmoid_gate(s, gate_logit));
  }
  // The statistics of the auxiliary loss (and the step record), and the
  // loss's gradient on the router's probabilities.
  totals.counts.push_back(ops::moe_counts(r.indices, E));
  totals.prob_sums.push_back(ops::reduce_sum(r.probs, {0, 1}));
  if (c.moe.aux_loss())
    y = ops::moe_aux_tap(y, r.probs, g.placeholder(moe_aux_weights_name(i), {E}, DType::F32));
  return ops::cast(y, act);
}

namespace {

// Per sparse layer and token: the experts' elements a forward keeps, and
// the parameters it multiplies by.
double sparse_fraction(const ModelConfig& c) {
  return c.num_hidden_layers > 0 ? static_cast<double>(c.sparse_layers()) / static_cast<double>(c.num_hidden_layers)
                                 : 0.0;
}

}  // namespace

double MoeDecoderFamily::activation_bytes_per_token(const ModelConfig& c, double element_bytes, int tp, int cp,
                                                    bool recompute) const {
  const double dense = ModelFamily::activation_bytes_per_token(c, element_bytes, tp, cp, recompute);
  if (recompute) return dense;
  const double h = static_cast<double>(c.hidden_size), k = static_cast<double>(c.moe.top_k);
  const double e = static_cast<double>(c.moe.num_experts), f = static_cast<double>(c.moe.expert_intermediate_size);
  const double s = static_cast<double>(c.moe.shared_expert_intermediate_size);
  // f32 router state and rows (the MoE ops compute in f32), the dense MLP's
  // gate and up (4 f in the default) not built on a sparse layer.
  const double sparse = (2 * e + 2 * k + k * (2 * h + 3 * f) + (s > 0 ? 3 * s + 2 * h : 0)) * 4.0 / cp -
                        4 * static_cast<double>(c.intermediate_size) * element_bytes / (tp * cp);
  return dense + sparse_fraction(c) * sparse;
}

ModelFamily::LayerCompute MoeDecoderFamily::layer_compute(const ModelConfig& c) const {
  LayerCompute out = ModelFamily::layer_compute(c);  // the attention's and the dense layers' TP-split parameters
  const double h = static_cast<double>(c.hidden_size), k = static_cast<double>(c.moe.top_k);
  const double e = static_cast<double>(c.moe.num_experts), f = static_cast<double>(c.moe.expert_intermediate_size);
  const double s = static_cast<double>(c.moe.shared_expert_intermediate_size);
  out.whole = sparse_fraction(c) * (e * h + k * 3 * h * f + (s > 0 ? 3 * h * s + h : 0));
  return out;
}

void read_moe_common(const ConfigFields& r, ModelConfig& c) {
  ModelConfig::Moe& m = c.moe;
  r.integer("num_experts_per_tok", m.top_k, false);
  r.boolean("output_router_logits", m.output_router_logits);
  r.number("router_aux_loss_coef", m.router_aux_loss_coef);
  if (m.num_experts < 0) r.fail_rule("the number of experts ", m.num_experts, " must not be negative");
  if (m.num_experts > 0 && (m.top_k < 1 || m.top_k > m.num_experts))
    r.fail_rule("num_experts_per_tok=", m.top_k, " must lie in [1, ", m.num_experts, "] (the number of experts)");
  if (m.num_experts > 0 && m.expert_intermediate_size <= 0)
    r.fail_rule("the experts' intermediate size ", m.expert_intermediate_size, " must be positive");
  if (!(m.router_aux_loss_coef >= 0))
    r.fail_rule("router_aux_loss_coef=", m.router_aux_loss_coef, " must not be negative");
  double jitter = 0;
  r.number("router_jitter_noise", jitter);
  if (jitter != 0)
    r.fail_rule("router_jitter_noise=", jitter, " is not supported (only 0: hspmd's routing is deterministic)");
}

void write_moe_common(const ModelConfig& c, nlohmann::json& j) {
  j["num_experts_per_tok"] = c.moe.top_k;
  j["output_router_logits"] = c.moe.output_router_logits;
  j["router_aux_loss_coef"] = c.moe.router_aux_loss_coef;
}

}  // namespace hspmd
