// tilefx::linear on AVX512-BF16: `vdpbf16ps` reads the packed layout (kernels.h) as it
// is. One 64-byte load is 16 columns x one K pair, and one instruction multiplies it by
// a broadcast pair of x values and adds both products into 16 fp32 accumulators: no
// widening, half the instructions per weight byte of the AVX2 unit. x comes as bf16
// pairs (ActivationForm::bf16_pairs), the accumulation and epilogues are fp32.
//
// The structure is the AVX2 unit's (linear_avx2.cpp explains the choices; both walk
// the blocks with linear_walk.h): decode (up to kGemvRows rows) streams each block once, as one or two streams
// per thread (on the AVX2 unit two for one row only) with a software prefetch (both tuned per machine, tuning.h);
// prefill is a blocked GEMM over an L1-resident panel of one block and kKChunk K pairs, here
// with micro-tiles of 8 rows x 32 columns (16 zmm accumulators).
//
// The same source builds twice: for the CPU (the `#pragma` in vec_avx512.h; the ops (dispatch.h)
// call it only where CPUID reports AVX512F and AVX512-BF16), and, as
// linear_avx512_emulated.cpp, on SIMDe's portable implementations of the same
// intrinsics, so that the tests check this unit's logic on CPUs without AVX512.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "vec_avx512.h"
#include "bf16_scalar.h"
#include "linear_walk.h"

namespace tilefx {
namespace {

constexpr int64_t kPairStride = kPairValues;  // bf16 elements per K pair in a block: two zmm
constexpr int64_t kKChunk = 128;              // K pairs per L1-resident weight panel (GEMM): 16 KiB
constexpr int kTileRows = 8;                  // rows of x per GEMM micro-tile (x 2 zmm accumulators)

// 16 columns x one K pair of a block.
static inline __m512bh load_pairs(const uint16_t* p) { return as_pairs(_mm512_loadu_si512(p)); }

// x[2p], x[2p + 1] in every lane.
static inline __m512bh broadcast_pair(uint32_t pair) { return as_pairs(_mm512_set1_epi32(static_cast<int>(pair))); }

// GEMV software prefetch: one K pair row (two cache lines) `ahead` bytes past `row`, in one stream
// (LinearProblem::prefetch_bytes and prefetch_hint, tuned per machine).
template <Prefetch P>
static inline void prefetch_ahead(const uint16_t* row, int64_t ahead) {
  const char* line = reinterpret_cast<const char*>(row) + ahead;
  prefetch<P>(line);
  prefetch<P>(line + 64);
}

// The values of `live` (the others 0), read only where it is set.
static inline __m512 load_bf16x16_masked(const uint16_t* p, __mmask16 live) {
  return widen_bf16x16(_mm256_maskz_loadu_epi16(live, p));
}

// silu(g) * u = g * u / (1 + exp(-g)), the division as a reciprocal estimate and one Newton step (~1 ulp):
// `vdivps` issues once per ~10 cycles, and at a prompt's gate/up it bounded the SiLU-and-mul epilogue. -g is
// capped at 80 (silu(g) under 1e-33 |g| past it either way), so that 1 / (1 + exp(-g)) stays a normal float: a
// subnormal reciprocal costs a microcode assist per lane (random gates of std 45 ran the epilogue 3x slower).
static inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 minus_g = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(80.0f));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(minus_g));
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(_mm512_mul_ps(g, u), _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f))));
}

// 1 to kGemvRows rows of x against two blocks at once (two streams): c_a and c_b get each block's rows.
template <int Rows, Prefetch P>
static void gemv_rows_two_blocks(const uint32_t* x, int64_t ldp, const uint16_t* block_a, const uint16_t* block_b,
                                 int64_t pairs, int64_t ahead, float* c_a, float* c_b) {
  __m512 a[Rows][2], b[Rows][2];
  for (int m = 0; m < Rows; ++m) a[m][0] = a[m][1] = b[m][0] = b[m][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* row_a = block_a + p * kPairStride;
    const uint16_t* row_b = block_b + p * kPairStride;
    prefetch_ahead<P>(row_a, ahead);
    prefetch_ahead<P>(row_b, ahead);
    const __m512bh a_lo = load_pairs(row_a), a_hi = load_pairs(row_a + 32);
    const __m512bh b_lo = load_pairs(row_b), b_hi = load_pairs(row_b + 32);
    for (int m = 0; m < Rows; ++m) {
      const __m512bh xp = broadcast_pair(x[m * ldp + p]);
      a[m][0] = _mm512_dpbf16_ps(a[m][0], a_lo, xp);
      a[m][1] = _mm512_dpbf16_ps(a[m][1], a_hi, xp);
      b[m][0] = _mm512_dpbf16_ps(b[m][0], b_lo, xp);
      b[m][1] = _mm512_dpbf16_ps(b[m][1], b_hi, xp);
    }
  }
  for (int m = 0; m < Rows; ++m) {
    _mm512_storeu_ps(c_a + m * kBlockN, a[m][0]);
    _mm512_storeu_ps(c_a + m * kBlockN + 16, a[m][1]);
    _mm512_storeu_ps(c_b + m * kBlockN, b[m][0]);
    _mm512_storeu_ps(c_b + m * kBlockN + 16, b[m][1]);
  }
}

// 1 to kGemvRows rows of x against one block, every K pair (decode, one stream): the weight
// is read once, with the walk's prefetch, however many rows. A batch of 3 or 4 ran the GEMM's
// micro-tile before, which has no prefetch: on an Emerald Rapids core that read half the
// one-row walk's GB/s.
template <int Rows, Prefetch P>
static void gemv_rows(const uint32_t* x, int64_t ldp, const uint16_t* block, int64_t pairs, int64_t ahead,
                      float* c) {
  __m512 acc[Rows][2];
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* row = block + p * kPairStride;
    prefetch_ahead<P>(row, ahead);
    const __m512bh lo = load_pairs(row), hi = load_pairs(row + 32);
    for (int m = 0; m < Rows; ++m) {
      const __m512bh xp = broadcast_pair(x[m * ldp + p]);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], lo, xp);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], hi, xp);
    }
  }
  for (int m = 0; m < Rows; ++m) {
    _mm512_storeu_ps(c + m * kBlockN, acc[m][0]);
    _mm512_storeu_ps(c + m * kBlockN + 16, acc[m][1]);
  }
}

// GEMM micro-tile: `Rows` (<= kTileRows) rows x the block's 32 columns, K pairs
// [p0, p1); adds into c (row stride kBlockN).
template <int Rows>
static void gemm_tile(const uint32_t* x, int64_t ldp, const uint16_t* block, int64_t p0, int64_t p1, float* c) {
  __m512 acc[Rows][2];
  for (int m = 0; m < Rows; ++m) {
    acc[m][0] = _mm512_loadu_ps(c + m * kBlockN);
    acc[m][1] = _mm512_loadu_ps(c + m * kBlockN + 16);
  }
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* row = block + p * kPairStride;
    const __m512bh lo = load_pairs(row), hi = load_pairs(row + 32);
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      const __m512bh xp = broadcast_pair(x[m * ldp + p]);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], lo, xp);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], hi, xp);
    }
  }
  for (int m = 0; m < Rows; ++m) {
    _mm512_storeu_ps(c + m * kBlockN, acc[m][0]);
    _mm512_storeu_ps(c + m * kBlockN + 16, acc[m][1]);
  }
}

static void gemm_block(const LinearProblem& p, const uint16_t* block, float* c) {
  const int64_t ldp = p.ldx / 2;
  for (int64_t i = 0; i < p.M * kBlockN; i += 16) _mm512_storeu_ps(c + i, _mm512_setzero_ps());
  over_gemm_tiles<kTileRows>(p, kKChunk, [&](int64_t p0, int64_t p1, int64_t m, auto rows) {
    gemm_tile<decltype(rows)::value>(p.x_pairs() + m * ldp, ldp, block, p0, p1, c + m * kBlockN);
  });
}

// Whether a row's kBlockN bf16 outputs from `y` go out as non-temporal stores (LinearProblem::stream_y): a whole
// block's, two 32-byte stores to one cache line.
static inline bool streams_row(const LinearProblem& p, const uint16_t* y, int64_t cols) {
  return p.stream_y && cols == kBlockN && reinterpret_cast<uintptr_t>(y) % 32 == 0;
}

// 16 fp32 -> 16 bf16 at p, non-temporal where `stream` (streams_row).
static inline void put_bf16x16(uint16_t* p, __m512 v, bool stream) {
  if (stream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), round_bf16x16(v));
  } else {
    store_bf16x16(p, v);
  }
}

// c (fp32, rows of kBlockN) + bias -> y, columns [col0, col0 + kBlockN) clipped to N.
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
    const bool stream = streams_row(p, y, cols);
    for (; j + 16 <= cols; j += 16) {
      __m512 v = _mm512_loadu_ps(cm + j);
      if (p.bias) v = _mm512_add_ps(v, load_bf16x16(p.bias + col0 + j));
      put_bf16x16(y + j, v, stream);
    }
    for (; j < cols; ++j) y[j] = float_to_bf16(cm[j] + (p.bias ? bf16_to_float(p.bias[col0 + j]) : 0.0f));
  }
}

// Gate and up results -> y = silu(gate) * up, columns [col0, col0 + kBlockN) clipped to N.
static void store_block_silu_mul(const LinearProblem& p, int64_t col0, const float* gate, const float* up) {
  const int64_t cols = p.N - col0 < kBlockN ? p.N - col0 : kBlockN;
  for (int64_t m = 0; m < p.M; ++m) {
    const float* g = gate + m * kBlockN;
    const float* u = up + m * kBlockN;
    int64_t j = 0;
    const bool stream = !p.yf && streams_row(p, p.y + m * p.ldy + col0, cols);
    for (; j + 16 <= cols; j += 16) {
      const __m512 v = silu_mul16(_mm512_loadu_ps(g + j), _mm512_loadu_ps(u + j));
      if (p.yf) {
        _mm512_storeu_ps(p.yf + m * p.ldy + col0 + j, v);
      } else {
        put_bf16x16(p.y + m * p.ldy + col0 + j, v, stream);
      }
    }
    for (; j < cols; ++j) {
      const float v = g[j] * u[j] / (1.0f + __builtin_expf(-g[j]));
      if (p.yf) {
        p.yf[m * p.ldy + col0 + j] = v;
      } else {
        p.y[m * p.ldy + col0 + j] = float_to_bf16(v);
      }
    }
  }
}

// -- quantized weights (kernels.h): fp32 FMAs over values widened in registers --------


// Decode reads 1-byte values straight into `vdpbf16ps`: every e4m3 value and every int8
// magnitude is exact in bf16, so a 128-entry table maps a byte's low 7 bits to its bf16
// magnitude (`vpermi2b` per result byte, AVX512-VBMI) and the sign comes from the byte's
// top bit (int8 looks its absolute value up). A K pair row of a block (64 bytes) becomes
// two vectors of bf16 pairs in 4 instructions plus 2 `vdpbf16ps`, against 20 for widening
// to fp32 (the first version), which left fp8 decode compute-bound (docs/PERFORMANCE.md).
struct ByteTables {
  uint8_t lo[128], hi[128];  // low and high byte of the bf16 value of each 7-bit magnitude code
};

// The bf16 bits of mantissa * 2^exponent (mantissa < 256: always exact).
constexpr uint16_t bf16_of(int mantissa, int exponent) {
  if (mantissa == 0) return 0;
  int top = 7;
  while (!(mantissa >> top)) --top;
  return static_cast<uint16_t>(((top + exponent + 127) << 7) | ((mantissa << (7 - top)) & 0x7F));
}

template <WeightFormat F>
constexpr ByteTables magnitude_tables() {
  ByteTables t{};
  for (int code = 0; code < 128; ++code) {
    const int e = code >> 3, m = code & 7;  // e4m3: (1 + m/8) 2^(e-7), subnormal m 2^-9; int8: the code itself
    const uint16_t v = F == WeightFormat::int8 ? bf16_of(code, 0) : e ? bf16_of(8 + m, e - 10) : bf16_of(m, -9);
    t.lo[code] = static_cast<uint8_t>(v & 0xFF);
    t.hi[code] = static_cast<uint8_t>(v >> 8);
  }
  return t;
}

alignas(64) constexpr ByteTables kInt8Tables = magnitude_tables<WeightFormat::int8>();
alignas(64) constexpr ByteTables kFp8Tables = magnitude_tables<WeightFormat::fp8>();

struct Tables {
  __m512i lo0, lo1, hi0, hi1;
};

static inline Tables load_tables(const ByteTables& t) {
  return {_mm512_loadu_si512(t.lo), _mm512_loadu_si512(t.lo + 64), _mm512_loadu_si512(t.hi),
          _mm512_loadu_si512(t.hi + 64)};
}

template <WeightFormat F>
static inline Tables load_tables() {
  return load_tables(F == WeightFormat::int8 ? kInt8Tables : kFp8Tables);
}

// fp8's byte tables with one group's scale folded in: each magnitude (its exact bf16 from
// kFp8Tables, widened) times `scale`, rounded to bf16 once (the rounding the dequantized panel
// always had), so that the GEMM's fp8 panel is the same table decode as int8's, rebuilt once
// per 128 inputs of a block (~40 instructions against 64 rows of 9) instead of widening every
// value to fp32 to scale it.
static inline Tables scaled_fp8_tables(float scale) {
  alignas(64) uint16_t bf16[128];
  alignas(64) ByteTables t;
  const __m512 s = _mm512_set1_ps(scale);
  for (int i = 0; i < 128; i += 16) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(kFp8Tables.lo + i))));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(kFp8Tables.hi + i))));
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(hi, 24), _mm512_slli_epi32(lo, 16)));
    store_bf16x16(bf16 + i, _mm512_mul_ps(magnitude, s));
  }
  for (int i = 0; i < 128; i += 32) {
    const __m512i v = _mm512_load_si512(bf16 + i);
    _mm256_store_si256(reinterpret_cast<__m256i*>(t.lo + i), _mm512_cvtepi16_epi8(v));
    _mm256_store_si256(reinterpret_cast<__m256i*>(t.hi + i), _mm512_cvtepi16_epi8(_mm512_srli_epi16(v, 8)));
  }
  return load_tables(t);
}

// One K pair row of a quantized block (64 bytes) as bf16 pairs: `a` holds columns 8L..8L+3
// and `b` columns 8L+4..8L+7 of each 128-bit lane L (the unpack order; kColumnOrder undoes it).
template <WeightFormat F>
static inline void load_quantized_pairs(const uint8_t* p, const Tables& t, __m512i& a, __m512i& b) {
  const __m512i raw = _mm512_loadu_si512(p);
  const __m512i index = F == WeightFormat::int8 ? _mm512_abs_epi8(raw) : raw;  // vpermi2b reads 7 bits
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, index, t.lo1);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, index, t.hi1), raw,
                                               _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // | sign
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}

// Lanes of (a, b) in column order: columns 0-15, then 16-31 (indices into a's lanes, then b's as 16-31).
alignas(64) constexpr int32_t kColumnOrder[2][16] = {{0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
                                                     {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};

// `Rows` rows of x (bf16 pairs) against `Blocks` fp8 blocks, every K pair; c[b] (rows of
// kBlockN) gets block b's result with its scales applied per 128 inputs to the partial sums at
// the end of each group. (int8 decode reads x as int16 words instead: int8_word_gemv.)
template <int Rows, int Blocks, Prefetch P>
static void fp8_gemv(const LinearProblem& p, const int64_t* blocks, float* const* c) {
  constexpr WeightFormat F = WeightFormat::fp8;
  const Tables tables = load_tables<F>();
  const uint8_t* w[Blocks];
  for (int b = 0; b < Blocks; ++b) w[b] = p.wq + blocks[b] * pairs_between_blocks(p) * kQPairBytes;
  const int64_t ldp = p.ldx / 2;
  __m512 total[Rows * Blocks][2];
  for (auto& t : total) t[0] = t[1] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < p.K_pairs; g0 += kFp8GroupPairs) {
    const int64_t g1 = g0 + kFp8GroupPairs < p.K_pairs ? g0 + kFp8GroupPairs : p.K_pairs;
    // Even and odd K pair rows accumulate apart: twice the independent vdpbf16ps chains.
    __m512 acc[Rows * Blocks][2], odd[Rows * Blocks][2];
    for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
    for (auto& a : odd) a[0] = a[1] = _mm512_setzero_ps();
    auto add_row = [&](int64_t q, __m512 (&into)[Rows * Blocks][2]) {
      for (int b = 0; b < Blocks; ++b) {
        const uint8_t* row = w[b] + q * kQPairBytes;
        prefetch<P>(row + p.prefetch_bytes);
        __m512i lo, hi;
        load_quantized_pairs<F>(row, tables, lo, hi);
        for (int r = 0; r < Rows; ++r) {
          const __m512bh xp = broadcast_pair(p.x_pairs()[r * ldp + q]);
          into[r * Blocks + b][0] = _mm512_dpbf16_ps(into[r * Blocks + b][0], as_pairs(lo), xp);
          into[r * Blocks + b][1] = _mm512_dpbf16_ps(into[r * Blocks + b][1], as_pairs(hi), xp);
        }
      }
    };
    int64_t q = g0;
    for (; q + 1 < g1; q += 2) {
      add_row(q, acc);
      add_row(q + 1, odd);
    }
    if (q < g1) add_row(q, acc);
    for (int i = 0; i < Rows * Blocks; ++i) {
      acc[i][0] = _mm512_add_ps(acc[i][0], odd[i][0]);
      acc[i][1] = _mm512_add_ps(acc[i][1], odd[i][1]);
      const __m512 scale = _mm512_set1_ps(fp8_scale(p, blocks[i % Blocks], g0));
      total[i][0] = _mm512_fmadd_ps(acc[i][0], scale, total[i][0]);
      total[i][1] = _mm512_fmadd_ps(acc[i][1], scale, total[i][1]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int b = 0; b < Blocks; ++b) {
      const __m512* t = total[r * Blocks + b];
      float* out = c[Blocks > 1 ? b : 0] + r * kBlockN;
      for (int h = 0; h < 2; ++h) {
        _mm512_storeu_ps(out + 16 * h, _mm512_permutex2var_ps(t[0], _mm512_loadu_si512(kColumnOrder[h]), t[1]));
      }
    }
  }
}

// int8 decode over x as int16 words (ActivationForm::int16_words, 15 bits per row): the
// half of a K pair row that holds 16 columns (32 bytes) sign-extends to int16 in one
// `vpmovsxbw`, and one `vpdpwssd` (AVX512-VNNI) multiplies it by the broadcast
// (x[2q], x[2q + 1]) and adds each column's two products into its int32 lane: 4
// instructions per 64 weight bytes and row of x, in column order, against the table
// decode's 9, so it does not run out of instructions before the memory runs out of bytes
// where bandwidth per core is high. As on the AVX2 unit, a sum of kWordPairs pairs, each at most 2 * 127 * 32767,
// stays within int32 before it goes to fp32; even and odd K pair rows accumulate apart.
constexpr int64_t kWordPairs = 128;

template <int Rows, int Blocks, Prefetch P>
static void int8_word_gemv(const LinearProblem& p, const int64_t* blocks, float* const* c) {
  const uint8_t* w[Blocks];
  for (int b = 0; b < Blocks; ++b) w[b] = p.wq + blocks[b] * pairs_between_blocks(p) * kQPairBytes;
  const int64_t ldw = p.ldx / 2;
  __m512 total[Rows * Blocks][2];
  for (auto& t : total) t[0] = t[1] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < p.K_pairs; g0 += kWordPairs) {
    const int64_t g1 = g0 + kWordPairs < p.K_pairs ? g0 + kWordPairs : p.K_pairs;
    __m512i even[Rows * Blocks][2], odd[Rows * Blocks][2];
    for (auto& a : even) a[0] = a[1] = _mm512_setzero_si512();
    for (auto& a : odd) a[0] = a[1] = _mm512_setzero_si512();
    auto add_row = [&](int64_t q, __m512i (&into)[Rows * Blocks][2]) {
      for (int b = 0; b < Blocks; ++b) {
        const uint8_t* row = w[b] + q * kQPairBytes;
        prefetch<P>(row + p.prefetch_bytes);
        const __m512i lo = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
        const __m512i hi = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32)));
        for (int r = 0; r < Rows; ++r) {
          const __m512i xw = _mm512_set1_epi32(static_cast<int>(p.x_words()[r * ldw + q]));
          into[r * Blocks + b][0] = _mm512_dpwssd_epi32(into[r * Blocks + b][0], lo, xw);
          into[r * Blocks + b][1] = _mm512_dpwssd_epi32(into[r * Blocks + b][1], hi, xw);
        }
      }
    };
    int64_t q = g0;
    for (; q + 1 < g1; q += 2) {
      add_row(q, even);
      add_row(q + 1, odd);
    }
    if (q < g1) add_row(q, even);
    for (int i = 0; i < Rows * Blocks; ++i) {
      for (int h = 0; h < 2; ++h) {
        total[i][h] = _mm512_add_ps(total[i][h], _mm512_cvtepi32_ps(_mm512_add_epi32(even[i][h], odd[i][h])));
      }
    }
  }
  for (int r = 0; r < Rows; ++r) {
    const __m512 x_scale = _mm512_set1_ps(p.x_scales[r]);
    for (int b = 0; b < Blocks; ++b) {
      float* out = c[Blocks > 1 ? b : 0] + r * kBlockN;
      for (int h = 0; h < 2; ++h) {
        const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(p.scales + blocks[b] * kBlockN + 16 * h), x_scale);
        _mm512_storeu_ps(out + 16 * h, _mm512_mul_ps(total[r * Blocks + b][h], scale));
      }
    }
  }
}

// int8 prefill over x as int8 per kXGroup inputs (ActivationForm::int8_groups, activations.h; more than
// kGemvRows rows, K a multiple of 4): the weight's bytes multiply x's in `vpdpbusd` (AVX512-VNNI), 64 products
// an instruction where `vdpbf16ps` over a dequantized panel makes 32, and the block is read as it is packed, no
// panel. Two K pair rows unpacked by 16 bits give each 32-bit lane four inputs of one column (`lo` columns
// 8L..8L+3 and `hi` 8L+4..8L+7 of each 128-bit lane L, kColumnOrder's order); `vpdpbusd` takes its first
// operand unsigned, so the weight's bytes are flipped to w + 128 and each kXGroup's sums start at -128 times its
// sum of bytes (x_totals): exact in int32, where taking 128 * sum(x) off the fp32 total at the end would lose the
// bits of an output much smaller than it (an outlying input's group: ~1e5 times, test_quantized_ops). A kXGroup's
// int32 sums (8 steps, each at most 4 * 255 * 127 a lane, plus the start) go to fp32 times its x scale; the column
// scales multiply the total. One core ran this 1.7x the rate of the bf16 GEMM's `vdpbf16ps` on Zen 4 (a scratch
// loop on hot weights; 1.4x in the linear ops, docs/PERFORMANCE.md).
constexpr int kGroupTileRows = 6;  // rows per micro-tile: 12 int32 and 12 fp32 accumulators

// acc + the products of a's unsigned and b's signed bytes, four a lane (`vpdpbusd`). Written as the instruction is,
// destructive on acc: through the intrinsic GCC kept each accumulator in another register and copied it there and
// back around every instruction (24 copies to 12 `vpdpbusd` a step), and spilled the fp32 totals.
static inline __m512i dot_bytes(__m512i acc, __m512i a, __m512i b) {
#ifdef TILEFX_AVX512_EMULATED
  return _mm512_dpbusd_epi32(acc, a, b);
#else
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
#endif
}

// dot_bytes with b four signed bytes from memory, broadcast to every lane by the instruction itself (`{1to16}`):
// no register holds the broadcast.
static inline __m512i dot_bytes_broadcast(__m512i acc, __m512i a, const uint8_t* b) {
#ifdef TILEFX_AVX512_EMULATED
  int32_t four;
  std::memcpy(&four, b, sizeof four);
  return _mm512_dpbusd_epi32(acc, a, _mm512_set1_epi32(four));
#else
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*reinterpret_cast<const int32_t*>(b)));
  return acc;
#endif
}

template <int Rows>
static void int8_group_tile(const LinearProblem& p, const uint8_t* block, int64_t q0, int64_t q1, int64_t m0,
                            float* c) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t groups = x_groups(p.ldx);
  __m512 total[Rows][2];
  for (int r = 0; r < Rows; ++r) {
    total[r][0] = _mm512_loadu_ps(c + r * kBlockN);
    total[r][1] = _mm512_loadu_ps(c + r * kBlockN + 16);
  }
  for (int64_t g0 = q0; g0 < q1; g0 += kXGroupPairs) {
    const int64_t g1 = g0 + kXGroupPairs < q1 ? g0 + kXGroupPairs : q1;
    __m512i dot[Rows][2];
    for (int r = 0; r < Rows; ++r) {
      dot[r][0] = dot[r][1] = _mm512_set1_epi32(-128 * p.x_totals[(m0 + r) * groups + g0 / kXGroupPairs]);
    }
    for (int64_t q = g0; q < g1; q += 2) {  // K_pairs is even (K a multiple of 4)
      const __m512i even = _mm512_loadu_si512(block + q * kQPairBytes);
      const __m512i odd = _mm512_loadu_si512(block + (q + 1) * kQPairBytes);
      const __m512i lo = _mm512_xor_si512(_mm512_unpacklo_epi16(even, odd), flip);
      const __m512i hi = _mm512_xor_si512(_mm512_unpackhi_epi16(even, odd), flip);
#pragma GCC unroll 6
      for (int r = 0; r < Rows; ++r) {
        int32_t four;
        std::memcpy(&four, p.x_bytes() + (m0 + r) * p.ldx + 2 * q, sizeof four);
        const __m512i xb = _mm512_set1_epi32(four);
        dot[r][0] = dot_bytes(dot[r][0], lo, xb);
        dot[r][1] = dot_bytes(dot[r][1], hi, xb);
      }
    }
    for (int r = 0; r < Rows; ++r) {
      const __m512 x_scale = _mm512_set1_ps(p.x_scales[(m0 + r) * groups + g0 / kXGroupPairs]);
      total[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][0]), x_scale, total[r][0]);
      total[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][1]), x_scale, total[r][1]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    _mm512_storeu_ps(c + r * kBlockN, total[r][0]);
    _mm512_storeu_ps(c + r * kBlockN + 16, total[r][1]);
  }
}

// Every row of p against int8 block `block` over int8_groups x, into c (rows of kBlockN, column order, scaled):
// K in chunks of kKChunk pairs (8 KiB of the block, in L1 while the row tiles pass), as gemm_block.
static void int8_group_gemm(const LinearProblem& p, int64_t block, float* c) {
  const uint8_t* w = p.wq + block * pairs_between_blocks(p) * kQPairBytes;
  for (int64_t i = 0; i < p.M * kBlockN; i += 16) _mm512_storeu_ps(c + i, _mm512_setzero_ps());
  over_gemm_tiles<kGroupTileRows>(p, kKChunk, [&](int64_t q0, int64_t q1, int64_t m, auto rows) {
    int8_group_tile<decltype(rows)::value>(p, w, q0, q1, m, c + m * kBlockN);
  });
  // column order, times the column scales
  const __m512i first = _mm512_loadu_si512(kColumnOrder[0]), second = _mm512_loadu_si512(kColumnOrder[1]);
  const __m512 s0 = _mm512_loadu_ps(p.scales + block * kBlockN), s1 = _mm512_loadu_ps(p.scales + block * kBlockN + 16);
  for (int64_t m = 0; m < p.M; ++m) {
    const __m512 lo = _mm512_loadu_ps(c + m * kBlockN), hi = _mm512_loadu_ps(c + m * kBlockN + 16);
    _mm512_storeu_ps(c + m * kBlockN, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), s0));
    _mm512_storeu_ps(c + m * kBlockN + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), s1));
  }
}

// int4 decode over x as int8 per kXGroup inputs (ActivationForm::int8_groups, TILEFX_INT4_ACTIVATIONS=int8;
// kernels.h has the nibble order): one 64-byte load holds four inputs of the block's 32 columns; a mask
// gives columns 0-15 and one `gf2p8affineqb` (GFNI) columns 16-31, each lane four values of one column, and
// one `vpdpbusd` each adds a lane's four products of nibbles (unsigned) and x's bytes (signed, one
// broadcast shared by both halves and both streams). About 6 instructions per 64 weight bytes, two of them
// VNNI: int8's count per byte (int4_gemv_words, below, takes four). Each kXGroup of x goes to fp32 with its
// scale; a weight group's sum over x q minus z times the group's sum of x (x_sums) is its sum over x
// (q - z). A kXGroup is 8 loads, each adding at most 4 * 15 * 128 per lane and accumulator.
// The GFNI bit matrix that takes each byte's high nibble down: output bit i (i < 4) is input bit i + 4
// (row i is byte 7 - i), the others 0.
constexpr int64_t kHighNibble = 0x1020408000000000LL;

// One 64-byte load of an int4 block (four inputs of its 32 columns, prefetching its stream ahead) as the
// nibbles of columns 0-15 and of 16-31, a byte each.
struct Int4Halves {
  __m512i first, second;
};
template <Prefetch P>
static inline Int4Halves load_int4_halves(const uint8_t* row, int64_t prefetch_bytes) {
  prefetch<P>(row + prefetch_bytes);
  const __m512i raw = _mm512_loadu_si512(row);
  return {_mm512_and_si512(raw, _mm512_set1_epi8(0x0F)),
          _mm512_gf2p8affine_epi64_epi8(raw, _mm512_set1_epi64(kHighNibble), 0)};  // each byte >> 4
}

// total[i][h] += s * (dot[i][h] - z * x_sum) for weight group g of each block: dot the group's sum over x q,
// x_sum its sum of x (LinearProblem::x_sums), in the units x was read in.
template <int Rows, int Blocks>
static inline void add_int4_group(const LinearProblem& p, const int64_t* blocks, int64_t g,
                                  const __m512 (&dot)[Rows * Blocks][2], __m512 (&total)[Rows * Blocks][2]) {
  for (int b = 0; b < Blocks; ++b) {
    const uint16_t* params = int4_group_params(p, blocks[b], g);
    for (int h = 0; h < 2; ++h) {
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + 16 * h)));
      const __m512 zero =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + kBlockN + 16 * h)));
      for (int r = 0; r < Rows; ++r) {
        const int i = r * Blocks + b;
        const __m512 x_sum = _mm512_set1_ps(p.x_sums[r * p.k_groups + g]);
        total[i][h] = _mm512_fmadd_ps(_mm512_fnmadd_ps(zero, x_sum, dot[i][h]), scale, total[i][h]);
      }
    }
  }
}

// int4 prefill over x as int8 per kXGroup inputs (ActivationForm::int8_groups; more than kGemvRows rows): the
// nibbles multiply x's bytes in `vpdpbusd` as int4_gemv_bytes does, but over a micro-tile of rows that share each
// load, so a step of two K pairs costs 3 instructions for the block and one broadcast and 2 `vpdpbusd` a row,
// where int8's GEMM takes 6 for its block (the nibbles are unsigned already: no flip, and no sums of bytes to
// start from). A kXGroup's int32 sums go to fp32 times its x scale (`dot`); at each weight group's end the
// group's scale and zero point apply to the row's total in c (int4_gemv_bytes' add_int4_group, once per 128
// inputs, so the totals stay out of the registers: 12 fp32 and 12 int32 accumulators for 6 rows). The nibbles
// come in column order, so the result needs no permutation.
// The chunk's first row tile, which reads the block from memory, prefetches it (kInt4GemmAheadBytes).
template <int Rows>
static void int4_group_tile(const LinearProblem& p, int64_t block, int64_t q0, int64_t q1, int64_t m0, float* c) {
  const uint8_t* w = p.wq + block * pairs_between_blocks(p) * kInt4PairBytes;
  const int64_t ahead = m0 == 0 ? kInt4GemmAheadBytes : 0;
  const int64_t x_row_groups = x_groups(p.ldx);
  for (int64_t g0 = q0; g0 < q1; g0 += kInt4GroupPairs) {  // q0 is a multiple of kInt4GroupPairs
    const int64_t g1 = g0 + kInt4GroupPairs < q1 ? g0 + kInt4GroupPairs : q1;
    __m512 dot[Rows][2];  // this weight group's sum over x q, x's scales applied
    for (auto& d : dot) d[0] = d[1] = _mm512_setzero_ps();
    for (int64_t x0 = g0; x0 < g1; x0 += kXGroupPairs) {
      const int64_t x1 = x0 + kXGroupPairs < g1 ? x0 + kXGroupPairs : g1;
      __m512i sums[Rows][2];
      for (auto& s : sums) s[0] = s[1] = _mm512_setzero_si512();
      for (int64_t q = x0; q < x1; q += 2) {  // K_pairs is even (K a multiple of 4)
        if (ahead) prefetch<Prefetch::t0>(w + q * kInt4PairBytes + ahead);
        const Int4Halves v = load_int4_halves<Prefetch::none>(w + q * kInt4PairBytes, 0);
#pragma GCC unroll 6
        for (int r = 0; r < Rows; ++r) {
          int32_t four;
          std::memcpy(&four, p.x_bytes() + (m0 + r) * p.ldx + 2 * q, sizeof four);
          const __m512i xb = _mm512_set1_epi32(four);
          sums[r][0] = dot_bytes(sums[r][0], v.first, xb);
          sums[r][1] = dot_bytes(sums[r][1], v.second, xb);
        }
      }
      for (int r = 0; r < Rows; ++r) {
        const __m512 x_scale = _mm512_set1_ps(p.x_scales[(m0 + r) * x_row_groups + x0 / kXGroupPairs]);
        dot[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][0]), x_scale, dot[r][0]);
        dot[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][1]), x_scale, dot[r][1]);
      }
    }
    const int64_t g = g0 / kInt4GroupPairs;
    const uint16_t* params = int4_group_params(p, block, g);
    for (int h = 0; h < 2; ++h) {
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + 16 * h)));
      const __m512 zero =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + kBlockN + 16 * h)));
      for (int r = 0; r < Rows; ++r) {
        float* total = c + r * kBlockN + 16 * h;
        const __m512 x_sum = _mm512_set1_ps(p.x_sums[(m0 + r) * p.k_groups + g]);
        _mm512_storeu_ps(total, _mm512_fmadd_ps(_mm512_fnmadd_ps(zero, x_sum, dot[r][h]), scale,
                                                _mm512_loadu_ps(total)));
      }
    }
  }
}

// Every row of p against int4 block `block` over int8_groups x, into c (rows of kBlockN, column order, scaled):
// K in chunks of kKChunk pairs (4 KiB of the block), as int8_group_gemm.
static void int4_group_gemm(const LinearProblem& p, int64_t block, float* c) {
  for (int64_t i = 0; i < p.M * kBlockN; i += 16) _mm512_storeu_ps(c + i, _mm512_setzero_ps());
  over_gemm_tiles<kGroupTileRows>(p, kKChunk, [&](int64_t q0, int64_t q1, int64_t m, auto rows) {
    int4_group_tile<decltype(rows)::value>(p, block, q0, q1, m, c + m * kBlockN);
  });
}

template <int Rows, int Blocks, Prefetch P>
static void int4_gemv_bytes(const LinearProblem& p, const int64_t* blocks, float* const* c) {
  const uint8_t* w[Blocks];
  for (int b = 0; b < Blocks; ++b) w[b] = p.wq + blocks[b] * pairs_between_blocks(p) * kInt4PairBytes;
  const int64_t x_row_groups = x_groups(p.ldx);
  __m512 total[Rows * Blocks][2];
  for (auto& t : total) t[0] = t[1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.k_groups; ++g) {
    __m512 dot[Rows * Blocks][2];  // this weight group's sum over x q, x's scales applied
    for (auto& d : dot) d[0] = d[1] = _mm512_setzero_ps();
    const int64_t group_end = std::min((g + 1) * kInt4GroupPairs, p.K_pairs);
    for (int64_t q0 = g * kInt4GroupPairs; q0 < group_end; q0 += kXGroupPairs) {
      __m512i sums[Rows * Blocks][2];  // [i][0]: columns 0-15, [i][1]: 16-31
      for (auto& a : sums) a[0] = a[1] = _mm512_setzero_si512();
      for (int64_t q = q0, end = std::min(q0 + kXGroupPairs, group_end); q < end; q += 2) {
        __m512i x4[Rows];  // inputs 2q..2q+3 of each row
        for (int r = 0; r < Rows; ++r) {
          int32_t four;
          std::memcpy(&four, p.x_bytes() + r * p.ldx + 2 * q, sizeof four);
          x4[r] = _mm512_set1_epi32(four);
        }
        for (int b = 0; b < Blocks; ++b) {
          const Int4Halves v = load_int4_halves<P>(w[b] + q * kInt4PairBytes, p.prefetch_bytes);
          for (int r = 0; r < Rows; ++r) {
            const int i = r * Blocks + b;
            sums[i][0] = _mm512_dpbusd_epi32(sums[i][0], v.first, x4[r]);
            sums[i][1] = _mm512_dpbusd_epi32(sums[i][1], v.second, x4[r]);
          }
        }
      }
      for (int r = 0; r < Rows; ++r) {
        const __m512 x_scale = _mm512_set1_ps(p.x_scales[r * x_row_groups + q0 / kXGroupPairs]);
        for (int b = 0; b < Blocks; ++b) {
          const int i = r * Blocks + b;
          for (int h = 0; h < 2; ++h) dot[i][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i][h]), x_scale, dot[i][h]);
        }
      }
    }
    add_int4_group<Rows, Blocks>(p, blocks, g, dot, total);
  }
  for (int r = 0; r < Rows; ++r) {
    for (int b = 0; b < Blocks; ++b) {
      float* out = c[Blocks > 1 ? b : 0] + r * kBlockN;
      for (int h = 0; h < 2; ++h) _mm512_storeu_ps(out + 16 * h, total[r * Blocks + b][h]);
    }
  }
}

// int4 decode over x as int16 words with their bytes apart (ActivationForm::split_words, the default), the
// same loads: `vpdpbusd` adds each lane's four products of the nibbles (unsigned) and the four words' high
// bytes (signed), and of the low bytes (unsigned) and the nibbles (read as signed: they are below 128).
// About 9 instructions per 64 weight bytes, four of them VNNI: twice int8's per byte, which bounds this
// GEMV on Zen 4 (512-bit VNNI at half rate) before memory does (docs/PERFORMANCE.md); x keeps its 15 bits. The
// high bytes' `vpdpbusd` broadcasts them from memory itself (dot_bytes_broadcast): at 4 rows x in registers and the
// sums would want 34 of the 32, and their spills cost 1.1-1.3x at 3-4 rows on Zen 4.
// A group's sums go to fp32 as 256 * high + low; its sum over x q minus z times the group's sum of x
// (x_sums) is its sum over x (q - z). A group is 32 loads, each adding at most 4 * 15 * 255 per lane and
// accumulator.
template <int Rows, int Blocks, Prefetch P>
static void int4_gemv_words(const LinearProblem& p, const int64_t* blocks, float* const* c) {
  const uint8_t* w[Blocks];
  for (int b = 0; b < Blocks; ++b) w[b] = p.wq + blocks[b] * pairs_between_blocks(p) * kInt4PairBytes;
  __m512 total[Rows * Blocks][2];
  for (auto& t : total) t[0] = t[1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.k_groups; ++g) {
    // [i][0]: columns 0-15, [i][1]: 16-31; against the high and the low bytes
    __m512i high[Rows * Blocks][2], lows[Rows * Blocks][2];
    for (auto& a : high) a[0] = a[1] = _mm512_setzero_si512();
    for (auto& a : lows) a[0] = a[1] = _mm512_setzero_si512();
    for (int64_t q = g * kInt4GroupPairs, end = std::min(q + kInt4GroupPairs, p.K_pairs); q < end; q += 2) {
      __m512i x_low[Rows];  // inputs 2q..2q+3 of each row: 4 low bytes, then (x_high) 4 high bytes
      for (int r = 0; r < Rows; ++r) {
        int32_t low;
        std::memcpy(&low, p.x_split() + r * 2 * p.ldx + 4 * q, sizeof low);
        x_low[r] = _mm512_set1_epi32(low);
      }
      for (int b = 0; b < Blocks; ++b) {
        const Int4Halves v = load_int4_halves<P>(w[b] + q * kInt4PairBytes, p.prefetch_bytes);
        for (int r = 0; r < Rows; ++r) {
          const int i = r * Blocks + b;
          const uint8_t* x_high = p.x_split() + r * 2 * p.ldx + 4 * q + 4;
          high[i][0] = dot_bytes_broadcast(high[i][0], v.first, x_high);
          high[i][1] = dot_bytes_broadcast(high[i][1], v.second, x_high);
          lows[i][0] = _mm512_dpbusd_epi32(lows[i][0], x_low[r], v.first);
          lows[i][1] = _mm512_dpbusd_epi32(lows[i][1], x_low[r], v.second);
        }
      }
    }
    __m512 dot[Rows * Blocks][2];  // the group's sum over words times nibbles
    for (int i = 0; i < Rows * Blocks; ++i) {
      for (int h = 0; h < 2; ++h) {
        dot[i][h] = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(high[i][h], 8), lows[i][h]));
      }
    }
    add_int4_group<Rows, Blocks>(p, blocks, g, dot, total);
  }
  for (int r = 0; r < Rows; ++r) {
    const __m512 x_scale = _mm512_set1_ps(p.x_scales[r]);
    for (int b = 0; b < Blocks; ++b) {
      float* out = c[Blocks > 1 ? b : 0] + r * kBlockN;
      for (int h = 0; h < 2; ++h) _mm512_storeu_ps(out + 16 * h, _mm512_mul_ps(total[r * Blocks + b][h], x_scale));
    }
  }
}

// 16 fp32 -> their bf16 bits (round to nearest even) in the low half of each 32-bit lane.
static inline __m512i bf16_bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
}

// An int4 block as bf16 in the packed order, scaled: each value q * s - z * s in fp32, which is
// (q - z) * s exactly (at most 4 + 11 significant bits), rounded to bf16 once, as a checkpoint's
// dequantized bf16 weight would be.
static void dequantize_int4_block(const LinearProblem& p, int64_t block, uint16_t* out) {
  const uint8_t* w = p.wq + block * pairs_between_blocks(p) * kInt4PairBytes;
  const __m512i byte = _mm512_set1_epi32(0xFF), low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < p.k_groups && g * kInt4GroupPairs < p.K_pairs; ++g) {  // (a K chunk: its groups)
    const uint16_t* params = int4_group_params(p, block, g);
    __m512 scale[2], shift[2];
    for (int h = 0; h < 2; ++h) {
      scale[h] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + 16 * h)));
      const __m512 zero =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + kBlockN + 16 * h)));
      shift[h] = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(zero, scale[h]));
    }
    for (int64_t q = g * kInt4GroupPairs, end = std::min(q + kInt4GroupPairs, p.K_pairs); q < end; q += 2) {
      const __m512i raw = _mm512_loadu_si512(w + q * kInt4PairBytes);
      for (int h = 0; h < 2; ++h) {  // columns 16h..16h+15: byte j of each lane is input 2q + j
        const __m512i values = h == 0 ? _mm512_and_si512(raw, low) : _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        for (int pair = 0; pair < 2; ++pair) {
          const __m512 first = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(values, 16 * pair), byte));
          const __m512 second = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(values, 16 * pair + 8), byte));
          const __m512i bits = _mm512_or_si512(bf16_bits16(_mm512_fmadd_ps(first, scale[h], shift[h])),
                                               _mm512_slli_epi32(bf16_bits16(_mm512_fmadd_ps(second, scale[h], shift[h])), 16));
          _mm512_storeu_si512(out + (q + pair) * kPairStride + 32 * h, bits);
        }
      }
    }
  }
}

// Block `block` as bf16 in the packed order (fp8 scaled, int8 not), for the GEMM, through the
// decode's byte tables: 9 instructions per K pair row instead of 16 widening to fp32. int8's
// are exact and its column scales apply to the result; fp8's carry each group's block scale
// (scaled_fp8_tables), rounded to bf16 as a widened and scaled value would be.
template <WeightFormat F>
static void dequantize_block(const LinearProblem& p, int64_t block, uint16_t* out) {
  const uint8_t* w = p.wq + block * pairs_between_blocks(p) * kQPairBytes;
  const __m512i first = _mm512_loadu_si512(kColumnOrder[0]), second = _mm512_loadu_si512(kColumnOrder[1]);
  const int64_t group = F == WeightFormat::fp8 ? kFp8GroupPairs : p.K_pairs;  // int8: one group
  for (int64_t g0 = 0; g0 < p.K_pairs; g0 += group) {
    const Tables tables = F == WeightFormat::fp8 ? scaled_fp8_tables(fp8_scale(p, block, g0)) : load_tables<F>();
    const int64_t g1 = g0 + group < p.K_pairs ? g0 + group : p.K_pairs;
    for (int64_t q = g0; q < g1; ++q) {
      __m512i a, b;
      load_quantized_pairs<F>(w + q * kQPairBytes, tables, a, b);
      _mm512_storeu_si512(out + q * kPairStride, _mm512_permutex2var_epi32(a, first, b));
      _mm512_storeu_si512(out + q * kPairStride + kBlockN, _mm512_permutex2var_epi32(a, second, b));
    }
  }
}

// The AVX512-BF16 micro-kernels as linear_walk.h calls them (over bf16 pairs, or int16 words for int8 decode).
struct Avx512Unit {
  static constexpr bool kTwoStreams = true;
  static constexpr int64_t kTwoBlockRows = kGemvRows;
  // q_blocks' rows: every format to kGemvRows in one pass (on Zen 4 1.1-1.2x two passes of 2 rows; int4 1.1x even
  // while its x spilled, int4_gemv_words)
  static constexpr int64_t q_register_rows(WeightFormat) { return kGemvRows; }
  template <WeightFormat F, int Rows, int Blocks>
  static void q_blocks(const LinearProblem& p, const int64_t* blocks, float* const* c) {
    with_prefetch(p, [&](auto as) {
      constexpr Prefetch P = decltype(as)::value;
      if constexpr (F == WeightFormat::int8) {
        int8_word_gemv<Rows, Blocks, P>(p, blocks, c);
      } else if constexpr (F == WeightFormat::int4) {
        if (p.x_form == ActivationForm::int8_groups) {
          int4_gemv_bytes<Rows, Blocks, P>(p, blocks, c);
        } else {
          int4_gemv_words<Rows, Blocks, P>(p, blocks, c);
        }
      } else {
        fp8_gemv<Rows, Blocks, P>(p, blocks, c);
      }
    });
  }
  // int8 and int4 prefill over int8_groups x (linear_walk.h walk_quantized)
  static constexpr ActivationForm kIntegerGemmForm = ActivationForm::int8_groups;
  template <WeightFormat F>
  static void integer_gemm_block(const LinearProblem& p, int64_t block, float* c) {
    if constexpr (F == WeightFormat::int4) {
      int4_group_gemm(p, block, c);
    } else {
      int8_group_gemm(p, block, c);
    }
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
      constexpr Prefetch P = decltype(as)::value;
      const uint32_t* x = p.x_pairs();
      const int64_t ldp = p.ldx / 2;
      switch (p.M) {
        case 1: return gemv_rows_two_blocks<1, P>(x, ldp, a, b, p.K_pairs, p.prefetch_bytes, c_a, c_b);
        case 2: return gemv_rows_two_blocks<2, P>(x, ldp, a, b, p.K_pairs, p.prefetch_bytes, c_a, c_b);
        case 3: return gemv_rows_two_blocks<3, P>(x, ldp, a, b, p.K_pairs, p.prefetch_bytes, c_a, c_b);
        default: return gemv_rows_two_blocks<4, P>(x, ldp, a, b, p.K_pairs, p.prefetch_bytes, c_a, c_b);
      }
    });
  }
  static void one_block(const LinearProblem& p, const uint16_t* block, float* c) {
    if (p.M > kGemvRows) return gemm_block(p, block, c);
    with_prefetch(p, [&](auto as) {
      constexpr Prefetch P = decltype(as)::value;
      const uint32_t* x = p.x_pairs();
      const int64_t ldp = p.ldx / 2;
      switch (p.M) {
        case 1: return gemv_rows<1, P>(x, ldp, block, p.K_pairs, p.prefetch_bytes, c);
        case 2: return gemv_rows<2, P>(x, ldp, block, p.K_pairs, p.prefetch_bytes, c);
        case 3: return gemv_rows<3, P>(x, ldp, block, p.K_pairs, p.prefetch_bytes, c);
        default: return gemv_rows<4, P>(x, ldp, block, p.K_pairs, p.prefetch_bytes, c);
      }
    });
  }
  static void store(const LinearProblem& p, int64_t col0, const float* c) { store_block(p, col0, c); }
  static void store_silu_mul(const LinearProblem& p, int64_t col0, const float* gate, const float* up) {
    store_block_silu_mul(p, col0, gate, up);
  }
};

// The largest |x| of a bf16 row of n values: the per-row scale of quantize_words.
static float row_absmax(const uint16_t* row, int64_t n) {
  __m512 peak = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) peak = _mm512_max_ps(peak, _mm512_abs_ps(load_bf16x16(row + k)));
  float amax = _mm512_reduce_max_ps(peak);
  for (; k < n; ++k) amax = std::max(amax, std::fabs(bf16_to_float(row[k])));
  return amax;
}

}  // namespace

void TILEFX_AVX512_ENTRY(quantize_words)(const uint16_t* x, int64_t rows, int64_t ldx, uint32_t* words,
                                          float* scales) {
  for (int64_t m = 0; m < rows; ++m) {
    const uint16_t* row = x + m * ldx;
    const float amax = row_absmax(row, ldx);
    const float scale = amax > 0.0f ? amax / 32767.0f : 1.0f;
    scales[m] = scale;
    const __m512 inverse = _mm512_set1_ps(1.0f / scale);
    int16_t* out = reinterpret_cast<int16_t*>(words + m * (ldx / 2));
    int64_t k = 0;
    for (; k + 16 <= ldx; k += 16) {  // round to nearest even, |q| <= 32767
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16x16(row + k), inverse));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm512_cvtsepi32_epi16(q));
    }
    for (; k < ldx; ++k) out[k] = static_cast<int16_t>(std::nearbyint(bf16_to_float(row[k]) * (1.0f / scale)));
  }
}

void TILEFX_AVX512_ENTRY(quantize_groups)(const uint16_t* x, int64_t rows, int64_t ldx, int8_t* bytes, float* scales,
                                           float* sums, int32_t* totals) {
  const auto round = [](const uint16_t* values, int64_t n, float inverse, int8_t* out) {
    const __m512 scale = _mm512_set1_ps(inverse);
    int32_t total = 0;
    for (int64_t k = 0; k < n; k += 16) {  // |q| <= 127; a partial group masked
      const __mmask16 live = n - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - k)) - 1);
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16x16_masked(values + k, live), scale));
      int8_t rounded[16];
      _mm_storeu_si128(reinterpret_cast<__m128i*>(rounded), _mm512_cvtsepi32_epi8(q));
      const int64_t count = std::min<int64_t>(16, n - k);
      for (int64_t t = 0; t < count; ++t) total += rounded[t];
      std::memcpy(out + k, rounded, count);
    }
    return total;
  };
  quantize_x_groups(x, rows, ldx, bytes, scales, sums, totals, row_absmax, round);
}

namespace {

// Whether mask row `m` allows every one of keys [0, keys), 64 mask bytes a test (the rest one by one).
static inline bool allows_all(const bool* m, int64_t keys) {
  const __m512i ones = _mm512_set1_epi8(1);
  int64_t t = 0;
  for (; t + 64 <= keys; t += 64) {
    if (_mm512_test_epi8_mask(_mm512_loadu_si512(m + t), ones) != ~__mmask64{0}) return false;
  }
  return std::all_of(m + t, m + keys, [](bool allowed) { return allowed; });
}

// The 8 lanes' sum as a tree (halves added twice, then the last pair).
static inline float sum_lanes(__m256 v) {
  __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  quarter = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}

// One key block of the flash attention on brgemm tiles, 16 keys a vector: the contract of
// flash_block_softmax_avx2 (kernels.h), with `ld` a multiple of 16. The first pass masks and
// takes the max of the raw scores (the scale is positive); the second folds the scale, log2(e)
// and the max into one FMA before exp2, and sums the weights as rounded to bf16 (one `vdpbf16ps` of
// each 16 against bf16 1.0 pairs, not a widening to fp32 and an add). A row whose mask allows the
// whole block (all but the causal diagonal's blocks; checked once per mask row, which `group` rows
// share) skips the mask: its first pass only reads, its second masks and clamps nothing. The lanes
// are summed as a tree (a sum of 16 lanes in order was a chain of 16 dependent adds a row: with the
// masking, 30-40% of this function's time on Emerald Rapids).
void flash_softmax(float* scores, int64_t rows, int64_t keys, int64_t ld, const bool* mask, int64_t group,
                   int64_t mask_stride, float scale, float* max, float* sum, uint16_t* weights, float* out,
                   int64_t v_dim) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 vneg_inf = _mm512_set1_ps(neg_inf), floor = _mm512_set1_ps(-126.0f);
  const float log2e_scale = scale * 1.44269504088896341f;
  const __m512 vfactor = _mm512_set1_ps(log2e_scale);
  const __m256bh ones = as_pairs(_mm256_set1_epi16(0x3F80));  // bf16 1.0 pairs
  bool whole = false;  // mask row r / group allows every key of the block (keys a multiple of 16)
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * ld;
    uint16_t* w = weights + r * ld;
    const bool* m = mask ? mask + (r / group) * mask_stride : nullptr;
    if (r % group == 0) whole = keys % 16 == 0 && (m == nullptr || allows_all(m, keys));
    __m512 vmax = vneg_inf;
    for (int64_t t = 0; whole && t < keys; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
    for (int64_t t = 0; !whole && t < keys; t += 16) {
      __m128i bytes;  // the mask bytes of keys [t, t + 16), 0 past `keys` (the row may end there)
      if (m == nullptr) {  // every key allowed (a block of a length not a multiple of 16)
        bytes = _mm_cmpgt_epi8(_mm_set1_epi8(static_cast<char>(std::min<int64_t>(keys - t, 16))),
                               _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      } else if (keys - t >= 16) {
        bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m + t));
      } else {
        alignas(16) bool tail[16] = {};
        std::copy(m + t, m + keys, tail);
        bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
      }
      const __mmask16 allowed = _mm_cmpneq_epi8_mask(bytes, _mm_setzero_si128());
      const __m512 x = _mm512_mask_loadu_ps(vneg_inf, allowed, s + t);
      _mm512_storeu_ps(s + t, x);
      vmax = _mm512_max_ps(vmax, x);
    }
    const float block_max = _mm512_reduce_max_ps(vmax) * scale;  // (-inf stays -inf)
    const float old_max = max[r], new_max = std::max(old_max, block_max);
    if (new_max == neg_inf) {  // nothing allowed so far: weights 0, the row's output stays 0
      std::fill(w, w + ld, uint16_t{0});
      continue;
    }
    const __m512 vbias = _mm512_set1_ps(-new_max * 1.44269504088896341f);
    __m256 vsum = _mm256_setzero_ps();
    int64_t t = 0;
    if (whole) {
      // every key allowed, every score finite: no mask, and no floor (exp2_for_bf16 of any finite t <= 0 is
      // finite; below 2^-126 it is a subnormal or 0, which the GEMM's bf16 inputs and the sum below read as 0)
      for (; t < keys; t += 16) {
        const __m256i rounded = round_bf16x16(exp2_for_bf16(_mm512_fmadd_ps(_mm512_loadu_ps(s + t), vfactor, vbias)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + t), rounded);  // ld is a multiple of 16
        // the sum of what the GEMM multiplies, the weights as rounded: pairs of them times bf16 1.0
        vsum = _mm256_dpbf16_ps(vsum, as_pairs(rounded), ones);
      }
    }
    for (; t < keys; t += 16) {  // (a row with a mask in this block)
      const __m512 x = _mm512_loadu_ps(s + t);
      // masked keys weigh exactly 0
      const __mmask16 live = _mm512_cmp_ps_mask(x, vneg_inf, _CMP_NEQ_OQ);
      const __m512 e = _mm512_maskz_mov_ps(live, exp2_for_bf16(_mm512_max_ps(_mm512_fmadd_ps(x, vfactor, vbias), floor)));
      const __m256i rounded = round_bf16x16(e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + t), rounded);  // ld is a multiple of 16
      vsum = _mm256_dpbf16_ps(vsum, as_pairs(rounded), ones);
    }
    std::fill(w + t, w + ld, uint16_t{0});
    // (a block that leaves the row's max as it was, as most past the first few do, calls no exp)
    const float alpha = old_max == neg_inf ? 0.0f : old_max == new_max ? 1.0f : std::exp(old_max - new_max);
    sum[r] = sum[r] * alpha + sum_lanes(vsum);
    max[r] = new_max;
    if (alpha != 1.0f) {
      float* o = out + r * v_dim;
      const __m512 va = _mm512_set1_ps(alpha);
      for (int64_t d = 0; d < v_dim; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), va));
    }
  }
}

// UnitEpilogue::interleave_rows, 32 columns a step (16 at the end where n is an odd multiple of 16):
// unpack within 128-bit lanes, then the lanes in order.
void interleave_rows(const uint16_t* a, const uint16_t* b, int64_t n, uint16_t* out) {
  alignas(64) static constexpr int64_t kFirst[8] = {0, 1, 8, 9, 2, 3, 10, 11}, kSecond[8] = {4, 5, 12, 13, 6, 7, 14, 15};
  const __m512i first = _mm512_load_si512(kFirst), second = _mm512_load_si512(kSecond);
  const __m512i zero = _mm512_setzero_si512();
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    const __m512i va = a ? _mm512_loadu_si512(a + c) : zero, vb = b ? _mm512_loadu_si512(b + c) : zero;
    const __m512i lo = _mm512_unpacklo_epi16(va, vb), hi = _mm512_unpackhi_epi16(va, vb);
    _mm512_storeu_si512(out + 2 * c, _mm512_permutex2var_epi64(lo, first, hi));
    _mm512_storeu_si512(out + 2 * c + 32, _mm512_permutex2var_epi64(lo, second, hi));
  }
  if (c < n) {  // 16 columns
    const __m256i va = a ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c)) : _mm256_setzero_si256();
    const __m256i vb = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c)) : _mm256_setzero_si256();
    const __m256i lo = _mm256_unpacklo_epi16(va, vb), hi = _mm256_unpackhi_epi16(va, vb);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * c), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * c + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
  }
}

// Index vectors of the transpose's stages: at distance `half` (8, 4, 2, 1), rows i and i + half
// swap their off-diagonal blocks of `half` values; after the four stages a 16 x 16 tile is transposed.
struct TransposeStages {
  int32_t low[4][16], high[4][16];
};
constexpr TransposeStages transpose_stages() {
  TransposeStages t{};
  for (int stage = 0; stage < 4; ++stage) {
    const int half = 8 >> stage;
    for (int j = 0; j < 16; ++j) {
      t.low[stage][j] = (j & half) ? 16 + j - half : j;   // row i: its block, then row i + half's
      t.high[stage][j] = (j & half) ? 16 + j : j + half;  // row i + half: row i's block, then its own
    }
  }
  return t;
}
alignas(64) constexpr TransposeStages kTransposeStages = transpose_stages();

// UnitEpilogue::transpose_pairs, 16 pairs of 16 rows a step (one 16 x 16 transpose of 32-bit
// values in registers), 8 pairs at the end where `pairs` is an odd multiple of 8.
void transpose_pairs(const uint16_t* const* rows, int64_t pairs, uint32_t* out, int64_t ld) {
  int64_t i0 = 0;
  for (; i0 + 16 <= pairs; i0 += 16) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = rows[j] ? _mm512_loadu_si512(rows[j] + 2 * i0) : _mm512_setzero_si512();
    for (int stage = 0; stage < 4; ++stage) {
      const int half = 8 >> stage;
      const __m512i low = _mm512_load_si512(kTransposeStages.low[stage]);
      const __m512i high = _mm512_load_si512(kTransposeStages.high[stage]);
      for (int j = 0; j < 16; ++j) {
        if (j & half) continue;
        const __m512i a = r[j], b = r[j + half];
        r[j] = _mm512_permutex2var_epi32(a, low, b);
        r[j + half] = _mm512_permutex2var_epi32(a, high, b);
      }
    }
    for (int j = 0; j < 16; ++j) _mm512_storeu_si512(out + (i0 + j) * ld, r[j]);
  }
  if (i0 < pairs) {
    const uint16_t* rest[16];
    for (int j = 0; j < 16; ++j) rest[j] = rows[j] ? rows[j] + 2 * i0 : nullptr;
    transpose_pairs_plain(rest, pairs - i0, out + i0 * ld, ld);
  }
}

// UnitEpilogue::scaled_bf16
void scaled_bf16(const float* x, float scale, int64_t n, uint16_t* out) {
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store_bf16x16(out + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), vscale));
  for (; i < n; ++i) out[i] = float_to_bf16(x[i] * scale);
}

// UnitEpilogue::scale_columns, a row's kBlockN columns as two vectors
void scale_columns(float* c, const float* s, int64_t rows) {
  static_assert(kBlockN == 32, "scale_columns takes a block's columns as two vectors");
  const __m512 lo = _mm512_loadu_ps(s), hi = _mm512_loadu_ps(s + 16);
  for (int64_t m = 0; m < rows; ++m, c += kBlockN) {
    _mm512_storeu_ps(c, _mm512_mul_ps(_mm512_loadu_ps(c), lo));
    _mm512_storeu_ps(c + 16, _mm512_mul_ps(_mm512_loadu_ps(c + 16), hi));
  }
}

// UnitEpilogue::rms_norm_row, 16 values a vector, the last n % 16 one at a time.
void rms_norm_row(const uint16_t* x, const uint16_t* residual, int64_t n, const uint16_t* weight, float eps,
                  uint16_t* sum, uint16_t* out) {
  const int64_t whole = n / 16 * 16;
  __m512 squares = _mm512_setzero_ps();
  float tail_squares = 0.0f;  // then the lanes' too
  const uint16_t* row = x;
  if (residual != nullptr) {  // the sum rounded to bf16 as HF's add rounds it; the norm reads it back from L1
    for (int64_t i = 0; i < whole; i += 16) {
      const __m256i rounded = round_bf16x16(_mm512_add_ps(load_bf16x16(x + i), load_bf16x16(residual + i)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(sum + i), rounded);
      const __m512 v = widen_bf16x16(rounded);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    for (int64_t i = whole; i < n; ++i) sum[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(residual[i]));
    row = sum;
  } else {
    for (int64_t i = 0; i < whole; i += 16) {
      const __m512 v = load_bf16x16(x + i);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
  }
  for (int64_t i = whole; i < n; ++i) tail_squares += bf16_to_float(row[i]) * bf16_to_float(row[i]);
  float lanes[16];
  _mm512_storeu_ps(lanes, squares);
  for (const float lane : lanes) tail_squares += lane;
  const float scale = 1.0f / std::sqrt(tail_squares / float(n) + eps);
  const __m512 scales = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 normed = widen_bf16x16(round_bf16x16(_mm512_mul_ps(load_bf16x16(row + i), scales)));
    store_bf16x16(out + i, _mm512_mul_ps(load_bf16x16(weight + i), normed));
  }
  for (int64_t i = whole; i < n; ++i) {
    out[i] = float_to_bf16(bf16_to_float(weight[i]) * bf16_to_float(float_to_bf16(bf16_to_float(row[i]) * scale)));
  }
}

// UnitEpilogue::weighted_sum_row, 16 values a vector, the last n % 16 one at a time.
void weighted_sum_row(const uint16_t* const* rows, const float* weights, int64_t k, int64_t n, uint16_t* out) {
  const int64_t whole = n / 16 * 16;
  for (int64_t i = 0; i < whole; i += 16) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t s = 0; s < k; ++s) sum = _mm512_fmadd_ps(_mm512_set1_ps(weights[s]), load_bf16x16(rows[s] + i), sum);
    store_bf16x16(out + i, sum);
  }
  weighted_sum_values(rows, weights, k, whole, n, out);
}

}  // namespace

void TILEFX_AVX512_ENTRY(linear_blocks)(const LinearProblem& p, int64_t block_begin, int64_t block_end,
                                        float* scratch) {
  walk<Avx512Unit>(p, block_begin, block_end, scratch);
}

const UnitEpilogue& TILEFX_AVX512_ENTRY(unit_epilogue)() {
  static const UnitEpilogue epilogue{
      {nullptr, dequantize_block<WeightFormat::int8>, dequantize_block<WeightFormat::fp8>, dequantize_int4_block},
      store_block,
      store_block_silu_mul,
      flash_softmax,
      interleave_rows,
      transpose_pairs,
      scaled_bf16,
      scale_columns,
      rms_norm_row,
      weighted_sum_row};
  return epilogue;
}

}  // namespace tilefx
