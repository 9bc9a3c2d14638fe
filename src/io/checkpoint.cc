#include "hspmd/io/checkpoint.h"
#include "hspmd/io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <regex>
#include <set>

#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"

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

std::string step_rank_stem(int64_t step, int rank) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "step-%08lld-rank-%05d", static_cast<long long>(step), rank);
  return buf;
}
std::string shard_file_name(int64_t step, int rank) { return step_rank_stem(step, rank) + ".safetensors"; }
std::string part_file_name(int64_t step, int rank) { return step_rank_stem(step, rank) + ".json"; }

const std::regex& shard_file_pattern() {
  static const std::regex re(R"(step-\d{8,}-rank-\d{5,}\.safetensors)");
  return re;
}
const std::regex& part_file_pattern() {
  static const std::regex re(R"(step-\d{8,}-rank-\d{5,}\.json)");
  return re;
}
const std::regex& tmp_file_pattern() {
  static const std::regex re(R"((step-\d{8,}-rank-\d{5,}\.(safetensors|json)|index\.json)\.tmp)");
  return re;
}

// "b0:e0,b1:e1,..." ("" for a scalar).
std::string box_text(const Box& box) {
  std::string s;
  for (size_t d = 0; d < box.begin.size(); ++d) {
    if (d) s += ',';
    s.append(std::to_string(box.begin[d])).append(":").append(std::to_string(box.end[d]));
  }
  return s;
}
std::string shard_key(const std::string& tensor, const Box& box) { return tensor + "@" + box_text(box); }

std::optional<DType> dtype_from_name(const std::string& name) { return safetensors_dtype(name); }

// The safetensors name of `t`, or nullptr for a dtype that shard files do
// not hold.
const char* st_dtype_name(DType t) { return t == DType::F64 ? nullptr : safetensors_dtype_name(t); }

const char* dtype_to_name(DType t) {
  const char* name = st_dtype_name(t);
  HSPMD_CHECK(name != nullptr, "dtype ", dtype_name(t), " in a checkpoint");
  return name;
}

// ---- boxes ---------------------------------------------------------------

bool box_fits(const Box& box, const Shape& shape) {
  if (box.begin.size() != shape.size() || box.end.size() != shape.size()) return false;
  for (size_t d = 0; d < shape.size(); ++d)
    if (box.begin[d] < 0 || box.begin[d] > box.end[d] || box.end[d] > shape[d]) return false;
  return true;
}

// The common part of two boxes of equal rank, or nullopt when it is empty.
std::optional<Box> intersect(const Box& a, const Box& b) {
  Box r{a.begin, a.end};
  for (size_t d = 0; d < a.begin.size(); ++d) {
    r.begin[d] = std::max(a.begin[d], b.begin[d]);
    r.end[d] = std::min(a.end[d], b.end[d]);
    if (r.begin[d] >= r.end[d]) return std::nullopt;
  }
  return r;
}

// `u` without its sub-box `cut`, as disjoint boxes (at most two per dim).
std::vector<Box> subtract(const Box& u, const Box& cut) {
  std::vector<Box> pieces;
  Box rest = u;
  for (size_t d = 0; d < u.begin.size(); ++d) {
    if (rest.begin[d] < cut.begin[d]) {
      Box below = rest;
      below.end[d] = cut.begin[d];
      pieces.push_back(below);
    }
    if (cut.end[d] < rest.end[d]) {
      Box above = rest;
      above.begin[d] = cut.end[d];
      pieces.push_back(above);
    }
    rest.begin[d] = cut.begin[d];
    rest.end[d] = cut.end[d];
  }
  return pieces;
}

// Covers `want` with `have`, earlier boxes first: calls take(i, region) for
// disjoint regions of have[i] that together make up the covered part of
// `want`, each element once. Returns the boxes of `want` left uncovered.
std::vector<Box> cover(const Box& want, const std::vector<const Box*>& have,
                       const std::function<void(size_t, const Box&)>& take) {
  std::vector<Box> todo;
  if (want.numel() > 0) todo.push_back(want);
  for (size_t i = 0; i < have.size() && !todo.empty(); ++i) {
    std::vector<Box> next;
    for (const Box& u : todo) {
      std::optional<Box> r = intersect(u, *have[i]);
      if (!r) {
        next.push_back(u);
        continue;
      }
      take(i, *r);
      for (Box& piece : subtract(u, *r)) next.push_back(std::move(piece));
    }
    todo = std::move(next);
  }
  return todo;
}

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

std::string errno_text() { return std::strerror(errno); }

// Writes n bytes; returns false (errno set) on failure.
bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t k = ::write(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// Reads n bytes at `offset`; returns false on failure or end of file.
bool pread_all(int fd, void* data, size_t n, uint64_t offset) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t k = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
    offset += static_cast<uint64_t>(k);
  }
  return true;
}

void fsync_dir(const std::string& dir) {
  Fd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.fd >= 0) ::fsync(d.fd);  // best effort: some file systems refuse it
}

// A write of dir/<name>.tmp failed (a full disk, say): the partial file is
// removed, so that it does not keep the disk full, and the error thrown.
template <typename... Args>
[[noreturn]] void fail_removing_tmp(const std::string& dir, const std::string& name, const Args&... args) {
  std::error_code ec;
  fs::remove(fs::path(dir) / (name + ".tmp"), ec);
  fail_dir(dir, args...);
}

// Opens dir/<name>.tmp for writing (truncated).
int open_tmp(const std::string& dir, const std::string& name) {
  const std::string tmp = (fs::path(dir) / (name + ".tmp")).string();
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail_dir(dir, "cannot create '", name, ".tmp': ", errno_text());
  return fd;
}

// fsyncs and closes dir/<name>.tmp, renames it to dir/<name>, fsyncs dir.
void finish_tmp(const std::string& dir, const std::string& name, Fd& fd) {
  if (::fsync(fd.fd) != 0) fail_removing_tmp(dir, name, "cannot fsync '", name, ".tmp': ", errno_text());
  const int f = fd.fd;
  fd.fd = -1;
  if (::close(f) != 0) fail_removing_tmp(dir, name, "cannot close '", name, ".tmp': ", errno_text());
  const fs::path target = fs::path(dir) / name;
  std::error_code ec;
  fs::rename(target.string() + ".tmp", target, ec);
  if (ec) fail_removing_tmp(dir, name, "cannot rename '", name, ".tmp' to '", name, "': ", ec.message());
  fsync_dir(dir);
}

void write_text_atomic(const std::string& dir, const std::string& name, const std::string& text) {
  Fd fd(open_tmp(dir, name));
  if (!write_all(fd.fd, text.data(), text.size()))
    fail_removing_tmp(dir, name, "cannot write '", name, ".tmp': ", errno_text());
  finish_tmp(dir, name, fd);
}

// ---- JSON forms ----------------------------------------------------------

bool is_count(const json& v) { return v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0); }

json box_json(const Box& box) {
  json j = json::array();
  for (size_t d = 0; d < box.begin.size(); ++d) j.push_back({box.begin[d], box.end[d]});
  return j;
}

const json& field(const Where& w, const json& obj, const std::string& ctx, const char* name) {
  if (!obj.is_object()) w.fail(ctx.empty() ? "the document" : ctx + "the entry", " is not a JSON object");
  auto it = obj.find(name);
  if (it == obj.end()) w.fail(ctx, "missing field \"", name, "\"");
  return *it;
}

Shape parse_shape(const Where& w, const std::string& ctx, const json& v) {
  if (!v.is_array()) w.fail(ctx, "\"shape\" is not a list");
  Shape shape;
  for (const json& d : v) {
    if (!is_count(d)) w.fail(ctx, "\"shape\" holds ", json_excerpt(d), ", not a non-negative integer");
    shape.push_back(d.get<int64_t>());
  }
  return shape;
}

Box parse_box(const Where& w, const std::string& ctx, const json& v, const Shape& shape) {
  if (!v.is_array()) w.fail(ctx, "\"box\" is not a list");
  Box box;
  for (const json& r : v) {
    if (!r.is_array() || r.size() != 2 || !is_count(r[0]) || !is_count(r[1]))
      w.fail(ctx, "\"box\" holds ", json_excerpt(r), ", not a pair [begin, end] of non-negative integers");
    box.begin.push_back(r[0].get<int64_t>());
    box.end.push_back(r[1].get<int64_t>());
  }
  if (!box_fits(box, shape)) w.fail(ctx, "box ", to_string(box), " does not fit the shape ", shape_str(shape));
  return box;
}

bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

constexpr const char* kChecksumPrefix = "fnv1a64w:";

std::string checksum_text(uint64_t c) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%s%016llx", kChecksumPrefix, static_cast<unsigned long long>(c));
  return buf;
}

CheckpointShardRef parse_shard_ref(const Where& w, const std::string& ctx, const json& v, const Shape& shape,
                                   const std::string& tensor) {
  CheckpointShardRef ref;
  const json& file = field(w, v, ctx, "file");
  const json& key = field(w, v, ctx, "key");
  if (!file.is_string() || !plain_file_name(file.get<std::string>()))
    w.fail(ctx, "\"file\" is not a plain file name: ", json_excerpt(file));
  if (!key.is_string()) w.fail(ctx, "\"key\" is not a string");
  ref.file = file.get<std::string>();
  ref.key = key.get<std::string>();
  ref.box = parse_box(w, ctx, field(w, v, ctx, "box"), shape);
  // The key names this tensor's box: an index whose key points at another
  // tensor's (or box's) data would load the wrong numbers.
  if (ref.key != shard_key(tensor, ref.box))
    w.fail(ctx, "\"key\" '", shorten(ref.key), "' is not this tensor's box (expected '", shard_key(tensor, ref.box),
           "')");
  if (v.contains("checksum")) {
    const json& c = v["checksum"];
    const std::string text = c.is_string() ? c.get<std::string>() : "";
    const std::string prefix = kChecksumPrefix;
    uint64_t value = 0;
    const char* digits = text.c_str() + std::min(text.size(), prefix.size());
    const auto [end, ec] = std::from_chars(digits, text.c_str() + text.size(), value, 16);
    if (text.rfind(prefix, 0) != 0 || text.size() != prefix.size() + 16 || ec != std::errc() ||
        end != text.c_str() + text.size())
      w.fail(ctx, "\"checksum\" is not \"", prefix, "<16 hex digits>\": ", json_excerpt(c));
    ref.checksum = value;
  }
  return ref;
}

CheckpointTensor parse_tensor(const Where& w, const std::string& name, const json& v) {
  const std::string ctx = "tensor '" + name + "': ";
  CheckpointTensor t;
  t.shape = parse_shape(w, ctx, field(w, v, ctx, "shape"));
  const json& dtype = field(w, v, ctx, "dtype");
  std::optional<DType> dt = dtype.is_string() ? dtype_from_name(dtype.get<std::string>()) : std::nullopt;
  if (!dt) w.fail(ctx, "unsupported dtype ", json_excerpt(dtype), " (supported: F32, BF16, I32, I64)");
  t.dtype = *dt;
  const json& shards = field(w, v, ctx, "shards");
  if (!shards.is_array()) w.fail(ctx, "\"shards\" is not a list");
  for (const json& s : shards) t.shards.push_back(parse_shard_ref(w, ctx, s, t.shape, name));
  return t;
}

json tensor_json(const CheckpointTensor& t) {
  json shards = json::array();
  for (const CheckpointShardRef& s : t.shards) {
    json j = {{"file", s.file}, {"key", s.key}, {"box", box_json(s.box)}};
    if (s.checksum) j["checksum"] = checksum_text(*s.checksum);
    shards.push_back(std::move(j));
  }
  return {{"shape", t.shape}, {"dtype", dtype_to_name(t.dtype)}, {"shards", shards}};
}

std::map<std::string, CheckpointTensor> parse_tensors(const Where& w, const json& v) {
  if (!v.is_object()) w.fail("\"tensors\" is not a JSON object");
  std::map<std::string, CheckpointTensor> tensors;
  for (const auto& [name, t] : v.items()) tensors.emplace(name, parse_tensor(w, name, t));
  return tensors;
}

// parse_json_text's rules (duplicate keys, nesting depth), failing through `w`.
json parse_strict(const Where& w, const std::string& text) {
  try {
    return parse_json_text(text, "checkpoint", w.what);
  } catch (const Error& e) {
    const std::string what = e.what(), prefix = "[checkpoint] " + w.what + ": ";
    w.fail(what.compare(0, prefix.size(), prefix) == 0 ? what.substr(prefix.size()) : what);
  }
}

// Parses dir/<name>; nullopt when the file does not exist.
std::optional<json> read_json_file(const Where& w, const std::string& name) {
  const fs::path path = fs::path(w.dir) / name;
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return std::nullopt;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) w.fail("cannot open: ", errno_text());
  std::string text;
  char buf[1 << 16];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) text.append(buf, n);
  const bool bad = std::ferror(f);
  std::fclose(f);
  if (bad) w.fail("cannot read the file");
  return parse_strict(w, text);
}

void check_header(const Where& w, const json& j, const char* format) {
  const json& f = field(w, j, "", "format");
  if (f != format) w.fail("\"format\" is ", json_excerpt(f), ", not \"", format, "\"");
  const json& v = field(w, j, "", "version");
  if (v != kVersion) w.fail("\"version\" is ", json_excerpt(v), "; this build reads version ", kVersion);
}

int64_t parse_step(const Where& w, const json& j) {
  const json& s = field(w, j, "", "step");
  if (!is_count(s)) w.fail("\"step\" is not a non-negative integer");
  return s.get<int64_t>();
}

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

StEntry parse_st_entry(const Where& w, const std::string& key, const json& v, uint64_t data_start,
                       uint64_t file_bytes) {
  const std::string ctx = "key '" + key + "': ";
  const json& dtype = field(w, v, ctx, "dtype");
  std::optional<DType> dt = dtype.is_string() ? dtype_from_name(dtype.get<std::string>()) : std::nullopt;
  if (!dt) w.fail(ctx, "unsupported dtype ", json_excerpt(dtype));
  StEntry e{*dt, parse_shape(w, ctx, field(w, v, ctx, "shape"))};
  const json& offs = field(w, v, ctx, "data_offsets");
  if (!offs.is_array() || offs.size() != 2 || !is_count(offs[0]) || !is_count(offs[1]))
    w.fail(ctx, "\"data_offsets\" is not a pair of non-negative integers");
  e.begin = data_start + offs[0].get<uint64_t>();
  e.end = data_start + offs[1].get<uint64_t>();
  const uint64_t need = static_cast<uint64_t>(shape_numel(e.shape)) * dtype_size(e.dtype);
  if (e.end < e.begin || e.end - e.begin != need || e.end > file_bytes)
    w.fail(ctx, "data_offsets do not match the shape or lie beyond the file's end");
  return e;
}

// Opens dir/<name> and parses its safetensors header.
std::unique_ptr<ShardFile> open_shard_file(const std::string& dir, const std::string& name) {
  auto f = std::make_unique<ShardFile>();
  f->name = name;
  f->fd.fd = ::open((fs::path(dir) / name).c_str(), O_RDONLY | O_CLOEXEC);
  if (f->fd.fd < 0) fail_dir(dir, "shard file '", name, "' missing (", errno_text(), ")");
  const Where w{dir, "malformed shard file '" + name + "'"};
  struct stat st;
  if (::fstat(f->fd.fd, &st) != 0) w.fail("cannot stat: ", errno_text());
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  unsigned char len[8];
  if (file_bytes < 8 || !pread_all(f->fd.fd, len, 8, 0)) w.fail("shorter than the 8-byte header length");
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | len[i];
  if (header_bytes > file_bytes - 8) w.fail("header length ", header_bytes, " runs past the file's end");
  std::string text(header_bytes, '\0');
  if (!pread_all(f->fd.fd, text.data(), header_bytes, 8)) w.fail("cannot read the header");
  const json header = parse_strict(w, text);
  if (!header.is_object()) w.fail("the header is not a JSON object");
  for (const auto& [key, v] : header.items())
    if (key != "__metadata__") f->entries.emplace(key, parse_st_entry(w, key, v, 8 + header_bytes, file_bytes));
  return f;
}

// The entry of `ref` in `file`, checked against the index's box and dtype.
const StEntry& shard_entry(const std::string& dir, const ShardFile& file, const std::string& tensor,
                           const CheckpointShardRef& ref, DType dtype) {
  auto it = file.entries.find(ref.key);
  if (it == file.entries.end())
    fail_dir(dir, "shard file '", file.name, "' has no key '", ref.key, "' (tensor '", tensor, "')");
  const StEntry& e = it->second;
  if (e.shape != ref.box.shape() || e.dtype != dtype)
    fail_dir(dir, "shard file '", file.name, "': key '", ref.key, "' holds ", shape_str(e.shape), " ",
             dtype_to_name(e.dtype), " but the index says box ", to_string(ref.box), " of ", dtype_to_name(dtype));
  return e;
}

std::vector<const Box*> shard_boxes(const CheckpointTensor& t) {
  std::vector<const Box*> boxes;
  for (const CheckpointShardRef& s : t.shards) boxes.push_back(&s.box);
  return boxes;
}

[[noreturn]] void fail_uncovered(const std::string& dir, const std::string& tensor, const Box& box) {
  fail_dir(dir, "tensor '", tensor, "': elements ", to_string(box), " are in no shard");
}

}  // namespace checkpoint_detail

using namespace checkpoint_detail;

// ---- writing -------------------------------------------------------------

namespace {

// A validated shard ready to be written: its key and contiguous data.
struct Prepared {
  const CheckpointShard* shard;
  std::string key;
  NDArray data;
};

void check_shard(const std::string& dir, int rank, const CheckpointShard& s) {
  const std::string ctx = "rank " + std::to_string(rank) + ": tensor '" + s.tensor + "': ";
  if (s.tensor.empty()) fail_dir(dir, "rank ", rank, ": a shard has an empty tensor name");
  for (int64_t d : s.global_shape)
    if (d < 0) fail_dir(dir, ctx, "global shape ", shape_str(s.global_shape), " has a negative dim");
  if (!box_fits(s.box, s.global_shape))
    fail_dir(dir, ctx, "box ", to_string(s.box), " does not fit the global shape ", shape_str(s.global_shape));
  if (!s.data.valid()) fail_dir(dir, ctx, "the data is an empty (invalid) array");
  if (!st_dtype_name(s.data.dtype()))
    fail_dir(dir, ctx, "dtype ", dtype_name(s.data.dtype()), " is not supported (F32, BF16, I32, I64)");
  if (!(s.data.device() == Device::cpu()))
    fail_dir(dir, ctx, "the data lives on ", s.data.device().str(), "; copy it to the CPU first");
  if (s.data.shape() != s.box.shape())
    fail_dir(dir, ctx, "the data has shape ", shape_str(s.data.shape()), " but box ", to_string(s.box),
             " has shape ", shape_str(s.box.shape()));
}

std::vector<Prepared> prepare(const std::string& dir, int rank, const std::vector<CheckpointShard>& shards) {
  std::vector<Prepared> out;
  std::map<std::string, const CheckpointShard*> first;  // per tensor
  std::set<std::string> keys;
  for (const CheckpointShard& s : shards) {
    check_shard(dir, rank, s);
    const std::string ctx = "rank " + std::to_string(rank) + ": tensor '" + s.tensor + "': ";
    auto [it, fresh] = first.emplace(s.tensor, &s);
    const CheckpointShard& f = *it->second;
    if (!fresh && (f.global_shape != s.global_shape || f.data.dtype() != s.data.dtype()))
      fail_dir(dir, ctx, "shape mismatch between shards: ", shape_str(f.global_shape), " ",
               dtype_to_name(f.data.dtype()), " and ", shape_str(s.global_shape), " ", dtype_to_name(s.data.dtype()));
    std::string key = shard_key(s.tensor, s.box);
    if (!keys.insert(key).second) fail_dir(dir, ctx, "box ", to_string(s.box), " is given twice");
    out.push_back({&s, std::move(key), s.data.contiguous()});
  }
  return out;
}

void refuse_committed_step(const std::string& dir, int64_t step) {
  std::optional<json> index;
  try {
    index = read_json_file(Where{dir, kIndexName}, kIndexName);
  } catch (const Error&) {
    return;  // an unreadable index is the loader's problem, not the writer's
  }
  if (index && index->is_object() && index->value("step", json()) == step)
    fail_dir(dir, "step ", step, " is the committed checkpoint; a new checkpoint needs another step");
}

std::string shard_file_header(int64_t step, int rank, const std::vector<Prepared>& shards) {
  json header = json::object();
  header["__metadata__"] = {{"format", kFormat}, {"step", std::to_string(step)}, {"rank", std::to_string(rank)}};
  uint64_t offset = 0;
  for (const Prepared& p : shards) {
    const uint64_t bytes = p.data.nbytes();
    header[p.key] = {{"dtype", dtype_to_name(p.data.dtype())}, {"shape", p.data.shape()},
                     {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(uint64_t{text.size()} >> (8 * i));
  return std::string(reinterpret_cast<const char*>(len), 8) + text;
}

bool fault_requested(int64_t step, int rank) {
  const char* v = std::getenv(kFaultEnv);
  return v != nullptr && std::string(v) == std::to_string(rank) + ":" + std::to_string(step);
}

// The test hook: leaves a partial temporary file and dies like a crash.
[[noreturn]] void crash_mid_write(int fd, const std::vector<Prepared>& shards) {
  if (!shards.empty()) (void)write_all(fd, shards[0].data.host_raw_data("checkpoint write"), shards[0].data.nbytes() / 2);
  ::fsync(fd);
  ::kill(::getpid(), SIGKILL);
  std::abort();  // not reached
}

void write_shard_file(const std::string& dir, const std::string& name, int64_t step, int rank,
                      const std::vector<Prepared>& shards) {
  Fd fd(open_tmp(dir, name));
  const std::string header = shard_file_header(step, rank, shards);
  bool ok = write_all(fd.fd, header.data(), header.size());
  if (ok && fault_requested(step, rank)) crash_mid_write(fd.fd, shards);
  for (size_t i = 0; ok && i < shards.size(); ++i) ok = write_all(fd.fd, shards[i].data.host_raw_data("checkpoint write"), shards[i].data.nbytes());
  if (!ok) fail_removing_tmp(dir, name, "cannot write '", name, ".tmp': ", errno_text());
  finish_tmp(dir, name, fd);
}

json part_index(int64_t step, int rank, const std::vector<Prepared>& shards) {
  std::map<std::string, CheckpointTensor> tensors;
  for (const Prepared& p : shards) {
    CheckpointTensor& t = tensors[p.shard->tensor];
    t.shape = p.shard->global_shape;
    t.dtype = p.data.dtype();
    t.shards.push_back({shard_file_name(step, rank), p.key, p.shard->box,
                        checkpoint_checksum(p.data.host_raw_data("checkpoint write"), p.data.nbytes())});
  }
  json j = {{"format", kPartFormat}, {"version", kVersion}, {"step", step}, {"rank", rank}, {"tensors", json::object()}};
  for (const auto& [name, t] : tensors) j["tensors"][name] = tensor_json(t);
  return j;
}

}  // namespace

uint64_t checkpoint_checksum(const void* data, size_t bytes) {
  constexpr uint64_t kPrime = 0x100000001b3ull;
  uint64_t h = 0xcbf29ce484222325ull;
  const auto* p = static_cast<const unsigned char*>(data);
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, 8);  // little-endian machines only (as the files)
    h = (h ^ word) * kPrime;
  }
  if (i < bytes) {
    uint64_t word = 0;
    std::memcpy(&word, p + i, bytes - i);
    h = (h ^ word) * kPrime;
  }
  return (h ^ static_cast<uint64_t>(bytes)) * kPrime;
}

void write_checkpoint_shards(const std::string& dir, int64_t step, int rank,
                             const std::vector<CheckpointShard>& shards) {
  if (step < 0) fail_dir(dir, "step ", step, " is negative");
  if (rank < 0) fail_dir(dir, "rank ", rank, " is negative");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail_dir(dir, "cannot create the directory: ", ec.message());
  refuse_committed_step(dir, step);
  const std::vector<Prepared> prepared = prepare(dir, rank, shards);
  if (!prepared.empty()) write_shard_file(dir, shard_file_name(step, rank), step, rank, prepared);
  write_text_atomic(dir, part_file_name(step, rank), part_index(step, rank, prepared).dump());
}

// ---- commit --------------------------------------------------------------

namespace {

void merge_tensor(const std::string& dir, const std::string& name, CheckpointTensor&& part, int rank,
                  std::map<std::string, std::pair<CheckpointTensor, int>>& merged) {
  auto [it, fresh] = merged.try_emplace(name, std::move(part), rank);
  if (fresh) return;
  CheckpointTensor& t = it->second.first;
  if (t.shape != part.shape || t.dtype != part.dtype)
    fail_dir(dir, "tensor '", name, "': shape mismatch: ", shape_str(t.shape), " ", dtype_to_name(t.dtype),
             " on rank ", it->second.second, " but ", shape_str(part.shape), " ", dtype_to_name(part.dtype),
             " on rank ", rank);
  for (CheckpointShardRef& s : part.shards) t.shards.push_back(std::move(s));
}

std::map<std::string, CheckpointTensor> merge_parts(const std::string& dir, int64_t step, int world_size) {
  std::map<std::string, std::pair<CheckpointTensor, int>> merged;  // tensor, first rank holding it
  for (int rank = 0; rank < world_size; ++rank) {
    const std::string name = part_file_name(step, rank);
    const Where w{dir, "malformed part index '" + name + "'"};
    std::optional<json> part = read_json_file(w, name);
    if (!part) fail_dir(dir, "part index '", name, "' of rank ", rank, " for step ", step, " missing");
    check_header(w, *part, kPartFormat);
    if (parse_step(w, *part) != step || field(w, *part, "", "rank") != rank)
      w.fail("it names another step or rank");
    for (auto& [tname, t] : parse_tensors(w, field(w, *part, "", "tensors")))
      merge_tensor(dir, tname, std::move(t), rank, merged);
  }
  std::map<std::string, CheckpointTensor> tensors;
  for (auto& [name, t] : merged) tensors.emplace(name, std::move(t.first));
  return tensors;
}

// Every shard file exists and holds its keys; every element is in a shard.
void verify(const std::string& dir, const std::map<std::string, CheckpointTensor>& tensors) {
  std::map<std::string, std::unique_ptr<ShardFile>> files;
  for (const auto& [name, t] : tensors) {
    for (const CheckpointShardRef& s : t.shards) {
      auto& f = files[s.file];
      if (!f) f = open_shard_file(dir, s.file);
      shard_entry(dir, *f, name, s, t.dtype);
    }
    const Box whole{Shape(t.shape.size(), 0), t.shape};
    std::vector<Box> left = cover(whole, shard_boxes(t), [](size_t, const Box&) {});
    if (!left.empty()) fail_uncovered(dir, name, left.front());
  }
}

// Deletes part indexes, unreferenced shard files and stale temporaries.
void remove_stale(const std::string& dir, const std::map<std::string, CheckpointTensor>& tensors) {
  std::set<std::string> keep;
  for (const auto& [name, t] : tensors)
    for (const CheckpointShardRef& s : t.shards) keep.insert(s.file);
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const bool stale = std::regex_match(name, part_file_pattern()) || std::regex_match(name, tmp_file_pattern()) ||
                       (std::regex_match(name, shard_file_pattern()) && !keep.count(name));
    std::error_code rm;
    if (stale) fs::remove(e.path(), rm);
  }
  fsync_dir(dir);
}

}  // namespace

void commit_checkpoint(const std::string& dir, int64_t step, int world_size, const json& meta) {
  if (step < 0) fail_dir(dir, "step ", step, " is negative");
  if (world_size < 1) fail_dir(dir, "world size ", world_size, " is not positive");
  const std::map<std::string, CheckpointTensor> tensors = merge_parts(dir, step, world_size);
  verify(dir, tensors);
  json index = {{"format", kFormat}, {"version", kVersion}, {"step", step}, {"meta", meta},
                {"tensors", json::object()}};
  for (const auto& [name, t] : tensors) index["tensors"][name] = tensor_json(t);
  write_text_atomic(dir, kIndexName, index.dump(1));  // the commit point
  remove_stale(dir, tensors);
}

// ---- loading -------------------------------------------------------------

bool checkpoint_exists(const std::string& dir) {
  std::error_code ec;
  return fs::is_regular_file(fs::path(dir) / kIndexName, ec);
}

CheckpointIndex load_checkpoint_index(const std::string& dir) {
  const Where w{dir, "malformed index.json"};
  std::optional<json> j = read_json_file(w, kIndexName);
  if (!j) fail_dir(dir, "no checkpoint (index.json missing)");
  check_header(w, *j, kFormat);
  CheckpointIndex index;
  index.step = parse_step(w, *j);
  index.meta = field(w, *j, "", "meta");
  index.tensors = parse_tensors(w, field(w, *j, "", "tensors"));
  std::set<std::string> seen;
  for (const auto& [name, t] : index.tensors)
    for (const CheckpointShardRef& s : t.shards) {
      std::error_code ec;
      if (seen.insert(s.file).second && !fs::is_regular_file(fs::path(dir) / s.file, ec))
        fail_dir(dir, "shard file '", s.file, "' missing (tensor '", name, "')");
    }
  return index;
}

struct CheckpointReader::OpenFile {
  std::unique_ptr<ShardFile> file;
};

CheckpointReader::CheckpointReader(std::string dir) : dir_(std::move(dir)), index_(load_checkpoint_index(dir_)) {}

CheckpointReader::~CheckpointReader() = default;

const CheckpointTensor& CheckpointReader::tensor(const std::string& name) const {
  auto it = index_.tensors.find(name);
  if (it == index_.tensors.end()) fail_dir(dir_, "tensor '", name, "' is not in the checkpoint");
  return it->second;
}

void CheckpointReader::check_shape(const std::string& name, const Shape& shape) const {
  const CheckpointTensor& t = tensor(name);
  if (t.shape != shape)
    fail_dir(dir_, "tensor '", name, "': shape mismatch: checkpoint ", shape_str(t.shape), ", expected ",
             shape_str(shape));
}

CheckpointReader::OpenFile& CheckpointReader::open(const std::string& file) {
  std::unique_ptr<OpenFile>& f = files_[file];
  if (!f) f = std::make_unique<OpenFile>(OpenFile{open_shard_file(dir_, file)});
  return *f;
}

namespace {

// Row-major linear position of `at` inside `frame`.
int64_t linear(const Box& frame, const Shape& at) {
  int64_t pos = 0;
  for (size_t d = 0; d < at.size(); ++d) pos = pos * (frame.end[d] - frame.begin[d]) + (at[d] - frame.begin[d]);
  return pos;
}

// Copies `region` (global coordinates, inside both `src` and `dst`) from
// the stored entry of box `src` into `out` (contiguous, box `dst`), one pread
// per contiguous run: the trailing dims that `region` spans whole in both
// boxes are merged with the first dim that it does not.
void copy_region(const std::string& dir, const std::string& file, int fd, const StEntry& e, const Box& src,
                 const Box& region, const Box& dst, NDArray& out) {
  const int n = static_cast<int>(region.begin.size());
  const size_t esize = dtype_size(out.dtype());
  auto whole = [&](int d) {
    const int64_t len = region.end[d] - region.begin[d];
    return len == src.end[d] - src.begin[d] && len == dst.end[d] - dst.begin[d];
  };
  int j = n - 1;
  while (j > 0 && whole(j)) --j;
  int64_t run = 1;
  for (int d = std::max(j, 0); d < n; ++d) run *= region.end[d] - region.begin[d];
  char* base = static_cast<char*>(out.host_raw_data("checkpoint read"));
  Shape at = region.begin;
  while (true) {
    const uint64_t from = e.begin + static_cast<uint64_t>(linear(src, at)) * esize;
    if (!pread_all(fd, base + linear(dst, at) * esize, static_cast<size_t>(run) * esize, from))
      fail_dir(dir, "shard file '", file, "': cannot read ", run * esize, " bytes at offset ", from);
    int d = j - 1;  // advance the odometer over the dims before j
    for (; d >= 0 && ++at[d] == region.end[d]; --d) at[d] = region.begin[d];
    if (d < 0) return;
  }
}

}  // namespace

// The whole entry, once per (file, key): its checksum must be the index's.
void CheckpointReader::verify(const ShardFile& f, const StEntry& e, const std::string& tensor,
                              const CheckpointShardRef& s) const {
  std::vector<char> bytes(static_cast<size_t>(e.end - e.begin));
  if (!pread_all(f.fd.fd, bytes.data(), bytes.size(), e.begin))
    fail_dir(dir_, "shard file '", s.file, "': cannot read ", bytes.size(), " bytes at offset ", e.begin);
  const uint64_t got = checkpoint_checksum(bytes.data(), bytes.size());
  if (got != *s.checksum)
    fail_dir(dir_, "shard file '", s.file, "': key '", s.key, "' (tensor '", tensor,
             "'): checksum mismatch: the data is corrupt (index ", checksum_text(*s.checksum), ", file ",
             checksum_text(got), ")");
}

// A checkpoint holds finite numbers only: a NaN or infinity is named here,
// not at the first step that trips on it.
void CheckpointReader::check_finite(const std::string& tensor, const Box& box, const NDArray& a) const {
  if (a.dtype() != DType::F32 && a.dtype() != DType::BF16) return;
  const NDArray f = a.dtype() == DType::F32 ? a : a.to(DType::F32);
  const float* x = f.host_data<float>("checkpoint check");
  for (int64_t i = 0; i < f.numel(); ++i)
    if (!std::isfinite(x[i]))
      fail_dir(dir_, "tensor '", tensor, "' holds ", x[i], " at element ", i, " of box ", to_string(box),
               " (a checkpoint holds finite values only)");
}

NDArray CheckpointReader::read(const std::string& name, const Box& box) {
  const CheckpointTensor& t = tensor(name);
  if (!box_fits(box, t.shape))
    fail_dir(dir_, "tensor '", name, "': shape mismatch: box ", to_string(box), " does not fit its shape ",
             shape_str(t.shape));
  NDArray out = NDArray::empty(box.shape(), t.dtype);
  std::vector<Box> left = cover(box, shard_boxes(t), [&](size_t i, const Box& region) {
    const CheckpointShardRef& s = t.shards[i];
    const ShardFile& f = *open(s.file).file;
    const StEntry& e = shard_entry(dir_, f, name, s, t.dtype);
    if (s.checksum && verified_.insert({s.file, s.key}).second) verify(f, e, name, s);
    copy_region(dir_, s.file, f.fd.fd, e, s.box, region, box, out);
  });
  if (!left.empty()) fail_uncovered(dir_, name, left.front());
  check_finite(name, box, out);
  return out;
}

}  // namespace hspmd
