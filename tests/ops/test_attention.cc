#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "annotation/deduce_test_util.h"
#include "gradcheck.h"
#include "hspmd/core/threads.h"
#include "hspmd/ops/autodiff.h"
#include "hspmd/ops/ops.h"
#include "kernels/attention.h"
#include "kernels/basic.h"
#include "kernels/cpu/bf16_pairs.h"

namespace hspmd {
namespace {

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

Inputs random_inputs(const Dims& d, uint64_t seed) {
  return {random_array({d.B, d.S, d.Hq, d.D}, seed), random_array({d.B, d.S, d.Hkv, d.D}, seed + 1),
          random_array({d.B, d.S, d.Hkv, d.D}, seed + 2)};
}

// Attention through the graph with symbolic B and S; `documents` is invalid,
// cu_seqlens [n+1] or positions [B, S].
NDArray run_with_documents(const Inputs& x, const NDArray& documents, float scale) {
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

NDArray cu_array(const std::vector<int32_t>& cu) {
  return NDArray::from_vector_i32({static_cast<int64_t>(cu.size())}, cu);
}

// cu empty means no cu_seqlens.
NDArray run_attention(const Inputs& x, const std::vector<int32_t>& cu, float scale) {
  return run_with_documents(x, cu.empty() ? NDArray() : cu_array(cu), scale);
}

// Naive reference in double: the full masked score matrix per head. Query i
// of row b sees key j iff start[b * S + i] <= j <= i.
std::vector<double> reference_starts(const Inputs& x, const std::vector<int64_t>& start,
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
std::vector<double> reference(const Inputs& x, const std::vector<int32_t>& cu, float scale) {
  const int64_t S = x.q.dim(1);
  std::vector<int64_t> start(x.q.dim(0) * S, 0);
  for (size_t d = 0; !cu.empty() && d + 1 < cu.size(); ++d)
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t) start[t] = cu[d] - t / S * S;
  return reference_starts(x, start, scale);
}

void expect_close(const NDArray& got, const std::vector<double>& want, double tol,
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

const AttentionTiles kSmallTiles[] = {{64, 64}, {3, 2}, {4, 5}, {16, 16}};

TEST(Attention, ForwardMatchesReference) {
  const Dims shapes[] = {{2, 7, 4, 4, 4}, {2, 70, 4, 2, 8}, {1, 70, 8, 2, 16},
                         {3, 33, 4, 1, 8}, {1, 130, 2, 1, 32}};
  for (const auto& tiles : kSmallTiles) {
    TilesGuard guard(tiles);
    for (const auto& d : shapes) {
      const Inputs x = random_inputs(d, 11);
      const float scale = 1.0f / std::sqrt(static_cast<float>(d.D));
      expect_close(run_attention(x, {}, scale), reference(x, {}, scale), 2e-5,
                   "S=" + std::to_string(d.S) + " G=" + std::to_string(d.Hq / d.Hkv) +
                       " tiles=" + std::to_string(tiles.q) + "x" + std::to_string(tiles.k));
    }
  }
}

TEST(Attention, DocumentsMatchReference) {
  const Dims d{2, 70, 4, 2, 8};
  const std::vector<int32_t> cu = {0, 10, 10, 45, 70, 71, 100, 140};  // an empty document too
  const Inputs x = random_inputs(d, 21);
  for (const auto& tiles : kSmallTiles) {
    TilesGuard guard(tiles);
    expect_close(run_attention(x, cu, 0.3f), reference(x, cu, 0.3f), 2e-5,
                 "tiles=" + std::to_string(tiles.q) + "x" + std::to_string(tiles.k));
  }
}

NDArray tokens(const NDArray& a, int64_t begin, int64_t end) {
  NDArray flat = a.reshape({a.dim(0) * a.dim(1), a.dim(2), a.dim(3)});
  return flat.slice(0, begin, end).contiguous().reshape({1, end - begin, a.dim(2), a.dim(3)});
}

TEST(Attention, VariableLengthEqualsPerDocumentAttention) {
  const Dims d{3, 40, 8, 2, 16};
  const std::vector<int32_t> cu = {0, 1, 17, 40, 80, 85, 85, 120};
  const Inputs x = random_inputs(d, 31);
  TilesGuard guard({8, 8});
  const NDArray packed = run_attention(x, cu, 0.25f);
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    if (cu[i] == cu[i + 1]) continue;
    const Inputs doc{tokens(x.q, cu[i], cu[i + 1]), tokens(x.k, cu[i], cu[i + 1]),
                     tokens(x.v, cu[i], cu[i + 1])};
    const NDArray alone = run_attention(doc, {}, 0.25f);
    const NDArray mine = tokens(packed, cu[i], cu[i + 1]);
    for (int64_t e = 0; e < alone.numel(); ++e)
      ASSERT_NEAR(mine.data<float>()[e], alone.data<float>()[e], 1e-5)
          << "document " << i << " element " << e;
  }
}

void check_gradients(const Dims& d, const std::vector<int32_t>& cu) {
  const Inputs x = random_inputs(d, 41);
  std::vector<testing::GradInput> in = {{"q", x.q}, {"k", x.k}, {"v", x.v}};
  if (!cu.empty())
    in.push_back({"cu", NDArray::from_vector_i32({static_cast<int64_t>(cu.size())}, cu), false});
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) {
        return ops::attention(t[0], t[1], t[2], t.size() > 3 ? t[3] : Tensor(), 0.5f);
      },
      in);
}

TEST(Attention, Gradients) {
  for (const auto& tiles : {AttentionTiles{64, 64}, AttentionTiles{3, 2}, AttentionTiles{2, 3}}) {
    TilesGuard guard(tiles);
    check_gradients({2, 7, 4, 2, 4}, {});
    check_gradients({2, 7, 4, 1, 4}, {});
  }
}

TEST(Attention, GradientsWithDocuments) {
  for (const auto& tiles : {AttentionTiles{64, 64}, AttentionTiles{3, 2}, AttentionTiles{2, 3}}) {
    TilesGuard guard(tiles);
    check_gradients({2, 7, 4, 2, 4}, {0, 3, 7, 7, 9, 14});
    check_gradients({2, 7, 4, 4, 4}, {0, 1, 2, 7, 13, 14});
  }
}

// d(sum(out * w))/d(q, k, v) through the graph.
std::vector<NDArray> run_gradients(const Inputs& x, const NDArray& w, float scale) {
  Graph g;
  Tensor q = g.placeholder("q", sym_shape(x.q.shape()), DType::F32);
  Tensor k = g.placeholder("k", sym_shape(x.k.shape()), DType::F32);
  Tensor v = g.placeholder("v", sym_shape(x.v.shape()), DType::F32);
  Tensor wt = g.placeholder("w", sym_shape(w.shape()), DType::F32);
  Tensor loss = g.add1(std::make_shared<testing::WeightedSumOp>(),
                       {ops::attention(q, k, v, Tensor(), scale), wt});
  return Executor(g, gradients(loss, {q, k, v})).run({{"q", x.q}, {"k", x.k}, {"v", x.v}, {"w", w}});
}

// Large enough for the kernels' multi-threaded path; different tilings must
// agree, and the forward must still match the reference.
TEST(Attention, ParallelPathIsConsistent) {
  const int saved = num_threads();
  set_num_threads(2);
  const Dims d{2, 256, 4, 2, 16};
  const Inputs x = random_inputs(d, 61);
  const NDArray w = random_array({d.B, d.S, d.Hq, d.D}, 62);
  expect_close(run_attention(x, {}, 0.25f), reference(x, {}, 0.25f), 2e-5, "S=256");
  const std::vector<NDArray> big = run_gradients(x, w, 0.25f);
  TilesGuard guard({8, 16});
  const std::vector<NDArray> small = run_gradients(x, w, 0.25f);
  set_num_threads(saved);
  for (size_t i = 0; i < 3; ++i)
    for (int64_t e = 0; e < big[i].numel(); ++e)
      ASSERT_NEAR(big[i].data<float>()[e], small[i].data<float>()[e], 1e-4)
          << "gradient " << i << " element " << e;
}

TEST(Attention, GradientForCuSeqlensIsUndefined) {
  Graph g;
  Tensor q = g.placeholder("q", {1, 4, 2, 4}, DType::F32);
  Tensor kv = g.placeholder("kv", {1, 4, 1, 4}, DType::F32);
  Tensor cu = g.placeholder("cu", {3}, DType::I32);
  Tensor out = ops::attention(q, kv, kv, cu, 1.0f);
  const Node& node = out.node();
  std::vector<Tensor> grads = node.op->gradient(node, {out, Tensor()});
  ASSERT_EQ(grads.size(), 4u);
  EXPECT_TRUE(grads[0].valid() && grads[1].valid() && grads[2].valid());
  EXPECT_FALSE(grads[3].valid());
}

TEST(Attention, ShapeErrors) {
  Graph g;
  const SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
  Tensor q = g.placeholder("q", {B, S, 4, 8}, DType::F32);
  Tensor k3 = g.placeholder("k3", {B, S, 3, 8}, DType::F32);
  Tensor k2 = g.placeholder("k2", {B, S, 2, 8}, DType::F32);
  Tensor k_d = g.placeholder("kd", {B, S, 2, 4}, DType::F32);
  Tensor k_s = g.placeholder("ks", {B, 5, 2, 8}, DType::F32);
  Tensor flat = g.placeholder("flat", {B, S, 16}, DType::F32);
  Tensor cu_f = g.placeholder("cuf", {3}, DType::F32);
  EXPECT_THROW(ops::attention(q, k3, k3, Tensor(), 1.0f), Error);
  EXPECT_THROW(ops::attention(q, k_d, k_d, Tensor(), 1.0f), Error);
  EXPECT_THROW(ops::attention(q, k_s, k_s, Tensor(), 1.0f), Error);
  EXPECT_THROW(ops::attention(q, k2, k_d, Tensor(), 1.0f), Error);
  EXPECT_THROW(ops::attention(flat, k2, k2, Tensor(), 1.0f), Error);
  EXPECT_THROW(ops::attention(q, k2, k2, cu_f, 1.0f), Error);
  EXPECT_NO_THROW(ops::attention(q, k2, k2, Tensor(), 1.0f));
  try {
    ops::attention(q, k3, k3, Tensor(), 1.0f);
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("[attention] ", 0), 0u) << e.what();
  }
}

// Runs B=2, S=7 attention with `cu` and returns the error message ("" if none).
std::string cu_error(const std::vector<int32_t>& cu) {
  try {
    run_attention(random_inputs({2, 7, 2, 1, 4}, 51), cu, 1.0f);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Attention, BadCuSeqlensIsAnError) {
  const std::vector<std::vector<int32_t>> bad = {
      {0, 5, 14},      // row boundary 7 missing
      {0, 9, 7, 14},   // decreasing
      {0, 7, 13},      // wrong total
      {0, 7, 15},      // wrong total
      {1, 7, 14},      // first offset not 0
      {0},             // too short
  };
  for (const auto& cu : bad) {
    const std::string msg = cu_error(cu);
    EXPECT_EQ(msg.rfind("[attention] cu_seqlens: ", 0), 0u) << "'" << msg << "'";
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  EXPECT_EQ(cu_error({0, 3, 7, 7, 14}), "");
}

// ---- documents as positions ----

// Positions [B, S] of packed documents: one list of document lengths per row.
NDArray positions_of(const std::vector<std::vector<int>>& rows) {
  std::vector<int32_t> pos;
  for (const auto& lengths : rows)
    for (int len : lengths)
      for (int i = 0; i < len; ++i) pos.push_back(i);
  const int64_t B = static_cast<int64_t>(rows.size());
  return NDArray::from_vector_i32({B, static_cast<int64_t>(pos.size()) / B}, pos);
}

// The rule of positions, straight: start = max(0, i - positions[i]).
std::vector<int64_t> starts_of(const NDArray& positions) {
  const int64_t S = positions.dim(1);
  std::vector<int64_t> start(positions.numel());
  for (int64_t t = 0; t < positions.numel(); ++t)
    start[t] = std::max<int64_t>(0, t % S - positions.data<int32_t>()[t]);
  return start;
}

void expect_equal(const NDArray& a, const NDArray& b, const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  for (int64_t e = 0; e < a.numel(); ++e)
    ASSERT_EQ(a.data<float>()[e], b.data<float>()[e]) << what << ": element " << e;
}

TEST(Attention, PositionsMatchReferenceAndCuSeqlens) {
  const Dims d{2, 70, 4, 2, 8};
  const NDArray pos = positions_of({{10, 35, 25}, {1, 29, 40}});
  const std::vector<int32_t> cu = {0, 10, 45, 70, 71, 100, 140};
  const Inputs x = random_inputs(d, 71);
  for (const auto& tiles : kSmallTiles) {
    TilesGuard guard(tiles);
    const std::string what = "tiles=" + std::to_string(tiles.q) + "x" + std::to_string(tiles.k);
    const NDArray got = run_with_documents(x, pos, 0.3f);
    expect_close(got, reference(x, cu, 0.3f), 2e-5, what);
    expect_equal(got, run_attention(x, cu, 0.3f), what + " vs cu_seqlens");
  }
}

TEST(Attention, PositionsEqualPerDocumentAttention) {
  const Dims d{3, 40, 8, 2, 16};
  const std::vector<std::vector<int>> rows = {{1, 16, 23}, {40}, {5, 5, 30}};
  const Inputs x = random_inputs(d, 72);
  TilesGuard guard({8, 8});
  const NDArray packed = run_with_documents(x, positions_of(rows), 0.25f);
  int64_t begin = 0;
  for (const auto& lengths : rows)
    for (int len : lengths) {
      const int64_t end = begin + len;
      const Inputs doc{tokens(x.q, begin, end), tokens(x.k, begin, end), tokens(x.v, begin, end)};
      const NDArray alone = run_with_documents(doc, NDArray(), 0.25f);
      const NDArray mine = tokens(packed, begin, end);
      for (int64_t e = 0; e < alone.numel(); ++e)
        ASSERT_NEAR(mine.data<float>()[e], alone.data<float>()[e], 1e-5)
            << "tokens [" << begin << ", " << end << ") element " << e;
      begin = end;
    }
}

TEST(Attention, PositionsFromZeroArePlainCausal) {
  const Dims d{2, 33, 4, 1, 8};
  const Inputs x = random_inputs(d, 73);
  TilesGuard guard({4, 5});
  expect_equal(run_with_documents(x, positions_of({{33}, {33}}), 0.4f), run_attention(x, {}, 0.4f),
               "positions 0..S-1");
}

// Positions that jump up (pos[i+1] > pos[i] + 1) give starts that fall along
// the row: tiles must take the least / greatest start of their rows.
TEST(Attention, PositionsWithJumpsFollowTheRule) {
  const Dims d{1, 40, 2, 1, 8};
  std::vector<int32_t> p(40);
  for (int i = 0; i < 40; ++i) p[i] = i < 9 ? i : i < 20 ? i - 9 + 30 : i < 27 ? i - 20 : i % 3 * 5;
  const NDArray pos = NDArray::from_vector_i32({1, 40}, p);
  const Inputs x = random_inputs(d, 74);
  for (const auto& tiles : kSmallTiles) {
    TilesGuard guard(tiles);
    expect_close(run_with_documents(x, pos, 0.5f), reference_starts(x, starts_of(pos), 0.5f), 2e-5,
                 "tiles=" + std::to_string(tiles.q) + "x" + std::to_string(tiles.k));
  }
}

TEST(Attention, GradientsWithPositions) {
  const Dims d{2, 7, 4, 2, 4};
  const Inputs x = random_inputs(d, 75);
  for (const NDArray& pos :
       {positions_of({{3, 4}, {2, 5}}),
        NDArray::from_vector_i32({2, 7}, {0, 1, 2, 0, 1, 2, 6, 0, 0, 1, 2, 3, 9, 0})}) {
    for (const auto& tiles : {AttentionTiles{64, 64}, AttentionTiles{3, 2}, AttentionTiles{2, 3}}) {
      TilesGuard guard(tiles);
      expect_gradients_match(
          [](Graph&, const std::vector<Tensor>& t) {
            return ops::attention(t[0], t[1], t[2], t[3], 0.5f);
          },
          {{"q", x.q}, {"k", x.k}, {"v", x.v}, {"pos", pos, false}});
    }
  }
}

TEST(Attention, BadPositionsIsAnError) {
  const Inputs x = random_inputs({2, 7, 2, 1, 4}, 76);
  std::vector<int32_t> p(14, 0);
  p[9] = -1;
  std::string msg;
  try {
    run_with_documents(x, NDArray::from_vector_i32({2, 7}, p), 1.0f);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_EQ(msg.rfind("[attention] document positions: ", 0), 0u) << "'" << msg << "'";
  EXPECT_NE(msg.find("positions >= 0"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;

  Graph g;
  Tensor q = g.placeholder("q", {2, 7, 2, 4}, DType::F32);
  Tensor kv = g.placeholder("kv", {2, 7, 1, 4}, DType::F32);
  Tensor long_pos = g.placeholder("p8", {2, 8}, DType::I32);
  Tensor f32_pos = g.placeholder("pf", {2, 7}, DType::F32);
  Tensor cube = g.placeholder("p3", {2, 7, 1}, DType::I32);
  for (const Tensor& bad : {long_pos, f32_pos, cube}) {
    try {
      ops::attention(q, kv, kv, bad, 1.0f);
      ADD_FAILURE() << "no error for documents " << sym_shape_str(bad.shape());
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("[attention] ", 0), 0u) << e.what();
    }
  }
}

// Deduction: positions [B, S] are split exactly like q's batch and sequence.
TEST(Attention, PositionsSplitLikeTheTokens) {
  using deduce_test::on;
  const SymDim B = deduce_test::B, S = deduce_test::S;
  Graph g;
  Tensor q = g.placeholder("q", {B, S, 4, 2}, DType::F32);
  Tensor k = g.placeholder("k", {B, S, 2, 2}, DType::F32);
  Tensor pos = g.placeholder("pos", {B, S}, DType::I32);
  Tensor out = ops::attention(q, k, k, pos, 0.5f, true);
  std::vector<Tensor> grads = gradients(ops::reduce_sum(out), {q, k});
  const Annotation seq = on({0, 1}, {{1, 2}}, {1}), batch = on({0, 1}, {{0, 2}}, {0});
  for (const Annotation& a : {seq, batch}) {
    AnnotatedGraph ag = deduce(g, {{"q", a}, {"k", a}, {"pos", a}}, 2);
    EXPECT_EQ(ag.of(out), a);
    EXPECT_EQ(ag.of(grads[0]), a);
    EXPECT_EQ(ag.of(grads[1]), a);
  }
  deduce_test::expect_error(g, {{"q", seq}, {"k", seq}, {"pos", on({0, 1}, {{kDup, 2}}, {kDup})}},
                            2, {"input 0 (q) splits dim 1 by 2 but input 3 (positions)"});
  Graph g2;
  Tensor q2 = g2.placeholder("q", {B, S, 4, 2}, DType::F32);
  Tensor cu = g2.placeholder("cu", {SymDim::symbol("N")}, DType::I32);
  ops::attention(q2, q2, q2, cu, 0.5f, true);
  deduce_test::expect_error(g2, {{"q", seq}, {"cu", on({0, 1}, {{0, 2}}, {0})}}, 2,
                            {"every device needs all document boundaries"});
}

// ---- blocks of context-parallel attention, in one process ----

std::vector<double> as_double(const NDArray& a) {
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
  // Per query of block r, the global index where its document starts.
  std::vector<int32_t> starts(const NDArray& positions, int r) const {
    const std::vector<int64_t> all = starts_of(positions);
    std::vector<int32_t> start;
    for (int64_t b = 0; b < positions.dim(0); ++b)
      for (int64_t i : rows(r)) start.push_back(static_cast<int32_t>(all[b * S + i]));
    return start;
  }
};

// The whole-sequence kernels' results: out, lse, dq, dk, dv.
std::vector<NDArray> whole_attention(const Inputs& x, const NDArray& pos, const NDArray& dout,
                                     float scale, DType products = DType::F32) {
  const kernels::AttentionTiles tiles = kernels::attention_tiles();
  NDArray out = NDArray::empty(x.q.shape(), DType::F32);
  NDArray lse = NDArray::empty({x.q.dim(0), x.q.dim(2), x.q.dim(1)}, DType::F32);
  kernels::attention_forward(x.q, x.k, x.v, pos, scale, out, lse, tiles, products);
  NDArray dq = NDArray::empty(x.q.shape(), DType::F32);
  NDArray dk = NDArray::empty(x.k.shape(), DType::F32);
  NDArray dv = NDArray::empty(x.k.shape(), DType::F32);
  kernels::attention_backward(x.q, x.k, x.v, out, lse, dout, pos, scale, dq, dk, dv, tiles,
                              products);
  return {out, lse, dq, dk, dv};
}

// Every block's queries over every block, merged, give the whole kernel's
// out and lse; the blocks' backward shares sum to its gradients. Tolerances:
// tol for out and lse, 5 tol for the gradients.
void check_zigzag_blocks(DType products, double tol) {
  const Dims d{2, 24, 4, 2, 8};
  const Zigzag z{3, d.S};
  const NDArray pos = positions_of({{4, 9, 11}, {13, 1, 10}});
  const Inputs x = random_inputs(d, 77);
  const NDArray dout = random_array({d.B, d.S, d.Hq, d.D}, 78);
  TilesGuard guard({3, 2});
  const kernels::AttentionTiles tiles = kernels::attention_tiles();
  const std::vector<NDArray> want = whole_attention(x, pos, dout, 0.3f, products);
  std::vector<NDArray> k(z.n), v(z.n), dk(z.n), dv(z.n);
  std::vector<std::vector<int64_t>> rows(z.n);
  for (int r = 0; r < z.n; ++r) {
    k[r] = z.take(x.k, r, 1), v[r] = z.take(x.v, r, 1), rows[r] = z.rows(r);
    dk[r] = NDArray::zeros(k[r].shape(), DType::F32);
    dv[r] = NDArray::zeros(k[r].shape(), DType::F32);
  }
  for (int c = 0; c < z.n; ++c) {
    const std::string rank = " of rank " + std::to_string(c);
    const std::vector<int32_t> start = z.starts(pos, c);
    const NDArray q = z.take(x.q, c, 1), go = z.take(dout, c, 1);
    NDArray o = NDArray::zeros(q.shape(), DType::F32);
    NDArray l = NDArray::empty({d.B, d.Hq, 2 * z.half()}, DType::F32);
    l.fill(-std::numeric_limits<float>::infinity());
    NDArray ob = NDArray::empty(o.shape(), DType::F32), lb = NDArray::empty(l.shape(), DType::F32);
    for (int r = 0; r < z.n; ++r) {
      kernels::attention_block_forward({q, rows[c], start, k[r], v[r], rows[r], 0.3f, products},
                                       ob, lb, tiles);
      kernels::attention_merge(o, l, ob, lb);
    }
    expect_close(o, as_double(z.take(want[0], c, 1)), tol, "out" + rank);
    expect_close(l, as_double(z.take(want[1], c, 2)), tol, "lse" + rank);
    NDArray delta = NDArray::empty(l.shape(), DType::F32);
    NDArray dq = NDArray::zeros(q.shape(), DType::F32);
    kernels::attention_row_dots(o, go, delta);
    for (int r = 0; r < z.n; ++r)
      kernels::attention_block_backward({q, rows[c], start, k[r], v[r], rows[r], 0.3f, products},
                                        go, l, delta, dq, dk[r], dv[r], tiles);
    expect_close(dq, as_double(z.take(want[2], c, 1)), 5 * tol, "dq" + rank);
  }
  for (int r = 0; r < z.n; ++r) {
    const std::string block = " of block " + std::to_string(r);
    expect_close(dk[r], as_double(z.take(want[3], r, 1)), 5 * tol, "dk" + block);
    expect_close(dv[r], as_double(z.take(want[4], r, 1)), 5 * tol, "dv" + block);
  }
}

TEST(Attention, ZigzagBlocksMatchTheWholeSequence) { check_zigzag_blocks(DType::F32, 2e-6); }

// With bf16 products the blocks round the same operands as the whole kernel;
// only the forward's probabilities are rounded after a different running
// max, so they agree to a few bf16 roundings.
TEST(Attention, ZigzagBlocksMatchTheWholeSequenceInBf16) {
  check_zigzag_blocks(DType::BF16, 4e-3);
}

// ---- bf16 tile products ----

double max_abs(const NDArray& a) {
  double m = 0;
  for (float v : a.to_vector()) m = std::max(m, static_cast<double>(std::fabs(v)));
  return m;
}

double max_diff(const NDArray& a, const NDArray& b) {
  const std::vector<float> x = a.to_vector(), y = b.to_vector();
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(x[i]) - y[i]));
  return m;
}

const char* const kOutputs[] = {"out", "lse", "dq", "dk", "dv"};

// Odd S, odd D, GQA and documents with odd starts: bf16 products stay within
// bf16 rounding of the f32 kernel (relative to each output's largest value),
// and differ from it (they are really used), for any tiles.
TEST(Attention, Bf16ProductsFollowTheF32Kernel) {
  const Dims d{2, 37, 4, 2, 7};
  const NDArray pos = positions_of({{5, 19, 13}, {37}});
  const Inputs x = random_inputs(d, 91);
  const NDArray dout = random_array({d.B, d.S, d.Hq, d.D}, 92);
  for (const AttentionTiles& t : kSmallTiles) {
    TilesGuard guard(t);
    const std::string tiles = " (tiles " + std::to_string(t.q) + "x" + std::to_string(t.k) + ")";
    const std::vector<NDArray> f32 = whole_attention(x, pos, dout, 0.4f);
    const std::vector<NDArray> bf16 = whole_attention(x, pos, dout, 0.4f, DType::BF16);
    for (int i = 0; i < 5; ++i) {
      const double scale = std::max(1.0, max_abs(f32[i])), diff = max_diff(bf16[i], f32[i]);
      EXPECT_LT(diff, 1.5e-2 * scale) << kOutputs[i] << tiles;
      EXPECT_GT(diff, 1e-6 * scale) << kOutputs[i] << tiles << ": bf16 products were not used";
    }
  }
}

// A row's results do not depend on the other rows of its batch, bit for bit
// (micro-batches of any size give the same attention).
TEST(Attention, Bf16ProductsOfARowDoNotDependOnItsBatch) {
  const Dims d{3, 200, 4, 2, 16};
  const Inputs x = random_inputs(d, 95);
  const NDArray dout = random_array({d.B, d.S, d.Hq, d.D}, 96);
  const NDArray pos = positions_of({{200}, {70, 130}, {200}});
  const std::vector<NDArray> all = whole_attention(x, pos, dout, 0.4f, DType::BF16);
  const auto row = [](const NDArray& a, int64_t b) {
    Shape s = a.shape();
    s[0] = 1;
    NDArray r = NDArray::empty(s, DType::F32);
    std::copy_n(a.data<float>() + b * r.numel(), r.numel(), r.data<float>());
    return r;
  };
  const Inputs one{row(x.q, 1), row(x.k, 1), row(x.v, 1)};
  const std::vector<NDArray> alone =
      whole_attention(one, positions_of({{70, 130}}), row(dout, 1), 0.4f, DType::BF16);
  for (int i = 0; i < 5; ++i) expect_equal(alone[i], row(all[i], 1), kOutputs[i]);
}

// The AVX512-BF16 code and the portable fallback multiply the same bf16
// values with f32 sums: they agree to f32 rounding.
TEST(Attention, Bf16ProductsNativeAndFallbackAgree) {
  if (!kernels::bf16_pairs_native()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const Dims d{2, 29, 4, 1, 16};
  const NDArray pos = positions_of({{29}, {3, 26}});
  const Inputs x = random_inputs(d, 93);
  const NDArray dout = random_array({d.B, d.S, d.Hq, d.D}, 94);
  TilesGuard guard({8, 6});
  const std::vector<NDArray> native = whole_attention(x, pos, dout, 0.4f, DType::BF16);
  kernels::set_bf16_gemm_emulation(true);
  ASSERT_FALSE(kernels::bf16_pairs_native());
  const std::vector<NDArray> fallback = whole_attention(x, pos, dout, 0.4f, DType::BF16);
  kernels::set_bf16_gemm_emulation(false);
  for (int i = 0; i < 5; ++i)
    EXPECT_LT(max_diff(native[i], fallback[i]), 1e-5 * std::max(1.0, max_abs(fallback[i])))
        << kOutputs[i];
}

}  // namespace
}  // namespace hspmd
