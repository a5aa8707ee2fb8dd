// tilefx::linear on AVX512-BF16: `vdpbf16ps` reads the packed layout (kernels.h) as it
// is. One 64-byte load is 16 columns x one K pair, and one instruction multiplies it by
// a broadcast pair of x values and adds both products into 16 fp32 accumulators: no
// widening, half the instructions per weight byte of the AVX2 unit. x comes as bf16
// pairs (LinearProblem::x_pairs), the accumulation and epilogues are fp32.
//
// The structure is the AVX2 unit's (linear_avx2.cpp explains the choices; both walk
// the blocks with linear_walk.h): decode (M <= 2) streams each block once, M = 1 as
// two streams per thread with a 1 KiB non-temporal prefetch; prefill is a blocked GEMM
// over an L1-resident panel of one block and kKChunk K pairs, here with micro-tiles of
// 8 rows x 32 columns (16 zmm accumulators).
//
// The same source builds twice: for the CPU (the `#pragma` below; the ops (dispatch.h)
// call it only where CPUID reports AVX512F and AVX512-BF16), and, as
// linear_avx512_emulated.cpp, on SIMDe's portable implementations of the same
// intrinsics, so that the tests check this unit's logic on CPUs without AVX512.
#include "kernels.h"

#include <cstring>

#ifdef TILEFX_AVX512_EMULATED
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define TILEFX_AVX512_ENTRY(name) name##_avx512_emulated
#else
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")
#include <immintrin.h>
#define TILEFX_AVX512_ENTRY(name) name##_avx512
#endif
#include "bf16_scalar.h"
#include "linear_walk.h"

namespace tilefx {
namespace {

constexpr int64_t kPairStride = kBlockN * 2;  // bf16 elements per K pair in a block: two zmm
constexpr int64_t kKChunk = 128;              // K pairs per L1-resident weight panel (GEMM): 16 KiB
constexpr int kTileRows = 8;                  // rows of x per GEMM micro-tile (x 2 zmm accumulators)
constexpr int64_t kPrefetchElems = 512;       // GEMV prefetch distance: 1 KiB of one stream

static inline __m512bh as_pairs(__m512i v) {
  __m512bh r;
  std::memcpy(&r, &v, sizeof r);
  return r;
}

// 16 columns x one K pair of a block.
static inline __m512bh load_pairs(const uint16_t* p) { return as_pairs(_mm512_loadu_si512(p)); }

// x[2p], x[2p + 1] in every lane.
static inline __m512bh broadcast_pair(uint32_t pair) { return as_pairs(_mm512_set1_epi32(static_cast<int>(pair))); }

static inline void prefetch_ahead(const uint16_t* row) {
  _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchElems), _MM_HINT_NTA);
  _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchElems + 32), _MM_HINT_NTA);
}

static inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 fp32 -> 16 bf16, round to nearest even (as float_to_bf16).
static inline void store_bf16x16(uint16_t* p, __m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  // packus packs within 128-bit lanes; the first quadword of each lane holds its 4 values.
  const __m512i packed = _mm512_permutexvar_epi64(_mm512_set_epi64(7, 7, 7, 7, 6, 4, 2, 0),
                                                  _mm512_packus_epi32(bits, bits));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_castsi512_si256(packed));
}

// exp(x) as the AVX2 unit computes it (Cephes expf polynomial; relative error ~2e-7).
static inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(x, _mm512_set1_ps(88.37626f));
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(pow2n));
}

// silu(g) * u = g * u / (1 + exp(-g)).
static inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_div_ps(_mm512_mul_ps(g, u), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// One row of x against one block, every K pair.
static void gemv_row(const uint32_t* x, const uint16_t* block, int64_t pairs, float* c) {
  __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* row = block + p * kPairStride;
    prefetch_ahead(row);
    const __m512bh xp = broadcast_pair(x[p]);
    lo = _mm512_dpbf16_ps(lo, load_pairs(row), xp);
    hi = _mm512_dpbf16_ps(hi, load_pairs(row + 32), xp);
  }
  _mm512_storeu_ps(c, lo);
  _mm512_storeu_ps(c + 16, hi);
}

// One row of x against two blocks at once (two streams).
static void gemv_row_two_blocks(const uint32_t* x, const uint16_t* block_a, const uint16_t* block_b, int64_t pairs,
                                float* c_a, float* c_b) {
  __m512 a_lo = _mm512_setzero_ps(), a_hi = _mm512_setzero_ps();
  __m512 b_lo = _mm512_setzero_ps(), b_hi = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* row_a = block_a + p * kPairStride;
    const uint16_t* row_b = block_b + p * kPairStride;
    prefetch_ahead(row_a);
    prefetch_ahead(row_b);
    const __m512bh xp = broadcast_pair(x[p]);
    a_lo = _mm512_dpbf16_ps(a_lo, load_pairs(row_a), xp);
    a_hi = _mm512_dpbf16_ps(a_hi, load_pairs(row_a + 32), xp);
    b_lo = _mm512_dpbf16_ps(b_lo, load_pairs(row_b), xp);
    b_hi = _mm512_dpbf16_ps(b_hi, load_pairs(row_b + 32), xp);
  }
  _mm512_storeu_ps(c_a, a_lo);
  _mm512_storeu_ps(c_a + 16, a_hi);
  _mm512_storeu_ps(c_b, b_lo);
  _mm512_storeu_ps(c_b + 16, b_hi);
}

// Two rows of x against one block (batch-2 decode): the weight is still read once.
static void gemv_two_rows(const uint32_t* x, int64_t ldp, const uint16_t* block, int64_t pairs, float* c) {
  __m512 acc[2][2];
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* row = block + p * kPairStride;
    prefetch_ahead(row);
    const __m512bh lo = load_pairs(row), hi = load_pairs(row + 32);
    for (int m = 0; m < 2; ++m) {
      const __m512bh xp = broadcast_pair(x[m * ldp + p]);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], lo, xp);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], hi, xp);
    }
  }
  for (int m = 0; m < 2; ++m) {
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
  for (int64_t p0 = 0; p0 < p.K_pairs; p0 += kKChunk) {
    const int64_t p1 = p0 + kKChunk < p.K_pairs ? p0 + kKChunk : p.K_pairs;
    for (int64_t m = 0; m < p.M; m += kTileRows) {
      const uint32_t* x = p.x_pairs + m * ldp;
      float* cm = c + m * kBlockN;
      switch (p.M - m < kTileRows ? p.M - m : kTileRows) {
        case 1: gemm_tile<1>(x, ldp, block, p0, p1, cm); break;
        case 2: gemm_tile<2>(x, ldp, block, p0, p1, cm); break;
        case 3: gemm_tile<3>(x, ldp, block, p0, p1, cm); break;
        case 4: gemm_tile<4>(x, ldp, block, p0, p1, cm); break;
        case 5: gemm_tile<5>(x, ldp, block, p0, p1, cm); break;
        case 6: gemm_tile<6>(x, ldp, block, p0, p1, cm); break;
        case 7: gemm_tile<7>(x, ldp, block, p0, p1, cm); break;
        default: gemm_tile<8>(x, ldp, block, p0, p1, cm); break;
      }
    }
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
    for (; j + 16 <= cols; j += 16) {
      __m512 v = _mm512_loadu_ps(cm + j);
      if (p.bias) v = _mm512_add_ps(v, load_bf16x16(p.bias + col0 + j));
      store_bf16x16(y + j, v);
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
    for (; j + 16 <= cols; j += 16) {
      const __m512 v = silu_mul16(_mm512_loadu_ps(g + j), _mm512_loadu_ps(u + j));
      if (p.yf) {
        _mm512_storeu_ps(p.yf + m * p.ldy + col0 + j, v);
      } else {
        store_bf16x16(p.y + m * p.ldy + col0 + j, v);
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

// The AVX512-BF16 micro-kernels as linear_walk.h calls them (over LinearProblem::x_pairs).
struct Avx512Unit {
  static void two_blocks(const LinearProblem& p, const uint16_t* a, const uint16_t* b, float* c_a, float* c_b) {
    gemv_row_two_blocks(p.x_pairs, a, b, p.K_pairs, c_a, c_b);
  }
  static void one_block(const LinearProblem& p, const uint16_t* block, float* c) {
    if (p.M == 1) return gemv_row(p.x_pairs, block, p.K_pairs, c);
    if (p.M == 2) return gemv_two_rows(p.x_pairs, p.ldx / 2, block, p.K_pairs, c);
    gemm_block(p, block, c);
  }
  static void store(const LinearProblem& p, int64_t col0, const float* c) { store_block(p, col0, c); }
  static void store_silu_mul(const LinearProblem& p, int64_t col0, const float* gate, const float* up) {
    store_block_silu_mul(p, col0, gate, up);
  }
};

}  // namespace

void TILEFX_AVX512_ENTRY(linear_blocks)(const LinearProblem& p, int64_t block_begin, int64_t block_end,
                                        float* scratch) {
  walk_blocks<Avx512Unit>(p, block_begin, block_end, scratch);
}

}  // namespace tilefx
