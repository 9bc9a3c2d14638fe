#include "hspmd/core/device.h"

#include <algorithm>
#include <ctime>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/block_cache.h"
#include "hspmd/core/error.h"
#ifdef HSPMD_HAVE_CUDA
#include "core/cuda_runtime.h"
#endif

namespace hspmd {

std::string Device::str() const {
  return (type == DeviceType::CPU ? "cpu:" : "cuda:") + std::to_string(index);
}

void Allocator::account_alloc(size_t bytes) {
  size_t now = current_.fetch_add(bytes) + bytes;
  size_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
}

namespace {

// 64-byte aligned host memory (one cache line, one AVX-512 vector) with a
// cache of freed blocks by exact size: a training step allocates the same
// sizes every step, and reusing blocks avoids page faults and zeroing by the
// kernel on every fresh mapping.
class CpuAllocator final : public CachingAllocator {
 public:
  CpuAllocator() : CachingAllocator(64) {}
  ~CpuAllocator() override { release_cache(); }

 private:
  void* backend_allocate(size_t bytes) override { return std::aligned_alloc(64, bytes); }
  void backend_free(void* ptr) override { std::free(ptr); }
  [[noreturn]] void out_of_memory(size_t bytes) override { fail("[cpu] out of memory allocating ", bytes, " bytes"); }
};

}  // namespace

bool built_with_cuda() {
#ifdef HSPMD_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef HSPMD_HAVE_CUDA
  return cuda_rt::device_count();
#else
  return 0;
#endif
}

Device parse_device_name(const std::string& text, const std::string& flag) {
  if (text == "cpu" || text == "cpu:0") return Device::cpu();
  if (text == "cpu:1") return Device::host_double();
  if (text == "cuda") return Device::cuda(0);
  if (text.rfind("cuda:", 0) == 0 && text.size() > 5 && text.size() <= 9 &&
      text.find_first_not_of("0123456789", 5) == std::string::npos)
    return Device::cuda(std::stoi(text.substr(5)));
  fail("[flags] ", flag, ": '", text.size() > 40 ? text.substr(0, 40) + "..." : text,
       "' (expected cpu, cuda or cuda:N)");
}

Device rank_device(const std::string& text, const std::string& flag, int fallback_rank) {
  const Device parsed = parse_device_name(text, flag);
  if (text != "cuda") return parsed;
  int local = fallback_rank;
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"})
    if (const char* v = std::getenv(var)) {
      local = std::atoi(v);
      break;
    }
  const int n = cuda_device_count();
  return Device::cuda(n > 0 ? std::max(0, local) % n : 0);
}

void require_device(Device device) {
  if (device.type == DeviceType::CPU) {
    if (device.index != 0 && !(device == Device::host_double()))
      fail("[device] ", device.str(), ": the host is cpu:0 (and cpu:1 its device test double)");
    return;
  }
  if (!built_with_cuda()) fail("[device] ", device.str(), ": this build has no CUDA backend");
  const int n = cuda_device_count();
  if (n == 0) {
    std::string why;
#ifdef HSPMD_HAVE_CUDA
    why = cuda_rt::device_count_error();  // a broken driver or MPS is not "no device"
#endif
    fail("[device] ", device.str(), ": no CUDA device is visible to this process",
         why.empty() ? "" : " (cudaGetDeviceCount: " + why + ")");
  }
  if (device.index < 0 || device.index >= n)
    fail("[device] ", device.str(), ": no such device (", n, " CUDA device", n == 1 ? "" : "s", " visible)");
}

Allocator& allocator_for(Device device) {
  static CpuAllocator cpu;
  if (device.type == DeviceType::CPU) return cpu;
#ifdef HSPMD_HAVE_CUDA
  require_device(device);
  return cuda_rt::allocator(device.index);
#else
  fail("[device] ", device.str(), ": this build has no CUDA backend");
#endif
}

namespace {

// Stream `id` of `device`: 0 the default one, 1 the communication one.
Stream& device_stream(Device device, int id) {
  static Stream cpu[2] = {Stream(Device::cpu(), 0), Stream(Device::cpu(), 1)};
  static Stream double_streams[2] = {Stream(Device::host_double(), 0), Stream(Device::host_double(), 1)};
  if (device == Device::cpu()) return cpu[id];
  if (device == Device::host_double()) return double_streams[id];
  if (device.type == DeviceType::CPU) require_device(device);
#ifdef HSPMD_HAVE_CUDA
  require_device(device);
  return id == 0 ? cuda_rt::default_stream(device.index) : cuda_rt::comm_stream(device.index);
#else
  fail("[device] ", device.str(), ": this build has no CUDA backend");
#endif
}

}  // namespace

Stream& default_stream(Device device) { return device_stream(device, 0); }

Stream& comm_stream(Device device) { return device_stream(device, 1); }

void stream_wait(Stream& stream, const Event& event) {
  HSPMD_CHECK(event.recorded(), "stream_wait on an event never recorded");
#ifdef HSPMD_HAVE_CUDA
  if (stream.device().type == DeviceType::CUDA) {
    cuda_rt::stream_wait(stream, event.native_handle());
    return;
  }
#else
  (void)stream;  // without CUDA every stream is a CPU stream
#endif
  event.synchronize();  // a CPU event's work ran when it was recorded
}

void bind_thread(Device device) {
#ifdef HSPMD_HAVE_CUDA
  if (device.type == DeviceType::CUDA) cuda_rt::set_device(device.index);
#else
  (void)device;
#endif
}

namespace {
thread_local SideStreamScope* t_side_stream = nullptr;
}

SideStreamScope::SideStreamScope() {
  HSPMD_CHECK(t_side_stream == nullptr, "SideStreamScope nested on one thread");
  t_side_stream = this;
}

SideStreamScope::~SideStreamScope() {
  t_side_stream = nullptr;
  for (auto& f : held_) f();
}

void SideStreamScope::release() {
  SideStreamScope* self = t_side_stream;
  t_side_stream = nullptr;  // the frees below happen now
  std::vector<std::function<void()>> held = std::move(held_);
  held_.clear();
  for (auto& f : held) f();
  t_side_stream = self;
}

SideStreamScope* SideStreamScope::current() { return t_side_stream; }

Allocator& staging_host_allocator() {
#ifdef HSPMD_HAVE_CUDA
  if (cuda_rt::device_count() > 0) return cuda_rt::pinned_allocator();
#endif
  return allocator_for(Device::cpu());
}

void copy_bytes(Stream& stream, void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
#ifdef HSPMD_HAVE_CUDA
  if (stream.device().type == DeviceType::CUDA) {
    cuda_rt::copy_bytes(stream, dst, src, bytes);
    return;
  }
#endif
  HSPMD_CHECK(stream.device().type == DeviceType::CPU, "copy_bytes on a ", stream.device().str(),
              " stream in a build without its backend");
  std::memmove(dst, src, bytes);
}

void Event::record(Stream& stream) {
  stream_ = &stream;
#ifdef HSPMD_HAVE_CUDA
  if (stream.device().type == DeviceType::CUDA) {
    native_ = cuda_rt::record_event(stream);
    return;
  }
#endif
  stream.synchronize();
  at_ = std::chrono::steady_clock::now();
}

void Event::synchronize() const {
  HSPMD_CHECK(recorded(), "Event::synchronize before record");
#ifdef HSPMD_HAVE_CUDA
  if (native_) cuda_rt::synchronize_event(native_.get());
#endif
}

double Event::elapsed_ms(const Event& start) const {
  HSPMD_CHECK(recorded() && start.recorded(), "Event::elapsed_ms of an event never recorded");
#ifdef HSPMD_HAVE_CUDA
  if (native_ || start.native_) {
    HSPMD_CHECK(native_ && start.native_, "Event::elapsed_ms between a CUDA and a CPU event");
    return cuda_rt::elapsed_ms(start.native_.get(), native_.get());
  }
#endif
  return std::chrono::duration<double, std::milli>(at_ - start.at_).count();
}

double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

void WorkTimer::begin() {
  if (stream_ != nullptr)
    start_.record(*stream_);
  else
    cpu0_ = process_cpu_seconds();
}

double WorkTimer::end_s() {
  if (stream_ == nullptr) return process_cpu_seconds() - cpu0_;
  HSPMD_CHECK(start_.recorded(), "WorkTimer::end_s before begin");
  Event end;
  end.record(*stream_);
  end.synchronize();
  return end.elapsed_ms(start_) * 1e-3;
}

}  // namespace hspmd
