// Internal to src/io: the helpers of the checkpoint format (docs/checkpoint.md)
// shared by its two files. checkpoint_format.cc defines them (file names,
// boxes, POSIX file helpers, JSON forms, shard files); checkpoint.cc writes,
// commits, loads and reads checkpoints with them.
#pragma once

#include <unistd.h>

#include <bit>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "hspmd/core/error.h"
#include "hspmd/io/checkpoint.h"

namespace hspmd {

static_assert(std::endian::native == std::endian::little, "shard files hold raw little-endian bytes");

namespace fs = std::filesystem;
using nlohmann::json;

// Internal helpers. A named namespace, not an anonymous one, because the
// reader's file cache (CheckpointReader::OpenFile) holds a ShardFile.
namespace checkpoint_detail {

constexpr const char* kFormat = "hspmd-checkpoint";
constexpr const char* kPartFormat = "hspmd-checkpoint-part";
constexpr int kVersion = 1;
constexpr const char* kIndexName = "index.json";
constexpr const char* kFaultEnv = "HSPMD_FAULT_KILL_CHECKPOINT";

template <typename... Args>
[[noreturn]] void fail_dir(const std::string& dir, const Args&... args) {
  fail("[checkpoint] ", dir, ": ", args...);
}

// The context of a JSON document being validated: errors read
// "[checkpoint] <dir>: <what>: <problem>".
struct Where {
  std::string dir;
  std::string what;
  template <typename... Args>
  [[noreturn]] void fail(const Args&... args) const {
    fail_dir(dir, what, ": ", args...);
  }
};

// ---- names ---------------------------------------------------------------

std::string shard_file_name(int64_t step, int rank);
std::string part_file_name(int64_t step, int rank);
const std::regex& shard_file_pattern();
const std::regex& part_file_pattern();
const std::regex& tmp_file_pattern();
std::string shard_key(const std::string& tensor, const Box& box);
const char* st_dtype_name(DType t);
const char* dtype_to_name(DType t);

// ---- boxes ---------------------------------------------------------------

bool box_fits(const Box& box, const Shape& shape);
std::vector<Box> cover(const Box& want, const std::vector<const Box*>& have,
                       const std::function<void(size_t, const Box&)>& take);

// ---- POSIX file helpers --------------------------------------------------

struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

std::string errno_text();
bool write_all(int fd, const void* data, size_t n);
bool pread_all(int fd, void* data, size_t n, uint64_t offset);
void fsync_dir(const std::string& dir);

// A write of dir/<name>.tmp failed (a full disk, say): the partial file is
// removed, so that it does not keep the disk full, and the error thrown.
template <typename... Args>
[[noreturn]] void fail_removing_tmp(const std::string& dir, const std::string& name, const Args&... args) {
  std::error_code ec;
  fs::remove(fs::path(dir) / (name + ".tmp"), ec);
  fail_dir(dir, args...);
}

int open_tmp(const std::string& dir, const std::string& name);
void finish_tmp(const std::string& dir, const std::string& name, Fd& fd);
void write_text_atomic(const std::string& dir, const std::string& name, const std::string& text);

// ---- JSON forms ----------------------------------------------------------

const json& field(const Where& w, const json& obj, const std::string& ctx, const char* name);
std::string checksum_text(uint64_t c);
json tensor_json(const CheckpointTensor& t);
std::map<std::string, CheckpointTensor> parse_tensors(const Where& w, const json& v);
std::optional<json> read_json_file(const Where& w, const std::string& name);
void check_header(const Where& w, const json& j, const char* format);
int64_t parse_step(const Where& w, const json& j);

// ---- shard files (safetensors) -------------------------------------------

struct StEntry {
  DType dtype;
  Shape shape;
  uint64_t begin = 0;  // absolute file offsets
  uint64_t end = 0;
};

// A shard file opened for reading, with its parsed header.
struct ShardFile {
  std::string name;
  Fd fd{-1};
  std::map<std::string, StEntry> entries;
};

std::unique_ptr<ShardFile> open_shard_file(const std::string& dir, const std::string& name);
const StEntry& shard_entry(const std::string& dir, const ShardFile& file, const std::string& tensor,
                           const CheckpointShardRef& ref, DType dtype);
std::vector<const Box*> shard_boxes(const CheckpointTensor& t);
[[noreturn]] void fail_uncovered(const std::string& dir, const std::string& tensor, const Box& box);

}  // namespace checkpoint_detail

}  // namespace hspmd
