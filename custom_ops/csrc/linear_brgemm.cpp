// The linear ops on oneDNN's brgemm (at::native::cpublas::brgemm), the GEMM kernel stock
// PyTorch's bf16 matmul runs: AMX tiles where the CPU has them, oneDNN's AVX512-BF16 JIT
// kernels on other AVX512-BF16 CPUs, a slow reference loop elsewhere (there only the tests
// force it). Prefill, and decode's 1 to 4 rows where tuning found it faster than the unit's
// walk (tuning.h decode_on_brgemm). The packed layout (kernels.h) is already brgemm's VNNI layout for B, one block
// of kBlockN columns at a time. Each block (gate and up together for SiLU-and-mul) is read
// once per call: a quantized one is dequantized to bf16 once, by the unit's panel routine,
// and serves every row tile. The fp32 result tiles leave through the unit's epilogue (bias,
// bf16 or fp32 output, SiLU-and-mul), int8's column scales applied first, so the same op
// computes the same thing on either GEMM.
#include <ATen/native/CPUBlas.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

#include "aligned.h"
#include "dispatch.h"
#include "kernels.h"
#include "layout.h"
#include "ops.h"
#include "tuning.h"

namespace tilefx {
namespace {

// One brgemm call multiplies a tile of x's rows by a chunk of K pairs of a block, adding to the
// previous chunk's result (tuning.h GemmTiling: 64 rows and 1024 pairs by default, where x's part,
// 256 KiB, and the block's, 128 KiB, stay in L2 while brgemm walks them; a whole K of 8192 read both
// from L3, docs/PERFORMANCE.md). Scratch holds the largest tile, so a tiling set meanwhile is safe.
// Decode's rows (1 to kGemvRows) take K in chunks of kDecodeGemmPairs whatever the tiling.
constexpr int64_t kDecodeGemmPairs = 1024;

// Work units are taken in groups whose bf16 weights (the blocks, or their dequantized panels) fill
// at most kGroupBytes, and each row tile of x meets the whole group before the next tile: x is read
// once per group rather than once per block. x of 1024 rows at K 2048 is 4 MiB, past an L2, so
// block by block every block read it again from L3; at AMX's GEMM rate that traffic is a share of
// the time (at Zen 4's, brgemm is compute-bound either way: measured level).
constexpr int64_t kGroupBytes = 512 << 10;
constexpr int64_t kMaxGroup = 8;

// Blocks a work unit multiplies: gate and up with SiLU-and-mul, else one.
int64_t blocks_per_unit(const LinearProblem& p) { return p.silu_mul ? 2 : 1; }

// Units a group holds: their blocks of K pairs in bf16 within kGroupBytes.
int64_t group_units(const LinearProblem& p) {
  const int64_t unit_bytes = blocks_per_unit(p) * block_values(p.K_pairs) * int64_t{sizeof(uint16_t)};
  return std::clamp<int64_t>(kGroupBytes / std::max<int64_t>(unit_bytes, 1), 1, kMaxGroup);
}

// `p` restricted to its rows [row, row + rows): what the epilogue writes.
LinearProblem row_tile(const LinearProblem& p, int64_t row, int64_t rows) {
  LinearProblem tile = p;
  tile.M = rows;
  if (tile.y != nullptr) tile.y += row * p.ldy;
  if (tile.yf != nullptr) tile.yf += row * p.ldy;
  return tile;
}

}  // namespace

bool amx_available() { return at::native::cpublas::could_pack(at::kBFloat16); }

const UnitEpilogue& epilogue_of(LinearUnit unit) {
  switch (unit) {
    case LinearUnit::avx2: return unit_epilogue_avx2();
    case LinearUnit::avx512: return unit_epilogue_avx512();
    case LinearUnit::avx512_emulated:
#ifdef TILEFX_AVX512_EMULATION
      return unit_epilogue_avx512_emulated();
#endif
      break;  // unreachable: set_path refuses the emulated path in builds without it
  }
  TORCH_CHECK(false, "tilefx brgemm: no epilogue for unit ", unit_name(unit));
}

int64_t brgemm_scratch_floats(const LinearProblem& p) {
  const int64_t tile = std::min(p.M, kMaxGemmRows);
  // the quantized group's bf16 panels, in floats
  const int64_t panels = p.format == WeightFormat::bf16
                             ? 0
                             : group_units(p) * blocks_per_unit(p) * block_values(p.K_pairs) / 2;
  return 2 * tile * kBlockN + panels;
}

void linear_blocks_brgemm(LinearUnit unit, const LinearProblem& p, int64_t begin, int64_t end, float* scratch) {
  TORCH_CHECK(p.x_form == ActivationForm::bf16_pairs, "tilefx brgemm: x must be bf16 pairs");
  // its panels and result tiles are brgemm's B and C: a row split across two cache lines costs two (aligned.h)
  TORCH_CHECK(reinterpret_cast<uintptr_t>(scratch) % kCacheLine == 0, "tilefx brgemm: scratch must be cache-line aligned");
  const UnitEpilogue& epilogue = epilogue_of(unit);
  const int64_t block_elems = block_values(p.K_pairs);
  const GemmTiling tiling = p.M > kGemvRows ? gemm_tiling() : GemmTiling{kGemvRows, kDecodeGemmPairs};
  const int64_t tile = std::min(p.M, tiling.rows);
  const int64_t per_unit = blocks_per_unit(p);
  const int64_t widest = std::min(p.M, kMaxGemmRows);  // the tile scratch holds (brgemm_scratch_floats)
  float* results[2] = {scratch, scratch + widest * kBlockN};
  uint16_t* panels = reinterpret_cast<uint16_t*>(scratch + 2 * widest * kBlockN);
  const auto* x = static_cast<const at::BFloat16*>(p.x);

  // Block `block` as brgemm's B: the packed bf16 block, or the quantized one dequantized into panel `which`.
  auto weight = [&](int64_t block, int64_t which) {
    if (p.format == WeightFormat::bf16) return reinterpret_cast<const at::BFloat16*>(p.w + block * block_elems);
    uint16_t* panel = panels + which * block_elems;
    epilogue.dequantize[static_cast<int>(p.format)](p, block, panel);
    return reinterpret_cast<const at::BFloat16*>(panel);
  };
  auto multiply = [&](const at::BFloat16* b, int64_t block, int64_t row, int64_t rows, float* c) {
    for (int64_t q = 0; q < p.K_pairs; q += tiling.pairs) {
      const int64_t pairs = std::min(tiling.pairs, p.K_pairs - q);
      at::native::cpublas::brgemm(rows, kBlockN, 2 * pairs, p.ldx, kBlockN, kBlockN, /*add_C=*/q > 0,
                                  x + row * p.ldx + 2 * q, b + block_values(q), c);
    }
    if (p.format == WeightFormat::int8) {  // the dequantized panel is unscaled: its column scales apply here
      const float* s = p.scales + block * kBlockN;
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t j = 0; j < kBlockN; ++j) c[m * kBlockN + j] *= s[j];
    }
  };
  // Work units are blocks, or gate/up block pairs (2u, 2u + 1) with SiLU-and-mul.
  const int64_t group = group_units(p);
  const at::BFloat16* b[kMaxGroup * 2];
  for (int64_t first = begin; first < end; first += group) {
    const int64_t units = std::min(group, end - first);
    for (int64_t i = 0; i < units * per_unit; ++i) b[i] = weight(first * per_unit + i, i);
    for (int64_t row = 0; row < p.M; row += tile) {
      const int64_t rows = std::min(tile, p.M - row);
      const LinearProblem out = row_tile(p, row, rows);
      for (int64_t i = 0; i < units; ++i) {
        const int64_t u = first + i;
        if (p.silu_mul) {
          multiply(b[2 * i], 2 * u, row, rows, results[0]);
          multiply(b[2 * i + 1], 2 * u + 1, row, rows, results[1]);
          epilogue.store_silu_mul(out, u * kBlockN, results[0], results[1]);
        } else {
          multiply(b[i], u, row, rows, results[0]);
          epilogue.store(out, u * kBlockN, results[0]);
        }
      }
    }
  }
  at::native::cpublas::brgemm_release();
}

}  // namespace tilefx
