#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "hspmd/core/device.h"
#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"
#include "hspmd/core/ndarray.h"
#include "hspmd/core/rng.h"
#include "test_util.h"

namespace hspmd {
namespace {

using testing::error_of;

TEST(JsonFile, RejectsDuplicateKeysAtAnyDepth) {
  EXPECT_EQ(error_of([] { parse_json_text(R"({"a": 1, "a": 2})", "strategy", "s.json"); }),
            "[strategy] s.json: duplicate key 'a'");
  EXPECT_EQ(error_of([] { parse_json_text(R"({"x": [{"b": 1, "c": 2, "b": 3}]})", "plan", "p"); }),
            "[plan] p: duplicate key 'b'");
  // The same key in sibling objects is fine.
  EXPECT_NO_THROW(parse_json_text(R"({"x": {"a": 1}, "y": {"a": 2}, "a": 3})", "plan", "p"));
}

TEST(JsonFile, RejectsDeepNestingWithoutCrashing) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_EQ(error_of([&] { parse_json_text(deep, "config", "c.json"); }),
            "[config] c.json: JSON nested deeper than 128 levels");
  const std::string ok = std::string(kMaxJsonDepth, '[') + std::string(kMaxJsonDepth, ']');
  EXPECT_NO_THROW(parse_json_text(ok, "config", "c.json"));
  // Unbalanced deep text fails at the depth limit too, not in the parser's message.
  EXPECT_THROW(parse_json_text(std::string(100000, '{') , "config", "c.json"), Error);
}

TEST(JsonFile, ErrorsEchoAtMost80CharactersOfAValue) {
  const std::string huge = "{\"a\": \"" + std::string(10 << 20, 'x') + "\\q\"}";
  const std::string what = error_of([&] { parse_json_text(huge, "config", "c.json"); });
  EXPECT_NE(what.find("not valid JSON"), std::string::npos);
  EXPECT_LT(what.size(), 300u);
  EXPECT_EQ(json_excerpt(nlohmann::json(std::string(1000, 'y'))), "\"" + std::string(80, 'y') + "...");
  EXPECT_EQ(json_excerpt(nlohmann::json::array({1, 2})), "[1,2]");
  EXPECT_EQ(shorten(std::string(81, 'z')), std::string(80, 'z') + "...");
}

TEST(JsonFile, NumberOverflowIsAnError) {
  EXPECT_EQ(error_of([] { parse_json_text("{\"a\": 1e309}", "cluster", "c.json"); }).rfind(
                "[cluster] c.json: not valid JSON ([json.exception.out_of_range.406] number overflow", 0),
            0u);
  const std::string what = error_of([] { parse_json_text("[-" + std::string(100000, '9') + "e999]", "plan", "p"); });
  EXPECT_NE(what.find("not valid JSON"), std::string::npos);
  EXPECT_LT(what.size(), 250u);
}

TEST(JsonFile, RefusesAFifoWithoutBlocking) {
  const std::string fifo = (std::filesystem::temp_directory_path() / ("hspmd_fifo_" + std::to_string(::getpid()))).string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(error_of([&] { read_json_file(fifo, "config"); }), "[config] " + fifo + ": is not a regular file");
  EXPECT_EQ(error_of([&] { require_regular_file(fifo, "data"); }), "[data] " + fifo + ": is not a regular file");
  std::filesystem::remove(fifo);
  EXPECT_EQ(error_of([&] { require_regular_file(fifo, "data"); }), "[data] " + fifo + ": no such file");
}

TEST(NDArray, ViewsShareStorageAndContiguousCopies) {
  NDArray a = NDArray::from_vector({2, 3}, {0, 1, 2, 3, 4, 5});
  NDArray t = a.transpose(0, 1);
  EXPECT_EQ(t.shape(), (Shape{3, 2}));
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.contiguous().to_vector(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  NDArray s = a.slice(1, 1, 3);
  EXPECT_EQ(s.contiguous().to_vector(), (std::vector<float>{1, 2, 4, 5}));
  NDArray r = a.reshape({3, 2});
  r.data<float>()[0] = 42;
  EXPECT_EQ(a.data<float>()[0], 42);  // a view, not a copy
  EXPECT_THROW(a.reshape({4, 2}), InternalError);
  EXPECT_THROW(a.data<int32_t>(), InternalError);
}

TEST(NDArray, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(3.140625f)), 3.140625f);  // exactly representable
  // 1 + 2^-8 lies halfway between two bf16 values: rounds to the even one (1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  NDArray a = NDArray::from_vector({3}, {1.5f, -2.25f, 1e-3f});
  std::vector<float> back = a.to(DType::BF16).to(DType::F32).to_vector();
  EXPECT_EQ(back[0], 1.5f);
  EXPECT_EQ(back[1], -2.25f);
  EXPECT_NEAR(back[2], 1e-3f, 1e-5f);
}

TEST(Allocator, AccountsCurrentAndPeakBytes) {
  Allocator& alloc = allocator_for(Device::cpu());
  const size_t before = alloc.current_bytes();
  alloc.reset_peak();
  {
    NDArray a = NDArray::empty({1024}, DType::F32);
    EXPECT_EQ(alloc.current_bytes(), before + 4096);
    { NDArray b = NDArray::empty({256}, DType::F32); }
    EXPECT_EQ(alloc.peak_bytes(), before + 4096 + 1024);
  }
  EXPECT_EQ(alloc.current_bytes(), before);
}

TEST(Rng, ReproducibleAndNameDependent) {
  NDArray a = NDArray::empty({64}, DType::F32), b = a.clone(), c = a.clone();
  fill_normal(a, 1, "w", 1.0f);
  fill_normal(b, 1, "w", 1.0f);
  fill_normal(c, 1, "v", 1.0f);
  EXPECT_EQ(a.to_vector(), b.to_vector());
  EXPECT_NE(a.to_vector(), c.to_vector());
  Rng rng(5);
  double sum = 0, sq = 0;
  for (int i = 0; i < 20000; ++i) {
    double x = rng.normal();
    sum += x;
    sq += x * x;
  }
  EXPECT_NEAR(sum / 20000, 0.0, 0.03);
  EXPECT_NEAR(sq / 20000, 1.0, 0.05);
}

}  // namespace
}  // namespace hspmd
