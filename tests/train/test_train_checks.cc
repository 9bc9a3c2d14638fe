// The training loop's checks before step 0 (train/train_common.h): finite
// float options, finite initial weights, outputs per rank
// (docs/reliability.md).
#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include <gtest/gtest.h>

#include "train/train_common.h"
#include "test_util.h"

namespace hspmd {
namespace {

using train_common::check_finite_options;
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

TEST(TrainChecks, FloatOptionsMustBeFinite) {
  EXPECT_EQ(error_of([] { check_finite_options(TrainOptions{}); }), "");
  const std::pair<const char*, std::function<void(TrainOptions&, double)>> cases[] = {
      {"--lr", [](TrainOptions& o, double v) { o.schedule.lr = v; }},
      {"--min-lr", [](TrainOptions& o, double v) { o.schedule.min_lr = v; }},
      {"--weight-decay", [](TrainOptions& o, double v) { o.adam.weight_decay = v; }},
      {"--eps", [](TrainOptions& o, double v) { o.adam.eps = v; }},
      {"--beta1", [](TrainOptions& o, double v) { o.adam.beta1 = v; }},
      {"--clip-grad", [](TrainOptions& o, double v) { o.clip_grad = v; }}};
  for (const auto& [flag, set] : cases)
    for (double v : {kNan, kInf, -kInf}) {
      TrainOptions o;
      set(o, v);
      const std::string e = error_of([&] { check_finite_options(o); });
      EXPECT_EQ(e.rfind(std::string("[flags] ") + flag + " must be a finite number, got ", 0), 0u) << e;
    }
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
