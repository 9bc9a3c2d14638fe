// The checkpoint format (docs/checkpoint.md): file names, boxes and their
// cover, POSIX file helpers (atomic writes through a temporary file), the
// JSON forms of the indexes and the shard files' safetensors headers.
// Declared in checkpoint_internal.h; checkpoint.cc uses them.
#include "io/checkpoint_internal.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "hspmd/core/json_file.h"
#include "hspmd/io/safetensors.h"

namespace hspmd {
namespace checkpoint_detail {

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

}  // namespace hspmd
