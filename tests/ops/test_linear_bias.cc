// linear_bias (x · weight^T + bias in one GEMM, rounded once to its output
// dtype) against the chain it replaces, cast(add_bias(linear(x, weight, f32),
// bias), out): the forward and every gradient the same bits, f32 and bf16
// outputs and operands, odd and Qwen2-like (column-parallel local) shapes, x
// shared by three projections (q, k, v: the backward folds x's gradient
// terms); the backward's nodes the chain's; the kernel's bias against the
// three kernels; the shape rule's errors.
#include <cstring>
#include <functional>

#include "gradcheck.h"
#include "hspmd/ops/autodiff.h"
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"

namespace hspmd {
namespace {

using testing::random_array;

Stream& cpu_stream() { return default_stream(Device::cpu()); }

bool same_bits(const NDArray& a, const NDArray& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.contiguous().raw_data(), b.contiguous().raw_data(), a.nbytes()) == 0;
}

// One projection: the fused op, or the chain it replaces.
Tensor project(bool fused, const Tensor& x, const Tensor& w, const Tensor& b, DType out) {
  return fused ? ops::linear_bias(x, w, b, out) : ops::cast(ops::add_bias(ops::linear(x, w, DType::F32), b), out);
}

struct Projection {
  int64_t n;
  DType out;
};

// x [B, S, K] (placeholder, f32; `operands` bf16 rounds x and the weights as
// the decoder's mixed precision does) feeding one projection per entry, the
// loss Σ cast(y, f32)·w_i; the outputs, then the gradients of x, each weight
// and each bias. `backward_types` gets the types of the nodes the backward
// appended.
std::vector<NDArray> run(bool fused, const Shape& x_shape, const std::vector<Projection>& projections, DType operands,
                         uint64_t seed, std::vector<std::string>* backward_types = nullptr) {
  Graph g;
  const SymDim B = SymDim::symbol("B");
  Tensor x = g.placeholder("x", {B, x_shape[1], x_shape[2]}, DType::F32);
  const Tensor x_lo = ops::cast(x, operands);
  std::vector<Tensor> params = {x}, outputs, losses;
  std::map<std::string, NDArray> feeds = {{"x", random_array(x_shape, seed)}};
  for (size_t i = 0; i < projections.size(); ++i) {
    const Projection& p = projections[i];
    const std::string id = std::to_string(i);
    Tensor w = g.parameter("w" + id, {p.n, x_shape[2]});
    Tensor b = g.parameter("b" + id, {p.n});
    feeds["w" + id] = random_array({p.n, x_shape[2]}, seed + 10 * i + 1, 0.3f);
    feeds["b" + id] = random_array({p.n}, seed + 10 * i + 2);
    const Tensor y = project(fused, x_lo, ops::cast(w, operands), b, p.out);
    Tensor weights = g.placeholder("l" + id, y.shape(), DType::F32);
    feeds["l" + id] = random_array({x_shape[0], x_shape[1], p.n}, seed + 10 * i + 3);
    losses.push_back(g.add1(std::make_shared<testing::WeightedSumOp>(), {ops::cast(y, DType::F32), weights}));
    outputs.push_back(y);
    params.push_back(w);
    params.push_back(b);
  }
  Tensor loss = losses[0];
  for (size_t i = 1; i < losses.size(); ++i) loss = ops::add(loss, losses[i]);
  const int before = g.num_nodes();
  const std::vector<Tensor> grads = gradients(loss, params);
  if (backward_types != nullptr)
    for (int id = before; id < g.num_nodes(); ++id) backward_types->push_back(g.node(id).op->type());
  outputs.insert(outputs.end(), grads.begin(), grads.end());
  return Executor(g, outputs).run(feeds);
}

void expect_same_as_chain(const Shape& x_shape, const std::vector<Projection>& projections, DType operands,
                          uint64_t seed) {
  std::vector<std::string> fused_types, chain_types;
  const std::vector<NDArray> fused = run(true, x_shape, projections, operands, seed, &fused_types);
  const std::vector<NDArray> chain = run(false, x_shape, projections, operands, seed, &chain_types);
  ASSERT_EQ(fused.size(), chain.size());
  for (size_t i = 0; i < fused.size(); ++i)
    EXPECT_TRUE(same_bits(fused[i], chain[i])) << "array " << i << " (outputs, then dx, dw0, db0, dw1, ...)";
  EXPECT_EQ(fused_types, chain_types) << "the backward's nodes";
}

TEST(LinearBias, ForwardAndGradientsAreTheChainsBits) {
  for (DType operands : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(operands));
    // One projection per output dtype, N odd and a multiple of 8.
    expect_same_as_chain({2, 5, 12}, {{13, DType::F32}}, operands, 1);
    expect_same_as_chain({2, 5, 12}, {{13, DType::BF16}}, operands, 2);
    expect_same_as_chain({1, 3, 7}, {{16, DType::BF16}}, operands, 3);
    expect_same_as_chain({3, 1, 1}, {{1, DType::F32}}, operands, 4);
    // Qwen2's q, k (f32) and v (bf16) over one x, at a column-parallel rank's
    // local sizes (hidden 64, 4 q heads and 2 kv heads of 16 over TP 2: the
    // weights' and biases' halves).
    expect_same_as_chain({2, 9, 64}, {{32, DType::F32}, {16, DType::F32}, {16, DType::BF16}}, operands, 5);
    // Threaded kernels (more than 65536 outputs).
    expect_same_as_chain({2, 300, 40}, {{120, DType::F32}, {120, DType::BF16}}, operands, 6);
  }
}

TEST(LinearBias, FiniteDifferences) {
  testing::expect_gradients_match(
      [](Graph&, const std::vector<Tensor>& t) { return ops::linear_bias(t[0], t[1], t[2]); },
      {{"x", random_array({2, 3, 5}, 31)}, {"w", random_array({7, 5}, 32)}, {"b", random_array({7}, 33)}});
}

// The kernel's bias against the three kernels the chain runs, on the CPU
// backend and its device test double.
TEST(LinearBias, KernelBiasIsMatmulAddBiasAndCast) {
  for (Device d : {Device::cpu(), Device::host_double()}) {
    Stream& s = default_stream(d);
    for (DType out_dtype : {DType::F32, DType::BF16})
      for (auto [m, n, k] : {std::tuple{5, 13, 7}, std::tuple{64, 24, 1}, std::tuple{300, 250, 33}}) {
        SCOPED_TRACE(::testing::Message() << d.str() << " " << dtype_name(out_dtype) << " " << m << "x" << n << "x" << k);
        const NDArray a = kernels::to_device(s, random_array({m, k}, 41));
        const NDArray w = kernels::to_device(s, random_array({n, k}, 42));
        const NDArray b = kernels::to_device(s, random_array({n}, 43));
        NDArray got = kernels::zeros(s, {m, n}, out_dtype);
        kernels::matmul(s, a, w, false, true, got, kernels::GemmCompute::kBF16, kernels::GemmEpilogue::with_bias(&b));
        NDArray y = kernels::zeros(s, {m, n}, DType::F32), yb = kernels::zeros(s, {m, n}, DType::F32);
        kernels::matmul(s, a, w, false, true, y, kernels::GemmCompute::kBF16);
        kernels::add_bias(s, y, b, yb);
        const NDArray want = kernels::cast(s, yb, out_dtype);
        EXPECT_TRUE(same_bits(kernels::to_host(s, got), kernels::to_host(s, want)));
      }
  }
}

TEST(LinearBias, KernelRefusesABiasThatDoesNotFit) {
  Stream& s = cpu_stream();
  const NDArray a = random_array({3, 4}, 1), w = random_array({5, 4}, 2), b5 = random_array({5}, 3);
  const NDArray b4 = random_array({4}, 4), add = random_array({3, 5}, 5);
  NDArray out = NDArray::empty({3, 5}, DType::F32);
  const auto error = [&](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const std::exception& e) {  // an internal check: the op's shape rule catches users' mistakes
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error([&] {
              kernels::matmul(s, a, w, false, true, out, kernels::GemmCompute::kF32,
                              kernels::GemmEpilogue::with_bias(&b4));
            }).find("the bias must be f32 [N]"),
            std::string::npos);
  kernels::GemmEpilogue both(&add);
  both.bias = &b5;
  EXPECT_NE(error([&] { kernels::matmul(s, a, w, false, true, out, kernels::GemmCompute::kF32, both); })
                .find("an addend and a bias together"),
            std::string::npos);
}

TEST(LinearBias, ShapeAndDtypeRules) {
  Graph g;
  const SymDim B = SymDim::symbol("B");
  Tensor x = g.placeholder("x", {B, 8}, DType::F32);
  Tensor w = g.parameter("w", {6, 8});
  Tensor w7 = g.parameter("w7", {6, 7});
  Tensor b = g.parameter("b", {6});
  Tensor b5 = g.parameter("b5", {5});
  Tensor bh = ops::cast(b, DType::BF16);
  const auto error = [&](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(error([&] { ops::linear_bias(x, w7, b); }),
            "[linear_bias] x [..., K] and weight [N, K] do not fit: x [B, 8], weight [6, 7]");
  EXPECT_EQ(error([&] { ops::linear_bias(x, w, b5); }),
            "[linear_bias] bias must be [N] with N weight's dim 0: weight [6, 8], bias [5]");
  EXPECT_EQ(error([&] { ops::linear_bias(x, w, bh); }), "[linear_bias] bias must be f32, got bf16");
  EXPECT_EQ(error([&] { ops::linear_bias(x, w, b, DType::I64); }), "[linear_bias] the output must be f32 or bf16, got i64");
  const Tensor y = ops::linear_bias(x, w, b, DType::BF16);
  EXPECT_EQ(y.shape(), (SymShape{B, 6}));
  EXPECT_EQ(y.dtype(), DType::BF16);
}

}  // namespace
}  // namespace hspmd
