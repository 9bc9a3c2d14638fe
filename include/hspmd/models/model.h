// Models: the contract every model family implements (ModelFamily), the
// registry that finds a family by its Hugging Face model_type, and the
// family-independent functions the rest of hspmd calls (parameters, Reshard
// points, the training graph, initialization, weight checks), which forward
// to the config's family. docs/models.md says how to add a family.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hspmd/core/ndarray.h"
#include "hspmd/graph/graph.h"
#include "hspmd/models/config.h"
#include "hspmd/ops/precision.h"

namespace hspmd {

class ConfigFields;  // src/models/config_fields.h

// Where a parameter or a Reshard point sits in the model: the embedding
// (before the blocks), a transformer block, or the head (final norm, LM
// head, loss). A pipeline places the embedding on its first stage, block i
// on the stage holding layer i, and the head on its last stage.
enum class ModelPart { kEmbedding, kBlock, kHead };

// A parameter's tensor-parallel role (Megatron-style, docs/plan.md):
//   kColumnParallel  a linear weight [out, in] whose output rows may be split
//                    (q, k, v, gate, up projections)
//   kRowParallel     a linear weight [out, in] whose input columns may be
//                    split; its output is a partial sum (o, down projections)
//   kVocabulary      an embedding table [vocab, hidden] whose vocabulary rows
//                    may be split (embedding, untied LM head)
//   kReplicated      never split (the RMSNorm scales)
enum class ParamRole { kColumnParallel, kRowParallel, kVocabulary, kReplicated };

// How a parameter starts without a checkpoint (init_model_parameters):
// N(0, initializer_range^2), all ones (the RMSNorm scales) or zeros (biases).
enum class ParamInit { kNormal, kOnes, kZeros };

// One parameter as the model declares it.
struct ModelParameter {
  std::string name;  // Hugging Face name
  Shape shape;
  ParamRole role = ParamRole::kReplicated;
  ParamInit init = ParamInit::kNormal;
  ModelPart part = ModelPart::kBlock;
  int64_t layer = -1;  // the block's index for kBlock, else -1
  bool operator==(const ModelParameter&) const = default;
};

// The model's parameters, in Hugging Face order and naming (lm_head.weight
// only when the embeddings are not tied). Cheap: builds no graph.
std::vector<ModelParameter> model_parameters(const ModelConfig& config);
// Their names and shapes, in the same order.
std::vector<std::pair<std::string, Shape>> model_parameter_shapes(const ModelConfig& config);

// What a named Reshard point of the training graph carries (docs/plan.md):
//   kEmbeddingOutput  model.embed_tokens.out: the embedding's output (partial
//                     sums under a vocabulary-parallel embedding)
//   kBlockInput       model.layers.{i}.input: the hidden state entering block
//                     i, an activation boundary (between pipeline stages)
//   kPositions        model.layers.{i}.positions: block i's RoPE positions
//                     (and document mask)
//   kSublayerInput    model.layers.{i}.attn_input / mlp_input: the normed
//                     input of attention / the MLP (enters column-parallel weights)
//   kSublayerOutput   model.layers.{i}.attn_output / mlp_output: the output of
//                     o_proj / down_proj (row-parallel partial sums)
//   kHeadInput        lm_head.input: the normed hidden state entering the LM
//                     head, an activation boundary
//   kTiedHead         lm_head.weight (tied embeddings only): the embedding
//                     table used as LM head
//   kGradSync         grad.{parameter}: the parameter's gradient, to be
//                     synchronized between the replicas that computed it
enum class ReshardKind {
  kEmbeddingOutput,
  kBlockInput,
  kPositions,
  kSublayerInput,
  kSublayerOutput,
  kHeadInput,
  kTiedHead,
  kGradSync,
};

struct ReshardPoint {
  std::string name;  // the plan's handle, e.g. "model.layers.3.input"
  ReshardKind kind = ReshardKind::kBlockInput;
  ModelPart part = ModelPart::kBlock;  // kGradSync: its parameter's
  int64_t layer = -1;                  // the block's index for kBlock, else -1
  std::string parameter;               // kGradSync, kTiedHead: the parameter it carries
  bool operator==(const ReshardPoint&) const = default;
  // Whether it carries the forward activations from one block (or pipeline
  // stage) to the next: kBlockInput and kHeadInput.
  bool carries_activations() const {
    return kind == ReshardKind::kBlockInput || kind == ReshardKind::kHeadInput;
  }
};

// The named Reshard points build_model adds with `reshard_points`, in graph
// order (the order of their nodes). Cheap: builds no graph.
std::vector<ReshardPoint> model_reshard_points(const ModelConfig& config);

// The training graph of one model replica. Placeholders (B, S symbolic):
//   input_ids, targets, positions: i32 [B, S]; normalizer: f32 scalar (number
//   of counted target tokens of the whole global batch). With packed
//   documents, positions restart at 0 at each document and also mask the
//   attention to each token's own document (docs/data.md).
struct ModelGraph {
  std::unique_ptr<Graph> graph = std::make_unique<Graph>();
  Tensor input_ids, targets, positions, normalizer;
  Tensor loss;                       // scalar: sum of token losses / normalizer
  std::vector<std::string> names;    // parameter names, same order as params/grads
  std::vector<ModelParameter> parameters;  // their declarations, same order
  std::vector<Tensor> params;
  std::vector<Tensor> grads;         // d(loss)/d(param)
  // Mixture of experts (docs/moe.md): per sparse layer, in layer order, the
  // router statistics of one micro-batch, [E] f32 each: the (token, slot)
  // pairs routed to each expert and the router's probabilities summed over
  // the tokens (empty for a dense model). With the auxiliary loss, each
  // sparse layer i also has the placeholder "moe_aux_weights.<i>" [E] f32,
  // which only the backward reads: coef * E * counts / N^2 of the whole
  // global batch, fed once every forward of the step has routed (the loss
  // gains its gradient; its value is added on the host).
  std::vector<Tensor> router_counts, router_prob_sums;
  // With reshard points: Reshard node id -> the point it is (mirrors and
  // unnamed Reshards are absent). Empty otherwise.
  std::map<int, ReshardPoint> points;

  // The point node `id` is, or nullptr.
  const ReshardPoint* point(int id) const {
    auto it = points.find(id);
    return it == points.end() ? nullptr : &it->second;
  }
};

struct ModelBuildOptions {
  bool packed_documents = false;  // attention masked per document by the positions
  // Add the named Reshard points an annotation plan refers to (docs/plan.md;
  // ReshardKind lists them), recorded in ModelGraph::points. On one device
  // every Reshard is the identity: the loss is unchanged.
  bool reshard_points = false;
  bool context_parallel = false;  // attention may take a sequence-split input
  // Sparse layers run their experts as one op whose weights may live on
  // other ranks than the tokens (ops::moe_experts; docs/moe.md): set where
  // a plan places some expert apart from its layer's router.
  bool expert_parallel = false;
  // Decided by the caller for its device (Precision::for_device): the model
  // builds the graph this precision describes and reads no device or
  // environment itself.
  Precision precision;
};

// Builds the forward graph and its backward graph. Throws hspmd::Error for an
// invalid config. With reshard points, `grads` are the outputs of the
// grad.{parameter} Reshards.
ModelGraph build_model(const ModelConfig& config, const ModelBuildOptions& options);
ModelGraph build_model(const ModelConfig& config, bool packed_documents = false);

// Mixture of experts (docs/moe.md): the Hugging Face names of expert
// `expert`'s (gate, up, down) weights in sparse layer `layer`, and of the
// layer's router weight (the config's family's ModelFamily methods).
std::vector<std::string> moe_expert_weight_names(const ModelConfig& config, int64_t layer, int64_t expert);
std::string moe_router_weight_name(const ModelConfig& config, int64_t layer);

// A model family: everything hspmd needs of one model architecture,
// registered under its Hugging Face model_type (src/models/registry.cc). The
// plan, the executors, the trainer, checkpoints and the CLI reach a model only
// through these methods (and the free functions below, which forward to the
// config's family).
class ModelFamily {
 public:
  virtual ~ModelFamily() = default;
  // The Hugging Face model_type, e.g. "llama".
  virtual std::string model_type() const = 0;
  // Before the shared fields are read: the family's defaults where Hugging
  // Face's config class for it differs from ModelConfig's (e.g.
  // max_position_embeddings).
  virtual void set_defaults(ModelConfig& c) const { (void)c; }
  // After the shared fields are read and validated: the family's own fields
  // into `c`, refusing what it does not build with fields.fail_rule(...)
  // ("[config] <source>: <rule>").
  virtual void read_config(const ConfigFields& fields, ModelConfig& c) const = 0;
  // The family's own fields into a config JSON that read_config reads back.
  virtual void write_config(const ModelConfig& c, nlohmann::json& j) const = 0;
  // Its parameters, in Hugging Face order and naming. Cheap: builds no graph.
  virtual std::vector<ModelParameter> parameters(const ModelConfig& c) const = 0;
  // The named Reshard points build() adds with reshard_points, in graph order.
  virtual std::vector<ReshardPoint> reshard_points(const ModelConfig& c) const = 0;
  // The training graph of one replica (see build_model).
  virtual ModelGraph build(const ModelConfig& c, const ModelBuildOptions& o) const = 0;
  // Per-layer cost terms for the cost model and the search: the (query,
  // key) pairs one layer's causal attention computes for a sequence of
  // `seq_len` tokens, in the continuous form the roofline uses (S^2 / 2
  // without a window; the model clock counts exact pairs, exec/op_work.h).
  virtual double attention_pairs(const ModelConfig& c, double seq_len) const;
  // Bytes one layer keeps for the backward per token of the sequence, on a
  // rank that holds 1 / (tp x cp) of it, with activations of `element_bytes`
  // (4 fp32, 2 bf16; the attention's log-sum-exp is always fp32); with
  // `recompute`, what a recomputed layer keeps (its input). The cost model's
  // estimate where no profile measured the layer. The default is the
  // pre-norm decoder's (flash-style attention: no S x S probabilities).
  virtual double activation_bytes_per_token(const ModelConfig& c, double element_bytes, int tp, int cp,
                                            bool recompute) const;
  // The parameters one token's forward multiplies by in a block's matmuls,
  // averaged over the layers (the roofline's FLOPs are 2 per parameter per
  // token): those tensor parallelism divides among a stage's tp ranks, and
  // those every tp rank multiplies by whole (a mixture of experts' router
  // and its top-k experts, replicated over tp; docs/moe.md). The default
  // counts the blocks' tensor-parallel parameters, and none whole.
  struct LayerCompute {
    double tp_split = 0, whole = 0;
  };
  virtual LayerCompute layer_compute(const ModelConfig& c) const;

  // Mixture of experts (docs/moe.md): the names of expert `expert`'s (gate,
  // up, down) weights in sparse layer `layer`, and of the layer's router
  // weight. A dense family has none (empty).
  virtual std::vector<std::string> expert_weight_names(const ModelConfig& c, int64_t layer, int64_t expert) const {
    (void)c, (void)layer, (void)expert;
    return {};
  }
  virtual std::string router_weight_name(const ModelConfig& c, int64_t layer) const {
    (void)c, (void)layer;
    return "";
  }
};

// Adds a family to the registry under its model_type (InternalError when
// another family holds it). The families layer (src/models/families.cc)
// registers the built-in ones while the program starts; returns true so that
// a static initializer can call it.
bool register_model_family(const ModelFamily& family);
// The family registered for `model_type`, or nullptr.
const ModelFamily* find_model_family(const std::string& model_type);
// The family of `model_type`; throws hspmd::Error "[config] model_type 'x'
// is not supported (registered: ...)" for an unregistered one.
const ModelFamily& model_family(const std::string& model_type);
// "llama, mistral, qwen2": the registered model types, sorted.
std::string registered_model_types();

// Initial parameters: linear and embedding weights ~ N(0, initializer_range^2),
// norm weights = 1. Each tensor depends only on (seed, its name). Throws
// hspmd::Error (check_parameters_fit_memory) before allocating anything when
// the parameters alone exceed the machine's memory.
std::map<std::string, NDArray> init_model_parameters(const ModelConfig& config, uint64_t seed);

// Checks that `weights` (e.g. loaded from safetensors) holds exactly the
// model's tensors with the right shapes, and converts them to f32. Extra
// tensors are an error too (except lm_head.weight when embeddings are tied,
// which must then equal nothing: it is ignored). Throws hspmd::Error
// "[weights] <source>: <tensor>: <rule>".
std::map<std::string, NDArray> validate_model_weights(const ModelConfig& config,
                                                      std::map<std::string, NDArray> weights,
                                                      const std::string& source);

}  // namespace hspmd
