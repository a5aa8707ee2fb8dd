// Scalar bf16 <-> fp32, for the ISA units' tails (vec_avx2.h, linear_avx512.cpp, attention_avx512.cpp).
// Static inline in an anonymous namespace: each unit compiles its own copy for its ISA.
#pragma once
#include <cmath>
#include <cstdint>

namespace tilefx {
namespace {

// bf16 is the top half of an fp32.
static inline float bf16_to_float(uint16_t v) {
  union { uint32_t u; float f; } bits{static_cast<uint32_t>(v) << 16};
  return bits.f;
}

// Round to nearest even.
static inline uint16_t float_to_bf16(float f) {
  union { float f; uint32_t u; } bits{f};
  const uint32_t lsb = (bits.u >> 16) & 1u;
  return static_cast<uint16_t>((bits.u + 0x7FFFu + lsb) >> 16);
}

// UnitEpilogue::weighted_sum_row (kernels.h) over values [begin, n), one at a time: the units' tails.
static inline void weighted_sum_values(const uint16_t* const* rows, const float* weights, int64_t k, int64_t begin,
                                       int64_t n, uint16_t* out) {
  for (int64_t i = begin; i < n; ++i) {
    float sum = 0.0f;
    for (int64_t s = 0; s < k; ++s) sum = std::fma(weights[s], bf16_to_float(rows[s][i]), sum);
    out[i] = float_to_bf16(sum);
  }
}

}  // namespace
}  // namespace tilefx
