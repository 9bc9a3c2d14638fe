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

// The stream the kernels here run on.
Stream& cpu_stream() { return default_stream(Device::cpu()); }

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
std::vector<NDArray> whole_attention(const Inputs& x, const NDArray& pos, const NDArray& dout,
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
int check_zigzag_blocks(DType products, double tol, int n = 3, int64_t window = 0,
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

// Random q, k, v (x32) and their bf16-rounded values (x, as f32), packed
// documents and an output gradient: the bf16 tests' case.
struct Bf16Case {
  Dims d{2, 37, 4, 2, 8};
  NDArray pos = positions_of({{5, 19, 13}, {37}});
  Inputs x32, x;
  NDArray dout;
};

Bf16Case bf16_case(uint64_t seed) {
  Bf16Case c;
  c.x32 = random_inputs(c.d, seed);
  c.x = {c.x32.q.to(DType::BF16).to(DType::F32), c.x32.k.to(DType::BF16).to(DType::F32),
         c.x32.v.to(DType::BF16).to(DType::F32)};
  c.dout = random_array({c.d.B, c.d.S, c.d.Hq, c.d.D}, seed + 1);
  return c;
}

// bf16 q, k and v through the graph (the bf16 training graph's): the
// output and the gradients are f32, the f32 kernel's on their values, bit
// for bit; bf16 arrays need bf16 products. The kernel's bf16 output (used
// by no op) is the f32 one rounded once.
TEST(Attention, Bf16ArraysAreTheF32KernelRoundedOnce) {
  const Bf16Case c = bf16_case(95);
  const Dims& d = c.d;
  const NDArray& pos = c.pos;
  const Inputs &x32 = c.x32, &x = c.x;
  const NDArray& dout = c.dout;
  const std::vector<NDArray> f32 = whole_attention(x, pos, dout, 0.4f, DType::BF16);
  {
    NDArray out16 = NDArray::empty(x.q.shape(), DType::BF16), lse = NDArray::empty(f32[1].shape(), DType::F32);
    kernels::attention_forward(cpu_stream(), x32.q.to(DType::BF16), x32.k.to(DType::BF16), x32.v.to(DType::BF16),
                               pos, 0.4f, out16, lse, kernels::attention_tiles(), DType::BF16);
    ASSERT_EQ(out16.dtype(), DType::BF16);
    EXPECT_EQ(max_diff(out16.to(DType::F32), f32[0].to(DType::BF16).to(DType::F32)), 0.0);
  }
  NDArray dq = NDArray::empty(x.q.shape(), DType::F32), dk = NDArray::empty(x.k.shape(), DType::F32);
  NDArray dv = NDArray::empty(x.k.shape(), DType::F32);
  Graph g;
  const SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
  Tensor q = g.placeholder("q", {B, S, d.Hq, d.D}, DType::BF16);
  Tensor k = g.placeholder("k", {B, S, d.Hkv, d.D}, DType::BF16);
  Tensor v = g.placeholder("v", {B, S, d.Hkv, d.D}, DType::BF16);
  Tensor p = g.placeholder("pos", {B, S}, DType::I32);
  Tensor go = g.placeholder("go", {B, S, d.Hq, d.D}, DType::F32);
  Tensor a = ops::attention(q, k, v, p, 0.4f, false, DType::BF16);
  ASSERT_EQ(a.dtype(), DType::F32);
  Tensor loss = g.add1(std::make_shared<testing::WeightedSumOp>(), {a, go});
  const std::vector<Tensor> grads = gradients(loss, {q, k, v});
  for (const Tensor& t : grads) EXPECT_EQ(t.dtype(), DType::F32);
  kernels::attention_backward(cpu_stream(), x.q, x.k, x.v, f32[0], f32[1], dout, pos, 0.4f, dq, dk, dv,
                              kernels::attention_tiles(), DType::BF16);
  const std::vector<NDArray> got =
      Executor(g, {a, grads[0], grads[1], grads[2]})
          .run({{"q", x32.q.to(DType::BF16)}, {"k", x32.k.to(DType::BF16)}, {"v", x32.v.to(DType::BF16)},
                {"pos", pos}, {"go", dout}});
  const NDArray want[] = {f32[0], dq, dk, dv};
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(got[i].dtype(), want[i].dtype()) << i;
    EXPECT_EQ(max_diff(got[i].to(DType::F32), want[i].to(DType::F32)), 0.0) << "output " << i;
  }
  Graph bad;
  Tensor bq = bad.placeholder("q", {1, 4, 2, 8}, DType::BF16), bk = bad.placeholder("k", {1, 4, 2, 8}, DType::BF16);
  EXPECT_THROW(ops::attention(bq, bk, bk, Tensor(), 0.3f, false, DType::F32), Error);
  Tensor fk = bad.placeholder("fk", {1, 4, 2, 8}, DType::F32);
  EXPECT_THROW(ops::attention(bq, fk, fk, Tensor(), 0.3f, false, DType::BF16), Error);
}

// A bf16 output (Precision::attention_output, as a GPU computes): the f32
// output rounded once, and the backward's O (its row dots dO . O) is that
// rounded output, as cuDNN's backward reads it; the backward writes bf16
// gradients then (as cuDNN does), the f32 ones rounded once.
TEST(Attention, Bf16OutputIsTheF32OutputRoundedOnce) {
  const Bf16Case c = bf16_case(97);
  const Dims& d = c.d;
  const NDArray& pos = c.pos;
  const Inputs &x32 = c.x32, &x = c.x;
  const NDArray& dout = c.dout;
  const std::vector<NDArray> f32 = whole_attention(x, pos, dout, 0.4f, DType::BF16);
  const NDArray o16 = f32[0].to(DType::BF16).to(DType::F32);
  NDArray dq = NDArray::empty(x.q.shape(), DType::F32), dk = NDArray::empty(x.k.shape(), DType::F32);
  NDArray dv = NDArray::empty(x.k.shape(), DType::F32);
  kernels::attention_backward(cpu_stream(), x.q, x.k, x.v, o16, f32[1], dout, pos, 0.4f, dq, dk, dv,
                              kernels::attention_tiles(), DType::BF16);
  Graph g;
  const SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
  Tensor q = g.placeholder("q", {B, S, d.Hq, d.D}, DType::BF16);
  Tensor k = g.placeholder("k", {B, S, d.Hkv, d.D}, DType::BF16);
  Tensor v = g.placeholder("v", {B, S, d.Hkv, d.D}, DType::BF16);
  Tensor p = g.placeholder("pos", {B, S}, DType::I32);
  Tensor go = g.placeholder("go", {B, S, d.Hq, d.D}, DType::F32);
  Tensor a = ops::attention(q, k, v, p, 0.4f, false, DType::BF16, 0, DType::BF16);
  ASSERT_EQ(a.dtype(), DType::BF16);
  Tensor loss = g.add1(std::make_shared<testing::WeightedSumOp>(), {ops::cast(a, DType::F32), go});
  const std::vector<Tensor> grads = gradients(loss, {q, k, v});
  const std::vector<NDArray> got =
      Executor(g, {a, grads[0], grads[1], grads[2]})
          .run({{"q", x32.q.to(DType::BF16)}, {"k", x32.k.to(DType::BF16)}, {"v", x32.v.to(DType::BF16)},
                {"pos", pos}, {"go", dout}});
  ASSERT_EQ(got[0].dtype(), DType::BF16);
  EXPECT_EQ(max_diff(got[0].to(DType::F32), o16), 0.0);
  const NDArray want[] = {dq, dk, dv};
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(got[i + 1].dtype(), DType::BF16) << "gradient " << i;
    EXPECT_EQ(max_diff(got[i + 1].to(DType::F32), want[i].to(DType::BF16).to(DType::F32)), 0.0) << "gradient " << i;
  }
  // The kernel writes bf16 gradients itself, the same bits.
  NDArray bq = NDArray::empty(x.q.shape(), DType::BF16), bk = NDArray::empty(x.k.shape(), DType::BF16);
  NDArray bv = NDArray::empty(x.k.shape(), DType::BF16);
  kernels::attention_backward(cpu_stream(), x.q, x.k, x.v, o16, f32[1], dout, pos, 0.4f, bq, bk, bv,
                              kernels::attention_tiles(), DType::BF16);
  const NDArray* direct[] = {&bq, &bk, &bv};
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(direct[i]->dtype(), DType::BF16);
    EXPECT_EQ(max_diff(direct[i]->to(DType::F32), got[i + 1].to(DType::F32)), 0.0) << "kernel gradient " << i;
  }
  // The rounded O is what the backward read: the f32 O's gradients differ.
  EXPECT_GT(max_diff(dk, f32[3]), 0.0);
  Graph bad;
  Tensor fq = bad.placeholder("q", {1, 4, 2, 8}, DType::F32);
  EXPECT_THROW(ops::attention(fq, fq, fq, Tensor(), 0.3f, false, DType::F32, 0, DType::BF16), Error);
  EXPECT_THROW(ops::attention(fq, fq, fq, Tensor(), 0.3f, false, DType::BF16, 0, DType::I32), Error);
}

// A bf16 output's gradient (where cuDNN serves attention, whose backward
// reads dO rounded to bf16): o_proj's input-gradient GEMM writes it in bf16
// when that GEMM is the output's only reader (through a reshape), f32 when
// another reader adds to the gradient, and f32 for an f32 output.
TEST(Attention, Bf16OutputGradientIsWrittenInBf16ByItsOnlyReader) {
  const auto grad_out_dtype = [](DType out, bool second_reader) {
    Graph g;
    const int64_t B = 2, S = 5, Hq = 4, Hkv = 2, D = 8;
    Tensor q = g.placeholder("q", {B, S, Hq, D}, DType::BF16);
    Tensor k = g.placeholder("k", {B, S, Hkv, D}, DType::BF16);
    Tensor v = g.placeholder("v", {B, S, Hkv, D}, DType::BF16);
    Tensor w = g.placeholder("w", {6, Hq * D}, DType::BF16);
    Tensor go = g.placeholder("go", {B, S, 6}, DType::F32), go2 = g.placeholder("go2", {B, S, Hq, D}, DType::F32);
    Tensor a = ops::attention(q, k, v, Tensor(), 0.3f, false, DType::BF16, 0, out);
    Tensor y = ops::linear(ops::reshape(a, {B, S, Hq * D}), w);
    Tensor loss = g.add1(std::make_shared<testing::WeightedSumOp>(), {y, go});
    if (second_reader)
      loss = ops::add(loss, g.add1(std::make_shared<testing::WeightedSumOp>(), {ops::cast(a, DType::F32), go2}));
    const Tensor dq = gradients(loss, {q})[0];
    const Node& grad = dq.node();
    EXPECT_EQ(grad.op->type(), "attention_grad");
    return grad.inputs.at(5).dtype();
  };
  EXPECT_EQ(grad_out_dtype(DType::BF16, false), DType::BF16);
  EXPECT_EQ(grad_out_dtype(DType::BF16, true), DType::F32);
  EXPECT_EQ(grad_out_dtype(DType::F32, false), DType::F32);
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
