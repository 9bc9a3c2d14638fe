#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "deduce/deduce_test_util.h"
#include "attention_test_util.h"
#include "gradcheck.h"
#include "hspmd/core/threads.h"
#include "hspmd/ops/autodiff.h"
#include "hspmd/ops/ops.h"
#include "kernels/attention.h"
#include "kernels/basic.h"
#include "kernels/cpu/bf16_pairs.h"

namespace hspmd {
namespace {

using namespace attention_test;
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

TEST(Attention, ZigzagBlocksMatchTheWholeSequence) { check_zigzag_blocks(DType::F32, 2e-6); }

// With bf16 products the blocks round the same operands as the whole kernel;
// only the forward's probabilities are rounded after a different running
// max, so they agree to a few bf16 roundings.
TEST(Attention, ZigzagBlocksMatchTheWholeSequenceInBf16) {
  check_zigzag_blocks(DType::BF16, 4e-3);
}

// ---- bf16 tile products ----

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

}  // namespace
}  // namespace hspmd
