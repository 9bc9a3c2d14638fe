// Fuzz target: a cluster JSON (Topology).
#include "fuzz/fuzz_util.h"
#include "hspmd/core/json_file.h"
#include "hspmd/resolve/topology.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace hspmd;
  return fuzz::expect_only_hspmd_errors([&] {
    const Topology t = Topology::from_json(parse_json_text(fuzz::text_of(data, size), "cluster", "fuzz"));
    Topology::from_json(t.to_json());
    if (t.world_size() > 1) t.bandwidth(0, t.world_size() - 1);
  });
}
