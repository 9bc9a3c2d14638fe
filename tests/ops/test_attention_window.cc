// The attention op's sliding window (Mistral's): the kernels, the graph, the
// gradients and context-parallel blocks against a dense reference.
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

#include "attention_test_util.h"

namespace hspmd {
namespace {

using namespace attention_test;

// ---- sliding window ----

// Dense reference in double, forward and backward: the softmax of the full
// masked score matrix of every head. Query i of row b sees key j iff
// start[b * S + i] <= j <= i and, with a window W > 0, i - W < j (Hugging
// Face Mistral's `sliding_window`). dq, dk, dv are those of sum(out * dout).
struct Dense {
  std::vector<double> out, dq, dk, dv;
};

Dense dense_reference(const Inputs& x, const NDArray& dout, const std::vector<int64_t>& start,
                      int64_t window, float scale) {
  const int64_t B = x.q.dim(0), S = x.q.dim(1), Hq = x.q.dim(2), Hkv = x.k.dim(2), D = x.q.dim(3);
  const float *q = x.q.data<float>(), *k = x.k.data<float>(), *v = x.v.data<float>();
  const float* go = dout.data<float>();
  Dense r{std::vector<double>(B * S * Hq * D, 0.0), std::vector<double>(B * S * Hq * D, 0.0),
          std::vector<double>(B * S * Hkv * D, 0.0), std::vector<double>(B * S * Hkv * D, 0.0)};
  std::vector<double> p(S), dp(S);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < S; ++i) {
        const int64_t hk = h / (Hq / Hkv);
        const auto qa = [&](int64_t e) { return ((b * S + i) * Hq + h) * D + e; };
        const auto ka = [&](int64_t j, int64_t e) { return ((b * S + j) * Hkv + hk) * D + e; };
        const auto sees = [&](int64_t j) {
          return j <= i && j >= start[b * S + i] && (window == 0 || i - j < window);
        };
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j < S; ++j) {
          p[j] = 0;
          if (!sees(j)) continue;
          double sc = 0;
          for (int64_t e = 0; e < D; ++e) sc += double(q[qa(e)]) * k[ka(j, e)];
          p[j] = sc * scale;
          mx = std::max(mx, p[j]);
        }
        for (int64_t j = 0; j < S; ++j) sum += p[j] = sees(j) ? std::exp(p[j] - mx) : 0.0;
        double delta = 0;
        for (int64_t j = 0; j < S; ++j) {
          p[j] /= sum;
          dp[j] = 0;
          for (int64_t e = 0; e < D; ++e) {
            r.out[qa(e)] += p[j] * v[ka(j, e)];
            dp[j] += double(go[qa(e)]) * v[ka(j, e)];
          }
          delta += p[j] * dp[j];
        }
        for (int64_t j = 0; j < S; ++j) {
          if (!sees(j)) continue;
          const double ds = p[j] * (dp[j] - delta) * scale;
          for (int64_t e = 0; e < D; ++e) {
            r.dv[ka(j, e)] += p[j] * go[qa(e)];
            r.dq[qa(e)] += ds * k[ka(j, e)];
            r.dk[ka(j, e)] += ds * q[qa(e)];
          }
        }
      }
  return r;
}

std::vector<int64_t> no_documents(const Dims& d) { return std::vector<int64_t>(d.B * d.S, 0); }

double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double e : a) m = std::max(m, std::fabs(e));
  return m;
}

double max_diff(const NDArray& a, const std::vector<double>& b) {
  const std::vector<float> x = a.to_vector();
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::fabs(x[i] - b[i]));
  return m;
}

// The largest difference of out, dq, dk, dv (kernels' results: whole_attention's
// order) from the reference's, each relative to max(1, its largest value).
std::vector<double> relative_errors(const std::vector<NDArray>& got, const Dense& want) {
  const std::vector<double>* w[] = {&want.out, &want.dq, &want.dk, &want.dv};
  const NDArray* g[] = {&got[0], &got[2], &got[3], &got[4]};
  std::vector<double> e;
  for (int i = 0; i < 4; ++i) e.push_back(max_diff(*g[i], *w[i]) / std::max(1.0, max_abs(*w[i])));
  return e;
}

const char* const kWindowOutputs[] = {"out", "dq", "dk", "dv"};

// Windows around the tile size T and the sequence length S.
std::vector<int64_t> windows_around(int64_t T, int64_t S) {
  return {1, 2, T - 1, T, T + 1, S - 1, S, S + 5};
}

// Forward and backward against the dense reference: S = 37 (no multiple of
// the tiles), GQA 4 / 2, every window around the tile and the sequence.
void check_window_against_reference(DType products, double tol) {
  const Dims d{2, 37, 4, 2, 8};
  const Inputs x = random_inputs(d, 101);
  const NDArray dout = random_array({d.B, d.S, d.Hq, d.D}, 102);
  for (const AttentionTiles& t : {AttentionTiles{8, 8}, AttentionTiles{4, 5}}) {
    TilesGuard guard(t);
    for (int64_t w : windows_around(t.k, d.S)) {
      const std::vector<NDArray> got = whole_attention(x, NDArray(), dout, 0.35f, products, w);
      const Dense want = dense_reference(x, dout, no_documents(d), w, 0.35f);
      const std::vector<double> err = relative_errors(got, want);
      for (int i = 0; i < 4; ++i) {
        // W = 1: a query sees only itself, so P = 1 and dS = dP - delta = 0:
        // dq and dk vanish. With bf16 products dP (bf16 dO . V) and delta
        // (f32 dO . O) round differently, so they are dP's rounding noise.
        const bool noise = products == DType::BF16 && w == 1 && (i == 1 || i == 2);
        EXPECT_LT(err[i], noise ? 5e-2 : tol)
            << kWindowOutputs[i] << " W=" << w << " tiles " << t.q << "x" << t.k;
      }
    }
  }
}

TEST(AttentionWindow, MatchesDenseReferenceForwardAndBackward) {
  check_window_against_reference(DType::F32, 2e-5);
}

// bf16 tile products: within bf16 rounding of the exact result, the
// tolerance of Bf16ProductsFollowTheF32Kernel (1.5e-2 of the largest value).
TEST(AttentionWindow, Bf16ProductsMatchDenseReference) {
  check_window_against_reference(DType::BF16, 1.5e-2);
}

// The window is exactly W keys: the kernels match the reference of W and
// neither that of W - 1 nor that of W + 1, forward and backward.
TEST(AttentionWindow, OffByOneIsCaught) {
  const Dims d{1, 29, 4, 2, 8};
  const Inputs x = random_inputs(d, 103);
  const NDArray dout = random_array({d.B, d.S, d.Hq, d.D}, 104);
  TilesGuard guard({4, 4});
  for (int64_t w : {2, 3, 4, 5, 9, 17}) {
    const std::vector<NDArray> got = whole_attention(x, NDArray(), dout, 0.35f, DType::F32, w);
    for (int64_t ref : {w - 1, w, w + 1}) {
      const std::vector<double> err =
          relative_errors(got, dense_reference(x, dout, no_documents(d), ref, 0.35f));
      for (int i = 0; i < 4; ++i) {
        const std::string what = std::string(kWindowOutputs[i]) + " W=" + std::to_string(w) +
                                 " against the reference of W=" + std::to_string(ref);
        if (ref == w)
          EXPECT_LT(err[i], 2e-5) << what;
        else
          EXPECT_GT(err[i], 1e-3) << what;
      }
    }
  }
}

// out, dq, dk, dv of sum(out * w) through the graph, with a window.
std::vector<NDArray> graph_window(const Inputs& x, const NDArray& documents, const NDArray& w,
                                  float scale, int64_t window, bool pass_window = true) {
  Graph g;
  Tensor q = g.placeholder("q", sym_shape(x.q.shape()), DType::F32);
  Tensor k = g.placeholder("k", sym_shape(x.k.shape()), DType::F32);
  Tensor v = g.placeholder("v", sym_shape(x.v.shape()), DType::F32);
  Tensor wt = g.placeholder("w", sym_shape(w.shape()), DType::F32);
  ValueMap values{{"q", x.q}, {"k", x.k}, {"v", x.v}, {"w", w}};
  Tensor docs;
  if (documents.valid()) {
    docs = g.placeholder("docs", sym_shape(documents.shape()), DType::I32);
    values["docs"] = documents;
  }
  Tensor out = pass_window ? ops::attention(q, k, v, docs, scale, false, DType::F32, window)
                           : ops::attention(q, k, v, docs, scale);
  Tensor loss = g.add1(std::make_shared<testing::WeightedSumOp>(), {out, wt});
  std::vector<Tensor> fetch = gradients(loss, {q, k, v});
  fetch.insert(fetch.begin(), out);
  return Executor(g, fetch).run(values);
}

// Window 0 is the call without a window, bit for bit (kernels and op), and a
// window of at least S hides nothing (the same starts: bit for bit too).
TEST(AttentionWindow, ZeroAndAtLeastSequenceAreNoWindow) {
  const Dims d{2, 37, 4, 2, 8};
  const Inputs x = random_inputs(d, 105);
  const NDArray dout = random_array({d.B, d.S, d.Hq, d.D}, 106);
  const NDArray pos = positions_of({{5, 19, 13}, {37}});
  for (const AttentionTiles& t : {AttentionTiles{64, 64}, AttentionTiles{4, 5}}) {
    TilesGuard guard(t);
    for (const NDArray& docs : {NDArray(), pos}) {
      for (DType products : {DType::F32, DType::BF16}) {
        const std::vector<NDArray> none = whole_attention(x, docs, dout, 0.35f, products);
        for (int64_t w : {int64_t{0}, d.S, d.S + 5, int64_t{1} << 40}) {
          const std::vector<NDArray> got = whole_attention(x, docs, dout, 0.35f, products, w);
          for (int i = 0; i < 5; ++i)
            expect_equal(got[i], none[i], std::string(kOutputs[i]) + " W=" + std::to_string(w));
        }
      }
      const std::vector<NDArray> plain = graph_window(x, docs, dout, 0.35f, 0, false);
      for (int64_t w : {int64_t{0}, d.S}) {
        const std::vector<NDArray> got = graph_window(x, docs, dout, 0.35f, w);
        for (int i = 0; i < 4; ++i)
          expect_equal(got[i], plain[i], std::string("graph ") + kWindowOutputs[i]);
      }
    }
  }
}

// The op passes its window to the forward and to the gradient op.
TEST(AttentionWindow, ThroughTheGraph) {
  const Dims d{2, 37, 4, 2, 8};
  const Inputs x = random_inputs(d, 107);
  const NDArray dout = random_array({d.B, d.S, d.Hq, d.D}, 108);
  TilesGuard guard({8, 8});
  for (int64_t w : {1, 7, 20}) {
    const std::vector<NDArray> got = graph_window(x, NDArray(), dout, 0.35f, w);
    const std::vector<NDArray> as_kernels = {got[0], NDArray(), got[1], got[2], got[3]};
    const std::vector<double> err =
        relative_errors(as_kernels, dense_reference(x, dout, no_documents(d), w, 0.35f));
    for (int i = 0; i < 4; ++i) EXPECT_LT(err[i], 2e-5) << kWindowOutputs[i] << " W=" << w;
  }
}

// Window and packed documents: query i sees max(start(i), i - W + 1) <= j <= i;
// positions give bit for bit what cu_seqlens of the same documents give; a
// packed row is each document attended alone with the same window.
TEST(AttentionWindow, WithPackedDocuments) {
  const Dims d{2, 70, 4, 2, 8};
  const NDArray pos = positions_of({{10, 35, 25}, {1, 29, 40}});
  const NDArray cu = cu_array({0, 10, 45, 70, 71, 100, 140});
  const Inputs x = random_inputs(d, 109);
  const NDArray dout = random_array({d.B, d.S, d.Hq, d.D}, 110);
  for (const AttentionTiles& t : kSmallTiles) {
    TilesGuard guard(t);
    for (int64_t w : {1, 3, 8, 17, 36}) {
      const std::string what = "W=" + std::to_string(w) + " tiles " + std::to_string(t.q) + "x" +
                               std::to_string(t.k);
      const std::vector<NDArray> by_pos = whole_attention(x, pos, dout, 0.3f, DType::F32, w);
      const std::vector<NDArray> by_cu = whole_attention(x, cu, dout, 0.3f, DType::F32, w);
      const std::vector<double> err =
          relative_errors(by_pos, dense_reference(x, dout, starts_of(pos), w, 0.3f));
      for (int i = 0; i < 4; ++i) EXPECT_LT(err[i], 2e-5) << kWindowOutputs[i] << " " << what;
      for (int i = 0; i < 5; ++i) expect_equal(by_cu[i], by_pos[i], kOutputs[i] + (" " + what));
    }
  }
  TilesGuard guard({8, 8});
  const NDArray w = random_array({d.B, d.S, d.Hq, d.D}, 111);
  const std::vector<NDArray> packed = graph_window(x, pos, w, 0.3f, 6);
  const std::vector<int> lengths = {10, 35, 25, 1, 29, 40};
  int64_t begin = 0;
  for (int len : lengths) {
    const int64_t end = begin + len;
    const Inputs doc{tokens(x.q, begin, end), tokens(x.k, begin, end), tokens(x.v, begin, end)};
    const std::vector<NDArray> alone = graph_window(doc, NDArray(), tokens(w, begin, end), 0.3f, 6);
    for (int i = 0; i < 4; ++i) {
      const NDArray mine = tokens(packed[i], begin, end);
      for (int64_t e = 0; e < alone[i].numel(); ++e)
        ASSERT_NEAR(mine.data<float>()[e], alone[i].data<float>()[e], 1e-5)
            << kWindowOutputs[i] << " of tokens [" << begin << ", " << end << ") element " << e;
    }
    begin = end;
  }
}

TEST(AttentionWindow, Gradients) {
  const Dims d{2, 7, 4, 2, 4};
  const Inputs x = random_inputs(d, 112);
  const NDArray pos = positions_of({{3, 4}, {2, 5}});
  for (const auto& tiles : {AttentionTiles{64, 64}, AttentionTiles{3, 2}, AttentionTiles{2, 3}})
    for (int64_t w : {1, 2, 3}) {
      TilesGuard guard(tiles);
      expect_gradients_match(
          [w](Graph&, const std::vector<Tensor>& t) {
            return ops::attention(t[0], t[1], t[2], Tensor(), 0.5f, false, DType::F32, w);
          },
          {{"q", x.q}, {"k", x.k}, {"v", x.v}});
      expect_gradients_match(
          [w](Graph&, const std::vector<Tensor>& t) {
            return ops::attention(t[0], t[1], t[2], t[3], 0.5f, false, DType::F32, w);
          },
          {{"q", x.q}, {"k", x.k}, {"v", x.v}, {"pos", pos, false}});
    }
}

// Large enough for the multi-threaded path (and many skipped tiles).
TEST(AttentionWindow, ParallelPathMatchesReference) {
  const int saved = num_threads();
  set_num_threads(2);
  const Dims d{2, 256, 4, 2, 16};
  const Inputs x = random_inputs(d, 113);
  const NDArray dout = random_array({d.B, d.S, d.Hq, d.D}, 114);
  TilesGuard guard({16, 16});
  for (int64_t w : {5, 40}) {
    const std::vector<double> err =
        relative_errors(whole_attention(x, NDArray(), dout, 0.25f, DType::F32, w),
                        dense_reference(x, dout, no_documents(d), w, 0.25f));
    for (int i = 0; i < 4; ++i) EXPECT_LT(err[i], 2e-5) << kWindowOutputs[i] << " W=" << w;
  }
  set_num_threads(saved);
}

// Ring attention's blocks with a window, in one process (cp = 2 and 4): a
// window below half a chunk hides whole blocks (skipped), one spanning
// several chunks crosses every block boundary; merged, the blocks give the
// whole kernel's results.
TEST(AttentionWindow, ZigzagBlocksMatchTheWholeSequence) {
  for (int n : {2, 4})
    for (bool documents : {false, true}) {
      // S = 24: halves of 6 (n = 2) or 3 (n = 4).
      // n = 2: every pair of blocks has adjacent halves, so no block is hidden.
      const int hidden = check_zigzag_blocks(DType::F32, 2e-6, n, 2, documents);
      if (n == 4) {
        EXPECT_GT(hidden, 0);
      }
      EXPECT_EQ(check_zigzag_blocks(DType::F32, 2e-6, n, 13, documents), 0) << "n=" << n;
      check_zigzag_blocks(DType::F32, 2e-6, n, 5, documents);
    }
  check_zigzag_blocks(DType::BF16, 4e-3, 4, 2);
  check_zigzag_blocks(DType::BF16, 4e-3, 2, 13);
}

// Rows that see nothing of a block (lse_blk -inf) keep their values, also
// when the running result is empty too: no NaN from exp(-inf - -inf).
TEST(AttentionWindow, MergeOfHiddenRowsKeepsValues) {
  const float inf = std::numeric_limits<float>::infinity();
  NDArray out = NDArray::from_vector({1, 3, 1, 2}, {1, 2, 3, 4, 0, 0});
  NDArray lse = NDArray::from_vector({1, 1, 3}, {0.5f, 0.25f, -inf});
  const NDArray ob = NDArray::from_vector({1, 3, 1, 2}, {7, 7, 5, 6, 9, 9});
  const NDArray lb = NDArray::from_vector({1, 1, 3}, {-inf, 0.25f, -inf});
  kernels::attention_merge(cpu_stream(), out, lse, ob, lb);
  const std::vector<float> o = out.to_vector(), l = lse.to_vector();
  EXPECT_EQ(o[0], 1.0f);
  EXPECT_EQ(o[1], 2.0f);
  EXPECT_FLOAT_EQ(o[2], 4.0f);  // equal weights: the mean
  EXPECT_FLOAT_EQ(o[3], 5.0f);
  EXPECT_EQ(o[4], 0.0f);
  EXPECT_EQ(o[5], 0.0f);
  EXPECT_EQ(l[0], 0.5f);
  EXPECT_FLOAT_EQ(l[1], 0.25f + std::log(2.0f));
  EXPECT_EQ(l[2], -inf);
}

TEST(AttentionWindow, NegativeWindowIsAnError) {
  Graph g;
  Tensor q = g.placeholder("q", {1, 4, 2, 4}, DType::F32);
  Tensor kv = g.placeholder("kv", {1, 4, 1, 4}, DType::F32);
  std::string msg;
  try {
    ops::attention(q, kv, kv, Tensor(), 1.0f, false, DType::F32, -1);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_EQ(msg.rfind("[attention] window: ", 0), 0u) << "'" << msg << "'";
  const Inputs x = random_inputs({1, 4, 2, 1, 4}, 115);
  NDArray out = NDArray::empty(x.q.shape(), DType::F32), lse = NDArray::empty({1, 2, 4}, DType::F32);
  EXPECT_THROW(kernels::attention_forward(cpu_stream(), x.q, x.k, x.v, NDArray(), 1.0f, out, lse,
                                          kernels::attention_tiles(), DType::F32, -3),
               Error);
}

}  // namespace
}  // namespace hspmd
