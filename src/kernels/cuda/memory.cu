// CUDA memory kernels (memory.h) and the elementwise f32 kernels
// (kernels.h) on a CUDA stream.
#include <algorithm>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels/cuda/runtime.h"
#include "hspmd/core/dtype.h"
#include "hspmd/core/error.h"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/launch.cuh"

namespace hspmd::kernels::cuda {

namespace {

using namespace launch;

// ---- elementwise ----

enum class Binary { kAdd, kMul };

// a, b: f32, or bf16 (widened exactly); out: f32, or bf16 (rounded to
// nearest even once). `out` may be `a` or `b`.
template <typename A, typename B, typename O>
struct BinaryOp {
  const A* a;
  const B* b;
  O* out;
  Binary op;
  template <int V>
  __device__ void apply(int64_t i) const {
    float x[V], y[V];
    load<V>(a, i, x);
    load<V>(b, i, y);
#pragma unroll
    for (int k = 0; k < V; ++k) x[k] = op == Binary::kAdd ? x[k] + y[k] : x[k] * y[k];
    store<V>(out, i, x);
  }
};

struct ScaleOp {
  const float* a;
  float factor;
  float* out;
  template <int V>
  __device__ void apply(int64_t i) const {
    float x[V];
    load<V>(a, i, x);
#pragma unroll
    for (int k = 0; k < V; ++k) x[k] *= factor;
    store<V>(out, i, x);
  }
};

void binary(Stream& s, const char* name, const NDArray& a, const NDArray& b, NDArray& out, Binary op) {
  require_contiguous(name, a);
  require_contiguous(name, b);
  HSPMD_CHECK(a.numel() == b.numel() && a.numel() == out.numel(), name, ": sizes differ");
  const int64_t n = a.numel();
  if (n == 0) return;
  with_float_type(name, a, [&](auto* pa) {
    using A = std::remove_pointer_t<decltype(pa)>;
    with_float_type(name, b, [&](auto* pb) {
      using B = std::remove_pointer_t<decltype(pb)>;
      with_float_type(name, out, [&](auto* po) {  // a bf16 output: the f32 result rounded (as cast)
        using O = std::remove_pointer_t<decltype(po)>;
        elementwise(s, name, BinaryOp<A, B, O>{pa, pb, po, op}, n, {a.raw_data(), b.raw_data(), out.raw_data()});
      });
    });
  });
}

// ---- fills ----

template <typename T>
__global__ void fill_kernel(T* out, T value, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = value;
}

template <typename T>
void fill_as(Stream& s, NDArray& out, T value) {
  const int64_t n = out.numel();
  if (n == 0) return;
  fill_kernel<T><<<blocks_for(n), kThreads, 0, native(s)>>>(out.data<T>(), value, n);
  launched("fill");
}

// ---- block copies ----

constexpr int kMaxDims = 8;

struct BlockGeometry {
  int ndim = 0;
  int64_t extent[kMaxDims];
  int64_t from_stride[kMaxDims], to_stride[kMaxDims];
  int64_t from_offset = 0, to_offset = 0;  // elements of the blocks' corners
};

// One thread per element of the block: its index in the block, decomposed
// over the extent, gives its offsets in both arrays.
template <typename T, bool kAccumulate>
__global__ void block_kernel(const T* from, T* to, BlockGeometry g, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t rest = i, a = g.from_offset, b = g.to_offset;
    for (int d = g.ndim - 1; d >= 0; --d) {
      const int64_t k = rest % g.extent[d];
      rest /= g.extent[d];
      a += k * g.from_stride[d];
      b += k * g.to_stride[d];
    }
    if constexpr (kAccumulate)
      to[b] += from[a];
    else
      to[b] = from[a];
  }
}

// ---- sum of squares: every array in one launch, chunk sums in double,
// added in a fixed order ----
//
// The arrays are cut into chunks of kSquareChunk elements; a block sums one
// chunk (16-byte loads where the array is aligned, each thread a fixed set
// of its elements), a second kernel adds the chunk sums in one block. The
// order depends only on the arrays' sizes, so the result is the same on
// every call; two launches for the whole gradient norm, whatever the number
// of parameters (one pair per array, half of them single-threaded, before).

constexpr int64_t kSquareChunk = 1 << 16;  // elements per chunk (a multiple of 4)

// The arrays: table [3T + 1] i64 = pointers [T], sizes [T], first chunks
// [T + 1] (first[T] = all chunks).
// The array whose chunks hold chunk c: first[a] <= c < first[a + 1] (first
// [T + 1], ascending).
__device__ int64_t chunk_owner(const int64_t* first, int64_t T, int64_t c) {
  int64_t lo = 0, hi = T - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (first[mid] <= c)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

__global__ void square_chunks_kernel(const int64_t* table, int64_t T, double* partials) {
  __shared__ double part[kThreads];
  const int64_t c = blockIdx.x;
  const int64_t lo = chunk_owner(table + 2 * T, T, c);
  const auto* x = reinterpret_cast<const float*>(table[lo]);
  const int64_t n = table[T + lo], begin = (c - table[2 * T + lo]) * kSquareChunk;
  const int64_t end = begin + kSquareChunk < n ? begin + kSquareChunk : n;
  // Groups of four in the same order whether the array is aligned (one
  // 16-byte load; begin is a multiple of 4, so x + begin is aligned too) or
  // not (four loads): the sum depends on the sizes only.
  double sum = 0;
  const int64_t quads = (end - begin) / 4;
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0;
  for (int64_t q = threadIdx.x; q < quads; q += blockDim.x) {
    const int64_t at = begin + 4 * q;
    const float4 v = aligned ? *reinterpret_cast<const float4*>(x + at) : make_float4(x[at], x[at + 1], x[at + 2], x[at + 3]);
    sum += static_cast<double>(v.x) * v.x + static_cast<double>(v.y) * v.y + static_cast<double>(v.z) * v.z +
           static_cast<double>(v.w) * v.w;
  }
  for (int64_t k = begin + 4 * quads + threadIdx.x; k < end; k += blockDim.x) sum += static_cast<double>(x[k]) * x[k];
  part[threadIdx.x] = sum;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[c] = part[0];
}

// The chunk sums added by one block: each thread a fixed stride of them in
// order, then a tree; thread 0 gets the total (the others, a part of it).
__device__ double add_chunks(const double* partials, int64_t count) {
  __shared__ double part[kThreads];
  double sum = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) sum += partials[i];
  part[threadIdx.x] = sum;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  return part[0];
}

__global__ void add_chunks_kernel(const double* partials, int64_t count, double* total) {
  const double sum = add_chunks(partials, count);
  if (threadIdx.x == 0) *total = sum;
}

// clip_control's values (memory.h) from the gradients' chunk sums and the
// loss terms (a table of `L` f32 pointers), one block: the sum in
// add_chunks_kernel's order, then thread 0 writes control[0..2].
__global__ void clip_control_kernel(const double* partials, int64_t count, const int64_t* losses, int64_t L,
                                    double max_norm, double* control) {
  const double sum = add_chunks(partials, count);
  if (threadIdx.x != 0) return;
  bool finite = true;
  for (int64_t i = 0; i < L; ++i) finite = finite && isfinite(*reinterpret_cast<const float*>(losses[i]));
  const double norm = sqrt(sum);  // IEEE, correctly rounded: the host's bits
  control[0] = sum;
  // clip_coefficient's expression (optim/lr_schedule.cc): the division in
  // double, rounded once to f32.
  control[1] = max_norm > 0 && norm > max_norm ? static_cast<double>(__double2float_rn(max_norm / (norm + 1e-6))) : 1.0;
  control[2] = finite && isfinite(norm) ? 1.0 : 0.0;
}

// ---- AdamW ----

struct AdamOp {
  float* p;
  const float* g;
  float* m;
  float* v;
  __nv_bfloat16* copy;  // the parameter's bf16 copy, or nullptr
  AdamFactors f;
  template <int V>
  __device__ void apply(int64_t i) const {
    float pv[V], gv[V], mv[V], vv[V];
    load<V>(p, i, pv);
    load<V>(g, i, gv);
    load<V>(m, i, mv);
    load<V>(v, i, vv);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      // The clip's product on its own (never fused into the next add): the
      // bits of kernels::scale's pass and the update after it.
      const float gi = __fmul_rn(gv[k], f.grad_scale) + f.l2 * pv[k];
      const float pi = pv[k] * f.decay_scale;
      const float mi = f.beta1 * mv[k] + f.one_minus_beta1 * gi;
      const float vi = f.beta2 * vv[k] + f.one_minus_beta2 * gi * gi;
      mv[k] = mi;
      vv[k] = vi;
      // torch's order: denom = sqrt(v) / sqrt(bc2) + eps; the last
      // multiply-subtract fused, as on CPUs with FMA.
      pv[k] = __fmaf_rn(-f.step_size, mi / (sqrtf(vi) / f.sqrt_bc2 + f.eps), pi);
    }
    store<V>(m, i, mv);
    store<V>(v, i, vv);
    store<V>(p, i, pv);
    if (copy != nullptr) store<V>(copy, i, pv);  // rounded as the cast kernel rounds
  }
};

// Every tensor of the step in one launch (one launch per tensor before: 201
// for TinyLlama, most of them short). The tensors are cut into chunks of
// kAdamChunk elements, a block per chunk; table [7T + 1] i64 = the tensors'
// param, grad, exp_avg, exp_avg_sq and bf16-copy (0: none) pointers [5T]
// (table[5t + j]), sizes [T], first chunks [T + 1]. Each element's update
// is AdamOp's (the same bits as one launch per tensor, 16-byte accesses or
// not).
constexpr int64_t kAdamChunk = 1 << 16;  // elements per chunk (a multiple of kVec)

// `control`: clip_control's array, or nullptr (AdamFactors::control).
// `step`: AdamFactors::step's three values, or nullptr.
__global__ void adam_chunks_kernel(const int64_t* table, int64_t T, AdamFactors f, const double* control,
                                   const float* step) {
  if (control != nullptr) {
    if (control[2] != 1.0) return;  // a non-finite step: nothing changes
    f.grad_scale = static_cast<float>(control[1]);  // an f32 value: exact
  }
  if (step != nullptr) f.decay_scale = step[0], f.sqrt_bc2 = step[1], f.step_size = step[2];
  const int64_t c = blockIdx.x;
  const int64_t t = chunk_owner(table + 6 * T, T, c);
  const int64_t* ptr = table + 5 * t;
  const AdamOp op{reinterpret_cast<float*>(ptr[0]), reinterpret_cast<const float*>(ptr[1]),
                  reinterpret_cast<float*>(ptr[2]), reinterpret_cast<float*>(ptr[3]),
                  reinterpret_cast<__nv_bfloat16*>(ptr[4]), f};
  const int64_t n = table[5 * T + t], begin = (c - table[6 * T + t]) * kAdamChunk;
  const int64_t end = begin + kAdamChunk < n ? begin + kAdamChunk : n;
  // begin is a multiple of kVec: an aligned tensor's chunk is aligned too
  // (kVec bf16 values are 16 bytes, as are kVec / 2 floats).
  const bool aligned = ((ptr[0] | ptr[1] | ptr[2] | ptr[3] | ptr[4]) & 15) == 0;
  int64_t i = begin + threadIdx.x;
  if (aligned) {
    const int64_t groups = (end - begin) / kVec;
    for (int64_t q = threadIdx.x; q < groups; q += blockDim.x) op.apply<kVec>(begin + q * kVec);
    i = begin + groups * kVec + threadIdx.x;
  }
  for (; i < end; i += blockDim.x) op.apply<1>(i);
}

// A host table of int64 values on the device (from pageable memory: staged
// when the call returns; the device array is reused in stream order only).
NDArray device_table(Stream& s, const std::vector<int64_t>& values) {
  NDArray host = NDArray::empty({static_cast<int64_t>(values.size())}, DType::I64);
  std::copy(values.begin(), values.end(), host.host_data<int64_t>());
  return to_device(s, host);
}

}  // namespace

void add(Stream& s, const NDArray& a, const NDArray& b, NDArray& out) { binary(s, "add", a, b, out, Binary::kAdd); }

void mul(Stream& s, const NDArray& a, const NDArray& b, NDArray& out) {
  HSPMD_CHECK(a.dtype() == DType::F32 && b.dtype() == DType::F32 && out.dtype() == DType::F32,
              "mul: f32 arrays only (as on the CPU)");
  binary(s, "mul", a, b, out, Binary::kMul);
}

void scale(Stream& s, const NDArray& a, float factor, NDArray& out) {
  require_contiguous("scale", a);
  HSPMD_CHECK(a.numel() == out.numel(), "scale: sizes differ");
  elementwise(s, "scale", ScaleOp{a.data<float>(), factor, out.data<float>()}, a.numel(),
              {a.raw_data(), out.raw_data()});
}

void accumulate(Stream& s, const NDArray& a, NDArray& out) {
  HSPMD_CHECK(a.dtype() == DType::F32 && out.dtype() == DType::F32, "accumulate: f32 arrays only (as on the CPU)");
  binary(s, "accumulate", a, out, out, Binary::kAdd);
}

void fill(Stream& s, NDArray& out, float value) {
  require_contiguous("fill", out);
  switch (out.dtype()) {
    case DType::F32: return fill_as<float>(s, out, value);
    case DType::BF16: return fill_as<uint16_t>(s, out, f32_to_bf16(value));
    case DType::I32: return fill_as<int32_t>(s, out, static_cast<int32_t>(value));
    case DType::I64: return fill_as<int64_t>(s, out, static_cast<int64_t>(value));
    case DType::F64: fail("[kernels] fill: no f64 arrays");
  }
}

NDArray zeros(Stream& s, const Shape& shape, DType dtype) {
  NDArray a = NDArray::empty(shape, dtype, s.device());
  if (a.nbytes() > 0) cuda_rt::check(cudaMemsetAsync(a.raw_data(), 0, a.nbytes(), native(s)), "cudaMemsetAsync");
  return a;
}

void copy(Stream& s, const NDArray& from, NDArray& out) {
  require_contiguous("copy", from);
  require_contiguous("copy", out);
  HSPMD_CHECK(from.dtype() == out.dtype() && from.numel() == out.numel(), "copy: ", dtype_name(from.dtype()),
              shape_str(from.shape()), " into ", dtype_name(out.dtype()), shape_str(out.shape()));
  if (from.nbytes() > 0 && from.raw_data() != out.raw_data())
    cuda_rt::check(cudaMemcpyAsync(out.raw_data(), from.raw_data(), from.nbytes(), cudaMemcpyDeviceToDevice,
                                   native(s)),
                   "cudaMemcpyAsync");
}

void copy_block(Stream& s, const NDArray& from, const Shape& from_start, NDArray& to, const Shape& to_start,
                const Shape& extent, bool accumulate) {
  require_contiguous("copy_block", from);
  require_contiguous("copy_block", to);
  const size_t n = extent.size();
  HSPMD_CHECK(from.dtype() == to.dtype(), "copy_block: ", dtype_name(from.dtype()), " into ", dtype_name(to.dtype()));
  HSPMD_CHECK(from.ndim() == static_cast<int>(n) && to.ndim() == static_cast<int>(n) && from_start.size() == n &&
                  to_start.size() == n,
              "copy_block: ranks differ");
  HSPMD_CHECK(n <= static_cast<size_t>(kMaxDims), "copy_block: more than ", kMaxDims, " dims");
  HSPMD_CHECK(!accumulate || to.dtype() == DType::F32, "copy_block: accumulates f32 only");
  BlockGeometry g;
  g.ndim = static_cast<int>(n);
  int64_t count = 1;
  for (size_t d = 0; d < n; ++d) {
    HSPMD_CHECK(extent[d] >= 0 && from_start[d] >= 0 && to_start[d] >= 0 &&
                    from_start[d] + extent[d] <= from.shape()[d] && to_start[d] + extent[d] <= to.shape()[d],
                "copy_block: block ", shape_str(extent), " at ", shape_str(from_start), " of ",
                shape_str(from.shape()), " into ", shape_str(to_start), " of ", shape_str(to.shape()));
    g.extent[d] = extent[d];
    g.from_stride[d] = from.strides()[d];
    g.to_stride[d] = to.strides()[d];
    g.from_offset += from_start[d] * from.strides()[d];
    g.to_offset += to_start[d] * to.strides()[d];
    count *= extent[d];
  }
  if (count == 0) return;
  const unsigned blocks = blocks_for(count);
  cudaStream_t st = native(s);
  switch (dtype_size(from.dtype())) {
    case 2:
      block_kernel<uint16_t, false><<<blocks, kThreads, 0, st>>>(static_cast<const uint16_t*>(from.raw_data()),
                                                                 static_cast<uint16_t*>(to.raw_data()), g, count);
      break;
    case 4:
      if (accumulate)
        block_kernel<float, true><<<blocks, kThreads, 0, st>>>(from.data<float>(), to.data<float>(), g, count);
      else
        block_kernel<uint32_t, false><<<blocks, kThreads, 0, st>>>(static_cast<const uint32_t*>(from.raw_data()),
                                                                   static_cast<uint32_t*>(to.raw_data()), g, count);
      break;
    case 8:
      block_kernel<uint64_t, false><<<blocks, kThreads, 0, st>>>(static_cast<const uint64_t*>(from.raw_data()),
                                                                 static_cast<uint64_t*>(to.raw_data()), g, count);
      break;
    default: fail("[kernels] copy_block: no ", dtype_size(from.dtype()), "-byte elements");
  }
  launched("copy_block");
}

namespace {

// f32 -> bf16 rounds to nearest even; bf16 -> f32 is exact.
template <typename From, typename To>
struct CastOp {
  const From* in;
  To* out;
  template <int V>
  __device__ void apply(int64_t i) const {
    float x[V];
    load<V>(in, i, x);
    store<V>(out, i, x);
  }
};

}  // namespace

void cast_into(Stream& s, const NDArray& a, NDArray& out) {
  require_contiguous("cast", a);
  require_contiguous("cast", out);
  HSPMD_CHECK(a.numel() == out.numel(), "cast: sizes differ");
  if (a.dtype() == out.dtype()) return copy(s, a, out);
  const int64_t n = a.numel();
  if (a.dtype() == DType::F32 && out.dtype() == DType::BF16) {
    elementwise(s, "cast", CastOp<float, __nv_bfloat16>{a.data<float>(), static_cast<__nv_bfloat16*>(out.raw_data())},
                n, {a.raw_data(), out.raw_data()});
  } else if (a.dtype() == DType::BF16 && out.dtype() == DType::F32) {
    elementwise(s, "cast",
                CastOp<__nv_bfloat16, float>{static_cast<const __nv_bfloat16*>(a.raw_data()), out.data<float>()}, n,
                {a.raw_data(), out.raw_data()});
  } else {
    fail("[kernels] cast: ", dtype_name(a.dtype()), " -> ", dtype_name(out.dtype()),
         " has no CUDA kernel (f32 <-> bf16)");
  }
}

NDArray cast(Stream& s, const NDArray& a, DType dtype) {
  NDArray out = NDArray::empty(a.shape(), dtype, s.device());
  cast_into(s, a, out);
  return out;
}

NDArray to_host(Stream& s, const NDArray& a) {
  require_contiguous("to_host", a);
  NDArray host = NDArray::empty(a.shape(), a.dtype(), Device::cpu());
  if (a.nbytes() > 0)
    cuda_rt::check(cudaMemcpyAsync(host.raw_data(), a.raw_data(), a.nbytes(), cudaMemcpyDeviceToHost, native(s)),
                   "cudaMemcpyAsync");
  s.synchronize();  // the host reads it next
  flush_checks(s);
  return host;
}

NDArray to_device(Stream& s, const NDArray& host) {
  const NDArray h = host.contiguous();
  NDArray a = NDArray::empty(h.shape(), h.dtype(), s.device());
  // From pageable memory the call returns once the bytes are staged: `host`
  // may go away after it. While `s` is captured, a page-locked copy that the
  // graph keeps (its copy reads it at each launch).
  cuda_rt::copy_from_host(s, a.raw_data(), h.raw_data(), h.nbytes());
  return a;
}

namespace {

// Queues the chunk sums of Σ x² over `arrays` (square_chunks_kernel): an
// array of `chunks` doubles (the caller adds them), invalid when there is
// no element.
NDArray square_partials(Stream& s, const char* what, const std::vector<NDArray>& arrays, int64_t& chunks) {
  std::vector<int64_t> ptrs, sizes, first;
  chunks = 0;
  for (const NDArray& a : arrays) {
    require_contiguous(what, a);
    HSPMD_CHECK(a.dtype() == DType::F32, what, ": f32 arrays only");
    if (a.numel() == 0) continue;
    ptrs.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.data<float>())));
    sizes.push_back(a.numel());
    first.push_back(chunks);
    chunks += (a.numel() + kSquareChunk - 1) / kSquareChunk;
  }
  if (chunks == 0) return NDArray();
  HSPMD_CHECK(chunks < (int64_t{1} << 31), what, ": too many chunks for one grid");
  const int64_t T = static_cast<int64_t>(ptrs.size());
  first.push_back(chunks);
  std::vector<int64_t> table = ptrs;
  table.insert(table.end(), sizes.begin(), sizes.end());
  table.insert(table.end(), first.begin(), first.end());
  const NDArray dtable = device_table(s, table);
  NDArray partials = NDArray::empty({chunks}, DType::F64, s.device());
  square_chunks_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, native(s)>>>(
      static_cast<const int64_t*>(dtable.raw_data()), T, partials.data<double>());
  return partials;
}

}  // namespace

double sum_of_squares(Stream& s, const std::vector<NDArray>& arrays) {
  int64_t chunks = 0;
  const NDArray partials = square_partials(s, "sum_of_squares", arrays, chunks);
  if (chunks == 0) return 0.0;
  NDArray total = NDArray::empty({1}, DType::F64, s.device());
  auto* t = total.data<double>();
  add_chunks_kernel<<<1, kThreads, 0, native(s)>>>(partials.data<double>(), chunks, t);
  launched("sum_of_squares");
  double result = 0;
  cuda_rt::check(cudaMemcpyAsync(&result, t, sizeof result, cudaMemcpyDeviceToHost, native(s)), "cudaMemcpyAsync");
  s.synchronize();
  flush_checks(s);
  return result;
}

void clip_control(Stream& s, const std::vector<NDArray>& grads, const std::vector<NDArray>& losses, double max_norm,
                  NDArray& control) {
  require_contiguous("clip_control", control);
  HSPMD_CHECK(control.dtype() == DType::F64 && control.numel() == 3, "clip_control: the control array must be f64 [3]");
  std::vector<int64_t> loss_ptrs;
  for (const NDArray& l : losses) {
    HSPMD_CHECK(l.dtype() == DType::F32 && l.numel() == 1, "clip_control: each loss must be one f32 value");
    loss_ptrs.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(l.raw_data())));
  }
  int64_t chunks = 0;
  const NDArray partials = square_partials(s, "clip_control", grads, chunks);
  const NDArray dlosses = loss_ptrs.empty() ? NDArray() : device_table(s, loss_ptrs);
  clip_control_kernel<<<1, kThreads, 0, native(s)>>>(
      chunks == 0 ? nullptr : partials.data<double>(), chunks,
      loss_ptrs.empty() ? nullptr : static_cast<const int64_t*>(dlosses.raw_data()),
      static_cast<int64_t>(loss_ptrs.size()), max_norm, control.data<double>());
  launched("clip_control");
}

void adam_step(Stream& s, const std::vector<AdamTensor>& tensors, const AdamFactors& f) {
  const double* control = nullptr;
  if (f.control != nullptr) {
    require_contiguous("adam_step", *f.control);
    HSPMD_CHECK(f.control->dtype() == DType::F64 && f.control->numel() == 3,
                "adam_step: the control array must be f64 [3] (clip_control's)");
    control = f.control->data<double>();
  }
  const float* step = nullptr;
  if (f.step != nullptr) {
    require_contiguous("adam_step", *f.step);
    HSPMD_CHECK(f.step->dtype() == DType::F32 && f.step->numel() == 3 && f.step->device() == s.device(),
                "adam_step: the step's factors must be f32 [3] on the update's device");
    step = f.step->data<float>();
  }
  std::vector<int64_t> ptrs, sizes, first;
  int64_t chunks = 0;
  for (const AdamTensor& t : tensors) {
    for (const NDArray* a : {static_cast<const NDArray*>(t.param), t.grad, static_cast<const NDArray*>(t.exp_avg),
                             static_cast<const NDArray*>(t.exp_avg_sq)}) {
      HSPMD_CHECK(a != nullptr && a->dtype() == DType::F32 && a->numel() == t.param->numel(),
                  "adam_step: param, grad and moments must be f32 of one size");
      require_contiguous("adam_step", *a);
      ptrs.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(a->raw_data())));
    }
    if (t.param_bf16 != nullptr) {
      HSPMD_CHECK(t.param_bf16->dtype() == DType::BF16 && t.param_bf16->numel() == t.param->numel(),
                  "adam_step: the parameter's bf16 copy must be bf16 of the parameter's size");
      require_contiguous("adam_step", *t.param_bf16);
    }
    ptrs.push_back(t.param_bf16 != nullptr && t.param->numel() > 0
                       ? static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.param_bf16->raw_data()))
                       : 0);
    if (t.param->numel() == 0) {
      ptrs.resize(ptrs.size() - 5);
      continue;
    }
    sizes.push_back(t.param->numel());
    first.push_back(chunks);
    chunks += (t.param->numel() + kAdamChunk - 1) / kAdamChunk;
  }
  if (chunks == 0) return;
  HSPMD_CHECK(chunks < (int64_t{1} << 31), "adam_step: too many chunks for one grid");
  const int64_t T = static_cast<int64_t>(sizes.size());
  first.push_back(chunks);
  std::vector<int64_t> table = ptrs;
  table.insert(table.end(), sizes.begin(), sizes.end());
  table.insert(table.end(), first.begin(), first.end());
  const NDArray dtable = device_table(s, table);
  adam_chunks_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, native(s)>>>(
      static_cast<const int64_t*>(dtable.raw_data()), T, f, control, step);
  launched("adam_step");
}

}  // namespace hspmd::kernels::cuda
