// Memory helpers the Python side calls through the module (custom_ops/isa.py): the
// huge-page allocator for packed weights and KV caches, the bandwidth probe that
// benchmarks pair with kernel measurements, and the copy that packs a weight's rows.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "layout.h"
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
// cache) evicts from the caches (docs/PERFORMANCE.md has what huge pages save).
at::Tensor huge_page_empty(const std::vector<int64_t>& sizes, at::ScalarType dtype) {
  constexpr size_t kHugePage = size_t{2} << 20;
  int64_t numel = 1;
  for (int64_t size : sizes) numel *= size;
  const size_t bytes = std::max<size_t>(1, numel * c10::elementSize(dtype));
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* data = std::aligned_alloc(kHugePage, rounded);
  TORCH_CHECK(data != nullptr, "tilefx: out of memory allocating ", rounded, " bytes");
  madvise(data, rounded, MADV_HUGEPAGE);  // advice only: without THP the memory is ordinary pages
  // The last 2 MiB, where the tensor ends inside it, in ordinary pages: as a huge page the whole of it
  // would be resident, up to 2 MiB that hold nothing (an eighth of an int8 layer of a 1.5B model).
  if (const size_t whole = bytes / kHugePage * kHugePage; whole != rounded) {
    madvise(static_cast<char*>(data) + whole, kHugePage, MADV_NOHUGEPAGE);
  }
  return torch::from_blob(data, sizes, [](void* p) { std::free(p); }, at::TensorOptions().dtype(dtype));
}

// out[b] = rows 32b .. 32b+31 of `weight` [n, k] in the packed (VNNI) order [k/2 pairs][32 rows][2],
// zero where the rows or the last pair run past the weight. Loading packs every weight once: a
// torch copy of a permuted view gathers element by element; here each block reads 32 rows a
// cache line at a time and writes its pairs in order, on every thread. `out` is [blocks, pairs, 32, 2]
// with each block contiguous (blocks may be strided: gate/up interleave theirs).
void pack_vnni_blocks(at::Tensor& out, const at::Tensor& weight) {
  TORCH_CHECK(is_packing(out, 0), "pack_vnni_blocks: out must be [blocks, pairs, ",
              kBlockN, ", 2], got ", out.sizes());
  TORCH_CHECK(out.stride(3) == 1 && out.stride(2) == 2 && out.stride(1) == kPairValues,
              "pack_vnni_blocks: each block of out must be contiguous");
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1, "pack_vnni_blocks: weight must be 2-D with contiguous rows");
  TORCH_CHECK(out.element_size() == 2 && weight.scalar_type() == out.scalar_type(),
              "pack_vnni_blocks: weight and out must share a 16-bit dtype");
  const int64_t blocks = packed_blocks(out), pairs = packed_pairs(out), n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(blocks_of(n) <= blocks && pairs_of(k) <= pairs, "pack_vnni_blocks: weight ", weight.sizes(),
              " does not fit ", out.sizes());
  const auto* src = static_cast<const uint16_t*>(weight.data_ptr());
  auto* dst = static_cast<uint16_t*>(out.data_ptr());
  const int64_t row_stride = weight.stride(0), block_stride = out.stride(0), whole_pairs = k / 2;
  constexpr int64_t kTile = 16;  // pairs per row read at a time: one 64-byte cache line
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      auto* block = reinterpret_cast<uint32_t*>(dst + b * block_stride);
      const int64_t rows = std::clamp<int64_t>(n - b * kBlockN, 0, kBlockN);
      for (int64_t p0 = 0; p0 < pairs; p0 += kTile) {
        const int64_t p1 = std::min(pairs, p0 + kTile);
        for (int64_t j = 0; j < kBlockN; ++j) {
          const uint16_t* row = src + (b * kBlockN + j) * row_stride;
          for (int64_t p = p0; p < p1; ++p) {
            uint32_t pair = 0;
            if (j < rows && p < whole_pairs) {
              std::memcpy(&pair, row + 2 * p, sizeof(pair));
            } else if (j < rows && 2 * p < k) {
              pair = row[2 * p];  // k odd: the last pair's second value is padding
            }
            block[p * kBlockN + j] = pair;
          }
        }
      }
    }
  });
}

}  // namespace tilefx
