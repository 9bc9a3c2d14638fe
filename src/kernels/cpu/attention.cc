// CPU attention over whole sequences: flash-attention tiles of OpenBLAS
// sgemm (or of bf16 products, bf16_pairs.h) with an online softmax. Tiles
// that the causal / document / sliding-window mask hides entirely are never
// computed; no S x S matrix is ever materialized. Key tiles lie on a fixed
// grid of tiles.k rows (the bf16 operands are packed per tile). A sliding
// window is folded into the starts: start(i) >= i - W + 1.
#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "hspmd/core/error.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "kernels/cpu/variant.h"

#include "attention_tile.h"

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT {

namespace {

using namespace attention_tile;

// The problem's sizes and read-only inputs, shared by all tiles.
struct Problem {
  int64_t B, S, Hq, Hkv, D, G;
  const float* q;
  const float* k;
  const float* v;
  const float* kt;  // k and v transposed to [B, Hkv, D, S], so Q K^T is a plain product
  const float* vt;
  const int32_t* start;  // [B*S]: where each token's visible keys start in its row (document, window)
  // Per query tile (b, i0 / tiles.q): the least and greatest start of its
  // rows. Starts from positions need not grow along a row.
  const int32_t* tile_min;
  const int32_t* tile_max;
  float scale;
  AttentionTiles tiles;
  int64_t window = 0;  // sliding window W (0: none); already folded into start
  // bf16 products: the packed operands (attention_tile.h), else empty.
  bool bf16 = false;
  Segments qseg, kseg;  // the query and key tiles
  const uint16_t* q_rows = nullptr;
  const uint16_t* k_d = nullptr;
  const uint16_t* v_s = nullptr;
  const uint16_t* q_cols = nullptr;  // backward
  const uint16_t* v_d = nullptr;
  const uint16_t* k_s = nullptr;
  int64_t ldq() const { return Hq * D; }
  int64_t ldk() const { return Hkv * D; }
  // Offsets of row i of head h (query layout) / kv head hk (kv layout) in batch b.
  int64_t q_at(int64_t b, int64_t i, int64_t h) const { return ((b * S + i) * Hq + h) * D; }
  int64_t k_at(int64_t b, int64_t j, int64_t hk) const { return ((b * S + j) * Hkv + hk) * D; }
  int64_t row_at(int64_t b, int64_t h, int64_t i) const { return (b * Hq + h) * S + i; }
  int64_t t_at(int64_t b, int64_t hk, int64_t j) const { return (b * Hkv + hk) * D * S + j; }
  bool parallel() const { return B * Hq * S * S * D > kParallelWork; }
  int64_t tile_of(int64_t b, int64_t i0) const {
    return b * ((S + tiles.q - 1) / tiles.q) + i0 / tiles.q;
  }
  int32_t min_start(int64_t b, int64_t i0) const { return tile_min[tile_of(b, i0)]; }
  int32_t max_start(int64_t b, int64_t i0) const { return tile_max[tile_of(b, i0)]; }
};

// Validates cu_seqlens against its contract (see attention.h).
void check_cu_seqlens(const NDArray& cu, int64_t total) {
  cpu::require_contiguous("attention", cu);
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

// Per flat token, where its document starts within its row, from cu_seqlens.
std::vector<int32_t> starts_from_cu_seqlens(const NDArray& cu, int64_t B, int64_t S) {
  std::vector<int32_t> start(B * S, 0);
  check_cu_seqlens(cu, B * S);
  const int32_t* c = cu.data<int32_t>();
  for (int64_t d = 0; d + 1 < cu.numel(); ++d)
    std::fill(start.begin() + c[d], start.begin() + c[d + 1], c[d]);
  for (int64_t b = 0; b < B; ++b)
    if (S > 0 && start[b * S] != b * S)
      fail("[attention] cu_seqlens: row boundary ", b * S, " (a multiple of S=", S,
           ") is not a document boundary");
  for (int64_t t = 0; t < B * S; ++t) start[t] -= static_cast<int32_t>(t / S * S);
  return start;
}

void check_window(int64_t window) {
  if (window < 0) fail("[attention] window: must be >= 0 (0: no window), got ", window);
}

// Where the keys of every token start (its document's start, raised to
// i - W + 1 by a window W > 0), and their range per query tile.
struct Starts {
  std::vector<int32_t> start, tile_min, tile_max;
};

Starts document_starts(const NDArray& documents, int64_t B, int64_t S, int64_t tq,
                       int64_t window) {
  Starts s;
  if (!documents.valid()) {
    s.start.assign(B * S, 0);
  } else if (documents.ndim() == 2) {
    if (documents.dim(0) != B || documents.dim(1) != S)
      fail("[attention] document positions: shape [", documents.dim(0), ", ", documents.dim(1),
           "] must be [B, S] = [", B, ", ", S, "]");
    s.start = document_starts_from_positions(documents, 0);
  } else {
    s.start = starts_from_cu_seqlens(documents, B, S);
  }
  if (window > 0)
    for (int64_t t = 0; t < B * S; ++t)
      s.start[t] = static_cast<int32_t>(std::max<int64_t>(s.start[t], t % S - window + 1));
  const int64_t ntq = (S + tq - 1) / tq;
  s.tile_min.resize(B * ntq);
  s.tile_max.resize(B * ntq);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < ntq; ++t) {
      const auto first = s.start.begin() + b * S + t * tq;
      const auto [lo, hi] = std::minmax_element(first, first + std::min(tq, S - t * tq));
      s.tile_min[b * ntq + t] = *lo;
      s.tile_max[b * ntq + t] = *hi;
    }
  return s;
}

// The problem without its derived buffers (start, kt, vt), which the caller owns.
Problem make_problem(const NDArray& q, const NDArray& k, const NDArray& v, float scale,
                     AttentionTiles tiles, DType products, int64_t window) {
  for (const NDArray* a : {&q, &k, &v}) cpu::require_contiguous("attention", *a);
  check_window(window);
  HSPMD_CHECK(q.ndim() == 4 && k.ndim() == 4 && k.shape() == v.shape(), "attention: ranks");
  Problem p{.B = q.dim(0), .S = q.dim(1), .Hq = q.dim(2), .Hkv = k.dim(2), .D = q.dim(3),
            .G = 1, .q = q.data<float>(), .k = k.data<float>(), .v = v.data<float>(),
            .kt = nullptr, .vt = nullptr, .start = nullptr, .tile_min = nullptr,
            .tile_max = nullptr, .scale = scale, .tiles = tiles, .window = window, .bf16 = false,
            .qseg = {}, .kseg = {}};
  HSPMD_CHECK(p.Hkv > 0 && p.Hq % p.Hkv == 0 && k.dim(0) == p.B && k.dim(1) == p.S &&
                  k.dim(3) == p.D && tiles.q > 0 && tiles.k > 0,
              "attention: shapes");
  p.G = p.Hq / p.Hkv;
  HSPMD_CHECK(products == DType::F32 || products == DType::BF16, "attention: products dtype");
  p.bf16 = products == DType::BF16;
  if (p.bf16) p.qseg = grid_segments(p.S, tiles.q), p.kseg = grid_segments(p.S, tiles.k);
  return p;
}

// True when every (query, key) pair of the tiles is visible: no masking needed.
inline bool tile_unmasked(const Problem& p, int64_t b, int64_t i0, int64_t j0, int64_t j1) {
  return j1 - 1 <= i0 && j0 >= p.max_start(b, i0);
}

// ---- forward ----

struct ForwardScratch {
  std::vector<float> s, acc, m, l;
  std::vector<uint16_t> s_bf16;  // P in bf16 (bf16 products)
  ForwardScratch(const AttentionTiles& t, int64_t D, bool bf16)
      : s(t.q * t.k), acc(t.q * D), m(t.q), l(t.q), s_bf16(bf16 ? t.q * even(t.k) : 0) {}
};

// Softmax of one score tile; rescales the accumulated output rows.
void softmax_tile(const Problem& p, int64_t b, int64_t i0, int64_t i1, int64_t j0, int64_t j1,
                  ForwardScratch& w) {
  const bool full = tile_unmasked(p, b, i0, j0, j1);
  for (int64_t r = 0; r < i1 - i0; ++r) {
    float* row = w.s.data() + r * p.tiles.k;
    if (!full) mask_row(row, j1 - j0, p.start[b * p.S + i0 + r] - j0, i0 + r + 1 - j0);
    const float corr = softmax_update(row, j1 - j0, w.m[r], w.l[r]);
    if (corr == 1.0f) continue;
    float* acc = w.acc.data() + r * p.D;
    for (int64_t d = 0; d < p.D; ++d) acc[d] *= corr;
  }
}

// S = scale Q K^T of rows [i0, i0 + mq) of head h and keys [j0, j0 + nk)
// into s (row stride tiles.k).
void scores(const Problem& p, int64_t b, int64_t h, int64_t i0, int64_t mq, int64_t j0,
            int64_t nk, float* s) {
  const int64_t hk = h / p.G, Dp = even(p.D);
  if (p.bf16)
    gemm_bf16_pairs(mq, nk, Dp, p.scale, p.q_rows + p.q_at(b, i0, h) / p.D * Dp, p.Hq * Dp,
                    p.k_d + pairs_d_at(b * p.Hkv + hk, p.S, p.D) + 2 * j0, 2 * p.S, 0.0f, s,
                    p.tiles.k);
  else
    sgemm(false, false, mq, nk, p.D, p.scale, p.q + p.q_at(b, i0, h), p.ldq(),
          p.kt + p.t_at(b, hk, j0), p.S, 0.0f, s, p.tiles.k);
}

// Output rows [i0, i1) of query head h in batch b.
void forward_tile(const Problem& p, int64_t b, int64_t h, int64_t i0, int64_t i1, float* out,
                  float* lse, ForwardScratch& w) {
  const int64_t mq = i1 - i0, hk = h / p.G, D = p.D, tk = p.tiles.k;
  std::fill_n(w.m.data(), mq, kNegInf);
  std::fill_n(w.l.data(), mq, 0.0f);
  std::fill_n(w.acc.data(), mq * D, 0.0f);
  for (int64_t j0 = p.min_start(b, i0) / tk * tk; j0 < i1; j0 += tk) {
    const int64_t j1 = std::min(j0 + tk, i1), nk = j1 - j0;
    scores(p, b, h, i0, mq, j0, nk, w.s.data());
    softmax_tile(p, b, i0, i1, j0, j1, w);
    if (p.bf16) {
      bf16_tile_rows(w.s.data(), mq, nk, tk, w.s_bf16.data(), even(tk));
      gemm_bf16_pairs(mq, D, even(nk), 1.0f, w.s_bf16.data(), even(tk),
                      p.v_s + pairs_s_at(b * p.Hkv + hk, p.kseg, D, j0 / tk), 2 * D, 1.0f,
                      w.acc.data(), D);
    } else {
      sgemm(false, false, mq, D, nk, 1.0f, w.s.data(), tk, p.v + p.k_at(b, j0, hk), p.ldk(),
            1.0f, w.acc.data(), D);
    }
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
  const float* lse;
  const float* dout;
  const float* delta;  // [B, Hq, S]: rowsum(dO * O)
  float* dq;
  float* dk;
  float* dv;
  const uint16_t* dout_rows = nullptr;  // bf16 products
  const uint16_t* dout_cols = nullptr;
};

// P = exp(scale * Q K^T - lse) of one tile, 0 where masked.
void recompute_probs(const Problem& p, const Grads& g, int64_t b, int64_t h, int64_t i0,
                     int64_t i1, int64_t j0, int64_t j1, float* probs) {
  const int64_t tk = p.tiles.k, nk = j1 - j0;
  scores(p, b, h, i0, i1 - i0, j0, nk, probs);
  const bool full = tile_unmasked(p, b, i0, j0, j1);
  for (int64_t r = 0; r < i1 - i0; ++r) {
    float* row = probs + r * tk;
    if (!full) mask_row(row, nk, p.start[b * p.S + i0 + r] - j0, i0 + r + 1 - j0);
    probs_row(row, nk, g.lse[p.row_at(b, h, i0 + r)]);
  }
}

// Adds one (query tile, key tile) pair's contributions to dq, dk, dv.
void backward_pair(const Problem& p, const Grads& g, int64_t b, int64_t h, int64_t i0,
                   int64_t i1, int64_t j0, int64_t j1, BackwardScratch& w) {
  const int64_t hk = h / p.G, tk = p.tiles.k, mq = i1 - i0, nk = j1 - j0, D = p.D;
  const int64_t qo = p.q_at(b, i0, h), ko = p.k_at(b, j0, hk);
  float* probs = w.p.data();
  float* ds = w.ds.data();
  recompute_probs(p, g, b, h, i0, i1, j0, j1, probs);
  const int64_t Dp = even(D), tq = p.tiles.q;
  const int64_t qc = p.bf16 ? columns_at(b * p.Hq + h, p.qseg, D, i0 / tq) : 0;
  if (p.bf16) {  // dV^T += dO^T P
    tile_row_pairs(probs, mq, nk, tk, w.p_pairs.data());
    gemm_bf16_pairs(D, nk, even(mq), 1.0f, g.dout_cols + qc, p.qseg.padded, w.p_pairs.data(),
                    2 * nk, 1.0f, w.dvt.data(), tk);
    gemm_bf16_pairs(mq, nk, Dp, 1.0f, g.dout_rows + qo / D * Dp, p.Hq * Dp,
                    p.v_d + pairs_d_at(b * p.Hkv + hk, p.S, D) + 2 * j0, 2 * p.S, 0.0f, ds, tk);
  } else {
    sgemm(true, false, nk, D, mq, 1.0f, probs, tk, g.dout + qo, p.ldq(), 1.0f, g.dv + ko,
          p.ldk());
    sgemm(false, false, mq, nk, D, 1.0f, g.dout + qo, p.ldq(), p.vt + p.t_at(b, hk, j0), p.S,
          0.0f, ds, tk);
  }
  for (int64_t r = 0; r < mq; ++r) {
    const float delta = g.delta[p.row_at(b, h, i0 + r)];
    float* dsr = ds + r * tk;
    const float* pr = probs + r * tk;
#pragma omp simd
    for (int64_t c = 0; c < nk; ++c) dsr[c] = pr[c] * (dsr[c] - delta);
  }
  if (p.bf16) {  // dQ += scale dS K, dK^T += scale Q^T dS
    bf16_tile_rows(ds, mq, nk, tk, w.ds_rows.data(), even(tk));
    gemm_bf16_pairs(mq, D, even(nk), p.scale, w.ds_rows.data(), even(tk),
                    p.k_s + pairs_s_at(b * p.Hkv + hk, p.kseg, D, j0 / tk), 2 * D, 1.0f,
                    g.dq + qo, p.ldq());
    tile_row_pairs(ds, mq, nk, tk, w.ds_pairs.data());
    gemm_bf16_pairs(D, nk, even(mq), p.scale, p.q_cols + qc, p.qseg.padded,
                    w.ds_pairs.data(), 2 * nk, 1.0f, w.dkt.data(), tk);
    return;
  }
  sgemm(false, false, mq, D, nk, p.scale, ds, tk, p.k + ko, p.ldk(), 1.0f, g.dq + qo, p.ldq());
  sgemm(true, false, nk, D, mq, p.scale, ds, tk, p.q + qo, p.ldq(), 1.0f, g.dk + ko, p.ldk());
}


// All gradients touching kv head hk of batch b: its dk, dv rows and the dq
// rows of its query heads, so no other thread writes them.
void backward_group(const Problem& p, const Grads& g, int64_t b, int64_t hk,
                    BackwardScratch& w) {
  const int64_t tq = p.tiles.q, tk = p.tiles.k;
  for (int64_t j0 = 0; j0 < p.S; j0 += tk) {
    const int64_t j1 = std::min(j0 + tk, p.S);
    if (p.bf16) {
      std::fill(w.dkt.begin(), w.dkt.end(), 0.0f);
      std::fill(w.dvt.begin(), w.dvt.end(), 0.0f);
    }
    for (int64_t h = hk * p.G; h < (hk + 1) * p.G; ++h) {
      for (int64_t i0 = j0 / tq * tq; i0 < p.S; i0 += tq) {
        // The window hides the keys from this query tile and every later one.
        if (p.window > 0 && i0 - p.window + 1 >= j1) break;
        if (p.min_start(b, i0) >= j1) continue;  // every row's keys start after these
        backward_pair(p, g, b, h, i0, std::min(i0 + tq, p.S), j0, j1, w);
      }
    }
    if (p.bf16)
      add_transposed(w.dkt.data(), w.dvt.data(), tk, j1 - j0, p.D, g.dk + p.k_at(b, j0, hk),
                     g.dv + p.k_at(b, j0, hk), p.ldk());
  }
}

}  // namespace

std::vector<int32_t> key_starts(const NDArray& documents, int64_t B, int64_t S, int64_t window) {
  check_window(window);
  return document_starts(documents, B, S, std::max<int64_t>(S, 1), window).start;
}

// Positions in host memory (or the double's, read by a CPU kernel); the
// public helper in dispatch.cc brings a device's to the host first.
std::vector<int32_t> document_starts_from_positions(const NDArray& positions, int64_t first) {
  cpu::require_contiguous("attention", positions);
  if (positions.dtype() != DType::I32 || positions.ndim() != 2)
    fail("[attention] document positions: must be a 2-D i32 array [B, S]");
  const NDArray pos = positions.contiguous();
  const int64_t B = pos.dim(0), S = pos.dim(1);
  const int32_t* p = pos.data<int32_t>();
  std::vector<int32_t> start(B * S);
  for (int64_t t = 0; t < B * S; ++t) {
    if (p[t] < 0)
      fail("[attention] document positions: position ", p[t], " of row ", t / S, ", token ",
           first + t % S, " is negative (rule: positions >= 0)");
    start[t] = static_cast<int32_t>(std::max<int64_t>(0, first + t % S - p[t]));
  }
  return start;
}

void attention_forward(const NDArray& q, const NDArray& k, const NDArray& v,
                            const NDArray& documents, float scale, NDArray& out, NDArray& lse,
                            AttentionTiles tiles, DType products, int64_t window) {
  Problem p = make_problem(q, k, v, scale, tiles, products, window);
  const Starts starts = document_starts(documents, p.B, p.S, tiles.q, window);
  std::vector<float> kt;
  std::vector<uint16_t> q_rows, k_d, v_s;
  if (p.bf16) {
    const bool par = p.parallel();
    q_rows = rows_bf16(p.q, p.B, p.S, p.Hq, p.D, par);
    k_d = pairs_over_d(rows_bf16(p.k, p.B, p.S, p.Hkv, p.D, par), p.B, p.S, p.Hkv, p.D, par);
    v_s = pairs_over_s(rows_bf16(p.v, p.B, p.S, p.Hkv, p.D, par), p.B, p.S, p.Hkv, p.D, p.kseg,
                       par);
    p.q_rows = q_rows.data(), p.k_d = k_d.data(), p.v_s = v_s.data();
  } else {
    kt = heads_transposed(k, p.parallel());
    p.kt = kt.data();
  }
  p.start = starts.start.data();
  p.tile_min = starts.tile_min.data();
  p.tile_max = starts.tile_max.data();
  HSPMD_CHECK(out.shape() == q.shape() && lse.numel() == p.B * p.Hq * p.S, "attention: outputs");
  float* po = out.data<float>();
  float* pl = lse.data<float>();
  const int64_t ntiles = (p.S + tiles.q - 1) / tiles.q, items = p.B * p.Hq * ntiles;
#pragma omp parallel if (p.parallel())
  {
    ForwardScratch w(tiles, p.D, p.bf16);
#pragma omp for schedule(dynamic)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t t = ntiles - 1 - it % ntiles, bh = it / ntiles;  // long tiles first
      const int64_t i0 = t * tiles.q;
      forward_tile(p, bh / p.Hq, bh % p.Hq, i0, std::min(i0 + tiles.q, p.S), po, pl, w);
    }
  }
}

void attention_backward(const NDArray& q, const NDArray& k, const NDArray& v,
                             const NDArray& out,
                             const NDArray& lse, const NDArray& grad_out, const NDArray& documents,
                             float scale, NDArray& dq, NDArray& dk, NDArray& dv,
                             AttentionTiles tiles, DType products, int64_t window) {
  Problem p = make_problem(q, k, v, scale, tiles, products, window);
  for (const NDArray* a : {&out, &lse, &grad_out}) cpu::require_contiguous("attention_grad", *a);
  const Starts starts = document_starts(documents, p.B, p.S, tiles.q, window);
  std::vector<float> kt, vt;
  std::vector<uint16_t> q_rows, q_cols, k_d, k_s, v_d, dout_rows, dout_cols;
  const NDArray dout = grad_out.contiguous();
  if (p.bf16) {
    const bool par = p.parallel();
    q_rows = rows_bf16(p.q, p.B, p.S, p.Hq, p.D, par);
    q_cols = columns_bf16(q_rows, p.B, p.S, p.Hq, p.D, p.qseg, par);
    const std::vector<uint16_t> k_rows = rows_bf16(p.k, p.B, p.S, p.Hkv, p.D, par);
    k_d = pairs_over_d(k_rows, p.B, p.S, p.Hkv, p.D, par);
    k_s = pairs_over_s(k_rows, p.B, p.S, p.Hkv, p.D, p.kseg, par);
    v_d = pairs_over_d(rows_bf16(p.v, p.B, p.S, p.Hkv, p.D, par), p.B, p.S, p.Hkv, p.D, par);
    dout_rows = rows_bf16(dout.data<float>(), p.B, p.S, p.Hq, p.D, par);
    dout_cols = columns_bf16(dout_rows, p.B, p.S, p.Hq, p.D, p.qseg, par);
    p.q_rows = q_rows.data(), p.q_cols = q_cols.data(), p.k_d = k_d.data(), p.k_s = k_s.data();
    p.v_d = v_d.data();
  } else {
    kt = heads_transposed(k, p.parallel());
    vt = heads_transposed(v, p.parallel());
    p.kt = kt.data();
    p.vt = vt.data();
  }
  p.start = starts.start.data();
  p.tile_min = starts.tile_min.data();
  p.tile_max = starts.tile_max.data();
  HSPMD_CHECK(out.shape() == q.shape() && grad_out.shape() == q.shape() &&
                  lse.numel() == p.B * p.Hq * p.S && dq.shape() == q.shape() &&
                  dk.shape() == k.shape() && dv.shape() == v.shape(),
              "attention_grad: shapes");
  NDArray delta = NDArray::empty({p.B, p.Hq, p.S}, DType::F32);
  attention_row_dots(out, grad_out, delta, p.bf16);
  for (NDArray* a : {&dq, &dk, &dv}) fill(*a, 0.0f);  // the kernel: they may live on cpu:1
  const Grads g{lse.data<float>(), dout.data<float>(), delta.data<float>(), dq.data<float>(),
                dk.data<float>(),  dv.data<float>(),   dout_rows.data(),   dout_cols.data()};
#pragma omp parallel if (p.parallel())
  {
    BackwardScratch w(tiles, p.D, p.bf16);
#pragma omp for schedule(dynamic)
    for (int64_t it = 0; it < p.B * p.Hkv; ++it) backward_group(p, g, it / p.Hkv, it % p.Hkv, w);
  }
}

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT
