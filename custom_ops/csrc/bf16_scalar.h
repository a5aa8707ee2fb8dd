// Scalar bf16 <-> fp32, for the ISA units' tails (vec_avx2.h, linear_avx512.cpp, attention_avx512.cpp).
// Static inline in an anonymous namespace: each unit compiles its own copy for its ISA.
#pragma once
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

}  // namespace
}  // namespace tilefx
