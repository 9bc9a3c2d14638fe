// The decoder the registered families share (Llama, and Qwen2 and Mistral
// with their variations): parameters, Reshard points and the training graph.
#include "models/decoder.h"

#include <cmath>

#include "hspmd/core/error.h"
#include "hspmd/core/rng.h"
#include "hspmd/ops/autodiff.h"
#include "hspmd/ops/ops.h"
#include "models/moe/moe.h"

namespace hspmd {

namespace {

std::string layer_prefix(int64_t i) { return "model.layers." + std::to_string(i) + "."; }

// The named Reshard points of block i.
struct BlockPoints {
  ReshardPoint input, positions, attn_input, attn_output, mlp_input, mlp_output;
};

BlockPoints block_points(int64_t i) {
  auto point = [i](ReshardKind kind, const char* local) {
    return ReshardPoint{layer_prefix(i) + local, kind, ModelPart::kBlock, i, ""};
  };
  return {point(ReshardKind::kBlockInput, "input"),
          point(ReshardKind::kPositions, "positions"),
          point(ReshardKind::kSublayerInput, "attn_input"),
          point(ReshardKind::kSublayerOutput, "attn_output"),
          point(ReshardKind::kSublayerInput, "mlp_input"),
          point(ReshardKind::kSublayerOutput, "mlp_output")};
}

const char* const kEmbedding = "model.embed_tokens.weight";

ReshardPoint embedding_output_point() {
  return {"model.embed_tokens.out", ReshardKind::kEmbeddingOutput, ModelPart::kEmbedding, -1, ""};
}
ReshardPoint head_input_point() {
  return {"lm_head.input", ReshardKind::kHeadInput, ModelPart::kHead, -1, ""};
}
ReshardPoint tied_head_point() {
  return {"lm_head.weight", ReshardKind::kTiedHead, ModelPart::kHead, -1, kEmbedding};
}
ReshardPoint grad_point(const ModelParameter& p) {
  return {"grad." + p.name, ReshardKind::kGradSync, p.part, p.layer, p.name};
}

// Adds a named Reshard point when the options ask for them (recording it in
// the model's points), else returns `t` itself.
class Marker {
 public:
  Marker(const ModelBuildOptions& o, ModelGraph& m) : on_(o.reshard_points), m_(m) {}
  Tensor operator()(const Tensor& t, ReshardPoint point) const {
    if (!on_) return t;
    const Tensor out = ops::reshard(t, point.name);
    m_.points.emplace(out.node_id(), std::move(point));
    return out;
  }

 private:
  bool on_;
  ModelGraph& m_;
};

// One transformer block: pre-norm attention and SwiGLU MLP with residuals.
Tensor transformer_block(const ModelConfig& c, const ModelBuildOptions& o, const Marker& mark,
                         int64_t i, Tensor h, const Tensor& block_positions, Graph& g, MoeTotals& moe) {
  const std::string p = layer_prefix(i);
  const BlockPoints points = block_points(i);
  auto param = [&](const std::string& n) { return g.find(p + n); };
  // The block input in the compute dtype, what its Reshard point carries:
  // the previous block's residual add (or the embedding) writes it so, and
  // the norm and the residual add below read it as it is (no widened copy;
  // the norm keeps it for its backward in that dtype).
  h = mark(ops::cast(h, o.precision.compute), points.input);
  const Tensor positions = mark(block_positions, points.positions);
  const SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
  const int64_t D = c.head_dim(), Hq = c.num_attention_heads, Hkv = c.kv_heads();
  const float theta = static_cast<float>(c.rope_theta);
  const float eps = static_cast<float>(c.rms_norm_eps);

  // Mixed precision: `lo` rounds to the compute dtype (a no-op in f32); GEMM
  // operands and what the Reshards carry are `lo`, and the residual adds
  // widen a bf16 branch themselves.
  const auto lo = [&](const Tensor& t) { return ops::cast(t, o.precision.compute); };
  // RMSNorm writes the GEMMs' operand in the compute dtype (norm and cast in one pass).
  const DType act = o.precision.compute;
  Tensor x = mark(ops::rms_norm(h, param("input_layernorm.weight"), eps, act), points.attn_input);
  // A projection in `out`, plus its bias where the family has them (Qwen2):
  // added in f32 to the f32 product in the GEMM's epilogue, split like the
  // projection's rows under TP, then rounded once; the GEMM writes `out`.
  const auto project = [&](const char* name, DType out) {
    const std::string p_name = std::string("self_attn.") + name;
    const Tensor w = lo(param(p_name + ".weight"));
    return c.attention_bias ? ops::linear_bias(x, w, param(p_name + ".bias"), out) : ops::linear(x, w, out);
  };
  // q, k and v, which attention keeps for its backward, are in the compute
  // dtype: RoPE writes q and k rounded once, v_proj writes v rounded once
  // (the rounding attention's bf16 products apply to them anyway), so that
  // v's gradient, bf16 where attention writes it so, is the GEMMs' operand
  // as it comes. Attention's output is f32 on
  // the CPU (ops::attention) and o_proj's operand as it is: a bf16 GEMM
  // rounds it, so no bf16 copy is kept beside it. On a GPU it is bf16
  // (Precision::attention_output), as cuDNN writes it.
  Tensor q = ops::reshape(project("q_proj", DType::F32), {B, S, Hq, D});
  Tensor k = ops::reshape(project("k_proj", DType::F32), {B, S, Hkv, D});
  const Tensor v = ops::reshape(project("v_proj", act), {B, S, Hkv, D});
  const ops::RopeQk rotated = ops::rope_qk(q, k, positions, theta, act);  // q and k in one kernel call
  q = rotated.q, k = rotated.k;
  // Packed documents: the positions (restarting at 0 at each document) also
  // mask the attention to each token's own document.
  Tensor a = ops::attention(q, k, v, o.packed_documents ? positions : Tensor(),
                            static_cast<float>(1.0 / std::sqrt(D)), o.context_parallel,
                            o.precision.compute, c.sliding_window, o.precision.attention_output);
  a = ops::reshape(a, {B, S, Hq * D});
  // o_proj and down_proj write their (partial, under TP) sums in the
  // compute dtype: one rounding, the one the Reshards carry, without an f32
  // array and a cast pass between.
  const Tensor attn_out = ops::linear(a, lo(param("self_attn.o_proj.weight")), act);
  // The residual add (it widens a bf16 branch) and the norm of its sum in
  // one op: one pass on a GPU, the two ops' bits (ops::add_rms_norm).
  const ops::AddRmsNorm mid = ops::add_rms_norm(h, mark(attn_out, points.attn_output),
                                                param("post_attention_layernorm.weight"), eps, DType::F32, act);
  h = mid.sum, x = mark(mid.y, points.mlp_input);
  // gate and up come out of their GEMMs in the compute dtype (bf16 halves
  // what SwiGLU keeps for its backward), SwiGLU computes in f32 and writes
  // that dtype, and down_proj's weight gradient recomputes it
  // (ops::swiglu): the MLP keeps gate and up only.
  Tensor down;
  if (c.moe.sparse_layer(i)) {
    down = build_moe_mlp(c, o, i, x, g, moe);
  } else {
    Tensor gate = ops::linear(x, lo(param("mlp.gate_proj.weight")), act);
    Tensor up = ops::linear(x, lo(param("mlp.up_proj.weight")), act);
    down = ops::linear(ops::swiglu(gate, up), lo(param("mlp.down_proj.weight")), act);
  }
  // The next block takes its input in the compute dtype (its Reshard point
  // carries that): the residual add writes it so, rounding once as a cast
  // would, without an f32 array and a pass between. The last block's
  // output stays f32 for the final norm.
  const bool last = i + 1 == c.num_hidden_layers;
  return ops::add(h, mark(down, points.mlp_output), last ? DType::F32 : act);
}

// The parameters of block i, in Hugging Face order: nine, and three
// biases with attention_bias.
void append_block_parameters(const ModelConfig& c, int64_t i, std::vector<ModelParameter>& out) {
  const int64_t H = c.hidden_size, D = c.head_dim(), F = c.intermediate_size;
  const int64_t q_out = c.num_attention_heads * D, kv_out = c.kv_heads() * D;
  const ParamRole col = ParamRole::kColumnParallel, row = ParamRole::kRowParallel;
  auto add = [&](const char* local, Shape shape, ParamRole role, ParamInit init = ParamInit::kNormal) {
    out.push_back({layer_prefix(i) + local, std::move(shape), role, init, ModelPart::kBlock, i});
  };
  add("self_attn.q_proj.weight", {q_out, H}, col);
  if (c.attention_bias) add("self_attn.q_proj.bias", {q_out}, col, ParamInit::kZeros);
  add("self_attn.k_proj.weight", {kv_out, H}, col);
  if (c.attention_bias) add("self_attn.k_proj.bias", {kv_out}, col, ParamInit::kZeros);
  add("self_attn.v_proj.weight", {kv_out, H}, col);
  if (c.attention_bias) add("self_attn.v_proj.bias", {kv_out}, col, ParamInit::kZeros);
  add("self_attn.o_proj.weight", {H, q_out}, row);
  if (c.moe.sparse_layer(i)) {
    append_moe_parameters(c, i, out);
  } else {
    add("mlp.gate_proj.weight", {F, H}, col);
    add("mlp.up_proj.weight", {F, H}, col);
    add("mlp.down_proj.weight", {H, F}, row);
  }
  add("input_layernorm.weight", {H}, ParamRole::kReplicated, ParamInit::kOnes);
  add("post_attention_layernorm.weight", {H}, ParamRole::kReplicated, ParamInit::kOnes);
}

}  // namespace

std::vector<ModelParameter> decoder_parameters(const ModelConfig& c) {
  const int64_t H = c.hidden_size, V = c.table_rows();
  const ParamRole vocab = ParamRole::kVocabulary;
  std::vector<ModelParameter> out = {
      {kEmbedding, {V, H}, vocab, ParamInit::kNormal, ModelPart::kEmbedding, -1}};
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) append_block_parameters(c, i, out);
  out.push_back(
      {"model.norm.weight", {H}, ParamRole::kReplicated, ParamInit::kOnes, ModelPart::kHead, -1});
  if (!c.tie_word_embeddings)
    out.push_back({"lm_head.weight", {V, H}, vocab, ParamInit::kNormal, ModelPart::kHead, -1});
  return out;
}

std::vector<ReshardPoint> decoder_reshard_points(const ModelConfig& c) {
  std::vector<ReshardPoint> out = {embedding_output_point()};
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const BlockPoints b = block_points(i);  // in the order transformer_block marks them
    out.insert(out.end(), {b.input, b.positions, b.attn_input, b.attn_output, b.mlp_input, b.mlp_output});
  }
  out.push_back(head_input_point());
  if (c.tie_word_embeddings) out.push_back(tied_head_point());
  for (const ModelParameter& p : decoder_parameters(c)) out.push_back(grad_point(p));
  return out;
}

ModelGraph build_decoder(const ModelConfig& c, const ModelBuildOptions& o) {
  ModelGraph m;
  Graph& g = *m.graph;
  const Marker mark(o, m);
  const SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
  m.input_ids = g.placeholder("input_ids", {B, S}, DType::I32);
  m.targets = g.placeholder("targets", {B, S}, DType::I32);
  m.positions = g.placeholder("positions", {B, S}, DType::I32);
  m.normalizer = g.placeholder("normalizer", {}, DType::F32);
  m.parameters = decoder_parameters(c);
  for (const ModelParameter& p : m.parameters) {
    m.names.push_back(p.name);
    m.params.push_back(g.parameter(p.name, p.shape));
  }

  const DType lo = o.precision.compute;
  // The embedding's output in the compute dtype (what its Reshard point
  // carries): the first block rounds its input to that dtype anyway, so it
  // takes this tensor as it is; without blocks the final norm takes it f32.
  Tensor h = mark(ops::cast(ops::embedding(g.find(kEmbedding), m.input_ids), lo), embedding_output_point());
  if (c.num_hidden_layers == 0) h = ops::cast(h, DType::F32);
  MoeTotals moe;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) h = transformer_block(c, o, mark, i, h, m.positions, g, moe);
  m.router_counts = moe.counts;
  m.router_prob_sums = moe.prob_sums;
  h = mark(ops::rms_norm(h, g.find("model.norm.weight"), static_cast<float>(c.rms_norm_eps), lo),
           head_input_point());
  Tensor head = c.tie_word_embeddings ? mark(ops::cast(g.find(kEmbedding), lo), tied_head_point())
                                      : ops::cast(g.find("lm_head.weight"), lo);
  // Under bf16 compute the head writes bf16 logits, as PyTorch's autocast
  // and Megatron-LM's bf16 head do; cross-entropy widens them and computes
  // in f32 (docs/precision.md). Half the bytes of the largest activation.
  Tensor logits = ops::linear(h, head, o.precision.compute);
  // Padded vocabulary: only the first vocab_size logits are classes.
  // The logits' gradient in the head GEMM's operand dtype (its gradient
  // would round it there anyway): no f32 copy of the [tokens, vocab] array.
  m.loss = ops::cross_entropy(logits, m.targets, m.normalizer, -100,
                              c.table_rows() != c.vocab_size ? c.vocab_size : 0, o.precision.compute);
  m.grads = gradients(m.loss, m.params);
  for (size_t i = 0; i < m.grads.size(); ++i) {
    HSPMD_CHECK(m.grads[i].valid(), "parameter ", m.names[i], " does not reach the loss");
    m.grads[i] = mark(m.grads[i], grad_point(m.parameters[i]));
  }
  return m;
}

}  // namespace hspmd
