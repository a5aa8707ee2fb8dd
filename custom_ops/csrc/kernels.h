// Kernel entry points of the ISA-specific translation units, called by the generic
// code (the *_ops.cpp files, moe.cpp, memory.cpp; dispatch.h picks the unit). ISA
// units include only this header, <immintrin.h> (or SIMDe, for the baseline ISA) and
// their own static helpers (vec_avx2.h, bf16_scalar.h, linear_walk.h): nothing inline
// from ATen or the standard library is compiled with wider ISA flags (it could be
// picked by the linker for the whole library and crash an older CPU).
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>

namespace tilefx {

// Packed linear weight, one layout for every ISA: W[N, K] becomes
//   packed[N / kBlockN][K / 2][kBlockN][2]   (bf16; N padded to kBlockN, K padded to even)
// i.e. blocks of kBlockN output columns, each a VNNI matrix: for every pair of
// input rows (k, k+1) the block's columns sit side by side with their two values
// interleaved. That is what `vdpbf16ps` (AVX512-BF16) and AMX tiles read, and on
// AVX2 one 32-byte load yields 8 columns x 2 k as two fp32 vectors (shift / mask).
constexpr int64_t kBlockN = 32;
// Values of one K pair row of a block: kBlockN columns x 2 inputs (a block is K_pairs of them).
constexpr int64_t kPairValues = 2 * kBlockN;

// Up to this many rows a linear is a decode, bound by reading its weight: the units stream each
// block once as a GEMV over x's rows as they are (no packing), with the walk's tuned prefetch,
// and the ops keep such calls off brgemm, whose tile setup and per-call packing of x cost more
// than they save (SGLang switches at the same M). Above it the units run their GEMMs.
constexpr int64_t kGemvRows = 4;

// Weight formats. A quantized weight keeps the packed layout above with 1-byte values
// (bytes per K pair of a block: 2 * kBlockN) and fp32 scales in packed-block order:
//   int8: symmetric, scales[block][kBlockN], one per packed column;
//   fp8:  e4m3, scales[block][k_groups], one per block and kFp8GroupPairs K pairs (128 inputs:
//         the hub's 128 x 128 weight_scale_inv, repeated for the 4 blocks of a 128-row group).
//   int4: unsigned nibbles q with, per block, 128 inputs (kInt4GroupPairs K pairs; the last group may be
//         shorter, K a multiple of 4) and column, an fp16 scale s and zero point z (W = (q - z) * s:
//         GPTQ's and AWQ's meaning; symmetric is z = 8) in int4_params[block][group][2][kBlockN] (the
//         scales, then the zeros). Half a byte per value: the 64 bytes of K pairs 2t and 2t + 1 (inputs
//         4t..4t+3) are 16 lanes of 4 bytes, byte j of lane l holding input 4t + j of column l in its
//         low nibble and of column l + 16 in its high one. So one mask gives columns 0-15 and a shift
//         and a mask columns 16-31 as bytes, each lane four inputs of one column: what `vpdpbusd` /
//         `vpmaddubsw` multiply by four bytes of x (ActivationForm::int8_groups, split_words).
// The decode GEMVs (up to kGemvRows rows) widen the values in registers and apply the scales to
// fp32 partial sums; above that a unit multiplies int8 and int4 weights' integers (its integer
// GEMM) or dequantizes one block to bf16 and runs its bf16 GEMM over it.
enum class WeightFormat : int { bf16 = 0, int8 = 1, fp8 = 2, int4 = 3 };
constexpr int kWeightFormats = 4;

// The streams a unit's M = 1 GEMV reads a weight in (the walk's `streams` runs 1 up to this): two blocks at once,
// or on the AVX2 unit a block's two halves of K (int8, fp8; bf16 reads two blocks); its int4 GEMV reads one block
// at a time. The walk tuning's default and its candidates (custom_ops/tuning.py, through walk_streams) follow it.
constexpr int64_t walk_streams(bool avx2_unit, WeightFormat format) {
  return avx2_unit && format == WeightFormat::int4 ? 1 : 2;
}
constexpr int64_t kFp8GroupPairs = 64;
constexpr int64_t kInt4GroupPairs = 64;
constexpr int64_t kQPairBytes = kPairValues;  // bytes per K pair of an int8 / fp8 block: one cache line
constexpr int64_t kInt4PairBytes = kBlockN;   // bytes per K pair of an int4 block: half a cache line
// How far ahead of its loads an int4 GEMM's first row tile of a chunk, the one that reads the block from memory,
// prefetches it into L1 (both units). On Zen 4 (2 threads, 48 experts of Qwen3-30B-A3B's shapes on cold weights,
// 5 to 64 rows) it ran the AVX512-BF16 unit's GEMM 1.1-1.25x, and the AVX2 unit's forced there 1.05-1.3x; 4 KiB
// ahead gave less. int8's GEMM, which reads two lines a step to int4's one, gained nothing from it (why the
// hardware's prefetchers keep up with the one stream and not the other is not known). Not timed on Zen 2/3.
constexpr int64_t kInt4GemmAheadBytes = 2048;
// Bytes per K pair of a block of `format` (bf16: kPairValues 2-byte values).
inline int64_t pair_bytes(WeightFormat format) {
  if (format == WeightFormat::bf16) return kPairValues * 2;
  return format == WeightFormat::int4 ? kInt4PairBytes : kQPairBytes;
}
// The AVX2 unit's GEMM panels widen e4m3 through fp16 (linear_avx2.cpp, load_quantized16), which yields the
// value times 2^-8 exactly: the fp8 scales it applies to those widened values carry this factor.
constexpr float kFp8Unscale = 256.0f;

// The forms a linear's activations take (activations.h picks one per problem):
//   fp32:        [M, ldx] floats, columns [K, ldx) zero (the AVX2 unit's base form);
//   bf16_pairs:  [M, ldx / 2] uint32, x[2p] in the low half of element p, x[2p + 1] in the high
//                half (what `vdpbf16ps` broadcasts; the AVX512-BF16 units' base form);
//   int16_words: the same pairs as int16, x ~= x_scales[m] * q, one scale per row (15 bits):
//                int8 decode on every unit (`vpmaddwd` / `vpdpwssd`), int8 and int4 GEMMs on the AVX2 unit
//                (int4's with x_sums[m][g], each 128 inputs' sum of words: the zero points' share);
//   split_words: the int16 words as bytes, per 4 inputs their 4 low bytes (unsigned) then their 4 high
//                bytes (signed): x ~= x_scales[m] * (256 * high + low), [M, 2 * ldx] bytes, and x_sums[m][g]
//                each 128 inputs' sum of words (the zero points' share): int4 decode by default, where
//                `vpdpbusd` / `vpmaddubsw` multiply four unsigned nibbles by four signed high bytes, and four
//                unsigned low bytes by four nibbles (read as signed);
//   int8_groups: x as int8, each kXGroup inputs with their own scale (llama.cpp's Q8 activations): [M, ldx]
//                bytes, x ~= x_scales[m][j] * q over inputs [kXGroup j, kXGroup (j + 1)) (x_groups(ldx) a
//                row), and x_sums[m][g] each 128 inputs' sum of x_scales * q (the zero points' share): int4
//                decode on the AVX512 units, one `vpdpbusd` per 4 inputs of 16 columns where 15-bit words
//                take two (what made that GEMV compute-bound); int8 and int4 GEMMs on the AVX512 units' own
//                GEMM (int8's read each kXGroup's sum of bytes, x_totals, instead of x_sums; activations.h).
enum class ActivationForm : int { fp32 = 0, bf16_pairs = 1, int16_words = 2, split_words = 3, int8_groups = 4 };
// Inputs per scale of x in int8_groups, and the scales a row of ldx inputs has.
constexpr int64_t kXGroup = 32;
constexpr int64_t kXGroupPairs = kXGroup / 2;
inline int64_t x_groups(int64_t ldx) { return (ldx + kXGroup - 1) / kXGroup; }
// int4's weight groups (128 inputs, the last one maybe shorter) over ldx inputs: x_sums per row.
inline int64_t int4_groups(int64_t ldx) { return (ldx + 2 * kInt4GroupPairs - 1) / (2 * kInt4GroupPairs); }

// Rows of x ([rows, ldx] of T, ldx a multiple of 4) as int8_groups, what every unit's quantize_groups shares:
// each kXGroup's scale max|x| / 127 (`absmax(values, n)`), its bytes (`round(values, n, 1 / scale, out)`, round
// half to even, returning their sum) and each weight group's sum of scale times bytes; where `totals` is given, each
// kXGroup's sum of its bytes ([rows][x_groups(ldx)], LinearProblem::x_totals).
template <class T, class Absmax, class Round>
inline void quantize_x_groups(const T* x, int64_t rows, int64_t ldx, int8_t* bytes, float* scales, float* sums,
                              int32_t* totals, const Absmax& absmax, const Round& round) {
  const int64_t groups = x_groups(ldx), weight_groups = int4_groups(ldx);
  for (int64_t m = 0; m < rows; ++m) {
    const T* row = x + m * ldx;
    float* row_sums = sums + m * weight_groups;
    std::fill(row_sums, row_sums + weight_groups, 0.0f);
    for (int64_t j = 0; j < groups; ++j) {
      const int64_t k0 = j * kXGroup, n = std::min(kXGroup, ldx - k0);
      const float amax = absmax(row + k0, n);
      const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
      scales[m * groups + j] = scale;
      const int32_t total = round(row + k0, n, 1.0f / scale, bytes + m * ldx + k0);
      row_sums[k0 / (2 * kInt4GroupPairs)] += scale * static_cast<float>(total);
      if (totals != nullptr) totals[m * groups + j] = total;
    }
  }
}

// Where a decode walk's software prefetch brings its lines: _MM_HINT_NTA (near the core, kept out of the
// outer caches), T0 (every level) or T1 (L2 and out). The CPUs differ in how many misses each keeps in
// flight, so the hint is tuned per machine with the distance (tuning.h).
enum class PrefetchHint : int { nta = 0, t0 = 1, t1 = 2 };

struct LinearProblem {
  const void* x;          // activations in form x_form (below)
  const uint16_t* w;      // packed weight (bf16 bits)
  const uint16_t* bias;   // [N] bf16 bits, or nullptr
  uint16_t* y;            // [M, ldy] bf16 bits, or nullptr when yf is set
  int64_t M, N, K_pairs;  // K_pairs = padded K / 2
  int64_t ldx;            // values per row of x (padded K)
  float* yf;              // [M, ldy] fp32 output instead of y (linear_float; fused_moe's act on the AVX2 unit)
  int64_t ldy;
  // Gate/up epilogue: the packed weight interleaves blocks of a gate and an up
  // projection (block 2j = gate columns [32j, 32j + 32), block 2j + 1 = the same
  // up columns) and y = silu(x @ gate^T) * (x @ up^T), N columns (no bias).
  bool silu_mul;
  ActivationForm x_form = ActivationForm::fp32;
  const float* x_scales = nullptr;  // int16_words, split_words: one per row; int8_groups: [M][x_groups(ldx)]
  const float* x_sums = nullptr;    // split_words, int8_groups: [M][k_groups]
  const int32_t* x_totals = nullptr;  // int8_groups for an int8 GEMM: each kXGroup's sum of bytes [M][x_groups(ldx)]
  // Quantized weights (format int8 / fp8): the packed values in `wq` instead of `w`, and their scales.
  WeightFormat format = WeightFormat::bf16;
  const uint8_t* wq = nullptr;
  const float* scales = nullptr;
  int64_t k_groups = 0;  // fp8 / int4: scale groups per block
  const uint16_t* int4_params = nullptr;  // int4: fp16 [blocks][k_groups][2][kBlockN] (scales, zeros)
  // How a decode walk streams the weight, per machine (tuning.h): for M = 1 a thread reads `streams`
  // blocks at once (1 or 2; the AVX2 unit's bf16 GEMV of 2-4 rows and its int8 and fp8 GEMVs (1-2 rows) read
  // the two halves of a block's K side by side instead, int4 one stream), and each
  // stream prefetches `prefetch_bytes` ahead of its loads with `prefetch_hint` (0 bytes: no prefetch).
  int64_t streams = 2;
  int64_t prefetch_bytes = 1024;
  PrefetchHint prefetch_hint = PrefetchHint::nta;
  // K pairs from one packed block to the next: 0 for K_pairs. A decode task over a K slice of its weight
  // (linear_ops.cpp, split_k) reads K_pairs of each block's block_pairs, from w / wq, x (and fp8's scales)
  // pointed at the slice's first pair.
  int64_t block_pairs = 0;
  // The AVX512 unit's epilogue writes bf16 y with non-temporal stores where a row's kBlockN columns are
  // 32-byte aligned (others ignore it), and the caller fences after. Set only by linear_blocks_brgemm, for
  // a prefill on AMX tiles (linear_brgemm.cpp kStreamRows).
  bool stream_y = false;

  const float* x_fp32() const { return static_cast<const float*>(x); }
  const uint32_t* x_pairs() const { return static_cast<const uint32_t*>(x); }
  const uint32_t* x_words() const { return static_cast<const uint32_t*>(x); }
  const uint8_t* x_split() const { return static_cast<const uint8_t*>(x); }
  const int8_t* x_bytes() const { return static_cast<const int8_t*>(x); }
};

// K pairs from one packed block of p's weight to the next (LinearProblem::block_pairs).
inline int64_t pairs_between_blocks(const LinearProblem& p) { return p.block_pairs ? p.block_pairs : p.K_pairs; }

// The fp8 scale of block `block`'s K pairs from `pair` on (one per kFp8GroupPairs pairs).
inline float fp8_scale(const LinearProblem& p, int64_t block, int64_t pair) {
  return p.scales[block * p.k_groups + pair / kFp8GroupPairs];
}

// p over its rows from r0 on (M - r0 rows): x, and its rows' scales, sums and totals, advanced in p's x_form by
// the strides Activations::attach (activations.cpp) lays a row out with.
inline LinearProblem rows_from(const LinearProblem& p, int64_t r0) {
  LinearProblem rest = p;
  rest.M = p.M - r0;
  const uint8_t* x = static_cast<const uint8_t*>(p.x);
  switch (p.x_form) {
    case ActivationForm::fp32: rest.x = x + r0 * p.ldx * 4; break;
    case ActivationForm::bf16_pairs: rest.x = x + r0 * p.ldx * 2; break;
    case ActivationForm::int16_words: rest.x = x + r0 * p.ldx * 2; break;  // a word per pair
    case ActivationForm::split_words: rest.x = x + r0 * p.ldx * 2; break;  // the words' bytes apart
    case ActivationForm::int8_groups: rest.x = x + r0 * p.ldx; break;
  }
  const int64_t scales_a_row = p.x_form == ActivationForm::int8_groups ? x_groups(p.ldx) : 1;
  if (p.x_scales) rest.x_scales = p.x_scales + r0 * scales_a_row;
  if (p.x_sums) rest.x_sums = p.x_sums + r0 * int4_groups(p.ldx);
  if (p.x_totals) rest.x_totals = p.x_totals + r0 * x_groups(p.ldx);
  return rest;
}

// Scratch floats a linear_blocks_* call needs (on any unit) for p or any problem like it of fewer rows (fused_moe
// sizes its threads' scratch by its widest expert): two fp32 result tiles (a decode's gate/up in two streams: four,
// so 4 rows need more than 5), and where a unit may dequantize (a quantized GEMM, more than kGemvRows rows) one
// dequantized bf16 block.
inline int64_t linear_scratch_floats(const LinearProblem& p) {
  const int64_t tiles = std::max(4 * std::min(p.M, kGemvRows), 2 * p.M);
  const bool panel = p.format != WeightFormat::bf16 && p.M > kGemvRows;
  return std::max<int64_t>(tiles, 4) * kBlockN + (panel ? p.K_pairs * kBlockN : 0);
}

// int4: the fp16 scales of block `block`'s group `group` (kBlockN), its zero points kBlockN further.
inline const uint16_t* int4_group_params(const LinearProblem& p, int64_t block, int64_t group) {
  return p.int4_params + (block * p.k_groups + group) * 2 * kBlockN;
}

// Rows of bf16 x ([rows, ldx], ldx a multiple of 2) as int16 words (ActivationForm::int16_words),
// as quantize_words_avx2 makes them from fp32 (the AVX512 units read bf16 activations).
void quantize_words_avx512(const uint16_t* x, int64_t rows, int64_t ldx, uint32_t* words, float* scales);
void quantize_words_avx512_emulated(const uint16_t* x, int64_t rows, int64_t ldx, uint32_t* words, float* scales);
// Rows of bf16 x ([rows, ldx], ldx a multiple of 4) as int8_groups: bytes [rows, ldx], scales [rows][x_groups(ldx)]
// (max|x| / 127 of each kXGroup inputs, round half to even), sums [rows][ceil(ldx / 128)].
void quantize_groups_avx512(const uint16_t* x, int64_t rows, int64_t ldx, int8_t* bytes, float* scales, float* sums,
                            int32_t* totals);
void quantize_groups_avx512_emulated(const uint16_t* x, int64_t rows, int64_t ldx, int8_t* bytes, float* scales,
                                     float* sums, int32_t* totals);

// Column blocks [block_begin, block_end) of y for every row. `scratch` holds
// linear_scratch_floats(p) floats.
void linear_blocks_avx2(const LinearProblem& p, int64_t block_begin, int64_t block_end, float* scratch);

// The same over bf16 pairs, with `vdpbf16ps` (linear_avx512.cpp; where CPUID reports
// AVX512F and AVX512-BF16), and that unit built on SIMDe's portable intrinsics (any CPU;
// only in builds with TILEFX_AVX512_EMULATION, for the tests).
void linear_blocks_avx512(const LinearProblem& p, int64_t block_begin, int64_t block_end, float* scratch);
void linear_blocks_avx512_emulated(const LinearProblem& p, int64_t block_begin, int64_t block_end, float* scratch);

// What oneDNN's brgemm GEMM (linear_brgemm.cpp) borrows from a unit: a quantized block as bf16
// in the packed order (the unit's GEMM panel: fp8 scaled, int8 not), and the stores of fp32
// result tiles [p.M][kBlockN] into y (bias, bf16 or fp32 output; gate/up -> SiLU-and-mul) and
// int8's column scales; and what the flash attention on brgemm tiles (attention_brgemm.cpp)
// borrows: the online softmax of one key block (flash_block_softmax_avx2's contract, `ld` a
// multiple of 16), for decode two value rows interleaved into brgemm's VNNI pairs, and each output
// row over its sum. (linear_brgemm.cpp and attention_brgemm.cpp are built for any x86-64: what
// runs per value lives here, in the units built for their ISA.)
struct UnitEpilogue {
  void (*dequantize[kWeightFormats])(const LinearProblem& p, int64_t block, uint16_t* out);  // by WeightFormat (bf16: null)
  void (*store)(const LinearProblem& p, int64_t col0, const float* c);
  void (*store_silu_mul)(const LinearProblem& p, int64_t col0, const float* gate, const float* up);
  void (*flash_softmax)(float* scores, int64_t rows, int64_t keys, int64_t ld, const bool* mask, int64_t group,
                        int64_t mask_stride, float scale, float* max, float* sum, uint16_t* weights, float* out,
                        int64_t v_dim);
  // out[2c] = a[c], out[2c + 1] = b[c] for c < n (a multiple of 16); a null row reads as zeros.
  void (*interleave_rows)(const uint16_t* a, const uint16_t* b, int64_t n, uint16_t* out);
  // The bf16 pairs (any 32-bit words) of 16 rows as 16 columns: out[i * ld + r] = word i of rows[r]
  // for i < pairs (a multiple of 8), r < 16; a null row reads as zeros. (The prefill kernel's keys
  // as brgemm's B; decode's transposed scores back to rows.)
  void (*transpose_pairs)(const uint16_t* const* rows, int64_t pairs, uint32_t* out, int64_t ld);
  // out[i] = x[i] * scale as bf16 (round to nearest even), i < n: a flash tile's output row over its sum.
  void (*scaled_bf16)(const float* x, float scale, int64_t n, uint16_t* out);
  // c[m * kBlockN + j] *= s[j] for m < rows, j < kBlockN: int8's column scales on a block's fp32 results.
  void (*scale_columns)(float* c, const float* s, int64_t rows);
  // HF's RMSNorm of one row of n values (custom_ops/norm.py), after its residual add where `residual` is not null:
  // sum = bf16(x + residual) stored at `sum`; out = bf16(weight * bf16(sum * rsqrt(mean(sum^2) + eps))). Without a
  // residual the row normalized is x and `sum` is not written (null).
  void (*rms_norm_row)(const uint16_t* x, const uint16_t* residual, int64_t n, const uint16_t* weight, float eps,
                       uint16_t* sum, uint16_t* out);
  // out[i] = bf16(sum over s < k, in order, of weights[s] * rows[s][i]) for i < n, the sum in fp32 from zero: a
  // token's routed experts' outputs combined (moe.cpp).
  void (*weighted_sum_row)(const uint16_t* const* rows, const float* weights, int64_t k, int64_t n, uint16_t* out);
};
// transpose_pairs one value at a time, for the units where brgemm attention is never fast (AVX2:
// oneDNN has no compiled brgemm kernel there).
void transpose_pairs_plain(const uint16_t* const* rows, int64_t pairs, uint32_t* out, int64_t ld);
const UnitEpilogue& unit_epilogue_avx2();
const UnitEpilogue& unit_epilogue_avx512();
const UnitEpilogue& unit_epilogue_avx512_emulated();

// bf16 -> fp32, n values.
void bf16_to_float_avx2(const uint16_t* src, float* dst, int64_t n);
// Rows of fp32 x ([rows, ldx], ldx a multiple of 2) as int16 words: per row the scale
// max|x| / 32767 and round(x / scale) as int16 (15 bits against bf16's 8 of the largest values).
void quantize_words_avx2(const float* x, int64_t rows, int64_t ldx, uint32_t* words, float* scales);
// The same as quantize_groups_avx512, from fp32 rows.
void quantize_groups_avx2(const float* x, int64_t rows, int64_t ldx, int8_t* bytes, float* scales, float* sums,
                          int32_t* totals);

// Streaming read of `bytes` bytes (multiple of 128 * streams) starting at `data`, as
// `streams` (1 or 2) concurrent sequential streams; returns a value that depends on
// every byte so the compiler cannot skip the reads.
float stream_read_avx2(const void* data, int64_t bytes, int streams);

// Attention of query rows over the KV cache (decode is one query row). One task is
// one (batch row, KV head, query row, key split): the query heads of that KV head
// attend keys [key_begin, key_end) allowed by the mask row; the task writes its
// partial result as running max, sum of exp and unnormalized output per head.
//
// A key may come in two parts read from two buffers, the query likewise: DeepSeek's
// MLA (weight-absorbed) attends with key = [latent | rope key] and value = latent,
// so `v_cache` then points at the latent (`k_cache`) and no K/V is ever expanded.
struct AttentionProblem {
  const uint16_t* q;  // [B, Hq, S, k_dim] strides below (elements)
  int64_t q_stride_b, q_stride_h, q_stride_s;
  const uint16_t* q_rope;  // [B, Hq, S, rope_dim], or nullptr when rope_dim == 0
  int64_t qr_stride_b, qr_stride_h, qr_stride_s;
  const uint16_t* k_cache;  // [maxB, Hkv, maxL, k_dim]
  int64_t k_stride_b, k_stride_h, k_stride_t;
  const uint16_t* k_rope_cache;  // [maxB, Hkv, maxL, rope_dim], or nullptr
  int64_t kr_stride_b, kr_stride_h, kr_stride_t;
  const uint16_t* v_cache;  // [maxB, Hkv, maxL, v_dim]
  int64_t v_stride_b, v_stride_h, v_stride_t;
  const bool* mask;  // [B, 1, S, maxL]
  int64_t mask_stride_b, mask_stride_s;
  int64_t q_heads, kv_heads;
  int64_t k_dim, rope_dim, v_dim;  // multiples of 16
  float scale;
};

// Query heads of one KV head processed together per pass over a key block; the
// group is padded with zero heads to a multiple of it.
constexpr int kAttentionHeadTile = 4;
// The most query rows per KV head (new tokens times the query heads sharing it) decode attention
// may run on brgemm tiles (attention_decode_brgemm: one tile of rows against each block of keys).
constexpr int64_t kDecodeAttentionRows = 64;

struct AttentionPartial {
  float* max;      // [group]
  float* sum;      // [group]
  float* out;      // [group, v_dim]
  float* scratch;  // attention_scratch_floats(p)
};

// Keys per block: a task walks its keys in blocks (online softmax across blocks)
// small enough that a block's value rows stay in L1 across the passes over the
// value slices, and that MLA's latent rows are read from memory once for all head
// tiles rather than once per tile.
constexpr int64_t kMaxAttentionKeyBlock = 128;
inline int64_t attention_key_block(const AttentionProblem& p) {
  const int64_t row_bytes = 2 * (p.k_dim + p.rope_dim + (p.v_cache == p.k_cache ? 0 : p.v_dim));
  const int64_t block = 32768 / row_bytes;
  return (block < 16 ? 16 : block > kMaxAttentionKeyBlock ? kMaxAttentionKeyBlock : block) & ~int64_t{1};
}

// Per-thread scratch of an attention task, in floats: enough for either unit (the AVX2 unit's fp32
// queries; the AVX512 unit's per-lane softmax state, bf16 weights and a zero row).
inline int64_t attention_scratch_floats(const AttentionProblem& p) {
  const int64_t padded_group = (p.q_heads / p.kv_heads + kAttentionHeadTile - 1) / kAttentionHeadTile * kAttentionHeadTile;
  const int64_t row = p.k_dim + p.rope_dim + p.v_dim + 64;
  return padded_group * row + 8 * (attention_key_block(p) + 4) + row;
}

// The keys a task attends of [begin, end): masked keys at either end (the causal future of a
// prompt row, left padding) trimmed, and whether any key inside is masked (a padded batch row's may be).
struct TaskKeys {
  int64_t begin, end;
  bool dense;  // no masked key in [begin, end)
};
inline TaskKeys attended_keys(const bool* allowed, int64_t begin, int64_t end) {
  while (begin < end && !allowed[begin]) ++begin;
  while (end > begin && !allowed[end - 1]) --end;
  bool dense = true;
  for (int64_t t = begin; t < end && dense; ++t) dense = allowed[t];
  return {begin, end, dense};
}

// The partial result of a task with no key to attend: every head's max -inf and sum 0 (its output is not read).
inline void no_keys(int64_t group, const AttentionPartial& part) {
  for (int64_t g = 0; g < group; ++g) {
    part.max[g] = -std::numeric_limits<float>::infinity();
    part.sum[g] = 0.0f;
  }
}

// The AVX2 unit's software prefetch, issued while the first head tile scores a block: the key (rope
// key, value) rows kAttentionPrefetchBytes of key rows past the keys being scored, across the block's
// end (a KV head's rows are contiguous), within the task's keys, into L2 (prefetcht2). A task computes
// long enough per row that its own loads keep few misses in flight, and the hardware prefetchers
// restart at every page: without it a decode task read its cache cold at well under half of the
// memory's speed (docs/PERFORMANCE.md, thirty-fifth session: into L2 beat L1 and non-temporal there,
// and 4-12 KiB ahead measured alike).
constexpr int64_t kAttentionPrefetchBytes = 8192;

struct AttentionPrefetch {
  const uint16_t* k = nullptr;     // the block's first key row; nullptr: prefetch nothing
  const uint16_t* rope = nullptr;  // its first rope key row, or nullptr
  const uint16_t* v = nullptr;     // its first value row, or nullptr (MLA: the values are the key rows)
  int64_t keys = 0;                // keys from the block's first that the task attends
  int64_t ahead = 0;               // keys ahead of the ones being scored
};

// What a task whose block starts at key row `k` (rope key `rope`, value `v`; rows of `p`) with
// `keys` keys left prefetches.
inline AttentionPrefetch attention_prefetch(const AttentionProblem& p, const uint16_t* k, const uint16_t* rope,
                                            const uint16_t* v, int64_t keys) {
  const int64_t ahead = std::max<int64_t>(4, kAttentionPrefetchBytes / (2 * p.k_dim) / 4 * 4);
  return {k, rope, p.v_cache == p.k_cache ? nullptr : v, keys, ahead};
}

// Asks for the `values` bf16 values at `row` to be brought into the caches: prefetcht1 (kHint 1) or
// prefetcht2 (kHint 2). A volatile asm: GCC 12 at -O2 deleted loops of __builtin_prefetch as having no effect.
template <int kHint>
inline void prefetch_row(const uint16_t* row, int64_t values) {
  static_assert(kHint == 1 || kHint == 2, "prefetcht1 or prefetcht2");
  for (int64_t at = 0; at < values; at += 32) {
    if constexpr (kHint == 1) {
      asm volatile("prefetcht1 %0" : : "m"(row[at]));
    } else {
      asm volatile("prefetcht2 %0" : : "m"(row[at]));
    }
  }
}

// Prefetches the rows of `count` keys `a.ahead` past key `t` of the block (none past the task's keys).
inline void prefetch_attention_rows(const AttentionPrefetch& a, const AttentionProblem& p, int64_t t,
                                    int64_t count) {
  if (!a.k) return;
  const int64_t end = std::min(t + a.ahead + count, a.keys);
  for (int64_t key = t + a.ahead; key < end; ++key) {
    prefetch_row<2>(a.k + key * p.k_stride_t, p.k_dim);
    if (a.rope) prefetch_row<2>(a.rope + key * p.kr_stride_t, p.rope_dim);
    if (a.v) prefetch_row<2>(a.v + key * p.v_stride_t, p.v_dim);
  }
}

// The AVX512 unit's software prefetch: the rows (key, rope key, value) of the key block after the one
// being worked, key by key, into L2, a share at each of the block's score steps (every head tile's), so
// the memory delivers the next block the whole time this one computes. The AVX2 unit's AttentionPrefetch
// asks only while the first head tile scores, a quarter of a block's time with two head tiles.
// Measured on both units against it (docs/PERFORMANCE.md, thirty-eighth session, cold caches, 2
// threads): on the AVX512 unit 1.09-1.17x for Qwen3's heads (two head tiles), 1.07-1.20x for MLA's
// (four), 0.92-1.0x for Llama's (one, reading at the memory's rate either way); on the AVX2 unit,
// which computes ~2x as long per key, level or up to 12% slower, so it keeps AttentionPrefetch.
struct NextBlockPrefetch {
  const uint16_t* k;     // the task's key rows, from key 0 of the cache row
  const uint16_t* rope;  // its rope key rows, or nullptr
  const uint16_t* v;     // its value rows, or nullptr (MLA: the values are the key rows)
  int64_t key = 0, end = 0;  // keys [key, end) still to ask for
  int64_t per_step = 0;      // keys a step asks for

  NextBlockPrefetch(const AttentionProblem& p, const uint16_t* k_rows, const uint16_t* rope_rows,
                    const uint16_t* v_rows)
      : k(k_rows), rope(p.rope_dim ? rope_rows : nullptr), v(p.v_cache == p.k_cache ? nullptr : v_rows) {}

  // Keys [first, stop) over the next `steps` steps.
  void ask(int64_t first, int64_t stop, int64_t steps) {
    key = first;
    end = stop;
    per_step = stop > first ? (stop - first + steps - 1) / steps : 0;
  }

  // One step's share.
  inline void step(const AttentionProblem& p) {
    const int64_t stop = std::min(key + per_step, end);
    for (; key < stop; ++key) {
      prefetch_row<2>(k + key * p.k_stride_t, p.k_dim);
      if (rope) prefetch_row<2>(rope + key * p.kr_stride_t, p.rope_dim);
      if (v) prefetch_row<2>(v + key * p.v_stride_t, p.v_dim);
    }
  }
};

// One attention task of `p` on a unit: the query heads of `kv_head` for query row `s` of batch row
// `b`, over keys [key_begin, key_end) as the mask row allows, into `part`.
void attention_task_avx2(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t s, int64_t key_begin,
                         int64_t key_end, const AttentionPartial& part);
void attention_task_avx512(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t s, int64_t key_begin,
                           int64_t key_end, const AttentionPartial& part);
void attention_task_avx512_emulated(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t s,
                                    int64_t key_begin, int64_t key_end, const AttentionPartial& part);

// RoPE's rotate-half form (custom_ops/rope.py) on the `heads` rows of one token: row h of `dim` values (dim
// even) at x + h * x_stride, written at out + h * out_stride, with the token's tables `cos` and `sin` (dim values
// each): out = x * cos + [-x[dim/2:], x[:dim/2]] * sin in fp32, rounded to bf16 once. The attention unit's.
void rope_heads_avx2(const uint16_t* x, int64_t x_stride, uint16_t* out, int64_t out_stride, int64_t heads,
                     const uint16_t* cos, const uint16_t* sin, int64_t dim);
void rope_heads_avx512(const uint16_t* x, int64_t x_stride, uint16_t* out, int64_t out_stride, int64_t heads,
                       const uint16_t* cos, const uint16_t* sin, int64_t dim);
void rope_heads_avx512_emulated(const uint16_t* x, int64_t x_stride, uint16_t* out, int64_t out_stride,
                                int64_t heads, const uint16_t* cos, const uint16_t* sin, int64_t dim);

// One key block of the flash attention over brgemm tiles (attention_brgemm.cpp), for `rows`
// query rows whose raw scores q.k are at `scores` (row stride `ld`): row r's mask row (its
// allowed keys from the block's first) is `mask + (r / group) * mask_stride` (a null `mask`: every
// row allows every key, as the caller knows for a block inside each row's unbroken run of allowed
// keys, with no mask byte read), keys at or past `keys` are masked too (`ld`, `v_dim` multiples
// of 8; `keys` <= `ld`). Turns the scores into
// bf16 weights exp(scale * score - max') at `weights` (row stride `ld`, 0 where masked, through
// column `ld`), adds the rounded weights to `sum` after scaling it by exp(max - max'), and
// scales each row's accumulated output (`v_dim` floats at `out`) by the same factor; `max` /
// `sum` are per row. A row with no allowed key yet keeps max -inf and weights 0. The AVX2
// unit's; each unit's is its UnitEpilogue::flash_softmax.
void flash_block_softmax_avx2(float* scores, int64_t rows, int64_t keys, int64_t ld, const bool* mask,
                              int64_t group, int64_t mask_stride, float scale, float* max, float* sum,
                              uint16_t* weights, float* out, int64_t v_dim);

}  // namespace tilefx
