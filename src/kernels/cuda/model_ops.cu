// CUDA embedding, rotary embedding and softmax cross-entropy (basic.h
// contracts, f32). Ids and targets are checked on the device; a bad one
// costs a synchronization to name it (`[embedding] token id 70000 at
// position 3 is outside the vocabulary [0, 32000)`, as on the CPU), a good
// batch one small read back per call. Sums run in double; the embedding
// gradient sorts the tokens by id (stably) and adds each id's tokens in order
// per column (the same bits as the CPU); RoPE's angles, cos and sin are
// computed in double as the CPU's table is, once per (token, pair). The
// memory-bound kernels move 16 bytes per access where the rows allow (every
// row 16-byte aligned), else one element: the embedding and its gradient,
// RoPE (8 pairs a thread), the cross-entropy's logsumexp (one read of each
// row: a running max and sum of exponentials) and its gradient.
#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <type_traits>
#include <vector>

#include "kernels/cuda/runtime.h"
#include "hspmd/core/error.h"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/launch.cuh"

namespace hspmd::kernels::cuda {

namespace {

using namespace launch;

// The first bad position of a check, with its value, as one key: position
// in the high 32 bits (so atomicMin keeps the first), value in the low.
__global__ void first_bad_kernel(const int32_t* v, int64_t n, int64_t limit, int32_t ignore, bool use_ignore,
                                 unsigned long long* slot) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t x = v[i];
    if (use_ignore && x == ignore) continue;
    if (x < 0 || x >= limit)
      atomicMin(slot, (static_cast<unsigned long long>(i) << 32) | static_cast<uint32_t>(x));
  }
}

// Checks of ids and targets without a host wait inside the step: each check
// runs first_bad_kernel into a slot of its stream's buffer, and the failure
// is raised at the stream's next host read (flush_checks, from to_host and
// sum_of_squares, where the host waits anyway). The kernels the checked
// arrays feed stay in bounds whatever the values. A stream that fills its
// slots flushes them at once.
constexpr int kCheckSlots = 1024;

struct PendingCheck {
  bool target = false;  // cross_entropy's target, else an embedding's token id
  int64_t limit = 0;
  int ignore = 0;
};

struct StreamChecks {
  NDArray slots;  // kCheckSlots u64 keys (I64 storage), all ones when clear
  std::vector<PendingCheck> pending;
};

std::mutex g_checks_mu;
std::map<const Stream*, StreamChecks>& all_checks() {
  static auto* checks = new std::map<const Stream*, StreamChecks>();  // process lifetime, as the streams
  return *checks;
}

void check_values(Stream& s, const NDArray& values, const PendingCheck& check) {
  const int64_t n = values.numel();
  if (n == 0) return;
  HSPMD_CHECK(n < (int64_t{1} << 31), "check ids: more than 2^31 values");
  int slot = 0;
  unsigned long long* keys = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_checks_mu);
    StreamChecks& sc = all_checks()[&s];
    if (!sc.slots.valid()) {
      sc.slots = NDArray::empty({kCheckSlots}, DType::I64, s.device());
      cuda_rt::check(cudaMemsetAsync(sc.slots.raw_data(), 0xff, sc.slots.nbytes(), native(s)), "check ids");
    }
    slot = static_cast<int>(sc.pending.size());
    sc.pending.push_back(check);
    keys = static_cast<unsigned long long*>(sc.slots.raw_data());
  }
  first_bad_kernel<<<blocks_for(n), kThreads, 0, native(s)>>>(values.data<int32_t>(), n, check.limit, check.ignore,
                                                              check.target, keys + slot);
  launched("check ids");
  if (cuda_rt::capturing(s))  // each launch of the graph queues the check in this slot again
    cuda_rt::at_each_launch([&s, check, slot] {
      std::lock_guard<std::mutex> lock(g_checks_mu);
      std::vector<PendingCheck>& pending = all_checks()[&s].pending;
      HSPMD_CHECK(static_cast<int>(pending.size()) == slot, "a CUDA graph's id checks: slot ", slot, " expected, ",
                  pending.size(), " queued");
      pending.push_back(check);
    });
  if (slot + 1 == kCheckSlots) flush_checks(s);
}

void check_ids(Stream& s, const NDArray& ids, int64_t vocab) { check_values(s, ids, PendingCheck{false, vocab, 0}); }

void check_targets(Stream& s, const NDArray& targets, int64_t v, int ignore_index) {
  check_values(s, targets, PendingCheck{true, v, ignore_index});
}

}  // namespace

void drop_pending_checks(Stream& s) {
  std::lock_guard<std::mutex> lock(g_checks_mu);
  if (auto it = all_checks().find(&s); it != all_checks().end()) it->second.pending.clear();
}

void flush_checks(Stream& s) {
  std::vector<PendingCheck> pending;
  std::vector<unsigned long long> keys;
  {
    std::lock_guard<std::mutex> lock(g_checks_mu);
    auto it = all_checks().find(&s);
    if (it == all_checks().end() || it->second.pending.empty()) return;
    pending = std::move(it->second.pending);
    it->second.pending.clear();
    keys.resize(pending.size());
    cuda_rt::check(cudaMemcpyAsync(keys.data(), it->second.slots.raw_data(), keys.size() * sizeof keys[0],
                                   cudaMemcpyDeviceToHost, native(s)),
                   "check ids");
    cuda_rt::check(cudaMemsetAsync(it->second.slots.raw_data(), 0xff, keys.size() * sizeof keys[0], native(s)),
                   "check ids");
  }
  s.synchronize();
  for (size_t k = 0; k < pending.size(); ++k) {
    if (keys[k] == ~0ull) continue;
    const int64_t pos = static_cast<int64_t>(keys[k] >> 32);
    const auto value = static_cast<int32_t>(static_cast<uint32_t>(keys[k] & 0xffffffffull));
    const PendingCheck& c = pending[k];
    if (c.target)
      fail("[cross_entropy] target ", value, " at position ", pos, " is outside the vocabulary [0, ", c.limit,
           ") and is not ignore_index ", c.ignore);
    fail("[embedding] token id ", value, " at position ", pos, " is outside the vocabulary [0, ", c.limit, ")");
  }
}

namespace {

void require_f32(const char* kernel, std::initializer_list<const NDArray*> arrays) {
  for (const NDArray* a : arrays)
    if (a->dtype() != DType::F32) fail("[cuda] ", kernel, ": f32 only so far, got ", dtype_name(a->dtype()));
}

// V consecutive columns a thread (V = 4: 16-byte loads and stores, the
// caller checked h % 4 and the pointers; V = 1 any width): item e = (token
// t, group q), one division per item.
template <int V>
__global__ void embedding_kernel(const float* w, const int32_t* ids, int64_t vocab_begin, int64_t rows, int64_t h,
                                 float* y, int64_t tokens) {
  const int64_t per_row = h / V, items = tokens * per_row;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < items;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = e / per_row, j = (e - t * per_row) * V;
    const int64_t row = ids[t] - vocab_begin;
    float v[V];
    if (row >= 0 && row < rows) {
      load<V>(w, row * h + j, v);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = 0.0f;
    }
    store<V>(y, t * h + j, v);
  }
}

__global__ void iota_kernel(int32_t* v, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    v[i] = static_cast<int32_t>(i);
}

// The tokens sorted by id, stably (`key` the sorted ids, `order` their
// positions): block x = a position, block y = a tile of columns. The block
// at the first position of an id sums that id's tokens in token order, one
// column per thread (the CPU's order: the same bits), and writes the row
// once; the other blocks return at once.
template <int V>
__global__ void embedding_backward_kernel(const float* g, const int32_t* key, const int32_t* order,
                                          int64_t vocab_begin, int64_t rows, int64_t h, int64_t tokens, float* dw) {
  const int64_t p = blockIdx.x;
  const int32_t id = key[p];
  if (p > 0 && key[p - 1] == id) return;
  const int64_t row = id - vocab_begin;
  if (row < 0 || row >= rows) return;
  // V consecutive columns a thread (V = 4: 16-byte loads and stores, the
  // caller checked h % 4 and the pointers), each summed in token order.
  for (int64_t j = (blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x) * V; j < h;
       j += static_cast<int64_t>(gridDim.y) * blockDim.x * V) {
    float acc[V], v[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = 0.0f;
    for (int64_t q = p; q < tokens && key[q] == id; ++q) {
      load<V>(g, order[q] * h + j, v);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += v[k];
    }
    store<V>(dw, row * h + j, acc);
  }
}

// cos and sin (-sin for the inverse) of every (token, pair) angle, in
// double as the CPU's table: table[t * half + i].
__global__ void rope_table_kernel(const int32_t* pos, double theta, bool inverse, int64_t d, float2* table,
                                  int64_t total) {
  const int64_t half = d / 2;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e % half, t = e / half;
    const double angle = static_cast<double>(pos[t]) * pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
    const float sn = static_cast<float>(sin(angle));
    table[e] = make_float2(static_cast<float>(cos(angle)), inverse ? -sn : sn);
  }
}

// V consecutive pairs a thread: work item e = (row th, group q), the pairs
// i = q * V .. q * V + V - 1 of row th = (token, head). V = kVec: 16-byte
// loads and stores of both halves (the caller checked half % kVec and the
// pointers), 64 bytes of the token's table; V = 1 any head dim.
template <int V, typename I, typename O>
__global__ void rope_kernel(const I* x, const float2* table, int64_t heads, int64_t half, O* y, int64_t rows) {
  const int64_t per_row = half / V, items = rows * per_row;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < items;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t th = e / per_row, i = (e - th * per_row) * V;
    const float2* cs = table + (th / heads) * half + i;
    const int64_t base = th * 2 * half + i;
    float a[V], b[V], ya[V], yb[V];
    load<V>(x, base, a);
    load<V>(x, base + half, b);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float2 c = cs[k];
      ya[k] = a[k] * c.x - b[k] * c.y;
      yb[k] = b[k] * c.x + a[k] * c.y;
    }
    store<V>(y, base, ya);
    store<V>(y, base + half, yb);
  }
}

// rope_kernel over two arrays in one launch (rope_qk: q and k, the same
// tokens and table, their own head counts): items [0, rows_a * per_row) are
// a's, the rest b's.
template <int V, typename I, typename O>
__global__ void rope_pair_kernel(const I* xa, O* ya, int64_t heads_a, int64_t rows_a, const I* xb, O* yb,
                                 int64_t heads_b, int64_t rows_b, const float2* table, int64_t half) {
  const int64_t per_row = half / V, items_a = rows_a * per_row, items = items_a + rows_b * per_row;
  for (int64_t e0 = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e0 < items;
       e0 += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const bool in_a = e0 < items_a;
    const int64_t e = in_a ? e0 : e0 - items_a, heads = in_a ? heads_a : heads_b;
    const I* x = in_a ? xa : xb;
    O* y = in_a ? ya : yb;
    const int64_t th = e / per_row, i = (e - th * per_row) * V;
    const float2* cs = table + (th / heads) * half + i;
    const int64_t base = th * 2 * half + i;
    float a[V], b[V], ra[V], rb[V];
    load<V>(x, base, a);
    load<V>(x, base + half, b);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float2 c = cs[k];
      ra[k] = a[k] * c.x - b[k] * c.y;  // rope_kernel's expressions
      rb[k] = b[k] * c.x + a[k] * c.y;
    }
    store<V>(y, base, ra);
    store<V>(y, base + half, rb);
  }
}

// A running (max, sum of exp(x - max)) pair of a softmax's normalizer: the
// sum in double, rescaled when the max grows. Empty: max -inf, sum 0.
struct MaxSum {
  double m, sum;
};

__device__ inline MaxSum max_sum_merge(MaxSum a, MaxSum b) {
  const double m = fmax(a.m, b.m);
  // an empty side adds nothing (its exp(-inf - -inf) would be NaN)
  const double sa = a.sum == 0 ? 0.0 : a.sum * exp(a.m - m), sb = b.sum == 0 ? 0.0 : b.sum * exp(b.m - m);
  return {m, sa + sb};  // a + b == b + a: every lane of a butterfly gets the same bits
}

// Adds V values to a thread's pair: the group's max first, one rescale per
// group at most, then exp(x - max) in double for each value.
template <int V>
__device__ inline void max_sum_add(MaxSum& p, const float (&x)[V]) {
  double gm = x[0];
#pragma unroll
  for (int v = 1; v < V; ++v) gm = fmax(gm, static_cast<double>(x[v]));
  if (gm == -INFINITY) return;  // -inf entries add nothing (exp(-inf - -inf) would be NaN)
  if (gm > p.m) {
    if (p.sum != 0) p.sum *= exp(p.m - gm);
    p.m = gm;
  }
#pragma unroll
  for (int v = 0; v < V; ++v) p.sum += exp(static_cast<double>(x[v]) - p.m);
}

// Per row: logsumexp over its first n entries in one read of the row (an
// online softmax: each thread a running max and sum of exponentials in
// double over its 16-byte groups, or single entries where the rows are not
// aligned, merged over the warp by a butterfly and over the warps in warp
// order: the same bits on every run), written to lse; the row's loss
// contribution to row_loss (0 for ignored rows); with `picked`, the
// target's logit when the shard holds it. n == 0 gives -inf (a shard of
// padding only). One block per row (grid-stride beyond). Logits I = float
// or bf16 (widened exactly, the same f32 values). V > 1 (4 f32 or 8 bf16:
// 16 bytes): x and the row length keep every row 16-byte aligned.
template <int V, typename I>
__global__ void __launch_bounds__(kThreads) row_lse_kernel(const I* x, const int32_t* targets, int64_t v,
                                                           int64_t n, int64_t vocab_begin, int32_t ignore,
                                                           float* lse, double* row_loss, float* picked,
                                                           int64_t rows) {
  __shared__ MaxSum warp_pairs[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const I* xr = x + r * v;
    const int32_t t = targets[r];
    if (t == ignore) {
      if (threadIdx.x == 0) {
        lse[r] = 0.0f;
        if (row_loss) row_loss[r] = 0.0;
        if (picked) picked[r] = 0.0f;
      }
      continue;  // every thread of the block alike: no barrier skipped by some
    }
    if (n == 0) {
      if (threadIdx.x == 0) {
        lse[r] = -INFINITY;
        if (picked) picked[r] = 0.0f;
      }
      continue;
    }
    MaxSum p{-INFINITY, 0.0};
    const int64_t groups = n / V;
    for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
      float xv[V];
      load<V>(xr, g * V, xv);
      max_sum_add<V>(p, xv);
    }
    for (int64_t j = groups * V + threadIdx.x; j < n; j += blockDim.x) {  // the tail (V > 1)
      float one[1];
      load<1>(xr, j, one);
      max_sum_add<1>(p, one);
    }
#pragma unroll
    for (int m = 16; m > 0; m /= 2) {
      const MaxSum o{__shfl_xor_sync(0xffffffffu, p.m, m), __shfl_xor_sync(0xffffffffu, p.sum, m)};
      p = max_sum_merge(p, o);
    }
    __syncthreads();  // thread 0 has read the previous row's warp_pairs
    if (lane == 0) warp_pairs[warp] = p;
    __syncthreads();
    if (threadIdx.x != 0) continue;
    MaxSum total = warp_pairs[0];
    for (int i = 1; i < kThreads / 32; ++i) total = max_sum_merge(total, warp_pairs[i]);
    const double l = log(total.sum) + total.m;
    lse[r] = static_cast<float>(l);
    const int64_t local = t - vocab_begin;
    // A target outside the row (a bad one: check_targets reports it) reads nothing.
    float target[1] = {0.0f};
    if (local >= 0 && local < n) load<1>(xr, local, target);
    if (row_loss) row_loss[r] = local >= 0 && local < n ? l - target[0] : l;
    if (picked) picked[r] = target[0];
  }
}

// Launches row_lse_kernel on f32 or bf16 logits: 16-byte groups where the
// logits' rows allow.
void launch_row_lse(Stream& s, const char* what, const NDArray& logits, const int32_t* targets, int64_t v, int64_t n,
                    int64_t vocab_begin, int32_t ignore, float* lse, double* row_loss, float* picked, int64_t rows) {
  const unsigned grid = static_cast<unsigned>(rows < (1 << 20) ? rows : (1 << 20));
  with_float_type(what, logits, [&](auto* x) {
    using I = std::remove_pointer_t<decltype(x)>;
    constexpr int kGroup = 16 / sizeof(I);  // 4 f32 or 8 bf16
    const auto kernel = v % kGroup == 0 && aligned16(x) ? &row_lse_kernel<kGroup, I> : &row_lse_kernel<1, I>;
    kernel<<<grid, kThreads, 0, native(s)>>>(x, targets, v, n, vocab_begin, ignore, lse, row_loss, picked, rows);
  });
}

// loss = Σ_rows row_loss (double; each thread a strided part, then a fixed
// tree) / normalizer: one block of kThreads.
__global__ void loss_kernel(const double* row_loss, int64_t rows, const float* normalizer, float* loss) {
  __shared__ double scratch[kThreads];
  double part = 0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) part += row_loss[r];
  const double total = block_sum(part, scratch);
  if (threadIdx.x == 0) loss[0] = static_cast<float>(total / normalizer[0]);
}

__global__ void combine_kernel(const float* part, const float* picked, const int32_t* targets, int64_t rows,
                               int64_t shards, int32_t ignore, float* out_lse, double* row_loss) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  out_lse[r] = 0.0f;
  row_loss[r] = 0.0;
  if (targets[r] == ignore) return;
  double m = part[r];
  for (int64_t s = 1; s < shards; ++s) m = fmax(m, static_cast<double>(part[s * rows + r]));
  double sum = 0;
  for (int64_t s = 0; s < shards; ++s) sum += exp(part[s * rows + r] - m);
  const double l = m + log(sum);
  out_lse[r] = static_cast<float>(l);
  row_loss[r] = l - picked[r];
}

// One block per row (no division per element), V consecutive columns a
// thread at a time (V = kVec: 16-byte loads of the logits and stores of dx,
// the caller checked the row length and the pointers), then the columns
// past the last whole group one at a time.
template <int V, typename I, typename O>
__device__ inline void ce_backward_columns(const I* xr, O* dr, int64_t c0, float l, float g, int64_t n,
                                           int64_t target_column, bool ignored) {
  float xv[V], d[V];
  load<V>(xr, c0, xv);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t c = c0 + k;
    float dk = 0.0f;
    if (!ignored && c < n) {
      dk = expf(xv[k] - l) * g;
      if (c == target_column) dk -= g;
    }
    d[k] = dk;
  }
  store<V>(dr, c0, d);
}

template <int V, typename I, typename O>
__global__ void ce_backward_kernel(const float* dloss, const I* x, const int32_t* targets, const float* normalizer,
                                   const float* lse, int32_t ignore, int64_t vocab_begin, int64_t v, int64_t n,
                                   O* dx, int64_t rows) {
  const float g = dloss[0] / normalizer[0];
  const int64_t groups = v / V;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t t = targets[r];
    const I* xr = x + r * v;
    O* dr = dx + r * v;
    const float l = lse[r];
    const int64_t target_column = t - vocab_begin;
    const bool ignored = t == ignore;
    for (int64_t q = threadIdx.x; q < groups; q += blockDim.x)
      ce_backward_columns<V>(xr, dr, q * V, l, g, n, target_column, ignored);
    if constexpr (V > 1)
      for (int64_t c = groups * V + threadIdx.x; c < v; c += blockDim.x)
        ce_backward_columns<1>(xr, dr, c, l, g, n, target_column, ignored);
  }
}

// Blocks of a one-block-per-row kernel (grid-stride beyond).
unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(rows < (1 << 20) ? rows : (1 << 20)); }

int64_t class_columns(int64_t v, int64_t begin, int64_t classes) {
  if (classes <= 0) return v;
  const int64_t n = classes - begin;
  return n < 0 ? 0 : n > v ? v : n;
}

}  // namespace

void embedding(Stream& s, const NDArray& weight, const NDArray& ids, int64_t vocab_begin, int64_t vocab_size,
               NDArray& out) {
  require_contiguous("embedding", weight);
  require_contiguous("embedding", ids);
  require_f32("embedding", {&weight, &out});
  const int64_t rows = weight.dim(0), h = weight.dim(1), tokens = ids.numel();
  HSPMD_CHECK(out.numel() == tokens * h, "embedding: output size");
  HSPMD_CHECK(vocab_begin >= 0 && vocab_begin + rows <= vocab_size, "embedding: vocab range");
  check_ids(s, ids, vocab_size);
  const int64_t total = tokens * h;
  if (total == 0) return;
  if (h % 4 == 0 && aligned16(weight.raw_data()) && aligned16(out.raw_data()))
    embedding_kernel<4><<<blocks_for(total / 4), kThreads, 0, native(s)>>>(
        weight.data<float>(), ids.data<int32_t>(), vocab_begin, rows, h, out.data<float>(), tokens);
  else
    embedding_kernel<1><<<blocks_for(total), kThreads, 0, native(s)>>>(weight.data<float>(), ids.data<int32_t>(),
                                                                       vocab_begin, rows, h, out.data<float>(), tokens);
  launched("embedding");
}

void embedding_backward(Stream& s, const NDArray& grad, const NDArray& ids, int64_t vocab_begin, int64_t vocab_size,
                        NDArray& dweight) {
  require_contiguous("embedding_backward", grad);
  require_f32("embedding_backward", {&grad, &dweight});
  const int64_t rows = dweight.dim(0), h = dweight.dim(1), tokens = ids.numel();
  HSPMD_CHECK(grad.numel() == tokens * h, "embedding_backward: grad size");
  HSPMD_CHECK(vocab_begin >= 0 && vocab_begin + rows <= vocab_size, "embedding_backward: vocab range");
  check_ids(s, ids, vocab_size);
  if (dweight.nbytes() > 0)
    cuda_rt::check(cudaMemsetAsync(dweight.raw_data(), 0, dweight.nbytes(), native(s)), "embedding_backward");
  if (h == 0 || tokens == 0) return;
  HSPMD_CHECK(tokens < (int64_t{1} << 31), "embedding_backward: more than 2^31 tokens");
  // The tokens by id, stably (CUB's radix sort; its scratch from the
  // stream's allocator, reused in stream order only).
  const int n = static_cast<int>(tokens);
  NDArray order_in = NDArray::empty({tokens}, DType::I32, s.device());
  NDArray keys = NDArray::empty({tokens}, DType::I32, s.device()), order = NDArray::empty({tokens}, DType::I32, s.device());
  iota_kernel<<<blocks_for(tokens), kThreads, 0, native(s)>>>(order_in.data<int32_t>(), tokens);
  launched("embedding_backward");
  size_t scratch_bytes = 0;
  cuda_rt::check(cub::DeviceRadixSort::SortPairs(nullptr, scratch_bytes, ids.data<int32_t>(), keys.data<int32_t>(),
                                                 order_in.data<int32_t>(), order.data<int32_t>(), n, 0, 32, native(s)),
                 "embedding_backward: sort");
  NDArray scratch = NDArray::empty({static_cast<int64_t>(scratch_bytes / 8 + 1)}, DType::I64, s.device());
  cuda_rt::check(cub::DeviceRadixSort::SortPairs(scratch.raw_data(), scratch_bytes, ids.data<int32_t>(),
                                                 keys.data<int32_t>(), order_in.data<int32_t>(),
                                                 order.data<int32_t>(), n, 0, 32, native(s)),
                 "embedding_backward: sort");
  const bool vec = h % 4 == 0 && aligned16(grad.raw_data()) && aligned16(dweight.raw_data());
  const int64_t per_thread = vec ? 4 : 1, tiles = (h + kThreads * per_thread - 1) / (kThreads * per_thread);
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(tiles < 65535 ? tiles : 65535));
  const auto kernel = vec ? &embedding_backward_kernel<4> : &embedding_backward_kernel<1>;
  kernel<<<grid, kThreads, 0, native(s)>>>(grad.data<float>(), keys.data<int32_t>(), order.data<int32_t>(),
                                           vocab_begin, rows, h, tokens, dweight.data<float>());
  launched("embedding_backward");
}

void rope(Stream& s, const NDArray& x, const NDArray& positions, float theta, bool inverse, NDArray& out) {
  require_contiguous("rope", x);
  require_contiguous("rope", positions);
  HSPMD_CHECK(x.ndim() == 4 && out.numel() == x.numel(), "rope: x must be [B, S, heads, D]");
  const int64_t tokens = x.dim(0) * x.dim(1), heads = x.dim(2), d = x.dim(3);
  HSPMD_CHECK(positions.numel() == tokens && d % 2 == 0, "rope: positions or head dim");
  const int64_t half = d / 2, rows = tokens * heads;
  if (rows == 0 || half == 0) return;
  // cos/sin once per (token, pair) instead of once per head.
  NDArray table = NDArray::empty({tokens, half, 2}, DType::F32, s.device());  // stream-ordered reuse only
  float2* cs = static_cast<float2*>(table.raw_data());
  rope_table_kernel<<<blocks_for(tokens * half), kThreads, 0, native(s)>>>(positions.data<int32_t>(), theta, inverse,
                                                                          d, cs, tokens * half);
  launched("rope");
  const bool vec = half % kVec == 0 && aligned16(x.raw_data()) && aligned16(out.raw_data());
  with_float_type("rope", x, [&](const auto* in) {  // x f32 or bf16 (read exactly)
    with_float_type("rope", out, [&](auto* y) {
      using I = std::remove_const_t<std::remove_pointer_t<decltype(in)>>;
      using O = std::remove_pointer_t<decltype(y)>;
      if (vec)
        rope_kernel<kVec, I, O><<<blocks_for(rows * (half / kVec)), kThreads, 0, native(s)>>>(in, cs, heads, half, y,
                                                                                               rows);
      else
        rope_kernel<1, I, O><<<blocks_for(rows * half), kThreads, 0, native(s)>>>(in, cs, heads, half, y, rows);
    });
  });
  launched("rope");
}

void rope_qk(Stream& s, const NDArray& q, const NDArray& k, const NDArray& positions, float theta, bool inverse,
             NDArray& q_out, NDArray& k_out) {
  require_contiguous("rope", q);
  require_contiguous("rope", k);
  require_contiguous("rope", positions);
  HSPMD_CHECK(q.ndim() == 4 && k.ndim() == 4 && q_out.numel() == q.numel() && k_out.numel() == k.numel(),
              "rope_qk: q and k must be [B, S, heads, D]");
  const int64_t tokens = q.dim(0) * q.dim(1), d = q.dim(3);
  HSPMD_CHECK(k.dim(0) * k.dim(1) == tokens && k.dim(3) == d, "rope_qk: q and k differ in tokens or head dim");
  HSPMD_CHECK(positions.numel() == tokens && d % 2 == 0, "rope_qk: positions or head dim");
  const int64_t half = d / 2, rows_q = tokens * q.dim(2), rows_k = tokens * k.dim(2);
  const bool same = k.dtype() == q.dtype() && k_out.dtype() == q_out.dtype();
  const bool vec = half % kVec == 0 && aligned16(q.raw_data()) && aligned16(k.raw_data()) &&
                   aligned16(q_out.raw_data()) && aligned16(k_out.raw_data());
  if (!same || !vec || rows_q + rows_k == 0 || half == 0) {  // two calls (each its own table)
    rope(s, q, positions, theta, inverse, q_out);
    rope(s, k, positions, theta, inverse, k_out);
    return;
  }
  // The table once for both, then one launch over q's rows and k's.
  NDArray table = NDArray::empty({tokens, half, 2}, DType::F32, s.device());  // stream-ordered reuse only
  float2* cs = static_cast<float2*>(table.raw_data());
  rope_table_kernel<<<blocks_for(tokens * half), kThreads, 0, native(s)>>>(positions.data<int32_t>(), theta, inverse,
                                                                          d, cs, tokens * half);
  launched("rope_qk");
  const int64_t items = (rows_q + rows_k) * (half / kVec);
  with_float_type("rope_qk", q, [&](const auto* in_q) {
    with_float_type("rope_qk", q_out, [&](auto* y_q) {
      using I = std::remove_const_t<std::remove_pointer_t<decltype(in_q)>>;
      using O = std::remove_pointer_t<decltype(y_q)>;
      rope_pair_kernel<kVec, I, O><<<blocks_for(items), kThreads, 0, native(s)>>>(
          in_q, y_q, q.dim(2), rows_q, static_cast<const I*>(k.raw_data()), static_cast<O*>(k_out.raw_data()),
          k.dim(2), rows_k, cs, half);
    });
  });
  launched("rope_qk");
}

void cross_entropy(Stream& s, const NDArray& logits, const NDArray& targets, const NDArray& normalizer,
                   int ignore_index, NDArray& loss, NDArray& lse, int64_t classes) {
  require_contiguous("cross_entropy", logits);
  require_contiguous("cross_entropy", targets);
  require_f32("cross_entropy", {&normalizer, &loss, &lse});  // logits f32 or bf16
  const int64_t v = logits.dim(-1), rows = targets.numel();
  HSPMD_CHECK(logits.numel() == rows * v && loss.numel() == 1, "cross_entropy: sizes");
  const int64_t n = class_columns(v, 0, classes);
  check_targets(s, targets, n, ignore_index);
  NDArray row_loss = NDArray::empty({rows > 0 ? rows : 1}, DType::F64, logits.device());
  if (rows > 0) {
    launch_row_lse(s, "cross_entropy", logits, targets.data<int32_t>(), v, n, 0, ignore_index, lse.data<float>(),
                   static_cast<double*>(row_loss.raw_data()), nullptr, rows);
    launched("cross_entropy");
  }
  loss_kernel<<<1, kThreads, 0, native(s)>>>(static_cast<const double*>(row_loss.raw_data()), rows, normalizer.data<float>(),
                                      loss.data<float>());
  launched("cross_entropy: loss");
}

void cross_entropy_shard_stats(Stream& s, const NDArray& logits, const NDArray& targets, int64_t vocab_begin,
                               int64_t vocab_size, int ignore_index, NDArray& local_lse, NDArray& target_logit,
                               int64_t classes) {
  require_contiguous("cross_entropy", logits);
  require_contiguous("cross_entropy", targets);
  require_f32("cross_entropy_shard_stats", {&local_lse, &target_logit});  // logits f32 or bf16
  const int64_t v = logits.dim(-1), rows = targets.numel();
  HSPMD_CHECK(logits.numel() == rows * v && local_lse.numel() == rows && target_logit.numel() == rows,
              "cross_entropy_shard_stats: sizes");
  HSPMD_CHECK(vocab_begin >= 0 && vocab_begin + v <= vocab_size, "cross_entropy_shard_stats: vocab range");
  check_targets(s, targets, classes > 0 ? classes : vocab_size, ignore_index);
  const int64_t n = class_columns(v, vocab_begin, classes);
  if (rows == 0) return;
  launch_row_lse(s, "cross_entropy_shard_stats", logits, targets.data<int32_t>(), v, n, vocab_begin, ignore_index,
                 local_lse.data<float>(), nullptr, target_logit.data<float>(), rows);
  launched("cross_entropy_shard_stats");
}

void cross_entropy_combine(Stream& s, const NDArray& shard_lse, const NDArray& target_logit, const NDArray& targets,
                           const NDArray& normalizer, int ignore_index, NDArray& loss, NDArray& lse) {
  require_contiguous("cross_entropy", shard_lse);
  require_f32("cross_entropy_combine", {&shard_lse, &target_logit, &normalizer, &loss, &lse});
  const int64_t rows = targets.numel(), shards = shard_lse.dim(0);
  HSPMD_CHECK(shard_lse.numel() == shards * rows && target_logit.numel() == rows && lse.numel() == rows &&
                  loss.numel() == 1,
              "cross_entropy_combine: sizes");
  NDArray row_loss = NDArray::empty({rows > 0 ? rows : 1}, DType::F64, shard_lse.device());
  if (rows > 0) {
    combine_kernel<<<blocks_for(rows), kThreads, 0, native(s)>>>(
        shard_lse.data<float>(), target_logit.data<float>(), targets.data<int32_t>(), rows, shards, ignore_index,
        lse.data<float>(), static_cast<double*>(row_loss.raw_data()));
    launched("cross_entropy_combine");
  }
  loss_kernel<<<1, kThreads, 0, native(s)>>>(static_cast<const double*>(row_loss.raw_data()), rows, normalizer.data<float>(),
                                      loss.data<float>());
  launched("cross_entropy_combine: loss");
}

void cross_entropy_backward(Stream& s, const NDArray& dloss, const NDArray& logits, const NDArray& targets,
                            const NDArray& normalizer, const NDArray& lse, int ignore_index, int64_t vocab_begin,
                            NDArray& dlogits, int64_t classes) {
  require_contiguous("cross_entropy_backward", logits);
  require_f32("cross_entropy_backward", {&dloss, &normalizer, &lse});  // logits f32 or bf16
  const int64_t v = logits.dim(-1), rows = targets.numel();
  HSPMD_CHECK(logits.numel() == rows * v && dlogits.numel() == rows * v, "cross_entropy_backward: sizes");
  if (rows * v == 0) return;
  const bool vec = v % kVec == 0 && aligned16(logits.raw_data()) && aligned16(dlogits.raw_data());
  with_float_type("cross_entropy_backward", logits, [&](auto* x) {
    using I = std::remove_pointer_t<decltype(x)>;
    with_float_type("cross_entropy_backward", dlogits, [&](auto* dx) {
      using O = std::remove_pointer_t<decltype(dx)>;
      const auto kernel = vec ? &ce_backward_kernel<kVec, I, O> : &ce_backward_kernel<1, I, O>;
      kernel<<<row_blocks(rows), kThreads, 0, native(s)>>>(
          dloss.data<float>(), x, targets.data<int32_t>(), normalizer.data<float>(), lse.data<float>(), ignore_index,
          vocab_begin, v, class_columns(v, vocab_begin, classes), dx, rows);
    });
  });
  launched("cross_entropy_backward");
}

}  // namespace hspmd::kernels::cuda
