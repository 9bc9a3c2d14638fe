// The CUDA device runtime (runtime.h): allocators, streams and events of
// CUDA devices, on the CUDA runtime API, and core's DeviceRuntime over them.
// Compiled only with CUDA.
#include "kernels/cuda/runtime.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstring>
#include <utility>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/block_cache.h"
#include "hspmd/core/device_runtime.h"
#include "hspmd/core/error.h"
#include "kernels/cuda/cuda.h"

namespace hspmd::cuda_rt {

void check(int status, const char* call) {
  if (status != cudaSuccess)
    fail("[cuda] ", call, ": ", cudaGetErrorString(static_cast<cudaError_t>(status)));
}

namespace {

struct DeviceCount {
  int n = 0;
  std::string why;  // cudaGetDeviceCount's error, "" when it succeeded or saw no device
};

const DeviceCount& counted() {
  static const DeviceCount c = [] {
    DeviceCount r;
    const cudaError_t status = cudaGetDeviceCount(&r.n);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();  // no driver or no device: none, not an error
      r.n = 0;
      if (status != cudaErrorNoDevice) r.why = cudaGetErrorString(status);
    }
    return r;
  }();
  return c;
}

}  // namespace

int device_count() { return counted().n; }

std::string device_count_error() { return counted().why; }

void set_device(int index) { check(cudaSetDevice(index), "cudaSetDevice"); }

namespace {

// Device blocks rounded up to 512 bytes and cached by that size.
class CudaAllocator final : public CachingAllocator {
 public:
  explicit CudaAllocator(int index) : CachingAllocator(512), index_(index) {}
  ~CudaAllocator() override { release_cache(); }

 private:
  void* backend_allocate(size_t bytes) override {
    set_device(index_);
    void* p = nullptr;
    const cudaError_t status = cudaMalloc(&p, bytes);
    status_ = status;
    if (status == cudaSuccess) return p;
    (void)cudaGetLastError();
    return nullptr;
  }
  void backend_free(void* ptr) override { (void)cudaFree(ptr); }
  [[noreturn]] void out_of_memory(size_t bytes) override {
    fail("[cuda:", index_, "] out of memory allocating ", bytes, " bytes (", current_bytes(), " in use, peak ",
         peak_bytes(), "): ", cudaGetErrorString(static_cast<cudaError_t>(status_.load())));
  }

  int index_;
  std::atomic<int> status_{cudaSuccess};  // the backend's last reason
};

// Page-locked host blocks rounded up to 4 KiB and cached by that size.
class PinnedAllocator final : public CachingAllocator {
 public:
  PinnedAllocator() : CachingAllocator(4096) {}  // process lifetime: see CudaStream

 private:
  void* backend_allocate(size_t bytes) override {
    void* p = nullptr;
    const cudaError_t status = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    status_ = status;
    if (status == cudaSuccess) return p;
    (void)cudaGetLastError();
    return nullptr;
  }
  void backend_free(void* ptr) override { (void)cudaFreeHost(ptr); }
  [[noreturn]] void out_of_memory(size_t bytes) override {
    fail("[cuda] out of pinned host memory allocating ", bytes, " bytes (", current_bytes(), " in use): ",
         cudaGetErrorString(static_cast<cudaError_t>(status_.load())));
  }

  std::atomic<int> status_{cudaSuccess};  // the backend's last reason
};

class CudaStream final : public Stream {
 public:
  explicit CudaStream(int index, int id = 0) : Stream(Device::cuda(index), id) {
    set_device(index);
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  }
  // Process-lifetime objects: the driver may be gone at exit, so the
  // stream is not destroyed.
  void* native_handle() const override { return stream_; }

 protected:
  void wait() override { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

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

// Stream `id` (0: default, 1: communication) of device `index`.
static Stream& stream_of(int index, int id) {
  static std::mutex mu;
  static auto* all = new std::unordered_map<int, std::unique_ptr<CudaStream>>();  // never destroyed: see CudaStream
  std::lock_guard<std::mutex> lock(mu);
  auto it = all->find(2 * index + id);
  if (it == all->end()) it = all->emplace(2 * index + id, std::make_unique<CudaStream>(index, id)).first;
  return *it->second;
}

Stream& default_stream(int index) { return stream_of(index, 0); }

Stream& comm_stream(int index) { return stream_of(index, 1); }

void stream_wait(Stream& stream, void* event) {
  set_device(stream.device().index);
  check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream.native_handle()), static_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent");
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

// ---- CUDA graphs ----

namespace {

// What a graph keeps beside its work (runtime.h): page-locked blocks its
// copies read, host work at each launch.
struct Capture {
  std::vector<std::shared_ptr<void>> held;
  std::vector<std::function<void()>> at_launch;
};

thread_local Capture* t_capture = nullptr;

struct Graph {
  cudaGraphExec_t exec = nullptr;
  Capture kept;
  ~Graph() {
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
  }
};

cudaStream_t native_stream(Stream& stream) { return static_cast<cudaStream_t>(stream.native_handle()); }

}  // namespace

bool capturing(Stream& stream) {
  if (stream.device().type != DeviceType::CUDA) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(native_stream(stream), &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

void keep_for_graph(std::shared_ptr<void> held) {
  HSPMD_CHECK(t_capture != nullptr, "keep_for_graph outside a capture");
  t_capture->held.push_back(std::move(held));
}

void at_each_launch(std::function<void()> f) {
  HSPMD_CHECK(t_capture != nullptr, "at_each_launch outside a capture");
  t_capture->at_launch.push_back(std::move(f));
}

void copy_from_host(Stream& stream, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  set_device(stream.device().index);
  if (capturing(stream)) {
    Allocator& pinned = pinned_allocator();
    void* staged = pinned.allocate(bytes);
    std::memcpy(staged, src, bytes);
    keep_for_graph(std::shared_ptr<void>(staged, [&pinned, bytes](void* p) { pinned.deallocate(p, bytes); }));
    src = staged;
  }
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, native_stream(stream)), "cudaMemcpyAsync");
}

void begin_capture(Stream& stream) {
  HSPMD_CHECK(t_capture == nullptr, "begin_capture: this thread is capturing already");
  set_device(stream.device().index);
  kernels::cuda::flush_checks(stream);  // the graph's checks then take the first slots
  t_capture = new Capture();
  const cudaError_t status = cudaStreamBeginCapture(native_stream(stream), cudaStreamCaptureModeRelaxed);
  if (status != cudaSuccess) {
    delete std::exchange(t_capture, nullptr);
    check(status, "cudaStreamBeginCapture");
  }
}

std::shared_ptr<void> end_capture(Stream& stream) {
  HSPMD_CHECK(t_capture != nullptr, "end_capture without begin_capture");
  std::unique_ptr<Capture> kept(std::exchange(t_capture, nullptr));
  set_device(stream.device().index);
  cudaGraph_t graph = nullptr;
  cudaError_t status = cudaStreamEndCapture(native_stream(stream), &graph);
  // Nothing recorded ran: the checks queued meanwhile are the graph's, queued
  // again at each launch.
  kernels::cuda::drop_pending_checks(stream);
  auto result = std::make_shared<Graph>();
  if (status == cudaSuccess && graph != nullptr) {
    status = cudaGraphInstantiate(&result->exec, graph, 0);
    (void)cudaGraphDestroy(graph);
  } else if (status == cudaSuccess) {
    status = cudaErrorStreamCaptureInvalidated;
  } else if (graph != nullptr) {
    (void)cudaGraphDestroy(graph);
  }
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // the capture's error is not the context's
    result->exec = nullptr;
    fail("[cuda] CUDA graph capture failed: ", cudaGetErrorString(status));
  }
  result->kept = std::move(*kept);
  return result;
}

void launch_graph(const std::shared_ptr<void>& graph, Stream& stream) {
  auto* g = static_cast<Graph*>(graph.get());
  HSPMD_CHECK(g != nullptr && g->exec != nullptr, "launch_graph: no graph");
  set_device(stream.device().index);
  for (const auto& f : g->kept.at_launch) f();
  check(cudaGraphLaunch(g->exec, native_stream(stream)), "cudaGraphLaunch");
}

namespace {

// Core's view of the functions above (hspmd/core/device_runtime.h).
class CudaRuntime final : public DeviceRuntime {
 public:
  int device_count() override { return cuda_rt::device_count(); }
  std::string device_count_error() override { return cuda_rt::device_count_error(); }
  Allocator& allocator(int index) override { return cuda_rt::allocator(index); }
  Stream& stream(int index, int id) override { return id == 0 ? default_stream(index) : comm_stream(index); }
  void stream_wait(Stream& stream, const Event& event) override {
    cuda_rt::stream_wait(stream, event.native_handle());
  }
  void bind_thread(int index) override { set_device(index); }
  void copy_bytes(Stream& stream, void* dst, const void* src, size_t bytes) override {
    cuda_rt::copy_bytes(stream, dst, src, bytes);
  }
  std::shared_ptr<void> record_event(Stream& stream) override { return cuda_rt::record_event(stream); }
  void synchronize_event(void* event) override { cuda_rt::synchronize_event(event); }
  double elapsed_ms(void* start, void* end) override { return cuda_rt::elapsed_ms(start, end); }
  Allocator* staging_allocator() override { return &pinned_allocator(); }
  bool can_capture() override { return true; }
  void begin_capture(Stream& stream) override { cuda_rt::begin_capture(stream); }
  std::shared_ptr<void> end_capture(Stream& stream) override { return cuda_rt::end_capture(stream); }
  void launch_graph(const std::shared_ptr<void>& graph, Stream& stream) override {
    cuda_rt::launch_graph(graph, stream);
  }
};

}  // namespace

DeviceRuntime& runtime() {
  static auto* r = new CudaRuntime();  // never destroyed: see CudaStream
  return *r;
}

}  // namespace hspmd::cuda_rt
