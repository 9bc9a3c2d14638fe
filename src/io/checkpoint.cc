// Sharded training checkpoints (docs/checkpoint.md): writing a rank's
// shards, committing a step, loading the index, and CheckpointReader. The
// format's helpers are in checkpoint_format.cc (checkpoint_internal.h).
#include "hspmd/io/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <set>

#include "io/checkpoint_internal.h"

namespace hspmd {

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
