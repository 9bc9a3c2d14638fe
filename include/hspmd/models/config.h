// The model configuration: the Hugging Face config.json fields hspmd reads,
// for every registered model family (docs/models.md): the decoder fields
// they share, plus what a family adds (Qwen2's q/k/v biases, Mistral's
// sliding window). Unknown fields are ignored; known fields that would
// describe another model (an unregistered model_type, hidden_act, head_dim,
// rope_scaling, dropout, biases a family does not have) are refused unless
// they match what hspmd builds.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace hspmd {

// The most layers a config may have, for every family (from_json refuses
// more, naming the limit). Every layer is its own nodes, parameters and
// Reshard points in the graph of every rank: the first step of the tiny
// custom GPT of examples/python/custom_gpt.py costs about 350 KB and 1.7 ms
// of CPU per layer (4,000 layers: 1.4 GB, 7 s), whatever its parameter
// count. The deepest published transformers have about 1,000 layers
// (DeepNet), LLMs under 200. Without a bound, 10^7 layers of a tiny model
// passed the memory check (few parameters) and then grew the graph past
// 17 GB (docs/models.md, "Depth").
inline constexpr int64_t kMaxHiddenLayers = 4096;

struct ModelConfig {
  // The Hugging Face model_type: which registered family builds the model
  // (models/model.h, model_family). Absent in a file: "llama".
  std::string model_type = "llama";
  // Required.
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  // Optional, with Hugging Face's defaults.
  // Absent or null in the file means = num_attention_heads; from_json always
  // sets it. 0 (the default of a hand-built config) means the same; use
  // kv_heads() to read it.
  int64_t num_key_value_heads = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  int64_t eos_token_id = 2;  // a list in the file: its first element
  double initializer_range = 0.02;
  // Rows of the embedding and LM-head tables when a plan pads the vocabulary
  // so that tensor parallelism divides it (0 = vocab_size). The padded rows
  // are zeros, never looked up, and their logits are masked: the model is
  // the same (docs/vocab_parallel.md). Not a Hugging Face field; a plan's
  // JSON carries it as "padded_vocab_size".
  int64_t padded_vocab_size = 0;
  // Family features (set by the family from its own fields, never read
  // from a file directly):
  // q, k and v projections with a bias (Qwen2: self_attn.{q,k,v}_proj.bias).
  bool attention_bias = false;
  // Sliding-window attention (Mistral's sliding_window): token i attends to
  // keys i - W < j <= i; 0 = none.
  int64_t sliding_window = 0;
  // Mixture of experts (Mixtral, Qwen2-MoE; docs/moe.md): set by the family
  // from its own fields; num_experts 0 is a dense model.
  struct Moe {
    // How the family names the layer's tensors: Mixtral's
    // block_sparse_moe.{gate, experts.N.w1/w2/w3} or Qwen2-MoE's
    // mlp.{gate, experts.N.gate_proj/up_proj/down_proj, shared_expert.*,
    // shared_expert_gate}.
    enum class Names { kMixtral, kQwen2Moe };
    Names names = Names::kMixtral;
    int64_t num_experts = 0;
    int64_t top_k = 0;                    // num_experts_per_tok
    int64_t expert_intermediate_size = 0;  // Mixtral: intermediate_size; Qwen2-MoE: moe_intermediate_size
    int64_t shared_expert_intermediate_size = 0;  // Qwen2-MoE's shared expert (0: none)
    bool norm_topk_prob = true;           // the top-k weights renormalized to sum to 1
    int64_t decoder_sparse_step = 1;      // layer i is sparse when (i + 1) % step == 0 ...
    std::vector<int64_t> mlp_only_layers;  // ... and it is not listed here
    // The auxiliary load-balancing loss (Switch Transformer's, as Hugging
    // Face computes it over the whole global batch) times router_aux_loss_coef,
    // added to the loss when output_router_logits is true.
    bool output_router_logits = false;
    double router_aux_loss_coef = 0.001;

    bool any() const { return num_experts > 0; }
    bool sparse_layer(int64_t i) const;
    bool aux_loss() const { return any() && output_router_logits && router_aux_loss_coef != 0; }
  };
  Moe moe;
  // The model a user defined (model_type "hspmd_custom", src/models/custom):
  // its "program" field, the parameters and ops its family builds the graph
  // from (docs/models.md, "Custom models"); null for every other family.
  nlohmann::json program = nullptr;

  // The sparse layers' count (the auxiliary loss averages over them).
  int64_t sparse_layers() const;
  int64_t table_rows() const { return padded_vocab_size > 0 ? padded_vocab_size : vocab_size; }
  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  int64_t kv_heads() const { return num_key_value_heads > 0 ? num_key_value_heads : num_attention_heads; }

  // Parameters of the full model (table_rows() embedding rows; an untied LM
  // head counts again), as a double so that no config overflows it:
  // count_parameters(*this).total, from the family's declared shapes.
  double parameter_count() const;

  // Parses and validates; the family named by model_type reads its own
  // fields and defaults (docs/models.md). `source` names the file in errors. Throws
  // hspmd::Error "[config] <source>: <rule>" for a missing required field, a
  // field of the wrong JSON type, or an impossible value (non-positive sizes,
  // heads not dividing hidden_size, KV heads not dividing heads, odd head_dim,
  // eos_token_id outside the vocabulary, non-positive rms_norm_eps, rope_theta
  // or initializer_range), and for what hspmd does not build: a model_type
  // no family is registered for, hidden_act other than "silu", head_dim other than
  // hidden_size / num_attention_heads, a non-null rope_scaling, or
  // attention_bias / mlp_bias true where the family has no such biases,
  // attention_dropout other than 0, or what the family refuses. Optional fields
  // given as null take their default. Values echoed in errors are cut to 80
  // characters.
  static ModelConfig from_json(const nlohmann::json& j, const std::string& source);
  // Reads a config.json; also throws for a missing file or malformed JSON.
  static ModelConfig load(const std::string& path);
  // Every field above (num_key_value_heads resolved); from_json reads it back.
  nlohmann::json to_json() const;
};

// The parameters of a model counted from the shapes its family declares
// (model_parameters: a custom program's own shapes, not the config's
// hidden_size and intermediate_size): the declarations of one layer, a block
// parameter counted num_hidden_layers times, so that counting costs nothing
// per layer and builds no graph. Throws hspmd::Error for an unregistered
// model_type.
struct ParameterCount {
  double total = 0;
  // The parameter with the most elements over the whole model (a block
  // parameter: layer 0's name, times largest_copies = num_hidden_layers).
  std::string largest;
  std::vector<int64_t> largest_shape;
  int64_t largest_copies = 1;
};
ParameterCount count_parameters(const ModelConfig& config);

// MemTotal of /proc/meminfo in bytes; nullopt where it cannot be read.
std::optional<uint64_t> machine_memory_bytes();

// Throws hspmd::Error "[config] <source>: <count> parameters need <n> GiB
// (<bytes_per_parameter> bytes each: <what>), more than this machine's <m>
// GiB (MemTotal); the largest parameter: <name> [<shape>][ in each of <L>
// layers]" when the full model (count_parameters) at `bytes_per_parameter`
// exceeds the machine's memory; called before anything of that size is
// allocated or built. Does nothing where MemTotal cannot be read.
void check_parameters_fit_memory(const ModelConfig& config, const std::string& source, int bytes_per_parameter = 4,
                                 const char* what = "f32 weights");

}  // namespace hspmd
