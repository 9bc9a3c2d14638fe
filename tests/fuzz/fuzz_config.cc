// Fuzz target: a model config.json (ModelConfig).
#include "fuzz/fuzz_util.h"
#include "hspmd/core/json_file.h"
#include "hspmd/models/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace hspmd;
  return fuzz::expect_only_hspmd_errors([&] {
    const ModelConfig c = ModelConfig::from_json(parse_json_text(fuzz::text_of(data, size), "config", "fuzz"), "fuzz");
    // What the config accepts must round-trip and survive the memory estimate.
    if (ModelConfig::from_json(c.to_json(), "round trip").to_json() != c.to_json()) std::abort();
    check_parameters_fit_memory(c, "fuzz");
  });
}
