// Threading for the native ops (included by the *_ops.cpp files and moe.cpp, never by the ISA units).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace tilefx {

// Runs fn(begin, end) over [0, units) in chunks that the threads take one at a time.
// at::parallel_for splits a range evenly up front, so an op lasts as long as its
// slowest thread: on a shared machine a core that another tenant slows down holds
// up the whole op. Taken on demand, that core simply does fewer chunks. Chunks are
// contiguous, so each still streams its weights front to back, and they shrink as
// the range runs out (each takes a quarter of what is left, for 2 threads): the
// first are long, and the last, which set how long one thread waits for the other
// at the end, are `min_chunk` units: the threads finish closer together than with fixed
// chunks (docs/PERFORMANCE.md). A chunk is at least `min_chunk` units (the M=1 GEMV may
// read blocks in pairs, as two streams).
template <typename F>
void parallel_chunks(int64_t units, int64_t min_chunk, const F& fn) {
  if (units <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), units);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < units) {
      const int64_t left = units - begin;
      const int64_t size = std::min(left, std::max<int64_t>(min_chunk, left / (2 * threads)));
      if (next.compare_exchange_weak(begin, begin + size, std::memory_order_relaxed)) {
        fn(begin, begin + size);
        begin = next.load(std::memory_order_relaxed);
      }  // else `begin` now holds the chunk another thread left
    }
  });
}

}  // namespace tilefx
