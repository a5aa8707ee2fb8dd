// How a linear's column blocks are walked, shared by the ISA units (linear_avx2.cpp,
// linear_avx512.cpp). Each includes this after its own ISA setup and instantiates
// walk_blocks with its micro-kernels, so every line here is compiled for that unit's
// ISA; it is a template in an anonymous namespace, so no symbol leaves the unit.
#pragma once
#include "kernels.h"

namespace tilefx {
namespace {

// `Unit` supplies, over the activations it reads (LinearProblem::x or x_pairs):
//   two_blocks(p, block_a, block_b, c_a, c_b)  M = 1 against two blocks at once (two streams)
//   one_block(p, block, c)                     every row against one block (GEMV, or GEMM for M > 2)
//   store(p, col0, c)                          bias and the output conversion
//   store_silu_mul(p, col0, gate, up)          the gate/up epilogue
// Results are fp32 rows of kBlockN in `scratch` (2 * max(M, 2) * kBlockN floats).
template <class Unit>
void walk_blocks(const LinearProblem& p, int64_t block_begin, int64_t block_end, float* scratch) {
  const int64_t block_elems = p.K_pairs * kBlockN * 2;
  if (p.silu_mul) {
    // Output block j reads gate block 2j and up block 2j + 1, adjacent in the packed
    // weight; for M = 1 as two streams at once.
    float* gate = scratch;
    float* up = scratch + (p.M > 2 ? p.M : 2) * kBlockN;
    for (int64_t j = block_begin; j < block_end; ++j) {
      const uint16_t* w_gate = p.w + 2 * j * block_elems;
      if (p.M == 1) {
        Unit::two_blocks(p, w_gate, w_gate + block_elems, gate, up);
      } else {
        Unit::one_block(p, w_gate, gate);
        Unit::one_block(p, w_gate + block_elems, up);
      }
      Unit::store_silu_mul(p, j * kBlockN, gate, up);
    }
    return;
  }
  if (p.M == 1) {  // blocks from the two halves of the range, as two streams
    const int64_t half = (block_end - block_begin) / 2;
    float* other = scratch + kBlockN;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t a = block_begin + i, b = block_begin + half + i;
      Unit::two_blocks(p, p.w + a * block_elems, p.w + b * block_elems, scratch, other);
      Unit::store(p, a * kBlockN, scratch);
      Unit::store(p, b * kBlockN, other);
    }
    block_begin += 2 * half;  // an odd block left over runs alone below
  }
  for (int64_t nb = block_begin; nb < block_end; ++nb) {
    Unit::one_block(p, p.w + nb * block_elems, scratch);
    Unit::store(p, nb * kBlockN, scratch);
  }
}

}  // namespace
}  // namespace tilefx
