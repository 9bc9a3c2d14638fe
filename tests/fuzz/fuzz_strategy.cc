// Fuzz target: a strategy JSON, parsed and validated against an 8-layer model on 8 ranks.
#include "fuzz/fuzz_util.h"
#include "hspmd/core/json_file.h"
#include "hspmd/plan/strategy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace hspmd;
  const ModelConfig tiny{.vocab_size = 256, .hidden_size = 64, .intermediate_size = 128, .num_hidden_layers = 8,
                         .num_attention_heads = 8, .num_key_value_heads = 4};
  return fuzz::expect_only_hspmd_errors([&] {
    const Strategy s = strategy_from_json(parse_json_text(fuzz::text_of(data, size), "strategy", "fuzz"));
    validate(s, tiny, 8);
    idle_ranks(s, 8);
  });
}
