// Pieces shared by the CPU attention kernels (attention.cc: whole sequences;
// attention_block.cc: one block of context-parallel attention): the sgemm
// call, row masking, the online-softmax step, the k / v transposition, and
// the bf16 operands of the bf16 tile products.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "bf16_pairs.h"
#include "hspmd/core/dtype.h"
#include "hspmd/core/ndarray.h"
#include "kernels/attention.h"
#include "vec_math.h"

#ifndef HSPMD_CPU_VARIANT
#error "attention_tile.h: include it after kernels/cpu/variant.h, in a CPU variant's source"
#endif

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT::attention_tile {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Below this many score multiply-adds a call runs on one thread: waking the
// team would cost more than it saves.
constexpr int64_t kParallelWork = int64_t{1} << 22;

inline void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                  int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta,
              c, static_cast<int>(ldc));
}

// Masks the scores of one query row outside its allowed keys [lo, hi) (key
// indices relative to the tile's first key).
inline void mask_row(float* row, int64_t nk, int64_t lo, int64_t hi) {
  std::fill(row, row + std::clamp<int64_t>(lo, 0, nk), kNegInf);
  std::fill(row + std::clamp<int64_t>(hi, 0, nk), row + nk, kNegInf);
}

// Online softmax step of one row: turns scores into exp(s - m_new), updates
// the running max m and sum l, and returns the factor for the row's output.
// On the variant's explicit vectors (vec_math.h): GCC vectorizes the same
// loop written with exp_scalar under `omp simd` for AVX-512 but runs it
// scalar for AVX2 (the attention forward took 1.8x the AVX-512 time).
inline float softmax_update(float* row, int64_t nk, float& m, float& l) {
  const float m_new = std::max(m, vec::row_max(row, nk));
  if (m_new == kNegInf) {  // nothing visible yet in this row
    std::fill(row, row + nk, 0.0f);
    return 1.0f;
  }
  const float sum = vec::exp_shift_sum(row, nk, m_new);
  const float corr = vec::exp_scalar(m - m_new);
  l = l * corr + sum;
  m = m_new;
  return corr;
}

// P = exp(s - lse) over one row of scores (0 where masked).
inline void probs_row(float* row, int64_t nk, float lse) { vec::exp_scale(row, nk, lse, 1.0f, row); }

// [B, S, H, D] -> [B, H, D, S], so that Q K^T is a plain product.
inline std::vector<float> heads_transposed(const NDArray& a, bool parallel) {
  const int64_t B = a.dim(0), S = a.dim(1), H = a.dim(2), D = a.dim(3);
  std::vector<float> t(a.numel());
  const float* src = a.data<float>();
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t j = 0; j < S; ++j)
      for (int64_t d = 0; d < D; ++d)
        t[(bh * D + d) * S + j] = src[((bh / H * S + j) * H + bh % H) * D + d];
  return t;
}

// ---- bf16 tile products (bf16_pairs.h) ----
//
// With bf16 products every tile product multiplies bf16 operands and sums in
// f32; scores, softmax, lse and the accumulated outputs and gradients stay
// f32. Operands are packed once per call, in four layouts:
//  * rows: q, dO as the left operand of Q K^T and dO V^T;
//  * pairs over d: k, v as the right operand of those;
//  * pairs over the sequence: v, k as the right operand of P V and dS K;
//  * columns: q, dO transposed, the left operand of dK^T = Q^T dS and
//    dV^T = dO^T P (the backward builds dK, dV transposed per key tile, so
//    no tile is ever transposed; the tile's P and dS are only converted).
// A sequence is cut into segments, the kernel's tiles; each starts at an even
// padded offset, so a tile's pairs never straddle two tiles, and odd lengths
// are padded with zeros.

inline int64_t even(int64_t x) { return (x + 1) / 2 * 2; }

struct Segments {
  std::vector<int64_t> begin, off;  // first row, padded offset of each segment
  int64_t padded = 0;               // padded length (even)
  void add(int64_t first, int64_t size) {
    begin.push_back(first);
    off.push_back(padded);
    padded += even(size);
  }
  int64_t count() const { return static_cast<int64_t>(begin.size()); }
};

// [0, S) in tiles of `tile` rows.
inline Segments grid_segments(int64_t S, int64_t tile) {
  Segments s;
  for (int64_t b = 0; b < S; b += tile) s.add(b, std::min(tile, S - b));
  return s;
}

// Rows: [B, S, H, D] f32 -> [B, S, H, even(D)] bf16, zero padded. The
// other layouts are made from these rows (16- and 32-bit moves only).
inline std::vector<uint16_t> rows_bf16(const float* src, int64_t B, int64_t S, int64_t H,
                                       int64_t D, bool parallel) {
  const int64_t Dp = even(D), rows = B * S * H, chunk = 256;
  std::vector<uint16_t> out(rows * Dp);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < rows; r += chunk)
    bf16_tile_rows(src + r * D, std::min(chunk, rows - r), D, D, out.data() + r * Dp, Dp);
  return out;
}

// Offset of row j of head bh = (b, h) in rows [B, S, H, Dp].
inline int64_t row_at(int64_t bh, int64_t j, int64_t S, int64_t H, int64_t Dp) {
  return ((bh / H * S + j) * H + bh % H) * Dp;
}

// Pairs over d: per head bh, even(D) / 2 pair rows of S pairs (values d and
// d + 1 of row j), from pairs_d_at(bh, S, D); pair-row stride 2 S, key j0
// at + 2 j0. A 32-bit transpose of the rows.
inline int64_t pairs_d_at(int64_t bh, int64_t S, int64_t D) { return bh * even(D) * S; }
inline std::vector<uint16_t> pairs_over_d(const std::vector<uint16_t>& rows, int64_t B, int64_t S,
                                          int64_t H, int64_t D, bool parallel) {
  const int64_t Dp = even(D);
  std::vector<uint16_t> out(B * H * Dp * S);
  const uint16_t* in = rows.data();
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t dp = 0; dp < Dp / 2; ++dp) {
      uint16_t* o = out.data() + pairs_d_at(bh, S, D) + dp * 2 * S;
      for (int64_t j = 0; j < S; ++j)  // one (d, d + 1) pair: 32 bits
        std::memcpy(o + 2 * j, in + row_at(bh, j, S, H, Dp) + 2 * dp, 2 * sizeof(uint16_t));
    }
  return out;
}

// Padded index of row j of segment t.
inline int64_t padded_row(const Segments& seg, int64_t t, int64_t j) {
  return seg.off[t] + j - seg.begin[t];
}
inline int64_t segment_end(const Segments& seg, int64_t t, int64_t S) {
  return t + 1 < seg.count() ? seg.begin[t + 1] : S;
}

// Pairs over the sequence: per head bh, seg.padded / 2 pair rows of D pairs
// (padded rows jp and jp + 1); segment t starts at pairs_s_at(bh, seg, D, t),
// pair-row stride 2 D.
inline int64_t pairs_s_at(int64_t bh, const Segments& seg, int64_t D, int64_t t) {
  return (bh * seg.padded + seg.off[t]) * D;
}
inline std::vector<uint16_t> pairs_over_s(const std::vector<uint16_t>& rows, int64_t B, int64_t S,
                                          int64_t H, int64_t D, const Segments& seg,
                                          bool parallel) {
  const int64_t Dp = even(D);
  std::vector<uint16_t> out(B * H * seg.padded * D, 0);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t t = 0; t < seg.count(); ++t)
      for (int64_t j = seg.begin[t]; j < segment_end(seg, t, S); ++j) {
        const int64_t jp = padded_row(seg, t, j);
        const uint16_t* row = rows.data() + row_at(bh, j, S, H, Dp);
        uint16_t* o = out.data() + (bh * seg.padded + jp / 2 * 2) * D + jp % 2;
        for (int64_t d = 0; d < D; ++d) o[2 * d] = row[d];
      }
  return out;
}

// Columns: per head bh, D rows of seg.padded values; segment t of row d at
// columns_at(bh, seg, D, t) + d * seg.padded. A 16-bit transpose of the rows.
inline int64_t columns_at(int64_t bh, const Segments& seg, int64_t D, int64_t t) {
  return bh * D * seg.padded + seg.off[t];
}
inline std::vector<uint16_t> columns_bf16(const std::vector<uint16_t>& rows, int64_t B, int64_t S,
                                          int64_t H, int64_t D, const Segments& seg,
                                          bool parallel) {
  const int64_t Dp = even(D);
  std::vector<uint16_t> out(B * H * D * seg.padded, 0);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t t = 0; t < seg.count(); ++t) {
        uint16_t* o = out.data() + columns_at(bh, seg, D, t) + d * seg.padded - seg.begin[t];
        for (int64_t j = seg.begin[t]; j < segment_end(seg, t, S); ++j)
          o[j] = rows[row_at(bh, j, S, H, Dp) + d];
      }
  return out;
}

// The same tile as pairs over its rows, the right operand of a product over
// its rows: pair row p (stride 2 n) holds rows 2p and 2p + 1 (0 past m).
inline void tile_row_pairs(const float* s, int64_t m, int64_t n, int64_t ld, uint16_t* out) {
  for (int64_t p = 0; p < even(m) / 2; ++p)
    bf16_row_pairs(s + 2 * p * ld, 2 * p + 1 < m ? s + (2 * p + 1) * ld : nullptr, n,
                   out + 2 * p * n);
}

// One thread's backward tiles: P and dS [queries, keys]; with bf16
// products also P and dS as pairs over their rows, dS as rows, and dK^T,
// dV^T [D, keys] of the current key tile.
struct BackwardScratch {
  std::vector<float> p, ds;
  std::vector<uint16_t> p_pairs, ds_pairs, ds_rows;
  std::vector<float> dkt, dvt;
  BackwardScratch(const AttentionTiles& t, int64_t D, bool bf16) : p(t.q * t.k), ds(t.q * t.k) {
    if (!bf16) return;
    p_pairs.resize(even(t.q) * t.k), ds_pairs.resize(even(t.q) * t.k);
    ds_rows.resize(t.q * even(t.k)), dkt.resize(D * t.k), dvt.resize(D * t.k);
  }
};

// Adds a key tile's dK^T, dV^T ([D, n], row stride ld) to its n rows of dk,
// dv (row stride ldk; the first at dk, dv).
inline void add_transposed(const float* dkt, const float* dvt, int64_t ld, int64_t n, int64_t D,
                           float* dk, float* dv, int64_t ldk) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) {
      dk[j * ldk + d] += dkt[d * ld + j];
      dv[j * ldk + d] += dvt[d * ld + j];
    }
}

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT::attention_tile
