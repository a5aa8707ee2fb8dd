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

#include "bf16_scalar.h"
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
// cache line at a time and writes its pairs in order, on every thread. `Value` is a 16-bit
// value (bf16) or a byte (int8, fp8: a quantized weight's values), `Pair` two of them.
template <typename Value, typename Pair>
static void pack_pairs(Pair* dst, const Value* src, int64_t n, int64_t k, int64_t row_stride, int64_t blocks,
                       int64_t pairs, int64_t block_stride) {
  static_assert(sizeof(Pair) == 2 * sizeof(Value));
  constexpr int64_t kTile = 64 / sizeof(Pair);  // pairs per row read at a time: one 64-byte cache line
  const int64_t whole_pairs = k / 2;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      Pair* block = dst + b * block_stride;
      const int64_t rows = std::clamp<int64_t>(n - b * kBlockN, 0, kBlockN);
      for (int64_t p0 = 0; p0 < pairs; p0 += kTile) {
        const int64_t p1 = std::min(pairs, p0 + kTile);
        for (int64_t j = 0; j < kBlockN; ++j) {
          const Value* row = src + (b * kBlockN + j) * row_stride;
          for (int64_t p = p0; p < p1; ++p) {
            Pair pair = 0;
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

// `out` is [blocks, pairs, 32, 2] with each block contiguous (blocks may be strided: gate/up
// interleave theirs), of the weight's dtype, 16-bit or 8-bit.
void pack_vnni_blocks(at::Tensor& out, const at::Tensor& weight) {
  // (not is_packing: that reads uint8 as int4's half-width packing; here bytes are int8 or fp8 values)
  TORCH_CHECK(out.dim() == 4 && out.size(2) == kBlockN && out.size(3) == 2, "pack_vnni_blocks: out must be [blocks, pairs, ",
              kBlockN, ", 2], got ", out.sizes());
  TORCH_CHECK(out.stride(3) == 1 && out.stride(2) == 2 && out.stride(1) == kPairValues,
              "pack_vnni_blocks: each block of out must be contiguous");
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1, "pack_vnni_blocks: weight must be 2-D with contiguous rows");
  TORCH_CHECK((out.element_size() == 2 || out.element_size() == 1) && weight.scalar_type() == out.scalar_type(),
              "pack_vnni_blocks: weight and out must share a 16-bit or 8-bit dtype, got ", weight.scalar_type(),
              " and ", out.scalar_type());
  const int64_t blocks = packed_blocks(out), pairs = packed_pairs(out), n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(blocks_of(n) <= blocks && pairs_of(k) <= pairs, "pack_vnni_blocks: weight ", weight.sizes(),
              " does not fit ", out.sizes());
  // (strides in values, and a pair is two: the block stride in pairs is half of it)
  if (out.element_size() == 2) {
    pack_pairs(static_cast<uint32_t*>(out.data_ptr()), static_cast<const uint16_t*>(weight.data_ptr()), n, k,
               weight.stride(0), blocks, pairs, out.stride(0) / 2);
  } else {
    pack_pairs(static_cast<uint16_t*>(out.data_ptr()), static_cast<const uint8_t*>(weight.data_ptr()), n, k,
               weight.stride(0), blocks, pairs, out.stride(0) / 2);
  }
}

// values[r] = round(weight[r] / scales[r]) in [-127, 127], scales[r] = max |weight[r]| / 127 (1 for a zero row):
// formats.quantize_rows' int8, bit for bit (an fp32 division, then rounding to nearest even), in one pass a row at a
// time on every thread; torch's ops made five passes over an fp32 copy (0.3 GB/s of bf16: most of a warm start
// of an int8 model, docs/PERFORMANCE.md). Plain loops the compiler vectorizes on any x86-64.
void quantize_rows_int8(const at::Tensor& weight, at::Tensor& values, at::Tensor& scales) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.stride(1) == 1,
              "quantize_rows_int8: weight must be 2-D bf16 with contiguous rows, got ", weight.scalar_type(), " ",
              weight.sizes());
  TORCH_CHECK(values.scalar_type() == at::kChar && values.sizes() == weight.sizes() && values.is_contiguous(),
              "quantize_rows_int8: values must be a contiguous int8 tensor of the weight's shape");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.size(0) == weight.size(0) &&
              scales.is_contiguous(), "quantize_rows_int8: scales must be fp32 [rows]");
  const int64_t n = weight.size(0), k = weight.size(1), stride = weight.stride(0);
  const auto* src = static_cast<const uint16_t*>(weight.data_ptr());
  auto* dst = values.data_ptr<int8_t>();
  float* row_scales = scales.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const uint16_t* row = src + r * stride;
      uint16_t top = 0;  // the largest magnitude's bits: a finite bf16's magnitudes order as their bits do
      for (int64_t j = 0; j < k; ++j) top = std::max<uint16_t>(top, row[j] & 0x7FFF);
      float scale = bf16_to_float(top) / 127.0f;
      if (!(scale > 0.0f)) scale = 1.0f;
      row_scales[r] = scale;
      int8_t* out = dst + r * k;
      for (int64_t j = 0; j < k; ++j) {
        constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds |q| < 2^22 to an integer, ties to even
        const float q = (bf16_to_float(row[j]) / scale + kRound) - kRound;
        out[j] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
      }
    }
  });
}

}  // namespace tilefx
