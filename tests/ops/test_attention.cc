#include <cmath>
#include <string>
#include <vector>

#include "gradcheck.h"
#include "hspmd/core/threads.h"
#include "hspmd/ops/ops.h"
#include "kernels/attention.h"

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

// Attention through the graph with symbolic B and S; cu empty means no cu_seqlens.
NDArray run_attention(const Inputs& x, const std::vector<int32_t>& cu, float scale) {
  Graph g;
  const SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
  Tensor q = g.placeholder("q", {B, S, x.q.dim(2), x.q.dim(3)}, DType::F32);
  Tensor k = g.placeholder("k", {B, S, x.k.dim(2), x.k.dim(3)}, DType::F32);
  Tensor v = g.placeholder("v", {B, S, x.v.dim(2), x.v.dim(3)}, DType::F32);
  ValueMap values{{"q", x.q}, {"k", x.k}, {"v", x.v}};
  Tensor c;
  if (!cu.empty()) {
    c = g.placeholder("cu", {SymDim::symbol("N")}, DType::I32);
    values["cu"] = NDArray::from_vector_i32({static_cast<int64_t>(cu.size())}, cu);
  }
  return Executor(g, {ops::attention(q, k, v, c, scale)}).run(values)[0];
}

// Naive reference in double: the full masked score matrix per head.
std::vector<double> reference(const Inputs& x, const std::vector<int32_t>& cu, float scale) {
  const int64_t B = x.q.dim(0), S = x.q.dim(1), Hq = x.q.dim(2), Hkv = x.k.dim(2), D = x.q.dim(3);
  std::vector<int64_t> doc(B * S);
  for (int64_t t = 0; t < B * S; ++t) doc[t] = t / S;
  for (size_t i = 0; !cu.empty() && i + 1 < cu.size(); ++i)
    for (int64_t t = cu[i]; t < cu[i + 1]; ++t) doc[t] = static_cast<int64_t>(i) + B;
  const float *q = x.q.data<float>(), *k = x.k.data<float>(), *v = x.v.data<float>();
  std::vector<double> out(B * S * Hq * D, 0.0), p(S);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < S; ++i) {
        const int64_t hk = h / (Hq / Hkv);
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j < S; ++j) {
          p[j] = -1e300;
          if (j > i || doc[b * S + j] != doc[b * S + i]) continue;
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

}  // namespace
}  // namespace hspmd
