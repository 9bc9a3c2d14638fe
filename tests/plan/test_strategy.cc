// Strategy JSON: parsing (strict), round trip, and every validation rule.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "hspmd/core/error.h"
#include "hspmd/plan/strategy.h"

namespace hspmd {
namespace {

using nlohmann::json;

// The tiny test model: 8 layers, 8 heads, 4 KV heads, FFN 128, vocab 256.
ModelConfig tiny() {
  return ModelConfig{.vocab_size = 256,
                     .hidden_size = 64,
                     .intermediate_size = 128,
                     .num_hidden_layers = 8,
                     .num_attention_heads = 8,
                     .num_key_value_heads = 4};
}

// docs/strategy.md's example with other layer ranges: two pipelines, tp 2 vs tp 1, uneven layers.
json hetero() {
  return json::parse(R"({
    "schedule": "1f1b", "zero": false,
    "pipelines": [
      {"micro_batch_size": 1, "micro_batches": 4,
       "stages": [{"ranks": [0, 1], "layers": [0, 3]}, {"ranks": [2, 3], "layers": [4, 7]}]},
      {"micro_batch_size": 2, "micro_batches": 2,
       "stages": [{"ranks": [4], "layers": [0, 4]}, {"ranks": [5], "layers": [5, 6]},
                  {"ranks": [6], "layers": [7, 7]}]}]})");
}

// The message of the hspmd::Error `f` throws ("" when it does not throw).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string parse_error(const json& j) {
  return error_of([&] { strategy_from_json(j); });
}

std::string validate_error(const json& j, int world = 8, const ModelConfig& c = tiny()) {
  return error_of([&] { validate(strategy_from_json(j), c, world); });
}

#define EXPECT_MESSAGE(msg, needle)                                     \
  do {                                                                  \
    const std::string m_ = (msg);                                       \
    EXPECT_NE(m_.find(needle), std::string::npos) << "message: " << m_; \
    EXPECT_EQ(m_.find('\n'), std::string::npos) << "message: " << m_;   \
  } while (0)

TEST(StrategyParse, ReadsEveryField) {
  const Strategy s = strategy_from_json(hetero());
  EXPECT_EQ(s.schedule, "1f1b");
  EXPECT_FALSE(s.zero);
  ASSERT_EQ(s.pipelines.size(), 2u);
  EXPECT_EQ(s.pipelines[0].micro_batches, 4);
  EXPECT_EQ(s.pipelines[1].micro_batch_size, 2);
  ASSERT_EQ(s.pipelines[1].stages.size(), 3u);
  EXPECT_EQ(s.pipelines[0].stages[1].ranks, (std::vector<int>{2, 3}));
  EXPECT_EQ(s.pipelines[0].stages[1].first_layer, 4);
  EXPECT_EQ(s.pipelines[0].stages[1].last_layer, 7);
  EXPECT_EQ(s.pipelines[0].stages[1].tp(), 2);
  EXPECT_EQ(s.pipelines[1].stages[0].num_layers(), 5);
  EXPECT_EQ(s.global_batch(), 8);
  EXPECT_EQ(s.ranks(), (std::vector<int>{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_NO_THROW(validate(s, tiny(), 8));
}

TEST(StrategyParse, Defaults) {
  json j = hetero();
  j.erase("schedule");
  j.erase("zero");
  const Strategy s = strategy_from_json(j);
  EXPECT_EQ(s.schedule, "1f1b");
  EXPECT_FALSE(s.zero);
  EXPECT_EQ(s.pipelines[0].stages[0].cp, 1);
  EXPECT_TRUE(s.description.empty());
}

TEST(StrategyParse, CpAndZeroAndGpipe) {
  json j = hetero();
  j["schedule"] = "gpipe";
  j["zero"] = true;
  j["pipelines"][0]["stages"][0] = json::parse(R"({"ranks": [0, 1, 7, 8], "layers": [0, 3], "cp": 2})");
  const Strategy s = strategy_from_json(j);
  EXPECT_EQ(s.schedule, "gpipe");
  EXPECT_TRUE(s.zero);
  EXPECT_EQ(s.pipelines[0].stages[0].cp, 2);
  EXPECT_EQ(s.pipelines[0].stages[0].tp(), 2);
  EXPECT_NO_THROW(validate(s, tiny(), 9));
}

TEST(StrategyParse, RoundTrip) {
  json j = hetero();
  j["description"] = "paper table X";
  j["zero"] = true;
  j["pipelines"][1]["stages"][0] = json::parse(R"({"ranks": [4, 7], "layers": [0, 4], "cp": 2})");
  const Strategy s = strategy_from_json(j);
  const json out = to_json(s);
  EXPECT_EQ(out, j);
  EXPECT_EQ(strategy_from_json(out), s);
  EXPECT_FALSE(to_json(strategy_from_json(hetero())).contains("description"));
  EXPECT_FALSE(out["pipelines"][0]["stages"][0].contains("cp"));
}

TEST(StrategyParse, Recompute) {
  json j = hetero();
  j["pipelines"][0]["stages"][1]["recompute"] = true;
  j["pipelines"][1]["stages"][0]["recompute"] = false;
  const Strategy s = strategy_from_json(j);
  EXPECT_FALSE(s.pipelines[0].stages[0].recompute);  // the default
  EXPECT_TRUE(s.pipelines[0].stages[1].recompute);
  EXPECT_FALSE(s.pipelines[1].stages[0].recompute);
  const json out = to_json(s);
  EXPECT_EQ(out["pipelines"][0]["stages"][1]["recompute"], true);
  EXPECT_FALSE(out["pipelines"][1]["stages"][0].contains("recompute"));  // false is not written
  EXPECT_EQ(strategy_from_json(out), s);
  EXPECT_NO_THROW(validate(s, tiny(), 8));
  j["pipelines"][1]["stages"][2]["recompute"] = "yes";
  EXPECT_MESSAGE(parse_error(j), "[strategy] pipeline 1 stage 2: field 'recompute' must be true or false");
  j["pipelines"][1]["stages"][2]["recompute"] = 1;
  EXPECT_MESSAGE(parse_error(j), "pipeline 1 stage 2: field 'recompute' must be true or false, got number");
}

TEST(StrategyParse, UnknownFields) {
  json j = hetero();
  j["pipelines"][1]["stages"][2]["tp"] = 1;
  EXPECT_MESSAGE(parse_error(j), "[strategy] pipeline 1 stage 2: unknown field 'tp'");
  j = hetero();
  j["pipelines"][0]["batch"] = 4;
  EXPECT_MESSAGE(parse_error(j), "[strategy] pipeline 0: unknown field 'batch'");
  j = hetero();
  j["zero1"] = true;
  EXPECT_MESSAGE(parse_error(j), "[strategy] unknown field 'zero1'");
}

TEST(StrategyParse, MissingFields) {
  json j = hetero();
  j.erase("pipelines");
  EXPECT_MESSAGE(parse_error(j), "missing required field 'pipelines'");
  j = hetero();
  j["pipelines"][0].erase("micro_batch_size");
  EXPECT_MESSAGE(parse_error(j), "[strategy] pipeline 0: missing required field 'micro_batch_size'");
  j = hetero();
  j["pipelines"][1].erase("micro_batches");
  EXPECT_MESSAGE(parse_error(j), "pipeline 1: missing required field 'micro_batches'");
  j = hetero();
  j["pipelines"][1]["stages"][1].erase("layers");
  EXPECT_MESSAGE(parse_error(j), "pipeline 1 stage 1: missing required field 'layers'");
  j = hetero();
  j["pipelines"][0]["stages"][0].erase("ranks");
  EXPECT_MESSAGE(parse_error(j), "pipeline 0 stage 0: missing required field 'ranks'");
}

TEST(StrategyParse, WrongTypes) {
  EXPECT_MESSAGE(parse_error(json::array()), "[strategy] expected a JSON object");
  json j = hetero();
  j["pipelines"][1]["stages"][0]["layers"] = {0, 1, 4};
  EXPECT_MESSAGE(parse_error(j), "[strategy] pipeline 1 stage 0: field 'layers' must be [first, last]");
  j["pipelines"][1]["stages"][0]["layers"] = 3;
  EXPECT_MESSAGE(parse_error(j), "field 'layers' must be an array");
  j = hetero();
  j["pipelines"][0]["stages"][0]["ranks"] = {0, "1"};
  EXPECT_MESSAGE(parse_error(j), "pipeline 0 stage 0: field 'ranks' entry must be an integer");
  j = hetero();
  j["pipelines"][0]["micro_batches"] = 1.5;
  EXPECT_MESSAGE(parse_error(j), "field 'micro_batches' must be an integer");
  j = hetero();
  j["pipelines"][0]["micro_batches"] = 1LL << 40;
  EXPECT_MESSAGE(parse_error(j), "out of range");
  j = hetero();
  j["zero"] = 1;
  EXPECT_MESSAGE(parse_error(j), "field 'zero' must be true or false");
  j = hetero();
  j["schedule"] = 1;
  EXPECT_MESSAGE(parse_error(j), "field 'schedule' must be a string");
  j = hetero();
  j["pipelines"] = json::object();
  EXPECT_MESSAGE(parse_error(j), "field 'pipelines' must be an array");
  j = hetero();
  j["pipelines"][0]["stages"][1] = 5;
  EXPECT_MESSAGE(parse_error(j), "pipeline 0 stage 1: expected a JSON object");
}

TEST(StrategyValidate, TopLevel) {
  json j = hetero();
  j["schedule"] = "interleaved";
  EXPECT_MESSAGE(validate_error(j), "[strategy] unknown schedule 'interleaved'");
  j = hetero();
  j["pipelines"] = json::array();
  EXPECT_MESSAGE(validate_error(j), "[strategy] no pipelines");
  EXPECT_MESSAGE(validate_error(hetero(), 0), "world size must be positive");
  EXPECT_EQ(validate_error(hetero(), 1000000000), "[strategy] world size 1000000000 is above the limit of 1048576 ranks");
}

TEST(StrategyParse, FileWithDuplicateKeyIsRejected) {
  const std::string path = ::testing::TempDir() + "hspmd_dup_strategy.json";
  std::string text = hetero().dump();
  text.insert(1, "\"zero\": true, ");  // "zero" now appears twice
  { std::ofstream(path) << text; }
  EXPECT_EQ(error_of([&] { load_strategy(path); }), "[strategy] " + path + ": duplicate key 'zero'");
  std::string nested = hetero().dump();
  nested.replace(nested.find("\"layers\""), 0, "\"cp\": 1, \"cp\": 2, ");
  { std::ofstream(path) << nested; }
  EXPECT_EQ(error_of([&] { load_strategy(path); }), "[strategy] " + path + ": duplicate key 'cp'");
  std::remove(path.c_str());
}

TEST(StrategyParse, HugeValuesAreEchoedShort) {
  json j = hetero();
  j["pipelines"][0]["micro_batches"] = std::string(1 << 20, '7');
  const std::string m = parse_error(j);
  EXPECT_LT(m.size(), 250u) << m.substr(0, 300);
  EXPECT_MESSAGE(m, "must be an integer, got string \"7777");
  j = hetero();
  j[std::string(1 << 20, 'k')] = 1;
  EXPECT_LT(parse_error(j).size(), 250u);
}

TEST(StrategyValidate, PipelineRules) {
  json j = hetero();
  j["pipelines"][1]["stages"] = json::array();
  EXPECT_MESSAGE(validate_error(j), "[strategy] pipeline 1: a pipeline needs at least one stage");
  j = hetero();
  j["pipelines"][0]["micro_batch_size"] = 0;
  EXPECT_MESSAGE(validate_error(j), "[strategy] pipeline 0: micro_batch_size=0 must be at least 1");
  j = hetero();
  j["pipelines"][1]["micro_batches"] = -2;
  EXPECT_MESSAGE(validate_error(j), "[strategy] pipeline 1: micro_batches=-2 must be at least 1");
}

TEST(StrategyValidate, RankRules) {
  json j = hetero();
  j["pipelines"][0]["stages"][1]["ranks"] = json::array();
  EXPECT_MESSAGE(validate_error(j), "[strategy] pipeline 0 stage 1: a stage needs at least one rank");
  j = hetero();
  j["pipelines"][1]["stages"][0]["ranks"] = {3};
  EXPECT_MESSAGE(validate_error(j),
                 "[strategy] pipeline 1 stage 0: rank 3 appears twice (pipeline 0 stage 1 and "
                 "pipeline 1 stage 0)");
  j = hetero();
  j["pipelines"][0]["stages"][0]["ranks"] = {0, 0};
  EXPECT_MESSAGE(validate_error(j), "rank 0 appears twice (pipeline 0 stage 0 and pipeline 0 stage 0)");
  j = hetero();
  j["pipelines"][1]["stages"][2]["ranks"] = {9};
  EXPECT_MESSAGE(validate_error(j), "[strategy] pipeline 1 stage 2: rank 9 is outside the world of 8 ranks");
  j["pipelines"][1]["stages"][2]["ranks"] = {-1};
  EXPECT_MESSAGE(validate_error(j), "rank -1 is outside the world of 8 ranks");
  EXPECT_MESSAGE(validate_error(hetero(), 6), "pipeline 1 stage 2: rank 6 is outside the world of 6 ranks");
}

TEST(StrategyValidate, CpRules) {
  json j = hetero();
  j["pipelines"][0]["stages"][0]["cp"] = 0;
  EXPECT_MESSAGE(validate_error(j), "[strategy] pipeline 0 stage 0: cp=0 must be at least 1");
  j["pipelines"][0]["stages"][0]["cp"] = 3;
  EXPECT_MESSAGE(validate_error(j), "pipeline 0 stage 0: cp=3 does not divide the stage's 2 ranks");
  j["pipelines"][0]["stages"][0]["cp"] = 2;  // tp 1 x cp 2
  EXPECT_EQ(validate_error(j), "");
}

TEST(StrategyValidate, LayerRules) {
  json j = hetero();
  j["pipelines"][0]["stages"][1]["layers"] = {5, 7};
  EXPECT_MESSAGE(validate_error(j), "[strategy] pipeline 0 stage 1: layers [5, 7] leave a gap after layer 3");
  j = hetero();
  j["pipelines"][1]["stages"][1]["layers"] = {4, 6};
  EXPECT_MESSAGE(
      validate_error(j),
      "[strategy] pipeline 1 stage 1: layers [4, 6] overlap the previous stage, which ends at layer 4");
  j = hetero();
  j["pipelines"][0]["stages"][0]["layers"] = {1, 3};
  EXPECT_MESSAGE(validate_error(j), "pipeline 0 stage 0: layers [1, 3] do not start at layer 0");
  j = hetero();
  j["pipelines"][0]["stages"][1]["layers"] = {4, 6};
  EXPECT_MESSAGE(validate_error(j),
                 "pipeline 0 stage 1: the stages end at layer 6 but the model has 8 layers [0, 7]");
  j = hetero();
  j["pipelines"][0]["stages"][1]["layers"] = {4, 8};
  EXPECT_MESSAGE(validate_error(j),
                 "pipeline 0 stage 1: layers [4, 8] are outside the model's 8 layers [0, 7]");
  j = hetero();
  j["pipelines"][0]["stages"][0]["layers"] = {-1, 3};
  EXPECT_MESSAGE(validate_error(j), "layers [-1, 3] are outside the model's 8 layers");
  j = hetero();
  j["pipelines"][1]["stages"][1]["layers"] = {6, 5};
  EXPECT_MESSAGE(validate_error(j), "pipeline 1 stage 1: layers [6, 5] are reversed (first > last)");
  j = hetero();
  j["pipelines"][0]["stages"] = {j["pipelines"][0]["stages"][1], j["pipelines"][0]["stages"][0]};
  EXPECT_MESSAGE(validate_error(j), "pipeline 0 stage 0: layers [4, 7] do not start at layer 0");
}

TEST(StrategyValidate, TensorParallelRules) {
  json j = hetero();
  j["pipelines"][0]["stages"][0]["ranks"] = {0, 1, 7};
  EXPECT_MESSAGE(validate_error(j),
                 "[strategy] pipeline 0 stage 0: tp=3 does not divide num_attention_heads=8");
  ModelConfig c = tiny();
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  EXPECT_MESSAGE(validate_error(hetero(), 8, c),
                 "pipeline 0 stage 0: tp=2 does not divide num_key_value_heads=1");
  c = tiny();
  c.intermediate_size = 129;
  EXPECT_MESSAGE(validate_error(hetero(), 8, c), "tp=2 does not divide intermediate_size=129");
  c = tiny();
  c.vocab_size = 255;  // the plan pads the vocabulary instead (test_plan)
  EXPECT_EQ(validate_error(hetero(), 8, c), "");
  // cp divides the stage first: 4 ranks with cp 2 is tp 2, fine.
  j = hetero();
  j["pipelines"][0]["stages"][0] = json::parse(R"({"ranks": [0, 1, 7, 8], "layers": [0, 3], "cp": 2})");
  EXPECT_EQ(validate_error(j, 9), "");
  j["pipelines"][0]["stages"][0]["cp"] = 1;  // tp 4 divides everything too
  EXPECT_EQ(validate_error(j, 9), "");
}

TEST(StrategyValidate, KvHeadsDefaultToHeads) {
  ModelConfig c = tiny();
  c.num_key_value_heads = 0;  // hand-built config: means "= heads"
  EXPECT_EQ(validate_error(hetero(), 8, c), "");
}

TEST(StrategyHelpers, IdleRanks) {
  const Strategy s = strategy_from_json(hetero());
  EXPECT_EQ(idle_ranks(s, 8), (std::vector<int>{7}));
  EXPECT_EQ(idle_ranks(s, 10), (std::vector<int>{7, 8, 9}));
  EXPECT_TRUE(idle_ranks(s, 7).empty());
  EXPECT_TRUE(idle_ranks(s, 3).empty());
}

TEST(StrategyHelpers, FormatRanks) {
  EXPECT_EQ(format_ranks({}), "");
  EXPECT_EQ(format_ranks({4}), "4");
  EXPECT_EQ(format_ranks({0, 1, 2, 3, 5, 8, 9}), "0-3,5,8-9");
}

class StrategyFile : public ::testing::Test {
 protected:
  std::string write(const std::string& name, const std::string& text) {
    const std::string path = ::testing::TempDir() + name;
    std::ofstream(path) << text;
    return path;
  }
};

TEST_F(StrategyFile, LoadsAFile) {
  const std::string path = write("ok_strategy.json", hetero().dump(2));
  EXPECT_EQ(load_strategy(path), strategy_from_json(hetero()));
}

TEST_F(StrategyFile, ErrorsNameTheFile) {
  EXPECT_MESSAGE(error_of([] { load_strategy("/no/such/strategy.json"); }),
                 "[strategy] /no/such/strategy.json: cannot open file");
  const std::string bad = write("bad_syntax.json", "{\"pipelines\": [\n{\"stages\": }\n");
  const std::string m = error_of([&] { load_strategy(bad); });
  EXPECT_MESSAGE(m, "[strategy] " + bad + ": not valid JSON");
  json j = hetero();
  j["pipelines"][0]["stages"][0]["tpp"] = 2;
  const std::string unknown = write("unknown_field.json", j.dump());
  EXPECT_MESSAGE(error_of([&] { load_strategy(unknown); }),
                 "[strategy] " + unknown + ": pipeline 0 stage 0: unknown field 'tpp'");
}

// Every example strategy is valid for its model and world; the paper's use a
// global batch of 64 (tab:loss).
struct Example {
  const char* strategy;
  const char* model;
  int world;
  int global_batch;
  std::vector<int> idle;
};

TEST(StrategyExamples, AllValidate) {
  const std::string root = HSPMD_SOURCE_DIR "/examples/";
  std::vector<int> c7_idle = {8, 9, 10, 11, 12, 13, 14, 15};
  const Example examples[] = {
      {"hetero_32b_16h800_16h20", "llama-32b", 32, 64, {}},
      {"hetero_32b_16h800_24h20", "llama-32b", 40, 64, {}},
      {"hetero_32b_16h800_32h20", "llama-32b", 48, 64, {}},
      {"hetero_70b_16h800_16h20", "llama-70b", 32, 64, {}},
      {"hetero_70b_16h800_24h20", "llama-70b", 40, 64, {}},
      {"hetero_70b_16h800_32h20", "llama-70b", 48, 64, {}},
      {"elastic_c1_32h20", "llama-32b", 32, 64, {}},
      {"elastic_c2_31h20", "llama-32b", 31, 64, {}},
      {"elastic_c3_24h20", "llama-32b", 24, 64, {}},
      {"elastic_c4_16h800_32h20", "llama-32b", 48, 64, {}},
      {"elastic_c5_16h800_24h20", "llama-32b", 40, 64, {}},
      {"elastic_c6_15h800_24h20", "llama-32b", 40, 64, {15}},
      {"elastic_c7_8h800_24h20", "llama-32b", 40, 64, c7_idle},
      {"tiny_hetero_8", "llama-tiny-8l", 8, 6, {7}},
      {"tiny_zero_8", "llama-tiny-8l", 8, 8, {}},
      {"tiny_cp_8", "llama-tiny-8l", 8, 8, {}},
      {"tiny_example_hetero_5", "../tiny-llama/config", 5, 16, {}},
      {"tiny_cp_packed_6", "../tiny-llama/config", 6, 16, {}},
  };
  for (const Example& e : examples) {
    SCOPED_TRACE(e.strategy);
    const Strategy s = load_strategy(root + "strategies/" + e.strategy + ".json");
    const ModelConfig c = ModelConfig::load(root + "models/" + e.model + ".json");
    EXPECT_NO_THROW(validate(s, c, e.world));
    EXPECT_EQ(s.global_batch(), e.global_batch);
    EXPECT_EQ(idle_ranks(s, e.world), e.idle);
    EXPECT_FALSE(s.description.empty());
  }
}

}  // namespace
}  // namespace hspmd
