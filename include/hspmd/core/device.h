// Devices, their allocators and streams.
//
// A Device names where memory lives and kernels run. What a device type
// needs underneath (allocator, streams, events, copies) is its registered
// DeviceRuntime (device_runtime.h): core has the CPU's, a backend registers
// its own (CUDA: src/kernels/cuda/), without any change to op files.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace hspmd {

enum class DeviceType : uint8_t { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static Device cpu() { return {DeviceType::CPU, 0}; }
  static Device cuda(int index = 0) { return {DeviceType::CUDA, index}; }
  // cpu:1, the device test double: host memory and the CPU's kernels, but
  // not the host to the rest of hspmd. Host accessors (NDArray::host_data,
  // to, clone, fill, ...) refuse its arrays as they refuse a GPU's,
  // kernels::to_host / to_device copy, communicators stage its buffers. So
  // every path a GPU takes runs on machines without one (`--device cpu:1`,
  // docs/cuda.md), and a host access that a GPU would refuse fails here too.
  static Device host_double() { return {DeviceType::CPU, 1}; }
  bool operator==(const Device&) const = default;
  std::string str() const;
};

// Allocates device memory and accounts current and peak bytes.
// Thread-safe. allocate() throws hspmd::Error when memory is exhausted.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr, size_t bytes) = 0;

  size_t current_bytes() const { return current_.load(); }
  size_t peak_bytes() const { return peak_.load(); }
  void reset_peak() { peak_.store(current_.load()); }

  // Private pools, for a captured device graph (DeviceRuntime::begin_capture;
  // docs/cuda.md, "CUDA graphs"): while a pool is the calling thread's
  // (use_pool), every block this allocator hands that thread belongs to the
  // pool, and once freed, by any thread, it goes back to the pool, never to
  // the shared cache: memory the graph's replays write is never given to
  // work queued between them. Blocks freed in the pool are reused by the
  // pool's own later requests (in the order of one stream's queue). When the
  // last copy of the handle goes, the pool's free blocks return to the
  // cache and its blocks still in use return there when freed. An
  // allocator without pools returns nullptr and use_pool does nothing.
  virtual std::shared_ptr<void> new_pool() { return nullptr; }
  // `pool` (from this allocator's new_pool) becomes the calling thread's;
  // nullptr: none.
  virtual void use_pool(const std::shared_ptr<void>& pool) { (void)pool; }

 protected:
  void account_alloc(size_t bytes);
  void account_free(size_t bytes) { current_.fetch_sub(bytes); }

 private:
  std::atomic<size_t> current_{0};
  std::atomic<size_t> peak_{0};
};

// The process-wide allocator of a device. Throws hspmd::Error when the
// device type has no backend in this build.
Allocator& allocator_for(Device device);

// An ordered queue of work on one device: every kernel takes the stream it
// runs on (src/kernels/*.h), and work issued to one stream runs in issue
// order. On the CPU, kernels run inline in the calling thread, so a CPU
// stream's work is done when the kernel returns and synchronize() returns at
// once. A backend with asynchronous queues derives from Stream (CUDA: one
// wrapping a cudaStream_t, returned by native_handle()). Not copyable: code
// holds streams by reference.
class Stream {
 public:
  Stream(Device device, int id) : device_(device), id_(id) {}
  virtual ~Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  Device device() const { return device_; }
  int id() const { return id_; }  // 0: the device's default stream
  // Waits until all work issued to this stream has finished (CPU: no-op).
  // While the calling thread records a step (RecordingScope), an error.
  void synchronize();
  // The backend's queue handle (a cudaStream_t for CUDA); nullptr on the CPU.
  virtual void* native_handle() const { return nullptr; }

 protected:
  // The backend's wait (synchronize()'s; CPU: nothing to wait for).
  virtual void wait() {}

 private:
  Device device_;
  int id_ = 0;
};

// The process-wide default stream (id 0) of a device, where ops run unless
// told otherwise. Throws hspmd::Error when the device type has no backend in
// this build.
Stream& default_stream(Device device);

class Event;

// The device's communication stream (id 1), beside its default stream:
// where a communication thread orders its work (the overlapped gradient
// synchronization, docs/comm.md). CUDA: a second non-blocking stream; CPU
// and the test double: a stream of their own, whose work runs inline.
Stream& comm_stream(Device device);

// Makes later work of `stream` wait for `event`'s point without blocking the
// host (CUDA: cudaStreamWaitEvent). CPU: the recorded work already ran
// inline, so nothing waits.
void stream_wait(Stream& stream, const Event& event);

// Makes `device` the calling thread's current device (CUDA: cudaSetDevice; a
// new thread starts on device 0). Nothing for the CPU.
void bind_thread(Device device);

// The memory of a thread whose work runs on a stream of its own (the
// communication thread). The caching allocators (CPU, CUDA, pinned) do not
// track streams: a block freed while work queued on its stream still uses
// it is safe to reuse on that same stream only. So while one of these lives
// on a thread, that thread allocates side blocks from a cache of its own
// (never a block another thread freed, whose stream may still use it), and
// the blocks it frees are held back until release() — which the thread
// calls after synchronizing its stream — or its end. A side block goes back
// to the side cache whoever frees it (other threads never get one; the side
// thread orders its stream after theirs before it writes), any other block
// to the common cache. Not nestable.
class SideStreamScope {
 public:
  SideStreamScope();
  ~SideStreamScope();
  SideStreamScope(const SideStreamScope&) = delete;
  SideStreamScope& operator=(const SideStreamScope&) = delete;
  // Frees everything held so far (the caller has synchronized its stream).
  void release();
  // The calling thread's, or nullptr.
  static SideStreamScope* current();
  // Keeps `free` to run at release().
  void hold(std::function<void()> free) { held_.push_back(std::move(free)); }

 private:
  std::vector<std::function<void()>> held_;
};

// While a RecordingScope lives on a thread, the device work that thread
// queues is being recorded as a graph (CUDA graphs: DeviceRuntime::
// begin_capture), not run: nothing it queued has a value yet, so a host wait
// (Stream::synchronize, Event::synchronize, a kernel that reads device
// values back) cannot be part of it and throws hspmd::Error naming the wait
// and `what` (the step being recorded), before the backend would fail the
// recording with its own, vaguer reason. The same scope audits a step on the
// CPU, where nothing is recorded (HSPMD_CAPTURE_AUDIT, docs/cuda.md).
class RecordingScope {
 public:
  explicit RecordingScope(std::string what);
  ~RecordingScope();
  RecordingScope(const RecordingScope&) = delete;
  RecordingScope& operator=(const RecordingScope&) = delete;
  // The calling thread's, or nullptr.
  static const RecordingScope* current();
  const std::string& what() const { return what_; }

 private:
  std::string what_;
  const RecordingScope* outer_;
};
// Throws while the calling thread records (RecordingScope): "[device] <wait>
// while recording <what>: ...".
void refuse_host_wait(const char* wait);

// Host memory for staging device buffers through a host library (the
// staged communicator, docs/comm.md): page-locked (cudaHostAlloc, cached by
// size) when the build has CUDA and a device is visible, so that copies to
// and from the device run at full speed and asynchronously; otherwise the
// CPU's allocator. Its blocks are host memory either way.
Allocator& staging_host_allocator();

// Copies `bytes` from `src` to `dst` in `stream`'s order. On a CUDA stream
// either side may be host or device memory (cudaMemcpyAsync, the direction
// from unified addressing; pageable host memory makes it synchronous); on
// the CPU's stream, a memcpy now.
void copy_bytes(Stream& stream, void* dst, const void* src, size_t bytes);

// Whether this build has the CUDA backend, and how many CUDA devices this
// process sees (0 without the backend, a driver or a device).
bool built_with_cuda();
int cuda_device_count();
// "cpu", "cuda" (= cuda:0) or "cuda:N" as a Device; anything else throws
// "[flags] <flag>: '<text>' (expected cpu, cuda or cuda:N)".
Device parse_device_name(const std::string& text, const std::string& flag);
// The device of this process for a --device text among the ranks of one
// machine: plain "cuda" spreads them over the machine's GPUs (the launcher's
// local rank, else `fallback_rank`, modulo the GPUs visible); anything else
// as parse_device_name gives it ("cuda:N" puts every rank on N).
Device rank_device(const std::string& text, const std::string& flag, int fallback_rank);
// Throws "[device] cuda:N: ..." in one line unless `device` can be used:
// a build without CUDA, no GPU, an index that does not exist.
void require_device(Device device);

// A point in a stream's work, for waiting and timing. CPU: record()
// synchronizes the stream and takes a timestamp (steady clock). CUDA: a
// cudaEvent recorded on the stream (timing enabled); synchronize() waits for
// it and elapsed_ms() reads the time between two such events. Copies share
// the recorded point.
class Event {
 public:
  // Marks the point after the work issued to `stream` so far.
  void record(Stream& stream);
  bool recorded() const { return stream_ != nullptr; }
  // Waits until the work before the recorded point has finished.
  void synchronize() const;
  // Milliseconds from `start`'s point to this one; both must be recorded.
  double elapsed_ms(const Event& start) const;
  // The cudaEvent_t of a CUDA stream's event; nullptr on the CPU.
  void* native_handle() const { return native_.get(); }

 private:
  Stream* stream_ = nullptr;
  std::chrono::steady_clock::time_point at_{};
  std::shared_ptr<void> native_;  // the cudaEvent_t of a CUDA stream
};

// How long the work between begin() and end_s() took: the one timing
// interface of the emulator's clock (exec/virtual_clock.h) and the profiler,
// whatever runs the work.
//  * process_cpu(): the process's CPU time over the bracket (CPU work: the
//    emulated cluster bills what a rank computed, not what it waited for a
//    core shared with other ranks).
//  * events(stream): two Events recorded on the stream around the work
//    (asynchronous device work: the time the device spent on it; end_s()
//    waits for the stream). On the CPU, whose streams run inline, wall time.
class WorkTimer {
 public:
  static WorkTimer process_cpu() { return WorkTimer(nullptr); }
  static WorkTimer events(Stream& stream) { return WorkTimer(&stream); }

  void begin();
  double end_s();  // seconds since begin()
  bool uses_events() const { return stream_ != nullptr; }

 private:
  explicit WorkTimer(Stream* stream) : stream_(stream) {}
  Stream* stream_ = nullptr;
  Event start_;
  double cpu0_ = 0;
};

// This process's CPU time in seconds (all threads).
double process_cpu_seconds();

}  // namespace hspmd
