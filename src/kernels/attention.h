// Attention kernels: causal grouped-query attention, flash-attention style.
//
// Layout: q [B, S, Hq, D], k and v [B, S, Hkv, D], f32, contiguous; query
// head h reads kv head h / (Hq / Hkv). Scores are q·k * scale; token i of a
// row attends to keys j <= i of its own document. `cu_seqlens` (i32 [n+1],
// or an invalid NDArray for one document per row) holds cumulative document
// lengths over the flattened B*S tokens. See docs/attention.md.
#pragma once

#include <cstdint>

#include "hspmd/core/ndarray.h"

namespace hspmd::kernels {

// Rows per tile of the attention kernels. Results do not depend on them
// beyond float rounding.
struct AttentionTiles {
  int64_t q = 64;  // query rows per tile
  int64_t k = 64;  // key rows per tile
};

// The tiles the attention ops use. set_attention_tiles changes them for the
// whole process (tests shrink them to exercise many tiles); call it only while
// no attention kernel runs. Throws hspmd::Error unless both sizes are >= 1.
AttentionTiles attention_tiles();
void set_attention_tiles(AttentionTiles tiles);

// Forward: writes out [B, S, Hq, D] and the log-sum-exp of each row's scaled
// scores, lse [B, Hq, S]. Throws hspmd::Error "[attention] cu_seqlens: ..."
// when cu_seqlens breaks its contract (first offset 0, nondecreasing, last
// offset B*S, every multiple of S an offset).
void attention_forward(const NDArray& q, const NDArray& k, const NDArray& v,
                       const NDArray& cu_seqlens, float scale, NDArray& out, NDArray& lse,
                       AttentionTiles tiles);

// Backward: from the forward's out and lse and the gradient of out, writes
// dq, dk, dv (shapes of q, k, v; fully overwritten). Throws like the forward.
void attention_backward(const NDArray& q, const NDArray& k, const NDArray& v, const NDArray& out,
                        const NDArray& lse, const NDArray& grad_out, const NDArray& cu_seqlens,
                        float scale, NDArray& dq, NDArray& dk, NDArray& dv,
                        AttentionTiles tiles);

}  // namespace hspmd::kernels
