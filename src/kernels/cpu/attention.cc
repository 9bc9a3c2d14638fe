// CPU attention: flash-attention tiles of OpenBLAS sgemm with an online
// softmax. Tiles that the causal / document mask hides entirely are never
// computed; no S x S matrix is ever materialized.
#include "kernels/attention.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "hspmd/core/error.h"
#include "kernels/kernels.h"

namespace hspmd::kernels {

namespace {

std::atomic<int64_t> g_tile_q{64};
std::atomic<int64_t> g_tile_k{64};

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Below this many score-tile multiply-adds a call runs on one thread: waking
// the team would cost more than it saves.
constexpr int64_t kParallelWork = int64_t{1} << 22;

// The problem's sizes and read-only inputs, shared by all tiles.
struct Problem {
  int64_t B, S, Hq, Hkv, D, G;
  const float* q;
  const float* k;
  const float* v;
  const int32_t* start;  // [B*S]: position in its row where each token's document starts
  float scale;
  AttentionTiles tiles;
  int64_t ldq() const { return Hq * D; }
  int64_t ldk() const { return Hkv * D; }
  // Offsets of row i of head h (query layout) / kv head hk (kv layout) in batch b.
  int64_t q_at(int64_t b, int64_t i, int64_t h) const { return ((b * S + i) * Hq + h) * D; }
  int64_t k_at(int64_t b, int64_t j, int64_t hk) const { return ((b * S + j) * Hkv + hk) * D; }
  int64_t row_at(int64_t b, int64_t h, int64_t i) const { return (b * Hq + h) * S + i; }
  bool parallel() const { return B * Hq * S * S * D > kParallelWork; }
};

// exp(x) for x <= 88 (Cephes expf, ~1e-7 relative error), branch-free so the
// loops calling it vectorize; exactly 0 below -87 (so exp(-inf) = 0).
inline float exp_approx(float x) {
  const float xc = std::max(x, -87.0f);
  const float rn = xc * 1.44269504088896341f + 12582912.0f;  // + 1.5 * 2^23 rounds to int
  const float n = rn - 12582912.0f;
  const int32_t e = std::bit_cast<int32_t>(rn) - 0x4B400000;
  float f = xc - n * 0.693359375f;
  f = f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  const float y = p * f * f + f + 1.0f;
  const float r = std::bit_cast<float>(std::bit_cast<int32_t>(y) + (e << 23));
  return x < -87.0f ? 0.0f : r;
}

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
           const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
           int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb),
              beta, c, static_cast<int>(ldc));
}

// Validates cu_seqlens against its contract (see attention.h).
void check_cu_seqlens(const NDArray& cu, int64_t total) {
  if (cu.dtype() != DType::I32 || cu.ndim() != 1)
    fail("[attention] cu_seqlens: must be a 1-D i32 array");
  const int32_t* c = cu.data<int32_t>();
  const int64_t n = cu.numel();
  if (n < 2) fail("[attention] cu_seqlens: needs at least 2 offsets, got ", n);
  if (c[0] != 0) fail("[attention] cu_seqlens: first offset must be 0, got ", c[0]);
  for (int64_t i = 1; i < n; ++i)
    if (c[i] < c[i - 1])
      fail("[attention] cu_seqlens: offsets must be nondecreasing, cu[", i, "]=", c[i],
           " < cu[", i - 1, "]=", c[i - 1]);
  if (c[n - 1] != total)
    fail("[attention] cu_seqlens: last offset must be B*S=", total, ", got ", c[n - 1]);
}

// Per flat token, where its document starts within its row of S tokens.
std::vector<int32_t> document_starts(const NDArray& cu, int64_t B, int64_t S) {
  std::vector<int32_t> start(B * S, 0);
  if (!cu.valid()) return start;
  check_cu_seqlens(cu, B * S);
  const int32_t* c = cu.data<int32_t>();
  for (int64_t d = 0; d + 1 < cu.numel(); ++d) std::fill(start.begin() + c[d], start.begin() + c[d + 1], c[d]);
  for (int64_t b = 0; b < B; ++b)
    if (S > 0 && start[b * S] != b * S)
      fail("[attention] cu_seqlens: row boundary ", b * S, " (a multiple of S=", S,
           ") is not a document boundary");
  for (int64_t t = 0; t < B * S; ++t) start[t] -= static_cast<int32_t>(t / S * S);
  return start;
}

Problem make_problem(const NDArray& q, const NDArray& k, const NDArray& v,
                     const std::vector<int32_t>& start, float scale, AttentionTiles tiles) {
  for (const NDArray* a : {&q, &k, &v}) require_backend("attention", *a);
  HSPMD_CHECK(q.ndim() == 4 && k.ndim() == 4 && k.shape() == v.shape(), "attention: ranks");
  Problem p{q.dim(0), q.dim(1), q.dim(2), k.dim(2), q.dim(3), 1, q.data<float>(),
            k.data<float>(), v.data<float>(), start.data(), scale, tiles};
  HSPMD_CHECK(p.Hkv > 0 && p.Hq % p.Hkv == 0 && k.dim(0) == p.B && k.dim(1) == p.S &&
                  k.dim(3) == p.D && tiles.q > 0 && tiles.k > 0,
              "attention: shapes");
  p.G = p.Hq / p.Hkv;
  return p;
}

// Masks the scores of one query row outside its allowed keys [lo, hi) (key
// indices relative to the tile's first key).
inline void mask_row(float* row, int64_t nk, int64_t lo, int64_t hi) {
  std::fill(row, row + std::clamp<int64_t>(lo, 0, nk), kNegInf);
  std::fill(row + std::clamp<int64_t>(hi, 0, nk), row + nk, kNegInf);
}

// True when every (query, key) pair of the tiles is visible: no masking needed.
inline bool tile_unmasked(const Problem& p, int64_t b, int64_t i0, int64_t i1, int64_t j0,
                          int64_t j1) {
  return j1 - 1 <= i0 && j0 >= p.start[b * p.S + i1 - 1];
}

// ---- forward ----

struct ForwardScratch {
  std::vector<float> s, acc, m, l;
  ForwardScratch(const AttentionTiles& t, int64_t D)
      : s(t.q * t.k), acc(t.q * D), m(t.q), l(t.q) {}
};

// Max of a row, in 16 independent lanes so that it vectorizes.
inline float row_max(const float* row, int64_t n) {
  float lane[16];
  std::fill_n(lane, 16, kNegInf);
  int64_t c = 0;
  for (; c + 16 <= n; c += 16)
    for (int u = 0; u < 16; ++u) lane[u] = row[c + u] > lane[u] ? row[c + u] : lane[u];
  for (; c < n; ++c) lane[0] = row[c] > lane[0] ? row[c] : lane[0];
  return *std::max_element(lane, lane + 16);
}

// Online softmax step of one row: turns scores into exp(s - m_new), updates
// the running max m and sum l, and returns the factor for the row's output.
inline float softmax_update(float* row, int64_t nk, float& m, float& l) {
  const float m_new = std::max(m, row_max(row, nk));
  if (m_new == kNegInf) {  // nothing visible yet in this row
    std::fill(row, row + nk, 0.0f);
    return 1.0f;
  }
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < nk; ++c) {
    row[c] = exp_approx(row[c] - m_new);
    sum += row[c];
  }
  const float corr = exp_approx(m - m_new);
  l = l * corr + sum;
  m = m_new;
  return corr;
}

// Softmax of one score tile; rescales the accumulated output rows.
void softmax_tile(const Problem& p, int64_t b, int64_t i0, int64_t i1, int64_t j0, int64_t j1,
                  ForwardScratch& w) {
  const bool full = tile_unmasked(p, b, i0, i1, j0, j1);
  for (int64_t r = 0; r < i1 - i0; ++r) {
    float* row = w.s.data() + r * p.tiles.k;
    if (!full) mask_row(row, j1 - j0, p.start[b * p.S + i0 + r] - j0, i0 + r + 1 - j0);
    const float corr = softmax_update(row, j1 - j0, w.m[r], w.l[r]);
    if (corr == 1.0f) continue;
    float* acc = w.acc.data() + r * p.D;
    for (int64_t d = 0; d < p.D; ++d) acc[d] *= corr;
  }
}

// Output rows [i0, i1) of query head h in batch b.
void forward_tile(const Problem& p, int64_t b, int64_t h, int64_t i0, int64_t i1, float* out,
                  float* lse, ForwardScratch& w) {
  const int64_t mq = i1 - i0, hk = h / p.G, D = p.D;
  const float* qt = p.q + p.q_at(b, i0, h);
  std::fill_n(w.m.data(), mq, kNegInf);
  std::fill_n(w.l.data(), mq, 0.0f);
  std::fill_n(w.acc.data(), mq * D, 0.0f);
  for (int64_t j0 = p.start[b * p.S + i0]; j0 < i1; j0 += p.tiles.k) {
    const int64_t j1 = std::min(j0 + p.tiles.k, i1);
    sgemm(false, true, mq, j1 - j0, D, p.scale, qt, p.ldq(), p.k + p.k_at(b, j0, hk), p.ldk(),
          0.0f, w.s.data(), p.tiles.k);
    softmax_tile(p, b, i0, i1, j0, j1, w);
    sgemm(false, false, mq, D, j1 - j0, 1.0f, w.s.data(), p.tiles.k, p.v + p.k_at(b, j0, hk),
          p.ldk(), 1.0f, w.acc.data(), D);
  }
  for (int64_t r = 0; r < mq; ++r) {
    const float inv = 1.0f / w.l[r];
    float* o = out + p.q_at(b, i0 + r, h);
    for (int64_t d = 0; d < D; ++d) o[d] = w.acc[r * D + d] * inv;
    lse[p.row_at(b, h, i0 + r)] = w.m[r] + std::log(w.l[r]);
  }
}

// ---- backward ----

struct Grads {
  const float* out;
  const float* lse;
  const float* dout;
  const float* delta;  // [B, Hq, S]: rowsum(dO * O)
  float* dq;
  float* dk;
  float* dv;
};

// The backward works on transposed tiles [keys, queries] so that all but one
// product are plain (non-transposed) sgemms, OpenBLAS's fast small-matrix path.
struct BackwardScratch {
  std::vector<float> pt, dst, ds;  // P^T, dS^T [keys, queries]; dS [queries, keys]
  explicit BackwardScratch(const AttentionTiles& t)
      : pt(t.k * t.q), dst(t.k * t.q), ds(t.q * t.k) {}
};

// P^T = exp(scale * K Q^T - lse) of one tile, 0 where masked.
void recompute_probs_t(const Problem& p, const Grads& g, int64_t b, int64_t h, int64_t i0,
                       int64_t i1, int64_t j0, int64_t j1, float* pt) {
  const int64_t hk = h / p.G, tq = p.tiles.q, mq = i1 - i0;
  sgemm(false, true, j1 - j0, mq, p.D, p.scale, p.k + p.k_at(b, j0, hk), p.ldk(),
        p.q + p.q_at(b, i0, h), p.ldq(), 0.0f, pt, tq);
  const bool full = tile_unmasked(p, b, i0, i1, j0, j1);
  const float* lse = g.lse + p.row_at(b, h, i0);
  const int32_t* start = p.start + b * p.S + i0;
  for (int64_t r = 0; r < j1 - j0; ++r) {
    float* row = pt + r * tq;
    const int64_t j = j0 + r;
    if (full) {
#pragma omp simd
      for (int64_t c = 0; c < mq; ++c) row[c] = exp_approx(row[c] - lse[c]);
      continue;
    }
#pragma omp simd
    for (int64_t c = 0; c < mq; ++c) {
      const bool visible = i0 + c >= j && start[c] <= j;
      row[c] = visible ? exp_approx(row[c] - lse[c]) : 0.0f;
    }
  }
}

// dS^T = P^T * (dP^T - delta), in place over dP^T.
void softmax_grad_t(const float* pt, const float* delta, int64_t nk, int64_t mq, int64_t ld,
                    float* dst) {
  for (int64_t r = 0; r < nk; ++r) {
    const float* pr = pt + r * ld;
    float* dr = dst + r * ld;
#pragma omp simd
    for (int64_t c = 0; c < mq; ++c) dr[c] = pr[c] * (dr[c] - delta[c]);
  }
}

// b[c][r] = a[r][c] for an n x m matrix a, in 8 x 8 blocks.
void transpose(const float* a, int64_t n, int64_t m, int64_t lda, float* b, int64_t ldb) {
  for (int64_t r0 = 0; r0 < n; r0 += 8)
    for (int64_t c0 = 0; c0 < m; c0 += 8)
      for (int64_t c = c0; c < std::min(c0 + 8, m); ++c)
        for (int64_t r = r0; r < std::min(r0 + 8, n); ++r) b[c * ldb + r] = a[r * lda + c];
}

// Adds one (query tile, key tile) pair's contributions to dq, dk, dv.
void backward_pair(const Problem& p, const Grads& g, int64_t b, int64_t h, int64_t i0,
                   int64_t i1, int64_t j0, int64_t j1, BackwardScratch& w) {
  const int64_t hk = h / p.G, tq = p.tiles.q, mq = i1 - i0, nk = j1 - j0, D = p.D;
  const int64_t qo = p.q_at(b, i0, h), ko = p.k_at(b, j0, hk);
  recompute_probs_t(p, g, b, h, i0, i1, j0, j1, w.pt.data());
  sgemm(false, false, nk, D, mq, 1.0f, w.pt.data(), tq, g.dout + qo, p.ldq(), 1.0f, g.dv + ko,
        p.ldk());
  sgemm(false, true, nk, mq, D, 1.0f, p.v + ko, p.ldk(), g.dout + qo, p.ldq(), 0.0f,
        w.dst.data(), tq);
  softmax_grad_t(w.pt.data(), g.delta + p.row_at(b, h, i0), nk, mq, tq, w.dst.data());
  sgemm(false, false, nk, D, mq, p.scale, w.dst.data(), tq, p.q + qo, p.ldq(), 1.0f,
        g.dk + ko, p.ldk());
  transpose(w.dst.data(), nk, mq, tq, w.ds.data(), p.tiles.k);
  sgemm(false, false, mq, D, nk, p.scale, w.ds.data(), p.tiles.k, p.k + ko, p.ldk(), 1.0f,
        g.dq + qo, p.ldq());
}

// All gradients touching kv head hk of batch b: its dk, dv rows and the dq
// rows of its query heads, so no other thread writes them.
void backward_group(const Problem& p, const Grads& g, int64_t b, int64_t hk,
                    BackwardScratch& w) {
  const int64_t tq = p.tiles.q, tk = p.tiles.k;
  for (int64_t j0 = 0; j0 < p.S; j0 += tk) {
    const int64_t j1 = std::min(j0 + tk, p.S);
    for (int64_t h = hk * p.G; h < (hk + 1) * p.G; ++h) {
      for (int64_t i0 = j0 / tq * tq; i0 < p.S; i0 += tq) {
        // Rows from max(i0, j0) on see keys >= j0; their documents start no earlier.
        if (p.start[b * p.S + std::max(i0, j0)] >= j1) break;
        backward_pair(p, g, b, h, i0, std::min(i0 + tq, p.S), j0, j1, w);
      }
    }
  }
}

// delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d].
void row_dots(const Problem& p, const float* out, const float* dout, float* delta) {
  const int64_t rows = p.B * p.S * p.Hq;
#pragma omp parallel for schedule(static) if (p.parallel())
  for (int64_t t = 0; t < rows; ++t) {
    const float* o = out + t * p.D;
    const float* d = dout + t * p.D;
    float s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t e = 0; e < p.D; ++e) s += o[e] * d[e];
    const int64_t h = t % p.Hq, bi = t / p.Hq;
    delta[p.row_at(bi / p.S, h, bi % p.S)] = s;
  }
}

}  // namespace

AttentionTiles attention_tiles() { return {g_tile_q.load(), g_tile_k.load()}; }

void set_attention_tiles(AttentionTiles tiles) {
  if (tiles.q < 1 || tiles.k < 1)
    fail("[attention] tile sizes must be >= 1, got q=", tiles.q, " k=", tiles.k);
  g_tile_q = tiles.q;
  g_tile_k = tiles.k;
}

void attention_forward(const NDArray& q, const NDArray& k, const NDArray& v,
                       const NDArray& cu_seqlens, float scale, NDArray& out, NDArray& lse,
                       AttentionTiles tiles) {
  const std::vector<int32_t> start = document_starts(cu_seqlens, q.dim(0), q.dim(1));
  const Problem p = make_problem(q, k, v, start, scale, tiles);
  HSPMD_CHECK(out.shape() == q.shape() && lse.numel() == p.B * p.Hq * p.S, "attention: outputs");
  float* po = out.data<float>();
  float* pl = lse.data<float>();
  const int64_t ntiles = (p.S + tiles.q - 1) / tiles.q, items = p.B * p.Hq * ntiles;
#pragma omp parallel if (p.parallel())
  {
    ForwardScratch w(tiles, p.D);
#pragma omp for schedule(dynamic)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t t = ntiles - 1 - it % ntiles, bh = it / ntiles;  // long tiles first
      const int64_t i0 = t * tiles.q;
      forward_tile(p, bh / p.Hq, bh % p.Hq, i0, std::min(i0 + tiles.q, p.S), po, pl, w);
    }
  }
}

void attention_backward(const NDArray& q, const NDArray& k, const NDArray& v, const NDArray& out,
                        const NDArray& lse, const NDArray& grad_out, const NDArray& cu_seqlens,
                        float scale, NDArray& dq, NDArray& dk, NDArray& dv,
                        AttentionTiles tiles) {
  const std::vector<int32_t> start = document_starts(cu_seqlens, q.dim(0), q.dim(1));
  const Problem p = make_problem(q, k, v, start, scale, tiles);
  HSPMD_CHECK(out.shape() == q.shape() && grad_out.shape() == q.shape() &&
                  lse.numel() == p.B * p.Hq * p.S && dq.shape() == q.shape() &&
                  dk.shape() == k.shape() && dv.shape() == v.shape(),
              "attention_grad: shapes");
  std::vector<float> delta(p.B * p.Hq * p.S);
  row_dots(p, out.data<float>(), grad_out.data<float>(), delta.data());
  for (NDArray* a : {&dq, &dk, &dv}) a->fill(0.0f);
  const Grads g{out.data<float>(), lse.data<float>(), grad_out.data<float>(), delta.data(),
                dq.data<float>(),  dk.data<float>(),  dv.data<float>()};
#pragma omp parallel if (p.parallel())
  {
    BackwardScratch w(tiles);
#pragma omp for schedule(dynamic)
    for (int64_t it = 0; it < p.B * p.Hkv; ++it) backward_group(p, g, it / p.Hkv, it % p.Hkv, w);
  }
}

}  // namespace hspmd::kernels
