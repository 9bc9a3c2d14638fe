// The host side of the CPU attention kernels, compiled once (not per CPU
// variant): the tile sizes every variant reads, and the window rules of a
// context-parallel attention block.
#include <algorithm>
#include <atomic>
#include <vector>

#include "hspmd/core/error.h"
#include "kernels/attention.h"
#include "kernels/cpu/cpu.h"

namespace hspmd::kernels {

namespace {

std::atomic<int64_t> g_tile_q{64};
std::atomic<int64_t> g_tile_k{64};

}  // namespace

AttentionTiles attention_tiles() { return {g_tile_q.load(), g_tile_k.load()}; }

void set_attention_tiles(AttentionTiles tiles) {
  if (tiles.q < 1 || tiles.k < 1)
    fail("[attention] tile sizes must be >= 1, got q=", tiles.q, " k=", tiles.k);
  g_tile_q = tiles.q;
  g_tile_k = tiles.k;
}

std::vector<int32_t> cpu::windowed_starts(const AttentionBlock& blk) {
  if (blk.window < 0) fail("[attention] window: must be >= 0 (0: no window), got ", blk.window);
  std::vector<int32_t> start(blk.q_start.begin(), blk.q_start.end());
  const int64_t Sq = static_cast<int64_t>(blk.q_index.size());
  if (blk.window > 0 && Sq > 0)
    for (size_t t = 0; t < start.size(); ++t)
      start[t] = static_cast<int32_t>(
          std::max<int64_t>(start[t], blk.q_index[t % Sq] - blk.window + 1));
  return start;
}

bool attention_block_hidden(const AttentionBlock& blk) {
  HSPMD_CHECK(blk.q_index.empty() || blk.q_start.size() % blk.q_index.size() == 0,
              "attention block: starts");
  std::vector<int64_t> keys(blk.k_index.begin(), blk.k_index.end());
  std::sort(keys.begin(), keys.end());
  const std::vector<int32_t> start = cpu::windowed_starts(blk);
  const size_t Sq = blk.q_index.size();
  for (size_t t = 0; t < start.size(); ++t) {
    const int64_t hi = blk.q_index[t % Sq];
    const auto first = std::lower_bound(keys.begin(), keys.end(), int64_t{start[t]});
    if (first != keys.end() && *first <= hi) return false;  // query t sees key *first
  }
  return true;
}

}  // namespace hspmd::kernels
