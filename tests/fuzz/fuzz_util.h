// Shared pieces of the fuzz targets (docs/reliability.md, "Fuzzing"). Each
// target defines LLVMFuzzerTestOneInput: hspmd::Error is the expected answer
// to a bad input and is swallowed; anything else (another exception, a crash,
// a sanitizer report) escapes and fails the run.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "hspmd/core/error.h"

namespace hspmd::fuzz {

inline std::string text_of(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

// A per-process scratch file holding `data`, for parsers that read paths.
inline std::string scratch_file(const uint8_t* data, size_t size, const char* suffix) {
  const char* dir = std::getenv("TMPDIR");
  const std::string path = std::string(dir && *dir ? dir : "/tmp") + "/hspmd_fuzz_" + std::to_string(::getpid()) + suffix;
  struct RemoveAtExit {
    std::string path;
    ~RemoveAtExit() { std::remove(path.c_str()); }
  };
  static RemoveAtExit scratch{path};  // one per suffix's translation unit: a target uses one
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  return path;
}

// Runs `f`, treating hspmd::Error as the expected rejection.
template <typename F>
int expect_only_hspmd_errors(F&& f) {
  try {
    f();
  } catch (const Error&) {
  }
  return 0;
}

}  // namespace hspmd::fuzz
