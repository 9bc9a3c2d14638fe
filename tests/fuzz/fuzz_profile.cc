// Fuzz target: a profile written by `hspmd profile` (the part fits, the op
// fits, the optimizer fit and the memory table), loaded as --profile does.
#include "fuzz/fuzz_util.h"
#include "hspmd/planner/profile.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace hspmd;
  const std::string path = fuzz::scratch_file(data, size, ".profile.json");
  return fuzz::expect_only_hspmd_errors([&] { Profile::load(path); });
}
