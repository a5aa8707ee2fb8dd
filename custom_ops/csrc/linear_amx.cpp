// tilefx's own AMX kernel for the prefill linears' GEMM: rows of x times a K chunk of one packed bf16 block
// (kernels.h: already the VNNI layout AMX's B takes), written with the tile intrinsics. linear_brgemm.cpp runs
// it in place of oneDNN's brgemm calls where tuning chose it (tuning.h GemmTiling::tiles); the grouping of
// blocks, K's chunks, the quantized blocks' bf16 panels and the epilogues stay the same.
//
// Why a kernel of our own: a brgemm call is opaque, so nothing can fetch the next block's bytes while it
// multiplies. A prompt of a few hundred tokens reads each weight block from DRAM once, and brgemm's first
// pass over a block waits on those reads: at 128 rows the time was the GEMM's plus the weights' streaming,
// not the larger of the two. Here the K steps interleave software prefetches of the bytes the caller will
// multiply next (the next block's chunk), a few cache lines a step, so the stream overlaps the products.
// Runs only where the CPU has AMX and Linux granted this process the tile state (amx_tiles_usable).
#pragma GCC target("amx-tile,amx-bf16,sse")
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"
#include "ops.h"

namespace tilefx {
namespace {

// The tile registers: results C[row tile][column half], x's two row tiles, the block's two column halves.
// Macros, not constants: the intrinsics paste the register's number into their assembly.
#define kC00 0
#define kC01 1
#define kC10 2
#define kC11 3
#define kA0 4
#define kA1 5
#define kB0 6
#define kB1 7
#define kB2 5  // row_tile_pair's third B tile, in place of the second x tile

constexpr int64_t kTileRows = 16;   // rows of x (and of C) a tile holds
constexpr int64_t kTilePairs = 16;  // K pairs a step multiplies: 32 bf16 of a row of x, 16 pair rows of B
constexpr int kRowBytes = 64;       // every tile row: 16 fp32 of C, 16 pairs of x, 16 columns' pairs of B
constexpr int64_t kBlockRowValues = kBlockN * 2;             // one pair row of a packed block
constexpr int kLdb = kBlockRowValues * sizeof(uint16_t);     // B's row stride: a pair row of the block
constexpr int kLdc = kBlockN * sizeof(float);                // C's row stride: the caller's [rows][kBlockN]
constexpr int64_t kLine = 64;

// LDTILECFG's operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// C and x's tiles take `rows` rows (16, or a last row tile's fewer); B's take a step's 16 pairs (with two
// blocks, kB2 is a third B tile: row_tile_pair).
void configure(int rows, bool pair) {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t == kB0 || t == kB1 || (pair && t == kB2) ? kTilePairs : rows;
    config.bytes_per_row[t] = kRowBytes;
  }
  _tile_loadconfig(&config);
}

bool request_tile_state() {
  // Linux hands AMX's tile data state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM).
  constexpr int kRequestPermission = 0x1023, kTileData = 18;
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

// The prefetches a call spreads over its K steps: `lines` cache lines from next[0] and, where it is set, as many
// from next[1], the first `due(step)` of them all issued by the end of step `step` of `steps`.
struct Prefetch {
  const char* next[2];
  int64_t lines, steps, issued = 0;

  void after(int64_t step) {
    const int64_t due = (step + 1) * (next[1] ? 2 : 1) * lines / steps;
    for (; issued < due; ++issued) {
      const char* range = next[issued / lines];
      if (range != nullptr) _mm_prefetch(range + issued % lines * kLine, _MM_HINT_T1);
    }
  }
};

// A row tile's results (its two column halves, C registers first and first + 1) from `c`, or zero.
#define TILEFX_START_RESULTS(first, second, c, add) \
  do {                                              \
    if (add) {                                      \
      _tile_loadd(first, (c), kLdc);                \
      _tile_loadd(second, (c) + 16, kLdc);          \
    } else {                                        \
      _tile_zero(first);                            \
      _tile_zero(second);                           \
    }                                               \
  } while (0)

#define TILEFX_STORE_RESULTS(first, second, c) \
  do {                                         \
    _tile_stored(first, (c), kLdc);            \
    _tile_stored(second, (c) + 16, kLdc);      \
  } while (0)

// Two row tiles (32 rows: C[2][2]) or one (as many rows as the configuration gives: C[1][2]) of x from `x`
// (row stride ldx_bytes) times `steps` K steps of `b`, into C at `c`.
template <bool kTwoRowTiles>
void row_tiles(const uint16_t* x, int64_t ldx_bytes, const uint16_t* b, int64_t steps, float* c, bool add,
               Prefetch& prefetch, int64_t step0) {
  float* c1 = c + kTileRows * kBlockN;
  const uint16_t* x1 = x + kTileRows * (ldx_bytes / 2);
  TILEFX_START_RESULTS(kC00, kC01, c, add);
  if constexpr (kTwoRowTiles) TILEFX_START_RESULTS(kC10, kC11, c1, add);
  for (int64_t step = 0; step < steps; ++step) {
    prefetch.after(step0 + step);
    const int64_t ax = 2 * kTilePairs * step, bx = kTilePairs * kBlockRowValues * step;
    _tile_loadd(kA0, x + ax, ldx_bytes);
    _tile_loadd(kB0, b + bx, kLdb);
    _tile_dpbf16ps(kC00, kA0, kB0);
    _tile_loadd(kB1, b + bx + kBlockN, kLdb);
    _tile_dpbf16ps(kC01, kA0, kB1);
    if constexpr (kTwoRowTiles) {
      _tile_loadd(kA1, x1 + ax, ldx_bytes);
      _tile_dpbf16ps(kC10, kA1, kB0);
      _tile_dpbf16ps(kC11, kA1, kB1);
    }
  }
  TILEFX_STORE_RESULTS(kC00, kC01, c);
  if constexpr (kTwoRowTiles) TILEFX_STORE_RESULTS(kC10, kC11, c1);
}

// The bytes of a block's K step: 16 pair rows of kBlockN columns (kB0's and kB1's tiles interleaved line by line).
constexpr int64_t kStepBytes = kTilePairs * kLdb;

// Both blocks' bytes `ahead` (a multiple of kStepBytes) past the step at `bx`, into L1, unless past the chunk's
// `steps`: the first row tile reads the blocks from memory (see multiply_tiles).
inline void prefetch_steps_ahead(const uint16_t* b0, const uint16_t* b1, int64_t bx, int64_t ahead, int64_t step,
                                 int64_t steps) {
  if (step + ahead / kStepBytes >= steps) return;
  const char* first = reinterpret_cast<const char*>(b0 + bx) + ahead;
  const char* second = reinterpret_cast<const char*>(b1 + bx) + ahead;
  for (int64_t line = 0; line < kStepBytes; line += kLine) {
    _mm_prefetch(first + line, _MM_HINT_T0);
    _mm_prefetch(second + line, _MM_HINT_T0);
  }
}

// One row tile of x (as many rows as the configuration gives) times `steps` K steps of two blocks, C[1][4]:
// each x tile serves four products, where row_tiles<true> loads one for two. x comes from L2 and the blocks'
// chunk stays in L1 while the panel's row tiles pass, so this halves the traffic from L2 (Llama-1B's prefill
// GEMMs at 128 rows 0.96x the time, docs/PERFORMANCE.md). The fourth product reuses kB0, as the other kernels
// reuse their tiles: only the register count (8) bounds the blocking.
// `ahead`: prefetch_steps_ahead's distance, or 0.
void row_tile_pair(const uint16_t* x, int64_t ldx_bytes, const uint16_t* b0, const uint16_t* b1, int64_t steps,
                   float* c0, float* c1, bool add, Prefetch& prefetch, int64_t step0, int64_t ahead) {
  TILEFX_START_RESULTS(kC00, kC01, c0, add);
  TILEFX_START_RESULTS(kC10, kC11, c1, add);
  for (int64_t step = 0; step < steps; ++step) {
    prefetch.after(step0 + step);
    const int64_t ax = 2 * kTilePairs * step, bx = kTilePairs * kBlockRowValues * step;
    if (ahead) prefetch_steps_ahead(b0, b1, bx, ahead, step, steps);
    _tile_loadd(kA0, x + ax, ldx_bytes);
    _tile_loadd(kB0, b0 + bx, kLdb);
    _tile_dpbf16ps(kC00, kA0, kB0);
    _tile_loadd(kB1, b0 + bx + kBlockN, kLdb);
    _tile_dpbf16ps(kC01, kA0, kB1);
    _tile_loadd(kB2, b1 + bx, kLdb);
    _tile_dpbf16ps(kC10, kA0, kB2);
    _tile_loadd(kB0, b1 + bx + kBlockN, kLdb);
    _tile_dpbf16ps(kC11, kA0, kB0);
  }
  TILEFX_STORE_RESULTS(kC00, kC01, c0);
  TILEFX_STORE_RESULTS(kC10, kC11, c1);
}

}  // namespace

bool amx_tiles_usable() {
  static const bool usable = amx_available() && request_tile_state();
  return usable;
}

void multiply_tiles(const uint16_t* x, int64_t ldx, int64_t rows, int64_t blocks, const uint16_t* const* b,
                    int64_t pairs, float* const* c, bool add, const void* const* next, int64_t next_bytes,
                    int64_t ahead_bytes) {
  TORCH_CHECK(pairs % kTilePairs == 0, "tilefx AMX tiles: K pairs must be a multiple of ", kTilePairs, ", got ", pairs);
  TORCH_CHECK(blocks == 1 || blocks == 2, "tilefx AMX tiles: one or two blocks a call, got ", blocks);
  TORCH_CHECK(ahead_bytes % kStepBytes == 0, "tilefx AMX tiles: prefetch ahead by whole K steps (", kStepBytes,
              " bytes), got ", ahead_bytes);
  const bool pair = blocks == 2;
  const int64_t steps = pairs / kTilePairs, ldx_bytes = ldx * int64_t{sizeof(uint16_t)};
  const int64_t row_steps = pair ? (rows + kTileRows - 1) / kTileRows
                                 : rows / (2 * kTileRows) + (rows % (2 * kTileRows) + kTileRows - 1) / kTileRows;
  Prefetch prefetch{{static_cast<const char*>(next[0]), static_cast<const char*>(next[1])}, next_bytes / kLine,
                    std::max<int64_t>(row_steps * steps, 1)};
  int configured = 0;
  int64_t step0 = 0;
  for (int64_t m = 0; m < rows;) {
    const int tile_rows = static_cast<int>(std::min(kTileRows, rows - m));
    if (tile_rows != configured) {
      configure(tile_rows, pair);
      configured = tile_rows;
    }
    if (pair) {
      // the first row tile reads the blocks' chunk from memory (the later ones from cache): ahead of its loads
      row_tile_pair(x + m * ldx, ldx_bytes, b[0], b[1], steps, c[0] + m * kBlockN, c[1] + m * kBlockN, add, prefetch,
                    step0, m == 0 ? ahead_bytes : 0);
      m += tile_rows;
    } else if (rows - m >= 2 * kTileRows) {
      row_tiles<true>(x + m * ldx, ldx_bytes, b[0], steps, c[0] + m * kBlockN, add, prefetch, step0);
      m += 2 * kTileRows;
    } else {
      row_tiles<false>(x + m * ldx, ldx_bytes, b[0], steps, c[0] + m * kBlockN, add, prefetch, step0);
      m += tile_rows;
    }
    step0 += steps;
  }
}

void release_tiles() { _tile_release(); }

}  // namespace tilefx
