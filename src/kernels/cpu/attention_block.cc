// CPU kernels of one block of context-parallel (ring) attention: queries and
// keys are pieces of a longer sequence, named by their global indices. Same
// tiles as attention.cc (sgemm or bf16 products, online softmax,
// flash-attention-2 backward),
// but a tile is a run of consecutive global indices, and the mask compares
// global indices. A sliding window W > 0 is folded into the queries' starts
// (start(i) >= i - W + 1, global), so tiles it hides are skipped like those
// the causal / document mask hides.
#include <algorithm>
#include <cmath>
#include <vector>

#include "hspmd/core/error.h"
#include "kernels/attention.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "kernels/cpu/variant.h"

#include "attention_tile.h"

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT {

namespace {

using namespace attention_tile;

// Local rows [begin, end) whose global indices run g0, g0 + 1, ...
struct Run {
  int64_t begin, end, g0;
  int64_t size() const { return end - begin; }
  int64_t g_last() const { return g0 + end - begin - 1; }
};

// Splits rows into runs of at most `tile` rows that never straddle a jump.
std::vector<Run> runs_of(std::span<const int64_t> index, int64_t tile) {
  std::vector<Run> runs;
  for (int64_t r = 0; r < static_cast<int64_t>(index.size()); ++r) {
    if (runs.empty() || runs.back().size() == tile || index[r] != index[r - 1] + 1)
      runs.push_back({r, r, index[r]});
    runs.back().end = r + 1;
  }
  return runs;
}

struct BlockProblem {
  int64_t B, Sq, Sk, Hq, Hkv, D, G;
  const float* q;
  const float* k;
  const float* v;
  std::vector<float> kt, vt;  // [B, Hkv, D, Sk]
  std::vector<int32_t> start;  // [B*Sq], global: where each query's keys start (document, window)
  std::vector<Run> qruns, kruns;
  std::vector<int32_t> run_min, run_max;  // per (b, query run): least / greatest start
  float scale;
  AttentionTiles tiles;
  // bf16 products: the runs as segments and the packed operands (attention_tile.h).
  bool bf16 = false;
  Segments qseg, kseg;
  std::vector<uint16_t> q_rows, q_cols, k_d, k_s, v_d, v_s;
  int64_t ldq() const { return Hq * D; }
  int64_t ldk() const { return Hkv * D; }
  int64_t q_at(int64_t b, int64_t i, int64_t h) const { return ((b * Sq + i) * Hq + h) * D; }
  int64_t k_at(int64_t b, int64_t j, int64_t hk) const { return ((b * Sk + j) * Hkv + hk) * D; }
  int64_t row_at(int64_t b, int64_t h, int64_t i) const { return (b * Hq + h) * Sq + i; }
  int64_t t_at(int64_t b, int64_t hk, int64_t j) const { return (b * Hkv + hk) * D * Sk + j; }
  bool parallel() const { return B * Hq * Sq * Sk * D > kParallelWork; }
  int64_t run_at(int64_t b, size_t qr) const { return b * static_cast<int64_t>(qruns.size()) + qr; }
  // No query of the run sees any key of the other.
  bool hidden(int64_t b, size_t qr, const Run& kr) const {
    return kr.g0 > qruns[qr].g_last() || kr.g_last() < run_min[run_at(b, qr)];
  }
  // Every query of the run sees every key of the other.
  bool unmasked(int64_t b, size_t qr, const Run& kr) const {
    return kr.g_last() <= qruns[qr].g0 && kr.g0 >= run_max[run_at(b, qr)];
  }
};

BlockProblem make_block_problem(const AttentionBlock& blk, AttentionTiles tiles, bool backward) {
  for (const NDArray* a : {&blk.q, &blk.k, &blk.v}) cpu::require_contiguous("attention", *a);
  const NDArray &q = blk.q, &k = blk.k;
  HSPMD_CHECK(q.ndim() == 4 && k.ndim() == 4 && k.shape() == blk.v.shape() && q.is_contiguous() &&
                  k.is_contiguous() && blk.v.is_contiguous(),
              "attention block: ranks");
  BlockProblem p{.B = q.dim(0),
                 .Sq = q.dim(1),
                 .Sk = k.dim(1),
                 .Hq = q.dim(2),
                 .Hkv = k.dim(2),
                 .D = q.dim(3),
                 .G = 1,
                 .q = q.data<float>(),
                 .k = k.data<float>(),
                 .v = blk.v.data<float>(),
                 .kt = {},
                 .vt = {},
                 .start = {},
                 .qruns = runs_of(blk.q_index, tiles.q),
                 .kruns = runs_of(blk.k_index, tiles.k),
                 .run_min = {},
                 .run_max = {},
                 .scale = blk.scale,
                 .tiles = tiles,
                 .bf16 = blk.products == DType::BF16,
                 .qseg = {},
                 .kseg = {},
                 .q_rows = {},
                 .q_cols = {},
                 .k_d = {},
                 .k_s = {},
                 .v_d = {},
                 .v_s = {}};
  HSPMD_CHECK(blk.products == DType::F32 || p.bf16, "attention block: products dtype");
  HSPMD_CHECK(p.Hkv > 0 && p.Hq % p.Hkv == 0 && k.dim(0) == p.B && k.dim(3) == p.D &&
                  static_cast<int64_t>(blk.q_index.size()) == p.Sq &&
                  static_cast<int64_t>(blk.k_index.size()) == p.Sk &&
                  static_cast<int64_t>(blk.q_start.size()) == p.B * p.Sq,
              "attention block: shapes");
  p.G = p.Hq / p.Hkv;
  p.start = windowed_starts(blk);
  for (int64_t b = 0; b < p.B; ++b)
    for (const Run& r : p.qruns) {
      const int32_t* row = p.start.data() + b * p.Sq;
      const auto [lo, hi] = std::minmax_element(row + r.begin, row + r.end);
      p.run_min.push_back(*lo);
      p.run_max.push_back(*hi);
    }
  const bool par = p.parallel();
  if (!p.bf16) {
    p.kt = heads_transposed(k, par);
    if (backward) p.vt = heads_transposed(blk.v, par);
    return p;
  }
  for (const Run& r : p.qruns) p.qseg.add(r.begin, r.size());
  for (const Run& r : p.kruns) p.kseg.add(r.begin, r.size());
  p.q_rows = rows_bf16(p.q, p.B, p.Sq, p.Hq, p.D, par);
  const std::vector<uint16_t> k_rows = rows_bf16(p.k, p.B, p.Sk, p.Hkv, p.D, par);
  const std::vector<uint16_t> v_rows = rows_bf16(p.v, p.B, p.Sk, p.Hkv, p.D, par);
  p.k_d = pairs_over_d(k_rows, p.B, p.Sk, p.Hkv, p.D, par);
  if (!backward) {
    p.v_s = pairs_over_s(v_rows, p.B, p.Sk, p.Hkv, p.D, p.kseg, par);
    return p;
  }
  p.q_cols = columns_bf16(p.q_rows, p.B, p.Sq, p.Hq, p.D, p.qseg, par);
  p.k_s = pairs_over_s(k_rows, p.B, p.Sk, p.Hkv, p.D, p.kseg, par);
  p.v_d = pairs_over_d(v_rows, p.B, p.Sk, p.Hkv, p.D, par);
  return p;
}

// Masks rows of a score tile outside start(i) <= j <= i, in global indices.
void mask_tile(const BlockProblem& p, int64_t b, const Run& qr, const Run& kr, float* s) {
  for (int64_t r = 0; r < qr.size(); ++r)
    mask_row(s + r * p.tiles.k, kr.size(), p.start[b * p.Sq + qr.begin + r] - kr.g0,
             qr.g0 + r + 1 - kr.g0);
}

// ---- forward ----

struct ForwardScratch {
  std::vector<float> s, acc, m, l;
  std::vector<uint16_t> s_bf16;  // P in bf16 (bf16 products)
  ForwardScratch(const AttentionTiles& t, int64_t D, bool bf16)
      : s(t.q * t.k), acc(t.q * D), m(t.q), l(t.q), s_bf16(bf16 ? t.q * even(t.k) : 0) {}
};

// S = scale Q K^T of query run qr, head h, key run kr into s (row stride tiles.k).
void scores(const BlockProblem& p, int64_t b, int64_t h, const Run& qr, const Run& kr, float* s) {
  const int64_t hk = h / p.G, Dp = even(p.D);
  if (p.bf16)
    gemm_bf16_pairs(qr.size(), kr.size(), Dp, p.scale,
                    p.q_rows.data() + p.q_at(b, qr.begin, h) / p.D * Dp, p.Hq * Dp,
                    p.k_d.data() + pairs_d_at(b * p.Hkv + hk, p.Sk, p.D) + 2 * kr.begin,
                    2 * p.Sk, 0.0f, s, p.tiles.k);
  else
    sgemm(false, false, qr.size(), kr.size(), p.D, p.scale, p.q + p.q_at(b, qr.begin, h), p.ldq(),
          p.kt.data() + p.t_at(b, hk, kr.begin), p.Sk, 0.0f, s, p.tiles.k);
}

// scores -> probabilities of one visible tile, rescaling the accumulated rows.
void softmax_tile(const BlockProblem& p, int64_t b, size_t qi, const Run& kr, ForwardScratch& w) {
  const Run& qr = p.qruns[qi];
  if (!p.unmasked(b, qi, kr)) mask_tile(p, b, qr, kr, w.s.data());
  for (int64_t r = 0; r < qr.size(); ++r) {
    const float corr = softmax_update(w.s.data() + r * p.tiles.k, kr.size(), w.m[r], w.l[r]);
    if (corr == 1.0f) continue;
    float* acc = w.acc.data() + r * p.D;
    for (int64_t d = 0; d < p.D; ++d) acc[d] *= corr;
  }
}

// Output rows of query run qi, head h, batch b; rows that see nothing get 0 and -inf.
void forward_run(const BlockProblem& p, int64_t b, int64_t h, size_t qi, float* out, float* lse,
                 ForwardScratch& w) {
  const Run& qr = p.qruns[qi];
  const int64_t mq = qr.size(), hk = h / p.G, D = p.D, tk = p.tiles.k;
  std::fill_n(w.m.data(), mq, kNegInf);
  std::fill_n(w.l.data(), mq, 0.0f);
  std::fill_n(w.acc.data(), mq * D, 0.0f);
  for (int64_t t = 0; t < static_cast<int64_t>(p.kruns.size()); ++t) {
    const Run& kr = p.kruns[t];
    if (p.hidden(b, qi, kr)) continue;
    scores(p, b, h, qr, kr, w.s.data());
    softmax_tile(p, b, qi, kr, w);
    if (p.bf16) {
      bf16_tile_rows(w.s.data(), mq, kr.size(), tk, w.s_bf16.data(), even(tk));
      gemm_bf16_pairs(mq, D, even(kr.size()), 1.0f, w.s_bf16.data(), even(tk),
                      p.v_s.data() + pairs_s_at(b * p.Hkv + hk, p.kseg, D, t), 2 * D, 1.0f,
                      w.acc.data(), D);
    } else {
      sgemm(false, false, mq, D, kr.size(), 1.0f, w.s.data(), tk, p.v + p.k_at(b, kr.begin, hk),
            p.ldk(), 1.0f, w.acc.data(), D);
    }
  }
  for (int64_t r = 0; r < mq; ++r) {
    const float inv = w.l[r] > 0 ? 1.0f / w.l[r] : 0.0f;
    float* o = out + p.q_at(b, qr.begin + r, h);
    for (int64_t d = 0; d < D; ++d) o[d] = w.acc[r * D + d] * inv;
    lse[p.row_at(b, h, qr.begin + r)] = w.l[r] > 0 ? w.m[r] + std::log(w.l[r]) : kNegInf;
  }
}

// ---- backward ----

struct Grads {
  const float* lse;
  const float* dout;
  const float* delta;
  float* dq;
  float* dk;
  float* dv;
  const uint16_t* dout_rows = nullptr;  // bf16 products
  const uint16_t* dout_cols = nullptr;
};

// Adds one visible (query run, key run t) pair's contributions to dq, dk, dv
// (with bf16 products: to dq and the scratch's dK^T, dV^T).
void backward_pair(const BlockProblem& p, const Grads& g, int64_t b, int64_t h, size_t qi,
                   int64_t t, BackwardScratch& w) {
  const Run& qr = p.qruns[qi];
  const Run& kr = p.kruns[t];
  const int64_t hk = h / p.G, tk = p.tiles.k, mq = qr.size(), nk = kr.size(), D = p.D;
  const int64_t qo = p.q_at(b, qr.begin, h), ko = p.k_at(b, kr.begin, hk), Dp = even(D);
  float* pt = w.p.data();
  float* st = w.ds.data();
  scores(p, b, h, qr, kr, pt);
  if (!p.unmasked(b, qi, kr)) mask_tile(p, b, qr, kr, pt);
  for (int64_t r = 0; r < mq; ++r) probs_row(pt + r * tk, nk, g.lse[p.row_at(b, h, qr.begin + r)]);
  const int64_t qc =
      p.bf16 ? columns_at(b * p.Hq + h, p.qseg, D, static_cast<int64_t>(qi)) : 0;
  if (p.bf16) {  // dV^T += dO^T P; dP = dO V^T
    tile_row_pairs(pt, mq, nk, tk, w.p_pairs.data());
    gemm_bf16_pairs(D, nk, even(mq), 1.0f, g.dout_cols + qc, p.qseg.padded, w.p_pairs.data(),
                    2 * nk, 1.0f, w.dvt.data(), tk);
    gemm_bf16_pairs(mq, nk, Dp, 1.0f, g.dout_rows + qo / D * Dp, p.Hq * Dp,
                    p.v_d.data() + pairs_d_at(b * p.Hkv + hk, p.Sk, D) + 2 * kr.begin, 2 * p.Sk,
                    0.0f, st, tk);
  } else {
    sgemm(true, false, nk, D, mq, 1.0f, pt, tk, g.dout + qo, p.ldq(), 1.0f, g.dv + ko, p.ldk());
    sgemm(false, false, mq, nk, D, 1.0f, g.dout + qo, p.ldq(),
          p.vt.data() + p.t_at(b, hk, kr.begin), p.Sk, 0.0f, st, tk);
  }
  for (int64_t r = 0; r < mq; ++r) {
    const float delta = g.delta[p.row_at(b, h, qr.begin + r)];
    float* dsr = st + r * tk;
    const float* pr = pt + r * tk;
#pragma omp simd
    for (int64_t c = 0; c < nk; ++c) dsr[c] = pr[c] * (dsr[c] - delta);
  }
  if (p.bf16) {  // dQ += scale dS K; dK^T += scale Q^T dS
    bf16_tile_rows(st, mq, nk, tk, w.ds_rows.data(), even(tk));
    gemm_bf16_pairs(mq, D, even(nk), p.scale, w.ds_rows.data(), even(tk),
                    p.k_s.data() + pairs_s_at(b * p.Hkv + hk, p.kseg, D, t), 2 * D, 1.0f,
                    g.dq + qo, p.ldq());
    tile_row_pairs(st, mq, nk, tk, w.ds_pairs.data());
    gemm_bf16_pairs(D, nk, even(mq), p.scale, p.q_cols.data() + qc, p.qseg.padded,
                    w.ds_pairs.data(), 2 * nk, 1.0f, w.dkt.data(), tk);
    return;
  }
  sgemm(false, false, mq, D, nk, p.scale, st, tk, p.k + ko, p.ldk(), 1.0f, g.dq + qo, p.ldq());
  sgemm(true, false, nk, D, mq, p.scale, st, tk, p.q + qo, p.ldq(), 1.0f, g.dk + ko, p.ldk());
}

// Everything touching kv head hk of batch b (its dk, dv rows; the dq rows of
// its query heads), so no other thread writes them.
void backward_group(const BlockProblem& p, const Grads& g, int64_t b, int64_t hk) {
  BackwardScratch w(p.tiles, p.D, p.bf16);
  for (int64_t t = 0; t < static_cast<int64_t>(p.kruns.size()); ++t) {
    const Run& kr = p.kruns[t];
    if (p.bf16) {
      std::fill(w.dkt.begin(), w.dkt.end(), 0.0f);
      std::fill(w.dvt.begin(), w.dvt.end(), 0.0f);
    }
    for (int64_t h = hk * p.G; h < (hk + 1) * p.G; ++h)
      for (size_t qi = 0; qi < p.qruns.size(); ++qi)
        if (!p.hidden(b, qi, kr)) backward_pair(p, g, b, h, qi, t, w);
    if (!p.bf16) continue;
    add_transposed(w.dkt.data(), w.dvt.data(), p.tiles.k, kr.size(), p.D,
                   g.dk + p.k_at(b, kr.begin, hk), g.dv + p.k_at(b, kr.begin, hk), p.ldk());
  }
}

}  // namespace

void attention_block_forward(const AttentionBlock& blk, NDArray& out_blk, NDArray& lse_blk,
                                  AttentionTiles tiles) {
  if (blk.window > 0 && attention_block_hidden(blk)) {  // nothing to compute or pack
    HSPMD_CHECK(out_blk.shape() == blk.q.shape() &&
                    lse_blk.numel() == blk.q.dim(0) * blk.q.dim(2) * blk.q.dim(1),
                "attention block: outputs");
    fill(out_blk, 0.0f);  // the kernel, not NDArray::fill: out_blk may live on cpu:1
    fill(lse_blk, kNegInf);
    return;
  }
  const BlockProblem p = make_block_problem(blk, tiles, false);
  HSPMD_CHECK(out_blk.shape() == blk.q.shape() && lse_blk.numel() == p.B * p.Hq * p.Sq,
              "attention block: outputs");
  float* po = out_blk.data<float>();
  float* pl = lse_blk.data<float>();
  const int64_t nruns = static_cast<int64_t>(p.qruns.size()), items = p.B * p.Hq * nruns;
#pragma omp parallel if (p.parallel())
  {
    ForwardScratch w(tiles, p.D, p.bf16);
#pragma omp for schedule(dynamic)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t bh = it / nruns;
      forward_run(p, bh / p.Hq, bh % p.Hq, static_cast<size_t>(it % nruns), po, pl, w);
    }
  }
}

void attention_merge(NDArray& out, NDArray& lse, const NDArray& out_blk,
                          const NDArray& lse_blk) {
  HSPMD_CHECK(out.ndim() == 4 && out.shape() == out_blk.shape() && lse.shape() == lse_blk.shape() &&
                  lse.numel() == out.dim(0) * out.dim(2) * out.dim(1),
              "attention merge: shapes");
  const int64_t B = out.dim(0), S = out.dim(1), H = out.dim(2), D = out.dim(3);
  float* o = out.data<float>();
  float* l = lse.data<float>();
  const float* ob = out_blk.data<float>();
  const float* lb = lse_blk.data<float>();
#pragma omp parallel for schedule(static) if (B * S * H * D > (int64_t{1} << 18))
  for (int64_t t = 0; t < B * S * H; ++t) {
    const int64_t h = t % H, i = t / H % S, b = t / H / S, at = (b * H + h) * S + i;
    if (lb[at] == kNegInf) continue;
    const float m = std::max(l[at], lb[at]);
    const float w_old = std::exp(l[at] - m), w_blk = std::exp(lb[at] - m), sum = w_old + w_blk;
    for (int64_t d = 0; d < D; ++d)
      o[t * D + d] = (o[t * D + d] * w_old + ob[t * D + d] * w_blk) / sum;
    l[at] = m + std::log(sum);
  }
}

void attention_row_dots(const NDArray& out, const NDArray& grad_out, NDArray& delta,
                             bool bf16_grad) {
  HSPMD_CHECK(out.ndim() == 4 && grad_out.shape() == out.shape() &&
                  delta.numel() == out.dim(0) * out.dim(1) * out.dim(2),
              "attention row dots: shapes");
  const int64_t B = out.dim(0), S = out.dim(1), H = out.dim(2), D = out.dim(3);
  const float* o = out.data<float>();
  const float* g = grad_out.data<float>();
  float* dl = delta.data<float>();
#pragma omp parallel for schedule(static) if (B * S * H * D > (int64_t{1} << 18))
  for (int64_t t = 0; t < B * S * H; ++t) {
    float s = 0;
    if (bf16_grad) {  // the dO the bf16 products of dP use: rowsum(P o dP) and this agree
#pragma omp simd reduction(+ : s)
      for (int64_t e = 0; e < D; ++e) s += o[t * D + e] * bf16_to_f32(f32_to_bf16(g[t * D + e]));
    } else {
#pragma omp simd reduction(+ : s)
      for (int64_t e = 0; e < D; ++e) s += o[t * D + e] * g[t * D + e];
    }
    const int64_t h = t % H, i = t / H % S, b = t / H / S;
    dl[(b * H + h) * S + i] = s;
  }
}

void attention_block_backward(const AttentionBlock& blk, const NDArray& grad_out,
                                   const NDArray& lse, const NDArray& delta, NDArray& dq, NDArray& dk,
                                   NDArray& dv, AttentionTiles tiles) {
  if (blk.window > 0 && attention_block_hidden(blk)) return;  // adds nothing
  const BlockProblem p = make_block_problem(blk, tiles, true);
  HSPMD_CHECK(grad_out.shape() == blk.q.shape() && lse.numel() == p.B * p.Hq * p.Sq &&
                  delta.numel() == lse.numel() && dq.shape() == blk.q.shape() &&
                  dk.shape() == blk.k.shape() && dv.shape() == blk.k.shape() &&
                  dq.is_contiguous() && dk.is_contiguous() && dv.is_contiguous(),
              "attention block grad: shapes");
  const NDArray dout = grad_out.contiguous();
  std::vector<uint16_t> dout_rows, dout_cols;
  if (p.bf16) {
    dout_rows = rows_bf16(dout.data<float>(), p.B, p.Sq, p.Hq, p.D, p.parallel());
    dout_cols = columns_bf16(dout_rows, p.B, p.Sq, p.Hq, p.D, p.qseg, p.parallel());
  }
  const Grads g{lse.data<float>(), dout.data<float>(), delta.data<float>(), dq.data<float>(),
                dk.data<float>(),  dv.data<float>(),   dout_rows.data(),   dout_cols.data()};
#pragma omp parallel for schedule(dynamic) if (p.parallel())
  for (int64_t it = 0; it < p.B * p.Hkv; ++it) backward_group(p, g, it / p.Hkv, it % p.Hkv);
}

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT
