// Fuzz target: a safetensors file (header and data).
#include "fuzz/fuzz_util.h"
#include "hspmd/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace hspmd;
  const std::string path = fuzz::scratch_file(data, size, ".safetensors");
  return fuzz::expect_only_hspmd_errors([&] { load_safetensors(path); });
}
