// tilefx::linear on AVX2 + FMA: bf16 weights (packed, see kernels.h) widened to fp32
// in registers, fp32 accumulation, bf16 output.
//
// Decode (M <= 4) is a GEMV: it must stream the weight at memory speed, so each
// block of kBlockN columns is read from memory once, front to back, with the rows of x
// applied to it (rows 2-3 from L1, after rows 0-1). For M = 1 a thread may walk two blocks at once, from the two
// halves of its range: two concurrent streams per core keep more DRAM requests in
// flight than one. Each stream also prefetches ahead of its loads: the FMAs between
// the loads leave fewer demand misses in flight than a plain streaming read has.
// How many streams and how far ahead pay differs between CPUs, so both are tuned
// per machine (tuning.h; docs/PERFORMANCE.md has the measurements). Prefill (M > 4)
// is a blocked GEMM over x packed in 6-row tiles (pack_x_tiles): the weight panel of one
// block and kKChunk pairs of K (16 KiB) stays in L1 while every tile of x passes over it;
// int8's and int4's multiply the weights' integers by x as int16 words in the same blocking
// (int8_word_gemm, int4_word_gemm).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "kernels.h"

// This unit (and only this unit) is compiled for AVX2 + FMA; the ops (dispatch.h) call
// it only where CPUID reports both.
#pragma GCC target("avx2,fma,f16c")
#include "vec_avx2.h"
#include "linear_walk.h"

namespace tilefx {
namespace {

constexpr int kVecs = kBlockN / 8;       // ymm vectors per packed row of a block
constexpr int64_t kPairStride = kPairValues;  // bf16 elements per K pair in a block
constexpr int64_t kKChunk = 128;         // K pairs per L1-resident weight panel (GEMM)
constexpr int kTileRows = 6;             // rows of x per GEMM micro-tile (12 accumulators with kTileVecs)
constexpr int kTileVecs = 2;             // 8-column vectors per GEMM micro-tile
constexpr int64_t kTilePairFloats = 2 * kTileRows;  // floats of a packed tile per K pair
constexpr int64_t kPackRows = 96;        // rows of x packed at a time (linear_blocks_avx2)
constexpr int kWordTileRows = 6;         // rows of x per micro-tile of int8's GEMM over words (int8_word_gemm)
// Up to kGemvRows rows one_block streams a block as a GEMV: batched decode is memory-bound, which the GEMM
// (blocked for L1 reuse across many rows, no software prefetch) is not built for. 3-4 rows (fp8: 2-4) read a
// block kDecodeChunkBytes per stream at a time (over_chunks): rows 0-1 from memory, then rows 2-3 from L1.
constexpr int64_t kDecodeChunkBytes = 2048;
constexpr int64_t kBf16ChunkPairs = kDecodeChunkBytes / (2 * kPairStride);  // 16
constexpr int64_t kQuantizedChunkPairs = kDecodeChunkBytes / kQPairBytes;   // 32: int8, fp8
// GEMV software prefetch: one K pair row (two cache lines) `ahead` bytes past `row`, in one stream
// (LinearProblem::prefetch_bytes and prefetch_hint, tuned per machine; the default is non-temporal, so
// the streamed weight does not evict x, fp32 up to 32 KiB, from the caches). Near a block's end it
// prefetches the next block, which a stream reads next; past the buffer's end it is a no-op
// (prefetches never fault).
template <Prefetch P>
static inline void prefetch_ahead(const uint16_t* row, int64_t ahead) {
  const char* line = reinterpret_cast<const char*>(row) + ahead;
  prefetch<P>(line);
  prefetch<P>(line + 64);
}

// One row of x against a block's K pairs [p0, p1), into c (added to it where `add`): 2 accumulators per
// column vector (k even / k odd) so FMA latency never limits the stream. With Streams = 2 each step also
// reads pair p + `second` into the same accumulators: a second stream through the block (one_block).
template <Prefetch P, int Streams = 1>
static void gemv_row(const float* x, const uint16_t* block, int64_t p0, int64_t p1, int64_t ahead, float* c,
                     bool add = false, int64_t second = 0) {
  __m256 acc_even[kVecs], acc_odd[kVecs];
  for (int j = 0; j < kVecs; ++j) {
    acc_even[j] = add ? _mm256_loadu_ps(c + 8 * j) : _mm256_setzero_ps();
    acc_odd[j] = _mm256_setzero_ps();
  }
  auto step = [&](int64_t q) {
    const uint16_t* row = block + q * kPairStride;
    prefetch_ahead<P>(row, ahead);
    const __m256 x0 = _mm256_broadcast_ss(x + 2 * q);
    const __m256 x1 = _mm256_broadcast_ss(x + 2 * q + 1);
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) {
      __m256 even, odd;
      load_vnni_pair(row + j * 16, even, odd);
      acc_even[j] = _mm256_fmadd_ps(x0, even, acc_even[j]);
      acc_odd[j] = _mm256_fmadd_ps(x1, odd, acc_odd[j]);
    }
  };
  for (int64_t q = p0; q < p1; ++q) {
    step(q);
    if constexpr (Streams == 2) step(q + second);
  }
  for (int j = 0; j < kVecs; ++j) _mm256_storeu_ps(c + 8 * j, _mm256_add_ps(acc_even[j], acc_odd[j]));
}

// One row of x against two blocks at once (two streams; see the top of the file).
template <Prefetch P>
static void gemv_row_two_blocks(const float* x, const uint16_t* block_a, const uint16_t* block_b, int64_t pairs,
                                int64_t ahead, float* c_a, float* c_b) {
  __m256 acc_a[kVecs], acc_b[kVecs];
  for (int j = 0; j < kVecs; ++j) acc_a[j] = acc_b[j] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* row_a = block_a + p * kPairStride;
    const uint16_t* row_b = block_b + p * kPairStride;
    prefetch_ahead<P>(row_a, ahead);
    prefetch_ahead<P>(row_b, ahead);
    const __m256 x0 = _mm256_broadcast_ss(x + 2 * p);
    const __m256 x1 = _mm256_broadcast_ss(x + 2 * p + 1);
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) {
      __m256 even, odd;
      load_vnni_pair(row_a + j * 16, even, odd);
      acc_a[j] = _mm256_fmadd_ps(x1, odd, _mm256_fmadd_ps(x0, even, acc_a[j]));
      load_vnni_pair(row_b + j * 16, even, odd);
      acc_b[j] = _mm256_fmadd_ps(x1, odd, _mm256_fmadd_ps(x0, even, acc_b[j]));
    }
  }
  for (int j = 0; j < kVecs; ++j) {
    _mm256_storeu_ps(c_a + 8 * j, acc_a[j]);
    _mm256_storeu_ps(c_b + 8 * j, acc_b[j]);
  }
}

// Two rows of x against a block's K pairs [p0, p1) (batch-2 decode: the weight is still read once), into c
// (rows kBlockN apart; added to it where `add`). Streams = 2: each step also reads pair p + `second`.
template <Prefetch P, int Streams = 1>
static void gemv_two_rows(const float* x, int64_t ldx, const uint16_t* block, int64_t p0, int64_t p1, int64_t ahead,
                          float* c, bool add = false, int64_t second = 0) {
  __m256 acc[2][kVecs];
  for (int m = 0; m < 2; ++m)
    for (int j = 0; j < kVecs; ++j) acc[m][j] = add ? _mm256_loadu_ps(c + m * kBlockN + 8 * j) : _mm256_setzero_ps();
  auto step = [&](int64_t q) {
    const uint16_t* row = block + q * kPairStride;
    prefetch_ahead<P>(row, ahead);
    const __m256 a0 = _mm256_broadcast_ss(x + 2 * q), a1 = _mm256_broadcast_ss(x + 2 * q + 1);
    const __m256 b0 = _mm256_broadcast_ss(x + ldx + 2 * q), b1 = _mm256_broadcast_ss(x + ldx + 2 * q + 1);
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) {
      __m256 even, odd;
      load_vnni_pair(row + j * 16, even, odd);
      acc[0][j] = _mm256_fmadd_ps(a1, odd, _mm256_fmadd_ps(a0, even, acc[0][j]));
      acc[1][j] = _mm256_fmadd_ps(b1, odd, _mm256_fmadd_ps(b0, even, acc[1][j]));
    }
  };
  for (int64_t q = p0; q < p1; ++q) {
    step(q);
    if constexpr (Streams == 2) step(q + second);
  }
  for (int m = 0; m < 2; ++m)
    for (int j = 0; j < kVecs; ++j) _mm256_storeu_ps(c + m * kBlockN + 8 * j, acc[m][j]);
}

// The schedule of a decode of `Rows` rows against one block, for this unit's kernels (bf16's one_block, int8's and
// fp8's 1-4 rows): pairs [0, end) on S streams (and the same pairs `second` further), `chunk` pairs at a time,
// rows 0-1 streaming a chunk from memory with the walk's prefetch and rows 2-3 reading it again from L1 (16
// registers hold two rows' sums), then pairs [tail, K_pairs) on one stream. add(rows, prefetch, streams, r0, p0,
// p1, second) runs rows r0 .. r0 + rows - 1 (integral constants: rows, streams; PrefetchAs: prefetch).
template <int Rows, Prefetch P, int S, class Add>
static inline void over_chunks(int64_t end, int64_t chunk, int64_t second, int64_t tail, int64_t k_pairs,
                               const Add& add) {
  auto pass = [&](auto streams, int64_t p0, int64_t p1, int64_t offset) {
    add(std::integral_constant<int, (Rows < 2 ? Rows : 2)>{}, PrefetchAs<P>{}, streams, 0, p0, p1, offset);
    if constexpr (Rows > 2) {
      add(std::integral_constant<int, Rows - 2>{}, PrefetchAs<Prefetch::none>{}, streams, 2, p0, p1, offset);
    }
  };
  for (int64_t p0 = 0; p0 < end; p0 += chunk) {
    pass(std::integral_constant<int, S>{}, p0, p0 + chunk < end ? p0 + chunk : end, second);
  }
  for (int64_t p0 = tail; p0 < k_pairs; p0 += chunk) {
    pass(std::integral_constant<int, 1>{}, p0, p0 + chunk < k_pairs ? p0 + chunk : k_pairs, 0);
  }
}

// x as the GEMM reads it: tiles of kTileRows rows, a tile's rows side by side per K pair (tile t, pair q:
// x[6t + r][2q] and x[6t + r][2q + 1] for r = 0..5, kTilePairFloats floats), rows past `rows` zero. Each
// tile's x is then one stream, front to back: broadcast from six rows ldx apart, the same micro-kernel ran at
// 47-59 GFLOP/s on a Zen 3 core (91 at its FMA peak), from packed tiles at 51-84 (docs/PERFORMANCE.md).
static void pack_x_tiles(const float* x, int64_t rows, int64_t ldx, int64_t pairs, float* out) {
  for (int64_t t = 0; t * kTileRows < rows; ++t) {
    float* tile = out + t * pairs * kTilePairFloats;
    for (int r = 0; r < kTileRows; ++r) {
      const int64_t m = t * kTileRows + r;
      float* to = tile + 2 * r;
      if (m >= rows) {
        for (int64_t q = 0; q < pairs; ++q) to[q * kTilePairFloats] = to[q * kTilePairFloats + 1] = 0.0f;
        continue;
      }
      const float* from = x + m * ldx;
      for (int64_t q = 0; q < pairs; ++q) std::memcpy(to + q * kTilePairFloats, from + 2 * q, 2 * sizeof(float));
    }
  }
}

// x words as int8_word_gemm reads them: tiles of kWordTileRows rows, a tile's rows side by side per K pair (tile t,
// pair q: the words of rows 6t .. 6t + 5 at pair q), rows past `rows` zero: each step's six broadcasts address one
// pointer, where six rows ldx apart cost an address computation each (1.06x the rate, docs/PERFORMANCE.md). With
// `together` 2 (int4_word_gemm; `pairs` even) each row's pairs q and q + 1 stay adjacent, one 64-bit broadcast.
static void pack_word_tiles(const uint32_t* words, int64_t rows, int64_t ldw, int64_t pairs, uint32_t* out,
                            int64_t together = 1) {
  for (int64_t t = 0; t * kWordTileRows < rows; ++t) {
    uint32_t* tile = out + t * pairs * kWordTileRows;
    for (int r = 0; r < kWordTileRows; ++r) {
      const int64_t m = t * kWordTileRows + r;
      const uint32_t* from = words + m * ldw;
      for (int64_t q = 0; q < pairs; q += together) {
        uint32_t* to = tile + q * kWordTileRows + r * together;
        for (int64_t j = 0; j < together; ++j) to[j] = m < rows ? from[q + j] : 0;
      }
    }
  }
}

// One row's share of a K row (b0, b1: two column vectors of input k) in the micro-tile: x broadcast, two FMAs.
template <int R>
static inline void tile_row(const float* xk, __m256 b0, __m256 b1, __m256 (&acc)[kTileRows][kTileVecs]) {
  const __m256 s = _mm256_broadcast_ss(xk + 2 * R);
  acc[R][0] = _mm256_fmadd_ps(s, b0, acc[R][0]);
  acc[R][1] = _mm256_fmadd_ps(s, b1, acc[R][1]);
}

template <int... R>
static inline void tile_rows(std::integer_sequence<int, R...>, const float* xk, __m256 b0, __m256 b1,
                             __m256 (&acc)[kTileRows][kTileVecs]) {
  (tile_row<R>(xk, b0, b1, acc), ...);
}

// GEMM micro-tile: one packed tile of x (kTileRows rows) x kTileVecs*8 columns from column vector `vec0`,
// K pairs [p0, p1); adds into c (kTileRows rows of kBlockN). Input 2q's values first, then 2q + 1's, so two
// column vectors of weights are live at a time and the 12 accumulators fit the 16 registers.
static void gemm_tile(const float* tile, const uint16_t* block, int64_t p0, int64_t p1, int vec0, float* c) {
  constexpr auto rows = std::make_integer_sequence<int, kTileRows>{};
  __m256 acc[kTileRows][kTileVecs];
  for (int m = 0; m < kTileRows; ++m)
    for (int j = 0; j < kTileVecs; ++j) acc[m][j] = _mm256_loadu_ps(c + m * kBlockN + 8 * (vec0 + j));
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* row = block + p * kPairStride + vec0 * 16;
    const float* xk = tile + p * kTilePairFloats;
    const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
    const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16));
    tile_rows(rows, xk, vnni_even(r0), vnni_even(r1), acc);
    tile_rows(rows, xk + 1, vnni_odd(r0), vnni_odd(r1), acc);
  }
  for (int m = 0; m < kTileRows; ++m)
    for (int j = 0; j < kTileVecs; ++j) _mm256_storeu_ps(c + m * kBlockN + 8 * (vec0 + j), acc[m][j]);
}

// Every row of p (x packed by pack_x_tiles) against one block into c (p.M rows of kBlockN). A last tile
// of fewer rows runs over a full tile's results in `short_tile` and keeps its rows.
static void gemm_block(const LinearProblem& p, const uint16_t* block, float* c) {
  for (int64_t i = 0; i < p.M * kBlockN; i += 8) _mm256_storeu_ps(c + i, _mm256_setzero_ps());
  alignas(32) float short_tile[kTileRows * kBlockN];
  for (int64_t p0 = 0; p0 < p.K_pairs; p0 += kKChunk) {
    const int64_t p1 = p0 + kKChunk < p.K_pairs ? p0 + kKChunk : p.K_pairs;
    for (int64_t m = 0; m < p.M; m += kTileRows) {
      const float* tile = p.x_fp32() + m / kTileRows * p.K_pairs * kTilePairFloats;
      const int64_t rows = p.M - m < kTileRows ? p.M - m : kTileRows;
      float* ct = rows == kTileRows ? c + m * kBlockN : short_tile;
      if (rows < kTileRows) {
        std::memcpy(short_tile, c + m * kBlockN, rows * kBlockN * sizeof(float));
        std::memset(short_tile + rows * kBlockN, 0, (kTileRows - rows) * kBlockN * sizeof(float));
      }
      for (int vec0 = 0; vec0 < kVecs; vec0 += kTileVecs) gemm_tile(tile, block, p0, p1, vec0, ct);
      if (rows < kTileRows) std::memcpy(c + m * kBlockN, short_tile, rows * kBlockN * sizeof(float));
    }
  }
}

// silu(g) * u = g * u / (1 + exp(-g)), in fp32.
static inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_div_ps(_mm256_mul_ps(g, u), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// Gate and up results (fp32, rows of kBlockN) -> y = silu(gate) * up (bf16), columns
// [col0, col0 + kBlockN) clipped to N.
static void store_block_silu_mul(const LinearProblem& p, int64_t col0, const float* gate, const float* up) {
  const int64_t cols = p.N - col0 < kBlockN ? p.N - col0 : kBlockN;
  for (int64_t m = 0; m < p.M; ++m) {
    const float* g = gate + m * kBlockN;
    const float* u = up + m * kBlockN;
    int64_t j = 0;
    if (p.yf) {
      float* y = p.yf + m * p.ldy + col0;
      for (; j + 8 <= cols; j += 8) _mm256_storeu_ps(y + j, silu_mul8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
      for (; j < cols; ++j) y[j] = g[j] * u[j] / (1.0f + __builtin_expf(-g[j]));
      continue;
    }
    uint16_t* y = p.y + m * p.ldy + col0;
    for (; j + 8 <= cols; j += 8) store_bf16x8(y + j, silu_mul8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
    for (; j < cols; ++j) y[j] = float_to_bf16(g[j] * u[j] / (1.0f + __builtin_expf(-g[j])));
  }
}

// c (fp32, rows of kBlockN) + bias -> y (bf16), columns [col0, col0 + kBlockN) clipped to N.
static void store_block(const LinearProblem& p, int64_t col0, const float* c) {
  const int64_t cols = p.N - col0 < kBlockN ? p.N - col0 : kBlockN;
  for (int64_t m = 0; m < p.M; ++m) {
    const float* cm = c + m * kBlockN;
    int64_t j = 0;
    if (p.yf) {
      float* y = p.yf + m * p.ldy + col0;
      for (; j < cols; ++j) y[j] = cm[j] + (p.bias ? bf16_to_float(p.bias[col0 + j]) : 0.0f);
      continue;
    }
    uint16_t* y = p.y + m * p.ldy + col0;
    for (; j + 8 <= cols; j += 8) {
      __m256 v = _mm256_loadu_ps(cm + j);
      if (p.bias) v = _mm256_add_ps(v, load_bf16x8(p.bias + col0 + j));
      store_bf16x8(y + j, v);
    }
    for (; j < cols; ++j) y[j] = float_to_bf16(cm[j] + (p.bias ? bf16_to_float(p.bias[col0 + j]) : 0.0f));
  }
}

// -- quantized weights (kernels.h): fp32 FMAs over values widened in registers --------

// 16 values (8 columns x one K pair, in packed order) of a quantized block as two fp32
// vectors (4 columns x 2 each). e4m3 goes through fp16 as in linear_avx512.cpp: exact,
// subnormals included, the value times 2^-8.
template <WeightFormat F>
static inline void load_quantized16(const uint8_t* p, __m256& lo, __m256& hi) {
  if constexpr (F == WeightFormat::int8) {
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(raw), 7),
                                          _mm256_set1_epi16(static_cast<short>(0xBFFF)));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
  }
}

template <WeightFormat F>
static inline __m256 group_scale(const LinearProblem& p, int64_t block, int64_t pair) {
  if constexpr (F == WeightFormat::fp8) {
    return _mm256_set1_ps(kFp8Unscale * fp8_scale(p, block, pair));
  } else {
    return _mm256_set1_ps(1.0f);
  }
}

// 16 e4m3 values of a block (8 columns x one K pair in the packed order: a column's inputs 2q and 2q + 1 side by
// side) as the values of input 2q (`even`) and 2q + 1 (`odd`) of the 8 columns, times 2^-120, exactly: widened to
// 16 bits with their sign, each value's 4 exponent and 3 mantissa bits shift to fp32's bits 26..20 (the low 4 bits
// of the exponent, the top 3 of the mantissa) and a copy of its sign to bit 31; the mask keeps those. e4m3's
// subnormals become fp32's (zero where the caller set denormals-are-zero: values under 2^-6, 1/28672 of e4m3's
// largest). Five instructions for 16 values, the shifts and masks one µop each; widening through fp16
// (load_quantized16) adds two conversions of two µops each: that kept fp8 decode compute-bound on Zen 3.
static inline void load_fp8_pairs(const uint8_t* p, __m256& even, __m256& odd) {
  const __m256i words = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i keep = _mm256_set1_epi32(static_cast<int>(0x87F00000u));
  even = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(words, 20), keep));
  odd = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(words, 4), keep));
}

// load_fp8_pairs' 2^-120, undone in two halves so that nothing overflows or leaves fp32's normal range: x times
// 2^60 before the FMAs (each product is then the true one times 2^-60), each scale group's sum times its scale and
// 2^60 after.
constexpr float kFp8HalfUnscale = 0x1p60f;

// One row of x against one fp8 block on one stream (even and odd accumulators for the 4 column vectors), each
// scale group's sums scaled into c[0, kBlockN); two streams and 2-4 rows: fp8_gemv_rows. (int8 decode reads x as
// int16 words instead: int8_word_gemv.)
template <Prefetch P>
static void fp8_gemv_row(const LinearProblem& p, const float* x, int64_t block, float* c) {
  const uint8_t* w = p.wq + block * pairs_between_blocks(p) * kQPairBytes;
  const __m256 half_unscale = _mm256_set1_ps(kFp8HalfUnscale);
  for (int j = 0; j < kVecs; ++j) _mm256_storeu_ps(c + 8 * j, _mm256_setzero_ps());
  for (int64_t g0 = 0; g0 < p.K_pairs; g0 += kFp8GroupPairs) {
    const int64_t g1 = g0 + kFp8GroupPairs < p.K_pairs ? g0 + kFp8GroupPairs : p.K_pairs;
    __m256 acc_even[kVecs], acc_odd[kVecs];
    for (int j = 0; j < kVecs; ++j) acc_even[j] = acc_odd[j] = _mm256_setzero_ps();
    for (int64_t q = g0; q < g1; ++q) {
      const uint8_t* row = w + q * kQPairBytes;
      prefetch<P>(row + p.prefetch_bytes);
      const __m256 x0 = _mm256_mul_ps(_mm256_broadcast_ss(x + 2 * q), half_unscale);
      const __m256 x1 = _mm256_mul_ps(_mm256_broadcast_ss(x + 2 * q + 1), half_unscale);
#pragma GCC unroll 4
      for (int j = 0; j < kVecs; ++j) {
        __m256 even, odd;
        load_fp8_pairs(row + 16 * j, even, odd);
        acc_even[j] = _mm256_fmadd_ps(x0, even, acc_even[j]);
        acc_odd[j] = _mm256_fmadd_ps(x1, odd, acc_odd[j]);
      }
    }
    const __m256 scale = _mm256_set1_ps(kFp8HalfUnscale * fp8_scale(p, block, g0));
    for (int j = 0; j < kVecs; ++j) {
      const __m256 sum = _mm256_add_ps(acc_even[j], acc_odd[j]);
      _mm256_storeu_ps(c + 8 * j, _mm256_fmadd_ps(sum, scale, _mm256_loadu_ps(c + 8 * j)));
    }
  }
}

// int8 decode over x as int16 words (ActivationForm::int16_words): 16 weight bytes (8 columns x one K
// pair, the packed order) sign-extend to int16 in one instruction and `vpmaddwd` multiplies
// them by the broadcast (x[2q], x[2q + 1]) and adds each column's two products: 3
// instructions per 16 weights, against 8 for widening them to fp32 for FMAs, which kept the
// fp32 kernel compute-bound (docs/PERFORMANCE.md). A sum of
// kWordPairs pairs, each at most 2 * 128 * 32767, stays within int32 before it goes to fp32.
constexpr int64_t kWordPairs = 128;

// body(s, pair, row) for pairs [p0, p1) of block `w` on S streams (stream s reads the pairs s * second further),
// each stream's K pair row prefetched with the walk's hint before the body reads it.
template <Prefetch P, int S, class Body>
static inline void over_streams(const LinearProblem& p, const uint8_t* w, int64_t p0, int64_t p1, int64_t second,
                                const Body& body) {
  for (int64_t q = p0; q < p1; ++q) {
    for (int s = 0; s < S; ++s) {
      const int64_t pair = q + s * second;
      const uint8_t* row = w + pair * kQPairBytes;
      prefetch<P>(row + p.prefetch_bytes);
      body(s, pair, row);
    }
  }
}

// c[r] += rows r0 .. r0 + R - 1 of x (words) against pairs [p0, p1) of block `w` (with S streams: and the same
// pairs `second` further, into the same sums; at most kWordPairs pairs in all), for R <= 2 (16 registers hold
// two rows' int32 sums and the loaded weights).
template <int R, Prefetch P, int S>
static inline void add_word_sums(const LinearProblem& p, const uint8_t* w, int r0, int64_t p0, int64_t p1,
                                 int64_t second, float* c) {
  const uint32_t* x = p.x_words() + r0 * (p.ldx / 2);
  __m256i acc[R][4];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_si256();
  over_streams<P, S>(p, w, p0, p1, second, [&](int, int64_t pair, const uint8_t* row) {
    __m256i words[4];
    for (int j = 0; j < 4; ++j) {
      words[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j)));
    }
    for (int r = 0; r < R; ++r) {
      const __m256i xq = _mm256_set1_epi32(static_cast<int>(x[r * (p.ldx / 2) + pair]));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(words[j], xq));
    }
  });
  for (int r = 0; r < R; ++r) {
    float* out = c + (r0 + r) * kBlockN;
    for (int j = 0; j < 4; ++j) {
      _mm256_storeu_ps(out + 8 * j, _mm256_add_ps(_mm256_loadu_ps(out + 8 * j), _mm256_cvtepi32_ps(acc[r][j])));
    }
  }
}

// int8 decode of 1-4 rows against one block. With two `Streams` (where the walk is tuned to two) the block's
// first and second halves of K are read side by side into the same sums (no more registers than one stream);
// an odd pair left runs after. 1-2 rows sum kWordPairs pairs at a time; 3-4 rows kQuantizedChunkPairs pairs
// per stream, rows 0-1 from memory and rows 2-3 the same pairs from L1 (over_chunks).
template <int Rows, Prefetch P, int Streams>
static void int8_word_gemv(const LinearProblem& p, int64_t block, float* c) {
  const uint8_t* w = p.wq + block * pairs_between_blocks(p) * kQPairBytes;
  for (int64_t i = 0; i < Rows * kBlockN; ++i) c[i] = 0.0f;
  const int64_t half = Streams == 2 ? p.K_pairs / 2 : 0;
  const int64_t end = Streams == 2 ? half : p.K_pairs, tail = Streams == 2 ? 2 * half : p.K_pairs;
  const int64_t chunk = Rows <= 2 ? kWordPairs / Streams : kQuantizedChunkPairs;
  over_chunks<Rows, P, Streams>(end, chunk, half, tail, p.K_pairs,
                                [&](auto rows, auto prefetch, auto streams, int r0, int64_t p0, int64_t p1,
                                    int64_t second) {
                                  add_word_sums<decltype(rows)::value, decltype(prefetch)::value,
                                                decltype(streams)::value>(p, w, r0, p0, p1, second, c);
                                });
  const float* column_scales = p.scales + block * kBlockN;
  for (int r = 0; r < Rows; ++r) {
    const __m256 x_scale = _mm256_set1_ps(p.x_scales[r]);
    for (int j = 0; j < 4; ++j) {
      const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(column_scales + 8 * j), x_scale);
      _mm256_storeu_ps(c + r * kBlockN + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(c + r * kBlockN + 8 * j), scale));
    }
  }
}

// int8 prefill over x as int16 words (ActivationForm::int16_words, one scale a row; more than kGemvRows rows), the
// decode GEMV's `vpmaddwd` over sign-extended weight bytes blocked as gemm_block is: a micro-tile of kWordTileRows
// rows and two column vectors (12 int32 sums, the two weight vectors and the broadcast x in the 16 registers), K in
// kWordPairs chunks (8 KiB of the block, in L1 while the row tiles pass; the most pairs int32 sums hold). A
// `vpmaddwd` and its `vpaddd` make 16 products where the fp32 GEMM over a dequantized panel makes 8 an FMA, after
// widening the weights; x at 15 bits a row is what int8 decode reads already. x comes packed in tiles
// (pack_word_tiles): 3 KiB of a tile per chunk.

// acc + w's int16 pairs times the x words at `x` broadcast, each lane's two products summed (`vpmaddwd`,
// `vpaddd`): Pairs 1, one pair of words to every lane (int8_word_gemm); 2, two pairs, the first to the even lanes
// and the second to the odd ones (int4_word_gemm). Written as the instructions, the broadcast from memory into the
// one scratch register the product takes: through intrinsics GCC kept the six rows' broadcasts live as well (17
// registers), spilled four of the twelve sums to the stack and copied the rest around every step (the GEMM ran at
// 1.1x the fp32 one).
template <int Pairs>
static inline __m256i add_word_products(__m256i acc, __m256i w, const uint32_t* x) {
  static_assert(Pairs == 1 || Pairs == 2, "a broadcast of one or two pairs of words");
  __m256i product;
  if constexpr (Pairs == 1) {
    asm("vpbroadcastd %2, %1\n\t"
        "vpmaddwd %1, %3, %1\n\t"
        "vpaddd %1, %0, %0"
        : "+x"(acc), "=&x"(product)
        : "m"(*x), "x"(w));
  } else {
    asm("vpbroadcastq %2, %1\n\t"
        "vpmaddwd %1, %3, %1\n\t"
        "vpaddd %1, %0, %0"
        : "+x"(acc), "=&x"(product)
        : "m"(*reinterpret_cast<const uint64_t*>(x)), "x"(w));
  }
  return acc;
}

template <int Rows>
static void int8_word_tile(const uint32_t* tile, const uint8_t* block, int64_t q0, int64_t q1, int vec0, float* c) {
  __m256i acc[Rows][2];
  for (auto& row : acc) row[0] = row[1] = _mm256_setzero_si256();
  for (int64_t q = q0; q < q1; ++q) {
    const uint8_t* row = block + q * kQPairBytes + 16 * vec0;
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16)));
    const uint32_t* x = tile + q * kWordTileRows;
#pragma GCC unroll 6
    for (int r = 0; r < Rows; ++r) {
      acc[r][0] = add_word_products<1>(acc[r][0], w0, x + r);
      acc[r][1] = add_word_products<1>(acc[r][1], w1, x + r);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int j = 0; j < 2; ++j) {
      float* out = c + r * kBlockN + 8 * (vec0 + j);
      _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), _mm256_cvtepi32_ps(acc[r][j])));
    }
  }
}

// Every row of p against int8 block `block` over int16 words x packed in tiles (pack_word_tiles), into c (rows of
// kBlockN, scaled).
static void int8_word_gemm(const LinearProblem& p, int64_t block, float* c) {
  const uint8_t* w = p.wq + block * pairs_between_blocks(p) * kQPairBytes;
  for (int64_t i = 0; i < p.M * kBlockN; i += 8) _mm256_storeu_ps(c + i, _mm256_setzero_ps());
  over_gemm_tiles<kWordTileRows>(p, kWordPairs, [&](int64_t q0, int64_t q1, int64_t m, auto rows) {
    const uint32_t* tile = p.x_words() + m / kWordTileRows * p.K_pairs * kWordTileRows;
    for (int vec0 = 0; vec0 < kVecs; vec0 += 2) {
      int8_word_tile<decltype(rows)::value>(tile, w, q0, q1, vec0, c + m * kBlockN);
    }
  });
  const float* column_scales = p.scales + block * kBlockN;
  for (int64_t m = 0; m < p.M; ++m) {
    const __m256 x_scale = _mm256_set1_ps(p.x_scales[m]);
    for (int j = 0; j < kVecs; ++j) {
      const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(column_scales + 8 * j), x_scale);
      _mm256_storeu_ps(c + m * kBlockN + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(c + m * kBlockN + 8 * j), scale));
    }
  }
}

// int4 prefill over x as int16 words (ActivationForm::int16_words, as int8's GEMM above; more than kGemvRows rows):
// 16 bytes of a block's two K pairs (columns 4v..4v+3 in the low nibbles, 4v+16..4v+19 in the high, four inputs
// each) widen to 16-bit values, so each 32-bit lane holds two inputs of one column, and a shift parts the
// nibbles: 4 instructions give two vectors of four columns' values, against which each row's words for the four
// inputs, broadcast as one 64-bit pair, make 16 products a `vpmaddwd` (even lanes the first two inputs, odd lanes
// the other two) as int8's GEMM does. Micro-tiles of kWordTileRows rows and those 8 columns (12 int32 sums); per
// weight group (128 inputs) each lane pair's sum goes to fp32, the group's scale and zero point apply (its sum over
// words q minus z times the row's sum of words in the group, x_sums) and the totals in c take it, in the lanes'
// column order (int4_word_order) until the end. x comes packed in tiles of pairs of K pairs
// (pack_word_tiles(..., 2)). A group is 32 steps, each adding at most 2 * 15 * 32767 per lane.
// The columns of column vector v (0-3) of an int4 word tile, in the order its pair sums come out (hadd of the
// low-nibble and the high-nibble sums, within 128-bit lanes).
static inline void int4_word_order(int v, int (&columns)[8]) {
  const int order[8] = {0, 1, 16, 17, 2, 3, 18, 19};
  for (int i = 0; i < 8; ++i) columns[i] = 4 * v + order[i];
}

// 8 fp16 params of a block's group (scales, or zeros at +kBlockN) for column vector v, in int4_word_order, as fp32.
static inline __m256 int4_word_params(const uint16_t* params, int v) {
  uint32_t two[4];  // columns (4v, 4v+1), (4v+16, 4v+17), (4v+2, 4v+3), (4v+18, 4v+19)
  std::memcpy(&two[0], params + 4 * v, 4);
  std::memcpy(&two[1], params + 4 * v + 16, 4);
  std::memcpy(&two[2], params + 4 * v + 2, 4);
  std::memcpy(&two[3], params + 4 * v + 18, 4);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(two)));
}

template <int Rows>
static void int4_word_tile(const LinearProblem& p, const uint32_t* tile, int64_t block, int64_t q0, int64_t q1,
                           int64_t m0, float* c) {
  const uint8_t* w = p.wq + block * pairs_between_blocks(p) * kInt4PairBytes;
  const int64_t ahead = m0 == 0 ? kInt4GemmAheadBytes : 0;  // the chunk's first row tile reads the block from memory
  for (int64_t g0 = q0; g0 < q1; g0 += kInt4GroupPairs) {  // q0 is a multiple of kInt4GroupPairs
    const int64_t g1 = g0 + kInt4GroupPairs < q1 ? g0 + kInt4GroupPairs : q1;
    const int64_t g = g0 / kInt4GroupPairs;
    const uint16_t* params = int4_group_params(p, block, g);
    for (int v = 0; v < 4; ++v) {
      __m256i low[Rows], high[Rows];
      for (int r = 0; r < Rows; ++r) low[r] = high[r] = _mm256_setzero_si256();
      for (int64_t q = g0; q < g1; q += 2) {  // K_pairs is even (K a multiple of 4)
        if (ahead && v == 0) prefetch<Prefetch::t0>(w + q * kInt4PairBytes + ahead);  // (the first of 4 passes)
        const __m256i values =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + q * kInt4PairBytes + 16 * v)));
        const __m256i hi = _mm256_srli_epi16(values, 4);
        const __m256i lo = _mm256_sub_epi16(values, _mm256_slli_epi16(hi, 4));
        const uint32_t* x = tile + q * kWordTileRows;  // (pairs q, q + 1 of each row side by side)
#pragma GCC unroll 6
        for (int r = 0; r < Rows; ++r) {
          low[r] = add_word_products<2>(low[r], lo, x + 2 * r);
          high[r] = add_word_products<2>(high[r], hi, x + 2 * r);
        }
      }
      const __m256 scale = int4_word_params(params, v), zero = int4_word_params(params + kBlockN, v);
      for (int r = 0; r < Rows; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_hadd_epi32(low[r], high[r]));
        const __m256 x_sum = _mm256_set1_ps(p.x_sums[(m0 + r) * p.k_groups + g]);
        float* total = c + r * kBlockN + 8 * v;
        _mm256_storeu_ps(total, _mm256_fmadd_ps(_mm256_fnmadd_ps(zero, x_sum, dot), scale, _mm256_loadu_ps(total)));
      }
    }
  }
}

// Every row of p against int4 block `block` over int16 words x packed in tiles of pairs of K pairs, into c (rows of
// kBlockN, scaled).
static void int4_word_gemm(const LinearProblem& p, int64_t block, float* c) {
  for (int64_t i = 0; i < p.M * kBlockN; i += 8) _mm256_storeu_ps(c + i, _mm256_setzero_ps());
  over_gemm_tiles<kWordTileRows>(p, kWordPairs, [&](int64_t q0, int64_t q1, int64_t m, auto rows) {
    const uint32_t* tile = p.x_words() + m / kWordTileRows * p.K_pairs * kWordTileRows;
    int4_word_tile<decltype(rows)::value>(p, tile, block, q0, q1, m, c + m * kBlockN);
  });
  int columns[4][8];
  for (int v = 0; v < 4; ++v) int4_word_order(v, columns[v]);
  for (int64_t m = 0; m < p.M; ++m) {  // to column order, times the row's scale
    float* row = c + m * kBlockN;
    float sums[kBlockN];
    std::memcpy(sums, row, sizeof sums);
    for (int v = 0; v < 4; ++v) {
      for (int i = 0; i < 8; ++i) row[columns[v][i]] = sums[8 * v + i] * p.x_scales[m];
    }
  }
}

// c[r] += rows r0 .. r0 + R - 1 of x (fp32) against fp8 pairs [p0, p1) of block `block` (S streams: and the same
// pairs `second` further), R <= 2, the pairs within one scale group per stream: each stream's group scale (and
// 2^60 of load_fp8_pairs' 2^-120) is folded into the x it multiplies, the values widened once for both rows, each
// row's even and odd products into one accumulator per column vector (one row: one per stream, so no chain of
// FMAs is longer than two a pair).
template <int R, Prefetch P, int S>
static inline void add_fp8_sums(const LinearProblem& p, const uint8_t* w, int64_t block, int r0, int64_t p0,
                                int64_t p1, int64_t second, float* c) {
  const float* x = p.x_fp32() + r0 * p.ldx;
  __m256 factor[S];
  for (int s = 0; s < S; ++s) factor[s] = _mm256_set1_ps(kFp8HalfUnscale * fp8_scale(p, block, p0 + s * second));
  constexpr int A = R == 1 ? S : 1;  // accumulators per row and column vector
  __m256 acc[R][A][kVecs];
  for (auto& row : acc)
    for (auto& stream : row)
      for (auto& a : stream) a = _mm256_setzero_ps();
  over_streams<P, S>(p, w, p0, p1, second, [&](int s, int64_t pair, const uint8_t* row) {
    const int a = A == 1 ? 0 : s;
    __m256 x0[R], x1[R];
    for (int r = 0; r < R; ++r) {
      x0[r] = _mm256_mul_ps(_mm256_broadcast_ss(x + r * p.ldx + 2 * pair), factor[s]);
      x1[r] = _mm256_mul_ps(_mm256_broadcast_ss(x + r * p.ldx + 2 * pair + 1), factor[s]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) {
      __m256 even, odd;
      load_fp8_pairs(row + 16 * j, even, odd);
      for (int r = 0; r < R; ++r) {
        acc[r][a][j] = _mm256_fmadd_ps(x1[r], odd, _mm256_fmadd_ps(x0[r], even, acc[r][a][j]));
      }
    }
  });
  const __m256 half_unscale = _mm256_set1_ps(kFp8HalfUnscale);
  for (int r = 0; r < R; ++r) {
    float* out = c + (r0 + r) * kBlockN;
    for (int j = 0; j < kVecs; ++j) {
      __m256 sum = acc[r][0][j];
      for (int i = 1; i < A; ++i) sum = _mm256_add_ps(sum, acc[r][i][j]);
      _mm256_storeu_ps(out + 8 * j, _mm256_fmadd_ps(sum, half_unscale, _mm256_loadu_ps(out + 8 * j)));
    }
  }
}

// fp8 decode of 1-4 rows against one block (one row on one stream: fp8_gemv_row): each chunk's values widened
// once per two rows, kQuantizedChunkPairs pairs per stream (dividing a scale group, so no chunk crosses one),
// rows 0-1 from memory and rows 2-3 from L1. Two `Streams`: the block's halves of K, split on a scale group.
template <int Rows, Prefetch P, int Streams>
static void fp8_gemv_rows(const LinearProblem& p, int64_t block, float* c) {
  static_assert(kFp8GroupPairs % kQuantizedChunkPairs == 0, "a chunk must not cross a scale group");
  const uint8_t* w = p.wq + block * pairs_between_blocks(p) * kQPairBytes;
  for (int64_t i = 0; i < Rows * kBlockN; ++i) c[i] = 0.0f;
  const int64_t half = Streams == 2 ? p.K_pairs / (2 * kFp8GroupPairs) * kFp8GroupPairs : 0;
  const int64_t end = Streams == 2 ? half : p.K_pairs, tail = Streams == 2 ? 2 * half : p.K_pairs;
  over_chunks<Rows, P, Streams>(end, kQuantizedChunkPairs, half, tail, p.K_pairs,
                                [&](auto rows, auto prefetch, auto streams, int r0, int64_t p0, int64_t p1,
                                    int64_t second) {
                                  add_fp8_sums<decltype(rows)::value, decltype(prefetch)::value,
                                               decltype(streams)::value>(p, w, block, r0, p0, p1, second, c);
                                });
}

// total[r][j] += s * (dot[r][j] - z * x_sum) for weight group g of the block: dot the group's sum over x q,
// x_sum its sum of x (LinearProblem::x_sums), in the units x was read in.
template <int Rows>
static inline void add_int4_group(const LinearProblem& p, int64_t block, int64_t g, const __m256 (&dot)[Rows][4],
                                  __m256 (&total)[Rows][4]) {
  const uint16_t* params = int4_group_params(p, block, g);
  for (int j = 0; j < 4; ++j) {
    const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(params + 8 * j)));
    const __m256 zero = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(params + kBlockN + 8 * j)));
    for (int r = 0; r < Rows; ++r) {
      const __m256 x_sum = _mm256_set1_ps(p.x_sums[r * p.k_groups + g]);
      total[r][j] = _mm256_fmadd_ps(_mm256_fnmadd_ps(zero, x_sum, dot[r][j]), scale, total[r][j]);
    }
  }
}

// int4 decode over x as int16 words with their bytes apart (ActivationForm::split_words, the default; kernels.h has
// the nibble order): each 32-byte half of a 64-byte load is 8 lanes of four inputs; a mask gives columns
// 8h..8h+7 and a shift and a mask columns 16+8h..16+8h+7; `vpmaddubsw` multiplies the nibbles by the
// words' four high bytes, and their four low bytes by the nibbles (pairs of products, at most 2 * 255 *
// 15: no saturation), `vpmaddwd` by ones sums each lane's four. As on the AVX512 unit (int4_gemv_words),
// a group's sums go to fp32 as 256 * high + low and the zero points come off per group.
template <int Rows, Prefetch P>
static void int4_gemv_words(const LinearProblem& p, int64_t block, float* c) {
  const uint8_t* w = p.wq + block * pairs_between_blocks(p) * kInt4PairBytes;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 total[Rows][4];  // columns 8j..8j+7
  for (auto& row : total)
    for (auto& t : row) t = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.k_groups; ++g) {
    __m256i high[Rows][4], lows[Rows][4];
    for (int r = 0; r < Rows; ++r)
      for (int j = 0; j < 4; ++j) high[r][j] = lows[r][j] = _mm256_setzero_si256();
    for (int64_t q = g * kInt4GroupPairs, end = std::min(q + kInt4GroupPairs, p.K_pairs); q < end; q += 2) {
      const uint8_t* row = w + q * kInt4PairBytes;
      prefetch<P>(row + p.prefetch_bytes);
      for (int half = 0; half < 2; ++half) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * half));
        const __m256i values[2] = {_mm256_and_si256(raw, low), _mm256_and_si256(_mm256_srli_epi16(raw, 4), low)};
        for (int r = 0; r < Rows; ++r) {
          const uint8_t* x = p.x_split() + r * 2 * p.ldx + 4 * q;  // 4 low bytes, then 4 high bytes
          int32_t low4, high4;
          __builtin_memcpy(&low4, x, sizeof low4);
          __builtin_memcpy(&high4, x + 4, sizeof high4);
          const __m256i x_low = _mm256_set1_epi32(low4), x_high = _mm256_set1_epi32(high4);
          for (int h = 0; h < 2; ++h) {
            const int j = 2 * h + half;
            high[r][j] = _mm256_add_epi32(high[r][j], _mm256_madd_epi16(_mm256_maddubs_epi16(values[h], x_high), ones));
            lows[r][j] = _mm256_add_epi32(lows[r][j], _mm256_madd_epi16(_mm256_maddubs_epi16(x_low, values[h]), ones));
          }
        }
      }
    }
    __m256 dot[Rows][4];  // the group's sum over words times nibbles
    for (int r = 0; r < Rows; ++r) {
      for (int j = 0; j < 4; ++j) {
        dot[r][j] = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(high[r][j], 8), lows[r][j]));
      }
    }
    add_int4_group<Rows>(p, block, g, dot, total);
  }
  for (int r = 0; r < Rows; ++r) {
    const __m256 x_scale = _mm256_set1_ps(p.x_scales[r]);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(c + r * kBlockN + 8 * j, _mm256_mul_ps(total[r][j], x_scale));
  }
}

// int4 decode over x as int8 per kXGroup inputs (ActivationForm::int8_groups, TILEFX_INT4_ACTIVATIONS=int8):
// the same loads and masks; `vpmaddubsw` multiplies the nibbles by x's four bytes (pairs of products, at
// most 2 * 15 * 127), summed in int16 over the kXGroup's 8 loads (at most 30480: no overflow), then
// `vpmaddwd` by ones to int32 and to fp32 times the kXGroup's scale: half the multiplies of the words
// per weight byte. The zero points come off per weight group as over the words.
template <int Rows, Prefetch P>
static void int4_gemv_bytes(const LinearProblem& p, int64_t block, float* c) {
  const uint8_t* w = p.wq + block * pairs_between_blocks(p) * kInt4PairBytes;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t x_row_groups = x_groups(p.ldx);
  __m256 total[Rows][4];  // columns 8j..8j+7
  for (auto& row : total)
    for (auto& t : row) t = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.k_groups; ++g) {
    __m256 dot[Rows][4];  // this weight group's sum over x q, x's scales applied
    for (auto& row : dot)
      for (auto& d : row) d = _mm256_setzero_ps();
    const int64_t group_end = std::min((g + 1) * kInt4GroupPairs, p.K_pairs);
    for (int64_t q0 = g * kInt4GroupPairs; q0 < group_end; q0 += kXGroupPairs) {
      __m256i sums[Rows][4];  // int16 pairs
      for (auto& row : sums)
        for (auto& a : row) a = _mm256_setzero_si256();
      for (int64_t q = q0, end = std::min(q0 + kXGroupPairs, group_end); q < end; q += 2) {
        const uint8_t* row = w + q * kInt4PairBytes;
        prefetch<P>(row + p.prefetch_bytes);
        __m256i x4[Rows];  // inputs 2q..2q+3 of each row
        for (int r = 0; r < Rows; ++r) {
          int32_t four;
          __builtin_memcpy(&four, p.x_bytes() + r * p.ldx + 2 * q, sizeof four);
          x4[r] = _mm256_set1_epi32(four);
        }
        for (int half = 0; half < 2; ++half) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * half));
          const __m256i values[2] = {_mm256_and_si256(raw, low), _mm256_and_si256(_mm256_srli_epi16(raw, 4), low)};
          for (int r = 0; r < Rows; ++r) {
            for (int h = 0; h < 2; ++h) {
              const int j = 2 * h + half;
              sums[r][j] = _mm256_add_epi16(sums[r][j], _mm256_maddubs_epi16(values[h], x4[r]));
            }
          }
        }
      }
      for (int r = 0; r < Rows; ++r) {
        const __m256 x_scale = _mm256_set1_ps(p.x_scales[r * x_row_groups + q0 / kXGroupPairs]);
        for (int j = 0; j < 4; ++j) {
          dot[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r][j], ones)), x_scale, dot[r][j]);
        }
      }
    }
    add_int4_group<Rows>(p, block, g, dot, total);
  }
  for (int r = 0; r < Rows; ++r) {
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(c + r * kBlockN + 8 * j, total[r][j]);
  }
}

// 8 fp32 -> their bf16 bits (round to nearest even) in the low half of each 32-bit lane.
static inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
}

// An int4 block as bf16 in the packed order, scaled: q * s - z * s in fp32 is (q - z) * s exactly,
// rounded to bf16 once (as linear_avx512.cpp's dequantize_int4_block).
static void dequantize_int4_block(const LinearProblem& p, int64_t block, uint16_t* out) {
  const uint8_t* w = p.wq + block * pairs_between_blocks(p) * kInt4PairBytes;
  const __m256i byte = _mm256_set1_epi32(0xFF), low = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < p.k_groups && g * kInt4GroupPairs < p.K_pairs; ++g) {  // (a K chunk: its groups)
    const uint16_t* params = int4_group_params(p, block, g);
    __m256 scale[4], shift[4];  // columns 8j..8j+7
    for (int j = 0; j < 4; ++j) {
      scale[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(params + 8 * j)));
      const __m256 zero = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(params + kBlockN + 8 * j)));
      shift[j] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(zero, scale[j]));
    }
    for (int64_t q = g * kInt4GroupPairs, end = std::min(q + kInt4GroupPairs, p.K_pairs); q < end; q += 2) {
      for (int half = 0; half < 2; ++half) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * kInt4PairBytes + 32 * half));
        for (int h = 0; h < 2; ++h) {  // columns 16h + 8 half ..: byte j of each lane is input 2q + j
          const int j = 2 * h + half;
          const __m256i values = h == 0 ? _mm256_and_si256(raw, low) : _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
          for (int pair = 0; pair < 2; ++pair) {
            const __m256 first = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(values, 16 * pair), byte));
            const __m256 second = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(values, 16 * pair + 8), byte));
            const __m256i bits = _mm256_or_si256(bf16_bits8(_mm256_fmadd_ps(first, scale[j], shift[j])),
                                                 _mm256_slli_epi32(bf16_bits8(_mm256_fmadd_ps(second, scale[j], shift[j])), 16));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (q + pair) * kPairStride + 16 * j), bits);
          }
        }
      }
    }
  }
}

template <WeightFormat F>
static void dequantize_block(const LinearProblem& p, int64_t block, uint16_t* out) {
  const uint8_t* w = p.wq + block * pairs_between_blocks(p) * kQPairBytes;
  for (int64_t q = 0; q < p.K_pairs; ++q) {
    const __m256 scale = group_scale<F>(p, block, q);
    for (int j = 0; j < 4; ++j) {
      __m256 lo, hi;
      load_quantized16<F>(w + q * kQPairBytes + 16 * j, lo, hi);
      if (F == WeightFormat::fp8) {
        lo = _mm256_mul_ps(lo, scale);
        hi = _mm256_mul_ps(hi, scale);
      }
      store_bf16x8(out + q * kPairStride + 16 * j, lo);
      store_bf16x8(out + q * kPairStride + 16 * j + 8, hi);
    }
  }
}

// The AVX2 micro-kernels as linear_walk.h calls them (over fp32 x, or int16 words for int8 decode and GEMMs).
struct Avx2Unit {
  static constexpr bool kTwoStreams = false;
  static constexpr int64_t kTwoBlockRows = 1;  // (two blocks' fp32 sums of two rows would spill its 16 registers)
  // q_blocks' rows: int8 and fp8 to kGemvRows (rows 2-3 over each chunk from L1, over_chunks); int4 2 (q_block
  // runs rows 2-3 as a second pass over the block)
  static constexpr int64_t q_register_rows(WeightFormat format) { return format == WeightFormat::int4 ? 2 : kGemvRows; }
  // int8 and int4 prefill over int16 words x (linear_walk.h walk_quantized)
  static constexpr ActivationForm kIntegerGemmForm = ActivationForm::int16_words;
  template <WeightFormat F>
  static void integer_gemm_block(const LinearProblem& p, int64_t block, float* c) {
    if constexpr (F == WeightFormat::int4) {
      int4_word_gemm(p, block, c);
    } else {
      int8_word_gemm(p, block, c);
    }
  }
  template <WeightFormat F, int Rows, int Blocks>
  static void q_blocks(const LinearProblem& p, const int64_t* blocks, float* const* c) {
    static_assert(Blocks == 1, "the AVX2 unit streams one quantized block at a time");
    with_prefetch(p, [&](auto as) {
      constexpr Prefetch P = decltype(as)::value;
      // Where the walk is tuned to two streams: a block's halves of K side by side (int8, fp8).
      const bool halves = p.streams == 2;
      if constexpr (F == WeightFormat::int8) {
        if (halves) return int8_word_gemv<Rows, P, 2>(p, blocks[0], c[0]);
        int8_word_gemv<Rows, P, 1>(p, blocks[0], c[0]);
      } else if constexpr (F == WeightFormat::int4) {
        if (p.x_form == ActivationForm::int8_groups) {
          int4_gemv_bytes<Rows, P>(p, blocks[0], c[0]);
        } else {
          int4_gemv_words<Rows, P>(p, blocks[0], c[0]);
        }
      } else {
        if (Rows == 1 && !halves) return fp8_gemv_row<P>(p, p.x_fp32(), blocks[0], c[0]);
        if (halves) return fp8_gemv_rows<Rows, P, 2>(p, blocks[0], c[0]);
        fp8_gemv_rows<Rows, P, 1>(p, blocks[0], c[0]);
      }
    });
  }
  template <WeightFormat F>
  static void dequantize(const LinearProblem& p, int64_t block, uint16_t* out) {
    if constexpr (F == WeightFormat::int4) {
      dequantize_int4_block(p, block, out);
    } else {
      dequantize_block<F>(p, block, out);
    }
  }
  static void two_blocks(const LinearProblem& p, const uint16_t* a, const uint16_t* b, float* c_a, float* c_b) {
    with_prefetch(p, [&](auto as) {
      gemv_row_two_blocks<decltype(as)::value>(p.x_fp32(), a, b, p.K_pairs, p.prefetch_bytes, c_a, c_b);
    });
  }
  static void one_block(const LinearProblem& p, const uint16_t* block, float* c) {
    if (p.M > kGemvRows) return gemm_block(p, block, c);
    with_prefetch(p, [&](auto as) {
      constexpr Prefetch P = decltype(as)::value;
      const float* x = p.x_fp32();
      if (p.M == 1) return gemv_row<P>(x, block, 0, p.K_pairs, p.prefetch_bytes, c);
      // 2-4 rows (over_chunks). Where the walk is tuned to two streams (M = 1 reads two blocks at once), the
      // block's first and second halves of K are read side by side into the same accumulators; 2 rows in one
      // chunk, 3-4 kBf16ChunkPairs at a time, so the streams (and their prefetch) never wait for a second pass
      // over the whole block. A chunk from pair 0 stores its sums, the others add to them.
      const int64_t second = p.streams == 2 ? p.K_pairs / 2 : 0;  // pairs [2 * second, K_pairs) run after
      const int64_t end = second ? second : p.K_pairs, tail = second ? 2 * second : p.K_pairs;
      const int64_t chunk = p.M == 2 ? p.K_pairs : kBf16ChunkPairs;
      auto add = [&](auto rows, auto prefetch, auto streams, int r0, int64_t p0, int64_t p1, int64_t offset) {
        constexpr Prefetch Q = decltype(prefetch)::value;
        constexpr int S = decltype(streams)::value;
        const float* xr = x + r0 * p.ldx;
        float* cr = c + r0 * kBlockN;
        if constexpr (decltype(rows)::value == 2) {
          gemv_two_rows<Q, S>(xr, p.ldx, block, p0, p1, p.prefetch_bytes, cr, p0 > 0, offset);
        } else {
          gemv_row<Q, S>(xr, block, p0, p1, p.prefetch_bytes, cr, p0 > 0, offset);
        }
      };
      auto run = [&](auto rows) {
        constexpr int R = decltype(rows)::value;
        if (second) return over_chunks<R, P, 2>(end, chunk, second, tail, p.K_pairs, add);
        over_chunks<R, P, 1>(end, chunk, 0, tail, p.K_pairs, add);
      };
      if (p.M == 2) return run(std::integral_constant<int, 2>{});
      if (p.M == 3) return run(std::integral_constant<int, 3>{});
      run(std::integral_constant<int, 4>{});
    });
  }
  static void store(const LinearProblem& p, int64_t col0, const float* c) { store_block(p, col0, c); }
  static void store_silu_mul(const LinearProblem& p, int64_t col0, const float* gate, const float* up) {
    store_block_silu_mul(p, col0, gate, up);
  }
};

}  // namespace

namespace {

// A thread's packed x (pack_x_tiles), grown as needed and kept for its next GEMM; freed when the thread ends.
// Raw memory rather than a std::vector: an ISA unit compiles no standard container's code (kernels.h).
struct TileBuffer {
  float* data = nullptr;
  int64_t floats = 0;
  ~TileBuffer() { std::free(data); }
  float* get(int64_t n) {
    if (n > floats) {
      std::free(data);
      data = static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64));
      floats = data ? n : 0;
      if (!data) throw std::bad_alloc();
    }
    return data;
  }
};

}  // namespace

// A GEMM (M > kGemvRows) runs kPackRows rows of x at a time (a last chunk of up to kGemvRows more rows joins
// the one before: so few would be a decode, which reads x unpacked, and for 1-2 rows of int8 or int4, as words),
// each chunk packed in tiles by this thread first (fp32 x, or int8's int16 words: pack_word_tiles); its output rows
// are the chunk's.
void linear_blocks_avx2(const LinearProblem& p, int64_t block_begin, int64_t block_end, float* scratch) {
  if (p.M <= kGemvRows) return walk<Avx2Unit>(p, block_begin, block_end, scratch);
  static thread_local TileBuffer tiles;
  const bool words = p.x_form == ActivationForm::int16_words;  // int8's and int4's GEMMs over words
  for (int64_t m0 = 0; m0 < p.M;) {
    const int64_t left = p.M - m0;
    const int64_t rows = left <= kPackRows + kGemvRows ? left : kPackRows;
    LinearProblem chunk = p;
    if (words) {
      uint32_t* packed = reinterpret_cast<uint32_t*>(
          tiles.get((rows + kWordTileRows - 1) / kWordTileRows * p.K_pairs * kWordTileRows));
      const bool int4 = p.format == WeightFormat::int4;  // (int4_word_gemm: pairs of K pairs, x_sums)
      pack_word_tiles(p.x_words() + m0 * (p.ldx / 2), rows, p.ldx / 2, p.K_pairs, packed, int4 ? 2 : 1);
      chunk.x = packed;
      chunk.x_scales = p.x_scales + m0;
      if (int4) chunk.x_sums = p.x_sums + m0 * p.k_groups;
    } else {
      float* packed = tiles.get((rows + kTileRows - 1) / kTileRows * p.K_pairs * kTilePairFloats);
      pack_x_tiles(p.x_fp32() + m0 * p.ldx, rows, p.ldx, p.K_pairs, packed);
      chunk.x = packed;
    }
    chunk.M = rows;
    if (p.y) chunk.y = p.y + m0 * p.ldy;
    if (p.yf) chunk.yf = p.yf + m0 * p.ldy;
    walk<Avx2Unit>(chunk, block_begin, block_end, scratch);
    m0 += rows;
  }
}

namespace {

// UnitEpilogue::interleave_rows, 16 columns a step: unpack within 128-bit lanes, then the lanes in order.
void interleave_rows(const uint16_t* a, const uint16_t* b, int64_t n, uint16_t* out) {
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t c = 0; c < n; c += 16) {
    const __m256i va = a ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c)) : zero;
    const __m256i vb = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c)) : zero;
    const __m256i lo = _mm256_unpacklo_epi16(va, vb), hi = _mm256_unpackhi_epi16(va, vb);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * c), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * c + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
  }
}

// UnitEpilogue::scaled_bf16
void scaled_bf16(const float* x, float scale, int64_t n, uint16_t* out) {
  const __m256 vscale = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store_bf16x8(out + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vscale));
  for (; i < n; ++i) out[i] = float_to_bf16(x[i] * scale);
}

// UnitEpilogue::scale_columns, a row's kBlockN columns as four vectors
void scale_columns(float* c, const float* s, int64_t rows) {
  static_assert(kBlockN == 32, "scale_columns takes a block's columns as four vectors");
  const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8), s2 = _mm256_loadu_ps(s + 16),
               s3 = _mm256_loadu_ps(s + 24);
  for (int64_t m = 0; m < rows; ++m, c += kBlockN) {
    _mm256_storeu_ps(c, _mm256_mul_ps(_mm256_loadu_ps(c), s0));
    _mm256_storeu_ps(c + 8, _mm256_mul_ps(_mm256_loadu_ps(c + 8), s1));
    _mm256_storeu_ps(c + 16, _mm256_mul_ps(_mm256_loadu_ps(c + 16), s2));
    _mm256_storeu_ps(c + 24, _mm256_mul_ps(_mm256_loadu_ps(c + 24), s3));
  }
}

// UnitEpilogue::rms_norm_row, 8 values a vector, the last n % 8 one at a time.
void rms_norm_row(const uint16_t* x, const uint16_t* residual, int64_t n, const uint16_t* weight, float eps,
                  uint16_t* sum, uint16_t* out) {
  const int64_t whole = n / 8 * 8;
  __m256 squares = _mm256_setzero_ps();
  float tail_squares = 0.0f;
  const uint16_t* row = x;
  if (residual != nullptr) {  // the sum rounded to bf16 as HF's add rounds it; the norm reads it back from L1
    for (int64_t i = 0; i < whole; i += 8) store_bf16x8(sum + i, _mm256_add_ps(load_bf16x8(x + i), load_bf16x8(residual + i)));
    for (int64_t i = whole; i < n; ++i) sum[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(residual[i]));
    row = sum;
  }
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 v = load_bf16x8(row + i);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  for (int64_t i = whole; i < n; ++i) tail_squares += bf16_to_float(row[i]) * bf16_to_float(row[i]);
  const __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(squares), _mm256_extractf128_ps(squares, 1));
  const __m128 half = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
  const float total = _mm_cvtss_f32(_mm_add_ss(half, _mm_shuffle_ps(half, half, 1))) + tail_squares;
  const float scale = 1.0f / std::sqrt(total / float(n) + eps);
  const __m256 scales = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < whole; i += 8) {
    uint16_t normed[8];
    store_bf16x8(normed, _mm256_mul_ps(load_bf16x8(row + i), scales));
    store_bf16x8(out + i, _mm256_mul_ps(load_bf16x8(weight + i), load_bf16x8(normed)));
  }
  for (int64_t i = whole; i < n; ++i) {
    out[i] = float_to_bf16(bf16_to_float(weight[i]) * bf16_to_float(float_to_bf16(bf16_to_float(row[i]) * scale)));
  }
}

// UnitEpilogue::weighted_sum_row, 8 values a vector, the last n % 8 one at a time.
void weighted_sum_row(const uint16_t* const* rows, const float* weights, int64_t k, int64_t n, uint16_t* out) {
  const int64_t whole = n / 8 * 8;
  for (int64_t i = 0; i < whole; i += 8) {
    __m256 sum = _mm256_setzero_ps();
    for (int64_t s = 0; s < k; ++s) sum = _mm256_fmadd_ps(_mm256_set1_ps(weights[s]), load_bf16x8(rows[s] + i), sum);
    store_bf16x8(out + i, sum);
  }
  weighted_sum_values(rows, weights, k, whole, n, out);
}

}  // namespace

const UnitEpilogue& unit_epilogue_avx2() {
  static const UnitEpilogue epilogue{
      {nullptr, dequantize_block<WeightFormat::int8>, dequantize_block<WeightFormat::fp8>, dequantize_int4_block},
      store_block,
      store_block_silu_mul,
      flash_block_softmax_avx2,
      interleave_rows,
      transpose_pairs_plain,
      scaled_bf16,
      scale_columns,
      rms_norm_row,
      weighted_sum_row};
  return epilogue;
}

void bf16_to_float_avx2(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(src + i));
  for (; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

namespace {

template <int Streams>
float stream_read(const char* data, int64_t bytes) {
  const int64_t per_stream = bytes / Streams;
  __m256i acc[Streams];
  for (int s = 0; s < Streams; ++s) acc[s] = _mm256_setzero_si256();
  for (int64_t i = 0; i < per_stream; i += 128) {
    for (int s = 0; s < Streams; ++s) {
      const __m256i* q = reinterpret_cast<const __m256i*>(data + s * per_stream + i);
      const __m256i ab = _mm256_xor_si256(_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1));
      const __m256i cd = _mm256_xor_si256(_mm256_loadu_si256(q + 2), _mm256_loadu_si256(q + 3));
      acc[s] = _mm256_xor_si256(acc[s], _mm256_xor_si256(ab, cd));
    }
  }
  int sum = 0;
  for (int s = 0; s < Streams; ++s) sum += _mm256_extract_epi32(acc[s], 0) & 0xFF;
  return static_cast<float>(sum);
}

}  // namespace

void quantize_words_avx2(const float* x, int64_t rows, int64_t ldx, uint32_t* words, float* scales) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = x + m * ldx;
    int16_t* out = reinterpret_cast<int16_t*>(words + m * (ldx / 2));
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 largest = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= ldx; k += 8) largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, _mm256_loadu_ps(row + k)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, largest);
    float top = 0.0f;
    for (float v : lanes) top = std::max(top, v);
    for (int64_t t = k; t < ldx; ++t) top = std::max(top, std::fabs(row[t]));
    const float scale = top > 0.0f ? top / 32767.0f : 1.0f;
    scales[m] = scale;
    const __m256 inverse = _mm256_set1_ps(1.0f / scale);
    k = 0;
    for (; k + 16 <= ldx; k += 16) {  // round to nearest even (the default rounding mode), pack, undo the lane interleave
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k), inverse));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k + 8), inverse));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
    for (; k < ldx; ++k) out[k] = static_cast<int16_t>(std::nearbyint(row[k] * (1.0f / scale)));
  }
}

void quantize_groups_avx2(const float* x, int64_t rows, int64_t ldx, int8_t* bytes, float* scales, float* sums,
                          int32_t* totals) {
  const auto absmax = [](const float* values, int64_t n) {
    float top = 0.0f;
    for (int64_t k = 0; k < n; ++k) top = std::max(top, std::fabs(values[k]));
    return top;
  };
  const auto round = [](const float* values, int64_t n, float inverse, int8_t* out) {
    int32_t total = 0;
    if (n < kXGroup) {  // a partial last group; round to nearest even (the default rounding mode), |q| <= 127
      for (int64_t k = 0; k < n; ++k) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(values[k] * inverse));
        out[k] = static_cast<int8_t>(v);
        total += v;
      }
      return total;
    }
    const __m256 scale = _mm256_set1_ps(inverse);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(values + 8 * i), scale));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo packs' lane interleave
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permutevar8x32_epi32(packed, order));
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                       _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    for (int32_t v : lanes) total += v;
    return total;
  };
  quantize_x_groups(x, rows, ldx, bytes, scales, sums, totals, absmax, round);
}

float stream_read_avx2(const void* data, int64_t bytes, int streams) {
  const char* p = static_cast<const char*>(data);
  return streams == 2 ? stream_read<2>(p, bytes) : stream_read<1>(p, bytes);
}

}  // namespace tilefx
