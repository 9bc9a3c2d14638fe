// Freed device or host blocks kept by their (rounded) size for reuse: the
// cache behind the CPU and CUDA caching allocators (internal to core).
// Thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "hspmd/core/device.h"
#include "hspmd/core/error.h"

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
  // Hands every cached block to `each(size, block)` and empties the cache.
  template <typename F>
  void drain_sized(F&& each) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [size, list] : blocks_)
      for (void* p : list) each(size, p);
    blocks_.clear();
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

// An Allocator that rounds sizes up to a multiple of `granule`, keeps freed
// blocks by that size for reuse, and when the backend cannot allocate,
// releases the cache and tries once more before out_of_memory(). The CPU,
// CUDA and pinned-host allocators differ only in the backend calls.
class CachingAllocator : public Allocator {
 public:
  explicit CachingAllocator(size_t granule) : granule_(granule) {}

  // A block allocated under a SideStreamScope is a side block for good:
  // whoever frees it, it goes back to the side cache, which only such
  // threads take from. (A side thread orders its stream after the others'
  // work before it writes a block — the overlap's events — so a side block
  // another thread freed is safe for it; the other threads never get one.)
  void* allocate(size_t bytes) override {
    const size_t rounded = round(bytes);
    const bool side = SideStreamScope::current() != nullptr;
    Pool* pool = t_pool != nullptr && t_pool->owner == this ? t_pool : nullptr;
    void* p = pool != nullptr ? pool->free.take(rounded) : nullptr;
    if (p == nullptr) p = (side ? side_ : cache_).take(rounded);
    if (p == nullptr) p = backend_allocate(rounded);
    if (p == nullptr) {
      release_cache();  // what the cache holds may be enough
      p = backend_allocate(rounded);
    }
    if (p == nullptr) out_of_memory(bytes);
    if (side) {
      std::lock_guard<std::mutex> lock(side_mu_);
      side_blocks_.insert(p);
    }
    if (pool != nullptr) {
      std::lock_guard<std::mutex> lock(side_mu_);
      pool_blocks_[p] = pool->self;
    }
    account_alloc(bytes);
    return p;
  }
  void deallocate(void* ptr, size_t bytes) override {
    bool side_block = false;
    std::shared_ptr<Pool> pool;
    {
      std::lock_guard<std::mutex> lock(side_mu_);
      side_block = side_blocks_.count(ptr) > 0;
      if (auto it = pool_blocks_.find(ptr); it != pool_blocks_.end()) {
        pool = it->second.lock();
        if (pool == nullptr) pool_blocks_.erase(it);  // its pool is gone: the cache's again
      }
    }
    auto give_back = [this, ptr, bytes, side_block, pool] {
      account_free(bytes);
      if (pool != nullptr) return pool->free.put(round(bytes), ptr);
      (side_block ? side_ : cache_).put(round(bytes), ptr);
    };
    if (SideStreamScope* side = SideStreamScope::current()) {  // its stream may still use it
      side->hold(give_back);
      return;
    }
    give_back();
  }

  std::shared_ptr<void> new_pool() override {
    auto pool = std::make_shared<Pool>();
    pool->owner = this;
    pool->self = pool;
    // The handle: when its last copy goes, the pool's free blocks return to
    // the cache (the allocators live as long as the process).
    return std::shared_ptr<void>(pool.get(), [this, pool](void*) mutable {
      {
        std::lock_guard<std::mutex> lock(side_mu_);
        pool->free.drain_sized([this](size_t size, void* p) {
          pool_blocks_.erase(p);
          cache_.put(size, p);
        });
        if (t_pool == pool.get()) t_pool = nullptr;
      }
      pool.reset();
    });
  }
  void use_pool(const std::shared_ptr<void>& handle) override {
    auto* pool = static_cast<Pool*>(handle.get());
    HSPMD_CHECK(pool == nullptr || pool->owner == this, "Allocator::use_pool: a pool of another allocator");
    t_pool = pool;
  }

 protected:
  // A new block of `bytes` (a multiple of the granule), or nullptr.
  virtual void* backend_allocate(size_t bytes) = 0;
  virtual void backend_free(void* ptr) = 0;
  // Throws hspmd::Error naming the request (the backend's last reason).
  [[noreturn]] virtual void out_of_memory(size_t bytes) = 0;
  // Derived destructors call it while their backend still works.
  void release_cache() {
    cache_.drain([this](void* p) { backend_free(p); });
    side_.drain([this](void* p) {
      {
        std::lock_guard<std::mutex> lock(side_mu_);
        side_blocks_.erase(p);
      }
      backend_free(p);
    });
  }

 private:
  struct Pool {
    const CachingAllocator* owner = nullptr;
    BlockCache free;
    std::weak_ptr<Pool> self;  // what its blocks' entries hold
  };
  inline static thread_local Pool* t_pool = nullptr;  // the calling thread's (use_pool)

  size_t round(size_t bytes) const { return bytes == 0 ? granule_ : (bytes + granule_ - 1) / granule_ * granule_; }
  size_t granule_;
  BlockCache cache_;
  BlockCache side_;  // blocks of threads on a stream of their own (SideStreamScope)
  std::mutex side_mu_;
  std::unordered_set<void*> side_blocks_;  // every side block, cached or in use
  std::unordered_map<void*, std::weak_ptr<Pool>> pool_blocks_;  // every pool's block, cached or in use (side_mu_)
};

}  // namespace hspmd
