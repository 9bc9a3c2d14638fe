// add_bias (x [..., N] + bias [N]) and its gradient (dx = dy, dbias = column
// sums of dy by bias_grad): forward and backward against double references
// for ranks 1 to 4 and odd shapes, finite differences, the thread count's
// (non-)effect on the bias gradient's bits, and the shape rule's errors.
#include <cmath>

#include "gradcheck.h"
#include "hspmd/core/threads.h"
#include "hspmd/ops/ops.h"
#include "kernels/kernels.h"

namespace hspmd {
namespace {

// The stream the kernels here run on.
Stream& cpu_stream() { return default_stream(Device::cpu()); }

using testing::expect_gradients_match;
using testing::random_array;

// Runs y = add_bias(x, bias) and the gradients of loss = Σ y·w (so dy = w);
// checks y, dx and dbias against double references.
void check_forward_and_backward(const Shape& shape, uint64_t seed) {
  const int64_t n = shape.back(), rows = shape_numel(shape) / n;
  NDArray x = random_array(shape, seed), b = random_array({n}, seed + 1);
  NDArray w = random_array(shape, seed + 2);
  Graph g;
  SymShape sym = sym_shape(shape);
  if (shape.size() > 1) sym[0] = SymDim::symbol("B");  // a symbolic batch, as in the model
  Tensor tx = g.placeholder("x", sym, DType::F32);
  Tensor tb = g.parameter("b", {n});
  Tensor y = ops::add_bias(tx, tb);
  Tensor tw = g.placeholder("w", y.shape(), DType::F32);
  Tensor loss = g.add1(std::make_shared<testing::WeightedSumOp>(), {y, tw});
  std::vector<Tensor> grads = gradients(loss, {tx, tb});
  ASSERT_EQ(grads.size(), 2u);
  std::vector<NDArray> out = Executor(g, {y, grads[0], grads[1]}).run({{"x", x}, {"b", b}, {"w", w}});
  ASSERT_EQ(out[0].shape(), shape);
  ASSERT_EQ(out[1].shape(), shape);
  ASSERT_EQ(out[2].shape(), (Shape{n}));
  const float* px = x.data<float>();
  const float* pb = b.data<float>();
  const float* pw = w.data<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = r * n + j;
      // A float sum rounded from its double value is the float sum exactly.
      ASSERT_EQ(out[0].data<float>()[i],
                static_cast<float>(static_cast<double>(px[i]) + static_cast<double>(pb[j])))
          << "y element " << i;
      ASSERT_EQ(out[1].data<float>()[i], pw[i]) << "dx element " << i;
    }
  for (int64_t j = 0; j < n; ++j) {
    double s = 0, mag = 0;
    for (int64_t r = 0; r < rows; ++r) {
      s += pw[r * n + j];
      mag += std::fabs(pw[r * n + j]);
    }
    EXPECT_NEAR(out[2].data<float>()[j], s, 1e-6 * mag + 1e-7) << "dbias element " << j;
  }
}

TEST(AddBias, ForwardAndBackwardMatchDoubleReference) {
  check_forward_and_backward({37}, 1);            // rank 1: one row
  check_forward_and_backward({5, 37}, 2);         // rank 2
  check_forward_and_backward({3, 7, 19}, 3);      // rank 3
  check_forward_and_backward({2, 3, 5, 67}, 4);   // rank 4, one column block and a bit
  check_forward_and_backward({1, 1, 1, 1}, 5);    // N = 1
  // Threaded paths (more than 65536 elements) with several row chunks and a
  // partial last column block in the bias gradient.
  check_forward_and_backward({3, 301, 131}, 6);
  check_forward_and_backward({1100, 3}, 7);       // narrow: one block, several row chunks
}

TEST(AddBias, Gradients) {
  auto build = [](Graph&, const std::vector<Tensor>& t) { return ops::add_bias(t[0], t[1]); };
  expect_gradients_match(build, {{"x", random_array({3, 5}, 11)}, {"b", random_array({5}, 12)}});
  expect_gradients_match(build,
                         {{"x", random_array({2, 3, 7}, 13)}, {"b", random_array({7}, 14)}});
  expect_gradients_match(build,
                         {{"x", random_array({2, 2, 3, 70}, 15)}, {"b", random_array({70}, 16)}});
  // The bias reused (its gradients sum) and x feeding two paths.
  expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) {
        return ops::add(ops::add_bias(t[0], t[1]), ops::mul(ops::add_bias(t[0], t[1]), t[0]));
      },
      {{"x", random_array({4, 9}, 17)}, {"b", random_array({9}, 18)}});
}

// Tests compare plans bit for bit on one process at several thread counts:
// the bias gradient must not depend on the thread count.
TEST(AddBias, BiasGradientBitsDoNotDependOnTheThreadCount) {
  const int saved = num_threads();
  for (const Shape& shape : {Shape{1537, 129}, Shape{4, 300, 67}, Shape{40000, 2}}) {
    NDArray dy = random_array(shape, 21);
    std::vector<std::vector<float>> results;
    for (int threads : {1, 2, 3, 4}) {
      set_num_threads(threads);
      NDArray db = NDArray::empty({shape.back()}, DType::F32);
      kernels::bias_grad(cpu_stream(), dy, db);
      results.push_back(db.to_vector());
    }
    for (size_t k = 1; k < results.size(); ++k)
      EXPECT_EQ(results[k], results[0]) << "threads differ, shape " << shape_str(shape);
  }
  set_num_threads(saved);
}

TEST(AddBias, EmptyRowsGiveAZeroBiasGradient) {
  NDArray dy = NDArray::empty({0, 5}, DType::F32);
  NDArray db = NDArray::empty({5}, DType::F32);
  kernels::bias_grad(cpu_stream(), dy, db);
  EXPECT_EQ(db.to_vector(), std::vector<float>(5, 0.0f));
}

TEST(AddBias, ShapeAndDtypeRules) {
  Graph g;
  Tensor x = g.placeholder("x", {SymDim::symbol("B"), 8}, DType::F32);
  Tensor b7 = g.parameter("b7", {7});
  Tensor b2 = g.parameter("b2", {1, 8});
  Tensor s = g.placeholder("s", {}, DType::F32);
  Tensor b1 = g.parameter("b1", {1});
  Tensor xh = g.placeholder("xh", {2, 8}, DType::BF16);
  Tensor b8 = g.parameter("b8", {8});
  auto message = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(message([&] { ops::add_bias(x, b7); }),
            "[add_bias] bias must be [N] with N the last dim of x: x [B, 8], bias [7]");
  EXPECT_NE(message([&] { ops::add_bias(x, b2); }).find("[add_bias] bias must be [N]"),
            std::string::npos);
  EXPECT_NE(message([&] { ops::add_bias(s, b1); }).find("[add_bias] bias must be [N]"),
            std::string::npos);
  EXPECT_EQ(message([&] { ops::add_bias(xh, b8); }), "[add_bias] x must be f32, got bf16");
  EXPECT_EQ(ops::add_bias(x, b8).shape(), x.shape());
}

}  // namespace
}  // namespace hspmd
