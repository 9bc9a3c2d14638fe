#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>

#include "hspmd/core/error.h"
#include "hspmd/data/token_data.h"
#include "hspmd/data/tokenizer.h"

namespace hspmd {
namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::path(::testing::TempDir()) / ("hspmd_data_" + name)).string();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Runs `f`, expecting hspmd::Error whose message is exactly `message`.
template <typename F>
void expect_error(F&& f, const std::string& message) {
  try {
    f();
    FAIL() << "no error; expected: " << message;
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
}

std::vector<uint32_t> iota_tokens(int n) {
  std::vector<uint32_t> t(n);
  std::iota(t.begin(), t.end(), 0u);
  return t;
}

TEST(TokenData, SaveLoadRoundTripIsLittleEndianUint32) {
  const std::string path = temp_path("round.bin");
  TokenData::save(path, {1, 258, 65536});
  EXPECT_EQ(std::filesystem::file_size(path), 12u);
  std::ifstream in(path, std::ios::binary);
  unsigned char b[12];
  in.read(reinterpret_cast<char*>(b), 12);
  EXPECT_EQ(b[0], 1);
  EXPECT_EQ(b[4], 2);
  EXPECT_EQ(b[5], 1);
  EXPECT_EQ(b[10], 1);
  TokenData d = TokenData::load(path, 70000);
  EXPECT_EQ(d.tokens(), (std::vector<uint32_t>{1, 258, 65536}));
}

TEST(TokenData, SamplesAreShiftedWindowsAndWrap) {
  TokenData d(iota_tokens(14));  // (14 - 1) / 4 = 3 samples of length 4
  const int64_t L = 4;
  EXPECT_EQ(d.num_samples(L), 3);
  int32_t in[4], tg[4];
  for (int64_t i = 0; i < 3; ++i) {
    d.sample(i, L, in, tg);
    for (int64_t t = 0; t < L; ++t) {
      EXPECT_EQ(in[t], i * L + t);
      EXPECT_EQ(tg[t], i * L + t + 1);
    }
  }
  d.sample(4, L, in, tg);  // 4 mod 3 = 1
  EXPECT_EQ(in[0], 4);
  EXPECT_EQ(tg[3], 8);
  d.sample(-1, L, in, tg);  // wraps to the last sample
  EXPECT_EQ(in[0], 8);
  EXPECT_EQ(tg[3], 12);
}

TEST(TokenData, ExactlyOneSample) {
  TokenData d(iota_tokens(5));
  EXPECT_EQ(d.num_samples(4), 1);
  int32_t in[4], tg[4];
  d.sample(7, 4, in, tg);
  EXPECT_EQ(in[0], 0);
  EXPECT_EQ(tg[3], 4);
}

TEST(TokenData, FewerTokensThanOneSample) {
  TokenData d(iota_tokens(4));
  expect_error([&] { d.num_samples(4); }, "[data] tokens: 4 tokens are fewer than one sample of seq_len 4 + 1");
  const std::string path = temp_path("short.bin");
  TokenData::save(path, iota_tokens(4));
  TokenData loaded = TokenData::load(path, 512);
  expect_error([&] { loaded.num_samples(4); },
               "[data] " + path + ": 4 tokens are fewer than one sample of seq_len 4 + 1");
  int32_t in[4], tg[4];
  EXPECT_THROW(loaded.sample(0, 4, in, tg), Error);
}

TEST(TokenData, MissingFile) {
  const std::string path = temp_path("missing.bin");
  expect_error([&] { TokenData::load(path, 512); }, "[data] " + path + ": no such file");
}

TEST(TokenData, FifoIsRefusedWithoutBlocking) {
  const std::string path = temp_path("fifo.bin");
  std::filesystem::remove(path);
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  expect_error([&] { TokenData::load(path, 512); }, "[data] " + path + ": is not a regular file");
  std::filesystem::remove(path);
}

TEST(TokenData, EmptyFile) {
  const std::string path = temp_path("empty.bin");
  write_bytes(path, "");
  expect_error([&] { TokenData::load(path, 512); }, "[data] " + path + ": file is empty");
}

TEST(TokenData, SizeNotMultipleOfFour) {
  const std::string path = temp_path("odd.bin");
  write_bytes(path, std::string(6, '\0'));
  expect_error([&] { TokenData::load(path, 512); },
               "[data] " + path + ": size 6 bytes is not a multiple of 4 (uint32 token ids)");
}

TEST(TokenData, TokenIdOutsideVocabulary) {
  const std::string path = temp_path("big_id.bin");
  std::vector<uint32_t> t = iota_tokens(20);
  t[12] = 70000;
  t[15] = 80000;
  TokenData::save(path, t);
  expect_error([&] { TokenData::load(path, 512); },
               "[data] " + path + ": token id 70000 at position 12 is >= vocab_size 512");
  t[12] = 512;
  t[15] = 3;
  TokenData::save(path, t);
  EXPECT_THROW(TokenData::load(path, 512), Error);
  EXPECT_EQ(TokenData::load(path, 513).size(), 20);
}

// Documents (eos = 0): [5 6 0] [7 0] [1 2 3 4 5 6 7 0] [8 9] (no final eos).
std::vector<uint32_t> doc_tokens() { return {5, 6, 0, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 8, 9}; }

struct Row {
  std::vector<int32_t> in, tg, pos;
};

Row packed_row(const PackedDocuments& p, int64_t index, int64_t width) {
  Row r{std::vector<int32_t>(width), std::vector<int32_t>(width), std::vector<int32_t>(width)};
  p.sample(index, width, r.in.data(), r.tg.data(), r.pos.data());
  return r;
}

TEST(PackedDocuments, NextFitPackingCutsLongDocuments) {
  TokenData d(doc_tokens());
  PackedDocuments p(d, 6, 0);
  // Pieces: [5 6 0] [7 0] | [1 2 3 4 5 6] | [7 0] [8 9]: the 8-token document
  // is cut into 6 + 2; next-fit opens a sequence when a piece does not fit.
  ASSERT_EQ(p.num_samples(), 3);
  EXPECT_EQ(p.length(0), 5);
  EXPECT_EQ(p.length(1), 6);
  EXPECT_EQ(p.length(2), 4);
  EXPECT_EQ(p.counted_targets(0), 3);  // 5 tokens, 2 pieces
  EXPECT_EQ(p.counted_targets(1), 5);
  EXPECT_EQ(p.counted_targets(2), 2);
  const int32_t X = PackedDocuments::kIgnore;
  Row r = packed_row(p, 0, 6);
  EXPECT_EQ(r.in, (std::vector<int32_t>{5, 6, 0, 7, 0, 0}));
  EXPECT_EQ(r.tg, (std::vector<int32_t>{6, 0, X, 0, X, X}));  // no target crosses a document
  EXPECT_EQ(r.pos, (std::vector<int32_t>{0, 1, 2, 0, 1, 0}));  // the pad is its own document
  r = packed_row(p, 2, 4);
  EXPECT_EQ(r.in, (std::vector<int32_t>{7, 0, 8, 9}));
  EXPECT_EQ(r.tg, (std::vector<int32_t>{0, X, 9, X}));
  EXPECT_EQ(r.pos, (std::vector<int32_t>{0, 1, 0, 1}));
  // Wrapping like fixed-length samples; a row narrower than its sample fails.
  EXPECT_EQ(packed_row(p, 4, 6).in, packed_row(p, 1, 6).in);
  EXPECT_EQ(packed_row(p, -1, 4).in, r.in);
  expect_error([&] { packed_row(p, 1, 5); },
               "[data] packed sample 1 has 6 tokens, more than the row width 5");
}

TEST(PackedDocuments, EveryTokenOnceInFileOrder) {
  std::vector<uint32_t> t;
  uint32_t next = 1;
  for (int doc = 0; doc < 40; ++doc) {  // document lengths 1 .. 13, each ending in eos 0
    for (int k = 0; k < doc % 13; ++k) t.push_back(next++);
    t.push_back(0);
  }
  TokenData d(t);
  PackedDocuments p(d, 8, 0);
  std::vector<uint32_t> seen;
  for (int64_t i = 0; i < p.num_samples(); ++i) {
    Row r = packed_row(p, i, 8);
    ASSERT_LE(p.length(i), 8);
    if (i + 1 < p.num_samples()) {  // next-fit: the next sample's first piece did not fit
      EXPECT_GT(p.length(i) + p.length(i + 1), 8);
    }
    for (int64_t k = 0; k < p.length(i); ++k) seen.push_back(static_cast<uint32_t>(r.in[k]));
  }
  EXPECT_EQ(seen, t);
}

TEST(PackedDocuments, Errors) {
  TokenData d(doc_tokens());
  expect_error([&] { PackedDocuments(d, 0, 0); }, "[data] tokens: seq_len 0 must be positive");
  expect_error([&] { PackedDocuments(d, 4, -1); },
               "[data] tokens: eos_token_id -1 is not a valid token id");
}

TEST(Tokenizer, BytesAreTokens) {
  EXPECT_EQ(byte_tokenize("Hi\n"), (std::vector<uint32_t>{72, 105, 10}));
  EXPECT_EQ(byte_tokenize("\xc3\xa9"), (std::vector<uint32_t>{0xc3, 0xa9}));  // UTF-8 bytes, unsigned
  EXPECT_TRUE(byte_tokenize("").empty());
}

TEST(Tokenizer, EachFileIsOneDocumentEndingInEos) {
  const std::string a = temp_path("a.txt"), b = temp_path("b.txt"), out = temp_path("ab.bin");
  write_bytes(a, "ab");
  write_bytes(b, "c\xff");
  EXPECT_EQ(tokenize_files({a, b}, out, 300), 6);
  TokenData d = TokenData::load(out, 301);
  EXPECT_EQ(d.tokens(), (std::vector<uint32_t>{'a', 'b', 300, 'c', 255, 300}));
}

TEST(Tokenizer, Errors) {
  const std::string out = temp_path("err.bin");
  const std::string a = temp_path("ok.txt");
  write_bytes(a, "x");
  expect_error([&] { tokenize_files({a}, out, 255); },
               "[tokenizer] eos_token_id 255 is a byte value; it must be >= 256");
  expect_error([&] { tokenize_files({}, out, 256); }, "[tokenizer] " + out + ": no input files");
  const std::string missing = temp_path("nope.txt");
  expect_error([&] { tokenize_files({a, missing}, out, 256); }, "[tokenizer] " + missing + ": no such file");
  EXPECT_FALSE(std::filesystem::exists(out));
}

}  // namespace
}  // namespace hspmd
