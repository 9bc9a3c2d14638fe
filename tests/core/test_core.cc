#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <thread>

#include "hspmd/core/device.h"
#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"
#include "hspmd/core/ndarray.h"
#include "hspmd/core/rng.h"
#include "test_util.h"

namespace hspmd {
namespace {

using testing::error_of;

// A thread on a stream of its own (the overlap's communication thread)
// never gets a block another thread freed (its stream may still use it),
// and the blocks it frees are reused only after release() (after it
// synchronized its stream); the other threads never get its blocks back
// from the cache.
TEST(SideStreamScope, KeepsTheThreadsBlocksApartUntilReleased) {
  Allocator& a = allocator_for(Device::cpu());
  const size_t n = 123457;  // a size no other test caches
  void* main_block = a.allocate(n);
  a.deallocate(main_block, n);  // cached for this (main) thread's stream
  const size_t before = a.current_bytes();
  void *first = nullptr, *second = nullptr, *again = nullptr;
  std::thread side([&] {
    SideStreamScope scope;
    first = a.allocate(n);
    a.deallocate(first, n);  // held: its stream may still use it
    second = a.allocate(n);
    scope.release();  // the stream was synchronized: first is reusable
    again = a.allocate(n);
    a.deallocate(second, n);
    a.deallocate(again, n);
  });
  side.join();
  EXPECT_NE(first, main_block);
  EXPECT_NE(second, main_block);
  EXPECT_NE(second, first);
  EXPECT_EQ(again, first);
  EXPECT_EQ(a.current_bytes(), before);  // the scope's end freed what it held
  void* next = a.allocate(n);  // the main thread gets its own block back, not the side's
  EXPECT_EQ(next, main_block);
  // A side block the main thread frees (the overlap's synced gradients)
  // goes back to the side cache: the main thread's next block is another,
  // the side thread's next is that one.
  void* handed = nullptr;
  std::thread([&] {
    SideStreamScope scope;
    handed = a.allocate(n);
  }).join();
  a.deallocate(handed, n);
  void* other = a.allocate(n);
  EXPECT_NE(other, handed);
  void* reused = nullptr;
  std::thread([&] {
    SideStreamScope scope;
    reused = a.allocate(n);
    a.deallocate(reused, n);
  }).join();
  EXPECT_EQ(reused, handed);
  a.deallocate(other, n);
  a.deallocate(next, n);
}

// A captured graph's pool (Allocator::new_pool): the blocks a thread gets
// while the pool is its own go back to the pool when freed, and only the
// pool's later requests get them; work outside it never does. When the
// pool goes, they are the cache's again.
TEST(AllocatorPool, KeepsTheGraphsBlocksFromOtherWork) {
  Allocator& a = allocator_for(Device::cpu());
  const size_t n = 234571;  // a size no other test caches
  std::shared_ptr<void> pool = a.new_pool();
  ASSERT_NE(pool, nullptr);
  a.use_pool(pool);
  void* in_pool = a.allocate(n);
  void* kept = a.allocate(n);  // in use when the pool goes
  a.deallocate(in_pool, n);
  a.use_pool(nullptr);
  void* outside = a.allocate(n);
  EXPECT_NE(outside, in_pool);  // the pool's free block is not the cache's
  a.deallocate(outside, n);     // a cache block
  a.use_pool(pool);
  void* again = a.allocate(n);
  EXPECT_EQ(again, in_pool);  // the pool's own request takes it back first
  a.deallocate(again, n);
  std::thread([&] { a.deallocate(kept, n); }).join();  // freed by another thread: still the pool's
  a.use_pool(nullptr);
  void* other = a.allocate(n);
  EXPECT_NE(other, in_pool);
  EXPECT_NE(other, kept);
  a.deallocate(other, n);
  // A block in use when the pool goes returns to the cache when freed.
  a.use_pool(pool);
  void* live = a.allocate(n);
  a.use_pool(nullptr);
  const size_t in_use = a.current_bytes();
  pool.reset();  // its free blocks return to the cache
  a.deallocate(live, n);
  EXPECT_EQ(a.current_bytes(), in_use - n);
  std::set<void*> got;
  for (int k = 0; k < 6; ++k) got.insert(a.allocate(n));
  EXPECT_TRUE(got.count(in_pool) && got.count(kept) && got.count(live)) << "the pool's blocks are the cache's again";
  for (void* p : got) a.deallocate(p, n);
}

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

// fill writes every dtype (an F64 fill once did nothing, silently).
TEST(NDArray, FillWritesEveryDtype) {
  for (DType t : {DType::F32, DType::BF16, DType::I32, DType::I64}) {
    NDArray a = NDArray::zeros({3}, t);
    a.fill(2.0f);
    EXPECT_EQ(a.to_vector(), (std::vector<float>{2, 2, 2})) << dtype_name(t);
  }
  NDArray d = NDArray::zeros({3}, DType::F64);
  d.fill(2.0f);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(d.data<double>()[i], 2.0);
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

// The bulk conversions on every path this CPU has are bitwise equal to the
// scalar ones: normal values, ties (both parities), denormals (which the
// AVX512-BF16 instruction alone would flush), zeros, infinities, signalling
// and quiet NaNs of both signs, random bit patterns, and every length from 0
// to 40 (the vector loops' tails) at every offset of a 16-element block.
TEST(NDArray, BulkBf16ConversionsMatchScalarBitwise) {
  std::vector<uint32_t> bits = {
      0x00000000, 0x80000000, 0x3f800000, 0xbf800000, 0x3f808000, 0x3f818000,  // 1, ties
      0x3f807fff, 0x3f808001, 0x7f7fffff, 0xff7fffff, 0x7f7f8000, 0x7f7f7fff,  // rounding to inf
      0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x007fffff, 0x807fffff,  // denormals
      0x007f8000, 0x00800000, 0x80800000, 0x0000ffff, 0x8000c000, 0x00010000,
      0x7f800000, 0xff800000,                                                  // infinities
      0x7f800001, 0xff800001, 0x7fc00000, 0xffc00000, 0x7fffffff, 0xffffffff,  // NaNs
      0x7f80ffff, 0x7fbf8000, 0x7f810000, 0xffa08000};
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&] {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return static_cast<uint32_t>(state >> 11);
  };
  for (int i = 0; i < 200000; ++i) bits.push_back(next());
  for (int i = 0; i < 20000; ++i) bits.push_back((next() & 0xffff0000u) | 0x8000u);  // ties
  for (int i = 0; i < 20000; ++i) bits.push_back(next() & 0x807fffffu);  // denormals
  const int64_t n = static_cast<int64_t>(bits.size());
  std::vector<float> f(n);
  std::memcpy(f.data(), bits.data(), n * sizeof(float));
  std::vector<uint16_t> want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = f32_to_bf16(f[i]);
  std::vector<float> want_back(n);
  for (int64_t i = 0; i < n; ++i) want_back[i] = bf16_to_f32(want[i]);
  auto same_floats = [](const float* a, const float* b, int64_t len) {
    return std::memcmp(a, b, len * sizeof(float)) == 0;
  };
  for (ConvertIsa isa : {ConvertIsa::kScalar, ConvertIsa::kAvx512F, ConvertIsa::kAvx512Bf16}) {
    SCOPED_TRACE(static_cast<int>(isa));
    std::vector<uint16_t> got(n);
    f32_to_bf16_n(f.data(), got.data(), n, isa);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(got[i], want[i]) << "f32 bits 0x" << std::hex << bits[i];
    std::vector<float> back(n);
    bf16_to_f32_n(want.data(), back.data(), n, isa);
    ASSERT_TRUE(same_floats(back.data(), want_back.data(), n));
    for (int64_t len = 0; len <= 40; ++len)
      for (int64_t off = 0; off < 16; ++off) {
        std::vector<uint16_t> h(len + 1, 0xabcd);  // the element after must stay as it is
        std::vector<float> w(len + 1, 7.0f);
        f32_to_bf16_n(f.data() + off, h.data(), len, isa);
        bf16_to_f32_n(want.data() + off, w.data(), len, isa);
        ASSERT_TRUE(std::equal(h.begin(), h.begin() + len, want.begin() + off)) << len;
        ASSERT_TRUE(same_floats(w.data(), want_back.data() + off, len)) << len;
        ASSERT_EQ(h[len], 0xabcd);
        ASSERT_EQ(w[len], 7.0f);
      }
  }
  // NDArray::to (parallel above 2^17 elements) agrees too.
  NDArray a = NDArray::from_vector({n}, f);
  NDArray h = a.to(DType::BF16);
  ASSERT_EQ(std::memcmp(h.data<uint16_t>(), want.data(), n * sizeof(uint16_t)), 0);
  NDArray back = h.to(DType::F32);
  ASSERT_TRUE(same_floats(back.data<float>(), want_back.data(), n));
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

// fill_normal fills large arrays on several threads, each from its own
// place in the tensor's stream: the values must be the sequential stream's,
// Rng::normal in order, bit for bit, at odd and even sizes, below and above
// the threading threshold (2 Mi elements a thread).
TEST(Rng, FillNormalIsTheSequentialStreamOnAnyThreadCount) {
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{64}, int64_t{(1 << 22) + 3}, int64_t{(1 << 23) + 1}}) {
    NDArray a = NDArray::empty({n}, DType::F32);
    fill_normal(a, 11, "model.layers.0.mlp.up_proj.weight", 0.02f);
    Rng rng(tensor_seed(11, "model.layers.0.mlp.up_proj.weight"));
    const float* got = a.host_data<float>("test");
    int64_t differ = 0;
    for (int64_t i = 0; i < n; ++i) differ += got[i] != static_cast<float>(rng.normal() * 0.02f);
    EXPECT_EQ(differ, 0) << "n " << n;
  }
}

}  // namespace
}  // namespace hspmd
