// Fuzz target: an annotation plan JSON. Models above 16 layers or 4096 wide
// are skipped: reading a plan builds the model's graph, and the fuzzer should
// spend its time on the plan's rules rather than on building big graphs.
#include "fuzz/fuzz_util.h"
#include "hspmd/core/json_file.h"
#include "hspmd/models/config.h"
#include "hspmd/plan/plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace hspmd;
  return fuzz::expect_only_hspmd_errors([&] {
    const nlohmann::json j = parse_json_text(fuzz::text_of(data, size), "plan", "fuzz");
    if (j.is_object() && j.contains("model")) {
      const ModelConfig c = ModelConfig::from_json(j["model"], "fuzz");
      if (c.num_hidden_layers > 16 || c.hidden_size > 4096 || c.intermediate_size > 4096 ||
          c.table_rows() > 65536 || c.num_attention_heads > 64)
        return;
    }
    plan_from_json(j);
  });
}
