// Memory helpers the Python side calls through the module (custom_ops/isa.py): the
// huge-page allocator for packed weights and KV caches, and the bandwidth probe that
// benchmarks pair with kernel measurements.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <vector>

#include "kernels.h"
#include "ops.h"

namespace tilefx {

// Streaming-read bandwidth over `buffer`, GB/s, one pass: every thread reads a
// contiguous slice as `streams` (1 or 2) sequential streams, with the loads the kernels use.
double stream_read_gbps(const at::Tensor& buffer, int64_t streams) {
  TORCH_CHECK(buffer.is_contiguous(), "stream_read_gbps: buffer must be contiguous");
  TORCH_CHECK(streams == 1 || streams == 2, "stream_read_gbps: streams must be 1 or 2");
  const int64_t chunk = 128 * streams;
  const int64_t chunks = buffer.nbytes() / chunk;
  const char* data = static_cast<const char*>(buffer.data_ptr());
  std::atomic<float> sink{0.0f};
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t stop) {
    sink = sink + stream_read_avx2(data + begin * chunk, (stop - begin) * chunk, static_cast<int>(streams));
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return chunks * chunk / seconds / 1e9;
}

// An uninitialized tensor in 2 MiB-aligned memory advised to be backed by transparent
// huge pages. Decode streams every packed weight once per token: with 4 KiB pages that
// is one TLB miss per 4 KiB, and a page walk whose entries other traffic (a long KV
// cache) evicts from the caches; measured here, huge pages made decode ~15% faster.
at::Tensor huge_page_empty(const std::vector<int64_t>& sizes, at::ScalarType dtype) {
  constexpr size_t kHugePage = size_t{2} << 20;
  int64_t numel = 1;
  for (int64_t size : sizes) numel *= size;
  const size_t bytes = std::max<size_t>(1, numel * c10::elementSize(dtype));
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* data = std::aligned_alloc(kHugePage, rounded);
  TORCH_CHECK(data != nullptr, "tilefx: out of memory allocating ", rounded, " bytes");
  madvise(data, rounded, MADV_HUGEPAGE);  // advice only: without THP the memory is ordinary pages
  return torch::from_blob(data, sizes, [](void* p) { std::free(p); }, at::TensorOptions().dtype(dtype));
}

}  // namespace tilefx
