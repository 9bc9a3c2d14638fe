// The conformance harness (ggml's test-backend-ops in our terms): one case
// type, a case per kernel of src/kernels/kernel_list.inc (the list declares
// case_<kernel>; a kernel without one does not link), run on every target:
// each registered backend on each of its devices here (cpu:0, the device
// test double cpu:1, cuda:0 when a GPU is visible) and every CPU ISA variant
// of the build, each compared with the CPU baseline variant on cpu:0.
// Inputs are the same random arrays on every target, uploaded with the
// backend's to_device; results come back with its to_host.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "hspmd/core/device_code.h"
#include "kernels/backend.h"

namespace hspmd {
namespace {

using kernels::Backend;

// What a case sees of its target: the backend's table, a stream of the
// device, inputs made on the host and uploaded, and the results it keeps.
struct Io {
  Io(const Backend& b, Stream& stream) : backend(b), s(stream) {}
  const Backend& backend;
  Stream& s;
  std::mt19937 rng{1234};
  std::vector<NDArray> results;  // on the host
  std::vector<double> values;
  double tolerance = 2e-4;  // |x - y| <= tolerance * (1 + |y|)

  const kernels::KernelTable& k() const { return backend.kernels; }
  NDArray up(const NDArray& host) { return k().to_device(s, host); }
  NDArray host_f32(const Shape& shape, float lo = -1, float hi = 1) {
    std::uniform_real_distribution<float> d(lo, hi);
    NDArray a = NDArray::empty(shape, DType::F32);
    for (int64_t i = 0; i < a.numel(); ++i) a.data<float>()[i] = d(rng);
    return a;
  }
  NDArray f32(const Shape& shape, float lo = -1, float hi = 1) { return up(host_f32(shape, lo, hi)); }
  NDArray ids(const Shape& shape, int32_t lo, int32_t hi) {
    std::uniform_int_distribution<int32_t> d(lo, hi - 1);
    std::vector<int32_t> v(static_cast<size_t>(NDArray::empty(shape, DType::I32).numel()));
    for (int32_t& x : v) x = d(rng);
    return up(NDArray::from_vector_i32(shape, v));
  }
  NDArray out(const Shape& shape, DType dtype = DType::F32) { return k().zeros(s, shape, dtype); }
  void keep(const NDArray& a) { results.push_back(a.device() == Device::cpu() ? a.clone() : k().to_host(s, a)); }
};

// ---- one case per kernel of the list ----
#define HSPMD_KERNEL(name, ret, params, args, cpu) void case_##name(Io& io);
#include "kernels/kernel_list.inc"
#undef HSPMD_KERNEL

void case_add(Io& io) {
  NDArray a = io.f32({5, 37}), b = io.f32({5, 37}), o = io.out({5, 37});
  io.k().add(io.s, a, b, o);
  io.keep(o);
}
void case_mul(Io& io) {
  NDArray a = io.f32({5, 37}), b = io.f32({5, 37}), o = io.out({5, 37});
  io.k().mul(io.s, a, b, o);
  io.keep(o);
}
void case_scale(Io& io) {
  NDArray a = io.f32({5, 37}), o = io.out({5, 37});
  io.k().scale(io.s, a, 0.7f, o);
  io.keep(o);
}
void case_accumulate(Io& io) {
  NDArray a = io.f32({5, 37}), o = io.f32({5, 37});
  io.k().accumulate(io.s, a, o);
  io.keep(o);
}
void case_add_bias(Io& io) {
  NDArray x = io.f32({6, 40}), b = io.f32({40}), o = io.out({6, 40});
  io.k().add_bias(io.s, x, b, o);
  io.keep(o);
}
void case_bias_grad(Io& io) {
  NDArray dy = io.f32({6, 40}), db = io.out({40});
  io.k().bias_grad(io.s, dy, db);
  io.keep(db);
}
// How many elements of `x` and `y` (two results of one target, one shape
// and type) differ in their bits.
double bits_differ(Io& io, const NDArray& x, const NDArray& y) {
  const NDArray hx = x.device() == Device::cpu() ? x : io.k().to_host(io.s, x);
  const NDArray hy = y.device() == Device::cpu() ? y : io.k().to_host(io.s, y);
  if (hx.shape() != hy.shape() || hx.dtype() != hy.dtype()) return -1;
  const size_t size = dtype_size(hx.dtype());
  const auto* px = static_cast<const unsigned char*>(hx.raw_data());
  const auto* py = static_cast<const unsigned char*>(hy.raw_data());
  double differ = 0;
  for (int64_t i = 0; i < hx.numel(); ++i)
    differ += std::memcmp(px + i * size, py + i * size, size) != 0 ? 1 : 0;
  return differ;
}

// The measured mode keeps the default's bits: on CUDA it may only choose an
// algorithm whose output equals, bit for bit, the one the heuristic mode
// runs (docs/cuda.md, "GEMM algorithm choice"). For each shape (one with a
// long k, 256 x 8192 x 256, where split-K algorithms sum in another order)
// and each kind of call (f32 products; + an addend; bf16 products + an
// addend; bf16 operands to a bf16 output), the heuristic mode's output and
// the measured mode's at the key's first call (the choice) and second (the
// kept choice), kept as counts of differing elements: 0 on every target
// (the CPU backends ignore the mode). Then a key whose first call has all
// zero data (nothing to choose by: the default, no choice kept) and whose
// second has real data.
void matmul_measured_bits(Io& io) {
  struct Mode {  // the algorithm setting for a scope, restored after (also when a call throws)
    kernels::GemmAlgorithm before = kernels::gemm_algorithm();
    explicit Mode(kernels::GemmAlgorithm a) { kernels::set_gemm_algorithm(a); }
    ~Mode() { kernels::set_gemm_algorithm(before); }
  };
  const auto run_in = [](kernels::GemmAlgorithm algorithm, const std::function<void()>& f) {
    const Mode mode(algorithm);
    f();
  };
  for (const auto& [m, k, n] : {std::array<int64_t, 3>{33, 200, 40}, std::array<int64_t, 3>{128, 1024, 96},
                                std::array<int64_t, 3>{256, 8192, 256}}) {
    const NDArray a = io.f32({m, k}), b = io.f32({k, n}), bt = io.f32({n, k}), add = io.f32({m, n});
    const NDArray a16 = io.k().cast(io.s, a, DType::BF16), b16 = io.k().cast(io.s, b, DType::BF16);
    const std::vector<std::function<void(NDArray&)>> calls = {
        [&](NDArray& o) { io.k().matmul(io.s, a, b, false, false, o, kernels::GemmCompute::kF32, nullptr); },
        [&](NDArray& o) { io.k().matmul(io.s, a, bt, false, true, o, kernels::GemmCompute::kF32, &add); },
        [&](NDArray& o) { io.k().matmul(io.s, a, bt, false, true, o, kernels::GemmCompute::kBF16, &add); },
        [&](NDArray& o) { io.k().matmul(io.s, a16, b16, false, false, o, kernels::GemmCompute::kBF16, nullptr); },
    };
    for (size_t i = 0; i < calls.size(); ++i) {
      const DType out_type = i == 3 ? DType::BF16 : DType::F32;
      NDArray h = io.out({m, n}, out_type), first = io.out({m, n}, out_type), again = io.out({m, n}, out_type);
      run_in(kernels::GemmAlgorithm::kHeuristic, [&] { calls[i](h); });
      run_in(kernels::GemmAlgorithm::kMeasured, [&] {
        calls[i](first);
        calls[i](again);
      });
      io.values.push_back(bits_differ(io, first, h));
      io.values.push_back(bits_differ(io, again, h));
    }
  }
  // All zeros first (a shape of its own: a key not seen before; no addend,
  // which would make the output nonzero), then data.
  const NDArray zeros = io.out({48, 320}), a = io.f32({48, 320}), b = io.f32({320, 72});
  NDArray hz = io.out({48, 72}), mz = io.out({48, 72}), h = io.out({48, 72}), x = io.out({48, 72});
  run_in(kernels::GemmAlgorithm::kHeuristic, [&] {
    io.k().matmul(io.s, zeros, b, false, false, hz, kernels::GemmCompute::kF32, nullptr);
    io.k().matmul(io.s, a, b, false, false, h, kernels::GemmCompute::kF32, nullptr);
  });
  run_in(kernels::GemmAlgorithm::kMeasured, [&] {
    io.k().matmul(io.s, zeros, b, false, false, mz, kernels::GemmCompute::kF32, nullptr);
    io.k().matmul(io.s, a, b, false, false, x, kernels::GemmCompute::kF32, nullptr);
  });
  io.values.push_back(bits_differ(io, mz, hz));
  io.values.push_back(bits_differ(io, x, h));
}

void case_matmul(Io& io) {
  NDArray a = io.f32({9, 16}), b = io.f32({16, 12}), bt = io.f32({12, 16}), add = io.f32({9, 12});
  NDArray o = io.out({9, 12}), o2 = io.out({9, 12});
  io.k().matmul(io.s, a, b, false, false, o, kernels::GemmCompute::kF32, nullptr);
  io.k().matmul(io.s, a, bt, false, true, o2, kernels::GemmCompute::kF32, &add);
  io.keep(o);
  io.keep(o2);
  // With the algorithm measured at each key's first call (CUDA; the CPU
  // ignores the setting): f32 and bf16 products, an addend, a bf16 output.
  struct Measured {
    kernels::GemmAlgorithm before = kernels::gemm_algorithm();
    Measured() { kernels::set_gemm_algorithm(kernels::GemmAlgorithm::kMeasured); }
    ~Measured() { kernels::set_gemm_algorithm(before); }
  } measured;
  NDArray m1 = io.out({9, 12}), m2 = io.out({9, 12}), m3 = io.out({9, 12}), m4 = io.out({9, 12}, DType::BF16);
  io.k().matmul(io.s, a, b, false, false, m1, kernels::GemmCompute::kF32, nullptr);
  io.k().matmul(io.s, a, bt, false, true, m2, kernels::GemmCompute::kF32, &add);
  io.k().matmul(io.s, a, bt, false, true, m3, kernels::GemmCompute::kBF16, &add);
  io.k().matmul(io.s, a, b, false, false, m4, kernels::GemmCompute::kBF16, nullptr);
  for (const NDArray* r : {&m1, &m2, &m3, &m4}) io.keep(*r);
  matmul_measured_bits(io);
}
void case_transpose(Io& io) {
  NDArray a = io.f32({3, 4, 5}), o = io.out({5, 4, 3});
  io.k().transpose(io.s, a, 0, 2, o);
  io.keep(o);
}
void case_slice(Io& io) {
  NDArray a = io.f32({4, 10}), o = io.out({4, 5});
  io.k().slice(io.s, a, 1, 3, o);
  io.keep(o);
  // Along dim 0 (one row: CUDA's 1-D copy) and a middle dim (pitched rows).
  NDArray a3 = io.f32({6, 4, 3}), o0 = io.out({2, 4, 3}), o1 = io.out({6, 2, 3});
  io.k().slice(io.s, a3, 0, 3, o0);
  io.k().slice(io.s, a3, 1, 1, o1);
  io.keep(o0);
  io.keep(o1);
}
void case_slice_backward(Io& io) {
  NDArray g = io.f32({4, 5}), o = io.f32({4, 10});
  io.k().slice_backward(io.s, g, 1, 3, o);
  io.keep(o);
  NDArray g0 = io.f32({2, 4, 3}), o0 = io.f32({6, 4, 3});
  io.k().slice_backward(io.s, g0, 0, 3, o0);
  io.keep(o0);
}
void case_concat(Io& io) {
  std::vector<NDArray> parts = {io.f32({4, 3}), io.f32({4, 5})};
  NDArray o = io.out({4, 8});
  io.k().concat(io.s, parts, 1, o);
  io.keep(o);
  // Along dim 0 (each part one row: CUDA's 1-D copy).
  std::vector<NDArray> rows = {io.f32({2, 5}), io.f32({3, 5})};
  NDArray o0 = io.out({5, 5});
  io.k().concat(io.s, rows, 0, o0);
  io.keep(o0);
}
void case_reduce_sum(Io& io) {
  NDArray a = io.f32({4, 6, 5}), o = io.out({4, 5});
  io.k().reduce_sum(io.s, a, {false, true, false}, o);
  io.keep(o);
}
void case_broadcast_reduced(Io& io) {
  NDArray g = io.f32({4, 5}), o = io.out({4, 6, 5});
  io.k().broadcast_reduced(io.s, g, {false, true, false}, o);
  io.keep(o);
}
void case_embedding(Io& io) {
  NDArray w = io.f32({11, 8}), ids = io.ids({7}, 0, 11), o = io.out({7, 8});
  io.k().embedding(io.s, w, ids, 0, 11, o);
  io.keep(o);
  // The CUDA kernel's 16-byte groups (36 columns) and single columns (10),
  // a shard of rows [10, 30) of a vocabulary of 50 (other ids: zeros).
  for (int64_t h : {36, 10}) {
    NDArray ws = io.f32({20, h}), ids2 = io.ids({3, 13}, 0, 50), o2 = io.out({3, 13, h});
    io.k().embedding(io.s, ws, ids2, 10, 50, o2);
    io.keep(o2);
  }
}
void case_embedding_backward(Io& io) {
  NDArray g = io.f32({7, 8}), ids = io.ids({7}, 0, 11), dw = io.f32({11, 8});
  io.k().embedding_backward(io.s, g, ids, 0, 11, dw);
  io.keep(dw);
  // Many tokens of few ids (sums of up to ~20 rows), the CUDA kernel's
  // 16-byte groups (1028 columns: past one block of 256 x 4) and single
  // columns (10), a shard of rows [3, 8) of a vocabulary of 9.
  for (int64_t h : {1028, 10}) {
    NDArray g2 = io.f32({2, 41, h}), ids2 = io.ids({2, 41}, 0, 9), dw2 = io.f32({5, h});
    io.k().embedding_backward(io.s, g2, ids2, 3, 9, dw2);
    io.keep(dw2);
  }
}
// A random array of `shape` in `t` (f32 or bf16: the f32 values rounded).
NDArray random_in(Io& io, const Shape& shape, DType t) {
  const NDArray a = io.host_f32(shape);
  return io.up(t == DType::F32 ? a : a.to(t));
}
// Keeps `o16` (a bf16 result of the inputs that gave the f32 `o`) as its
// difference from `o` rounded to bf16 on the same target: zero where the
// kernel rounds its f32 value once (a bf16 result itself may sit one ulp
// from another backend's where the f32 values straddle a rounding point).
void keep_rounded_once(Io& io, const NDArray& o, const NDArray& o16) {
  NDArray minus = io.out(o.shape()), diff = io.out(o.shape());
  io.k().scale(io.s, io.k().cast(io.s, io.k().cast(io.s, o, DType::BF16), DType::F32), -1.0f, minus);
  io.k().add(io.s, minus, o16, diff);
  io.keep(diff);
}
// One rms_norm call of `shape` with x in `x_type`: the f32 output, and the
// bf16 output's difference from it rounded.
void rms_norm_shape(Io& io, const Shape& shape, DType x_type) {
  const int64_t h = shape.back();
  NDArray x = random_in(io, shape, x_type), w = io.f32({h}, 0.5f, 1.5f);
  NDArray o = io.out(shape), o16 = io.out(shape, DType::BF16);
  io.k().rms_norm(io.s, x, w, 1e-5f, o);
  io.k().rms_norm(io.s, x, w, 1e-5f, o16);
  io.keep(o);
  keep_rounded_once(io, o, o16);
}
void case_rms_norm(Io& io) {
  NDArray x = io.f32({6, 32}), w = io.f32({32}), o = io.out({6, 32});
  io.k().rms_norm(io.s, x, w, 1e-5f, o);
  io.keep(o);
  // The CUDA kernel's paths and tails: 16-byte groups with 1, 2 and 4 per
  // thread (rows of 2048, 4096, 8192), partly filled groups (1000, 8),
  // single columns (203, 4095: not multiples of 8), the wide-row kernel
  // past them (4099, 8200); bf16 and f32 x, one row and many.
  rms_norm_shape(io, {100, 2048}, DType::BF16);
  rms_norm_shape(io, {33, 2048}, DType::F32);
  rms_norm_shape(io, {5, 4096}, DType::F32);
  rms_norm_shape(io, {3, 8192}, DType::BF16);
  rms_norm_shape(io, {40, 1000}, DType::F32);
  rms_norm_shape(io, {7, 8}, DType::BF16);
  rms_norm_shape(io, {37, 203}, DType::BF16);
  rms_norm_shape(io, {1, 4095}, DType::F32);
  rms_norm_shape(io, {2, 4099}, DType::F32);
  rms_norm_shape(io, {2, 8200}, DType::BF16);
}
// One add_rms_norm call of `shape`: a, b and the sum in the given dtypes;
// keeps the sum and the f32 output, and the bf16 output's difference from
// the f32 one rounded.
void add_rms_norm_shape(Io& io, const Shape& shape, DType a_type, DType b_type, DType sum_type) {
  const int64_t h = shape.back();
  NDArray a = random_in(io, shape, a_type), b = random_in(io, shape, b_type), w = io.f32({h}, 0.5f, 1.5f);
  NDArray sum = io.out(shape, sum_type), sum2 = io.out(shape, sum_type);
  NDArray o = io.out(shape), o16 = io.out(shape, DType::BF16);
  io.k().add_rms_norm(io.s, a, b, w, 1e-5f, sum, o);
  io.k().add_rms_norm(io.s, a, b, w, 1e-5f, sum2, o16);
  io.keep(sum);
  io.keep(o);
  keep_rounded_once(io, o, o16);
}
void case_add_rms_norm(Io& io) {
  // The decoder's use (a bf16 block input, a bf16 branch, the f32 sum) and
  // the other dtypes, on the CUDA kernel's paths as rms_norm's cases: 16-byte
  // groups with 1, 2 and 4 per thread, partly filled groups, single columns,
  // the two kernels past them.
  add_rms_norm_shape(io, {6, 32}, DType::F32, DType::F32, DType::F32);
  add_rms_norm_shape(io, {100, 2048}, DType::BF16, DType::BF16, DType::F32);
  add_rms_norm_shape(io, {33, 2048}, DType::F32, DType::BF16, DType::F32);
  add_rms_norm_shape(io, {5, 4096}, DType::BF16, DType::F32, DType::BF16);
  add_rms_norm_shape(io, {3, 8192}, DType::F32, DType::F32, DType::F32);
  add_rms_norm_shape(io, {40, 1000}, DType::BF16, DType::BF16, DType::BF16);
  add_rms_norm_shape(io, {37, 203}, DType::BF16, DType::BF16, DType::F32);
  add_rms_norm_shape(io, {1, 4095}, DType::F32, DType::BF16, DType::BF16);
  add_rms_norm_shape(io, {2, 8200}, DType::BF16, DType::BF16, DType::F32);
}
// One rms_norm_backward call of `shape` with x in `x_type` and an addend in
// `add_type` (F64: none); keeps the f32 dx and dweight, and, for a bf16 dx
// of the same inputs, its difference from the f32 dx rounded on the same
// target (zero: "rounded once", free of the one-ulp straddles a bf16
// result may show against another backend's).
void rms_norm_backward_shape(Io& io, const Shape& shape, DType x_type, DType add_type, bool bf16_dx) {
  const int64_t h = shape.back();
  NDArray dy = io.f32(shape), w = io.f32({h}, 0.5f, 1.5f);
  const auto random_as = [&](DType t) {
    const NDArray a = io.host_f32(shape);
    return io.up(t == DType::F32 ? a : a.to(t));
  };
  NDArray x = random_as(x_type);
  NDArray add = add_type == DType::F64 ? NDArray() : random_as(add_type);
  const NDArray* addend = add.valid() ? &add : nullptr;
  // The f32 dx with its bf16 copy written in the same pass (a cast's bits).
  NDArray dx = io.out(shape), dw = io.out({h}), copy = io.out(shape, DType::BF16);
  io.k().rms_norm_backward(io.s, dy, x, w, 1e-5f, dx, dw, addend, &copy);
  io.keep(dx);
  io.keep(dw);
  keep_rounded_once(io, dx, copy);
  if (!bf16_dx) return;
  NDArray dx16 = io.out(shape, DType::BF16), dw2 = io.out({h});
  io.k().rms_norm_backward(io.s, dy, x, w, 1e-5f, dx16, dw2, addend, nullptr);
  NDArray minus = io.out(shape), diff = io.out(shape);
  io.k().scale(io.s, io.k().cast(io.s, io.k().cast(io.s, dx, DType::BF16), DType::F32), -1.0f, minus);
  io.k().add(io.s, minus, dx16, diff);
  io.keep(diff);
  io.keep(dw2);
}
void case_rms_norm_backward(Io& io) {
  NDArray dy = io.f32({6, 32}), x = io.f32({6, 32}), w = io.f32({32}), add = io.f32({6, 32});
  NDArray dx = io.out({6, 32}), dw = io.out({32});
  io.k().rms_norm_backward(io.s, dy, x, w, 1e-5f, dx, dw, &add, nullptr);
  io.keep(dx);
  io.keep(dw);
  // The CUDA kernel's paths and tails: 16-byte groups with 1, 2 and 4 per
  // thread (rows of 2048, 4096, 8192), partly filled groups (1000), single
  // columns (203: not a multiple of 8), two kernels past them (4099, 8200);
  // one row, and row counts that leave the last block of 32 rows short.
  rms_norm_backward_shape(io, {100, 2048}, DType::BF16, DType::BF16, true);
  rms_norm_backward_shape(io, {1, 4096}, DType::F32, DType::F64, false);
  rms_norm_backward_shape(io, {3, 8192}, DType::BF16, DType::F32, true);
  rms_norm_backward_shape(io, {40, 1000}, DType::F32, DType::BF16, true);
  rms_norm_backward_shape(io, {37, 203}, DType::BF16, DType::BF16, true);
  rms_norm_backward_shape(io, {2, 4099}, DType::F32, DType::F32, false);
  rms_norm_backward_shape(io, {2, 8200}, DType::BF16, DType::F64, true);
}
// One rope call of `shape` ([B, S, heads, D]) with x in `x_type`, forward
// or inverse: the f32 output and the bf16 one's difference from it rounded.
void rope_shape(Io& io, const Shape& shape, DType x_type, bool inverse) {
  NDArray x = random_in(io, shape, x_type), pos = io.ids({shape[0], shape[1]}, 0, 4096);
  NDArray o = io.out(shape), o16 = io.out(shape, DType::BF16);
  io.k().rope(io.s, x, pos, 10000.0f, inverse, o);
  io.k().rope(io.s, x, pos, 10000.0f, inverse, o16);
  io.keep(o);
  keep_rounded_once(io, o, o16);
}
void case_rope(Io& io) {
  NDArray x = io.f32({2, 5, 3, 8}), pos = io.ids({2, 5}, 0, 9), o = io.out({2, 5, 3, 8});
  io.k().rope(io.s, x, pos, 10000.0f, false, o);
  io.keep(o);
  // The CUDA kernel's 16-byte path (half a head a multiple of 8: D 16, 64,
  // 128) and its single pairs (D 20, 6), f32 and bf16 x, the inverse.
  rope_shape(io, {2, 7, 3, 64}, DType::F32, false);
  rope_shape(io, {1, 9, 5, 128}, DType::BF16, false);
  rope_shape(io, {3, 5, 1, 16}, DType::BF16, true);
  rope_shape(io, {2, 3, 3, 20}, DType::F32, true);
  rope_shape(io, {1, 11, 2, 6}, DType::BF16, false);
}
// q and k (their own head counts) in one call: rope's results on each, f32
// and bf16 inputs and outputs, forward and inverse; the CUDA kernel's one
// launch (half a head a multiple of 8) and its two-call fallback (D 20;
// q and k of different dtypes).
void case_rope_qk(Io& io) {
  struct Shapes {
    int64_t b, s, hq, hk, d;
    DType in_q, in_k;
    bool inverse;
  };
  for (const Shapes& c : {Shapes{2, 7, 4, 1, 64, DType::F32, DType::F32, false},
                          Shapes{1, 9, 3, 2, 128, DType::BF16, DType::BF16, true},
                          Shapes{3, 5, 2, 2, 16, DType::BF16, DType::BF16, false},
                          Shapes{2, 3, 3, 1, 20, DType::F32, DType::F32, true},
                          Shapes{1, 6, 2, 1, 16, DType::F32, DType::BF16, false}}) {
    const Shape qs = {c.b, c.s, c.hq, c.d}, ks = {c.b, c.s, c.hk, c.d};
    NDArray q = random_in(io, qs, c.in_q), k = random_in(io, ks, c.in_k), pos = io.ids({c.b, c.s}, 0, 4096);
    NDArray qo = io.out(qs), ko = io.out(ks), qo16 = io.out(qs, DType::BF16), ko16 = io.out(ks, DType::BF16);
    io.k().rope_qk(io.s, q, k, pos, 10000.0f, c.inverse, qo, ko);
    io.k().rope_qk(io.s, q, k, pos, 10000.0f, c.inverse, qo16, ko16);
    io.keep(qo);
    io.keep(ko);
    keep_rounded_once(io, qo, qo16);
    keep_rounded_once(io, ko, ko16);
  }
}
void case_swiglu(Io& io) {
  NDArray g = io.f32({6, 24}), u = io.f32({6, 24}), o = io.out({6, 24});
  io.k().swiglu(io.s, g, u, o);
  io.keep(o);
}
void case_swiglu_backward(Io& io) {
  NDArray dy = io.f32({6, 24}), g = io.f32({6, 24}), u = io.f32({6, 24});
  NDArray dg = io.out({6, 24}), du = io.out({6, 24}), o = io.out({6, 24});
  io.k().swiglu_backward(io.s, dy, g, u, dg, du, &o);
  for (const NDArray* a : {&dg, &du, &o}) io.keep(*a);
}

// The router on 9 tokens of 7 experts, top 3: probs, top-k and the weights
// (normalized and not), and its gradient with and without the auxiliary
// loss's dprobs, at the target's own top-k.
void case_moe_route(Io& io) {
  for (bool normalize : {true, false}) {
    NDArray l = io.f32({9, 7}, -3, 3), w = io.out({9, 3}), idx = io.out({9, 3}, DType::I32), p = io.out({9, 7});
    io.k().moe_route(io.s, l, 3, normalize, w, idx, p);
    for (const NDArray* a : {&w, &idx, &p}) io.keep(*a);
  }
}
void case_moe_route_backward(Io& io) {
  for (bool normalize : {true, false}) {
    NDArray l = io.f32({9, 7}, -3, 3), w = io.out({9, 3}), idx = io.out({9, 3}, DType::I32), p = io.out({9, 7});
    io.k().moe_route(io.s, l, 3, normalize, w, idx, p);
    NDArray dw = io.f32({9, 3}), dp = io.f32({9, 7}), dl = io.out({9, 7}), dl2 = io.out({9, 7});
    io.k().moe_route_backward(io.s, p, idx, dw, &dp, normalize, dl);
    io.k().moe_route_backward(io.s, p, idx, dw, nullptr, normalize, dl2);
    io.keep(dl);
    io.keep(dl2);
  }
}
// 6 tokens, 2 slots each, permuted over 12 rows of 10 (a fixed shuffle).
NDArray moe_rows(Io& io) {
  std::vector<int32_t> r(12);
  for (int i = 0; i < 12; ++i) r[i] = (i * 5 + 3) % 12;
  return io.up(NDArray::from_vector_i32({6, 2}, r));
}
void case_moe_combine(Io& io) {
  NDArray in = io.f32({12, 10}), rows = moe_rows(io), w = io.f32({6, 2}, 0, 1);
  NDArray y = io.out({6, 10}), y1 = io.out({6, 10});
  io.k().moe_combine(io.s, in, rows, &w, y);
  io.k().moe_combine(io.s, in, rows, nullptr, y1);
  io.keep(y);
  io.keep(y1);
}
void case_moe_combine_backward(Io& io) {
  NDArray dy = io.f32({6, 10}), in = io.f32({12, 10}), rows = moe_rows(io), w = io.f32({6, 2}, 0, 1);
  NDArray d = io.f32({12, 10}), dw = io.out({6, 2}), d1 = io.f32({12, 10});
  io.k().moe_combine_backward(io.s, dy, in, rows, &w, d, &dw);
  io.k().moe_combine_backward(io.s, dy, in, rows, nullptr, d1, nullptr);
  for (const NDArray* a : {&d, &dw, &d1}) io.keep(*a);
}
void case_sigmoid_gate(Io& io) {
  NDArray x = io.f32({5, 3, 9}), g = io.f32({5, 3, 1}, -4, 4), o = io.out({5, 3, 9});
  io.k().sigmoid_gate(io.s, x, g, o);
  io.keep(o);
}
void case_sigmoid_gate_backward(Io& io) {
  NDArray dy = io.f32({5, 3, 9}), x = io.f32({5, 3, 9}), g = io.f32({5, 3, 1}, -4, 4);
  NDArray dx = io.out({5, 3, 9}), dg = io.out({5, 3, 1});
  io.k().sigmoid_gate_backward(io.s, dy, x, g, dx, dg);
  io.keep(dx);
  io.keep(dg);
}

// Rows of 31 classes, one target ignored (-100), normalizer 8.
struct CrossEntropyInputs {
  NDArray logits, targets, normalizer;
  explicit CrossEntropyInputs(Io& io, int64_t width = 31)
      : logits(io.f32({9, width}, -3, 3)), normalizer(io.up(NDArray::from_vector({1}, {8.0f}))) {
    std::vector<int32_t> t = {0, 5, 30, 12, -100, 7, 19, 3, 25};
    targets = io.up(NDArray::from_vector_i32({9}, t));
  }
};

// Wider rows for the CUDA kernels' paths: `rows` rows of `width` logits,
// targets below `classes` (0: all), every fifth row ignored, normalizer 8.
struct WideCrossEntropyInputs {
  NDArray logits, targets, normalizer;
  WideCrossEntropyInputs(Io& io, int64_t rows, int64_t width, int64_t classes)
      : logits(io.f32({rows, width}, -8, 8)), normalizer(io.up(NDArray::from_vector({1}, {8.0f}))) {
    std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>((classes > 0 ? classes : width) - 1));
    std::vector<int32_t> t(static_cast<size_t>(rows));
    for (size_t r = 0; r < t.size(); ++r) t[r] = r % 5 == 3 ? -100 : d(io.rng);
    targets = io.up(NDArray::from_vector_i32({rows}, t));
  }
};

void case_cross_entropy(Io& io) {
  CrossEntropyInputs in(io);
  NDArray loss = io.out({1}), lse = io.out({9});
  io.k().cross_entropy(io.s, in.logits, in.targets, in.normalizer, -100, loss, lse, 0);
  io.keep(loss);
  io.keep(lse);
  // The CUDA kernel's 16-byte groups with many per thread (4000 and the
  // 32000 vocabulary), a padded vocabulary whose classes end inside a group
  // (classes 3998 of 4000: a tail of single entries), rows not a multiple
  // of 4 (1003: single entries throughout).
  for (const auto& [rows, width, classes] : std::vector<std::array<int64_t, 3>>{
           {11, 4000, 0}, {3, 32000, 0}, {6, 4000, 3998}, {7, 1003, 0}, {5, 1003, 1001}}) {
    WideCrossEntropyInputs w(io, rows, width, classes);
    NDArray wl = io.out({1}), wlse = io.out({rows});
    io.k().cross_entropy(io.s, w.logits, w.targets, w.normalizer, -100, wl, wlse, classes);
    io.keep(wl);
    io.keep(wlse);
  }
  // -inf logits (the first 300 of each row: whole 16-byte groups and
  // threads that see nothing else) add nothing to the sum.
  NDArray host = io.host_f32({4, 4000}, -8, 8);
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t j = 0; j < 300; ++j) host.data<float>()[r * 4000 + j] = -INFINITY;
  const NDArray masked = io.up(host), tm = io.up(NDArray::from_vector_i32({4}, {300, 3999, -100, 1234}));
  NDArray ml = io.out({1}), mlse = io.out({4});
  io.k().cross_entropy(io.s, masked, tm, io.up(NDArray::from_vector({1}, {3.0f})), -100, ml, mlse, 0);
  io.keep(ml);
  io.keep(mlse);
  // bf16 logits (a bf16 LM head): 16-byte groups of 8 (4000, 32000), a
  // padded vocabulary ending inside a group, single entries (1003), -inf.
  for (const auto& [rows, width, classes] :
       std::vector<std::array<int64_t, 3>>{{11, 4000, 0}, {3, 32000, 0}, {6, 4000, 3998}, {5, 1003, 1001}}) {
    WideCrossEntropyInputs w(io, rows, width, classes);
    const NDArray x16 = io.k().cast(io.s, w.logits, DType::BF16);
    NDArray wl = io.out({1}), wlse = io.out({rows});
    io.k().cross_entropy(io.s, x16, w.targets, w.normalizer, -100, wl, wlse, classes);
    io.keep(wl);
    io.keep(wlse);
  }
  const NDArray masked16 = io.k().cast(io.s, masked, DType::BF16);
  io.k().cross_entropy(io.s, masked16, tm, io.up(NDArray::from_vector({1}, {3.0f})), -100, ml, mlse, 0);
  io.keep(ml);
  io.keep(mlse);
}
void case_cross_entropy_shard_stats(Io& io) {
  CrossEntropyInputs in(io, 16);  // entries [8, 24) of 31
  NDArray local = io.out({9}), picked = io.out({9});
  io.k().cross_entropy_shard_stats(io.s, in.logits, in.targets, 8, 31, -100, local, picked, 0);
  io.keep(local);
  io.keep(picked);
  // A shard of 4000 entries [4000, 8000) of a padded vocabulary of 7990
  // classes (its last 10 entries padding), the rows' targets anywhere.
  WideCrossEntropyInputs w(io, 9, 4000, 7990);
  const std::vector<int32_t> t = {4000, 7989, 12, -100, 5000, 7999 - 10, 3999, 6001, 4003};
  w.targets = io.up(NDArray::from_vector_i32({9}, t));
  NDArray wl = io.out({9}), wp = io.out({9});
  io.k().cross_entropy_shard_stats(io.s, w.logits, w.targets, 4000, 8000, -100, wl, wp, 7990);
  io.keep(wl);
  io.keep(wp);
  // The same shard's logits in bf16.
  const NDArray x16 = io.k().cast(io.s, w.logits, DType::BF16);
  io.k().cross_entropy_shard_stats(io.s, x16, w.targets, 4000, 8000, -100, wl, wp, 7990);
  io.keep(wl);
  io.keep(wp);
}
void case_cross_entropy_combine(Io& io) {
  CrossEntropyInputs in(io);
  NDArray shard_lse = io.f32({2, 9}, 1, 3), picked = io.f32({9}), loss = io.out({1}), lse = io.out({9});
  io.k().cross_entropy_combine(io.s, shard_lse, picked, in.targets, in.normalizer, -100, loss, lse);
  io.keep(loss);
  io.keep(lse);
}
void case_cross_entropy_backward(Io& io) {
  CrossEntropyInputs in(io);
  NDArray dloss = io.up(NDArray::from_vector({1}, {1.5f})), lse = io.f32({9}, 4, 5), d = io.out({9, 31});
  io.k().cross_entropy_backward(io.s, dloss, in.logits, in.targets, in.normalizer, lse, -100, 0, d, 0);
  io.keep(d);
  // The CUDA kernel's 16-byte groups (rows a multiple of 8) with a padded
  // vocabulary ending inside a group, single columns (1003), f32 and bf16
  // gradients (the bf16 one as its difference from the f32 one rounded).
  for (const auto& [rows, width, classes] :
       std::vector<std::array<int64_t, 3>>{{11, 4000, 0}, {6, 4000, 3995}, {5, 1003, 1001}}) {
    WideCrossEntropyInputs w(io, rows, width, classes);
    NDArray wlse = io.f32({rows}, 8, 10), wd = io.out({rows, width}), wd16 = io.out({rows, width}, DType::BF16);
    io.k().cross_entropy_backward(io.s, dloss, w.logits, w.targets, w.normalizer, wlse, -100, 0, wd, classes);
    io.k().cross_entropy_backward(io.s, dloss, w.logits, w.targets, w.normalizer, wlse, -100, 0, wd16, classes);
    io.keep(wd);
    keep_rounded_once(io, wd, wd16);
    // From bf16 logits, into f32 and bf16 gradients.
    const NDArray x16 = io.k().cast(io.s, w.logits, DType::BF16);
    NDArray bd = io.out({rows, width}), bd16 = io.out({rows, width}, DType::BF16);
    io.k().cross_entropy_backward(io.s, dloss, x16, w.targets, w.normalizer, wlse, -100, 0, bd, classes);
    io.k().cross_entropy_backward(io.s, dloss, x16, w.targets, w.normalizer, wlse, -100, 0, bd16, classes);
    io.keep(bd);
    keep_rounded_once(io, bd, bd16);
  }
}

// One batch row of 16 tokens in two documents (positions restart at 10),
// 2 heads of 8, tiles of 8.
struct AttentionInputs {
  NDArray q, k, v, documents;
  kernels::AttentionTiles tiles{8, 8};
  float scale = 0.35f;
  explicit AttentionInputs(Io& io) : q(io.f32({1, 16, 2, 8})), k(io.f32({1, 16, 2, 8})), v(io.f32({1, 16, 2, 8})) {
    std::vector<int32_t> pos(16);
    for (int i = 0; i < 16; ++i) pos[i] = i < 10 ? i : i - 10;
    documents = io.up(NDArray::from_vector_i32({1, 16}, pos));
  }
};

void case_attention_forward(Io& io) {
  AttentionInputs in(io);
  NDArray o = io.out({1, 16, 2, 8}), lse = io.out({1, 2, 16});
  io.k().attention_forward(io.s, in.q, in.k, in.v, in.documents, in.scale, o, lse, in.tiles, DType::F32, 0);
  io.keep(o);
  io.keep(lse);
}
void case_attention_backward(Io& io) {
  AttentionInputs in(io);
  NDArray o = io.out({1, 16, 2, 8}), lse = io.out({1, 2, 16}), g = io.f32({1, 16, 2, 8});
  io.k().attention_forward(io.s, in.q, in.k, in.v, in.documents, in.scale, o, lse, in.tiles, DType::F32, 0);
  NDArray dq = io.out({1, 16, 2, 8}), dk = io.out({1, 16, 2, 8}), dv = io.out({1, 16, 2, 8});
  io.k().attention_backward(io.s, in.q, in.k, in.v, o, lse, g, in.documents, in.scale, dq, dk, dv, in.tiles,
                            DType::F32, 0);
  for (const NDArray* a : {&dq, &dk, &dv}) io.keep(*a);
}

// A ring-attention block: queries 8..15 against keys 0..7 of one document.
struct BlockInputs {
  std::vector<int64_t> q_index, k_index;
  std::vector<int32_t> q_start = std::vector<int32_t>(8, 0);
  kernels::AttentionBlock blk;
  explicit BlockInputs(Io& io) {
    for (int64_t i = 0; i < 8; ++i) {
      q_index.push_back(8 + i);
      k_index.push_back(i);
    }
    blk.q = io.f32({1, 8, 2, 8});
    blk.k = io.f32({1, 8, 2, 8});
    blk.v = io.f32({1, 8, 2, 8});
    blk.q_index = q_index;
    blk.q_start = q_start;
    blk.k_index = k_index;
    blk.scale = 0.35f;
  }
};

void case_attention_block_forward(Io& io) {
  BlockInputs in(io);
  NDArray o = io.out({1, 8, 2, 8}), lse = io.out({1, 2, 8});
  io.k().attention_block_forward(io.s, in.blk, o, lse, {8, 8});
  io.keep(o);
  io.keep(lse);
}
void case_attention_merge(Io& io) {
  NDArray o = io.f32({1, 8, 2, 8}), lse = io.f32({1, 2, 8}), ob = io.f32({1, 8, 2, 8}), lb = io.f32({1, 2, 8});
  io.k().attention_merge(io.s, o, lse, ob, lb);
  io.keep(o);
  io.keep(lse);
}
void case_attention_row_dots(Io& io) {
  NDArray o = io.f32({1, 8, 2, 8}), g = io.f32({1, 8, 2, 8}), delta = io.out({1, 2, 8});
  io.k().attention_row_dots(io.s, o, g, delta, false);
  io.keep(delta);
}
void case_attention_block_backward(Io& io) {
  BlockInputs in(io);
  NDArray g = io.f32({1, 8, 2, 8}), lse = io.f32({1, 2, 8}, 1, 2), delta = io.f32({1, 2, 8});
  NDArray dq = io.f32({1, 8, 2, 8}), dk = io.f32({1, 8, 2, 8}), dv = io.f32({1, 8, 2, 8});
  io.k().attention_block_backward(io.s, in.blk, g, lse, delta, dq, dk, dv, {8, 8});
  for (const NDArray* a : {&dq, &dk, &dv}) io.keep(*a);
}

void case_fill(Io& io) {
  NDArray o = io.out({5, 7});
  io.k().fill(io.s, o, 1.5f);
  io.keep(o);
}
void case_zeros(Io& io) { io.keep(io.k().zeros(io.s, {4, 5}, DType::F32)); }
void case_copy(Io& io) {
  NDArray a = io.f32({4, 5}), o = io.out({4, 5});
  io.k().copy(io.s, a, o);
  io.keep(o);
}
void case_cast(Io& io) {
  NDArray a = io.f32({4, 5});
  io.keep(io.k().cast(io.s, io.k().cast(io.s, a, DType::BF16), DType::F32));
}
void case_copy_block(Io& io) {
  NDArray from = io.f32({4, 6}), to = io.f32({5, 7});
  io.k().copy_block(io.s, from, {1, 2}, to, {0, 1}, {3, 3}, true);
  io.keep(to);
}
void case_to_host(Io& io) { io.results.push_back(io.k().to_host(io.s, io.f32({3, 4})).clone()); }
void case_to_device(Io& io) { io.keep(io.k().to_device(io.s, io.host_f32({3, 4}))); }
void case_sum_of_squares(Io& io) {
  std::vector<NDArray> arrays = {io.f32({4, 5}), io.f32({7})};
  io.values.push_back(io.k().sum_of_squares(io.s, arrays));
  // Chunks of 65536 on CUDA with a short last one, an empty array, one
  // element, and a view one element in (not 16-byte aligned).
  const NDArray base = io.f32({1001});
  arrays = {io.f32({70001}), io.f32({0}), io.f32({1}), base.slice(0, 1, 1001), io.f32({2048})};
  io.values.push_back(io.k().sum_of_squares(io.s, arrays));
}
void case_clip_control(Io& io) {
  // Chunks of 65536 with a short last one, an empty array, one element and
  // a view one element in; the norm above the limit, below it, no limit;
  // each loss term non-finite in turn, and the norm (an inf gradient).
  const NDArray base = io.f32({1001}, -3, 3);
  std::vector<NDArray> grads = {io.f32({70001}), io.f32({0}), io.f32({1}), base.slice(0, 1, 1001)};
  auto loss = [&](float v) {
    NDArray h = NDArray::empty({}, DType::F32);
    h.data<float>()[0] = v;
    return io.up(h);
  };
  std::vector<NDArray> losses = {loss(2.5f), loss(-0.25f)};
  auto run = [&](const std::vector<NDArray>& g, const std::vector<NDArray>& l, double max_norm, bool sum) {
    NDArray control = io.out({3}, DType::F64);
    io.k().clip_control(io.s, g, l, max_norm, control);
    const NDArray c = io.k().to_host(io.s, control);
    if (sum) io.values.push_back(c.data<double>()[0]);
    io.values.push_back(c.data<double>()[1]);
    io.values.push_back(c.data<double>()[2]);
  };
  for (double max_norm : {1.0, 1e6, 0.0}) run(grads, losses, max_norm, true);
  run({}, {}, 1.0, true);  // nothing: sum 0, coefficient 1, finite
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (float bad : {nan, inf, -inf}) {
    run(grads, {losses[0], loss(bad)}, 1.0, true);
    NDArray h = NDArray::empty({3}, DType::F32);
    for (int i = 0; i < 3; ++i) h.data<float>()[i] = i == 1 ? bad : 0.5f;
    run({grads[0], io.up(h)}, losses, 1.0, false);  // the sum is not finite: not compared
  }
}
void case_adam_step(Io& io) {
  NDArray p = io.f32({33}), g = io.f32({33}), m = io.f32({33}), v = io.f32({33}, 0.1f, 1);
  kernels::AdamFactors f{0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, 0.0f, 0.999f, 1.0f, 1e-3f};
  io.k().adam_step(io.s, {{&p, &g, &m, &v}}, f);
  for (const NDArray* a : {&p, &m, &v}) io.keep(*a);
  // Many tensors in one call (one launch on CUDA): a chunk of 65536 and a
  // short one, an empty tensor, one element, 16-byte groups with a tail, and
  // views one element in (not aligned: single elements).
  std::vector<NDArray> arrays;
  for (int64_t n : {70001, 0, 1, 2051, 1001})
    for (int i = 0; i < 4; ++i) arrays.push_back(i == 3 ? io.f32({n}, 0.1f, 1) : io.f32({n}));
  std::vector<NDArray> views(arrays.end() - 4, arrays.end());
  for (NDArray& a : views) a = a.slice(0, 1, 1001);
  std::vector<kernels::AdamTensor> tensors;
  for (size_t t = 0; t + 4 <= arrays.size(); t += 4) {
    std::vector<NDArray>& from = t + 4 == arrays.size() ? views : arrays;
    const size_t at = t + 4 == arrays.size() ? 0 : t;
    tensors.push_back({&from[at], &from[at + 1], &from[at + 2], &from[at + 3]});
  }
  // The parameters' bf16 copies written in the same pass (AdamTensor::
  // param_bf16): for every tensor but the one-element one, the views' copy
  // a view one element in too (single elements).
  std::vector<NDArray> copies;
  for (const kernels::AdamTensor& t : tensors) {
    const int64_t n = t.param->numel();
    copies.push_back(t.param->data<float>() == views[0].data<float>() ? io.out({n + 1}, DType::BF16).slice(0, 1, n + 1)
                                                                     : io.out({n}, DType::BF16));
  }
  for (size_t t = 0; t < tensors.size(); ++t)
    if (tensors[t].param->numel() != 1) tensors[t].param_bf16 = &copies[t];
  kernels::AdamFactors w{0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, 0.0f, 0.9997f, 0.3f, 2e-3f};
  io.k().adam_step(io.s, tensors, w);
  for (size_t t = 0; t < arrays.size(); t += 4)
    for (int i : {0, 2, 3}) io.keep(arrays[t + i]);  // the views' writes show in their arrays
  // Each copy is the target's own cast of its updated parameter, bit for bit.
  const auto copy_mismatches = [&](const std::vector<kernels::AdamTensor>& ts) {
    for (const kernels::AdamTensor& t : ts) {
      if (t.param_bf16 == nullptr) continue;
      const NDArray want = io.k().to_host(io.s, io.k().cast(io.s, *t.param, DType::BF16));
      const NDArray got = io.k().to_host(io.s, *t.param_bf16).contiguous();
      int64_t differ = 0;
      for (int64_t i = 0; i < want.numel(); ++i)
        differ += want.data<uint16_t>()[i] != got.data<uint16_t>()[i] ? 1 : 0;
      io.values.push_back(static_cast<double>(differ));
    }
  };
  copy_mismatches(tensors);
  // The clip's coefficient read with each gradient (grad_scale), with L2 and
  // without, on the 16-byte path and the single elements; the gradients kept.
  for (float l2 : {0.0f, 0.02f}) {
    std::vector<NDArray> c;
    for (int64_t n : {2051, 7})
      for (int i = 0; i < 4; ++i) c.push_back(i == 3 ? io.f32({n}, 0.1f, 1) : io.f32({n}));
    kernels::AdamFactors clip{0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, l2, 0.999f, 0.6f, 1e-3f, 0.37f};
    io.k().adam_step(io.s, {{&c[0], &c[1], &c[2], &c[3]}, {&c[4], &c[5], &c[6], &c[7]}}, clip);
    for (const NDArray& a : c) io.keep(a);
  }
  // The coefficient and the guard read from clip_control's array on the
  // device: applied (grad_scale ignored), then skipped (nothing written).
  for (double apply : {1.0, 0.0}) {
    std::vector<NDArray> c;
    for (int64_t n : {2051, 7})
      for (int i = 0; i < 4; ++i) c.push_back(i == 3 ? io.f32({n}, 0.1f, 1) : io.f32({n}));
    NDArray h = NDArray::empty({3}, DType::F64);
    h.data<double>()[0] = 9.0;
    h.data<double>()[1] = static_cast<double>(0.43f);
    h.data<double>()[2] = apply;
    const NDArray control = io.up(h);
    kernels::AdamFactors f{0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, 0.0f, 0.999f, 0.6f, 1e-3f, 7.0f, &control};
    // The bf16 copies start as the parameters' casts: rewritten when the
    // step applies, left as they are (still the casts) when it is skipped.
    NDArray b0 = io.k().cast(io.s, c[0], DType::BF16), b4 = io.k().cast(io.s, c[4], DType::BF16);
    const std::vector<kernels::AdamTensor> ts = {{&c[0], &c[1], &c[2], &c[3], &b0}, {&c[4], &c[5], &c[6], &c[7], &b4}};
    io.k().adam_step(io.s, ts, f);
    for (const NDArray& a : c) io.keep(a);
    copy_mismatches(ts);
  }
}

// ---- the harness ----

struct KernelCase {
  const char* kernel;
  void (*run)(Io&);
  bool cpu_only = false;  // listed as HSPMD_CPU_ONLY_KERNEL: the CPU targets only
};

const std::vector<KernelCase>& all_cases() {
  static const std::vector<KernelCase> cases = {
#define HSPMD_KERNEL(name, ret, params, args, cpu) {#name, &case_##name, false},
#define HSPMD_CPU_ONLY_KERNEL(name, ret, params, args, cpu) {#name, &case_##name, true},
#include "kernels/kernel_list.inc"
#undef HSPMD_CPU_ONLY_KERNEL
#undef HSPMD_KERNEL
  };
  return cases;
}

struct Target {
  const Backend* backend;
  Device device;
  std::string label() const { return std::string(backend->name) + " on " + device.str(); }
};

// Every registered backend on each of its devices here, then the CPU variants.
std::vector<Target> targets() {
  std::vector<Target> out;
  for (const Backend* b : kernels::registered_backends()) {
    if (b->device_type == DeviceType::CPU) {
      out.push_back({b, Device::cpu()});
      out.push_back({b, Device::host_double()});
    } else if (b->device_type == DeviceType::CUDA && cuda_device_count() > 0) {
      out.push_back({b, Device::cuda(0)});
    }
  }
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512})
    if (const Backend* b = kernels::cpu::variant_backend(isa)) out.push_back({b, Device::cpu()});
  return out;
}

Io run_case(const KernelCase& c, const Target& t) {
  Io io(*t.backend, default_stream(t.device));
  const DeviceCodeScope code;  // the test double's arrays, read by the CPU kernels
  c.run(io);
  io.s.synchronize();
  return io;
}

// "" when `got` is `want` within the tolerance, else what differs first.
std::string mismatch(const NDArray& got, const NDArray& want, double tol) {
  if (got.shape() != want.shape()) return "another shape";
  const NDArray g = got.to(DType::F32), w = want.to(DType::F32);
  for (int64_t i = 0; i < w.numel(); ++i) {
    const double x = g.data<float>()[i], y = w.data<float>()[i];
    if (std::isinf(y) && x == y) continue;
    if (!(std::abs(x - y) <= tol * (1 + std::abs(y))))
      return "element " + std::to_string(i) + " is " + std::to_string(x) + ", want " + std::to_string(y);
  }
  return "";
}

class Conformance : public testing::TestWithParam<size_t> {};

TEST_P(Conformance, EveryBackendAgreesWithTheCpuBaseline) {
  const KernelCase& c = all_cases()[GetParam()];
  const Backend* base = kernels::cpu::variant_backend(CpuIsa::kBaseline);
  ASSERT_NE(base, nullptr);
  const Io want = run_case(c, {base, Device::cpu()});
  ASSERT_FALSE(want.results.empty() && want.values.empty()) << c.kernel << ": the case keeps nothing";
  for (const Target& t : targets()) {
    if (c.cpu_only && t.backend->device_type != DeviceType::CPU) continue;
    const Io got = run_case(c, t);
    const std::string what = std::string(c.kernel) + " on " + t.label();
    ASSERT_EQ(got.results.size(), want.results.size()) << what;
    for (size_t i = 0; i < want.results.size(); ++i)
      EXPECT_EQ(mismatch(got.results[i], want.results[i], want.tolerance), "") << what << ", result " << i;
    ASSERT_EQ(got.values.size(), want.values.size()) << what;
    for (size_t i = 0; i < want.values.size(); ++i)
      EXPECT_NEAR(got.values[i], want.values[i], want.tolerance * (1 + std::abs(want.values[i]))) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, Conformance, testing::Range<size_t>(0, all_cases().size()),
                         [](const testing::TestParamInfo<size_t>& p) { return all_cases()[p.param].kernel; });

// The list and the cases are one: a case per kernel, in the list's order.
TEST(ConformanceHarness, HasACasePerKernel) {
  const std::vector<const char*> names = kernels::kernel_names();
  ASSERT_EQ(names.size(), all_cases().size());
  for (size_t i = 0; i < names.size(); ++i) EXPECT_STREQ(names[i], all_cases()[i].kernel);
  EXPECT_GE(targets().size(), 2u);  // the CPU on the host and on its test double at least
}

// The harness's own check: a backend with a wrong kernel fails its case.
TEST(ConformanceHarness, CatchesAWrongKernel) {
  Backend wrong = *kernels::cpu::variant_backend(CpuIsa::kBaseline);
  wrong.kernels.add = wrong.kernels.mul;
  const Io want = run_case({"add", &case_add}, {kernels::cpu::variant_backend(CpuIsa::kBaseline), Device::cpu()});
  const Io got = run_case({"add", &case_add}, {&wrong, Device::cpu()});
  ASSERT_EQ(got.results.size(), 1u);
  EXPECT_NE(mismatch(got.results[0], want.results[0], want.tolerance), "");
}

}  // namespace
}  // namespace hspmd
