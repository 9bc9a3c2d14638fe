// The registry of device runtimes (hspmd/core/device_runtime.h) and the
// CPU's runtime: host memory, and streams whose work runs inline.
#include "hspmd/core/device_runtime.h"

#include <array>
#include <cstdlib>
#include <cstring>

#include "core/block_cache.h"
#include "hspmd/core/error.h"

namespace hspmd {
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

// cpu:0, the host, and cpu:1, its device test double (device.h): host
// memory both, two streams each (default, communication) that run inline.
class CpuRuntime final : public DeviceRuntime {
 public:
  int device_count() override { return 2; }
  Allocator& allocator(int) override { return allocator_; }
  Stream& stream(int index, int id) override { return index == 0 ? host_[id] : double_[id]; }
  void stream_wait(Stream&, const Event& event) override { event.synchronize(); }  // its work ran when recorded
  void bind_thread(int) override {}
  void copy_bytes(Stream&, void* dst, const void* src, size_t bytes) override { std::memmove(dst, src, bytes); }
  std::shared_ptr<void> record_event(Stream&) override { return nullptr; }
  void synchronize_event(void*) override {}
  double elapsed_ms(void*, void*) override { return 0; }

 private:
  CpuAllocator allocator_;
  Stream host_[2] = {Stream(Device::cpu(), 0), Stream(Device::cpu(), 1)};
  Stream double_[2] = {Stream(Device::host_double(), 0), Stream(Device::host_double(), 1)};
};

constexpr size_t kDeviceTypes = static_cast<size_t>(DeviceType::CUDA) + 1;

std::array<DeviceRuntime*, kDeviceTypes>& runtimes() {
  static CpuRuntime cpu;
  static std::array<DeviceRuntime*, kDeviceTypes> all = [] {
    std::array<DeviceRuntime*, kDeviceTypes> a{};
    a[static_cast<size_t>(DeviceType::CPU)] = &cpu;
    return a;
  }();
  return all;
}

}  // namespace

namespace {
[[noreturn]] void no_graphs(const Stream& stream) {
  fail("[device] ", stream.device().str(), ": this device's streams cannot be captured in a graph");
}
}  // namespace

void DeviceRuntime::begin_capture(Stream& stream) { no_graphs(stream); }

std::shared_ptr<void> DeviceRuntime::end_capture(Stream& stream) { no_graphs(stream); }

void DeviceRuntime::launch_graph(const std::shared_ptr<void>&, Stream& stream) { no_graphs(stream); }

void register_device_runtime(DeviceType type, DeviceRuntime& runtime) {
  const auto t = static_cast<size_t>(type);
  HSPMD_CHECK(t < kDeviceTypes, "register_device_runtime: unknown device type");
  runtimes()[t] = &runtime;
}

DeviceRuntime* device_runtime(DeviceType type) {
  const auto t = static_cast<size_t>(type);
  return t < kDeviceTypes ? runtimes()[t] : nullptr;
}

}  // namespace hspmd
