// probe_streams: the transfer, ordering, allocation and collective facts the
// distributed backend relies on.
//  1. host<->device copy bandwidth, pinned (cudaHostAlloc) vs pageable, and
//     device-to-device bandwidth (read + write counted), 256 MiB, contents
//     verified end to end;
//  2. two streams ordered only by events: stream A copies in, stream B waits
//     on A's event and runs a kernel, stream A waits on B's event and copies
//     out; every result checked, so a missing dependency shows as wrong data;
//  3. stream-ordered allocation (cudaMallocAsync / cudaFreeAsync on the
//     device's default pool, release threshold raised so freed blocks are
//     reused) latency, against cudaMalloc / cudaFree;
//  4. NCCL with a world of one (ncclGetUniqueId + ncclCommInitRank, nranks 1):
//     all-reduce (sum) of bf16 and fp32, out of place and in place, and
//     ncclSend/ncclRecv to itself inside ncclGroupStart/End, values checked.
#include "probe_common.cuh"

#ifndef HSPMD_PROBE_NCCL
#define HSPMD_PROBE_NCCL 1
#endif
#if HSPMD_PROBE_NCCL
#include <nccl.h>
#endif

#include <chrono>
#include <cstdint>

using namespace probe;

namespace {

constexpr size_t kBig = 256u << 20;  // 256 MiB

double gbps(double bytes, double ms) { return bytes / (ms * 1e-3) / 1e9; }

__global__ void k_affine(uint32_t* x, size_t n, uint32_t a, uint32_t b) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t v = x[i];
#pragma unroll 1
    for (int r = 0; r < 8; ++r) v = v * a + b;  // some work, so a missing wait would be caught
    x[i] = v;
  }
}
uint32_t affine_host(uint32_t v, uint32_t a, uint32_t b) {
  for (int r = 0; r < 8; ++r) v = v * a + b;
  return v;
}

void bandwidth(cudaStream_t s) {
  void *hp_src, *hp_dst, *d1, *d2;
  PROBE_CUDA(cudaHostAlloc(&hp_src, kBig, cudaHostAllocDefault));
  PROBE_CUDA(cudaHostAlloc(&hp_dst, kBig, cudaHostAllocDefault));
  PROBE_CUDA(cudaMalloc(&d1, kBig));
  PROBE_CUDA(cudaMalloc(&d2, kBig));
  std::vector<unsigned char> pg_src(kBig), pg_dst(kBig);  // pageable, touched
  auto* src32 = static_cast<uint32_t*>(hp_src);
  for (size_t i = 0; i < kBig / 4; ++i) src32[i] = static_cast<uint32_t>(i * 2654435761u);
  std::memcpy(pg_src.data(), hp_src, kBig);
  std::memset(hp_dst, 0xFF, kBig);

  auto copy_ms = [&](void* dst, const void* src, cudaMemcpyKind kind, int reps) {
    return median_ms(s, 2, reps, [&] { PROBE_CUDA(cudaMemcpyAsync(dst, src, kBig, kind, s)); });
  };
  double h2d_p = copy_ms(d1, hp_src, cudaMemcpyHostToDevice, 10);
  double d2d = copy_ms(d2, d1, cudaMemcpyDeviceToDevice, 20);
  double d2h_p = copy_ms(hp_dst, d2, cudaMemcpyDeviceToHost, 10);
  bool ok_p = std::memcmp(hp_src, hp_dst, kBig) == 0;
  double h2d_g = copy_ms(d1, pg_src.data(), cudaMemcpyHostToDevice, 5);
  PROBE_CUDA(cudaMemsetAsync(d2, 0xFF, kBig, s));
  PROBE_CUDA(cudaMemcpyAsync(d2, d1, kBig, cudaMemcpyDeviceToDevice, s));
  double d2h_g = copy_ms(pg_dst.data(), d2, cudaMemcpyDeviceToHost, 5);
  PROBE_CUDA(cudaStreamSynchronize(s));
  bool ok_g = std::memcmp(pg_src.data(), pg_dst.data(), kBig) == 0;

  result("h2d_pinned", pass_fail(ok_p), "bytes=%zu median_ms=%.3f gbps=%.1f", kBig, h2d_p, gbps(kBig, h2d_p));
  result("d2h_pinned", pass_fail(ok_p), "bytes=%zu median_ms=%.3f gbps=%.1f", kBig, d2h_p, gbps(kBig, d2h_p));
  result("h2d_pageable", pass_fail(ok_g), "bytes=%zu median_ms=%.3f gbps=%.1f", kBig, h2d_g, gbps(kBig, h2d_g));
  result("d2h_pageable", pass_fail(ok_g), "bytes=%zu median_ms=%.3f gbps=%.1f", kBig, d2h_g, gbps(kBig, d2h_g));
  result("d2d", pass_fail(ok_p), "bytes=%zu median_ms=%.3f gbps_rw=%.1f", kBig, d2d, gbps(2.0 * kBig, d2d));
  PROBE_CUDA(cudaFreeHost(hp_src));
  PROBE_CUDA(cudaFreeHost(hp_dst));
  PROBE_CUDA(cudaFree(d1));
  PROBE_CUDA(cudaFree(d2));
}

void event_ordering() {
  const size_t n = (64u << 20) / 4;
  const int rounds = 8;
  cudaStream_t a, b;
  PROBE_CUDA(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  PROBE_CUDA(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  cudaEvent_t copied, computed;
  PROBE_CUDA(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming));
  PROBE_CUDA(cudaEventCreateWithFlags(&computed, cudaEventDisableTiming));
  uint32_t *h_in, *h_out, *d;
  PROBE_CUDA(cudaHostAlloc(&h_in, n * 4, cudaHostAllocDefault));
  PROBE_CUDA(cudaHostAlloc(&h_out, n * 4, cudaHostAllocDefault));
  PROBE_CUDA(cudaMalloc(&d, n * 4));
  size_t bad = 0;
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < n; ++i) h_in[i] = static_cast<uint32_t>(i * 2246822519u + r);
    std::memset(h_out, 0xFF, n * 4);
    const uint32_t ka = 1664525u + 2 * r, kb = 1013904223u + r;
    PROBE_CUDA(cudaMemcpyAsync(d, h_in, n * 4, cudaMemcpyHostToDevice, a));
    PROBE_CUDA(cudaEventRecord(copied, a));
    PROBE_CUDA(cudaStreamWaitEvent(b, copied, 0));
    k_affine<<<1024, 256, 0, b>>>(d, n, ka, kb);
    PROBE_LAUNCH("k_affine");
    PROBE_CUDA(cudaEventRecord(computed, b));
    PROBE_CUDA(cudaStreamWaitEvent(a, computed, 0));
    PROBE_CUDA(cudaMemcpyAsync(h_out, d, n * 4, cudaMemcpyDeviceToHost, a));
    PROBE_CUDA(cudaStreamSynchronize(a));
    for (size_t i = 0; i < n; ++i)
      if (h_out[i] != affine_host(h_in[i], ka, kb)) ++bad;
  }
  result("two_stream_event_order", pass_fail(bad == 0), "rounds=%d bytes=%zu wrong=%zu", rounds, n * 4, bad);
  PROBE_CUDA(cudaFreeHost(h_in));
  PROBE_CUDA(cudaFreeHost(h_out));
  PROBE_CUDA(cudaFree(d));
  PROBE_CUDA(cudaEventDestroy(copied));
  PROBE_CUDA(cudaEventDestroy(computed));
  PROBE_CUDA(cudaStreamDestroy(a));
  PROBE_CUDA(cudaStreamDestroy(b));
}

void mempool(cudaStream_t s) {
  cudaMemPool_t pool;
  PROBE_CUDA(cudaDeviceGetDefaultMemPool(&pool, 0));
  uint64_t keep = UINT64_MAX;
  PROBE_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  using clk = std::chrono::steady_clock;
  auto us = [](clk::time_point t0) { return std::chrono::duration<double, std::micro>(clk::now() - t0).count(); };

  // First (cold) 1 GiB from the pool, then alloc+free pairs that reuse it.
  void* p = nullptr;
  auto t0 = clk::now();
  PROBE_CUDA(cudaMallocAsync(&p, 1u << 30, s));
  PROBE_CUDA(cudaStreamSynchronize(s));
  double cold_us = us(t0);
  PROBE_CUDA(cudaMemsetAsync(p, 0x5A, 1u << 30, s));
  unsigned char probe_byte = 0;
  PROBE_CUDA(cudaMemcpyAsync(&probe_byte, static_cast<char*>(p) + (1u << 29), 1, cudaMemcpyDeviceToHost, s));
  PROBE_CUDA(cudaFreeAsync(p, s));
  PROBE_CUDA(cudaStreamSynchronize(s));
  const int pairs = 1000;
  double warm_us[2];
  const size_t sizes[2] = {1u << 20, 64u << 20};
  for (int k = 0; k < 2; ++k) {
    t0 = clk::now();
    for (int i = 0; i < pairs; ++i) {
      PROBE_CUDA(cudaMallocAsync(&p, sizes[k], s));
      PROBE_CUDA(cudaFreeAsync(p, s));
    }
    PROBE_CUDA(cudaStreamSynchronize(s));
    warm_us[k] = us(t0) / pairs;
  }
  t0 = clk::now();
  for (int i = 0; i < 20; ++i) {
    PROBE_CUDA(cudaMalloc(&p, 64u << 20));
    PROBE_CUDA(cudaFree(p));
  }
  double sync_us = us(t0) / 20;
  // cold_us: first 1 GiB from the pool; pair_us / pair64_us: one
  // cudaMallocAsync + cudaFreeAsync of 1 MiB / 64 MiB, reused from the pool;
  // malloc_us: one cudaMalloc + cudaFree of 64 MiB.
  result("malloc_async", pass_fail(probe_byte == 0x5A), "cold_us=%.0f pair_us=%.2f pair64_us=%.2f malloc_us=%.0f",
         cold_us, warm_us[0], warm_us[1], sync_us);
}

#if HSPMD_PROBE_NCCL
#define NCCL_TRY(call, what_fail)                                                  \
  do {                                                                             \
    ncclResult_t r_ = (call);                                                      \
    if (r_ != ncclSuccess) {                                                       \
      what_fail = std::string(#call) + ": " + ncclGetErrorString(r_);            \
    }                                                                              \
  } while (0)

void nccl_world1(cudaStream_t s) {
  int v = 0;
  ncclGetVersion(&v);
  std::printf("INFO probe=streams nccl_runtime=%d nccl_headers=%d\n", v, NCCL_VERSION_CODE);
  ncclUniqueId id;
  ncclComm_t comm = nullptr;
  std::string err;
  auto t0 = std::chrono::steady_clock::now();
  NCCL_TRY(ncclGetUniqueId(&id), err);
  if (err.empty()) NCCL_TRY(ncclCommInitRank(&comm, 1, id, 0), err);
  double init_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!err.empty()) {
    result("nccl_init", "FAIL", "version=%d msg=\"%s\"", v, err.c_str());
    return;
  }
  result("nccl_init", "PASS", "version=%d nranks=1 init_ms=%.1f", v, init_ms);

  const size_t n = 1u << 20;
  void *send, *recv;
  PROBE_CUDA(cudaMalloc(&send, n * 4));
  PROBE_CUDA(cudaMalloc(&recv, n * 4));
  struct T {
    const char* name;
    ncclDataType_t t;
    size_t es;
  };
  for (T t : {T{"bf16", ncclBfloat16, 2}, T{"f32", ncclFloat32, 4}}) {
    if (t.es == 2)
      fill(static_cast<__nv_bfloat16*>(send), n, 41, 1.0f);
    else
      fill(static_cast<float*>(send), n, 42, 1.0f);
    PROBE_CUDA(cudaDeviceSynchronize());
    std::vector<unsigned char> want(n * t.es), got(n * t.es);
    PROBE_CUDA(cudaMemcpy(want.data(), send, n * t.es, cudaMemcpyDeviceToHost));

    // Out of place: recv poisoned first; the sum over one rank is the input.
    poison(recv, n * t.es, s);
    err.clear();
    NCCL_TRY(ncclAllReduce(send, recv, n, t.t, ncclSum, comm, s), err);
    PROBE_CUDA(cudaStreamSynchronize(s));
    PROBE_CUDA(cudaMemcpy(got.data(), recv, n * t.es, cudaMemcpyDeviceToHost));
    bool ok = err.empty() && got == want;
    result((std::string("allreduce_sum_") + t.name).c_str(), pass_fail(ok), "count=%zu%s%s", n,
           err.empty() ? "" : " msg=", err.c_str());
    // In place.
    PROBE_CUDA(cudaMemcpyAsync(recv, send, n * t.es, cudaMemcpyDeviceToDevice, s));
    err.clear();
    NCCL_TRY(ncclAllReduce(recv, recv, n, t.t, ncclSum, comm, s), err);
    PROBE_CUDA(cudaStreamSynchronize(s));
    PROBE_CUDA(cudaMemcpy(got.data(), recv, n * t.es, cudaMemcpyDeviceToHost));
    ok = err.empty() && got == want;
    result((std::string("allreduce_inplace_") + t.name).c_str(), pass_fail(ok), "count=%zu%s%s", n,
           err.empty() ? "" : " msg=", err.c_str());
  }

  // Send/recv to self (peer 0 at world 1), grouped.
  fill(static_cast<float*>(send), n, 43, 1.0f);
  PROBE_CUDA(cudaDeviceSynchronize());
  poison(recv, n * 4, s);
  err.clear();
  NCCL_TRY(ncclGroupStart(), err);
  if (err.empty()) NCCL_TRY(ncclSend(send, n, ncclFloat32, 0, comm, s), err);
  if (err.empty()) NCCL_TRY(ncclRecv(recv, n, ncclFloat32, 0, comm, s), err);
  std::string end_err;
  NCCL_TRY(ncclGroupEnd(), end_err);
  if (err.empty()) err = end_err;
  cudaError_t ce = cudaStreamSynchronize(s);
  if (ce != cudaSuccess) fatal("cudaStreamSynchronize after ncclSend/ncclRecv", cudaGetErrorString(ce), __FILE__, __LINE__);
  if (!err.empty()) {
    const char* last = ncclGetLastError(comm);
    result("sendrecv_self", "UNSUPPORTED", "msg=\"%s %s\"", err.c_str(), last ? last : "");
  } else {
    std::vector<float> a(n), b(n);
    PROBE_CUDA(cudaMemcpy(a.data(), send, n * 4, cudaMemcpyDeviceToHost));
    PROBE_CUDA(cudaMemcpy(b.data(), recv, n * 4, cudaMemcpyDeviceToHost));
    result("sendrecv_self", pass_fail(std::memcmp(a.data(), b.data(), n * 4) == 0), "count=%zu", n);
  }
  PROBE_CUDA(cudaFree(send));
  PROBE_CUDA(cudaFree(recv));
  ncclResult_t r = ncclCommDestroy(comm);
  if (r != ncclSuccess) fatal("ncclCommDestroy", ncclGetErrorString(r), __FILE__, __LINE__);
}
#else
void nccl_world1(cudaStream_t) { result("nccl_init", "UNSUPPORTED", "msg=\"built without NCCL\""); }
#endif

}  // namespace

int main() {
  require_device("streams");
  cudaStream_t s;
  PROBE_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  bandwidth(s);
  event_ordering();
  mempool(s);
  nccl_world1(s);
  PROBE_CUDA(cudaStreamDestroy(s));
  return exit_code();
}
