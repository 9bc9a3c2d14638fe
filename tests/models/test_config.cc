#include "hspmd/models/config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "hspmd/core/error.h"
#include "hspmd/models/model.h"

namespace hspmd {
namespace {

using nlohmann::json;

json minimal() {
  return {{"vocab_size", 512},
          {"hidden_size", 64},
          {"intermediate_size", 172},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4}};
}

// Expects from_json(j) to throw "[config] cfg.json: <rule>" containing `rule`.
void expect_config_error(const json& j, const std::string& rule) {
  try {
    ModelConfig::from_json(j, "cfg.json");
    FAIL() << "no error for " << j.dump();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("[config] cfg.json: ", 0), 0u) << msg;
    EXPECT_NE(msg.find(rule), std::string::npos) << "expected '" << rule << "' in: " << msg;
  }
}

TEST(ModelConfig, ParsesRequiredFieldsWithDefaults) {
  ModelConfig c = ModelConfig::from_json(minimal(), "cfg.json");
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.intermediate_size, 172);
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.kv_heads(), 4);
  EXPECT_EQ(c.head_dim(), 16);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_id, 2);
  EXPECT_DOUBLE_EQ(c.initializer_range, 0.02);
}

TEST(ModelConfig, ParsesOptionalFieldsAndIgnoresUnknown) {
  json j = minimal();
  j["num_key_value_heads"] = 2;
  j["rms_norm_eps"] = 1e-5;
  j["rope_theta"] = 500000;  // an integer is a valid number
  j["max_position_embeddings"] = 4096;
  j["tie_word_embeddings"] = true;
  j["eos_token_id"] = 300;
  j["initializer_range"] = 0.01;
  j["architectures"] = {"LlamaForCausalLM"};
  j["torch_dtype"] = "bfloat16";
  ModelConfig c = ModelConfig::from_json(j, "cfg.json");
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_id, 300);
  EXPECT_DOUBLE_EQ(c.initializer_range, 0.01);
}

TEST(ModelConfig, NullKvHeadsMeansAttentionHeads) {
  json j = minimal();
  j["num_key_value_heads"] = nullptr;
  EXPECT_EQ(ModelConfig::from_json(j, "cfg.json").num_key_value_heads, 4);
}

TEST(ModelConfig, EosListTakesFirst) {
  json j = minimal();
  j["eos_token_id"] = {7, 9};
  EXPECT_EQ(ModelConfig::from_json(j, "cfg.json").eos_token_id, 7);
  j["eos_token_id"] = json::array();
  expect_config_error(j, "field 'eos_token_id' is an empty list");
  j["eos_token_id"] = {"x"};
  expect_config_error(j, "field 'eos_token_id' must be an integer");
}

TEST(ModelConfig, ToJsonRoundTrips) {
  json j = minimal();
  j["num_key_value_heads"] = 2;
  j["tie_word_embeddings"] = true;
  j["eos_token_id"] = 511;
  ModelConfig c = ModelConfig::from_json(j, "cfg.json");
  json out = c.to_json();
  for (const char* field : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
                            "max_position_embeddings", "tie_word_embeddings", "eos_token_id",
                            "initializer_range"})
    EXPECT_TRUE(out.contains(field)) << field;
  EXPECT_EQ(ModelConfig::from_json(out, "again").to_json(), out);
  EXPECT_EQ(out["num_key_value_heads"], 2);
}

TEST(ModelConfig, MissingRequiredField) {
  for (const char* field : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads"}) {
    json j = minimal();
    j.erase(field);
    expect_config_error(j, std::string("missing required field '") + field + "'");
  }
}

TEST(ModelConfig, WrongJsonType) {
  const std::pair<const char*, json> cases[] = {
      {"vocab_size", "512"},       {"hidden_size", 64.5},          {"num_hidden_layers", true},
      {"num_attention_heads", nullptr}, {"num_key_value_heads", "2"}, {"rms_norm_eps", "1e-6"},
      {"rope_theta", json::array()}, {"max_position_embeddings", 1.5}, {"tie_word_embeddings", 1},
      {"eos_token_id", "2"},       {"initializer_range", false}};
  for (const auto& [field, value] : cases) {
    json j = minimal();
    j[field] = value;
    expect_config_error(j, std::string("field '") + field + "' must be ");
  }
  expect_config_error(json::array(), "not a JSON object");
}

TEST(ModelConfig, NonPositiveSizes) {
  for (const char* field : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads", "num_key_value_heads", "max_position_embeddings"}) {
    for (int value : {0, -4}) {
      json j = minimal();
      j[field] = value;
      expect_config_error(j, std::string(field) + "=" + std::to_string(value) + " must be positive");
    }
  }
}

TEST(ModelConfig, ImpossibleValues) {
  json j = minimal();
  j["num_attention_heads"] = 6;
  expect_config_error(j, "num_attention_heads=6 does not divide hidden_size=64");

  j = minimal();
  j["num_key_value_heads"] = 3;
  expect_config_error(j, "num_key_value_heads=3 does not divide num_attention_heads=4");

  j = minimal();
  j["hidden_size"] = 60;
  j["num_attention_heads"] = 4;  // head_dim 15
  expect_config_error(j, "head_dim=hidden_size/num_attention_heads=15 must be even");

  j = minimal();
  j["rms_norm_eps"] = 0.0;
  expect_config_error(j, "rms_norm_eps=0 must be positive");
  j = minimal();
  j["rope_theta"] = -1.0;
  expect_config_error(j, "rope_theta=-1 must be positive");
  j = minimal();
  j["initializer_range"] = 0;
  expect_config_error(j, "initializer_range=0 must be positive");

  j = minimal();
  j["eos_token_id"] = 512;
  expect_config_error(j, "eos_token_id=512 is outside the vocabulary [0, 512)");
  j["eos_token_id"] = -1;
  expect_config_error(j, "eos_token_id=-1 is outside the vocabulary");
}

TEST(ModelConfig, ExactMessageForHeads) {
  json j = minimal();
  j["num_attention_heads"] = 6;
  try {
    ModelConfig::from_json(j, "cfg.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "[config] cfg.json: num_attention_heads=6 does not divide hidden_size=64");
  }
}

TEST(ModelConfig, LoadFile) {
  const std::string path = (std::filesystem::path(::testing::TempDir()) / "hspmd_cfg.json").string();
  { std::ofstream(path) << minimal().dump(2); }
  EXPECT_EQ(ModelConfig::load(path).hidden_size, 64);

  { std::ofstream(path) << "{\"vocab_size\": 512,"; }
  try {
    ModelConfig::load(path);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("[config] " + path + ": not valid JSON", 0), 0u) << e.what();
  }

  json j = minimal();
  j.erase("hidden_size");
  { std::ofstream(path) << j.dump(); }
  try {
    ModelConfig::load(path);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), ("[config] " + path + ": missing required field 'hidden_size'").c_str());
  }

  const std::string missing = path + ".nope";
  try {
    ModelConfig::load(missing);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), ("[config] " + missing + ": cannot open file").c_str());
  }
}

}  // namespace
}  // namespace hspmd

namespace hspmd {
namespace {

std::string config_error(const json& j) {
  try {
    ModelConfig::from_json(j, "cfg.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ModelConfig, RejectsFieldsOfOtherModels) {
  json j = minimal();
  j["hidden_act"] = "gelu";
  EXPECT_EQ(config_error(j), "[config] cfg.json: hidden_act 'gelu' is not supported (only silu)");
  j = minimal();
  j["model_type"] = "gpt2";
  EXPECT_EQ(config_error(j),
            "[config] cfg.json: model_type 'gpt2' is not supported (registered: hspmd_custom, llama, mistral, mixtral, qwen2, qwen2_moe)");
  j = minimal();
  j["attention_dropout"] = 0.1;
  EXPECT_EQ(config_error(j),
            "[config] cfg.json: attention_dropout=0.1 is not supported (only 0: hspmd trains without dropout)");
  j = minimal();
  j["head_dim"] = 32;
  EXPECT_EQ(config_error(j),
            "[config] cfg.json: head_dim=32 is not supported (only hidden_size/num_attention_heads=16)");
  j = minimal();
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  EXPECT_EQ(config_error(j).rfind("[config] cfg.json: rope_scaling {", 0), 0u) << config_error(j);
  EXPECT_NE(config_error(j).find("is not supported (only null)"), std::string::npos);
  j = minimal();
  j["attention_bias"] = true;
  EXPECT_EQ(config_error(j), "[config] cfg.json: attention_bias=true is not supported (only false)");
  j = minimal();
  j["hidden_act"] = 3;
  EXPECT_EQ(config_error(j), "[config] cfg.json: field 'hidden_act' must be a string, got number 3");
}

TEST(ModelFamilies, Qwen2HasQkvBiasesAndRefusesItsSlidingWindow) {
  json j = minimal();
  j["model_type"] = "qwen2";
  j["sliding_window"] = 8;  // Hub files carry a number here; use_sliding_window decides
  j["use_sliding_window"] = false;
  j["tie_word_embeddings"] = true;
  const ModelConfig c = ModelConfig::from_json(j, "cfg.json");
  EXPECT_EQ(c.model_type, "qwen2");
  EXPECT_TRUE(c.attention_bias);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.max_position_embeddings, 32768);  // Qwen2Config's default
  std::vector<std::string> biases;
  for (const ModelParameter& p : model_parameters(c))
    if (p.name.ends_with(".bias")) {
      biases.push_back(p.name);
      EXPECT_EQ(p.role, ParamRole::kColumnParallel) << p.name;
      EXPECT_EQ(p.init, ParamInit::kZeros) << p.name;
      EXPECT_EQ(p.shape, Shape{64}) << p.name;  // 4 heads (and 4 kv heads) of 16
    }
  EXPECT_EQ(biases, (std::vector<std::string>{
                        "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias",
                        "model.layers.0.self_attn.v_proj.bias", "model.layers.1.self_attn.q_proj.bias",
                        "model.layers.1.self_attn.k_proj.bias", "model.layers.1.self_attn.v_proj.bias"}));
  // parameter_count (O(1), for the memory check) agrees with the declarations.
  double n = 0;
  for (const ModelParameter& p : model_parameters(c)) n += static_cast<double>(shape_numel(p.shape));
  EXPECT_EQ(c.parameter_count(), n);
  // The config's JSON reads back to the same model (plans carry it).
  const ModelConfig back = ModelConfig::from_json(c.to_json(), "plan");
  EXPECT_EQ(back.model_type, "qwen2");
  EXPECT_TRUE(back.attention_bias);
  j["use_sliding_window"] = true;
  EXPECT_EQ(config_error(j).rfind("[config] cfg.json: use_sliding_window=true is not supported", 0), 0u)
      << config_error(j);
}

TEST(ModelFamilies, MistralSlidingWindowDefaultsNullAndErrors) {
  json j = minimal();
  j["model_type"] = "mistral";
  EXPECT_EQ(ModelConfig::from_json(j, "cfg.json").sliding_window, 4096);  // MistralConfig's default
  j["sliding_window"] = nullptr;
  EXPECT_EQ(ModelConfig::from_json(j, "cfg.json").sliding_window, 0);  // null: no window
  j["sliding_window"] = 16;
  const ModelConfig c = ModelConfig::from_json(j, "cfg.json");
  EXPECT_EQ(c.sliding_window, 16);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(ModelConfig::from_json(c.to_json(), "plan").sliding_window, 16);
  // The cost terms: s^2/2 without a window; the window hides a triangle.
  EXPECT_DOUBLE_EQ(model_family("mistral").attention_pairs(c, 64), 64.0 * 16 - 16.0 * 16 / 2);
  EXPECT_DOUBLE_EQ(model_family("mistral").attention_pairs(c, 8), 32.0);
  EXPECT_DOUBLE_EQ(model_family("llama").attention_pairs(c, 64), 64.0 * 64 / 2);
  j["sliding_window"] = 0;
  EXPECT_EQ(config_error(j), "[config] cfg.json: sliding_window=0 must be positive (or null: no window)");
  j["sliding_window"] = "wide";
  EXPECT_EQ(config_error(j), "[config] cfg.json: field 'sliding_window' must be an integer, got string \"wide\"");
  // Llama reads no sliding_window: it is not a Llama field.
  j = minimal();
  j["sliding_window"] = 8;
  EXPECT_EQ(ModelConfig::from_json(j, "cfg.json").sliding_window, 0);
}

TEST(ModelFamilies, RegistryNamesEveryFamily) {
  EXPECT_EQ(registered_model_types(), "hspmd_custom, llama, mistral, mixtral, qwen2, qwen2_moe");
  for (const char* type : {"llama", "mistral", "qwen2"}) EXPECT_EQ(model_family(type).model_type(), type);
  EXPECT_EQ(find_model_family("gpt2"), nullptr);
  try {
    model_family("gpt2");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "[config] model_type 'gpt2' is not supported (registered: hspmd_custom, llama, mistral, mixtral, qwen2, qwen2_moe)");
  }
}

TEST(ModelConfig, AcceptsTheValuesHspmdBuilds) {
  json j = minimal();
  j["model_type"] = "llama";
  j["hidden_act"] = "silu";
  j["head_dim"] = 16;
  j["rope_scaling"] = nullptr;
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  EXPECT_EQ(ModelConfig::from_json(j, "cfg.json").head_dim(), 16);
}

TEST(ModelConfig, EveryExampleConfigLoads) {
  for (const auto& entry : std::filesystem::directory_iterator(HSPMD_SOURCE_DIR "/examples/models"))
    EXPECT_NO_THROW(ModelConfig::load(entry.path().string())) << entry.path();
  EXPECT_NO_THROW(ModelConfig::load(HSPMD_SOURCE_DIR "/examples/tiny-llama/config.json"));
}

TEST(ModelConfig, WrongTypeEchoesAtMost80Characters) {
  json j = minimal();
  j["hidden_size"] = std::string(10 << 20, 'x');
  const std::string what = config_error(j);
  EXPECT_LT(what.size(), 200u) << what.substr(0, 200);
  EXPECT_NE(what.find("xxx..."), std::string::npos);
}

TEST(ModelConfig, RefusesModelsLargerThanTheMachineBeforeAllocating) {
  json j = minimal();
  j["num_hidden_layers"] = kMaxHiddenLayers;
  j["hidden_size"] = 65536;
  j["num_attention_heads"] = 64;
  const ModelConfig c = ModelConfig::from_json(j, "cfg.json");
  EXPECT_GT(c.parameter_count(), 5e13);
  ASSERT_TRUE(machine_memory_bytes().has_value());
  try {
    check_parameters_fit_memory(c, "cfg.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GiB (MemTotal)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(init_model_parameters(c, 0), Error);
  EXPECT_NO_THROW(check_parameters_fit_memory(ModelConfig::from_json(minimal(), "cfg.json"), "cfg.json"));
}

}  // namespace
}  // namespace hspmd
