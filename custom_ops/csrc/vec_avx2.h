// AVX2 + FMA helpers, included only by *_avx2.cpp (compiled with -mavx2 -mfma).
// Everything is static inline so no symbol compiled for AVX2 escapes its unit.
#pragma once
#include <immintrin.h>
#include <cstdint>

#include "bf16_scalar.h"

namespace tilefx {
namespace {

// 8 bf16 -> 8 fp32 (bf16 is the top half of an fp32).
static inline __m256 load_bf16x8(const uint16_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// A 32-byte VNNI row segment holds 8 columns x (k, k+1): the fp32 values of row k
// are its low halves, those of row k+1 its high halves.
static inline __m256 vnni_even(__m256i raw) { return _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)); }
static inline __m256 vnni_odd(__m256i raw) {
  return _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Both rows of a segment at once.
static inline void load_vnni_pair(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = vnni_even(raw);
  odd = vnni_odd(raw);
}

// 8 fp32 -> 8 bf16, round to nearest even.
static inline void store_bf16x8(uint16_t* p, __m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  bits = _mm256_srli_epi32(bits, 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// Sums of four vectors, one per lane of the result.
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// exp(x): range reduction to 2^n * exp(r), |r| <= ln2/2, degree-6 polynomial
// (Cephes expf coefficients); relative error ~2e-7. Inputs below -87 give ~0.
static inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.37626f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

}  // namespace
}  // namespace tilefx
