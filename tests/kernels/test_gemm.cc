// kernels::matmul's precisions and backends: bf16 compute (native oneDNN or
// emulated on OpenBLAS) against an fp32-accumulated reference on bf16-rounded
// operands; the fp32 path on both backends; the primitive cache.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "hspmd/core/rng.h"
#include "hspmd/core/threads.h"
#include "kernels/basic.h"
#include "test_util.h"

namespace hspmd {
namespace {

// The stream the kernels here run on.
Stream& cpu_stream() { return default_stream(Device::cpu()); }

using kernels::GemmCompute;
using kernels::GemmF32Backend;

// Restores the process-wide GEMM settings when a test ends.
class GemmSettings {
 public:
  GemmSettings() : backend_(kernels::f32_gemm_backend()) {}
  ~GemmSettings() {
    kernels::set_bf16_gemm_emulation(false);
    kernels::set_f32_gemm_backend(backend_);
  }

 private:
  GemmF32Backend backend_;
};

NDArray random_f32(const Shape& shape, uint64_t seed) {
  Rng rng(seed);
  NDArray x = NDArray::empty(shape, DType::F32);
  float* p = x.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) p[i] = static_cast<float>(2.0 * rng.uniform() - 1.0);
  return x;
}

float bf16_round(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// Reference: op(a2) · op(b) in double on the operands' values, each rounded to
// bf16 first when `round`; also sum |a||b| per element (the error scale).
struct Reference {
  std::vector<double> value, scale;
};

Reference reference(const NDArray& a, const NDArray& b, bool ta, bool tb, bool round) {
  const std::vector<float> va = a.to_vector(), vb = b.to_vector();
  const int64_t cols = a.dim(-1), rows = cols == 0 ? 0 : a.numel() / cols;
  const int64_t m = ta ? cols : rows, k = ta ? rows : cols, n = tb ? b.dim(0) : b.dim(1);
  const int64_t ldb = b.dim(1);
  Reference r{std::vector<double>(m * n, 0.0), std::vector<double>(m * n, 0.0)};
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t p = 0; p < k; ++p) {
        float x = ta ? va[p * cols + i] : va[i * cols + p];
        float y = tb ? vb[j * ldb + p] : vb[p * ldb + j];
        if (round) x = bf16_round(x), y = bf16_round(y);
        r.value[i * n + j] += static_cast<double>(x) * y;
        r.scale[i * n + j] += std::fabs(static_cast<double>(x) * y);
      }
  return r;
}

// |got - ref| <= rel * scale, plus half a bf16 ulp of ref for a BF16 output.
void expect_close(const NDArray& out, const Reference& ref, double rel, const std::string& what) {
  const std::vector<float> got = out.to_vector();
  ASSERT_EQ(got.size(), ref.value.size()) << what;
  const double out_ulp = out.dtype() == DType::BF16 ? std::ldexp(1.0, -8) : 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = rel * ref.scale[i] + out_ulp * std::fabs(ref.value[i]) + 1e-30;
    ASSERT_LE(std::fabs(got[i] - ref.value[i]), tol)
        << what << " element " << i << ": " << got[i] << " vs " << ref.value[i];
  }
}

// Shapes of the operands for C[m, n] = op(A)[m, k] · op(B)[k, n].
std::pair<Shape, Shape> operand_shapes(int64_t m, int64_t n, int64_t k, bool ta, bool tb) {
  return {ta ? Shape{k, m} : Shape{m, k}, tb ? Shape{n, k} : Shape{k, n}};
}

struct Dims {
  int64_t m, n, k;
};
const std::vector<Dims> kShapes = {{1, 1, 1}, {37, 19, 53}, {64, 128, 96}, {5, 300, 7}};

// Every transposition, odd shapes, F32 operands with bf16 compute, F32 and
// BF16 outputs, on the path this machine picks.
TEST(GemmBf16, MatchesRoundedReferenceForEveryTranspositionAndShape) {
  GemmSettings settings;
  uint64_t seed = 1;
  for (const Dims& d : kShapes)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (DType out_dtype : {DType::F32, DType::BF16}) {
          auto [sa, sb] = operand_shapes(d.m, d.n, d.k, ta, tb);
          NDArray a = random_f32(sa, seed++), b = random_f32(sb, seed++);
          NDArray out = NDArray::empty({d.m, d.n}, out_dtype);
          kernels::matmul(cpu_stream(), a, b, ta, tb, out, GemmCompute::kBF16);
          expect_close(out, reference(a, b, ta, tb, true), 1e-5,
                       std::to_string(d.m) + "x" + std::to_string(d.n) + "x" +
                           std::to_string(d.k) + " ta=" + std::to_string(ta) +
                           " tb=" + std::to_string(tb) + " out=" + dtype_name(out_dtype));
        }
}

// A BF16 operand implies bf16 compute, whatever `compute` says; F32 operands
// mixed with BF16 ones are rounded to bf16.
TEST(GemmBf16, MixedOperandDtypesComputeInBf16) {
  GemmSettings settings;
  const Dims d{37, 19, 53};
  uint64_t seed = 100;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (auto [da, db] : {std::pair{DType::BF16, DType::F32}, std::pair{DType::F32, DType::BF16},
                            std::pair{DType::BF16, DType::BF16}}) {
        auto [sa, sb] = operand_shapes(d.m, d.n, d.k, ta, tb);
        NDArray a = random_f32(sa, seed++), b = random_f32(sb, seed++);
        if (da == DType::BF16) a = a.to(DType::BF16);
        if (db == DType::BF16) b = b.to(DType::BF16);
        for (DType out_dtype : {DType::F32, DType::BF16}) {
          NDArray out = NDArray::empty({d.m, d.n}, out_dtype);
          kernels::matmul(cpu_stream(), a, b, ta, tb, out);  // compute defaults to kF32
          expect_close(out, reference(a, b, ta, tb, true), 1e-5,
                       std::string(dtype_name(da)) + " x " + dtype_name(db) + " -> " +
                           dtype_name(out_dtype) + " ta=" + std::to_string(ta) +
                           " tb=" + std::to_string(tb));
        }
      }
}

// a with leading dims ([2, 3, K]) is viewed as [6, K], as in fp32.
TEST(GemmBf16, FlattensLeadingDimsOfA) {
  GemmSettings settings;
  NDArray a = random_f32({2, 3, 8}, 7).to(DType::BF16), b = random_f32({8, 5}, 8);
  NDArray out = NDArray::empty({2, 3, 5}, DType::F32);
  kernels::matmul(cpu_stream(), a, b, false, false, out);
  expect_close(out, reference(a, b, false, false, true), 1e-5, "[2,3,8] x [8,5]");
}

TEST(GemmBf16, EmptyDims) {
  GemmSettings settings;
  for (bool emulate : {false, true}) {
    kernels::set_bf16_gemm_emulation(emulate);
    // m = 0: nothing to write.
    NDArray a = NDArray::empty({0, 4}, DType::BF16), b = random_f32({4, 3}, 1);
    NDArray out = NDArray::empty({0, 3}, DType::BF16);
    kernels::matmul(cpu_stream(), a, b, false, false, out);
    // k = 0 (a weight gradient over no tokens: [0, 3]^T · [0, 2]): zeros.
    NDArray a0 = NDArray::empty({0, 3}, DType::BF16), b0 = NDArray::empty({0, 2}, DType::F32);
    NDArray out0 = NDArray::empty({3, 2}, DType::BF16);
    out0.fill(5.0f);
    kernels::matmul(cpu_stream(), a0, b0, true, false, out0, GemmCompute::kBF16);
    for (float v : out0.to_vector()) EXPECT_EQ(v, 0.0f);
  }
}

// The second call with the same shape reuses the cached primitive and gives
// the same bits; new data at that shape is still computed correctly.
TEST(GemmBf16, SameShapeTwiceGivesSameResult) {
  GemmSettings settings;
  for (bool ta : {false, true}) {
    auto [sa, sb] = operand_shapes(33, 65, 129, ta, true);
    NDArray a = random_f32(sa, 20), b = random_f32(sb, 21);
    NDArray first = NDArray::empty({33, 65}, DType::F32);
    NDArray second = NDArray::empty({33, 65}, DType::F32);
    kernels::matmul(cpu_stream(), a, b, ta, true, first, GemmCompute::kBF16);
    kernels::matmul(cpu_stream(), a, b, ta, true, second, GemmCompute::kBF16);
    EXPECT_EQ(std::memcmp(first.raw_data(), second.raw_data(), first.nbytes()), 0);
    NDArray c = random_f32(sa, 22);
    kernels::matmul(cpu_stream(), c, b, ta, true, second, GemmCompute::kBF16);
    expect_close(second, reference(c, b, ta, true, true), 1e-5, "new data, cached shape");
  }
}

// The forced emulation (OpenBLAS on bf16-rounded values) agrees with the
// default path within 1e-5 relative, for every transposition and dtype mix.
TEST(GemmBf16, ForcedEmulationMatchesDefaultPath) {
  GemmSettings settings;
  EXPECT_EQ(kernels::bf16_gemm_emulated(), !kernels::bf16_gemm_native());
  uint64_t seed = 300;
  for (const Dims& d : {Dims{37, 19, 53}, Dims{128, 96, 256}})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (DType da : {DType::F32, DType::BF16}) {
          auto [sa, sb] = operand_shapes(d.m, d.n, d.k, ta, tb);
          NDArray a = random_f32(sa, seed++), b = random_f32(sb, seed++);
          if (da == DType::BF16) a = a.to(DType::BF16);
          NDArray by_default = NDArray::empty({d.m, d.n}, DType::F32);
          NDArray emulated = NDArray::empty({d.m, d.n}, DType::F32);
          kernels::set_bf16_gemm_emulation(false);
          kernels::matmul(cpu_stream(), a, b, ta, tb, by_default, GemmCompute::kBF16);
          kernels::set_bf16_gemm_emulation(true);
          EXPECT_TRUE(kernels::bf16_gemm_emulated());
          kernels::matmul(cpu_stream(), a, b, ta, tb, emulated, GemmCompute::kBF16);
          const Reference ref = reference(a, b, ta, tb, true);
          expect_close(emulated, ref, 1e-5, "emulated");
          const std::vector<float> x = by_default.to_vector(), y = emulated.to_vector();
          for (size_t i = 0; i < x.size(); ++i)
            ASSERT_LE(std::fabs(x[i] - y[i]), 1e-5 * ref.scale[i]) << "element " << i;
        }
}

// fp32 compute on F32 operands is not rounded: both fp32 backends match the
// unrounded reference within 1e-5 relative (and each other).
TEST(GemmF32, BothBackendsMatchUnroundedReference) {
  GemmSettings settings;
  uint64_t seed = 500;
  for (const Dims& d : kShapes)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        auto [sa, sb] = operand_shapes(d.m, d.n, d.k, ta, tb);
        NDArray a = random_f32(sa, seed++), b = random_f32(sb, seed++);
        const Reference ref = reference(a, b, ta, tb, false);
        for (GemmF32Backend backend : {GemmF32Backend::kOpenBLAS, GemmF32Backend::kOneDNN}) {
          if (!kernels::set_f32_gemm_backend(backend)) continue;  // no oneDNN in this build
          NDArray out = NDArray::empty({d.m, d.n}, DType::F32);
          kernels::matmul(cpu_stream(), a, b, ta, tb, out);
          expect_close(out, ref, 1e-5,
                       std::string(backend == GemmF32Backend::kOneDNN ? "oneDNN" : "OpenBLAS") +
                           " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
          NDArray out16 = NDArray::empty({d.m, d.n}, DType::BF16);  // fp32 product, bf16 store
          kernels::matmul(cpu_stream(), a, b, ta, tb, out16);
          expect_close(out16, ref, 1e-5, "f32 -> bf16 output");
        }
      }
}

// A product whose bf16 rounding is visible: fp32 compute keeps it, bf16
// compute loses it.
TEST(GemmF32, ComputeKindChangesOnlyBf16) {
  GemmSettings settings;
  const float x = 1.0f + std::ldexp(1.0f, -12);  // not a bf16 value
  NDArray a = NDArray::from_vector({1, 1}, {x}), b = NDArray::from_vector({1, 1}, {1.0f});
  NDArray out = NDArray::empty({1, 1}, DType::F32);
  kernels::matmul(cpu_stream(), a, b, false, false, out);
  EXPECT_EQ(out.to_vector()[0], x);
  for (bool emulate : {false, true}) {
    kernels::set_bf16_gemm_emulation(emulate);
    kernels::matmul(cpu_stream(), a, b, false, false, out, GemmCompute::kBF16);
    EXPECT_EQ(out.to_vector()[0], 1.0f);
  }
}

// Primitives are keyed by thread count too: switching counts stays correct.
TEST(GemmBf16, ThreadCountsShareNoPrimitive) {
  GemmSettings settings;
  const int before = num_threads();
  NDArray a = random_f32({96, 200}, 40), b = random_f32({200, 72}, 41);
  const Reference ref = reference(a, b, false, false, true);
  for (int threads : {1, 2, 1}) {
    set_num_threads(threads);
    NDArray out = NDArray::empty({96, 72}, DType::F32);
    kernels::matmul(cpu_stream(), a, b, false, false, out, GemmCompute::kBF16);
    expect_close(out, ref, 1e-5, "threads " + std::to_string(threads));
  }
  set_num_threads(before);
}

TEST(GemmBackends, DescriptionNamesTheBackends) {
  GemmSettings settings;
  const std::string d = kernels::gemm_isa_description();
  EXPECT_NE(d.find("fp32"), std::string::npos) << d;
  if (kernels::bf16_gemm_native()) {
    EXPECT_NE(d.find("oneDNN"), std::string::npos) << d;
    EXPECT_EQ(d.find("emulated"), std::string::npos) << d;
  } else {
    EXPECT_NE(d.find("emulated"), std::string::npos) << d;
  }
  kernels::set_bf16_gemm_emulation(true);
  EXPECT_NE(kernels::gemm_isa_description().find("emulated"), std::string::npos);
}

TEST(GemmBackends, RejectsIntegerDtypes) {
  NDArray a = NDArray::zeros({2, 2}, DType::I32), b = random_f32({2, 2}, 1);
  NDArray out = NDArray::empty({2, 2}, DType::F32);
  EXPECT_NE(testing::error_of([&] { kernels::matmul(cpu_stream(), a, b, false, false, out); })
                .find("must be f32 or bf16"),
            std::string::npos);
}

}  // namespace
}  // namespace hspmd
