// Fuzz target: a checkpoint's index.json, read beside a real shard file
// (tests/fuzz/checkpoint_shards/: the micro model of corpus/checkpoint_index,
// one step), and every tensor the index names read back in full: the index
// checks (format, meta, keys, boxes, checksums) and the shard assembly.
#include <filesystem>
#include <system_error>

#include "fuzz/fuzz_util.h"
#include "hspmd/io/checkpoint.h"

#ifndef HSPMD_FUZZ_CHECKPOINT_SHARDS
#error "HSPMD_FUZZ_CHECKPOINT_SHARDS (the shard files' folder) must be defined"
#endif

namespace {

// A per-process checkpoint folder holding the shard files; the input becomes
// its index.json.
const std::string& checkpoint_dir() {
  static const std::string dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    const std::filesystem::path d =
        std::filesystem::path(tmp && *tmp ? tmp : "/tmp") / ("hspmd_fuzz_ckpt_" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    for (const auto& e : std::filesystem::directory_iterator(HSPMD_FUZZ_CHECKPOINT_SHARDS))
      std::filesystem::copy_file(e.path(), d / e.path().filename(),
                                 std::filesystem::copy_options::overwrite_existing);
    return d.string();
  }();
  struct RemoveAtExit {
    ~RemoveAtExit() {
      std::error_code ec;
      std::filesystem::remove_all(checkpoint_dir(), ec);
    }
  };
  static RemoveAtExit cleanup;
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace hspmd;
  const std::string dir = checkpoint_dir();
  {
    std::ofstream out(dir + "/index.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  return fuzz::expect_only_hspmd_errors([&] {
    CheckpointReader reader(dir);
    for (const auto& [name, t] : reader.index().tensors) {
      Box whole;
      for (int64_t d : t.shape) {
        whole.begin.push_back(0);
        whole.end.push_back(d);
      }
      if (whole.numel() <= (int64_t{1} << 22)) reader.read(name, whole);  // a corrupt shape may be huge
    }
  });
}
