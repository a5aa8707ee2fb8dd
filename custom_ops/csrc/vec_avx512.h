// AVX512 (F, BW, BF16) helpers of the AVX512-BF16 units (linear_avx512.cpp, attention_avx512.cpp),
// included only by them, after they say which build they are: with TILEFX_AVX512_EMULATED defined,
// SIMDe's portable implementations of the same intrinsics (the *_emulated.cpp twins, for tests on
// any CPU); otherwise the CPU's, with the target pragma below applying to the rest of the unit.
// Entry points are named through TILEFX_AVX512_ENTRY so the two builds link side by side.
// Everything here is static inline so no symbol compiled for AVX512 escapes its unit.
#pragma once
#include <cstdint>
#include <cstring>

#ifdef TILEFX_AVX512_EMULATED
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/gfni.h>
#define TILEFX_AVX512_ENTRY(name) name##_avx512_emulated
#else
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi,avx512vnni,gfni,fma,f16c")
#include <immintrin.h>
#define TILEFX_AVX512_ENTRY(name) name##_avx512
#endif

namespace tilefx {
namespace {

static inline __m512bh as_pairs(__m512i v) {
  __m512bh r;
  std::memcpy(&r, &v, sizeof r);
  return r;
}

static inline __m256bh as_pairs(__m256i v) {
  __m256bh r;
  std::memcpy(&r, &v, sizeof r);
  return r;
}

// 16 bf16 -> 16 fp32 (bf16 is the top half of an fp32).
static inline __m512 widen_bf16x16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

static inline __m512 load_bf16x16(const uint16_t* p) {
  return widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 fp32 -> 16 bf16 bits, round to nearest even (as float_to_bf16): one `vcvtneps2bf16` where the CPU has
// AVX512-BF16 (a third of the instructions of the integer rounding in the linears' output epilogues); SIMDe's
// emulation lacks it, and rounds in the integer unit.
static inline __m256i round_bf16x16(__m512 v) {
#ifdef TILEFX_AVX512_EMULATED
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  // packus packs within 128-bit lanes; the first quadword of each lane holds its 4 values.
  const __m512i packed = _mm512_permutexvar_epi64(_mm512_set_epi64(7, 7, 7, 7, 6, 4, 2, 0),
                                                  _mm512_packus_epi32(bits, bits));
  return _mm512_castsi512_si256(packed);
#else
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#endif
}

// 16 fp32 -> 16 bf16 at p (round_bf16x16).
static inline void store_bf16x16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round_bf16x16(v));
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

// 2^t for t >= -126 (finite), to ~3e-6 relative: 2^round(t) (scalef) times a degree-4 polynomial
// of the fraction in [-0.5, 0.5] (fitted to the relative error): the softmax's weights are rounded
// to bf16 (8 bits) right after, where exp512's degree-7 accuracy buys nothing.
static inline __m512 exp2_for_bf16(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_set1_ps(0.009560520f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.05591712f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.24024981f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.69312197f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.99999917f));
  return _mm512_scalef_ps(y, n);
}

}  // namespace
}  // namespace tilefx
