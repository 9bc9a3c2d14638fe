// The CUDA device runtime (cuda_runtime.h): allocators, streams and events
// of CUDA devices, on the CUDA runtime API. Compiled only with CUDA.
#include "core/cuda_runtime.h"

#include <cuda_runtime.h>

#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/block_cache.h"
#include "hspmd/core/error.h"

namespace hspmd::cuda_rt {

void check(int status, const char* call) {
  if (status != cudaSuccess)
    fail("[cuda] ", call, ": ", cudaGetErrorString(static_cast<cudaError_t>(status)));
}

int device_count() {
  static const int n = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();  // no driver or no device: none, not an error
      return 0;
    }
    return count;
  }();
  return n;
}

void set_device(int index) { check(cudaSetDevice(index), "cudaSetDevice"); }

namespace {

// Blocks rounded up to 512 bytes and cached by that size.
class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(int index) : index_(index) {}
  ~CudaAllocator() override { release_cache(); }

  void* allocate(size_t bytes) override {
    const size_t rounded = round(bytes);
    if (void* p = cache_.take(rounded)) {
      account_alloc(bytes);
      return p;
    }
    set_device(index_);
    void* p = nullptr;
    cudaError_t status = cudaMalloc(&p, rounded);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      release_cache();  // what the cache holds may be enough
      status = cudaMalloc(&p, rounded);
    }
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      fail("[cuda:", index_, "] out of memory allocating ", bytes, " bytes (", current_bytes(), " in use, peak ",
           peak_bytes(), "): ", cudaGetErrorString(status));
    }
    account_alloc(bytes);
    return p;
  }

  void deallocate(void* ptr, size_t bytes) override {
    account_free(bytes);
    cache_.put(round(bytes), ptr);
  }

 private:
  static size_t round(size_t bytes) { return bytes == 0 ? 512 : (bytes + 511) / 512 * 512; }
  void release_cache() {
    cache_.drain([](void* p) { (void)cudaFree(p); });
  }

  int index_;
  BlockCache cache_;
};

// Page-locked host blocks rounded up to 4 KiB and cached by that size.
class PinnedAllocator final : public Allocator {
 public:
  ~PinnedAllocator() override = default;  // process lifetime: see CudaStream

  void* allocate(size_t bytes) override {
    const size_t rounded = round(bytes);
    if (void* p = cache_.take(rounded)) {
      account_alloc(bytes);
      return p;
    }
    void* p = nullptr;
    cudaError_t status = cudaHostAlloc(&p, rounded, cudaHostAllocPortable);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      cache_.drain([](void* q) { (void)cudaFreeHost(q); });
      status = cudaHostAlloc(&p, rounded, cudaHostAllocPortable);
    }
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      fail("[cuda] out of pinned host memory allocating ", bytes, " bytes (", current_bytes(), " in use): ",
           cudaGetErrorString(status));
    }
    account_alloc(bytes);
    return p;
  }

  void deallocate(void* ptr, size_t bytes) override {
    account_free(bytes);
    cache_.put(round(bytes), ptr);
  }

 private:
  static size_t round(size_t bytes) { return bytes == 0 ? 4096 : (bytes + 4095) / 4096 * 4096; }
  BlockCache cache_;
};

class CudaStream final : public Stream {
 public:
  explicit CudaStream(int index) : Stream(Device::cuda(index), 0) {
    set_device(index);
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  }
  // Process-lifetime objects: the driver may be gone at exit, so the
  // stream is not destroyed.
  void synchronize() override { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }
  void* native_handle() const override { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

template <typename T>
T& per_device(int index, std::unordered_map<int, std::unique_ptr<T>>& all, std::mutex& mu) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = all.find(index);
  if (it == all.end()) it = all.emplace(index, std::make_unique<T>(index)).first;
  return *it->second;
}

}  // namespace

Allocator& allocator(int index) {
  static std::mutex mu;
  static auto* all = new std::unordered_map<int, std::unique_ptr<CudaAllocator>>();  // never destroyed: see CudaStream
  return per_device(index, *all, mu);
}

Stream& default_stream(int index) {
  static std::mutex mu;
  static auto* all = new std::unordered_map<int, std::unique_ptr<CudaStream>>();
  return per_device(index, *all, mu);
}

Allocator& pinned_allocator() {
  static auto* pinned = new PinnedAllocator();  // never destroyed: see CudaStream
  return *pinned;
}

void copy_bytes(Stream& stream, void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  set_device(stream.device().index);
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream.native_handle())),
        "cudaMemcpyAsync");
}

std::shared_ptr<void> record_event(Stream& stream) {
  set_device(stream.device().index);
  cudaEvent_t e = nullptr;
  check(cudaEventCreate(&e), "cudaEventCreate");
  std::shared_ptr<void> event(e, [](void* p) { (void)cudaEventDestroy(static_cast<cudaEvent_t>(p)); });
  check(cudaEventRecord(e, static_cast<cudaStream_t>(stream.native_handle())), "cudaEventRecord");
  return event;
}

void synchronize_event(void* event) {
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(event)), "cudaEventSynchronize");
}

double elapsed_ms(void* start, void* end) {
  synchronize_event(end);
  float ms = 0;
  check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end)),
        "cudaEventElapsedTime");
  return ms;
}

}  // namespace hspmd::cuda_rt
