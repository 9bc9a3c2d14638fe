// Attention kernels: causal grouped-query attention, flash-attention style.
//
// Layout: q [B, S, Hq, D], k and v [B, S, Hkv, D], f32, contiguous; query
// head h reads kv head h / (Hq / Hkv). Scores are q·k * scale; query i of a
// row attends to keys start(i) <= j <= i, where start(i) is where its
// document begins. `documents` gives the documents (see docs/attention.md):
//  * an invalid NDArray: one document per row (start = 0);
//  * i32 [n+1] cu_seqlens: cumulative document lengths over the flattened
//    B*S tokens;
//  * i32 [B, S] positions: each token's position in its own document, so
//    start(i) = max(0, i - positions[i]).
// A sliding window W > 0 (Mistral's `sliding_window`) raises every start to
// at least i - W + 1: query i sees keys max(start(i), i - W + 1) <= j <= i.
// W = 0 is no window. Key tiles the window hides are skipped, so the cost
// falls with W.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "hspmd/core/device.h"
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

// Per token of positions [B, S] (i32, on the stream's device), the sequence
// index where its document starts, max(0, first + i - positions[b, i]) for
// column i: `first` is the global index of column 0 (nonzero for a chunk of
// a longer sequence). Returned flat, [B*S], in host memory. A host helper:
// positions on a device are read back first (kernels::to_host, a wait for
// the stream's work), then the CPU's rules run on the host copy. Throws
// hspmd::Error "[attention] document positions: ..." for a negative position
// or a positions array that is not contiguous 2-D i32.
std::vector<int32_t> document_starts_from_positions(Stream& s, const NDArray& positions, int64_t first);

// q, k and v (all alike), out and grad_out may also be bf16 (bf16 products
// only): read as their exact f32 values, a bf16 out rounded once (it may
// then be replaced by a new array); dq, dk, dv and lse are f32.
//
// Forward: writes out [B, S, Hq, D] and the log-sum-exp of each row's scaled
// scores, lse [B, Hq, S]. Throws hspmd::Error "[attention] cu_seqlens: ..."
// when cu_seqlens breaks its contract (first offset 0, nondecreasing, last
// offset B*S, every multiple of S an offset), "[attention] document
// positions: ..." for positions that are negative or not [B, S].
//
// `products` is the dtype of the tile products' operands: F32, or BF16 for
// bf16 operands with f32 sums (mixed precision; softmax, lse and the outputs
// stay f32). Both run on either CPU (bf16 without AVX512-BF16 is slower).
// `window`: the sliding window W (0: none); W < 0 throws hspmd::Error
// "[attention] window: ...".
void attention_forward(Stream& s, const NDArray& q, const NDArray& k, const NDArray& v,
                       const NDArray& documents, float scale, NDArray& out, NDArray& lse,
                       AttentionTiles tiles, DType products = DType::F32, int64_t window = 0);

// Backward: from the forward's out and lse and the gradient of out, writes
// dq, dk, dv (shapes of q, k, v; fully overwritten; f32, or bf16: the f32
// gradients rounded once, as cuDNN writes them). Throws like the forward.
void attention_backward(Stream& s, const NDArray& q, const NDArray& k, const NDArray& v,
                        const NDArray& out,
                        const NDArray& lse, const NDArray& grad_out, const NDArray& documents,
                        float scale, NDArray& dq, NDArray& dk, NDArray& dv,
                        AttentionTiles tiles, DType products = DType::F32,
                        int64_t window = 0);

// How whole-sequence attention ran on CUDA in this process (docs/cuda.md,
// "Attention on cuDNN"): the calls cuDNN's fused attention served, the
// calls with bf16 products it did not take (our much slower kernels ran
// them), and why the latest of those fell back. All zero and "" without a
// CUDA build or before any such call.
struct FusedAttentionReport {
  int64_t cudnn_calls = 0;
  int64_t fallbacks = 0;
  std::string last_fallback;
};
FusedAttentionReport fused_attention_report();

// Whether whole-sequence attention with bf16 products on `device` goes to
// cuDNN's fused attention, which writes and reads its output O in bf16: a
// CUDA device, a build with cuDNN attention, HSPMD_CUDNN_ATTENTION not 0
// (Precision::for_device then keeps O in bf16; a case cuDNN refuses at run
// time falls back, rounded and reported). False elsewhere.
bool fused_attention_rounds_output(Device device);

// ---- blocks of context-parallel (ring) attention (cpu/attention_block.cc) ----

// One (query block, key block) pair of a longer sequence. Rows carry their
// global sequence indices (the same in every batch row), so the two blocks
// may be any pieces of the sequence, e.g. two zigzag halves each. Query i
// sees key j iff q_start[b*Sq + i] <= k_index[j] <= q_index[i] and, with a
// window W > 0, q_index[i] - W < k_index[j] (global indices). Tiles never
// straddle a jump in the indices; tiles the mask hides are skipped, and only
// tiles the mask cuts are masked. The views must outlive the call.
struct AttentionBlock {
  NDArray q;                          // [B, Sq, Hq, D]
  std::span<const int64_t> q_index;   // [Sq]
  std::span<const int32_t> q_start;   // [B*Sq]: global index where each query's document starts
  NDArray k, v;                       // [B, Sk, Hkv, D]
  std::span<const int64_t> k_index;   // [Sk]
  float scale = 1.0f;
  DType products = DType::F32;        // of the tile products, as attention_forward's
  int64_t window = 0;                 // sliding window W (0: none), in global indices
};

// True when no query of the block sees any of its keys (the window or the
// causal / document mask hides them all): ring attention then skips the
// block's kernels; they would only return out 0, lse -inf (forward) and add
// nothing (backward).
bool attention_block_hidden(const AttentionBlock& blk);

// The block's attention alone: writes out_blk [B, Sq, Hq, D] and lse_blk
// [B, Hq, Sq] over this block's visible keys. A row that sees none of them
// gets out 0 and lse -inf.
void attention_block_forward(Stream& s, const AttentionBlock& blk, NDArray& out_blk,
                             NDArray& lse_blk, AttentionTiles tiles);

// Merges a block's (out_blk, lse_blk) into the running (out, lse), the
// log-sum-exp way: lse' = log(e^lse + e^lse_blk), out' = (e^lse out +
// e^lse_blk out_blk) / e^lse'. A row with lse_blk = -inf keeps its values;
// one with lse = -inf takes the block's.
void attention_merge(Stream& s, NDArray& out, NDArray& lse, const NDArray& out_blk,
                     const NDArray& lse_blk);

// delta [B, Hq, S] = rowsum(grad_out * out) of out, grad_out [B, S, Hq, D];
// bf16_grad: grad_out rounded to bf16 first, as the bf16 products of dP take
// it, so that delta and the rows of P o dP agree (their difference is dS).
void attention_row_dots(Stream& s, const NDArray& out, const NDArray& grad_out, NDArray& delta,
                        bool bf16_grad = false);

// The block's share of the backward, from the final lse and delta of the
// whole attention ([B, Hq, Sq] each) and grad_out [B, Sq, Hq, D]: adds to dq
// (shape of q) and to dk, dv (shape of k).
void attention_block_backward(Stream& s, const AttentionBlock& blk, const NDArray& grad_out,
                              const NDArray& lse, const NDArray& delta, NDArray& dq, NDArray& dk,
                              NDArray& dv, AttentionTiles tiles);

}  // namespace hspmd::kernels
