// Freed device or host blocks kept by their (rounded) size for reuse: the
// cache behind the CPU and CUDA caching allocators (internal to core).
// Thread-safe.
#pragma once

#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace hspmd {

class BlockCache {
 public:
  // A cached block of exactly `size` bytes (removed from the cache), or nullptr.
  void* take(size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(size);
    if (it == blocks_.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    return p;
  }
  void put(size_t size, void* block) {
    std::lock_guard<std::mutex> lock(mu_);
    blocks_[size].push_back(block);
  }
  // Hands every cached block to `release` and empties the cache.
  template <typename F>
  void drain(F&& release) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [size, list] : blocks_)
      for (void* p : list) release(p);
    blocks_.clear();
  }

 private:
  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> blocks_;
};

}  // namespace hspmd
