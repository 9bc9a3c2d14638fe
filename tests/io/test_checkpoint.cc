#include "hspmd/io/checkpoint.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "hspmd/core/error.h"
#include "hspmd/io/safetensors.h"

namespace hspmd {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A fresh, empty directory for one test.
std::string fresh_dir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("hspmd_ckpt_" + name);
  fs::remove_all(dir);
  return dir.string();
}

// The global tensor whose element at linear position i is seed + i.
NDArray global_tensor(const Shape& shape, float seed) {
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = seed + static_cast<float>(i);
  return NDArray::from_vector(shape, v);
}

Box make_box(const Shape& begin, const Shape& end) { return Box{begin, end}; }
Box whole(const Shape& shape) { return Box{Shape(shape.size(), 0), shape}; }

CheckpointShard shard_of(const std::string& name, const NDArray& global, const Box& box) {
  return CheckpointShard{name, global.shape(), box, box_slice(global, box)};
}

std::set<std::string> files_in(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  return names;
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
}

// Expects `f` to throw hspmd::Error "[checkpoint] <dir>: ...<rule>...".
template <typename F>
void expect_error(const std::string& dir, const std::string& rule, F&& f) {
  try {
    f();
    FAIL() << "no error; expected: " << rule;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("[checkpoint] " + dir + ": ", 0), 0u) << msg;
    EXPECT_NE(msg.find(rule), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

void expect_same(const NDArray& got, const NDArray& want) {
  ASSERT_EQ(got.shape(), want.shape());
  ASSERT_EQ(got.dtype(), want.dtype());
  EXPECT_EQ(got.to_vector(), want.to_vector());
}

// A random non-empty sub-box of `shape`.
Box random_box(const Shape& shape, std::mt19937& rng) {
  Box b{Shape(shape.size()), Shape(shape.size())};
  for (size_t d = 0; d < shape.size(); ++d) {
    std::uniform_int_distribution<int64_t> pick(0, shape[d] - 1);
    int64_t x = pick(rng), y = pick(rng);
    b.begin[d] = std::min(x, y);
    b.end[d] = std::max(x, y) + 1;
  }
  return b;
}

// Three tensors (1-D, 2-D, 3-D) held by five ranks under a plan with
// replicas, partial overlaps, uneven boxes and one rank holding nothing.
struct Model {
  NDArray bias = global_tensor({8}, 0.5f);
  NDArray weight = global_tensor({6, 8}, 100.f);
  NDArray cube = global_tensor({4, 5, 6}, -300.f);

  std::vector<std::vector<CheckpointShard>> ranks() const {
    std::vector<std::vector<CheckpointShard>> r(5);
    r[0] = {shard_of("bias", bias, make_box({0}, {4})), shard_of("weight", weight, make_box({0, 0}, {3, 8})),
            shard_of("cube", cube, make_box({0, 0, 0}, {4, 2, 6}))};
    r[1] = {shard_of("bias", bias, make_box({4}, {8})), shard_of("weight", weight, make_box({3, 0}, {6, 4})),
            shard_of("cube", cube, make_box({0, 2, 0}, {4, 5, 3}))};
    r[2] = {shard_of("bias", bias, make_box({0}, {8})), shard_of("weight", weight, make_box({3, 4}, {6, 8})),
            shard_of("cube", cube, make_box({0, 2, 3}, {4, 5, 6}))};
    r[3] = {shard_of("weight", weight, make_box({2, 0}, {5, 8})), shard_of("cube", cube, make_box({1, 1, 1}, {3, 4, 5}))};
    return r;
  }
  const NDArray& get(const std::string& name) const { return name == "bias" ? bias : name == "weight" ? weight : cube; }
};

void save(const std::string& dir, int64_t step, const std::vector<std::vector<CheckpointShard>>& ranks,
          const json& meta = json::object()) {
  for (size_t r = 0; r < ranks.size(); ++r) write_checkpoint_shards(dir, step, static_cast<int>(r), ranks[r]);
  commit_checkpoint(dir, step, static_cast<int>(ranks.size()), meta);
}

TEST(Checkpoint, RoundTripArbitraryBoxes) {
  const std::string dir = fresh_dir("round_trip");
  const Model m;
  const json meta = {{"data_cursor", 1234}, {"seed", 7}, {"adam_step", 42}, {"plan", "tp2 x pp2"}};
  save(dir, 42, m.ranks(), meta);

  CheckpointReader reader(dir);
  EXPECT_EQ(reader.index().step, 42);
  EXPECT_EQ(reader.index().meta, meta);
  EXPECT_EQ(reader.index().tensors.size(), 3u);
  EXPECT_EQ(reader.tensor("weight").shards.size(), 4u);
  EXPECT_EQ(reader.tensor("cube").shape, (Shape{4, 5, 6}));
  EXPECT_TRUE(reader.has("bias"));
  EXPECT_FALSE(reader.has("nope"));
  std::mt19937 rng(5);
  for (const char* name : {"bias", "weight", "cube"}) {
    const NDArray& full = m.get(name);
    expect_same(reader.read(name, whole(full.shape())), full);
    for (int i = 0; i < 200; ++i) {
      const Box b = random_box(full.shape(), rng);
      expect_same(reader.read(name, b), box_slice(full, b));
    }
  }
  // A box spanning four shards, and an empty box.
  expect_same(reader.read("weight", make_box({1, 2}, {6, 7})), box_slice(m.weight, make_box({1, 2}, {6, 7})));
  EXPECT_EQ(reader.read("weight", make_box({1, 2}, {1, 7})).shape(), (Shape{0, 5}));
}

TEST(Checkpoint, DirectoryHoldsIndexAndStandardShardFiles) {
  const std::string dir = fresh_dir("layout");
  const Model m;
  save(dir, 3, m.ranks());
  // Rank 4 held nothing: no shard file; part indexes are gone after the commit.
  EXPECT_EQ(files_in(dir), (std::set<std::string>{"index.json", "step-00000003-rank-00000.safetensors",
                                                   "step-00000003-rank-00001.safetensors",
                                                   "step-00000003-rank-00002.safetensors",
                                                   "step-00000003-rank-00003.safetensors"}));
  const json index = read_json(dir + "/index.json");
  EXPECT_EQ(index["format"], "hspmd-checkpoint");
  EXPECT_EQ(index["version"], 1);
  EXPECT_EQ(index["tensors"]["weight"]["dtype"], "F32");
  EXPECT_EQ(index["tensors"]["weight"]["shape"], json({6, 8}));
  const json s = index["tensors"]["weight"]["shards"][0];
  EXPECT_EQ(s["file"], "step-00000003-rank-00000.safetensors");
  EXPECT_EQ(s["key"], "weight@0:3,0:8");
  EXPECT_EQ(s["box"], json({{0, 3}, {0, 8}}));
  // Any safetensors reader reads the shard files.
  auto tensors = load_safetensors(dir + "/step-00000003-rank-00001.safetensors");
  EXPECT_EQ(tensors.size(), 3u);
  expect_same(tensors.at("cube@0:4,2:5,0:3"), box_slice(m.cube, make_box({0, 2, 0}, {4, 5, 3})));
}

TEST(Checkpoint, DtypesScalarsAndStridedData) {
  const std::string dir = fresh_dir("dtypes");
  const NDArray bf = global_tensor({4, 6}, 1.f).to(DType::BF16);
  const NDArray ids = NDArray::from_vector_i32({5}, {9, 8, 7, 6, 5});
  const NDArray scalar = NDArray::from_vector({}, {3.5f});
  const NDArray base = global_tensor({6, 4}, 0.f);  // stored transposed: a strided view
  const NDArray tr = base.transpose(0, 1);
  save(dir, 1,
       {{shard_of("bf", bf, make_box({0, 0}, {4, 3})), shard_of("ids", ids, whole({5})),
         CheckpointShard{"scalar", {}, Box{}, scalar}, CheckpointShard{"tr", {4, 6}, whole({4, 6}), tr}},
        {shard_of("bf", bf, make_box({0, 3}, {4, 6}))}});
  CheckpointReader reader(dir);
  EXPECT_EQ(reader.tensor("bf").dtype, DType::BF16);
  expect_same(reader.read("bf", make_box({1, 2}, {3, 5})), box_slice(bf, make_box({1, 2}, {3, 5})));
  expect_same(reader.read("ids", make_box({1}, {4})), NDArray::from_vector_i32({3}, {8, 7, 6}));
  expect_same(reader.read("scalar", Box{}), scalar);
  expect_same(reader.read("tr", make_box({1, 0}, {3, 6})), box_slice(tr.contiguous(), make_box({1, 0}, {3, 6})));
}

TEST(Checkpoint, LaterCheckpointReplacesEarlierAndDeletesItsFiles) {
  const std::string dir = fresh_dir("replace");
  const Model m;
  save(dir, 10, m.ranks());
  // Step 20 under another plan: two ranks, new values.
  const NDArray w2 = global_tensor({6, 8}, 7.f);
  save(dir, 20, {{shard_of("weight", w2, make_box({0, 0}, {6, 5}))}, {shard_of("weight", w2, make_box({0, 5}, {6, 8}))}},
       {{"seed", 2}});
  EXPECT_EQ(files_in(dir), (std::set<std::string>{"index.json", "step-00000020-rank-00000.safetensors",
                                                   "step-00000020-rank-00001.safetensors"}));
  CheckpointReader reader(dir);
  EXPECT_EQ(reader.index().step, 20);
  EXPECT_EQ(reader.index().meta["seed"], 2);
  EXPECT_FALSE(reader.has("bias"));
  expect_same(reader.read("weight", make_box({2, 3}, {5, 7})), box_slice(w2, make_box({2, 3}, {5, 7})));
}

TEST(Checkpoint, UncommittedStepLeavesPreviousCheckpointLoadable) {
  const std::string dir = fresh_dir("crash");
  const Model m;
  save(dir, 10, m.ranks());
  // Step 20: every rank wrote, the process died before the commit; plus
  // stale temporaries of a crashed write.
  const NDArray w2 = global_tensor({6, 8}, 7.f);
  write_checkpoint_shards(dir, 20, 0, {shard_of("weight", w2, whole({6, 8}))});
  write_checkpoint_shards(dir, 20, 1, {});
  write_text(dir + "/step-00000020-rank-00002.safetensors.tmp", "half a file");
  write_text(dir + "/index.json.tmp", "{\"format\": ");
  write_text(dir + "/notes.txt", "not ours");
  {
    CheckpointReader reader(dir);
    EXPECT_EQ(reader.index().step, 10);
    expect_same(reader.read("weight", whole({6, 8})), m.weight);
    expect_same(reader.read("cube", make_box({1, 1, 1}, {4, 5, 6})), box_slice(m.cube, make_box({1, 1, 1}, {4, 5, 6})));
  }
  // A later commit of step 20 cleans up everything else of this format.
  commit_checkpoint(dir, 20, 2, json::object());
  EXPECT_EQ(files_in(dir),
            (std::set<std::string>{"index.json", "notes.txt", "step-00000020-rank-00000.safetensors"}));
  expect_same(CheckpointReader(dir).read("weight", whole({6, 8})), w2);
}

TEST(Checkpoint, KilledWriterLeavesPreviousCheckpointLoadable) {
  const std::string dir = fresh_dir("sigkill");
  const Model m;
  save(dir, 1, m.ranks());
  const std::vector<CheckpointShard> shards = m.ranks()[0];
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::setenv("HSPMD_FAULT_KILL_CHECKPOINT", "0:2", 1);
    try {
      write_checkpoint_shards(dir, 2, 0, shards);
    } catch (...) {
    }
    ::_exit(0);  // reached only when the hook did not fire
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
  const std::set<std::string> files = files_in(dir);
  EXPECT_TRUE(files.count("step-00000002-rank-00000.safetensors.tmp"));
  EXPECT_FALSE(files.count("step-00000002-rank-00000.safetensors"));
  EXPECT_FALSE(files.count("step-00000002-rank-00000.json"));
  CheckpointReader reader(dir);
  EXPECT_EQ(reader.index().step, 1);
  expect_same(reader.read("weight", whole({6, 8})), m.weight);
  // Another rank or step is not affected by the hook.
  ::setenv("HSPMD_FAULT_KILL_CHECKPOINT", "0:2", 1);
  write_checkpoint_shards(dir, 2, 1, m.ranks()[1]);
  write_checkpoint_shards(dir, 3, 0, m.ranks()[0]);
  ::unsetenv("HSPMD_FAULT_KILL_CHECKPOINT");
}

// A full disk while a shard file is written (simulated with RLIMIT_FSIZE,
// which makes write() fail with EFBIG as ENOSPC would, in a child process):
// a one-line error, and no partial ".tmp" left to keep the disk full.
TEST(Checkpoint, AFailedWriteLeavesNoTemporaryFile) {
  const std::string dir = fresh_dir("full_disk");
  const Model m;
  save(dir, 1, m.ranks());
  const std::vector<CheckpointShard> shards = m.ranks()[0];
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit small {64, 64};
    ::setrlimit(RLIMIT_FSIZE, &small);
    try {
      write_checkpoint_shards(dir, 2, 0, shards);
    } catch (const Error& e) {
      const std::string msg = e.what();
      ::_exit(msg.find("cannot write 'step-00000002-rank-00000.safetensors.tmp'") != std::string::npos ? 3 : 4);
    }
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 3) << "3: the write error; 4: another error; 0: no error";
  const std::set<std::string> files = files_in(dir);
  for (const std::string& f : files) EXPECT_FALSE(f.ends_with(".tmp")) << f;
  EXPECT_EQ(CheckpointReader(dir).index().step, 1);
}

// Contents are verified on load: a flipped byte (the per-shard checksum), a
// NaN (named with its tensor), an index key that points at another tensor's
// data.
TEST(Checkpoint, ContentsAreVerified) {
  const Model m;
  {
    const std::string dir = fresh_dir("flipped_byte");
    save(dir, 3, m.ranks());
    const json index = read_json(dir + "/index.json");
    for (const json& s : index["tensors"]["weight"]["shards"])
      EXPECT_EQ(s["checksum"].get<std::string>().rfind("fnv1a64w:", 0), 0u) << s.dump();
    // Flip one bit of the last byte of rank 0's shard file (its data).
    const std::string file = dir + "/step-00000003-rank-00000.safetensors";
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    char c = 0;
    f.get(c);
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(c ^ 0x10));
    f.close();
    CheckpointReader reader(dir);
    bool mismatch = false;
    for (const char* t : {"bias", "weight", "cube"}) {
      try {
        reader.read(t, whole(reader.tensor(t).shape));
      } catch (const Error& e) {
        mismatch = std::string(e.what()).find("checksum mismatch: the data is corrupt") != std::string::npos;
      }
    }
    EXPECT_TRUE(mismatch);
  }
  {
    const std::string dir = fresh_dir("nan_weight");
    NDArray bad = m.weight.clone();
    bad.data<float>()[13] = std::nanf("");
    save(dir, 3, {{shard_of("weight", bad, whole({6, 8}))}});
    expect_error(dir, "tensor 'weight' holds nan at element 13 of box",
                 [&] { CheckpointReader(dir).read("weight", whole({6, 8})); });
  }
  {
    const std::string dir = fresh_dir("key_elsewhere");
    save(dir, 3, m.ranks());
    json index = read_json(dir + "/index.json");
    // Point weight's first shard at bias's data (a real key of the same file).
    json& ref = index["tensors"]["weight"]["shards"][0];
    ref["key"] = "bias@0:4";
    write_text(dir + "/index.json", index.dump());
    expect_error(dir, "\"key\" 'bias@0:4' is not this tensor's box", [&] { load_checkpoint_index(dir); });
    ref["key"] = "weight@0:3,0:8";
    ref["checksum"] = "crc:12";
    write_text(dir + "/index.json", index.dump());
    expect_error(dir, "\"checksum\" is not", [&] { load_checkpoint_index(dir); });
  }
}

TEST(Checkpoint, LoadErrors) {
  const std::string dir = fresh_dir("load_errors");
  expect_error(dir, "no checkpoint (index.json missing)", [&] { load_checkpoint_index(dir); });
  EXPECT_FALSE(checkpoint_exists(dir));
  const Model m;
  save(dir, 5, m.ranks());
  EXPECT_TRUE(checkpoint_exists(dir));
  const json good = read_json(dir + "/index.json");
  auto expect_malformed = [&](const json& index, const std::string& rule) {
    write_text(dir + "/index.json", index.dump());
    expect_error(dir, "malformed index.json: " + rule, [&] { load_checkpoint_index(dir); });
  };
  write_text(dir + "/index.json", "{ not json");
  expect_error(dir, "malformed index.json: not valid JSON", [&] { load_checkpoint_index(dir); });
  std::string twice = good.dump();
  twice.insert(1, "\"version\": 1, ");
  write_text(dir + "/index.json", twice);
  expect_error(dir, "malformed index.json: duplicate key 'version'", [&] { load_checkpoint_index(dir); });
  json bad = good;
  bad["format"] = "other";
  expect_malformed(bad, "\"format\" is \"other\"");
  bad = good;
  bad["version"] = 2;
  expect_malformed(bad, "\"version\" is 2");
  bad = good;
  bad.erase("meta");
  expect_malformed(bad, "missing field \"meta\"");
  bad = good;
  bad["tensors"]["weight"]["shards"][1]["box"] = json({{3, 7}, {0, 9}});
  expect_malformed(bad, "tensor 'weight': box [3:7, 0:9] does not fit the shape [6, 8]");
  bad = good;
  bad["tensors"]["bias"]["shards"][0]["file"] = "../elsewhere.safetensors";
  expect_malformed(bad, "tensor 'bias': \"file\" is not a plain file name");
  bad = good;
  bad["tensors"]["bias"]["dtype"] = "F8";
  expect_malformed(bad, "tensor 'bias': unsupported dtype \"F8\"");
  write_text(dir + "/index.json", good.dump());
  fs::remove(dir + "/step-00000005-rank-00002.safetensors");
  expect_error(dir, "shard file 'step-00000005-rank-00002.safetensors' missing", [&] { CheckpointReader r(dir); });
}

TEST(Checkpoint, ReadErrors) {
  const std::string dir = fresh_dir("read_errors");
  const Model m;
  save(dir, 5, m.ranks());
  json index = read_json(dir + "/index.json");
  CheckpointReader reader(dir);
  expect_error(dir, "tensor 'nope' is not in the checkpoint", [&] { reader.read("nope", Box{}); });
  expect_error(dir, "tensor 'weight': shape mismatch: box [0:7, 0:8] does not fit its shape [6, 8]",
               [&] { reader.read("weight", make_box({0, 0}, {7, 8})); });
  expect_error(dir, "tensor 'weight': shape mismatch: box [0:2]", [&] { reader.read("weight", make_box({0}, {2})); });
  expect_error(dir, "tensor 'cube': shape mismatch: checkpoint [4, 5, 6], expected [4, 5, 7]",
               [&] { reader.check_shape("cube", {4, 5, 7}); });
  reader.check_shape("cube", {4, 5, 6});
  // Drop the shards of ranks 1 and 2 for "weight": rows 5:6 are then in no shard.
  json& shards = index["tensors"]["weight"]["shards"];
  shards = json::array({shards[0], shards[3]});
  write_text(dir + "/index.json", index.dump());
  CheckpointReader partial(dir);
  expect_same(partial.read("weight", make_box({0, 0}, {5, 8})), box_slice(m.weight, make_box({0, 0}, {5, 8})));
  expect_error(dir, "tensor 'weight': elements [5:6, 1:3] are in no shard",
               [&] { partial.read("weight", make_box({4, 1}, {6, 3})); });
  // An index key that the shard file does not hold (its box changed alike:
  // a key that is not the entry's own box is refused with the index).
  shards[0]["key"] = "weight@0:3,0:7";
  shards[0]["box"] = {{0, 3}, {0, 7}};
  write_text(dir + "/index.json", index.dump());
  expect_error(dir, "shard file 'step-00000005-rank-00000.safetensors' has no key 'weight@0:3,0:7'",
               [&] { CheckpointReader(dir).read("weight", make_box({0, 0}, {1, 1})); });
}

TEST(Checkpoint, WriteErrors) {
  const std::string dir = fresh_dir("write_errors");
  const NDArray w = global_tensor({4, 4}, 0.f);
  auto write = [&](std::vector<CheckpointShard> shards) { write_checkpoint_shards(dir, 1, 0, shards); };
  expect_error(dir, "rank 0: tensor 'w': box [0:5, 0:4] does not fit the global shape [4, 4]",
               [&] { write({CheckpointShard{"w", {4, 4}, make_box({0, 0}, {5, 4}), w}}); });
  expect_error(dir, "rank 0: tensor 'w': the data has shape [4, 4] but box [0:2, 0:4] has shape [2, 4]",
               [&] { write({CheckpointShard{"w", {4, 4}, make_box({0, 0}, {2, 4}), w}}); });
  expect_error(dir, "rank 0: tensor 'w': box [0:2, 0:4] is given twice", [&] {
    write({shard_of("w", w, make_box({0, 0}, {2, 4})), shard_of("w", w, make_box({0, 0}, {2, 4}))});
  });
  expect_error(dir, "rank 0: tensor 'w': shape mismatch between shards", [&] {
    write({shard_of("w", w, make_box({0, 0}, {2, 4})),
           CheckpointShard{"w", {8, 4}, make_box({2, 0}, {4, 4}), box_slice(w, make_box({2, 0}, {4, 4}))}});
  });
  expect_error(dir, "rank 0: tensor 'w': the data is an empty (invalid) array",
               [&] { write({CheckpointShard{"w", {4, 4}, whole({4, 4}), NDArray()}}); });
  expect_error(dir, "rank 0: a shard has an empty tensor name",
               [&] { write({CheckpointShard{"", {4, 4}, whole({4, 4}), w}}); });
  expect_error(dir, "step -1 is negative", [&] { write_checkpoint_shards(dir, -1, 0, {}); });
  save(dir, 1, {{shard_of("w", w, whole({4, 4}))}});
  expect_error(dir, "step 1 is the committed checkpoint; a new checkpoint needs another step",
               [&] { write({shard_of("w", w, whole({4, 4}))}); });
}

TEST(Checkpoint, CommitErrorsKeepPreviousCheckpoint) {
  const std::string dir = fresh_dir("commit_errors");
  const NDArray w = global_tensor({4, 4}, 0.f);
  save(dir, 1, {{shard_of("w", w, whole({4, 4}))}});
  const NDArray w2 = global_tensor({4, 4}, 50.f);
  write_checkpoint_shards(dir, 2, 0, {shard_of("w", w2, make_box({0, 0}, {2, 4}))});
  expect_error(dir, "part index 'step-00000002-rank-00001.json' of rank 1 for step 2 missing",
               [&] { commit_checkpoint(dir, 2, 2, {}); });
  expect_error(dir, "tensor 'w': elements [2:4, 0:4] are in no shard", [&] { commit_checkpoint(dir, 2, 1, {}); });
  write_checkpoint_shards(dir, 2, 1, {CheckpointShard{"w", {5, 4}, make_box({2, 0}, {4, 4}), box_slice(w2, make_box({2, 0}, {4, 4}))}});
  expect_error(dir, "tensor 'w': shape mismatch: [4, 4] F32 on rank 0 but [5, 4] F32 on rank 1",
               [&] { commit_checkpoint(dir, 2, 2, {}); });
  write_checkpoint_shards(dir, 2, 1, {shard_of("w", w2, make_box({2, 0}, {4, 4}))});
  fs::remove(dir + "/step-00000002-rank-00001.safetensors");
  expect_error(dir, "shard file 'step-00000002-rank-00001.safetensors' missing", [&] { commit_checkpoint(dir, 2, 2, {}); });
  write_text(dir + "/step-00000002-rank-00001.json", "[]");
  expect_error(dir, "malformed part index 'step-00000002-rank-00001.json': the document is not a JSON object",
               [&] { commit_checkpoint(dir, 2, 2, {}); });
  expect_error(dir, "world size 0 is not positive", [&] { commit_checkpoint(dir, 2, 0, {}); });
  // Every failed commit left step 1 in place.
  CheckpointReader reader(dir);
  EXPECT_EQ(reader.index().step, 1);
  expect_same(reader.read("w", whole({4, 4})), w);
}

}  // namespace
}  // namespace hspmd
