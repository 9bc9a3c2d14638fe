// CUDA layout and reduction kernels (basic.h, kernels.h contracts): transpose,
// slice, slice_backward and concat for every dtype (they move bytes), the f32
// reduce_sum / broadcast_reduced pair, and the f32 bias add and its gradient.
// Sums run in double in the CPU kernels' order (reduce_sum: the reduced
// elements in row-major order; bias_grad: chunks of 512 rows added in chunk
// order), so both backends give the same bits.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/cuda/runtime.h"
#include "hspmd/core/error.h"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/launch.cuh"

namespace hspmd::kernels::cuda {

namespace {

using namespace launch;

int64_t dims_product(const Shape& s, int begin, int end) {
  int64_t p = 1;
  for (int d = begin; d < end; ++d) p *= s[d];
  return p;
}

// `outer` rows of `bytes` bytes between pitched buffers on the device.
// cudaMemcpy2DAsync refuses a pitch above the device's memPitch (2^31 - 1
// bytes): a slice or concat along dim 0 of an array past 2 GiB (bf16 logits
// [16384, 151936]: 5 GB) has one row as large as the array. Rows that are
// contiguous on both sides go as one 1-D copy; rows with a pitch past the
// limit as one copy each (there are few: each is over 2 GiB apart).
void copy_rows(Stream& s, const void* src, int64_t src_pitch, void* dst, int64_t dst_pitch, int64_t outer,
               int64_t bytes, const char* what) {
  if (bytes == 0 || outer == 0) return;
  if (outer == 1 || (src_pitch == bytes && dst_pitch == bytes)) {
    cuda_rt::check(cudaMemcpyAsync(dst, src, static_cast<size_t>(outer * bytes), cudaMemcpyDeviceToDevice, native(s)),
                   what);
    return;
  }
  constexpr int64_t kMaxPitch = 0x7fffffff;  // cudaDevAttrMaxPitch on every current GPU
  if (src_pitch > kMaxPitch || dst_pitch > kMaxPitch) {
    for (int64_t r = 0; r < outer; ++r)
      cuda_rt::check(cudaMemcpyAsync(static_cast<char*>(dst) + r * dst_pitch,
                                     static_cast<const char*>(src) + r * src_pitch, static_cast<size_t>(bytes),
                                     cudaMemcpyDeviceToDevice, native(s)),
                     what);
    return;
  }
  cuda_rt::check(cudaMemcpy2DAsync(dst, static_cast<size_t>(dst_pitch), src, static_cast<size_t>(src_pitch),
                                   static_cast<size_t>(bytes), static_cast<size_t>(outer), cudaMemcpyDeviceToDevice,
                                   native(s)),
                 what);
}

// dst (o, j, m, i, n) = src (o, i, m, j, n) for dims outer, rows, mid, cols, inner.
template <typename T>
__global__ void transpose_kernel(const T* src, T* dst, int64_t rows, int64_t mid, int64_t cols, int64_t inner,
                                 int64_t total) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t x = e;
    const int64_t n = x % inner;
    x /= inner;
    const int64_t i = x % rows;
    x /= rows;
    const int64_t m = x % mid;
    x /= mid;
    const int64_t j = x % cols;
    const int64_t o = x / cols;
    dst[e] = src[(((o * rows + i) * mid + m) * cols + j) * inner + n];
  }
}

template <typename T>
void launch_transpose(Stream& s, const void* src, void* dst, int64_t rows, int64_t mid, int64_t cols, int64_t inner,
                      int64_t total) {
  transpose_kernel<T><<<blocks_for(total), kThreads, 0, native(s)>>>(static_cast<const T*>(src), static_cast<T*>(dst),
                                                                      rows, mid, cols, inner, total);
  launched("transpose");
}

// Up to 8 dims: for each output element, its first input element and the
// walk over the reduced dims (row-major, as the CPU adds them).
constexpr int kMaxDims = 8;
struct ReduceMap {
  int kept = 0, red = 0;
  int64_t kept_dims[kMaxDims], kept_strides[kMaxDims];  // input strides of the kept dims
  int64_t red_dims[kMaxDims], red_strides[kMaxDims];    // input strides of the reduced dims
  int64_t red_count = 1;
};

ReduceMap reduce_map(const Shape& in, const std::vector<bool>& reduced, const char* what) {
  if (in.size() > static_cast<size_t>(kMaxDims)) fail("[cuda] ", what, ": more than ", kMaxDims, " dims");
  const Shape strides = contiguous_strides(in);
  ReduceMap m;
  for (size_t d = 0; d < in.size(); ++d) {
    if (reduced[d]) {
      m.red_dims[m.red] = in[d], m.red_strides[m.red] = strides[d], ++m.red;
      m.red_count *= in[d];
    } else {
      m.kept_dims[m.kept] = in[d], m.kept_strides[m.kept] = strides[d], ++m.kept;
    }
  }
  return m;
}

// The input offset of kept-dims index `o` (row-major over the kept dims).
__device__ int64_t kept_offset(const ReduceMap& m, int64_t o) {
  int64_t off = 0;
  for (int d = m.kept - 1; d >= 0; --d) {
    off += (o % m.kept_dims[d]) * m.kept_strides[d];
    o /= m.kept_dims[d];
  }
  return off;
}

// A grid-stride loop over the outputs: blocks_for caps the grid at 2^21
// blocks (2^29 threads), fewer than the outputs of a logits-sized array.
__global__ void reduce_sum_kernel(const float* x, float* y, ReduceMap m, int64_t outputs) {
  for (int64_t o = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; o < outputs;
       o += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t base = kept_offset(m, o);
    double acc = 0;
    for (int64_t r = 0; r < m.red_count; ++r) {
      int64_t off = base, q = r;
      for (int d = m.red - 1; d >= 0; --d) {
        off += (q % m.red_dims[d]) * m.red_strides[d];
        q /= m.red_dims[d];
      }
      acc += x[off];
    }
    y[o] = static_cast<float>(acc);
  }
}

// out[i] = g[o(i)]: o(i) drops the reduced dims of i.
__global__ void broadcast_reduced_kernel(const float* g, float* out, ReduceMap m, int64_t outputs, int64_t total) {
  // Here `m` maps the OUTPUT shape: kept dims are g's dims.
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // Decode i over all dims (kept and reduced interleaved by stride order):
    // the kept part is i's coordinate along each kept dim.
    int64_t o = 0;
    for (int d = 0; d < m.kept; ++d) o = o * m.kept_dims[d] + (i / m.kept_strides[d]) % m.kept_dims[d];
    out[i] = g[o];
  }
  (void)outputs;
}

__global__ void add_bias_kernel(const float* x, const float* b, float* y, int64_t n, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = x[i] + b[i % n];
}

constexpr int64_t kRowChunk = 512;  // the CPU kernel's partial sums: the same bits

struct BiasGradTerm {
  const float* g;
  int64_t n;
  __device__ double operator()(int64_t r, int64_t j) const { return static_cast<double>(g[r * n + j]); }
};

void require_f32(const char* kernel, std::initializer_list<const NDArray*> arrays) {
  for (const NDArray* a : arrays)
    if (a->dtype() != DType::F32) fail("[cuda] ", kernel, ": f32 only so far, got ", dtype_name(a->dtype()));
}

}  // namespace

void transpose(Stream& s, const NDArray& a, int d0, int d1, NDArray& out) {
  require_contiguous("transpose", a);
  const int n = a.ndim();
  if (d0 > d1) std::swap(d0, d1);
  HSPMD_CHECK(0 <= d0 && d1 < n && out.numel() == a.numel(), "transpose: bad dims");
  const Shape& sh = a.shape();
  const int64_t rows = sh[d0], mid = dims_product(sh, d0 + 1, d1), cols = sh[d1], inner = dims_product(sh, d1 + 1, n);
  const int64_t total = a.numel();
  if (total == 0) return;
  switch (dtype_size(a.dtype())) {
    case 1: return launch_transpose<uint8_t>(s, a.raw_data(), out.raw_data(), rows, mid, cols, inner, total);
    case 2: return launch_transpose<uint16_t>(s, a.raw_data(), out.raw_data(), rows, mid, cols, inner, total);
    case 4: return launch_transpose<uint32_t>(s, a.raw_data(), out.raw_data(), rows, mid, cols, inner, total);
    case 8: return launch_transpose<uint64_t>(s, a.raw_data(), out.raw_data(), rows, mid, cols, inner, total);
    default: fail("[cuda] transpose: element size ", dtype_size(a.dtype()));
  }
}

void slice(Stream& s, const NDArray& a, int axis, int64_t begin, NDArray& out) {
  require_contiguous("slice", a);
  const Shape& sh = a.shape();
  const int64_t outer = dims_product(sh, 0, axis), inner = dims_product(sh, axis + 1, a.ndim());
  const int64_t len = out.dim(axis);
  HSPMD_CHECK(begin >= 0 && begin + len <= sh[axis], "slice: range out of bounds");
  const int64_t es = static_cast<int64_t>(dtype_size(a.dtype()));
  copy_rows(s, static_cast<const char*>(a.raw_data()) + begin * inner * es, sh[axis] * inner * es, out.raw_data(),
            len * inner * es, outer, len * inner * es, "slice");
}

void slice_backward(Stream& s, const NDArray& grad, int axis, int64_t begin, NDArray& out) {
  require_contiguous("slice_backward", grad);
  const Shape& sh = out.shape();
  const int64_t outer = dims_product(sh, 0, axis), inner = dims_product(sh, axis + 1, out.ndim());
  const int64_t len = grad.dim(axis);
  HSPMD_CHECK(begin >= 0 && begin + len <= sh[axis], "slice_backward: range out of bounds");
  const int64_t es = static_cast<int64_t>(dtype_size(out.dtype()));
  if (out.nbytes() > 0) cuda_rt::check(cudaMemsetAsync(out.raw_data(), 0, out.nbytes(), native(s)), "slice_backward");
  copy_rows(s, grad.raw_data(), len * inner * es, static_cast<char*>(out.raw_data()) + begin * inner * es,
            sh[axis] * inner * es, outer, len * inner * es, "slice_backward");
}

void concat(Stream& s, const std::vector<NDArray>& parts, int axis, NDArray& out) {
  const Shape& sh = out.shape();
  const int64_t outer = dims_product(sh, 0, axis), inner = dims_product(sh, axis + 1, out.ndim());
  const int64_t es = static_cast<int64_t>(dtype_size(out.dtype()));
  int64_t offset = 0;
  for (const NDArray& p : parts) {
    require_contiguous("concat", p);
    const int64_t len = p.dim(axis);
    HSPMD_CHECK(offset + len <= sh[axis], "concat: parts exceed the output");
    copy_rows(s, p.raw_data(), len * inner * es, static_cast<char*>(out.raw_data()) + offset * inner * es,
              sh[axis] * inner * es, outer, len * inner * es, "concat");
    offset += len;
  }
  HSPMD_CHECK(offset == sh[axis], "concat: parts do not fill the output");
}

void reduce_sum(Stream& s, const NDArray& a, const std::vector<bool>& reduced, NDArray& out) {
  require_contiguous("reduce_sum", a);
  require_f32("reduce_sum", {&a, &out});
  HSPMD_CHECK(static_cast<int>(reduced.size()) == a.ndim(), "reduce_sum: mask rank");
  const int64_t outputs = out.numel();
  if (outputs == 0) return;
  const ReduceMap m = reduce_map(a.shape(), reduced, "reduce_sum");
  reduce_sum_kernel<<<blocks_for(outputs), kThreads, 0, native(s)>>>(a.data<float>(), out.data<float>(), m, outputs);
  launched("reduce_sum");
}

void broadcast_reduced(Stream& s, const NDArray& g, const std::vector<bool>& reduced, NDArray& out) {
  require_contiguous("broadcast_reduced", g);
  require_f32("broadcast_reduced", {&g, &out});
  HSPMD_CHECK(static_cast<int>(reduced.size()) == out.ndim(), "broadcast_reduced: mask rank");
  const int64_t total = out.numel();
  if (total == 0) return;
  const ReduceMap m = reduce_map(out.shape(), reduced, "broadcast_reduced");
  broadcast_reduced_kernel<<<blocks_for(total), kThreads, 0, native(s)>>>(g.data<float>(), out.data<float>(), m,
                                                                          g.numel(), total);
  launched("broadcast_reduced");
}

void add_bias(Stream& s, const NDArray& x, const NDArray& bias, NDArray& out) {
  require_contiguous("add_bias", x);
  require_contiguous("add_bias", bias);
  require_f32("add_bias", {&x, &bias, &out});
  const int64_t n = bias.numel();
  HSPMD_CHECK(x.ndim() >= 1 && x.dim(-1) == n && out.numel() == x.numel(), "add_bias: sizes");
  const int64_t total = x.numel();
  if (total == 0) return;
  add_bias_kernel<<<blocks_for(total), kThreads, 0, native(s)>>>(x.data<float>(), bias.data<float>(),
                                                                 out.data<float>(), n, total);
  launched("add_bias");
}

void bias_grad(Stream& s, const NDArray& dy, NDArray& dbias) {
  require_contiguous("bias_grad", dy);
  require_f32("bias_grad", {&dy, &dbias});
  const int64_t n = dbias.numel(), rows = n == 0 ? 0 : dy.numel() / n;
  HSPMD_CHECK(dy.ndim() >= 1 && dy.dim(-1) == n, "bias_grad: sizes");
  if (n == 0) return;
  if (rows == 0) return fill(s, dbias, 0.0f);
  column_sums(s, "bias_grad", BiasGradTerm{dy.data<float>(), n}, rows, n, kRowChunk, dbias.data<float>());
}

}  // namespace hspmd::kernels::cuda
