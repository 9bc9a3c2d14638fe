#include "gradcheck.h"
#include "hspmd/core/dtype.h"
#include "hspmd/ops/autodiff.h"
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"

namespace hspmd {
namespace {

// The stream the kernels here run on.
Stream& cpu_stream() { return default_stream(Device::cpu()); }

using testing::expect_gradients_match;
using testing::random_array;

// Σ_{t != ignore} (logsumexp(row) - row[t]) / normalizer, in double.
double reference_loss(const NDArray& logits, const std::vector<int32_t>& targets, double norm,
                      int ignore) {
  const int64_t v = logits.dim(-1);
  double total = 0;
  for (size_t r = 0; r < targets.size(); ++r) {
    if (targets[r] == ignore) continue;
    const float* row = logits.data<float>() + r * v;
    double m = row[0], s = 0;
    for (int64_t i = 0; i < v; ++i) m = std::max(m, static_cast<double>(row[i]));
    for (int64_t i = 0; i < v; ++i) s += std::exp(row[i] - m);
    total += std::log(s) + m - row[targets[r]];
  }
  return total / norm;
}

struct CeGraph {
  Graph g;
  Tensor logits, targets, norm, loss;
  CeGraph(const Shape& lshape, int ignore = -100, int64_t classes = 0) {
    SymShape ls = sym_shape(lshape);
    logits = g.placeholder("logits", ls, DType::F32);
    targets = g.placeholder("targets", SymShape(ls.begin(), ls.end() - 1), DType::I32);
    norm = g.placeholder("norm", {}, DType::F32);
    loss = ops::cross_entropy(logits, targets, norm, ignore, classes);
  }
  ValueMap values(const NDArray& l, const std::vector<int32_t>& t, float n) const {
    Shape ts(l.shape().begin(), l.shape().end() - 1);
    return {{"logits", l},
            {"targets", NDArray::from_vector_i32(ts, t)},
            {"norm", NDArray::from_vector({}, {n})}};
  }
};

TEST(CrossEntropy, IgnoredRowsAndNormalizer) {
  NDArray logits = random_array({2, 3, 5}, 1, 2.0f);
  const std::vector<int32_t> t = {1, -100, 4, 0, 3, -100};
  CeGraph c({2, 3, 5});
  Executor exec(c.g, {c.loss});
  const float l4 = exec.run(c.values(logits, t, 4.0f))[0].data<float>()[0];
  EXPECT_NEAR(l4, reference_loss(logits, t, 4.0, -100), 1e-5);
  const float l1 = exec.run(c.values(logits, t, 1.0f))[0].data<float>()[0];
  EXPECT_NEAR(l1, 4 * l4, 1e-5);
  // Changing an ignored row changes nothing.
  NDArray changed = logits.clone();
  for (int i = 5; i < 10; ++i) changed.data<float>()[i] += 3.0f * i;
  EXPECT_EQ(exec.run(c.values(changed, t, 4.0f))[0].data<float>()[0], l4);
  // Its gradient rows are zero.
  Tensor dl = gradients(c.loss, {c.logits})[0];
  NDArray grad = Executor(c.g, {dl}).run(c.values(logits, t, 4.0f))[0];
  for (int i = 5; i < 10; ++i) EXPECT_EQ(grad.data<float>()[i], 0.0f);
  for (int i = 25; i < 30; ++i) EXPECT_EQ(grad.data<float>()[i], 0.0f);
}

// A padded vocabulary: with classes = 5 of 8 columns, the loss is that of the
// first 5 columns alone, whatever the other 3 hold, and they get no gradient.
TEST(CrossEntropy, ClassesLeaveThePaddingOut) {
  NDArray logits = random_array({3, 8}, 6, 2.0f);
  const std::vector<int32_t> t = {4, 0, 2};
  CeGraph c({3, 8}, -100, 5);
  Executor exec(c.g, {c.loss});
  const float l = exec.run(c.values(logits, t, 3.0f))[0].data<float>()[0];
  EXPECT_NEAR(l, reference_loss(logits.slice(1, 0, 5).contiguous(), t, 3.0, -100), 1e-5);
  NDArray changed = logits.clone();
  for (int r = 0; r < 3; ++r) changed.data<float>()[r * 8 + 6] = 50.0f;
  EXPECT_EQ(exec.run(c.values(changed, t, 3.0f))[0].data<float>()[0], l);
  Tensor dl = gradients(c.loss, {c.logits})[0];
  NDArray grad = Executor(c.g, {dl}).run(c.values(logits, t, 3.0f))[0];
  for (int r = 0; r < 3; ++r)
    for (int k = 5; k < 8; ++k) EXPECT_EQ(grad.data<float>()[r * 8 + k], 0.0f);
  // A target among the padding is outside the classes.
  EXPECT_THROW(exec.run(c.values(logits, {6, 0, 2}, 3.0f)), Error);
}

// Vocab-parallel statistics with a shard that holds padding only: it adds
// nothing, and the combined loss equals the one-device loss over the classes.
TEST(CrossEntropy, ShardOfPaddingOnly) {
  NDArray logits = random_array({2, 8}, 7, 2.0f);  // vocab 5 padded to 8, shards of 4 (tp 2)
  const std::vector<int32_t> t = {1, 4};
  const NDArray targets = NDArray::from_vector_i32({2}, t), norm = NDArray::from_vector({}, {2.0f});
  NDArray shard_lse = NDArray::empty({2, 2}, DType::F32), picked = NDArray::zeros({2}, DType::F32);
  for (int s = 0; s < 2; ++s) {
    NDArray lse = NDArray::empty({2}, DType::F32), tl = NDArray::empty({2}, DType::F32);
    kernels::cross_entropy_shard_stats(cpu_stream(), logits.slice(1, 4 * s,
                                       4 * s + 4).contiguous(), targets, 4 * s, 8,
                                       -100, lse, tl, 5);
    for (int r = 0; r < 2; ++r) {
      shard_lse.data<float>()[s * 2 + r] = lse.data<float>()[r];
      picked.data<float>()[r] += tl.data<float>()[r];
    }
  }
  NDArray loss = NDArray::empty({}, DType::F32), lse = NDArray::empty({2}, DType::F32);
  kernels::cross_entropy_combine(cpu_stream(), shard_lse, picked, targets, norm, -100, loss, lse);
  EXPECT_NEAR(loss.data<float>()[0], reference_loss(logits.slice(1, 0, 5).contiguous(), t, 2.0, -100), 1e-5);
}

TEST(CrossEntropy, CustomIgnoreIndex) {
  NDArray logits = random_array({3, 4}, 2);
  const std::vector<int32_t> t = {2, 0, 3};
  CeGraph c({3, 4}, 0);
  const float l = Executor(c.g, {c.loss}).run(c.values(logits, t, 2.0f))[0].data<float>()[0];
  EXPECT_NEAR(l, reference_loss(logits, t, 2.0, 0), 1e-5);
}

TEST(CrossEntropy, Gradient) {
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& x) { return ops::cross_entropy(x[0], x[1], x[2]); },
      {{"logits", random_array({2, 3, 5}, 3, 2.0f)},
       {"targets", NDArray::from_vector_i32({2, 3}, {1, -100, 4, 0, 3, 2}), false},
       {"norm", NDArray::from_vector({}, {3.0f}), false}});
}

// grad_dtype bf16: the logits' gradient is the f32 one rounded once (ignored
// rows and padded classes stay exact zeros), also on a vocabulary shard.
TEST(CrossEntropy, Bf16GradientIsTheF32OneRoundedOnce) {
  const int64_t rows = 37, v = 301;
  const NDArray logits = random_array({rows, v}, 11, 3.0f);
  std::vector<int32_t> tv(rows);
  for (int64_t r = 0; r < rows; ++r) tv[r] = static_cast<int32_t>((r * 97) % 290);
  tv[5] = -100;
  const NDArray targets = NDArray::from_vector_i32({rows}, tv);
  const NDArray norm = NDArray::from_vector({}, {7.0f}), dloss = NDArray::from_vector({}, {1.25f});
  NDArray loss = NDArray::empty({}, DType::F32), lse = NDArray::empty({rows}, DType::F32);
  kernels::cross_entropy(cpu_stream(), logits, targets, norm, -100, loss, lse, 290);
  for (const int64_t begin : {int64_t{0}, int64_t{150}}) {
    NDArray f32 = NDArray::empty({rows, v}, DType::F32), b16 = NDArray::empty({rows, v}, DType::BF16);
    kernels::cross_entropy_backward(cpu_stream(), dloss, logits, targets, norm, lse, -100, begin, f32, 290);
    kernels::cross_entropy_backward(cpu_stream(), dloss, logits, targets, norm, lse, -100, begin, b16, 290);
    for (int64_t i = 0; i < rows * v; ++i)
      ASSERT_EQ(b16.data<uint16_t>()[i], f32_to_bf16(f32.data<float>()[i])) << "element " << i;
  }
  Graph g;
  Tensor tl = g.placeholder("logits", {rows, v}, DType::F32);
  Tensor tt = g.placeholder("targets", {rows}, DType::I32), tn = g.placeholder("norm", {}, DType::F32);
  Tensor l = ops::cross_entropy(tl, tt, tn, -100, 0, DType::BF16);
  EXPECT_EQ(gradients(l, {tl})[0].dtype(), DType::BF16);
  EXPECT_THROW(ops::cross_entropy(tl, tt, tn, -100, 0, DType::I32), Error);
}

// bf16 logits (a bf16 LM head) are their exact f32 widening to the kernels:
// the loss, lse, shard statistics and gradients equal those of the widened
// f32 copy bit for bit, with and without padded classes, on a shard.
TEST(CrossEntropy, Bf16LogitsAreTheirWidenedF32Values) {
  const int64_t rows = 37, v = 304;
  const NDArray logits = random_array({rows, v}, 13, 4.0f).to(DType::BF16);
  const NDArray wide = logits.to(DType::F32);
  std::vector<int32_t> tv(rows);
  for (int64_t r = 0; r < rows; ++r) tv[r] = static_cast<int32_t>((r * 89) % 290);
  tv[3] = -100;
  const NDArray targets = NDArray::from_vector_i32({rows}, tv);
  const NDArray norm = NDArray::from_vector({}, {5.0f}), dloss = NDArray::from_vector({}, {0.75f});
  for (const int64_t classes : {int64_t{0}, int64_t{290}}) {
    NDArray loss[2], lse[2], stats[2][2];
    for (int k = 0; k < 2; ++k) {
      const NDArray& x = k == 0 ? logits : wide;
      loss[k] = NDArray::empty({}, DType::F32);
      lse[k] = NDArray::empty({rows}, DType::F32);
      kernels::cross_entropy(cpu_stream(), x, targets, norm, -100, loss[k], lse[k], classes);
      stats[k][0] = NDArray::empty({rows}, DType::F32);
      stats[k][1] = NDArray::empty({rows}, DType::F32);
      kernels::cross_entropy_shard_stats(cpu_stream(), x, targets, 150, 454, -100, stats[k][0], stats[k][1],
                                         classes);
    }
    EXPECT_EQ(loss[0].to_vector(), loss[1].to_vector()) << classes;
    EXPECT_EQ(lse[0].to_vector(), lse[1].to_vector());
    EXPECT_EQ(stats[0][0].to_vector(), stats[1][0].to_vector());
    EXPECT_EQ(stats[0][1].to_vector(), stats[1][1].to_vector());
    for (DType gd : {DType::F32, DType::BF16}) {
      NDArray g16 = NDArray::empty({rows, v}, gd), g32 = NDArray::empty({rows, v}, gd);
      kernels::cross_entropy_backward(cpu_stream(), dloss, logits, targets, norm, lse[1], -100, 0, g16, classes);
      kernels::cross_entropy_backward(cpu_stream(), dloss, wide, targets, norm, lse[1], -100, 0, g32, classes);
      EXPECT_EQ(g16.to(DType::F32).to_vector(), g32.to(DType::F32).to_vector());
    }
  }
  // The op takes bf16 logits; an i32 one is refused in one line.
  Graph g;
  Tensor tl = g.placeholder("logits", {rows, v}, DType::BF16);
  Tensor tt = g.placeholder("targets", {rows}, DType::I32), tn = g.placeholder("norm", {}, DType::F32);
  EXPECT_NO_THROW(ops::cross_entropy(tl, tt, tn, -100, 0, DType::BF16));
  Tensor ti = g.placeholder("ids", {rows, v}, DType::I32);
  EXPECT_THROW(ops::cross_entropy(ti, tt, tn), Error);
}

TEST(CrossEntropy, LargeRowsMatchReferenceAndAreDeterministic) {
  const int64_t rows = 256, v = 4096;
  NDArray logits = random_array({rows, v}, 4, 4.0f);
  std::vector<int32_t> t(rows);
  for (int64_t r = 0; r < rows; ++r) t[r] = r % 17 == 0 ? -100 : static_cast<int32_t>((r * 97) % v);
  CeGraph c({rows, v});
  Executor exec(c.g, {c.loss});
  const float l = exec.run(c.values(logits, t, 200.0f))[0].data<float>()[0];
  EXPECT_NEAR(l, reference_loss(logits, t, 200.0, -100), 1e-5 * std::fabs(l));
  EXPECT_EQ(exec.run(c.values(logits, t, 200.0f))[0].data<float>()[0], l);
  // dlogits rows sum to zero and match softmax - onehot.
  Tensor dl = gradients(c.loss, {c.logits})[0];
  NDArray grad = Executor(c.g, {dl}).run(c.values(logits, t, 200.0f))[0];
  for (int64_t i = 0; i < v; ++i) ASSERT_EQ(grad.data<float>()[255 * v + i], 0.0f);  // ignored
  for (int64_t r : {1, 100, 254}) {
    const float* row = logits.data<float>() + r * v;
    double m = row[0], s = 0;
    for (int64_t i = 0; i < v; ++i) m = std::max(m, static_cast<double>(row[i]));
    for (int64_t i = 0; i < v; ++i) s += std::exp(row[i] - m);
    for (int64_t i = 0; i < v; i += 37) {
      const double want = (std::exp(row[i] - m) / s - (i == t[r])) / 200.0;
      EXPECT_NEAR(grad.data<float>()[r * v + i], want, 1e-8);
    }
  }
}

TEST(CrossEntropy, BadTargetIsAnError) {
  CeGraph c({2, 5});
  Executor exec(c.g, {c.loss});
  NDArray logits = random_array({2, 5}, 5);
  EXPECT_THROW(exec.run(c.values(logits, {1, 5}, 1.0f)), Error);
  EXPECT_THROW(exec.run(c.values(logits, {-1, 0}, 1.0f)), Error);
  EXPECT_NO_THROW(exec.run(c.values(logits, {-100, 4}, 1.0f)));
}

TEST(CrossEntropy, BadShapesAreErrors) {
  Graph g;
  Tensor logits = g.placeholder("logits", {2, 3, 5}, DType::F32);
  Tensor targets = g.placeholder("targets", {2, 3}, DType::I32);
  Tensor bad_targets = g.placeholder("bad_targets", {2, 4}, DType::I32);
  Tensor norm = g.placeholder("norm", {}, DType::F32);
  Tensor vec_norm = g.placeholder("vec_norm", {1}, DType::F32);
  EXPECT_THROW(ops::cross_entropy(logits, bad_targets, norm), Error);
  EXPECT_THROW(ops::cross_entropy(logits, targets, vec_norm), Error);
  EXPECT_NO_THROW(ops::cross_entropy(logits, targets, norm));
}

}  // namespace
}  // namespace hspmd
