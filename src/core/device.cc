#include "hspmd/core/device.h"

#include <cstdlib>
#include <new>

#include "hspmd/core/error.h"

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

// 64-byte aligned host memory (one cache line, one AVX-512 vector).
class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
    if (p == nullptr) fail("[cpu] out of memory allocating ", bytes, " bytes");
    account_alloc(bytes);
    return p;
  }
  void deallocate(void* ptr, size_t bytes) override {
    std::free(ptr);
    account_free(bytes);
  }
};

}  // namespace

Allocator& allocator_for(Device device) {
  static CpuAllocator cpu;
  if (device.type == DeviceType::CPU) return cpu;
  fail("[device] ", device.str(), ": this build has no CUDA backend");
}

}  // namespace hspmd
