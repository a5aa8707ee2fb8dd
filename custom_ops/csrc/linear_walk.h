// How a linear's column blocks are walked, shared by the ISA units (linear_avx2.cpp,
// linear_avx512.cpp). Each includes this after its own ISA setup and instantiates
// walk_blocks with its micro-kernels, so every line here is compiled for that unit's
// ISA; it is a template in an anonymous namespace, so no symbol leaves the unit.
#pragma once
#include <utility>

#include "kernels.h"

namespace tilefx {
namespace {

// A decode kernel's software prefetch, fixed for a call: none at distance 0, else one hint
// (LinearProblem::prefetch_bytes, prefetch_hint). A template argument of the kernels, so their
// loops carry no branch for it.
enum class Prefetch { none, nta, t0, t1 };

template <Prefetch P>
inline void prefetch(const void* address) {
  const char* line = static_cast<const char*>(address);
  if constexpr (P == Prefetch::nta) _mm_prefetch(line, _MM_HINT_NTA);
  if constexpr (P == Prefetch::t0) _mm_prefetch(line, _MM_HINT_T0);
  if constexpr (P == Prefetch::t1) _mm_prefetch(line, _MM_HINT_T1);
}

template <Prefetch P>
struct PrefetchAs {
  static constexpr Prefetch value = P;
};

// body(m, std::integral_constant<int, R>{}) for each micro-tile of a GEMM over rows [0, rows): tiles of TileRows
// rows from m = 0, the last one R = what is left, so each tile's row count is a template argument of its kernel.
template <int TileRows, class Body, int... R>
inline void over_row_tiles(int64_t rows, const Body& body, std::integer_sequence<int, R...>) {
  for (int64_t m = 0; m < rows; m += TileRows) {
    const int64_t left = rows - m < TileRows ? rows - m : TileRows;
    ((left == R + 1 ? (body(m, std::integral_constant<int, R + 1>{}), true) : false) || ...);
  }
}
template <int TileRows, class Body>
inline void over_row_tiles(int64_t rows, const Body& body) {
  over_row_tiles<TileRows>(rows, body, std::make_integer_sequence<int, TileRows>{});
}

// body(q0, q1, m, std::integral_constant<int, R>{}) for a GEMM's micro-tiles: p's K pairs in chunks [q0, q1) of
// `chunk`, outermost, so a chunk of the block stays in L1 while every row tile passes over it; within a chunk p's
// rows in tiles of TileRows (over_row_tiles).
template <int TileRows, class Body>
inline void over_gemm_tiles(const LinearProblem& p, int64_t chunk, const Body& body) {
  for (int64_t q0 = 0; q0 < p.K_pairs; q0 += chunk) {
    const int64_t q1 = q0 + chunk < p.K_pairs ? q0 + chunk : p.K_pairs;
    over_row_tiles<TileRows>(p.M, [&](int64_t m, auto rows) { body(q0, q1, m, rows); });
  }
}

// body(PrefetchAs<P>{}) with P the problem's prefetch: a kernel reads it as decltype(tag)::value.
template <class Body>
inline void with_prefetch(const LinearProblem& p, const Body& body) {
  if (p.prefetch_bytes == 0) return body(PrefetchAs<Prefetch::none>{});
  switch (p.prefetch_hint) {
    case PrefetchHint::t0: return body(PrefetchAs<Prefetch::t0>{});
    case PrefetchHint::t1: return body(PrefetchAs<Prefetch::t1>{});
    case PrefetchHint::nta: break;
  }
  body(PrefetchAs<Prefetch::nta>{});
}

// The M = 1 gate/up walk with SiLU-and-mul over output blocks [block_begin, block_end):
// stream a takes the first half of them and stream b the second, and each reads its
// blocks in memory order, gate j then up j then gate j + 1, so neither stream jumps
// and each one's prefetch past a block's end lands on what it reads next. (Pairing
// gate j with up j instead restarts both streams at every block, and the gate/up GEMV
// read less than a plain GEMV over the same bytes: docs/PERFORMANCE.md.)
// `two(a, b, c_a, c_b)` runs packed blocks a and b as two streams; `gate` and `up`
// hold 2 * kBlockN floats each. Returns where the walk stopped: an odd block is left.
template <class Unit, class Two>
int64_t silu_mul_halves(const LinearProblem& p, int64_t block_begin, int64_t block_end, float* gate, float* up,
                        const Two& two) {
  const int64_t half = (block_end - block_begin) / 2, second = p.M * kBlockN;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = block_begin + i, b = block_begin + half + i;
    two(2 * a, 2 * b, gate, gate + second);
    two(2 * a + 1, 2 * b + 1, up, up + second);
    Unit::store_silu_mul(p, a * kBlockN, gate, up);
    Unit::store_silu_mul(p, b * kBlockN, gate + second, up + second);
  }
  return block_begin + 2 * half;
}

// `Unit` supplies, over the activations in the form it reads (LinearProblem::x_form, activations.h):
//   kTwoBlockRows                              the most rows two_blocks takes
//   two_blocks(p, block_a, block_b, c_a, c_b)  M = 1 to kTwoBlockRows against two blocks at once (two streams)
//   one_block(p, block, c)                     every row against one block (GEMV; GEMM above 2 rows, 4 on AVX512)
//   store(p, col0, c)                          bias and the output conversion
//   store_silu_mul(p, col0, gate, up)          the gate/up epilogue
// Results are fp32 rows of kBlockN in `scratch` (linear_scratch_floats). A batch's decode (up to kTwoBlockRows
// rows) reads two blocks at once as a single row does: on a Xeon 6 one stream of 2 rows read 21-24 GB/s where
// two streams read 27-28 (docs/PERFORMANCE.md, fifty-second session).
template <class Unit>
void walk_blocks(const LinearProblem& p, int64_t block_begin, int64_t block_end, float* scratch) {
  const int64_t block_elems = pairs_between_blocks(p) * kPairValues;
  const bool two_streams = p.M <= Unit::kTwoBlockRows && p.streams == 2;
  if (p.silu_mul) {
    // Output block j reads gate block 2j and up block 2j + 1, adjacent in the packed
    // weight. In two streams each reads its half of the range front to back
    // (gate j, up j, gate j + 1, ...; see silu_mul_halves).
    float* gate = scratch;
    float* up = scratch + (two_streams ? 2 * p.M : std::max<int64_t>(p.M, 2)) * kBlockN;
    if (two_streams) {
      auto two = [&](int64_t a, int64_t b, float* c_a, float* c_b) {
        Unit::two_blocks(p, p.w + a * block_elems, p.w + b * block_elems, c_a, c_b);
      };
      block_begin = silu_mul_halves<Unit>(p, block_begin, block_end, gate, up, two);
    }
    for (int64_t j = block_begin; j < block_end; ++j) {
      const uint16_t* w_gate = p.w + 2 * j * block_elems;
      if (two_streams) {
        Unit::two_blocks(p, w_gate, w_gate + block_elems, gate, up);
      } else {
        Unit::one_block(p, w_gate, gate);
        Unit::one_block(p, w_gate + block_elems, up);
      }
      Unit::store_silu_mul(p, j * kBlockN, gate, up);
    }
    return;
  }
  if (two_streams) {  // blocks from the two halves of the range, as two streams
    const int64_t half = (block_end - block_begin) / 2;
    float* other = scratch + p.M * kBlockN;
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

// M = 1 to kGemvRows rows of p against quantized block `block`, in registers, into c. Where the unit's q_blocks
// takes fewer rows than p has (q_register_rows: 2, the AVX2 unit's int4), rows 0-1 read the block from memory and
// rows 2-3 read it again from the cache: a block is 12-128 KiB of int4 for the usual K (32 columns), so L2 holds
// it. (Dequantizing the block to bf16 for its bf16 GEMV instead, as 3-4 rows did before, read 4.4 GB/s of int4.)
template <class Unit, WeightFormat F>
void q_block(const LinearProblem& p, int64_t block, float* c) {
  const int64_t which[1] = {block};
  float* out[1] = {c};
  if constexpr (Unit::q_register_rows(F) > 2) {
    if (p.M == 3) return Unit::template q_blocks<F, 3, 1>(p, which, out);
    if (p.M == 4) return Unit::template q_blocks<F, 4, 1>(p, which, out);
  } else if (p.M > 2) {
    Unit::template q_blocks<F, 2, 1>(p, which, out);
    const LinearProblem rest = rows_from(p, 2);
    float* later[1] = {c + 2 * kBlockN};
    return rest.M == 1 ? Unit::template q_blocks<F, 1, 1>(rest, which, later)
                       : Unit::template q_blocks<F, 2, 1>(rest, which, later);
  }
  return p.M == 1 ? Unit::template q_blocks<F, 1, 1>(p, which, out) : Unit::template q_blocks<F, 2, 1>(p, which, out);
}

// Quantized weights in format F (p.format int8 / fp8 / int4). `Unit` also supplies:
//   q_register_rows(F)                       the most rows its q_blocks takes for F (2, or kGemvRows)
//   q_blocks<F, Rows, Blocks>(p, blocks, c)  M = Rows (1 to q_register_rows(F)) against `Blocks` blocks at once
//                                             (Blocks = 2: two streams, Rows 1 or 2), scales applied; c[i] gets block i's
//   dequantize<F>(p, block, out)             block as bf16 in the packed order (fp8, int4: scaled; int8: not)
//   kIntegerGemmForm, integer_gemm_block<F>(p, block, c)
//                                            the x form its int8 and int4 GEMMs read, and those GEMMs (scaled)
// Decode (up to kGemvRows rows) reads the values in registers (q_blocks; int8 and int4 against x as int16 words);
// above that an int8 or int4 GEMM over x in kIntegerGemmForm (activations.h activation_form) multiplies the
// weight's integers as they are (integer_gemm_block), and otherwise each block is dequantized into scratch once
// and one_block runs over it, then int8's column scales apply.
template <class Unit, WeightFormat F>
void walk_quantized(const LinearProblem& p, int64_t block_begin, int64_t block_end, float* scratch) {
  const bool two_streams = Unit::kTwoStreams && p.M <= 2 && p.streams == 2;
  const int64_t rows = p.M > 2 ? p.M : 2;
  float* first = scratch;  // (with two streams a gate/up walk's first holds two blocks' rows: silu_mul_halves)
  float* second = scratch + (two_streams ? 2 * p.M : rows) * kBlockN;
  uint16_t* panel = reinterpret_cast<uint16_t*>(scratch + 2 * rows * kBlockN);
  auto one = [&](int64_t block, float* c) {
    if (p.M <= kGemvRows) return q_block<Unit, F>(p, block, c);
    if constexpr (F == WeightFormat::int8 || F == WeightFormat::int4) {
      if (p.x_form == Unit::kIntegerGemmForm) return Unit::template integer_gemm_block<F>(p, block, c);
    }
    Unit::template dequantize<F>(p, block, panel);
    Unit::one_block(p, panel, c);
    if constexpr (F == WeightFormat::int8) {
      const float* s = p.scales + block * kBlockN;
      for (int64_t m = 0; m < p.M; ++m)
        for (int64_t j = 0; j < kBlockN; ++j) c[m * kBlockN + j] *= s[j];
    }
  };
  auto two = [&](int64_t a, int64_t b, float* c_a, float* c_b) {
    if constexpr (Unit::kTwoStreams) {
      if (two_streams) {
        float* out[2] = {c_a, c_b};
        const int64_t which[2] = {a, b};
        return p.M == 1 ? Unit::template q_blocks<F, 1, 2>(p, which, out)
                        : Unit::template q_blocks<F, 2, 2>(p, which, out);
      }
    }
    one(a, c_a);
    one(b, c_b);
  };
  if (p.silu_mul) {
    // (a unit that streams one quantized block at a time reads gate j, up j in memory order already)
    if (two_streams) block_begin = silu_mul_halves<Unit>(p, block_begin, block_end, first, second, two);
    for (int64_t j = block_begin; j < block_end; ++j) {
      two(2 * j, 2 * j + 1, first, second);
      Unit::store_silu_mul(p, j * kBlockN, first, second);
    }
    return;
  }
  if (two_streams) {
    const int64_t half = (block_end - block_begin) / 2;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t a = block_begin + i, b = block_begin + half + i;
      two(a, b, first, second);
      Unit::store(p, a * kBlockN, first);
      Unit::store(p, b * kBlockN, second);
    }
    block_begin += 2 * half;
  }
  for (int64_t nb = block_begin; nb < block_end; ++nb) {
    one(nb, first);
    Unit::store(p, nb * kBlockN, first);
  }
}

template <class Unit>
void walk(const LinearProblem& p, int64_t block_begin, int64_t block_end, float* scratch) {
  switch (p.format) {
    case WeightFormat::bf16: return walk_blocks<Unit>(p, block_begin, block_end, scratch);
    case WeightFormat::int8: return walk_quantized<Unit, WeightFormat::int8>(p, block_begin, block_end, scratch);
    case WeightFormat::fp8: return walk_quantized<Unit, WeightFormat::fp8>(p, block_begin, block_end, scratch);
    case WeightFormat::int4: return walk_quantized<Unit, WeightFormat::int4>(p, block_begin, block_end, scratch);
  }
}

}  // namespace
}  // namespace tilefx
