// The custom family (model_type "hspmd_custom"): a program that spells out
// the Llama decoder declares Llama's parameters and Reshard points and gives
// its loss and gradients bit for bit; bad programs fail in one line naming
// the op and the rule.
#include <gtest/gtest.h>

#include <functional>

#include "custom_program_util.h"
#include "hspmd/core/error.h"
#include "hspmd/graph/executor.h"
#include "hspmd/models/model.h"
#include "hspmd/plan/plan.h"
#include "hspmd/plan/strategy.h"

namespace hspmd {
namespace {

using nlohmann::json;

using custom_program::mark;
using custom_program::op;

// Llama with hidden 16, 4 heads of 4 (2 KV heads), ffn 24, as a program.
json llama_program(bool tied) {
  const std::string L = "model.layers.{i}.";
  json params = json::array();
  auto param = [&](const std::string& name, json shape, const char* role, const char* init, const char* part) {
    params.push_back({{"name", name}, {"shape", shape}, {"role", role}, {"init", init}, {"part", part}});
  };
  param("model.embed_tokens.weight", {"vocab", 16}, "vocabulary", "normal", "embedding");
  param(L + "self_attn.q_proj.weight", {16, 16}, "column", "normal", "block");
  param(L + "self_attn.k_proj.weight", {8, 16}, "column", "normal", "block");
  param(L + "self_attn.v_proj.weight", {8, 16}, "column", "normal", "block");
  param(L + "self_attn.o_proj.weight", {16, 16}, "row", "normal", "block");
  param(L + "mlp.gate_proj.weight", {24, 16}, "column", "normal", "block");
  param(L + "mlp.up_proj.weight", {24, 16}, "column", "normal", "block");
  param(L + "mlp.down_proj.weight", {16, 24}, "row", "normal", "block");
  param(L + "input_layernorm.weight", {16}, "replicated", "ones", "block");
  param(L + "post_attention_layernorm.weight", {16}, "replicated", "ones", "block");
  param("model.norm.weight", {16}, "replicated", "ones", "head");
  if (!tied) param("lm_head.weight", {"vocab", 16}, "vocabulary", "normal", "head");
  const json eps = {{"eps", 1e-6}};
  json block = json::array({
      mark("h", "x", "block_input", L + "input"),
      mark("positions", "pos", "positions", L + "positions"),
      op("rms_norm", {"x", L + "input_layernorm.weight"}, "n1", eps),
      mark("n1", "a_in", "sublayer_input", L + "attn_input"),
      op("linear", {"a_in", L + "self_attn.q_proj.weight"}, "q2"),
      op("reshape", {"q2"}, "q3", {{"shape", {"B", "S", 4, 4}}}),
      op("linear", {"a_in", L + "self_attn.k_proj.weight"}, "k2"),
      op("reshape", {"k2"}, "k3", {{"shape", {"B", "S", 2, 4}}}),
      op("linear", {"a_in", L + "self_attn.v_proj.weight"}, "v2"),
      op("reshape", {"v2"}, "v", {{"shape", {"B", "S", 2, 4}}}),
      op("rope", {"q3", "pos"}, "q", {{"theta", 10000.0}}),
      op("rope", {"k3", "pos"}, "k", {{"theta", 10000.0}}),
      op("attention", {"q", "k", "v", "pos"}, "a4"),
      op("reshape", {"a4"}, "a", {{"shape", {"B", "S", 16}}}),
      op("linear", {"a", L + "self_attn.o_proj.weight"}, "o"),
      mark("o", "a_out", "sublayer_output", L + "attn_output"),
      op("add", {"x", "a_out"}, "h1"),
      op("rms_norm", {"h1", L + "post_attention_layernorm.weight"}, "n2", eps),
      mark("n2", "m_in", "sublayer_input", L + "mlp_input"),
      op("linear", {"m_in", L + "mlp.gate_proj.weight"}, "gate"),
      op("linear", {"m_in", L + "mlp.up_proj.weight"}, "up"),
      op("swiglu", {"gate", "up"}, "act"),
      op("linear", {"act", L + "mlp.down_proj.weight"}, "down"),
      mark("down", "m_out", "sublayer_output", L + "mlp_output"),
      op("add", {"h1", "m_out"}, "out")});
  json head = json::array({op("rms_norm", {"h", "model.norm.weight"}, "n", eps),
                           mark("n", "x", "head_input", "lm_head.input")});
  if (tied) head.push_back(mark("model.embed_tokens.weight", "w", "tied_head", "lm_head.weight"));
  head.push_back(op("linear", {"x", tied ? "w" : "lm_head.weight"}, "logits"));
  head.push_back(op("cross_entropy", {"logits", "targets", "normalizer"}, "loss"));
  return {{"parameters", params},
          {"embedding",
           {{"ops", {op("embedding", {"model.embed_tokens.weight", "input_ids"}, "e"),
                     mark("e", "h", "embedding_output", "model.embed_tokens.out")}},
            {"output", "h"}}},
          {"block", {{"input", "h"}, {"ops", block}, {"output", "out"}}},
          {"head", {{"input", "h"}, {"ops", head}, {"output", "loss"}}}};
}

json llama_config(bool tied) {
  return {{"vocab_size", 32},        {"hidden_size", 16},         {"intermediate_size", 24},
          {"num_hidden_layers", 2},  {"num_attention_heads", 4}, {"num_key_value_heads", 2},
          {"tie_word_embeddings", tied}};
}

ModelConfig custom_config(const json& program, int64_t padded = 0) {
  json j = llama_config(false);
  j["model_type"] = "hspmd_custom";
  j["program"] = program;
  if (padded) j["padded_vocab_size"] = padded;
  return ModelConfig::from_json(j, "custom.json");
}

ValueMap feeds(const ModelConfig& c) {
  ValueMap v;
  for (auto& [name, a] : init_model_parameters(c, 7)) v[name] = a;
  std::vector<int32_t> ids, targets, positions;
  for (int b = 0; b < 2; ++b)
    for (int s = 0; s < 6; ++s) {
      ids.push_back((b * 7 + s * 3) % 32);
      targets.push_back((b * 5 + s * 11 + 1) % 32);
      positions.push_back(s < 4 ? s : s - 4);  // two documents in each row
    }
  v["input_ids"] = NDArray::from_vector_i32({2, 6}, ids);
  v["targets"] = NDArray::from_vector_i32({2, 6}, targets);
  v["positions"] = NDArray::from_vector_i32({2, 6}, positions);
  v["normalizer"] = NDArray::from_vector({}, {12.0f});
  return v;
}

std::vector<NDArray> run(const ModelGraph& m, const ValueMap& values) {
  std::vector<Tensor> fetches = {m.loss};
  fetches.insert(fetches.end(), m.grads.begin(), m.grads.end());
  return Executor(*m.graph, fetches).run(values);
}

void expect_llama(bool tied, int64_t padded) {
  json lj = llama_config(tied);
  if (padded) lj["padded_vocab_size"] = padded;
  const ModelConfig llama = ModelConfig::from_json(lj, "llama.json");
  const ModelConfig custom = custom_config(llama_program(tied), padded);
  EXPECT_EQ(model_parameters(custom), model_parameters(llama));
  EXPECT_EQ(model_reshard_points(custom), model_reshard_points(llama));
  ModelBuildOptions o;
  o.reshard_points = true;
  o.packed_documents = true;
  const ModelGraph a = build_model(llama, o), b = build_model(custom, o);
  ASSERT_EQ(a.names, b.names);
  std::vector<ReshardPoint> pa, pb;
  for (const auto& [id, p] : a.points) pa.push_back(p);
  for (const auto& [id, p] : b.points) pb.push_back(p);
  EXPECT_EQ(pa, pb);
  EXPECT_EQ(pb, model_reshard_points(custom));  // declared in graph order
  const ValueMap values = feeds(llama);
  const std::vector<NDArray> x = run(a, values), y = run(b, values);
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(x[i].shape(), y[i].shape()) << i;
    for (int64_t k = 0; k < x[i].numel(); ++k) ASSERT_EQ(x[i].data<float>()[k], y[i].data<float>()[k]) << i;
  }
  // The config round-trips through its JSON with the program.
  EXPECT_EQ(ModelConfig::from_json(custom.to_json(), "again").program, custom.program);
}

TEST(CustomFamily, LlamaProgramIsLlama) { expect_llama(false, 0); }
TEST(CustomFamily, LlamaProgramIsLlamaTied) { expect_llama(true, 0); }
TEST(CustomFamily, LlamaProgramIsLlamaPaddedVocabulary) { expect_llama(false, 34); }

TEST(CustomFamily, PerturbedProgramDiffers) {
  json p = llama_program(false);
  p["block"]["ops"][16] = op("add", {"a_out", "a_out"}, "h1");  // residual dropped
  const ModelConfig llama = ModelConfig::from_json(llama_config(false), "llama.json");
  const ModelGraph a = build_model(llama), b = build_model(custom_config(p));
  const ValueMap values = feeds(llama);
  EXPECT_NE(run(a, values)[0].data<float>()[0], run(b, values)[0].data<float>()[0]);
}

void expect_error(const std::function<void(json&)>& edit, const std::string& message) {
  json p = llama_program(false);
  edit(p);
  try {
    custom_config(p);
    FAIL() << "no error; expected " << message;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
}

TEST(CustomFamily, BadProgramsNameTheOpAndTheRule) {
  expect_error([](json& p) { p["block"]["ops"][4]["op"] = "lineer"; },
               "[config] custom.json: program: block op 4 (lineer -> q2): unknown op");
  expect_error([](json& p) { p["block"]["ops"][4]["inputs"][0] = "nope"; },
               "block op 4 (linear -> q2): input 'nope' is not defined before it");
  expect_error([](json& p) { p["block"]["ops"][7]["shape"] = {"B", "S", 5, 4}; },
               "program: block op 7 (reshape -> k3) of layer 0: ");
  expect_error([](json& p) { p["parameters"][1]["role"] = "diagonal"; }, "role 'diagonal'");
  expect_error([](json& p) { p["parameters"][1]["name"] = "q.weight"; }, "must hold {i}");
  expect_error([](json& p) { p["block"]["ops"][0]["kind"] = "head_input"; },
               "kind head_input is not a point of the block");
  expect_error([](json& p) { p["head"]["output"] = "logits"; }, "is not a scalar");
  expect_error([](json& p) { p["block"]["ops"][2]["output"] = "x"; }, "output 'x' is already defined");
  expect_error([](json& p) { p["parameters"].push_back({{"name", "extra"}, {"shape", {3}}, {"part", "head"}}); },
               "parameter extra does not reach the loss");
  json no_program = llama_config(false);
  no_program["model_type"] = "hspmd_custom";
  EXPECT_THROW(ModelConfig::from_json(no_program, "x.json"), Error);
}

// An MLP output left unmarked: under tensor parallelism the down projection
// is partial where the residual add needs it whole. compile_plan (the CLI's
// `plan compile`, Python's compile_plan and the trainer all call it) deduces
// a custom program's graph, so the plan is refused before any run, and the
// error names the program op, not only a graph node.
TEST(CustomFamily, UnmarkedRowParallelOutputIsRefusedNamingTheOp) {
  json program = llama_program(false);
  json& block = program["block"]["ops"];
  ASSERT_EQ(block[23]["op"], "mark");
  ASSERT_EQ(block[24]["op"], "add");
  block.erase(block.begin() + 23);
  block[23]["inputs"][1] = "down";
  const ModelConfig c = custom_config(program);
  auto strategy = [](json ranks) {
    return strategy_from_json({{"pipelines", {{{"micro_batch_size", 1}, {"micro_batches", 1},
                                              {"stages", {{{"ranks", ranks}, {"layers", {0, 1}}}}}}}}});
  };
  // One rank: nothing is partial, and the program is fine.
  EXPECT_NO_THROW(compile_plan(c, strategy({0}), 1, {}));
  try {
    compile_plan(c, strategy({0, 1}), 2, {});
    FAIL() << "compile_plan accepted an unmarked row-parallel output under TP 2";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("[deduce] op 'add' (node "), std::string::npos) << m;
    EXPECT_NE(m.find(", from hspmd_custom program: block op 23 (add -> out) of layer 0)"), std::string::npos) << m;
    EXPECT_NE(m.find("insert a Reshard"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace hspmd
