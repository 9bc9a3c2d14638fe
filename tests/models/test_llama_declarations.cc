// The Llama model declares what its parameters and Reshard points are (role,
// part, layer, kind) instead of leaving readers to parse names: these
// declarations must agree with the Hugging Face names and with the graph
// build_model makes.
#include <gtest/gtest.h>

#include <set>

#include "hspmd/models/model.h"
#include "hspmd/ops/ops.h"

namespace hspmd {
namespace {

ModelConfig config(bool tied, int64_t layers = 3) {
  return ModelConfig{.vocab_size = 40,
                     .hidden_size = 16,
                     .intermediate_size = 24,
                     .num_hidden_layers = layers,
                     .num_attention_heads = 4,
                     .num_key_value_heads = 2,
                     .tie_word_embeddings = tied};
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The block index a Hugging Face name carries ("model.layers.12.<...>"), or -1.
int64_t layer_in_name(const std::string& name) {
  const std::string prefix = "model.layers.";
  if (name.rfind(prefix, 0) != 0) return -1;
  return std::stoll(name.substr(prefix.size(), name.find('.', prefix.size()) - prefix.size()));
}

// What the Hugging Face name of a parameter means under Megatron tensor parallelism.
ParamRole role_by_name(const std::string& name) {
  for (const char* col : {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
    if (name.find(col) != std::string::npos) return ParamRole::kColumnParallel;
  for (const char* row : {"o_proj", "down_proj"})
    if (name.find(row) != std::string::npos) return ParamRole::kRowParallel;
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return ParamRole::kVocabulary;
  EXPECT_TRUE(ends_with(name, "norm.weight")) << name;
  return ParamRole::kReplicated;
}

TEST(LlamaParameters, RolesPartsAndLayersMatchTheirNames) {
  for (bool tied : {false, true}) {
    const ModelConfig c = config(tied);
    const std::vector<ModelParameter> params = model_parameters(c);
    ASSERT_EQ(params.size(), 9 * 3 + (tied ? 2u : 3u));
    std::map<int64_t, int> per_layer;
    for (const ModelParameter& p : params) {
      EXPECT_EQ(p.role, role_by_name(p.name)) << p.name;
      EXPECT_EQ(p.layer, layer_in_name(p.name)) << p.name;
      const ParamInit init = ends_with(p.name, "norm.weight") ? ParamInit::kOnes : ParamInit::kNormal;
      EXPECT_EQ(p.init, init) << p.name;
      const ModelPart part = p.layer >= 0 ? ModelPart::kBlock
                             : p.name == "model.embed_tokens.weight" ? ModelPart::kEmbedding
                                                                     : ModelPart::kHead;
      EXPECT_EQ(p.part, part) << p.name;
      ++per_layer[p.layer];
    }
    EXPECT_EQ(per_layer, (std::map<int64_t, int>{{-1, tied ? 2 : 3}, {0, 9}, {1, 9}, {2, 9}}));
    EXPECT_EQ(params.front().name, "model.embed_tokens.weight");
    EXPECT_EQ(params.front().shape, (Shape{40, 16}));
  }
}

TEST(LlamaParameters, ShapesListIsTheDeclarationsNamesAndShapes) {
  for (bool tied : {false, true}) {
    const ModelConfig c = config(tied);
    std::vector<std::pair<std::string, Shape>> expected;
    for (const ModelParameter& p : model_parameters(c)) expected.emplace_back(p.name, p.shape);
    EXPECT_EQ(model_parameter_shapes(c), expected);
    const ModelGraph m = build_model(c);
    EXPECT_EQ(m.parameters, model_parameters(c));
    ASSERT_EQ(m.names.size(), m.parameters.size());
    for (size_t i = 0; i < m.names.size(); ++i) {
      EXPECT_EQ(m.names[i], m.parameters[i].name);
      EXPECT_EQ(m.params[i].node().name, m.names[i]);
    }
    EXPECT_TRUE(m.points.empty());  // no Reshard points asked for
  }
}

// The kind a point's name means (docs/plan.md's table).
ReshardKind kind_by_name(const std::string& name) {
  if (name.rfind("grad.", 0) == 0) return ReshardKind::kGradSync;
  if (name == "model.embed_tokens.out") return ReshardKind::kEmbeddingOutput;
  if (name == "lm_head.input") return ReshardKind::kHeadInput;
  if (name == "lm_head.weight") return ReshardKind::kTiedHead;
  if (ends_with(name, ".input")) return ReshardKind::kBlockInput;
  if (ends_with(name, ".positions")) return ReshardKind::kPositions;
  if (ends_with(name, "_input")) return ReshardKind::kSublayerInput;
  EXPECT_TRUE(ends_with(name, "_output")) << name;
  return ReshardKind::kSublayerOutput;
}

TEST(LlamaReshardPoints, KindsAndLayersMatchTheirNames) {
  for (bool tied : {false, true}) {
    const ModelConfig c = config(tied);
    const std::vector<ModelParameter> params = model_parameters(c);
    std::map<std::string, ModelParameter> by_name;
    for (const ModelParameter& p : params) by_name[p.name] = p;
    int grads = 0, carriers = 0;
    for (const ReshardPoint& p : model_reshard_points(c)) {
      EXPECT_EQ(p.kind, kind_by_name(p.name)) << p.name;
      const bool block_input = p.name == "model.layers." + std::to_string(p.layer) + ".input";
      EXPECT_EQ(p.carries_activations(), p.name == "lm_head.input" || block_input) << p.name;
      carriers += p.carries_activations();
      if (p.kind == ReshardKind::kGradSync) {
        ++grads;
        EXPECT_EQ(p.name, "grad." + p.parameter);
        const ModelParameter& param = by_name.at(p.parameter);
        EXPECT_EQ(p.part, param.part) << p.name;
        EXPECT_EQ(p.layer, param.layer) << p.name;
        continue;
      }
      EXPECT_EQ(p.layer, layer_in_name(p.name)) << p.name;
      const std::string carried = p.kind == ReshardKind::kTiedHead ? "model.embed_tokens.weight" : "";
      EXPECT_EQ(p.parameter, carried) << p.name;
    }
    EXPECT_EQ(grads, static_cast<int>(params.size()));
    EXPECT_EQ(carriers, 3 + 1);  // each block's input and the LM head's
  }
}

// build_model records exactly the declared points, in graph order, on the
// named forward Reshards; the gradients are the grad.{parameter} points.
TEST(LlamaReshardPoints, TheGraphHasExactlyTheDeclaredPoints) {
  for (bool tied : {false, true}) {
    const ModelConfig c = config(tied);
    ModelBuildOptions o;
    o.reshard_points = true;
    const ModelGraph m = build_model(c, o);
    std::vector<ReshardPoint> in_graph;
    for (const auto& [id, point] : m.points) {
      const Node& n = m.graph->node(id);
      EXPECT_TRUE(ops::is_reshard(n)) << point.name;
      EXPECT_EQ(ops::reshard_mirror_of(n), -1) << point.name;
      EXPECT_EQ(n.name, point.name);
      EXPECT_EQ(m.point(id), &point);
      in_graph.push_back(point);
    }
    EXPECT_EQ(in_graph, model_reshard_points(c));
    for (int id = 0; id < m.graph->num_nodes(); ++id) {
      const Node& n = m.graph->node(id);
      if (ops::is_reshard(n) && ops::reshard_mirror_of(n) < 0) {
        EXPECT_NE(m.point(id), nullptr) << n.name;
      }
    }
    for (size_t i = 0; i < m.grads.size(); ++i) {
      const ReshardPoint* p = m.point(m.grads[i].node_id());
      ASSERT_NE(p, nullptr) << m.names[i];
      EXPECT_EQ(p->kind, ReshardKind::kGradSync);
      EXPECT_EQ(p->parameter, m.names[i]);
    }
  }
}

}  // namespace
}  // namespace hspmd
