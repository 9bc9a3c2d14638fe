// Devices and their allocators.
//
// A Device names where memory lives and kernels run. Only the CPU backend is
// built today; a CUDA device (with streams) slots in behind the same
// Allocator interface and the kernel dispatch in src/kernels/, without any
// change to op files.
#pragma once

#include <atomic>
#include <cstddef>
#include <string>

namespace hspmd {

enum class DeviceType : uint8_t { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static Device cpu() { return {DeviceType::CPU, 0}; }
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

}  // namespace hspmd
