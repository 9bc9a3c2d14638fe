#include "hspmd/models/llama.h"

#include <cmath>

#include "hspmd/core/error.h"
#include "hspmd/core/rng.h"
#include "hspmd/graph/autodiff.h"
#include "hspmd/ops/ops.h"

namespace hspmd {

namespace {

std::string layer_prefix(int64_t i) { return "model.layers." + std::to_string(i) + "."; }

bool is_norm_weight(const std::string& name) {
  return name.find("norm.weight") != std::string::npos;
}

// A named Reshard point when the options ask for them, else `t` itself.
Tensor mark(const LlamaBuildOptions& o, const Tensor& t, const std::string& name) {
  return o.reshard_points ? ops::reshard(t, name) : t;
}

// One transformer block: pre-norm attention and SwiGLU MLP with residuals.
Tensor transformer_block(const LlamaConfig& c, const LlamaBuildOptions& o, int64_t i, Tensor h,
                         const LlamaGraph& m, Graph& g) {
  const std::string p = layer_prefix(i);
  auto param = [&](const std::string& n) { return g.find(p + n); };
  h = mark(o, h, p + "input");
  const Tensor positions = mark(o, m.positions, p + "positions");
  const SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
  const int64_t D = c.head_dim(), Hq = c.num_attention_heads, Hkv = c.kv_heads();
  const float theta = static_cast<float>(c.rope_theta);

  Tensor x = mark(o, ops::rms_norm(h, param("input_layernorm.weight"), static_cast<float>(c.rms_norm_eps)),
                  p + "attn_input");
  Tensor q = ops::reshape(ops::linear(x, param("self_attn.q_proj.weight")), {B, S, Hq, D});
  Tensor k = ops::reshape(ops::linear(x, param("self_attn.k_proj.weight")), {B, S, Hkv, D});
  Tensor v = ops::reshape(ops::linear(x, param("self_attn.v_proj.weight")), {B, S, Hkv, D});
  q = ops::rope(q, positions, theta);
  k = ops::rope(k, positions, theta);
  // Packed documents: the positions (restarting at 0 at each document) also
  // mask the attention to each token's own document.
  Tensor a = ops::attention(q, k, v, o.packed_documents ? positions : Tensor(),
                            static_cast<float>(1.0 / std::sqrt(D)), o.context_parallel);
  a = ops::reshape(a, {B, S, Hq * D});
  h = ops::add(h, mark(o, ops::linear(a, param("self_attn.o_proj.weight")), p + "attn_output"));

  x = mark(o, ops::rms_norm(h, param("post_attention_layernorm.weight"),
                            static_cast<float>(c.rms_norm_eps)),
           p + "mlp_input");
  Tensor gate = ops::linear(x, param("mlp.gate_proj.weight"));
  Tensor up = ops::linear(x, param("mlp.up_proj.weight"));
  Tensor down = ops::linear(ops::swiglu(gate, up), param("mlp.down_proj.weight"));
  return ops::add(h, mark(o, down, p + "mlp_output"));
}

}  // namespace

std::vector<std::pair<std::string, Shape>> llama_parameter_shapes(const LlamaConfig& c) {
  const int64_t H = c.hidden_size, D = c.head_dim(), F = c.intermediate_size;
  const int64_t q_out = c.num_attention_heads * D, kv_out = c.kv_heads() * D;
  std::vector<std::pair<std::string, Shape>> shapes = {{"model.embed_tokens.weight",
                                                        {c.table_rows(), H}}};
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = layer_prefix(i);
    shapes.push_back({p + "self_attn.q_proj.weight", {q_out, H}});
    shapes.push_back({p + "self_attn.k_proj.weight", {kv_out, H}});
    shapes.push_back({p + "self_attn.v_proj.weight", {kv_out, H}});
    shapes.push_back({p + "self_attn.o_proj.weight", {H, q_out}});
    shapes.push_back({p + "mlp.gate_proj.weight", {F, H}});
    shapes.push_back({p + "mlp.up_proj.weight", {F, H}});
    shapes.push_back({p + "mlp.down_proj.weight", {H, F}});
    shapes.push_back({p + "input_layernorm.weight", {H}});
    shapes.push_back({p + "post_attention_layernorm.weight", {H}});
  }
  shapes.push_back({"model.norm.weight", {H}});
  if (!c.tie_word_embeddings) shapes.push_back({"lm_head.weight", {c.table_rows(), H}});
  return shapes;
}

LlamaGraph build_llama(const LlamaConfig& c, bool packed_documents) {
  LlamaBuildOptions o;
  o.packed_documents = packed_documents;
  return build_llama(c, o);
}

LlamaGraph build_llama(const LlamaConfig& c, const LlamaBuildOptions& o) {
  LlamaGraph m;
  Graph& g = *m.graph;
  const SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
  m.input_ids = g.placeholder("input_ids", {B, S}, DType::I32);
  m.targets = g.placeholder("targets", {B, S}, DType::I32);
  m.positions = g.placeholder("positions", {B, S}, DType::I32);
  m.normalizer = g.placeholder("normalizer", {}, DType::F32);
  for (const auto& [name, shape] : llama_parameter_shapes(c)) {
    m.names.push_back(name);
    m.params.push_back(g.parameter(name, shape));
  }

  Tensor h = mark(o, ops::embedding(g.find("model.embed_tokens.weight"), m.input_ids),
                  "model.embed_tokens.out");
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) h = transformer_block(c, o, i, h, m, g);
  h = mark(o, ops::rms_norm(h, g.find("model.norm.weight"), static_cast<float>(c.rms_norm_eps)),
           "lm_head.input");
  Tensor head = c.tie_word_embeddings
                    ? mark(o, g.find("model.embed_tokens.weight"), "lm_head.weight")
                    : g.find("lm_head.weight");
  Tensor logits = ops::linear(h, head);
  // Padded vocabulary: only the first vocab_size logits are classes.
  m.loss = ops::cross_entropy(logits, m.targets, m.normalizer, -100,
                              c.table_rows() != c.vocab_size ? c.vocab_size : 0);
  m.grads = gradients(m.loss, m.params);
  for (size_t i = 0; i < m.grads.size(); ++i) {
    HSPMD_CHECK(m.grads[i].valid(), "parameter ", m.names[i], " does not reach the loss");
    m.grads[i] = mark(o, m.grads[i], "grad." + m.names[i]);
  }
  return m;
}

std::map<std::string, NDArray> init_llama_parameters(const LlamaConfig& c, uint64_t seed) {
  std::map<std::string, NDArray> params;
  for (const auto& [name, shape] : llama_parameter_shapes(c)) {
    NDArray a = NDArray::empty(shape, DType::F32);
    if (is_norm_weight(name))
      a.fill(1.0f);
    else
      fill_normal(a, seed, name, static_cast<float>(c.initializer_range));
    params.emplace(name, std::move(a));
  }
  return params;
}

std::map<std::string, NDArray> validate_llama_weights(const LlamaConfig& c,
                                                      std::map<std::string, NDArray> weights,
                                                      const std::string& source) {
  std::map<std::string, NDArray> out;
  for (const auto& [name, shape] : llama_parameter_shapes(c)) {
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
