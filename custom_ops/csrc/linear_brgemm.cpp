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

#include <xmmintrin.h>

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
// from L3, docs/PERFORMANCE.md); a call over several panels of rows takes the long prompt's chunk where tuning
// set one (tuning.h gemm_long_pairs). Scratch holds the largest tile, so a tiling set meanwhile is safe.
// Decode's rows (1 to kGemvRows) take K in chunks of kDecodeGemmPairs whatever the tiling.
constexpr int64_t kDecodeGemmPairs = 1024;

// Work units are taken in groups whose bf16 weights (the blocks, or their dequantized panels) fill
// at most kGroupBytes, and each row tile of x meets the whole group before the next tile: x is read
// once per group rather than once per block. x of 1024 rows at K 2048 is 4 MiB, past an L2, so
// block by block every block read it again from L3; at AMX's GEMM rate that traffic is a share of
// the time (at Zen 4's, brgemm is compute-bound either way: measured level). bf16 blocks are counted
// by the K chunk a call takes, not whole: with K in chunks, the group's chunk is what stays in L2
// while the row tiles pass, and K 8192 (a down projection) would otherwise make every group one block
// and every block read all of x again (x of 1024 rows is then 16 MiB, read from L3 per block at a
// third of AMX's rate). A quantized group's blocks are dequantized once, into bf16 panels (chunk by
// chunk as the first panel of rows reaches them), which kQuantizedPanelBytes also bounds (a down
// projection's 512 KiB blocks eight to a group, not one). 4 MiB, past an L2, where 2 made groups of half
// bf16's (4 gate/up units to its 8) and int8's 1024-token TTFT 1.06x bf16's, against 1.01-1.03x.
constexpr int64_t kGroupBytes = 512 << 10;
constexpr int64_t kQuantizedPanelBytes = 4 << 20;
constexpr int64_t kMaxGroup = 8;

// Rows of x whose fp32 results a group keeps while K's chunks pass (at most kMaxGroup units of 2 blocks:
// 512 KiB of scratch); a longer prompt takes the group's chunks again per panel of rows.
constexpr int64_t kPanelRows = 256;

// Rows from which a prefill on AMX tiles writes its output with non-temporal stores (LinearProblem::stream_y).
// Stored through the cache, each output line is first read for ownership, and the lines then sit in L2 over
// the weights and x the next calls read: on the Xeon 6, Llama-1B's prefill GEMMs at 1024 rows took 1.05x the
// time stored so (o_proj 1.14x), and TTFT was 1.02x at 128 and 1024 tokens (int8: 1.04x at 1024), though the
// output's consumers then read it from memory (docs/PERFORMANCE.md, forty-ninth session). fused_moe's experts
// too: their outputs are read only once every expert is done (the down projection's by the combine, megabytes
// later), and a 1024-token prompt's routed experts took 1.10x (Qwen3-30B-A3B) and 1.12x (DeepSeek-V2-Lite) the
// time stored through the cache, the down projection 1.2-1.3x (fifty-second session). Measured on AMX CPUs
// only, so only the tile kernel's path streams.
constexpr int64_t kStreamRows = 64;

// Rows from which a tile kernel's call prefetches what the next call multiplies (multiply_tiles' `next`). The
// prefetches are spread over the call's products, and each holds one of the core's fill buffers for a DRAM
// round trip, the buffers the tile loads from L2 need too. Over a call of few rows they come too densely: the
// products wait, and the L2's own streamer, which fetches a block's bytes as the tile loads walk them without
// taking those buffers, does better. On the Xeon 6, cold weights, prefetch off against on: Llama-1B's GEMMs
// 0.83x the time at 32 rows, 0.94x at 64, 0.97x at 80, level at 96, 1.03x at 128, 1.07x at 1024;
// fused_moe's routed experts 0.84-0.88x at 16-48 rows an expert, 0.93x at 64 (Qwen3-30B-A3B, 1024 tokens),
// 1.02x at 96 (DeepSeek-V2-Lite, 1024 tokens) and 128 (docs/PERFORMANCE.md, fifty-third session).
constexpr int64_t kPrefetchRows = 96;

// Below kPrefetchRows a call's first row tile prefetches its own bf16 blocks this far ahead of its loads (two K
// steps, into L1), as the decode walks read theirs: the L2's streamer alone left the first pass waiting on
// memory. On the Xeon 6, cold weights, with it against without: Llama-1B's GEMMs 0.90x the time at 32 rows, 0.99x
// at 64; fused_moe's experts 0.78x at ~16 rows an expert, 0.88-0.91x at 32-48, 0.97x at 64 (fifty-third session;
// 2 KiB and 8 KiB ahead, or into L2 only, within a few percent of it).
constexpr int64_t kAheadBytes = 4096;

// Blocks a work unit multiplies: gate and up with SiLU-and-mul, else one.
int64_t blocks_per_unit(const LinearProblem& p) { return p.silu_mul ? 2 : 1; }

// The bf16 bytes of a unit's blocks over `pairs` K pairs.
int64_t unit_bytes(const LinearProblem& p, int64_t pairs) {
  return std::max<int64_t>(blocks_per_unit(p) * block_values(pairs) * int64_t{sizeof(uint16_t)}, 1);
}

// Units a group holds: a chunk of `chunk_pairs` of their blocks in bf16 within kGroupBytes and, quantized,
// their whole dequantized blocks within kQuantizedPanelBytes.
int64_t group_units(const LinearProblem& p, int64_t chunk_pairs) {
  int64_t units = kGroupBytes / unit_bytes(p, std::min(chunk_pairs, p.K_pairs));
  if (p.format != WeightFormat::bf16) units = std::min(units, kQuantizedPanelBytes / unit_bytes(p, p.K_pairs));
  return std::clamp<int64_t>(units, 1, kMaxGroup);
}

// Quantized `p` restricted to its K pairs [q, q + pairs) (q a multiple of the fp8 / int4 scale groups' 64 pairs),
// each block still where it was: what dequantizing one chunk of a block reads.
LinearProblem k_chunk(const LinearProblem& p, int64_t q, int64_t pairs) {
  LinearProblem chunk = p;
  chunk.block_pairs = pairs_between_blocks(p);
  chunk.K_pairs = pairs;
  chunk.wq = p.wq + q * pair_bytes(p.format);
  if (p.format == WeightFormat::fp8) chunk.scales = p.scales + q / kFp8GroupPairs;
  if (p.format == WeightFormat::int4) chunk.int4_params = p.int4_params + q / kInt4GroupPairs * 2 * kBlockN;
  return chunk;
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
  // the results of a panel of rows for the largest group any tiling makes (a tiling set meanwhile is safe)
  const int64_t results = std::min(p.M, kPanelRows) * kMaxGroup * blocks_per_unit(p) * kBlockN;
  // the quantized group's bf16 panels, in floats: whole blocks within kQuantizedPanelBytes, or one unit's
  const int64_t panels = p.format == WeightFormat::bf16
                             ? 0
                             : std::max(kQuantizedPanelBytes, unit_bytes(p, p.K_pairs)) / int64_t{sizeof(float)};
  return results + panels;
}

void linear_blocks_brgemm(LinearUnit unit, const LinearProblem& p, int64_t begin, int64_t end, float* scratch) {
  TORCH_CHECK(p.x_form == ActivationForm::bf16_pairs, "tilefx brgemm: x must be bf16 pairs");
  // its panels and result tiles are brgemm's B and C: a row split across two cache lines costs two (aligned.h)
  TORCH_CHECK(reinterpret_cast<uintptr_t>(scratch) % kCacheLine == 0, "tilefx brgemm: scratch must be cache-line aligned");
  const UnitEpilogue& epilogue = epilogue_of(unit);
  const int64_t block_elems = block_values(p.K_pairs);
  const GemmTiling tiling = p.M > kGemvRows ? gemm_tiling() : GemmTiling{kGemvRows, kDecodeGemmPairs, false};
  // tilefx's AMX kernel takes K in steps of 16 pairs; other K (no model's so far) stay on brgemm
  const bool tiles = tiling.tiles && p.K_pairs % 16 == 0;
  const int64_t tile = std::min(p.M, tiling.rows);
  const int64_t per_unit = blocks_per_unit(p);
  // A long prompt (rows past one panel of the tiling's) takes the long prompt's chunk where tuning set one
  // (tuning.h gemm_long_pairs): past the first panel the weights come from cache. The tile kernel then takes
  // panels of kPanelRows, so that each chunk read serves the most row tiles; otherwise a panel of the tiling's
  // rows at once (scratch holds kPanelRows of them).
  const int64_t tiling_panel = tiles ? tiling.rows : kPanelRows, long_pairs = gemm_long_pairs();
  const bool long_prompt = long_pairs > 0 && p.M > tiling_panel;
  const int64_t chunk = long_prompt ? long_pairs : tiling.pairs;
  const int64_t panel_rows = std::min(p.M, long_prompt ? kPanelRows : tiling_panel);
  const bool stream = tiles && p.M >= kStreamRows;
  float* results = scratch;  // per block of the group: [panel_rows][kBlockN] fp32
  uint16_t* panels = reinterpret_cast<uint16_t*>(scratch + panel_rows * kMaxGroup * per_unit * kBlockN);
  const auto* x = static_cast<const at::BFloat16*>(p.x);

  // Block `block` as brgemm's B: the packed bf16 block, or panel `which`, into which the first panel of rows
  // dequantizes each K chunk of the quantized block just before it multiplies it (dequantize_chunk). Whole
  // blocks dequantized ahead of the group left the quantized bytes to the last chunk's calls to prefetch, and
  // the dequantization waited on DRAM: int8's gate/up ran 13% behind bf16's at 1024 rows (docs/PERFORMANCE.md).
  const bool quantized = p.format != WeightFormat::bf16;
  const int64_t quantized_block_bytes = pairs_between_blocks(p) * pair_bytes(p.format);
  auto weight = [&](int64_t block, int64_t which) {
    if (!quantized) return reinterpret_cast<const at::BFloat16*>(p.w + block * block_elems);
    return reinterpret_cast<const at::BFloat16*>(panels + which * block_elems);
  };
  auto dequantize_chunk = [&](int64_t block, int64_t which, int64_t q, int64_t pairs) {
    epilogue.dequantize[static_cast<int>(p.format)](k_chunk(p, q, pairs), block,
                                                      panels + which * block_elems + block_values(q));
  };
  // Work units are blocks, or gate/up block pairs (2u, 2u + 1) with SiLU-and-mul; the group's i-th block
  // (unit i / per_unit) keeps its results at results + i * panel_rows * kBlockN.
  const int64_t group = group_units(p, chunk);
  const at::BFloat16* b[kMaxGroup * 2];
  for (int64_t first = begin; first < end; first += group) {
    const int64_t units = std::min(group, end - first), blocks = units * per_unit;
    for (int64_t i = 0; i < blocks; ++i) b[i] = weight(first * per_unit + i, i);
    for (int64_t panel = 0; panel < p.M; panel += panel_rows) {
      const int64_t prows = std::min(panel_rows, p.M - panel);
      // K's chunks outermost: a chunk of the group's blocks stays in L2 while the panel's row tiles pass
      for (int64_t q = 0; q < p.K_pairs; q += chunk) {
        const int64_t pairs = std::min(chunk, p.K_pairs - q);
        if (quantized && panel == 0 && !tiles) {  // (the tile kernel's calls dequantize theirs one by one)
          for (int64_t i = 0; i < blocks; ++i) dequantize_chunk(first * per_unit + i, i, q, pairs);
        }
        if (tiles) {  // the panel's rows at once, two blocks a call
          // A panel of kPrefetchRows rows or more fetches what its next call multiplies from memory; a shorter one
          // has its first row tile read its own bf16 blocks ahead (a quantized call's panel is in cache).
          const bool fetch_next = prows >= kPrefetchRows;
          const int64_t ahead = !quantized && !fetch_next ? kAheadBytes : 0;
          for (int64_t i = 0; i < blocks; i += 2) {
            const int64_t width = std::min<int64_t>(2, blocks - i), block = first * per_unit + i;
            if (quantized && panel == 0) {
              for (int64_t j = 0; j < width; ++j) dequantize_chunk(block + j, i + j, q, pairs);
            }
            // the chunks the next call multiplies: the group's next two blocks at this chunk; after its last, its
            // first two at the next chunk, or at the first chunk again for the next panel, or the next group's.
            // They come from memory where they are bf16, or where the next call dequantizes them (a first panel).
            int64_t next_block = block + 2, next_q = q;
            bool next_first_panel = panel == 0;
            if (i + 2 >= blocks) {
              next_q = q + pairs < p.K_pairs ? q + pairs : 0;
              const bool next_group = next_q == 0 && panel + prows >= p.M;
              next_block = first * per_unit + (next_group ? blocks : 0);
              if (next_q == 0) next_first_panel = next_group;
            }
            const int64_t next_pairs = std::min(chunk, p.K_pairs - next_q);
            const void* next[2] = {nullptr, nullptr};
            const int64_t next_bytes = quantized ? next_pairs * pair_bytes(p.format)
                                                 : block_values(next_pairs) * int64_t{sizeof(uint16_t)};
            for (int64_t j = 0; j < 2 && fetch_next && next_block + j < end * per_unit; ++j) {
              if (!quantized) {
                next[j] = p.w + (next_block + j) * block_elems + block_values(next_q);
              } else if (next_first_panel) {
                next[j] = p.wq + (next_block + j) * quantized_block_bytes + next_q * pair_bytes(p.format);
              }
            }
            const uint16_t* chunks[2] = {reinterpret_cast<const uint16_t*>(b[i] + block_values(q)),
                                         width == 2 ? reinterpret_cast<const uint16_t*>(b[i + 1] + block_values(q))
                                                    : nullptr};
            float* c[2] = {results + i * panel_rows * kBlockN, results + (i + 1) * panel_rows * kBlockN};
            multiply_tiles(reinterpret_cast<const uint16_t*>(x + panel * p.ldx + 2 * q), p.ldx, prows, width, chunks,
                           pairs, c, q > 0, next, next_bytes, ahead);
          }
          continue;
        }
        for (int64_t row = panel; row < panel + prows; row += tile) {
          const int64_t rows = std::min(tile, panel + prows - row);
          for (int64_t i = 0; i < blocks; ++i) {
            at::native::cpublas::brgemm(rows, kBlockN, 2 * pairs, p.ldx, kBlockN, kBlockN, /*add_C=*/q > 0,
                                        x + row * p.ldx + 2 * q, b[i] + block_values(q),
                                        results + (i * panel_rows + row - panel) * kBlockN);
          }
        }
      }
      LinearProblem out = row_tile(p, panel, prows);
      out.stream_y = stream;
      if (p.format == WeightFormat::int8) {  // the dequantized panels are unscaled: the column scales apply here
        for (int64_t i = 0; i < blocks; ++i) {
          epilogue.scale_columns(results + i * panel_rows * kBlockN, p.scales + (first * per_unit + i) * kBlockN, prows);
        }
      }
      for (int64_t i = 0; i < units; ++i) {
        const int64_t u = first + i;
        const float* c = results + i * per_unit * panel_rows * kBlockN;
        if (p.silu_mul) {
          epilogue.store_silu_mul(out, u * kBlockN, c, c + panel_rows * kBlockN);
        } else {
          epilogue.store(out, u * kBlockN, c);
        }
      }
    }
  }
  if (stream) _mm_sfence();  // the streamed lines reach memory before the op returns (other threads read y)
  if (tiles) {
    release_tiles();
  } else {
    at::native::cpublas::brgemm_release();
  }
}

}  // namespace tilefx
