// Storage aligned to a cache line, for what oneDNN's brgemm reads and writes from tilefx's own
// buffers (dequantized panels, result tiles, packed keys and values, copies of x). An AMX tile
// row is one 64-byte line; glibc's malloc aligns large blocks to 16 bytes, so in a plain
// std::vector every tile row straddles two lines and costs two loads.
#pragma once
#include <c10/core/CPUAllocator.h>

#include <cstddef>
#include <new>
#include <utility>
#include <vector>

namespace tilefx {

constexpr std::size_t kCacheLine = 64;

template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kCacheLine}));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{kCacheLine}); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
};

template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

// The same whose resize leaves new elements uninitialized (default-initialized), for a buffer every
// element of which is written before it is read: the prefill attention's packed keys and values,
// ~40 MB a layer for a 4096-token DeepSeek prompt, where zeroing them first cost as much again as
// packing them.
//
// Its storage comes from PyTorch's CPU allocator (64-byte aligned), so that while a forward holds the
// recycler (recycling.cpp) these buffers, the largest a prefill makes (fused_moe's routed rows: 100 MB a
// layer at 4096 tokens of DeepSeek-V2-Lite), are reused from layer to layer like the ops' outputs.
template <class T>
struct UninitializedCacheLineAllocator {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = UninitializedCacheLineAllocator<U>;
  };
  UninitializedCacheLineAllocator() = default;
  template <class U>
  UninitializedCacheLineAllocator(const UninitializedCacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) {
    static_assert(alignof(T) <= kCacheLine);
    return static_cast<T*>(c10::GetCPUAllocator()->raw_allocate(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t) { c10::GetCPUAllocator()->raw_deallocate(p); }
  template <class U>
  bool operator==(const UninitializedCacheLineAllocator<U>&) const { return true; }
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <class T>
using UninitializedAlignedVector = std::vector<T, UninitializedCacheLineAllocator<T>>;

}  // namespace tilefx
