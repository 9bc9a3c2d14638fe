#include "hspmd/io/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "hspmd/core/error.h"

namespace hspmd {
namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::path(::testing::TempDir()) / ("hspmd_st_" + name)).string();
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A file with the given JSON header and raw data.
std::string file_with(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

// Expects load_safetensors(path) to throw hspmd::Error naming the path and `rule`.
void expect_load_error(const std::string& path, const std::string& rule) {
  try {
    load_safetensors(path);
    FAIL() << "no error for " << path;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("[safetensors] " + path + ": ", 0), 0u) << msg;
    EXPECT_NE(msg.find(rule), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST(Safetensors, RoundTripF32Bf16I32I64) {
  const std::string path = temp_path("round_trip.safetensors");
  std::map<std::string, NDArray> tensors;
  tensors["b.weight"] = NDArray::from_vector({2, 3}, {1.5f, -2.25f, 0.f, 3e-3f, 1e6f, -7.f});
  tensors["a.bf16"] = NDArray::from_vector({4}, {1.0f, -2.5f, 3.140625f, 1.00390625f}).to(DType::BF16);
  tensors["c.ids"] = NDArray::from_vector_i32({3}, {7, -1, 2147483647});
  tensors["d.i64"] = NDArray::from_vector_i32({2}, {5, -6}).to(DType::I64);
  tensors["e.scalar"] = NDArray::from_vector({}, {42.f});
  save_safetensors(path, tensors);

  auto loaded = load_safetensors(path);
  ASSERT_EQ(loaded.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(loaded.count(name)) << name;
    const NDArray& l = loaded.at(name);
    EXPECT_EQ(l.dtype(), t.dtype()) << name;
    EXPECT_EQ(l.shape(), t.shape()) << name;
    ASSERT_EQ(l.nbytes(), t.nbytes());
    EXPECT_EQ(std::memcmp(l.raw_data(), t.raw_data(), t.nbytes()), 0) << name;
  }
  // bf16 keeps the stored bits: exactly representable values survive, and
  // 1.00390625 (= 1 + 2^-8) rounds to even, i.e. to 1.0.
  EXPECT_EQ(loaded.at("a.bf16").to_vector(), (std::vector<float>{1.0f, -2.5f, 3.140625f, 1.0f}));
  const uint16_t* bits = loaded.at("a.bf16").data<uint16_t>();
  EXPECT_EQ(bits[0], 0x3f80);
  EXPECT_EQ(bits[1], 0xc020);
  EXPECT_EQ(loaded.at("c.ids").data<int32_t>()[2], 2147483647);
  EXPECT_EQ(loaded.at("d.i64").data<int64_t>()[1], -6);
}

TEST(Safetensors, SavedLayoutIsSortedPaddedAndContiguous) {
  const std::string path = temp_path("layout.safetensors");
  std::map<std::string, NDArray> tensors;
  // A transposed (strided) view is written in its logical row-major order.
  tensors["z"] = NDArray::from_vector({2, 3}, {1, 2, 3, 4, 5, 6}).transpose(0, 1);
  tensors["a"] = NDArray::from_vector_i32({1}, {9});
  save_safetensors(path, tensors);

  const std::string bytes = read_bytes(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + n + 4 + 24);
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(header["__metadata__"], (nlohmann::json{{"format", "pt"}}));
  EXPECT_EQ(header["a"]["data_offsets"], (nlohmann::json{0, 4}));
  EXPECT_EQ(header["z"]["data_offsets"], (nlohmann::json{4, 28}));
  EXPECT_EQ(header["z"]["shape"], (nlohmann::json{3, 2}));
  EXPECT_EQ(header["z"]["dtype"], "F32");
  EXPECT_EQ(load_safetensors(path).at("z").to_vector(), (std::vector<float>{1, 4, 2, 5, 3, 6}));
  for (const auto& entry : std::filesystem::directory_iterator(::testing::TempDir()))
    EXPECT_EQ(entry.path().string().find("layout.safetensors.tmp"), std::string::npos) << entry.path();
}

TEST(Safetensors, ReadsHandWrittenFile) {
  const std::string path = temp_path("hand.safetensors");
  std::string data(4 * 4 + 2 * 2, '\0');
  const float f[4] = {0.5f, -1.f, 2.f, 8.f};
  std::memcpy(data.data(), f, sizeof f);
  const uint16_t h[2] = {0x4040 /* 3.0 */, 0xbf00 /* -0.5 */};
  std::memcpy(data.data() + 16, h, sizeof h);
  // Unpadded header, keys out of order, extra metadata: all allowed.
  write_bytes(path, file_with(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
                              R"("__metadata__":{"format":"pt","note":"x"},)"
                              R"("h":{"data_offsets":[16,20],"shape":[2],"dtype":"BF16"}})",
                              data));
  auto t = load_safetensors(path);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t.at("w").shape(), (Shape{2, 2}));
  EXPECT_EQ(t.at("w").to_vector(), (std::vector<float>{0.5f, -1.f, 2.f, 8.f}));
  EXPECT_EQ(t.at("h").dtype(), DType::BF16);
  EXPECT_EQ(t.at("h").to_vector(), (std::vector<float>{3.f, -0.5f}));
}

TEST(Safetensors, EmptyMapRoundTrips) {
  const std::string path = temp_path("empty.safetensors");
  save_safetensors(path, {});
  EXPECT_TRUE(load_safetensors(path).empty());
}

TEST(Safetensors, MissingFile) { expect_load_error(temp_path("does_not_exist.safetensors"), "no such file"); }

TEST(Safetensors, FileShorterThanHeaderLength) {
  const std::string path = temp_path("short.safetensors");
  write_bytes(path, "abc");
  expect_load_error(path, "shorter than the 8-byte header length");
}

TEST(Safetensors, HeaderLengthBeyondFile) {
  const std::string path = temp_path("bad_len.safetensors");
  write_bytes(path, le64(1000) + "{}");
  expect_load_error(path, "header length 1000 exceeds");
  write_bytes(path, le64(~uint64_t{0}) + "{}");
  expect_load_error(path, "exceeds");
}

TEST(Safetensors, TruncatedData) {
  const std::string path = temp_path("truncated.safetensors");
  save_safetensors(path, {{"x", NDArray::from_vector({4}, {1, 2, 3, 4})}});
  std::string bytes = read_bytes(path);
  write_bytes(path, bytes.substr(0, bytes.size() - 3));
  expect_load_error(path, "beyond the 13-byte data section");
}

TEST(Safetensors, HeaderNotJson) {
  const std::string path = temp_path("bad_json.safetensors");
  write_bytes(path, file_with("{\"x\": [1, 2", ""));
  expect_load_error(path, "header: not valid JSON");
  write_bytes(path, file_with("[1, 2]", ""));
  expect_load_error(path, "header is not a JSON object");
}

TEST(Safetensors, EntryMissingField) {
  const std::string path = temp_path("missing_field.safetensors");
  write_bytes(path, file_with(R"({"x":{"dtype":"F32","shape":[1]}})", std::string(4, '\0')));
  expect_load_error(path, "tensor 'x': missing field \"data_offsets\"");
  write_bytes(path, file_with(R"({"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", std::string(4, '\0')));
  expect_load_error(path, "not a non-negative integer");
  write_bytes(path, file_with(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", std::string(4, '\0')));
  expect_load_error(path, "\"data_offsets\" is not a pair");
  write_bytes(path, file_with(R"({"x":7})", ""));
  expect_load_error(path, "tensor 'x': entry is not a JSON object");
}

TEST(Safetensors, UnsupportedDtype) {
  const std::string path = temp_path("bad_dtype.safetensors");
  write_bytes(path, file_with(R"({"x":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", std::string(4, '\0')));
  expect_load_error(path, "tensor 'x': unsupported dtype 'F16'");
}

TEST(Safetensors, OffsetsDoNotMatchShape) {
  const std::string path = temp_path("bad_offsets.safetensors");
  write_bytes(path, file_with(R"({"x":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", std::string(16, '\0')));
  expect_load_error(path, "tensor 'x': data_offsets [0, 12] span 12 bytes but shape [2, 2] of F32 needs 16");
  write_bytes(path, file_with(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", std::string(16, '\0')));
  expect_load_error(path, "data_offsets [8, 4]");
  write_bytes(path, file_with(R"({"x":{"dtype":"I64","shape":[4611686018427387904, 8],"data_offsets":[0,8]}})",
                              std::string(8, '\0')));
  expect_load_error(path, "needs too many");
}

TEST(Safetensors, OffsetsBeyondData) {
  const std::string path = temp_path("beyond.safetensors");
  write_bytes(path, file_with(R"({"x":{"dtype":"I32","shape":[2],"data_offsets":[4,12]}})", std::string(8, '\0')));
  expect_load_error(path, "tensor 'x': data_offsets end 12 is beyond the 8-byte data section");
}

TEST(Safetensors, RejectsOverlappingDataRanges) {
  const std::string path = temp_path("overlap.safetensors");
  write_bytes(path, file_with(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                              std::string(12, '\0')));
  expect_load_error(path, "tensor 'b': data_offsets [4, 12] overlap tensor 'a', which ends at 8");
  // The same range twice is an overlap too.
  write_bytes(path, file_with(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                              std::string(8, '\0')));
  expect_load_error(path, "overlap tensor 'a'");
  // Empty tensors take no bytes and overlap nothing.
  write_bytes(path, file_with(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                              std::string(8, '\0')));
  EXPECT_EQ(load_safetensors(path).size(), 2u);
}

TEST(Safetensors, RejectsTrailingBytes) {
  const std::string path = temp_path("trailing.safetensors");
  write_bytes(path, file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", std::string(6, '\0')));
  expect_load_error(path, "2 trailing bytes after the last tensor (data ends at 4 of 6)");
  write_bytes(path, file_with(R"({})", "x"));
  expect_load_error(path, "1 trailing bytes after the last tensor");
}

TEST(Safetensors, RejectsDuplicateHeaderKeys) {
  const std::string path = temp_path("dup.safetensors");
  write_bytes(path, file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                              R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                              std::string(4, '\0')));
  expect_load_error(path, "header: duplicate key 'a'");
  write_bytes(path, file_with(R"({"a":{"dtype":"F32","dtype":"I32","shape":[1],"data_offsets":[0,4]}})",
                              std::string(4, '\0')));
  expect_load_error(path, "header: duplicate key 'dtype'");
}

TEST(Safetensors, RejectsNonStringMetadata) {
  const std::string path = temp_path("meta.safetensors");
  write_bytes(path, file_with(R"({"__metadata__":{"format":"pt","step":3}})", ""));
  expect_load_error(path, "\"__metadata__\" value of 'step' is 3, not a string");
  write_bytes(path, file_with(R"({"__metadata__":[1]})", ""));
  expect_load_error(path, "\"__metadata__\" is not an object of strings");
}

TEST(Safetensors, LongNamesAndValuesAreEchoedShort) {
  const std::string path = temp_path("long.safetensors");
  const std::string name(100000, 'n'), dtype(100000, 'D');
  write_bytes(path, file_with("{\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":[1],\"data_offsets\":[0,4]}}",
                              std::string(4, '\0')));
  try {
    load_safetensors(path);
    FAIL();
  } catch (const Error& e) {
    EXPECT_LT(std::string(e.what()).size(), 400u);
    EXPECT_NE(std::string(e.what()).find("unsupported dtype 'DDD"), std::string::npos);
  }
}

TEST(Safetensors, RejectsFifoAndDeepHeader) {
  const std::string fifo = temp_path("fifo.safetensors");
  std::filesystem::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_load_error(fifo, "is not a regular file");
  std::filesystem::remove(fifo);
  const std::string path = temp_path("deep.safetensors");
  write_bytes(path, file_with("{\"a\":" + std::string(100000, '[') + std::string(100000, ']') + "}", ""));
  expect_load_error(path, "nested deeper than 128 levels");
}

TEST(Safetensors, SaveFailureNamesPathAndKeepsNothing) {
  const std::string dir = temp_path("no_such_dir");
  const std::string path = dir + "/w.safetensors";
  try {
    save_safetensors(path, {{"x", NDArray::from_vector({1}, {1})}});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("[safetensors] " + path + ": ", 0), 0u) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(dir));
}

TEST(Safetensors, SaveFailureKeepsOldFile) {
  const std::string path = temp_path("keep_old.safetensors");
  save_safetensors(path, {{"x", NDArray::from_vector({1}, {1})}});
  const std::string before = read_bytes(path);
  EXPECT_THROW(save_safetensors(path, {{"x", NDArray()}}), Error);
  EXPECT_THROW(save_safetensors(path, {{"__metadata__", NDArray::from_vector({1}, {2})}}), Error);
  EXPECT_EQ(read_bytes(path), before);
}

}  // namespace
}  // namespace hspmd
