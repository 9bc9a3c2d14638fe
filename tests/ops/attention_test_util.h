// Helpers of the attention op's tests (test_attention.cc, test_attention_window.cc):
// random inputs, the graph and kernel runs, the dense reference, documents as
// positions, context-parallel zigzag blocks, comparisons.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "deduce/deduce_test_util.h"
#include "gradcheck.h"
#include "hspmd/core/threads.h"
#include "hspmd/ops/autodiff.h"
#include "hspmd/ops/ops.h"
#include "kernels/attention.h"
#include "kernels/basic.h"
#include "kernels/cpu/bf16_pairs.h"

namespace hspmd::attention_test {


// The stream the kernels here run on.
inline Stream& cpu_stream() { return default_stream(Device::cpu()); }

using kernels::AttentionTiles;
using testing::expect_gradients_match;
using testing::random_array;

struct Dims {
  int64_t B, S, Hq, Hkv, D;
};

// Sets the kernels' tile sizes for one test and restores them afterwards.
class TilesGuard {
 public:
  explicit TilesGuard(AttentionTiles t) : saved_(kernels::attention_tiles()) {
    kernels::set_attention_tiles(t);
  }
  ~TilesGuard() { kernels::set_attention_tiles(saved_); }

 private:
  AttentionTiles saved_;
};

struct Inputs {
  NDArray q, k, v;
};

inline Inputs random_inputs(const Dims& d, uint64_t seed) {
  return {random_array({d.B, d.S, d.Hq, d.D}, seed), random_array({d.B, d.S, d.Hkv, d.D}, seed + 1),
          random_array({d.B, d.S, d.Hkv, d.D}, seed + 2)};
}

// Attention through the graph with symbolic B and S; `documents` is invalid,
// cu_seqlens [n+1] or positions [B, S].
inline NDArray run_with_documents(const Inputs& x, const NDArray& documents, float scale) {
  Graph g;
  const SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
  Tensor q = g.placeholder("q", {B, S, x.q.dim(2), x.q.dim(3)}, DType::F32);
  Tensor k = g.placeholder("k", {B, S, x.k.dim(2), x.k.dim(3)}, DType::F32);
  Tensor v = g.placeholder("v", {B, S, x.v.dim(2), x.v.dim(3)}, DType::F32);
  ValueMap values{{"q", x.q}, {"k", x.k}, {"v", x.v}};
  Tensor c;
  if (documents.valid() && documents.ndim() == 1)
    c = g.placeholder("docs", {SymDim::symbol("N")}, DType::I32);
  if (documents.valid() && documents.ndim() == 2) c = g.placeholder("docs", {B, S}, DType::I32);
  if (documents.valid()) values["docs"] = documents;
  return Executor(g, {ops::attention(q, k, v, c, scale)}).run(values)[0];
}

inline NDArray cu_array(const std::vector<int32_t>& cu) {
  return NDArray::from_vector_i32({static_cast<int64_t>(cu.size())}, cu);
}

// cu empty means no cu_seqlens.
inline NDArray run_attention(const Inputs& x, const std::vector<int32_t>& cu, float scale) {
  return run_with_documents(x, cu.empty() ? NDArray() : cu_array(cu), scale);
}

// Naive reference in double: the full masked score matrix per head. Query i
// of row b sees key j iff start[b * S + i] <= j <= i.
inline std::vector<double> reference_starts(const Inputs& x, const std::vector<int64_t>& start,
                                     float scale) {
  const int64_t B = x.q.dim(0), S = x.q.dim(1), Hq = x.q.dim(2), Hkv = x.k.dim(2), D = x.q.dim(3);
  const float *q = x.q.data<float>(), *k = x.k.data<float>(), *v = x.v.data<float>();
  std::vector<double> out(B * S * Hq * D, 0.0), p(S);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < S; ++i) {
        const int64_t hk = h / (Hq / Hkv);
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j < S; ++j) {
          p[j] = -1e300;
          if (j > i || j < start[b * S + i]) continue;
          double s = 0;
          for (int64_t e = 0; e < D; ++e)
            s += double(q[((b * S + i) * Hq + h) * D + e]) * k[((b * S + j) * Hkv + hk) * D + e];
          p[j] = s * scale;
          mx = std::max(mx, p[j]);
        }
        for (int64_t j = 0; j < S; ++j) sum += p[j] = p[j] <= -1e300 ? 0.0 : std::exp(p[j] - mx);
        for (int64_t j = 0; j < S; ++j)
          for (int64_t e = 0; e < D; ++e)
            out[((b * S + i) * Hq + h) * D + e] += p[j] / sum * v[((b * S + j) * Hkv + hk) * D + e];
      }
  return out;
}

// The reference with documents from cu_seqlens (cu empty: one per row).
inline std::vector<double> reference(const Inputs& x, const std::vector<int32_t>& cu, float scale) {
  const int64_t S = x.q.dim(1);
  std::vector<int64_t> start(x.q.dim(0) * S, 0);
  for (size_t d = 0; !cu.empty() && d + 1 < cu.size(); ++d)
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t) start[t] = cu[d] - t / S * S;
  return reference_starts(x, start, scale);
}

inline void expect_close(const NDArray& got, const std::vector<double>& want, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size())) << what;
  const float* g = got.data<float>();
  int bad = 0;
  for (size_t i = 0; i < want.size() && bad < 5; ++i)
    if (!(std::fabs(g[i] - want[i]) <= tol)) {
      ADD_FAILURE() << what << ": element " << i << " got " << g[i] << " want " << want[i];
      ++bad;
    }
}

inline const AttentionTiles kSmallTiles[] = {{64, 64}, {3, 2}, {4, 5}, {16, 16}};

inline NDArray tokens(const NDArray& a, int64_t begin, int64_t end) {
  NDArray flat = a.reshape({a.dim(0) * a.dim(1), a.dim(2), a.dim(3)});
  return flat.slice(0, begin, end).contiguous().reshape({1, end - begin, a.dim(2), a.dim(3)});
}

// Positions [B, S] of packed documents: one list of document lengths per row.
inline NDArray positions_of(const std::vector<std::vector<int>>& rows) {
  std::vector<int32_t> pos;
  for (const auto& lengths : rows)
    for (int len : lengths)
      for (int i = 0; i < len; ++i) pos.push_back(i);
  const int64_t B = static_cast<int64_t>(rows.size());
  return NDArray::from_vector_i32({B, static_cast<int64_t>(pos.size()) / B}, pos);
}

// The rule of positions, straight: start = max(0, i - positions[i]).
inline std::vector<int64_t> starts_of(const NDArray& positions) {
  const int64_t S = positions.dim(1);
  std::vector<int64_t> start(positions.numel());
  for (int64_t t = 0; t < positions.numel(); ++t)
    start[t] = std::max<int64_t>(0, t % S - positions.data<int32_t>()[t]);
  return start;
}

inline void expect_equal(const NDArray& a, const NDArray& b, const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  for (int64_t e = 0; e < a.numel(); ++e)
    ASSERT_EQ(a.data<float>()[e], b.data<float>()[e]) << what << ": element " << e;
}

inline std::vector<double> as_double(const NDArray& a) {
  return std::vector<double>(a.data<float>(), a.data<float>() + a.numel());
}

// A sequence of S tokens cut into n zigzag blocks: block r holds halves r and
// 2n-1-r of the 2n halves.
struct Zigzag {
  int n;
  int64_t S;
  int64_t half() const { return S / (2 * n); }
  std::vector<int64_t> rows(int r) const {
    std::vector<int64_t> idx;
    for (int64_t h : {int64_t{r}, int64_t{2 * n - 1 - r}})
      for (int64_t i = 0; i < half(); ++i) idx.push_back(h * half() + i);
    return idx;
  }
  // The rows of block r of `a`, whose sequence is along dim 1 or 2.
  NDArray take(const NDArray& a, int r, int dim) const {
    const std::vector<int64_t> idx = rows(r);
    const int64_t L = static_cast<int64_t>(idx.size());
    Shape shape = a.shape();
    shape[dim] = L;
    NDArray g = NDArray::empty(shape, DType::F32);
    const int64_t outer = dim == 1 ? a.dim(0) : a.dim(0) * a.dim(1);
    const int64_t inner = a.numel() / outer / S;
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t i = 0; i < L; ++i)
        std::copy_n(a.data<float>() + (o * S + idx[i]) * inner, inner,
                    g.data<float>() + (o * L + i) * inner);
    return g;
  }
  // Per query of block r, the global index where its document starts (0
  // for every query of the B rows without positions).
  std::vector<int32_t> starts(const NDArray& positions, int r, int64_t B = 0) const {
    if (!positions.valid()) return std::vector<int32_t>(B * 2 * half(), 0);
    const std::vector<int64_t> all = starts_of(positions);
    std::vector<int32_t> start;
    for (int64_t b = 0; b < positions.dim(0); ++b)
      for (int64_t i : rows(r)) start.push_back(static_cast<int32_t>(all[b * S + i]));
    return start;
  }
};

// The whole-sequence kernels' results: out, lse, dq, dk, dv.
inline std::vector<NDArray> whole_attention(const Inputs& x, const NDArray& pos, const NDArray& dout,
                                     float scale, DType products = DType::F32,
                                     int64_t window = 0) {
  const kernels::AttentionTiles tiles = kernels::attention_tiles();
  NDArray out = NDArray::empty(x.q.shape(), DType::F32);
  NDArray lse = NDArray::empty({x.q.dim(0), x.q.dim(2), x.q.dim(1)}, DType::F32);
  kernels::attention_forward(cpu_stream(), x.q, x.k, x.v, pos, scale, out, lse, tiles, products,
                             window);
  NDArray dq = NDArray::empty(x.q.shape(), DType::F32);
  NDArray dk = NDArray::empty(x.k.shape(), DType::F32);
  NDArray dv = NDArray::empty(x.k.shape(), DType::F32);
  kernels::attention_backward(cpu_stream(), x.q, x.k, x.v, out, lse, dout, pos, scale, dq, dk, dv,
                              tiles, products, window);
  return {out, lse, dq, dk, dv};
}

// Every block's queries over every block, merged, give the whole kernel's
// out and lse; the blocks' backward shares sum to its gradients. Tolerances:
// tol for out and lse, 5 tol for the gradients. `n` blocks, sliding window
// `window` (0: none), packed documents unless `documents` is false. Returns
// how many (query block, key block) pairs the window hides entirely.
inline int check_zigzag_blocks(DType products, double tol, int n = 3, int64_t window = 0,
                        bool documents = true) {
  const Dims d{2, 24, 4, 2, 8};
  const Zigzag z{n, d.S};
  const NDArray pos = documents ? positions_of({{4, 9, 11}, {13, 1, 10}}) : NDArray();
  const Inputs x = random_inputs(d, 77);
  const NDArray dout = random_array({d.B, d.S, d.Hq, d.D}, 78);
  TilesGuard guard({3, 2});
  const kernels::AttentionTiles tiles = kernels::attention_tiles();
  const std::vector<NDArray> want = whole_attention(x, pos, dout, 0.3f, products, window);
  int hidden = 0;
  std::vector<NDArray> k(z.n), v(z.n), dk(z.n), dv(z.n);
  std::vector<std::vector<int64_t>> rows(z.n);
  for (int r = 0; r < z.n; ++r) {
    k[r] = z.take(x.k, r, 1), v[r] = z.take(x.v, r, 1), rows[r] = z.rows(r);
    dk[r] = NDArray::zeros(k[r].shape(), DType::F32);
    dv[r] = NDArray::zeros(k[r].shape(), DType::F32);
  }
  for (int c = 0; c < z.n; ++c) {
    const std::string rank = " of rank " + std::to_string(c) + " (n=" + std::to_string(n) +
                             ", window " + std::to_string(window) + ")";
    const std::vector<int32_t> start = z.starts(pos, c, d.B);
    const NDArray q = z.take(x.q, c, 1), go = z.take(dout, c, 1);
    NDArray o = NDArray::zeros(q.shape(), DType::F32);
    NDArray l = NDArray::empty({d.B, d.Hq, 2 * z.half()}, DType::F32);
    l.fill(-std::numeric_limits<float>::infinity());
    NDArray ob = NDArray::empty(o.shape(), DType::F32), lb = NDArray::empty(l.shape(), DType::F32);
    for (int r = 0; r < z.n; ++r) {
      const kernels::AttentionBlock blk{q, rows[c], start, k[r], v[r], rows[r], 0.3f, products,
                                        window};
      kernels::attention_block_forward(cpu_stream(), blk, ob, lb, tiles);
      if (kernels::attention_block_hidden(blk)) {  // what the ring skips adds nothing
        ++hidden;
        for (float e : lb.to_vector()) EXPECT_EQ(e, -std::numeric_limits<float>::infinity());
      }
      kernels::attention_merge(cpu_stream(), o, l, ob, lb);
    }
    expect_close(o, as_double(z.take(want[0], c, 1)), tol, "out" + rank);
    expect_close(l, as_double(z.take(want[1], c, 2)), tol, "lse" + rank);
    NDArray delta = NDArray::empty(l.shape(), DType::F32);
    NDArray dq = NDArray::zeros(q.shape(), DType::F32);
    kernels::attention_row_dots(cpu_stream(), o, go, delta);
    for (int r = 0; r < z.n; ++r)
      kernels::attention_block_backward(cpu_stream(),
          {q, rows[c], start, k[r], v[r], rows[r], 0.3f, products, window}, go, l, delta, dq,
          dk[r], dv[r], tiles);
    expect_close(dq, as_double(z.take(want[2], c, 1)), 5 * tol, "dq" + rank);
  }
  for (int r = 0; r < z.n; ++r) {
    const std::string block = " of block " + std::to_string(r);
    expect_close(dk[r], as_double(z.take(want[3], r, 1)), 5 * tol, "dk" + block);
    expect_close(dv[r], as_double(z.take(want[4], r, 1)), 5 * tol, "dv" + block);
  }
  return hidden;
}

inline double max_abs(const NDArray& a) {
  double m = 0;
  for (float v : a.to_vector()) m = std::max(m, static_cast<double>(std::fabs(v)));
  return m;
}

inline double max_diff(const NDArray& a, const NDArray& b) {
  const std::vector<float> x = a.to_vector(), y = b.to_vector();
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(x[i]) - y[i]));
  return m;
}

inline const char* const kOutputs[] = {"out", "lse", "dq", "dk", "dv"};

}  // namespace hspmd::attention_test
