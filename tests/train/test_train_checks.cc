// The training loop's checks before step 0 (train/train_common.h, and the
// options' validate(), hspmd/options/train_options.h): finite float
// options named as the front end spells them, finite initial weights,
// outputs per rank (docs/reliability.md).
#include <cmath>
#include <algorithm>
#include <functional>
#include <set>
#include <limits>
#include <string>

#include <gtest/gtest.h>

#include "hspmd/core/options.h"
#include "hspmd/options/train_options.h"
#include "train/train_common.h"
#include "test_util.h"

namespace hspmd {
namespace {

using train_common::check_finite_weights;
using train_common::check_outputs;
using train_common::first_nonfinite;

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

using testing::error_of;

TEST(TrainChecks, FirstNonfiniteFindsNanAndInfInF32AndBf16) {
  NDArray a = NDArray::zeros({2, 3}, DType::F32);
  EXPECT_EQ(first_nonfinite(a), -1);
  a.data<float>()[4] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(first_nonfinite(a), 4);
  a.data<float>()[1] = std::nanf("");
  EXPECT_EQ(first_nonfinite(a), 1);
  EXPECT_EQ(first_nonfinite(a.to(DType::BF16)), 1);
  EXPECT_EQ(first_nonfinite(NDArray::zeros({4}, DType::BF16)), -1);
}

TEST(TrainChecks, FloatOptionsMustBeFiniteNamedAsTheFrontEndSpellsThem) {
  TrainOptions valid = default_train_options();
  valid.steps = 1;
  EXPECT_EQ(error_of([&] { validate(valid); }), "");
  const std::pair<const char*, std::function<void(TrainOptions&, double)>> cases[] = {
      {"lr", [](TrainOptions& o, double v) { o.schedule.lr = v; }},
      {"min_lr", [](TrainOptions& o, double v) { o.schedule.min_lr = v; }},
      {"weight_decay", [](TrainOptions& o, double v) { o.adam.weight_decay = v; }},
      {"eps", [](TrainOptions& o, double v) { o.adam.eps = v; }},
      {"beta1", [](TrainOptions& o, double v) { o.adam.beta1 = v; }},
      {"clip_grad", [](TrainOptions& o, double v) { o.clip_grad = v; }}};
  for (const auto& [field, set] : cases)
    for (double v : {kNan, kInf, -kInf}) {
      TrainOptions o = valid;
      set(o, v);
      std::string flag = std::string("--") + field;
      std::replace(flag.begin(), flag.end(), '_', '-');
      const std::string e = error_of([&] { validate(o); });
      EXPECT_EQ(e.rfind("[flags] " + flag + " must be a finite number, got ", 0), 0u) << e;
      set_option_spelling(OptionSpelling::kKeyword);  // as the Python module does
      const std::string k = error_of([&] { validate(o); });
      set_option_spelling(OptionSpelling::kFlag);
      EXPECT_EQ(k.rfind(std::string("[options] ") + field + " must be a finite number, got ", 0), 0u) << k;
    }
}

// The schema: one row per option, every name a field (no flag spelling),
// and a row's setter writes what validate() reads.
TEST(TrainChecks, OptionTableNamesEachOptionOnce) {
  std::set<std::string> names;
  for (const OptionSpec<TrainOptions>& spec : train_option_table()) {
    EXPECT_TRUE(names.insert(spec.name).second) << spec.name;
    EXPECT_EQ(std::string(spec.name).find('-'), std::string::npos) << spec.name;
    EXPECT_EQ(find_train_option(spec.name), find_train_option(spec.name));
  }
  EXPECT_EQ(find_train_option("no-such-option"), nullptr);
  TrainOptions o = default_train_options();
  o.steps = 1;
  find_train_option("beta2")->set(o, OptionValue{1.0});
  EXPECT_EQ(error_of([&] { validate(o); }), "[flags] --beta2 must lie in [0, 1), got 1");
  find_train_option("optimizer")->set(o, OptionValue{std::string("adam")});
  EXPECT_FALSE(o.adam.decoupled_weight_decay);
  EXPECT_EQ(error_of([&] { find_train_option("optimizer")->set(o, OptionValue{std::string("sgd")}); }),
            "[flags] --optimizer: unknown optimizer 'sgd' (expected adamw or adam)");
}

TEST(TrainChecks, InitialWeightsMustBeFinite) {
  NDArray ok = NDArray::zeros({3}, DType::F32), bad = NDArray::zeros({2, 2}, DType::BF16);
  EXPECT_EQ(error_of([&] { check_finite_weights({{"a", ok}, {"b", bad}}, "w.safetensors"); }), "");
  NDArray f = NDArray::zeros({2, 2}, DType::F32);
  f.data<float>()[3] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(error_of([&] { check_finite_weights({{"a", ok}, {"layer.w", f.to(DType::BF16)}}, "w.safetensors"); }),
            "[init] w.safetensors: tensor 'layer.w' holds inf at element 3 (weights must be finite)");
}

TEST(TrainChecks, OutputsAreCheckedOnTheRanksThatWriteThem) {
  TrainOptions o;
  o.save_path = "/proc/hspmd-w.safetensors";
  o.log_path = "/proc/hspmd-log.jsonl";
  EXPECT_NE(error_of([&] { check_outputs(o, 0); }).find("[flags] --save /proc/hspmd-w.safetensors: cannot create"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { check_outputs(o, 1); }), "");  // rank 0 alone writes them
  o.trace_path = "/proc/hspmd-trace.json";  // every rank writes a part of the trace
  EXPECT_NE(error_of([&] { check_outputs(o, 1); }).find("--trace"), std::string::npos);
  o.trace_path.clear();
  o.checkpoint_dir = "/proc/hspmd-ckpt";  // every rank writes its shards
  EXPECT_NE(error_of([&] { check_outputs(o, 1); }).find("--checkpoint"), std::string::npos);
}

}  // namespace
}  // namespace hspmd
