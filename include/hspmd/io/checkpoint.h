// Sharded training checkpoints: every rank writes the boxes it holds of each
// logical global tensor (weights, optimizer states) in parallel; a loader
// under any other parallel plan and world size reads arbitrary boxes back.
// This is the communicator-free I/O part; the caller places barriers between
// the steps. docs/checkpoint.md describes the format in full.
//
// Directory layout of a checkpoint directory DIR:
//   index.json                                   the commit point (below)
//   step-<step, 8 digits>-rank-<rank, 5 digits>.safetensors
//       a rank's shard file (standard safetensors); key "<tensor>@<box>"
//       with <box> "b0:e0,b1:e1,..." (half-open global ranges per dim, ""
//       for a scalar), shape = the box's shape, dtype = the data's
//   step-<...>-rank-<...>.json                   a rank's part index, only
//       between write_checkpoint_shards and commit_checkpoint
//   *.tmp                                        files being written
// Wider numbers than 8 / 5 digits are written in full.
//
// index.json:
//   {"format": "hspmd-checkpoint", "version": 1, "step": K, "meta": {...},
//    "tensors": {"<name>": {"shape": [...], "dtype": "F32",
//       "shards": [{"file": "step-...safetensors", "key": "...",
//                   "box": [[begin, end], ...], "checksum": "fnv1a64w:..."}]}}}
//
// Protocol: every rank calls write_checkpoint_shards(dir, K, rank, ...); the
// caller barriers; rank 0 calls commit_checkpoint(dir, K, world, meta). Each
// file is written under "<name>.tmp", fsynced and renamed; index.json is
// replaced last. Files of step K never overwrite files of the committed
// step, so a crash anywhere before index.json is renamed leaves the previous
// checkpoint intact and loadable.
//
// Errors are hspmd::Error, one line "[checkpoint] <dir>: <rule>".
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/annotation/annotation.h"
#include "hspmd/core/ndarray.h"

namespace hspmd {

// One box of one global tensor held by the writing rank. `data` holds the
// box's elements: shape == box.shape(), on the CPU, any dtype (F32, BF16,
// I32, I64), strided views allowed.
struct CheckpointShard {
  std::string tensor;
  Shape global_shape;
  Box box;
  NDArray data;
};

// Writes this rank's shards of checkpoint `step` into `dir` (created when
// missing): the shard file (none when `shards` is empty) and then the part
// index, each as "<name>.tmp", fsynced, renamed. Ranks may hold overlapping
// boxes (replicas); all shards of one tensor must agree on global shape and
// dtype. Throws hspmd::Error for: step < 0 or rank < 0; an empty tensor name;
// a box whose rank or range does not fit the global shape; data that is
// invalid, not on the CPU, not of the box's shape or of another dtype than
// F32, BF16, I32, I64; two shards of one tensor with different global
// shapes or dtypes, or with the same box; `step` equal to the step that
// dir/index.json already commits (its files would be overwritten); a file
// that cannot be written. A stale file of the same step and rank (an earlier
// attempt) is replaced.
//
// Test hook: when the environment variable HSPMD_FAULT_KILL_CHECKPOINT is
// "<rank>:<step>" for this call's rank and step, the call writes part of its
// temporary shard file and then kills its own process with SIGKILL.
void write_checkpoint_shards(const std::string& dir, int64_t step, int rank,
                             const std::vector<CheckpointShard>& shards);

// Rank 0, after every rank 0..world_size-1 returned from
// write_checkpoint_shards(dir, step, ...): reads their part indexes, checks
// that every shard file exists and holds its keys and that every element of
// every tensor lies in some shard, writes index.json.tmp with `meta` (any
// JSON, stored verbatim), fsyncs it and renames it to index.json (the commit
// point). Then it deletes every part index, every shard file that the new
// index does not reference, and every stale "*.tmp" of this format (files
// of other names are left alone). Throws hspmd::Error, before the commit
// point (the previous checkpoint stays intact), for: world_size < 1; a
// missing or malformed part index; shards of one tensor with different
// shapes or dtypes on different ranks; a missing shard file or key; elements
// in no shard ("tensor 'X': elements [..] are in no shard"); a file that
// cannot be written. Failing deletions after the commit point are ignored.
void commit_checkpoint(const std::string& dir, int64_t step, int world_size, const nlohmann::json& meta);

// Where one box of a tensor is stored: a shard file in the checkpoint
// directory (a plain file name) and its key there.
struct CheckpointShardRef {
  std::string file;
  std::string key;
  Box box;
  // checkpoint_checksum of the entry's bytes as written; absent in
  // checkpoints written before checksums (then nothing is verified).
  std::optional<uint64_t> checksum;
};

// The checksum stored per shard ("checksum": "fnv1a64w:<16 hex digits>"):
// FNV-1a over the bytes taken as little-endian 64-bit words (the tail
// zero-padded), then the byte count folded in. Catches any flipped byte.
uint64_t checkpoint_checksum(const void* data, size_t bytes);

struct CheckpointTensor {
  Shape shape;
  DType dtype = DType::F32;
  std::vector<CheckpointShardRef> shards;
};

struct CheckpointIndex {
  int64_t step = 0;
  nlohmann::json meta;
  std::map<std::string, CheckpointTensor> tensors;
};

// Whether dir/index.json exists (a committed checkpoint is there).
bool checkpoint_exists(const std::string& dir);

// Parses and validates dir/index.json and checks that every shard file it
// names exists. Throws hspmd::Error: "no checkpoint (index.json missing)";
// "malformed index.json: <what>" (not JSON, wrong format or version, a
// missing or mistyped field, a box outside its tensor's shape, a file name
// with a path separator); "shard file '<file>' missing (tensor '<name>')".
CheckpointIndex load_checkpoint_index(const std::string& dir);

namespace checkpoint_detail {  // src/io/checkpoint*.cc, checkpoint_internal.h
struct ShardFile;
struct StEntry;
}  // namespace checkpoint_detail

// Reads arbitrary global boxes of the tensors of a committed checkpoint.
// Shard files are opened on first use and kept open with their parsed
// headers; a read fetches only the contiguous runs of the overlapping
// shards that it needs (pread), never whole files. Not thread-safe.
class CheckpointReader {
 public:
  // Loads the index (throws like load_checkpoint_index).
  explicit CheckpointReader(std::string dir);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const CheckpointIndex& index() const { return index_; }
  bool has(const std::string& tensor) const { return index_.tensors.count(tensor) > 0; }
  // The stored tensor; throws "tensor 'X' is not in the checkpoint".
  const CheckpointTensor& tensor(const std::string& name) const;
  // Throws "tensor 'X': shape mismatch: checkpoint [..], expected [..]"
  // unless the stored global shape equals `shape`.
  void check_shape(const std::string& name, const Shape& shape) const;

  // The elements of global box `box` of `tensor`, contiguous on the CPU in
  // the stored dtype, assembled from the shards overlapping it (where shards
  // overlap, any one of them is used). Throws hspmd::Error for: an unknown
  // tensor; a box of the wrong rank or outside the tensor's shape ("shape
  // mismatch"); elements in no shard ("tensor 'X': elements [..] are in no
  // shard"); a shard file that is missing, malformed, lacks its key or
  // whose entry disagrees with the index; a failing read.
  NDArray read(const std::string& tensor, const Box& box);

 private:
  struct OpenFile;
  OpenFile& open(const std::string& file);
  void verify(const checkpoint_detail::ShardFile& f, const checkpoint_detail::StEntry& e,
              const std::string& tensor, const CheckpointShardRef& s) const;
  void check_finite(const std::string& tensor, const Box& box, const NDArray& a) const;

  std::string dir_;
  CheckpointIndex index_;
  std::map<std::string, std::unique_ptr<OpenFile>> files_;
  std::set<std::pair<std::string, std::string>> verified_;  // (file, key) whose checksum matched
};

}  // namespace hspmd
