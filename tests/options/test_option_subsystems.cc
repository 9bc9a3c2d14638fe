// The training options by subsystem (hspmd/options/subsystem_options.h):
// each subsystem's validate() alone refuses its own bad value naming that
// field, validate(TrainOptions) runs every subsystem's validate() and the
// rules between subsystems, and train_option_table() is the subsystems'
// tables in order.
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "hspmd/core/options.h"
#include "hspmd/options/train_options.h"
#include "test_util.h"

namespace hspmd {
namespace {

using testing::error_of;

// Sets the front end's spelling for one test and puts the flag back.
struct Spelling {
  explicit Spelling(OptionSpelling s) { set_option_spelling(s); }
  ~Spelling() { set_option_spelling(OptionSpelling::kFlag); }
};

// One bad value of a subsystem: `spoil` breaks it in the subsystem's part of
// a TrainOptions, `field` is what the error must name and `rule` the rest.
struct BadValue {
  const char* subsystem;
  std::function<void(TrainOptions&)> spoil;
  std::function<void(const TrainOptions&)> validate_alone;  // that subsystem's validate() only
  std::string field, rule;
};

template <typename Part>
std::function<void(const TrainOptions&)> alone() {
  return [](const TrainOptions& o) { validate(static_cast<const Part&>(o)); };
}

std::vector<BadValue> bad_values() {
  return {
      {"data", [](TrainOptions& o) { o.steps = 0; }, alone<DataOptions>(), "steps", " must be positive, got 0"},
      {"optimizer", [](TrainOptions& o) { o.clip_grad = -1; }, alone<OptimizerOptions>(), "clip_grad",
       " must be >= 0, got -1"},
      {"output", [](TrainOptions& o) { o.threads = 0; }, alone<OutputOptions>(), "threads",
       " must lie in [1, 1024], got 0"},
      {"parallel", [](TrainOptions& o) { o.model_clock = true; }, alone<ParallelOptions>(), "clock",
       " model needs cluster (it times an emulated cluster)"},
      {"switching", [](TrainOptions& o) { o.switch_bucket_mb = std::numeric_limits<double>::infinity(); }, alone<SwitchingOptions>(),
       "switch_bucket_mb", " must be a finite number, got inf"},
      {"elastic",
       [](TrainOptions& o) {
         o.events_path = "events.json";
         o.straggler_horizon = 0;
       },
       alone<ElasticOptions>(), "straggler_horizon", " must be >= 1, got 0"},
      {"checkpoint", [](TrainOptions& o) { o.save_every = 2; }, alone<CheckpointOptions>(), "save_every",
       " needs checkpoint DIR"},
  };
}

TrainOptions valid_options() {
  TrainOptions o = default_train_options();
  o.steps = 1;
  return o;
}

// The keyword spelling, so that an option named in the rule reads as its
// field too ("needs checkpoint DIR").
TEST(OptionSubsystems, EachValidateAloneRefusesItsOwnBadValueNamingTheField) {
  Spelling keyword(OptionSpelling::kKeyword);
  for (const BadValue& bad : bad_values()) {
    const TrainOptions good = valid_options();
    EXPECT_EQ(error_of([&] { bad.validate_alone(good); }), "") << bad.subsystem;
    TrainOptions o = good;
    bad.spoil(o);
    const std::string expected = "[options] " + bad.field + bad.rule;
    EXPECT_EQ(error_of([&] { bad.validate_alone(o); }), expected) << bad.subsystem;
    EXPECT_EQ(error_of([&] { validate(o); }), expected) << bad.subsystem << " from validate(TrainOptions)";
  }
}

// A subsystem's rule is its own: the other subsystems' validate() accept
// the value it refuses.
TEST(OptionSubsystems, OnlyItsOwnSubsystemRefusesABadValue) {
  const std::vector<BadValue> all = bad_values();
  for (const BadValue& bad : all) {
    TrainOptions o = valid_options();
    bad.spoil(o);
    for (const BadValue& other : all) {
      if (std::string(other.subsystem) == bad.subsystem) continue;
      EXPECT_EQ(error_of([&] { other.validate_alone(o); }), "") << bad.subsystem << " in " << other.subsystem;
    }
  }
}

TEST(OptionSubsystems, ErrorsSpellTheOptionAsTheFrontEnd) {
  TrainOptions o = valid_options();
  o.save_every = 2;
  EXPECT_EQ(error_of([&] { validate(static_cast<const CheckpointOptions&>(o)); }),
            "[flags] --save-every needs --checkpoint DIR");
  Spelling keyword(OptionSpelling::kKeyword);
  EXPECT_EQ(error_of([&] { validate(static_cast<const CheckpointOptions&>(o)); }),
            "[options] save_every needs checkpoint DIR");
}

// Rules between subsystems are validate(TrainOptions)'s: each part alone
// is valid.
TEST(OptionSubsystems, RulesBetweenSubsystemsAreTheWholeOptions) {
  TrainOptions o = valid_options();
  o.strategy_choices = {"a.json", "b.json"};  // switching, without batch_tokens (data)
  EXPECT_EQ(error_of([&] { validate(static_cast<const SwitchingOptions&>(o)); }), "");
  EXPECT_EQ(error_of([&] { validate(static_cast<const DataOptions&>(o)); }), "");
  EXPECT_EQ(error_of([&] { validate(o); }), "[flags] --strategies needs --batch-tokens (a strategy is chosen per step)");
  o = valid_options();
  o.profile_path = "p.json";  // parallel, read by no clock, events or token budget
  EXPECT_EQ(error_of([&] { validate(static_cast<const ParallelOptions&>(o)); }), "");
  EXPECT_NE(error_of([&] { validate(o); }).find("[flags] --profile is read only with --clock model"),
            std::string::npos);
  o.batch_tokens = 1024;
  EXPECT_EQ(error_of([&] { validate(o); }), "");
}

template <typename Part>
void add_names(std::vector<std::string>& names, const std::vector<OptionSpec<Part>>& table) {
  for (const OptionSpec<Part>& spec : table) names.push_back(spec.name);
}

TEST(OptionSubsystems, TheTableIsTheSubsystemsTablesInOrder) {
  std::vector<std::string> expected;
  add_names(expected, data_option_table());
  add_names(expected, optimizer_option_table());
  add_names(expected, output_option_table());
  add_names(expected, parallel_option_table());
  add_names(expected, switching_option_table());
  add_names(expected, elastic_option_table());
  add_names(expected, checkpoint_option_table());
  std::vector<std::string> names;
  add_names(names, train_option_table());
  EXPECT_EQ(names, expected);
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()).size(), names.size());
}

// A row set through the whole table writes its subsystem's member.
TEST(OptionSubsystems, RowsWriteTheirSubsystemsMembers) {
  TrainOptions o = default_train_options();
  find_train_option("seq_len")->set(o, OptionValue{int64_t{128}});
  find_train_option("warmup_steps")->set(o, OptionValue{int64_t{5}});
  find_train_option("save_dtype")->set(o, OptionValue{std::string("bf16")});
  find_train_option("clock")->set(o, OptionValue{std::string("model")});
  find_train_option("straggler_threshold")->set(o, OptionValue{0.5});
  find_train_option("checkpoint_sync")->set(o, OptionValue{true});
  EXPECT_EQ(o.seq_len, 128);
  EXPECT_EQ(o.schedule.warmup_steps, 5);
  EXPECT_EQ(o.save_dtype, DType::BF16);
  EXPECT_TRUE(o.model_clock);
  EXPECT_EQ(o.straggler_threshold, 0.5);
  EXPECT_TRUE(o.checkpoint_sync);
}

// `strategies` is the one row that writes two subsystems: its first file is
// the run's strategy (ParallelOptions::strategy_path).
TEST(OptionSubsystems, StrategiesAlsoNameTheRunsStrategy) {
  TrainOptions o = default_train_options();
  find_train_option("strategies")->set(o, OptionValue{std::string("a.json,b.json")});
  EXPECT_EQ(o.strategy_choices, (std::vector<std::string>{"a.json", "b.json"}));
  EXPECT_EQ(o.strategy_path, "a.json");
  SwitchingOptions alone;
  for (const OptionSpec<SwitchingOptions>& spec : switching_option_table())
    if (std::string(spec.name) == "strategies") spec.set(alone, OptionValue{std::string("c.json")});
  EXPECT_EQ(alone.strategy_choices, std::vector<std::string>{"c.json"});
  EXPECT_EQ(error_of([&] { find_train_option("strategies")->set(o, OptionValue{std::string("a.json,,b.json")}); }),
            "[flags] --strategies 'a.json,,b.json': an empty file name");
}

}  // namespace
}  // namespace hspmd
