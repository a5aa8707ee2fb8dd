// Threading for the native ops (included by ops.cpp and moe.cpp, never by the ISA units).
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
// contiguous, so each still streams its weights front to back. The work left for
// the last chunk bounds the imbalance: about 1/8 of a thread's share. A chunk is at
// least `min_chunk` units (the M=1 GEMV reads blocks in pairs, as two streams).
template <typename F>
void parallel_chunks(int64_t units, int64_t min_chunk, const F& fn) {
  if (units <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), units);
  const int64_t chunk = std::max<int64_t>(min_chunk, units / (8 * threads));
  const int64_t chunks = (units + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next++; c < chunks; c = next++) fn(c * chunk, std::min(units, (c + 1) * chunk));
  });
}

}  // namespace tilefx
