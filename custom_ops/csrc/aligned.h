// Storage aligned to a cache line, for what oneDNN's brgemm reads and writes from tilefx's own
// buffers (dequantized panels, result tiles, packed keys and values, copies of x). An AMX tile
// row is one 64-byte line; glibc's malloc aligns large blocks to 16 bytes, so in a plain
// std::vector every tile row straddles two lines and costs two loads.
#pragma once
#include <cstddef>
#include <new>
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

}  // namespace tilefx
