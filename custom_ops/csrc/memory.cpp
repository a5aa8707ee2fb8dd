// Memory helpers the Python side calls through the module (custom_ops/isa.py): the
// huge-page allocator for packed weights and KV caches, the bandwidth probe that
// benchmarks pair with kernel measurements, and the copy that packs a weight's rows.
#include <ATen/Parallel.h>
#include <ATen/ATen.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
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
  return at::from_blob(data, sizes, [](void* p) { std::free(p); }, at::TensorOptions().dtype(dtype));
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

// Drop from this process the pages of every file mapping whose path ends with `suffix` (a lazy load's safetensors
// files), except pages holding a byte of a `keep` range [begin, end): they stay in the page cache, and a later read
// maps them again. Returns the bytes advised.
// It runs with the GIL held (a pybind function that never releases it), and that is what makes it safe to call from
// a background thread: a file mapping is unmapped only when Python drops its last reference (a safetensors handle
// or a tensor over it), which needs the GIL, so no mapping read from /proc/self/maps here can be unmapped, and its
// addresses reused by other memory, before it is advised. MADV_DONTNEED on anonymous memory would zero it: a sweep
// in Python, which releases the GIL while it reads the maps and calls madvise, could zero an allocation that took
// a just-closed file's addresses (a 30B GPTQ load aborted with "free(): invalid pointer", the mark of malloc's own
// header zeroed; test_weights' stress test saw buffers zeroed a few times a second).
int64_t drop_file_mapping_pages(const std::string& suffix, std::vector<std::pair<int64_t, int64_t>> keep) {
  const int64_t page = sysconf(_SC_PAGESIZE);
  std::sort(keep.begin(), keep.end());
  std::ifstream maps("/proc/self/maps");
  TORCH_CHECK(maps, "tilefx: cannot read /proc/self/maps");
  int64_t dropped = 0;
  auto advise = [&](int64_t first, int64_t last) {  // whole pages in [first, last)
    first = (first + page - 1) / page * page;
    last = last / page * page;
    if (last > first && madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED) == 0) {
      dropped += last - first;
    }
  };
  for (std::string line; std::getline(maps, line);) {
    // "begin-end perms offset dev inode    path": the path is what follows the fifth field
    std::istringstream fields(line);
    std::string range, perms, offset, device, inode, path;
    fields >> range >> perms >> offset >> device >> inode;
    std::getline(fields >> std::ws, path);
    if (path.size() < suffix.size() || path.compare(path.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    const size_t dash = range.find('-');
    const int64_t lo = std::stoll(range.substr(0, dash), nullptr, 16);
    const int64_t hi = std::stoll(range.substr(dash + 1), nullptr, 16);
    int64_t start = lo;
    for (const auto& [begin, end] : keep) {  // the pages wholly between kept ranges
      if (end <= lo || begin >= hi) continue;
      advise(start, begin);
      start = std::max(start, end);  // (advise rounds it up: the page holding `end - 1` is kept)
    }
    advise(start, hi);
  }
  return dropped;
}

// out[b] = rows 32b .. 32b+31 of int4 values in the int4 packing's order (kernels.h, layouts.int4_interleave): per
// two K pairs t (inputs 4t .. 4t+3), 16 lanes of 4 bytes, byte j of lane l holding input 4t + j of row l in its
// low nibble and of row l + 16 in its high one; zero past the rows and K. The values are nibbles one a byte
// ([n, k], what the quantizer writes), two a byte ([n, k / 2], even input low: formats.pair_nibbles), or two a byte
// as 32-bit words of 8 inputs ([n, k / 8, 4], any row and word strides: a GPTQ checkpoint's qweight [K / 8, N] read
// in place from its file, models/int4.py). Every thread; one block's rows are read once.
void pack_int4_blocks(at::Tensor& out, const at::Tensor& values, bool two_a_byte) {
  constexpr int64_t kLanes = kBlockN / 2;
  TORCH_CHECK(out.scalar_type() == at::kByte && out.dim() == 4 && out.size(2) == kLanes && out.size(3) == 2 &&
                  out.size(1) % 2 == 0,
              "pack_int4_blocks: out must be uint8 [blocks, pairs (even), ", kLanes, ", 2], got ", out.scalar_type(),
              " ", out.sizes());
  TORCH_CHECK(out.stride(3) == 1 && out.stride(2) == 2 && out.stride(1) == kBlockN,
              "pack_int4_blocks: each block of out must be contiguous");
  const bool words_given = values.dim() == 3;
  TORCH_CHECK(values.scalar_type() == at::kByte && values.stride(-1) == 1 &&
                  (values.dim() == 2 || (words_given && two_a_byte && values.size(2) == 4)),
              "pack_int4_blocks: values must be uint8 [n, k] (two a byte: [n, k / 2] or words [n, k / 8, 4]) with "
              "contiguous bytes, got ", values.scalar_type(), " ", values.sizes());
  const int64_t blocks = out.size(0), groups = out.size(1) / 2, n = values.size(0);
  const int64_t k = words_given ? 8 * values.size(1) : two_a_byte ? 2 * values.size(1) : values.size(1);
  const int64_t row_stride = values.stride(0);
  const int64_t word_stride = words_given ? values.stride(1) : 4;  // bytes from one 8 (two a byte) inputs to the next
  TORCH_CHECK(blocks_of(n) <= blocks && (k + 3) / 4 <= groups, "pack_int4_blocks: values of ", n, " rows x ", k,
              " inputs do not fit ", out.sizes());
  const int64_t block_stride = out.stride(0), whole = k / 4;  // groups of 4 inputs with no padding
  const auto* src = values.data_ptr<uint8_t>();
  auto* dst = out.data_ptr<uint8_t>();
  // lane words of one row pair: word t holds inputs 4t .. 4t+3 of the low row (low nibbles) and the high row (high
  // nibbles), byte j input 4t + j. The loops over whole groups are branch free, so the compiler vectorizes them
  // (rows of contiguous bytes: the stride a constant).
  auto spread = [](uint32_t paired) {  // two a byte -> one a byte: nibble i into byte i
    return (paired & 0xFu) | ((paired & 0xF0u) << 4) | ((paired & 0xF00u) << 8) | ((paired & 0xF000u) << 12);
  };
  auto paired_words = [&](uint32_t* words, const uint8_t* low, const uint8_t* top, auto stride) {
    for (int64_t t = 0; t < whole; ++t) {  // 4 inputs: half a word of 8
      const int64_t at = (t >> 1) * stride + (t & 1) * 2;
      uint16_t a, b;
      std::memcpy(&a, low + at, 2);
      std::memcpy(&b, top + at, 2);
      words[t] = spread(a) | (spread(b) << 4);
    }
  };
  auto lane_words = [&](uint32_t* words, const uint8_t* low, const uint8_t* high) {
    if (low == nullptr) {  // padding rows (high is then padding too)
      std::fill(words, words + groups, 0u);
      return;
    }
    const uint8_t* top = high != nullptr ? high : low;  // a padding high row: read as the low one, masked below
    if (two_a_byte && word_stride == 4) {
      paired_words(words, low, top, std::integral_constant<int64_t, 4>());
    } else if (two_a_byte) {
      paired_words(words, low, top, word_stride);
    } else {
      for (int64_t t = 0; t < whole; ++t) {
        uint32_t a, b;
        std::memcpy(&a, low + 4 * t, 4);
        std::memcpy(&b, top + 4 * t, 4);
        words[t] = a | (b << 4);
      }
    }
    if (high == nullptr) {
      for (int64_t t = 0; t < whole; ++t) words[t] &= 0x0F0F0F0Fu;  // the high row is padding: zero nibbles
    }
    for (int64_t t = whole; t < groups; ++t) {  // the inputs past the last whole four, zero past K
      uint32_t q = 0;
      for (int64_t j = 0; j < 4 && 4 * t + j < k; ++j) {
        const int64_t c = 4 * t + j;
        auto nibble = [&](const uint8_t* row) {
          if (!two_a_byte) return static_cast<int>(row[c]);
          const int64_t byte = c / 2;
          return (row[(byte / 4) * word_stride + byte % 4] >> (4 * (c % 2))) & 0xF;
        };
        q |= static_cast<uint32_t>(nibble(low) | (high != nullptr ? nibble(high) << 4 : 0)) << (8 * j);
      }
      words[t] = q;
    }
  };
  // A whole block of a GPTQ file's words: its 32 rows' words of 8 inputs lie side by side (row stride 4 bytes), so
  // the lanes of inputs 8w .. 8w+3 (even t) and 8w+4 .. 8w+7 (odd t) are one vector op over them each.
  auto block_from_words = [&](uint8_t* block, const uint8_t* rows) {
    for (int64_t w = 0; w < k / 8; ++w) {
      uint32_t low[kLanes], high[kLanes], even[kLanes], odd[kLanes];
      std::memcpy(low, rows + w * word_stride, sizeof low);
      std::memcpy(high, rows + w * word_stride + sizeof low, sizeof high);
      for (int64_t l = 0; l < kLanes; ++l) {
        even[l] = spread(low[l] & 0xFFFFu) | (spread(high[l] & 0xFFFFu) << 4);
        odd[l] = spread(low[l] >> 16) | (spread(high[l] >> 16) << 4);
      }
      std::memcpy(block + 2 * w * sizeof even, even, sizeof even);
      std::memcpy(block + (2 * w + 1) * sizeof even, odd, sizeof odd);
    }
    std::fill(block + k / 4 * sizeof(uint32_t) * kLanes, block + groups * sizeof(uint32_t) * kLanes, 0);  // past K
  };
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    std::vector<uint32_t> words(kLanes * groups);  // [lane][t]: one block's words before they are interleaved
    for (int64_t b = first; b < last; ++b) {
      const int64_t rows = std::clamp<int64_t>(n - b * kBlockN, 0, kBlockN);
      if (words_given && row_stride == 4 && rows == kBlockN) {
        block_from_words(dst + b * block_stride, src + b * kBlockN * row_stride);
        continue;
      }
      for (int64_t l = 0; l < kLanes; ++l) {
        lane_words(words.data() + l * groups, l < rows ? src + (b * kBlockN + l) * row_stride : nullptr,
                   l + kLanes < rows ? src + (b * kBlockN + l + kLanes) * row_stride : nullptr);
      }
      uint8_t* block = dst + b * block_stride;  // [t][lane] words
      for (int64_t t = 0; t < groups; ++t) {
        for (int64_t l = 0; l < kLanes; ++l) std::memcpy(block + (t * kLanes + l) * 4, &words[l * groups + t], 4);
      }
    }
  });
}

// An AWQ checkpoint's qweight (int32 [K, N / 8]: word c of input k holds outputs 8c .. 8c+7, output order[i] in
// nibble i) as nibbles two a byte [N, K / 2] (input 2j in byte j's low nibble, 2j + 1 in its high one:
// formats.pair_nibbles), what the int4 packing copies. The words hold outputs along a row and the packing wants
// them along a column: a transpose of nibbles, which torch's ops make in several passes (0.16 GB/s). Here each
// thread takes 16 words of columns (128 outputs) and walks K, reading a cache line of each row.
at::Tensor awq_paired_nibbles(const at::Tensor& qweight, const std::vector<int64_t>& order) {
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.size(0) % 2 == 0,
              "awq_paired_nibbles: qweight must be contiguous int32 [K (even), N / 8], got ", qweight.scalar_type(), " ",
              qweight.sizes());
  int shift[8] = {-1, -1, -1, -1, -1, -1, -1, -1};  // output 8c + p is in bits shift[p] .. shift[p] + 3
  TORCH_CHECK(order.size() == 8, "awq_paired_nibbles: order must be a permutation of 0..7");
  for (int i = 0; i < 8; ++i) {
    TORCH_CHECK(order[i] >= 0 && order[i] < 8 && shift[order[i]] < 0,
                "awq_paired_nibbles: order must be a permutation of 0..7");
    shift[order[i]] = 4 * i;
  }
  constexpr int64_t kTileWords = 16;
  const int64_t k = qweight.size(0), words = qweight.size(1), pairs = k / 2;
  at::Tensor out = at::empty({8 * words, pairs}, qweight.options().dtype(at::kByte));
  const auto* src = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>());
  auto* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, (words + kTileWords - 1) / kTileWords, 1, [&](int64_t first, int64_t last) {
    for (int64_t tile = first; tile < last; ++tile) {
      const int64_t c0 = tile * kTileWords, c1 = std::min(words, c0 + kTileWords);
      for (int64_t j = 0; j < pairs; ++j) {
        const uint32_t* low = src + 2 * j * words;  // input 2j's words; input 2j + 1's follow
        const uint32_t* high = low + words;
        for (int64_t c = c0; c < c1; ++c) {
          const uint32_t even = low[c], odd = high[c];
          for (int p = 0; p < 8; ++p) {
            dst[(8 * c + p) * pairs + j] =
                static_cast<uint8_t>(((even >> shift[p]) & 0xFu) | (((odd >> shift[p]) & 0xFu) << 4));
          }
        }
      }
    }
  });
  return out;
}

namespace {

constexpr float kRoundToEven = 12582912.0f;  // 1.5 * 2^23: (q + it) - it rounds |q| < 2^22 to an integer, ties to even

// The largest magnitude of `count` bf16 values, as fp32: a finite bf16's magnitudes order as their bits do.
inline float largest_magnitude(const uint16_t* values, int64_t count) {
  uint16_t top = 0;
  for (int64_t j = 0; j < count; ++j) top = std::max<uint16_t>(top, values[j] & 0x7FFF);
  return bf16_to_float(top);
}

void check_quantizing(const at::Tensor& weight, const at::Tensor& values, at::ScalarType dtype, const char* op) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.stride(1) == 1, op,
              ": weight must be 2-D bf16 with contiguous rows, got ", weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(values.scalar_type() == dtype && values.sizes() == weight.sizes() && values.is_contiguous(), op,
              ": values must be a contiguous ", dtype, " tensor of the weight's shape");
}

}  // namespace

// values[r] = round(weight[r] / scales[r]) in [-127, 127], scales[r] = max |weight[r]| / 127 (1 for a zero row):
// formats.quantize_rows' int8, bit for bit (an fp32 division, then rounding to nearest even), in one pass a row at a
// time on every thread; torch's ops made five passes over an fp32 copy (0.3 GB/s of bf16: most of a warm start
// of an int8 model, docs/PERFORMANCE.md). Plain loops, built for any x86-64.
void quantize_rows_int8(const at::Tensor& weight, at::Tensor& values, at::Tensor& scales) {
  check_quantizing(weight, values, at::kChar, "quantize_rows_int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.size(0) == weight.size(0) &&
              scales.is_contiguous(), "quantize_rows_int8: scales must be fp32 [rows]");
  const int64_t n = weight.size(0), k = weight.size(1), stride = weight.stride(0);
  const auto* src = static_cast<const uint16_t*>(weight.data_ptr());
  auto* dst = values.data_ptr<int8_t>();
  float* row_scales = scales.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const uint16_t* row = src + r * stride;
      float scale = largest_magnitude(row, k) / 127.0f;
      if (!(scale > 0.0f)) scale = 1.0f;
      row_scales[r] = scale;
      int8_t* out = dst + r * k;
      for (int64_t j = 0; j < k; ++j) {
        const float q = (bf16_to_float(row[j]) / scale + kRoundToEven) - kRoundToEven;
        out[j] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
      }
    }
  });
}

// formats.quantize_rows' fp8, bit for bit: per 128 x 128 block scale = max |w| / 448 (1 for a zero block),
// values = clamp(w / scale, +-448) rounded to e4m3 (c10's conversion, the one torch's .to() runs). One pass a
// 128-row group at a time; torch's ops made several over an fp32 copy.
void quantize_blocks_fp8(const at::Tensor& weight, at::Tensor& values, at::Tensor& scales) {
  constexpr int64_t kGroup = 2 * kFp8GroupPairs;  // 128 outputs x 128 inputs a scale
  check_quantizing(weight, values, at::kFloat8_e4m3fn, "quantize_blocks_fp8");
  const int64_t n = weight.size(0), k = weight.size(1), stride = weight.stride(0);
  const int64_t groups_n = (n + kGroup - 1) / kGroup, groups_k = (k + kGroup - 1) / kGroup;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
              scales.size(0) == groups_n && scales.size(1) == groups_k,
              "quantize_blocks_fp8: scales must be fp32 [", groups_n, ", ", groups_k, "]");
  const auto* src = static_cast<const uint16_t*>(weight.data_ptr());
  auto* dst = values.data_ptr<c10::Float8_e4m3fn>();
  float* block_scales = scales.data_ptr<float>();
  at::parallel_for(0, groups_n * groups_k, 1, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      const int64_t r0 = g / groups_k * kGroup, r1 = std::min(n, r0 + kGroup);
      const int64_t c0 = g % groups_k * kGroup, c1 = std::min(k, c0 + kGroup);
      float top = 0.0f;
      for (int64_t r = r0; r < r1; ++r) top = std::max(top, largest_magnitude(src + r * stride + c0, c1 - c0));
      float scale = top / 448.0f;
      if (!(scale > 0.0f)) scale = 1.0f;
      block_scales[g] = scale;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          dst[r * k + c] = c10::Float8_e4m3fn(std::clamp(bf16_to_float(src[r * stride + c]) / scale, -448.0f, 448.0f));
        }
      }
    }
  });
}

// formats.quantize_rows' int4, bit for bit: per row and 128 inputs (zeros past K), low = min(w, 0), high =
// max(w, 0), scale = (high - low) / 15 rounded to fp16 (1 where that is 0), zero = clamp(round(-low / scale),
// 0, 15), values = clamp(round(w / scale + zero), 0, 15). params is [rows, groups, 2] fp16: scale, zero.
void quantize_groups_int4(const at::Tensor& weight, at::Tensor& values, at::Tensor& params) {
  constexpr int64_t kGroup = 2 * kInt4GroupPairs;  // inputs a scale and zero point
  check_quantizing(weight, values, at::kByte, "quantize_groups_int4");
  const int64_t n = weight.size(0), k = weight.size(1), stride = weight.stride(0);
  const int64_t groups = (k + kGroup - 1) / kGroup;
  TORCH_CHECK(params.scalar_type() == at::kHalf && params.is_contiguous() && params.dim() == 3 &&
              params.size(0) == n && params.size(1) == groups && params.size(2) == 2,
              "quantize_groups_int4: params must be fp16 [", n, ", ", groups, ", 2]");
  const auto* src = static_cast<const uint16_t*>(weight.data_ptr());
  auto* dst = values.data_ptr<uint8_t>();
  auto* out_params = params.data_ptr<at::Half>();
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t c0 = g * kGroup, c1 = std::min(k, c0 + kGroup);
        const uint16_t* row = src + r * stride;
        float low = 0.0f, high = 0.0f;  // (0 included: padding, and zero stays exact)
        for (int64_t c = c0; c < c1; ++c) {
          low = std::min(low, bf16_to_float(row[c]));
          high = std::max(high, bf16_to_float(row[c]));
        }
        at::Half scale_half((high - low) / 15.0f);
        if (!(static_cast<float>(scale_half) > 0.0f)) scale_half = at::Half(1.0f);
        const float scale = static_cast<float>(scale_half);
        const float zero = std::clamp((-low / scale + kRoundToEven) - kRoundToEven, 0.0f, 15.0f);
        out_params[(r * groups + g) * 2] = scale_half;
        out_params[(r * groups + g) * 2 + 1] = at::Half(zero);
        for (int64_t c = c0; c < c1; ++c) {
          const float q = (bf16_to_float(row[c]) / scale + zero + kRoundToEven) - kRoundToEven;
          dst[r * k + c] = static_cast<uint8_t>(std::clamp(q, 0.0f, 15.0f));
        }
      }
    }
  });
}

}  // namespace tilefx
