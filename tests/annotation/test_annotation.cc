#include <gtest/gtest.h>

#include "hspmd/annotation/annotation.h"
#include "hspmd/core/error.h"

namespace hspmd {
namespace {

const std::string kName = "model.layers.0.mlp.up_proj.weight";

Subgroup subgroup(std::vector<int> ranks, std::map<int, int> degrees, std::vector<int> order) {
  return Subgroup{DeviceGroup{std::move(ranks)}, DistStates{std::move(degrees), std::move(order)}};
}

// The example of docs/annotation.md ("Order"): Di = [4,5,6,7], split(0): 2, dup: 2, order [split(0), dup].
Annotation design_example() {
  return Annotation{{subgroup({4, 5, 6, 7}, {{split_key(0), 2}, {kDup, 2}}, {split_key(0), kDup})}, kDup};
}

// Expects validate() to throw an Error whose message names the tensor and contains `rule`.
void expect_invalid(const Annotation& a, const std::string& rule, int tensor_rank = 2, int world = 8,
                    bool is_parameter = false) {
  try {
    validate(a, kName, tensor_rank, world, is_parameter);
    ADD_FAILURE() << "no error for rule: " << rule;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("[annotation] tensor '" + kName + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(rule), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

Box box(Shape begin, Shape end) { return Box{std::move(begin), std::move(end)}; }

TEST(DeviceGroup, ContainsAndIndexOf) {
  DeviceGroup g{{4, 5, 6, 7}};
  EXPECT_EQ(g.size(), 4);
  EXPECT_TRUE(g.contains(6));
  EXPECT_FALSE(g.contains(0));
  EXPECT_EQ(g.index_of(6), 2);
  EXPECT_EQ(g.index_of(0), -1);
}

TEST(DistStates, DegreesAndMixedRadixLastKeyFastest) {
  DistStates s{{{split_key(0), 2}, {split_key(1), 3}, {kDup, 2}, {kPartial, 1}}, {kDup, split_key(0), split_key(1)}};
  EXPECT_EQ(s.degree(split_key(0)), 2);
  EXPECT_EQ(s.degree(split_key(2)), 1);
  EXPECT_EQ(s.degree(kPartial), 1);
  EXPECT_EQ(s.device_count(), 12);
  EXPECT_TRUE(s.is_split(1));
  EXPECT_FALSE(s.is_split(2));
  EXPECT_FALSE(s.has_partial());
  EXPECT_EQ(s.split_dims(), (std::vector<int>{0, 1}));
  // position 11 = 1*6 + 1*3 + 2
  EXPECT_EQ(s.coordinates(11), (std::vector<int>{1, 1, 2}));
  EXPECT_EQ(s.coordinates(4), (std::vector<int>{0, 1, 1}));
  EXPECT_EQ(s.coordinate(4, split_key(1)), 1);
  EXPECT_EQ(s.coordinate(4, kPartial), 0);
  EXPECT_THROW(s.coordinates(12), InternalError);
  // Chunks of a {4, 6} part: dim 0 in halves, dim 1 in thirds.
  EXPECT_EQ(chunk_box(s, {4, 6}, 11), box({2, 4}, {4, 6}));
  EXPECT_EQ(chunk_box(s, {4, 6}, 4), box({2, 2}, {4, 4}));
  EXPECT_THROW(chunk_box(s, {4, 5}, 0), Error);
}

TEST(DistStates, EqualityIgnoresDegreeOne) {
  DistStates a{{{split_key(0), 2}}, {split_key(0)}};
  DistStates b{{{split_key(0), 2}, {kDup, 1}}, {split_key(0)}};
  EXPECT_EQ(a, b);
  EXPECT_NE(a, (DistStates{{{split_key(1), 2}}, {split_key(1)}}));
}

TEST(Annotation, RanksAndSubgroupLookup) {
  Annotation a{{subgroup({0, 1}, {{kDup, 2}}, {kDup}), subgroup({5, 3, 4}, {{split_key(0), 3}}, {split_key(0)})}, 0};
  EXPECT_EQ(a.hsize(), 2);
  EXPECT_EQ(a.all_ranks(), (std::vector<int>{0, 1, 5, 3, 4}));
  EXPECT_EQ(a.subgroup_of(3), 1);
  EXPECT_EQ(a.subgroup_of(2), -1);
  EXPECT_TRUE(a.contains(0));
  EXPECT_FALSE(a.contains(7));
}

TEST(LocalBox, DesignExample) {
  Annotation a = design_example();
  EXPECT_NO_THROW(validate(a, kName, 2, 8, true));
  const Shape g{8, 3};
  EXPECT_EQ(*local_box(a, g, 4), box({0, 0}, {4, 3}));
  EXPECT_EQ(*local_box(a, g, 5), box({0, 0}, {4, 3}));
  EXPECT_EQ(*local_box(a, g, 6), box({4, 0}, {8, 3}));
  EXPECT_EQ(*local_box(a, g, 7), box({4, 0}, {8, 3}));
  EXPECT_FALSE(local_box(a, g, 0).has_value());
  // The other order interleaves: ranks 4,6 chunk 0 and ranks 5,7 chunk 1.
  a.subgroups[0].states.order = {kDup, split_key(0)};
  EXPECT_EQ(*local_box(a, g, 5), box({4, 0}, {8, 3}));
  EXPECT_EQ(*local_box(a, g, 6), box({0, 0}, {4, 3}));
}

// hsize 2 split along dim 0 with uneven parts (6 and 2 rows) and different
// bottom-tier states: subgroup 0 = [0,1,2,3] splits dim 1 in two, duplicated
// twice (split fastest); subgroup 1 = [5,4] splits dim 0 in two.
TEST(LocalBox, AsymmetricUnevenParts) {
  Annotation a{{subgroup({0, 1, 2, 3}, {{split_key(1), 2}, {kDup, 2}}, {kDup, split_key(1)}),
                subgroup({5, 4}, {{split_key(0), 2}}, {split_key(0)})},
               0};
  EXPECT_NO_THROW(validate(a, kName, 2, 6, true));
  const Shape g{8, 4};
  const std::vector<int64_t> parts{6, 2};
  EXPECT_NO_THROW(check_divisible(a, kName, g, parts));
  EXPECT_EQ(part_box(a, g, 0, parts), box({0, 0}, {6, 4}));
  EXPECT_EQ(part_box(a, g, 1, parts), box({6, 0}, {8, 4}));
  EXPECT_EQ(*local_box(a, g, 0, parts), box({0, 0}, {6, 2}));
  EXPECT_EQ(*local_box(a, g, 1, parts), box({0, 2}, {6, 4}));
  EXPECT_EQ(*local_box(a, g, 2, parts), box({0, 0}, {6, 2}));
  EXPECT_EQ(*local_box(a, g, 3, parts), box({0, 2}, {6, 4}));
  EXPECT_EQ(*local_box(a, g, 5, parts), box({6, 0}, {7, 4}));
  EXPECT_EQ(*local_box(a, g, 4, parts), box({7, 0}, {8, 4}));
  // Equal parts: 4 rows each.
  EXPECT_EQ(*local_box(a, g, 4), box({6, 0}, {8, 4}));
  EXPECT_EQ(*local_box(a, g, 3), box({0, 2}, {4, 4}));
  EXPECT_EQ(local_box(a, g, 3)->numel(), 8);
  // Top-tier dup: each subgroup shards the whole tensor.
  a.hdim = kDup;
  EXPECT_EQ(*local_box(a, g, 4), box({4, 0}, {8, 4}));
}

TEST(LocalBox, PartialFlags) {
  Annotation bottom{{subgroup({0, 1}, {{kPartial, 2}}, {kPartial}), subgroup({2}, {}, {})}, kDup};
  EXPECT_TRUE(holds_partial_sum(bottom, 0));
  EXPECT_TRUE(holds_partial_sum(bottom, 1));
  EXPECT_FALSE(holds_partial_sum(bottom, 2));
  EXPECT_FALSE(holds_partial_sum(bottom, 3));
  EXPECT_EQ(*local_box(bottom, {2, 2}, 1), box({0, 0}, {2, 2}));
  Annotation top{{subgroup({0}, {}, {}), subgroup({1}, {}, {})}, kPartial};
  EXPECT_TRUE(holds_partial_sum(top, 1));
  EXPECT_EQ(*local_box(top, {2, 2}, 1), box({0, 0}, {2, 2}));
  Annotation single{{subgroup({0}, {}, {})}, kPartial};  // sum of one value: not partial
  EXPECT_FALSE(holds_partial_sum(single, 0));
  EXPECT_FALSE(holds_partial_sum(design_example(), 4));
}

TEST(Validate, EveryRuleNamesTensorAndRule) {
  expect_invalid(Annotation{}, "has no subgroups");
  expect_invalid(Annotation{{subgroup({}, {}, {})}}, "subgroup 0 has an empty device group");
  expect_invalid(Annotation{{subgroup({1, 1}, {{kDup, 2}}, {kDup})}}, "subgroup 0 lists rank 1 twice");
  expect_invalid(Annotation{{subgroup({2, 3}, {{kDup, 2}}, {kDup}), subgroup({3}, {}, {})}, kDup},
                 "subgroups 0 and 1 share rank 3");
  expect_invalid(Annotation{{subgroup({7, 8}, {{kDup, 2}}, {kDup})}}, "rank 8 is outside the world [0, 8)");
  expect_invalid(Annotation{{subgroup({-1}, {}, {})}}, "rank -1 is outside");
  expect_invalid(Annotation{{subgroup({0}, {{-3, 1}}, {})}}, "invalid key -3");
  expect_invalid(Annotation{{subgroup({0}, {{split_key(0), 0}}, {})}}, "split(0) has degree 0");
  expect_invalid(Annotation{{subgroup({0, 1}, {{split_key(0), 2}, {kDup, -1}}, {split_key(0)})}},
                 "dup has degree -1; degrees must be positive");
  expect_invalid(Annotation{{subgroup({0, 1, 2}, {{split_key(0), 2}}, {split_key(0)})}},
                 "degrees multiply to 2 but the device group has 3 ranks");
  expect_invalid(Annotation{{subgroup({0, 1}, {{split_key(0), 2}}, {})}}, "order [] misses split(0) (degree 2)");
  expect_invalid(Annotation{{subgroup({0, 1}, {{split_key(0), 2}}, {split_key(0), split_key(0)})}},
                 "order lists split(0) twice");
  expect_invalid(Annotation{{subgroup({0, 1}, {{split_key(0), 2}, {kDup, 1}}, {split_key(0), kDup})}},
                 "order lists dup whose degree is 1");
  expect_invalid(Annotation{{subgroup({0, 1}, {{split_key(2), 2}}, {split_key(2)})}},
                 "split(2) is outside the tensor's rank 2");
  expect_invalid(Annotation{{subgroup({0}, {}, {})}, 2}, "hdim 2 is neither -2, -1 nor a dim");
  expect_invalid(Annotation{{subgroup({0}, {}, {})}, -3}, "hdim -3");
  expect_invalid(Annotation{{subgroup({0, 1}, {{kPartial, 2}}, {kPartial})}},
                 "subgroup 0: a parameter or optimizer state cannot be partial", 2, 8, true);
  expect_invalid(Annotation{{subgroup({0}, {}, {}), subgroup({1}, {}, {})}, kPartial},
                 "hdim -2 (partial) on a parameter", 2, 8, true);
  // The same partial annotations are fine on activations.
  EXPECT_NO_THROW(validate(Annotation{{subgroup({0}, {}, {}), subgroup({1}, {}, {})}, kPartial}, kName, 2, 8, false));
  EXPECT_NO_THROW(validate(Annotation{{subgroup({0, 1}, {{kPartial, 2}}, {kPartial})}}, kName, 2, 8, false));
}

TEST(CheckDivisible, PartsAndSplits) {
  auto expect_bad = [](const Annotation& a, const Shape& g, const std::vector<int64_t>& parts,
                       const std::string& rule) {
    try {
      check_divisible(a, kName, g, parts);
      ADD_FAILURE() << "no error for rule: " << rule;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("tensor '" + kName + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find(rule), std::string::npos) << msg;
    }
  };
  Annotation a{{subgroup({0, 1}, {{split_key(0), 2}}, {split_key(0)}), subgroup({2}, {}, {})}, 0};
  EXPECT_NO_THROW(check_divisible(a, kName, {6, 3}, {4, 2}));
  expect_bad(a, {6, 3}, {3, 3}, "subgroup 0: split(0): 2 does not divide size 3 of its part along dim 0");
  expect_bad(a, {6, 3}, {4, 1}, "part sizes sum to 5 but dim 0 has size 6");
  expect_bad(a, {6, 3}, {6}, "1 part sizes given for 2 subgroups");
  expect_bad(a, {6, 3}, {8, -2}, "negative part size -2");
  expect_bad(a, {7, 3}, {}, "dim 0 of size 7 does not split into 2 equal parts");
  expect_bad(a, {}, {}, "hdim 0 is outside the shape");
  a.hdim = kDup;
  expect_bad(a, {6, 3}, {4, 2}, "part sizes given but hdim is -1");
  expect_bad(a, {5, 3}, {}, "split(0): 2 does not divide size 5");
  // A negative size was divisible (-8 % 2 == 0) and gave a box (issue 39).
  expect_bad(a, {-8, 3}, {}, "has the negative size -8 along dim 0");
  expect_bad(a, {6, -1}, {}, "has the negative size -1 along dim 1");
  // local_box runs the same checks (its message names no tensor).
  EXPECT_THROW(local_box(a, {5, 3}, 0), Error);
  EXPECT_THROW(local_box(a, {-8, 3}, 0), Error);
  EXPECT_THROW(local_box(a, {6, 3}, 0, {4, 2}), Error);
}

TEST(Json, RoundTrip) {
  Annotation a{{subgroup({0, 1, 2, 3}, {{split_key(1), 2}, {kDup, 2}}, {kDup, split_key(1)}),
                subgroup({5, 4}, {{split_key(0), 2}, {kPartial, 1}}, {split_key(0)}), subgroup({6}, {}, {})},
               0};
  nlohmann::json j = to_json(a);
  EXPECT_EQ(j["subgroups"][0]["states"]["split1"], 2);
  EXPECT_EQ(j["subgroups"][0]["order"], nlohmann::json({"dup", "split1"}));
  EXPECT_EQ(annotation_from_json(j, kName), a);
  EXPECT_EQ(annotation_from_json(nlohmann::json::parse(j.dump()), kName), a);
  EXPECT_EQ(to_json(design_example()), nlohmann::json::parse(R"({"hdim": -1, "subgroups": [
      {"ranks": [4, 5, 6, 7], "states": {"split0": 2, "dup": 2}, "order": ["split0", "dup"]}]})"));
}

// Subgroups that repeat one at a constant rank stride (every data-parallel
// replica's TP group) are written as one entry with "repeat": [count,
// stride], and read back as the same subgroups.
TEST(Json, RepeatedSubgroupsAreOneEntry) {
  Annotation a{{}, 0};
  for (int k = 0; k < 5; ++k)
    a.subgroups.push_back(subgroup({8 * k + 1, 8 * k}, {{split_key(1), 2}}, {split_key(1)}));
  a.subgroups.push_back(subgroup({40, 41}, {{split_key(1), 2}}, {split_key(1)}));  // rank order differs
  a.subgroups.push_back(subgroup({50, 51}, {{kDup, 2}}, {kDup}));                  // states differ
  a.subgroups.push_back(subgroup({60, 61}, {{kDup, 2}}, {kDup}));                  // a run of 2
  const nlohmann::json j = to_json(a);
  ASSERT_EQ(j["subgroups"].size(), 3u) << j.dump();
  EXPECT_EQ(j["subgroups"][0]["ranks"], nlohmann::json({1, 0}));
  EXPECT_EQ(j["subgroups"][0]["repeat"], nlohmann::json({5, 8}));
  EXPECT_FALSE(j["subgroups"][1].contains("repeat"));
  EXPECT_EQ(j["subgroups"][2]["repeat"], nlohmann::json({2, 10}));
  EXPECT_EQ(annotation_from_json(nlohmann::json::parse(j.dump()), kName), a);
  // A single subgroup, or one of another size, never repeats.
  EXPECT_FALSE(to_json(design_example())["subgroups"][0].contains("repeat"));
}

TEST(Json, DefaultsForHdimAndOrder) {
  Annotation a = annotation_from_json(nlohmann::json::parse(R"({"subgroups": [
      {"ranks": [0, 1, 2, 3, 4, 5, 6, 7], "states": {"split1": 2, "dup": 2, "partial": 2, "split0": 1}}]})"),
                                      kName);
  EXPECT_EQ(a.hdim, kDup);
  EXPECT_EQ(a.subgroups[0].states.order, (std::vector<int>{kPartial, kDup, split_key(1)}));
  EXPECT_NO_THROW(validate(a, kName, 2, 8, false));
}

TEST(Json, MalformedNamesTheField) {
  auto expect_bad = [](const std::string& text, const std::string& field) {
    try {
      annotation_from_json(nlohmann::json::parse(text), kName);
      ADD_FAILURE() << "no error for " << text;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("[annotation] tensor '" + kName + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find(field), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  };
  expect_bad("[1, 2]", "must be a JSON object");
  expect_bad(R"({"hdim": -1})", "field 'subgroups': missing");
  expect_bad(R"({"subgroups": {}})", "field 'subgroups': must be an array");
  expect_bad(R"({"hdim": "0", "subgroups": []})", "field 'hdim': must be an integer");
  expect_bad(R"({"hdim": 1.5, "subgroups": []})", "field 'hdim': must be an integer");
  expect_bad(R"({"hdim": 0, "subgroups": [], "hsize": 2})", "field 'hsize': unknown field");
  expect_bad(R"({"subgroups": [3]})", "field 'subgroups[0]': must be an object");
  expect_bad(R"({"subgroups": [{"states": {}}]})", "field 'subgroups[0].ranks': missing");
  expect_bad(R"({"subgroups": [{"ranks": 0, "states": {}}]})", "field 'subgroups[0].ranks': must be an array");
  expect_bad(R"({"subgroups": [{"ranks": [0, "1"], "states": {}}]})", "field 'subgroups[0].ranks[1]'");
  expect_bad(R"({"subgroups": [{"ranks": [0, 99999999999], "states": {}}]})", "out of range");
  expect_bad(R"({"subgroups": [{"ranks": [0]}]})", "field 'subgroups[0].states': missing");
  expect_bad(R"({"subgroups": [{"ranks": [0], "states": [2]}]})", "field 'subgroups[0].states': must be an object");
  expect_bad(R"({"subgroups": [{"ranks": [0], "states": {}, "repeat": 3}]})",
             "field 'subgroups[0].repeat': must be [count, stride]");
  expect_bad(R"({"subgroups": [{"ranks": [0], "states": {}, "repeat": [0, 1]}]})",
             "field 'subgroups[0].repeat[0]': count 0 is outside");
  expect_bad(R"({"subgroups": [{"ranks": [0], "states": {}, "repeat": [2, 0]}]})",
             "field 'subgroups[0].repeat[1]': stride must be >= 1");
  expect_bad(R"({"subgroups": [{"ranks": [0, 1, 2, 3], "states": {}, "repeat": [1000000, 4]}]})",
             "1000000 copies of 4 ranks exceed the largest world");
  expect_bad(R"({"subgroups": [{"ranks": [2000000000], "states": {}, "repeat": [1000, 1000000]}]})",
             "field 'subgroups[0].repeat': rank 2000000000 + 999 x 1000000 is out of range");
  expect_bad(R"({"subgroups": [{"ranks": [0, 1], "states": {"split": 2}}]})",
             "field 'subgroups[0].states.split': key 'split' is not splitN");
  expect_bad(R"({"subgroups": [{"ranks": [0, 1], "states": {"split-1": 2}}]})", "key 'split-1'");
  expect_bad(R"({"subgroups": [{"ranks": [0, 1], "states": {"split0x": 2}}]})", "key 'split0x'");
  expect_bad(R"({"subgroups": [{"ranks": [0, 1], "states": {"dup": true}}]})", "field 'subgroups[0].states.dup'");
  expect_bad(R"({"subgroups": [{"ranks": [0, 1], "states": {"dup": 2}, "order": "dup"}]})",
             "field 'subgroups[0].order': must be an array");
  expect_bad(R"({"subgroups": [{"ranks": [0, 1], "states": {"dup": 2}, "order": [-1]}]})",
             "field 'subgroups[0].order[0]': must be a string key");
  expect_bad(R"({"subgroups": [{"ranks": [0, 1], "states": {"dup": 2}, "order": ["dupe"]}]})",
             "field 'subgroups[0].order[0]': key 'dupe'");
  expect_bad(R"({"subgroups": [{"ranks": [0], "states": {}, "oder": []}]})", "field 'subgroups[0].oder': unknown field");
}

TEST(Annotation, PartWeightsGiveProportionalParts) {
  Annotation a;
  a.hdim = 0;
  a.subgroups = {Subgroup{DeviceGroup{{0, 1}}, DistStates{{{0, 2}}, {0}}},
                 Subgroup{DeviceGroup{{2}}, DistStates{}}};
  a.part_weights = {3, 1};
  validate(a, "x", 2, 3, false);
  EXPECT_EQ(part_sizes(a, "x", 8), (std::vector<int64_t>{6, 2}));
  // [6, 4] split 3:1: rank 0 holds rows 0..2 of part 0, rank 2 holds rows 6..7.
  EXPECT_EQ(local_box(a, {8, 4}, 1), (Box{{3, 0}, {6, 4}}));
  EXPECT_EQ(local_box(a, {8, 4}, 2), (Box{{6, 0}, {8, 4}}));
  EXPECT_THROW(part_sizes(a, "x", 6), Error);  // 6 * 3 / 4 is not whole
  EXPECT_EQ(annotation_from_json(to_json(a), "x"), a);
  a.part_weights = {3, 0};
  EXPECT_THROW(validate(a, "x", 2, 3, false), Error);
  a.part_weights = {3, 1, 1};
  EXPECT_THROW(validate(a, "x", 2, 3, false), Error);
}

}  // namespace
}  // namespace hspmd
