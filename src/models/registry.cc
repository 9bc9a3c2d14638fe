// The registry of model families and the family-independent functions,
// which forward to the config's family (models/model.h).
#include <algorithm>
#include <string>
#include <map>

#include "hspmd/core/error.h"
#include "hspmd/core/rng.h"
#include "hspmd/models/model.h"

namespace hspmd {

namespace {

// The registered families (filled when the program starts: the families
// layer registers its own, src/models/families.cc).
std::map<std::string, const ModelFamily*>& families() {
  static std::map<std::string, const ModelFamily*> all;
  return all;
}

}  // namespace

bool register_model_family(const ModelFamily& family) {
  const auto [it, added] = families().emplace(family.model_type(), &family);
  HSPMD_CHECK(added || it->second == &family, "model_type '", family.model_type(), "' registered twice");
  return true;
}

double ModelFamily::attention_pairs(const ModelConfig&, double seq_len) const { return seq_len * seq_len / 2; }

double ModelFamily::activation_bytes_per_token(const ModelConfig& c, double element_bytes, int tp, int cp,
                                               bool recompute) const {
  // The norms' inputs and outputs, q, k, v and their rotated copies, the
  // attention output and its log-sum-exp (fp32), the MLP's gate, up and
  // product, and the residual sums; recomputed: only the block's input.
  const double h = static_cast<double>(c.hidden_size), f = static_cast<double>(c.intermediate_size);
  const double kv = static_cast<double>(c.kv_heads() * c.head_dim());
  const double heads = static_cast<double>(c.num_attention_heads);
  if (recompute) return h * element_bytes / (tp * cp);
  return ((8 * h + 4 * kv + 4 * f) * element_bytes + heads * 4.0) / (tp * cp);
}

ModelFamily::LayerCompute ModelFamily::layer_compute(const ModelConfig& c) const {
  LayerCompute out;
  if (c.num_hidden_layers <= 0) return out;
  for (const ModelParameter& p : parameters(c)) {
    if (p.part != ModelPart::kBlock || (p.role != ParamRole::kColumnParallel && p.role != ParamRole::kRowParallel))
      continue;
    double n = 1;
    for (int64_t d : p.shape) n *= static_cast<double>(d);
    out.tp_split += n;
  }
  out.tp_split /= static_cast<double>(c.num_hidden_layers);
  return out;
}

const ModelFamily* find_model_family(const std::string& model_type) {
  const auto it = families().find(model_type);
  return it == families().end() ? nullptr : it->second;
}

const ModelFamily& model_family(const std::string& model_type) {
  if (const ModelFamily* f = find_model_family(model_type)) return *f;
  fail("[config] model_type '", model_type, "' is not supported (registered: ", registered_model_types(), ")");
}

std::string registered_model_types() {
  std::string out;
  for (const auto& [type, family] : families()) out += (out.empty() ? "" : ", ") + type;
  return out;
}

std::vector<ModelParameter> model_parameters(const ModelConfig& c) {
  return model_family(c.model_type).parameters(c);
}

std::vector<std::pair<std::string, Shape>> model_parameter_shapes(const ModelConfig& c) {
  std::vector<std::pair<std::string, Shape>> shapes;
  for (ModelParameter& p : model_parameters(c)) shapes.emplace_back(std::move(p.name), std::move(p.shape));
  return shapes;
}

std::vector<ReshardPoint> model_reshard_points(const ModelConfig& c) {
  return model_family(c.model_type).reshard_points(c);
}

std::vector<std::string> moe_expert_weight_names(const ModelConfig& c, int64_t layer, int64_t expert) {
  return model_family(c.model_type).expert_weight_names(c, layer, expert);
}

std::string moe_router_weight_name(const ModelConfig& c, int64_t layer) {
  return model_family(c.model_type).router_weight_name(c, layer);
}

ModelGraph build_model(const ModelConfig& c, const ModelBuildOptions& o) {
  return model_family(c.model_type).build(c, o);
}

ModelGraph build_model(const ModelConfig& c, bool packed_documents) {
  ModelBuildOptions o;
  o.packed_documents = packed_documents;
  return build_model(c, o);
}

std::map<std::string, NDArray> init_model_parameters(const ModelConfig& c, uint64_t seed) {
  check_parameters_fit_memory(c, "model to initialize");
  std::map<std::string, NDArray> params;
  for (const ModelParameter& p : model_parameters(c)) {
    NDArray a = NDArray::empty(p.shape, DType::F32);
    if (p.init == ParamInit::kOnes)
      a.fill(1.0f);
    else if (p.init == ParamInit::kZeros)
      a.fill(0.0f);
    else
      fill_normal(a, seed, p.name, static_cast<float>(c.initializer_range));
    params.emplace(p.name, std::move(a));
  }
  return params;
}

std::map<std::string, NDArray> validate_model_weights(const ModelConfig& c,
                                                      std::map<std::string, NDArray> weights,
                                                      const std::string& source) {
  std::map<std::string, NDArray> out;
  for (const auto& [name, shape] : model_parameter_shapes(c)) {
    auto it = weights.find(name);
    if (it == weights.end()) fail("[weights] ", source, ": missing tensor ", name);
    const NDArray& a = it->second;
    if (a.dtype() != DType::F32 && a.dtype() != DType::BF16)
      fail("[weights] ", source, ": ", name, ": dtype ", dtype_name(a.dtype()),
           " is not F32 or BF16");
    if (a.shape() != shape)
      fail("[weights] ", source, ": ", name, ": shape ", shape_str(a.shape()), " but the config needs ",
           shape_str(shape));
    out.emplace(name, a.dtype() == DType::F32 ? a.contiguous() : a.to(DType::F32));
    weights.erase(it);
  }
  if (c.tie_word_embeddings) weights.erase("lm_head.weight");
  if (!weights.empty())
    fail("[weights] ", source, ": unexpected tensor ", weights.begin()->first,
         " (not a parameter of this model)");
  return out;
}

}  // namespace hspmd
