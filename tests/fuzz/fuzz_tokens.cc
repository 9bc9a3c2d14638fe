// Fuzz target: a token file (little-endian uint32 ids), loaded, sampled and packed.
#include <vector>

#include "fuzz/fuzz_util.h"
#include "hspmd/data/token_data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace hspmd;
  const std::string path = fuzz::scratch_file(data, size, ".bin");
  return fuzz::expect_only_hspmd_errors([&] {
    const TokenData tokens = TokenData::load(path, 512);
    constexpr int64_t kSeq = 8;
    std::vector<int32_t> in(kSeq), out(kSeq), pos(kSeq);
    if (tokens.size() > kSeq) tokens.sample(3, kSeq, in.data(), out.data());
    const PackedDocuments packed(tokens, kSeq, 0);
    for (int64_t i = 0; i < 3; ++i) packed.sample(i, kSeq, in.data(), out.data(), pos.data());
  });
}
