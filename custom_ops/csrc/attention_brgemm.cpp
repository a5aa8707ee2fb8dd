// Prefill attention as a flash attention over oneDNN's brgemm tiles (at::native::cpublas::brgemm:
// AMX where the CPU has it, oneDNN's AVX512-BF16 JIT kernels on other AVX512-BF16 CPUs, a slow
// reference loop elsewhere, where only the tests force it). The attention unit attends one query
// row at a time with vector FMAs; here a task takes a tile of query rows (a few positions times
// every query head of one KV head: GQA and MLA's head folding make them rows of one GEMM over the
// shared keys) and walks the keys in blocks: scores = Q . K^T as one brgemm, an online softmax on
// the path's linear unit (UnitEpilogue::flash_softmax: AVX2 or AVX512), out += weights . V as
// another. The keys and values of the valid prefix are first repacked once per call into brgemm's
// VNNI layout for B, as zeros where no query row may see them (padding, holes: whatever their
// cache rows hold never reaches a GEMM).
// Key blocks no row of a tile may see are skipped, as the causal future is, and a block is cut after the last
// key any row of the tile may see (to the packing's 128: the causal diagonal's); blocks every row of a
// tile may see whole (below the causal diagonal, past the padding) go to the softmax with no mask
// to read (a 4096-token prompt's mask is 16 MiB, read once per KV head). How many query rows a
// task takes and how many keys a step multiplies is tuned per CPU and model (tuning.h AttentionTiling).
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "aligned.h"
#include "kernels.h"
#include "ops.h"
#include "parallel.h"

namespace tilefx {
namespace {

// The keys one query row may see lie in [first, last) (first == last: none); `unbroken`: it may see
// every one of them (no hole), so a key block inside the range needs no look at its mask.
struct KeyRange {
  int64_t first, last;
  bool unbroken;
};

bool none_of_8(const bool* m) {
  uint64_t word;
  std::memcpy(&word, m, sizeof(word));
  return word == 0;
}

bool all_of_8(const bool* m) {
  uint64_t word;
  std::memcpy(&word, m, sizeof(word));
  constexpr uint64_t kLow = 0x0101010101010101ull, kHigh = 0x8080808080808080ull;
  return ((word - kLow) & ~word & kHigh) == 0;  // no zero byte
}

// The keys [0, end) mask row `m` allows lie in the returned range (8 mask bytes a step).
KeyRange allowed_range(const bool* m, int64_t end) {
  int64_t first = 0, last = end;
  while (first + 8 <= last && none_of_8(m + first)) first += 8;
  while (first < last && !m[first]) ++first;
  while (last - 8 >= first && none_of_8(m + last - 8)) last -= 8;
  while (last > first && !m[last - 1]) --last;
  int64_t t = first;
  while (t + 8 <= last && all_of_8(m + t)) t += 8;
  while (t < last && m[t]) ++t;
  return {first, last, t == last};
}

// What the tasks share: the problem, each query row's key range, the packed keys and values
// per (batch row, KV head).
struct Packed {
  const AttentionProblem& p;
  int64_t end, padded;  // keys [0, end) are valid; `padded` rounds `end` up to a key block
  int64_t qdim;         // k_dim + rope_dim: a query row and a packed key column
  std::vector<KeyRange> ranges;  // per (b, s)
  UninitializedAlignedVector<uint32_t> keys;    // per (b, kv_head): [qdim / 2][padded] bf16 pairs (all written)
  UninitializedAlignedVector<uint16_t> values;  // per (b, kv_head): [padded / 2][v_dim][2] (all written)

  const uint32_t* keys_of(int64_t bh) const { return keys.data() + bh * (qdim / 2) * padded; }
  const uint16_t* values_of(int64_t bh) const { return values.data() + bh * padded * p.v_dim; }
};

}  // namespace

void transpose_pairs_plain(const uint16_t* const* rows, int64_t pairs, uint32_t* out, int64_t ld) {
  for (int64_t i = 0; i < pairs; ++i) {
    for (int j = 0; j < 16; ++j) {
      uint32_t word = 0;
      if (rows[j]) std::memcpy(&word, rows[j] + 2 * i, sizeof(word));
      out[i * ld + j] = word;
    }
  }
}

namespace {

// Which of keys [t0, t1) any query row of batch row b may see: the others (left padding,
// holes) are packed as zeros, so whatever their cache rows hold never reaches the GEMMs. The
// last rows see the most (causal), so the rows are read from the last until every key is seen.
void visible_keys(const AttentionProblem& p, int64_t b, int64_t seq, int64_t t0, int64_t t1, bool* visible) {
  std::fill(visible, visible + (t1 - t0), false);
  int64_t unseen = t1 - t0;
  for (int64_t s = seq - 1; s >= 0 && unseen > 0; --s) {
    const bool* m = p.mask + b * p.mask_stride_b + s * p.mask_stride_s;
    for (int64_t t = t0; t < t1; ++t) {
      if (m[t] && !visible[t - t0]) {
        visible[t - t0] = true;
        --unseen;
      }
    }
  }
}

// 16 rows in two parts, [first | rope] (keys, or decode's queries), as 16 columns of bf16 pairs at
// `dst` (row stride `ld`) through the unit's transpose: the first part's pairs, then the rope part's;
// a null row is zeros.
void pairs_as_columns(const UnitEpilogue& epilogue, const uint16_t* const* first, const uint16_t* const* rope,
                      int64_t first_pairs, int64_t rope_pairs, uint32_t* dst, int64_t ld) {
  epilogue.transpose_pairs(first, first_pairs, dst, ld);
  if (rope_pairs) epilogue.transpose_pairs(rope, rope_pairs, dst + first_pairs * ld, ld);
}

// Keys [t0, t1) (a multiple of 16 apart) of (b, kv_head) into brgemm's B of Q . K^T: column t of
// pair row i holds dims (2i, 2i + 1) of key t, the key's rope part after its first part (16 keys at
// a time through the unit's transpose); zero past `end` and where `visible` (from t0) is false.
void pack_keys(const UnitEpilogue& epilogue, Packed& packed, int64_t b, int64_t h, int64_t bh, int64_t t0,
               int64_t t1, const bool* visible) {
  const AttentionProblem& p = packed.p;
  const int64_t k_pairs = p.k_dim / 2, pairs = packed.qdim / 2, padded = packed.padded;
  uint32_t* dst = packed.keys.data() + bh * pairs * padded;
  const uint16_t* k = p.k_cache + b * p.k_stride_b + h * p.k_stride_h;
  const uint16_t* kr = p.rope_dim ? p.k_rope_cache + b * p.kr_stride_b + h * p.kr_stride_h : nullptr;
  const uint16_t* rows[16];
  const uint16_t* rope_rows[16];
  for (int64_t t = t0; t < t1; t += 16) {
    for (int64_t j = 0; j < 16; ++j) {
      const bool shown = t + j < packed.end && visible[t + j - t0];
      rows[j] = shown ? k + (t + j) * p.k_stride_t : nullptr;
      rope_rows[j] = shown && kr ? kr + (t + j) * p.kr_stride_t : nullptr;
    }
    pairs_as_columns(epilogue, rows, rope_rows, k_pairs, pairs - k_pairs, dst + t, padded);
  }
}

// Values [t0, t1) (t0 even) of (b, kv_head) into brgemm's B of weights . V: pair row t / 2 holds
// values t and t + 1 interleaved per column (the unit's vector interleave); zero past `end` and
// where `visible` is false.
void pack_values(const UnitEpilogue& epilogue, Packed& packed, int64_t b, int64_t h, int64_t bh, int64_t t0,
                 int64_t t1, const bool* visible) {
  const AttentionProblem& p = packed.p;
  const int64_t v_dim = p.v_dim;
  uint16_t* dst = packed.values.data() + bh * packed.padded * v_dim;
  const uint16_t* v = p.v_cache + b * p.v_stride_b + h * p.v_stride_h;
  auto row = [&](int64_t t) { return t < packed.end && visible[t - t0] ? v + t * p.v_stride_t : nullptr; };
  for (int64_t t = t0; t < t1; t += 2) epilogue.interleave_rows(row(t), row(t + 1), v_dim, dst + t * v_dim);
}

// A tile of query rows through the keys, one block at a time (the online softmax): the block's
// scores (brgemm's C) and weights (the value GEMM's A), each row's running max and sum, and the
// unnormalized output (the value GEMM's C).
struct TileSoftmax {
  AlignedVector<float> scores, out;  // [rows][step], [rows][v_dim]
  AlignedVector<uint16_t> weights;   // [rows][step]
  std::vector<float> max, sum;       // [rows]
  int64_t step = kAttentionKeyBlock;  // keys a block holds at most: the scores' and weights' row stride

  // `rows` rows of `v_dim` values, no key seen yet, blocks of up to `keys` keys; scores for `score_rows`
  // (>= rows) rows, where whatever fills them writes more (decode's transpose writes its 16-row tiles whole).
  void start(int64_t rows, int64_t v_dim, int64_t keys, int64_t score_rows = 0) {
    step = keys;
    scores.resize(std::max(rows, score_rows) * step);
    weights.resize(rows * step);
    out.assign(rows * v_dim, 0.0f);
    max.assign(rows, -std::numeric_limits<float>::infinity());
    sum.assign(rows, 0.0f);
  }

  // The block whose `keys` scores are in `scores` (row r masked by mask + (r / group) * mask_stride):
  // softmax on the unit, then out += weights . values (`packed_keys`, a multiple of kAttentionKeyBlock at most
  // `step`, of [packed_keys / 2][v_dim][2]; the weights past `keys` are zeros).
  void add_block(const UnitEpilogue& epilogue, int64_t rows, int64_t keys, int64_t packed_keys, const bool* mask,
                 int64_t group, int64_t mask_stride, float scale, const at::BFloat16* values, int64_t v_dim) {
    epilogue.flash_softmax(scores.data(), rows, keys, step, mask, group, mask_stride, scale, max.data(), sum.data(),
                           weights.data(), out.data(), v_dim);
    at::native::cpublas::brgemm(rows, v_dim, packed_keys, step, v_dim, v_dim, /*add_C=*/true,
                                reinterpret_cast<const at::BFloat16*>(weights.data()), values, out.data());
  }
};

// The task's positions [s0, s0 + positions) of (b, kv_head): rows r = i * group + g are position
// s0 + i of query head kv_head * group + g; `step` keys (a multiple of kAttentionKeyBlock) a block.
void attend_tile(const UnitEpilogue& epilogue, const Packed& packed, int64_t b, int64_t h, int64_t s0,
                 int64_t positions, int64_t step, AlignedVector<uint16_t>& query_rows, TileSoftmax& tile,
                 at::BFloat16* y, int64_t seq) {
  const AttentionProblem& p = packed.p;
  const int64_t group = p.q_heads / p.kv_heads, rows = positions * group, qdim = packed.qdim, v_dim = p.v_dim;
  const bool* mask = p.mask + b * p.mask_stride_b + s0 * p.mask_stride_s;

  // The keys any row may see: blocks outside [lo, hi) are skipped. Every row may see every key of
  // [all_from, all_to) where each row's range is unbroken: blocks inside it read no mask.
  int64_t lo = packed.end, hi = 0, all_from = 0, all_to = packed.end;
  for (int64_t i = 0; i < positions; ++i) {
    const KeyRange range = packed.ranges[b * seq + s0 + i];
    if (range.first < range.last) {
      lo = std::min(lo, range.first);
      hi = std::max(hi, range.last);
    }
    all_from = std::max(all_from, range.first);
    all_to = range.unbroken ? std::min(all_to, range.last) : 0;
  }

  query_rows.resize(rows * qdim);
  uint16_t* query = query_rows.data();
  for (int64_t i = 0; i < positions; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t head = h * group + g, s = s0 + i;
      uint16_t* row = query + (i * group + g) * qdim;
      std::memcpy(row, p.q + b * p.q_stride_b + head * p.q_stride_h + s * p.q_stride_s, p.k_dim * sizeof(uint16_t));
      if (p.rope_dim) {
        std::memcpy(row + p.k_dim, p.q_rope + b * p.qr_stride_b + head * p.qr_stride_h + s * p.qr_stride_s,
                    p.rope_dim * sizeof(uint16_t));
      }
    }
  }
  tile.start(rows, v_dim, step);

  const int64_t bh = b * p.kv_heads + h;
  const auto* keys = reinterpret_cast<const at::BFloat16*>(packed.keys_of(bh));
  const auto* values = reinterpret_cast<const at::BFloat16*>(packed.values_of(bh));
  const auto* q = reinterpret_cast<const at::BFloat16*>(query);
  for (int64_t c0 = lo / kAttentionKeyBlock * kAttentionKeyBlock; c0 < hi; c0 += step) {
    // the keys packed from c0 up to the last any row may see (the causal diagonal's block is mostly past it),
    // a multiple of kAttentionKeyBlock
    const int64_t seen = (hi - c0 + kAttentionKeyBlock - 1) / kAttentionKeyBlock * kAttentionKeyBlock;
    const int64_t block = std::min({step, packed.padded - c0, seen});
    at::native::cpublas::brgemm(rows, block, qdim, qdim, packed.padded, step, /*add_C=*/false, q, keys + 2 * c0,
                                tile.scores.data());
    const int64_t keys_in_block = std::min({block, packed.end - c0, hi - c0});
    const bool all_allowed = all_from <= c0 && c0 + keys_in_block <= all_to;
    tile.add_block(epilogue, rows, keys_in_block, block, all_allowed ? nullptr : mask + c0, group, p.mask_stride_s,
                   p.scale, values + c0 * v_dim, v_dim);
  }

  for (int64_t i = 0; i < positions; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      const float inv = tile.sum[r] > 0.0f ? 1.0f / tile.sum[r] : 0.0f;
      at::BFloat16* dst = y + ((b * p.q_heads + h * group + g) * seq + s0 + i) * v_dim;
      epilogue.scaled_bf16(tile.out.data() + r * v_dim, inv, v_dim, reinterpret_cast<uint16_t*>(dst));
    }
  }
}


// -- Decode: flash decoding over brgemm tiles ----------------------------------------------------
// A few new tokens: a task takes every query row of one KV head (its positions times the query
// heads sharing it, at most kDecodeAttentionRows) against one split of the keys, so that a batch of
// one keeps every thread busy (flash decoding; the splits merge as the unit's do). The scores are
// computed transposed, scores^T = K . Q^T, so the cache rows are brgemm's A as they lie (M keys,
// N query rows): nothing is repacked per step but the queries (once per task) and each block's
// values into VNNI pairs (read in row order before the score GEMM walks the same rows). The unit
// attends the same rows with fp32 FMAs (AVX2); here the two GEMMs run on AMX tiles or oneDNN's
// AVX512-BF16 code.

// Per-thread buffers of a decode task besides its TileSoftmax; `n` is the task's query rows rounded up to 16.
struct DecodeScratch {
  AlignedVector<uint32_t> query;   // [qdim / 2][n] bf16 pairs: B of scores^T = K . Q^T (zero past the rows)
  AlignedVector<float> scores_t;   // [block][n]
  AlignedVector<uint16_t> values;  // [block / 2][v_dim][2]
  TileSoftmax tile;
  void fit(int64_t n, int64_t qdim, int64_t v_dim) {
    query.resize(qdim / 2 * n);
    scores_t.resize(kAttentionKeyBlock * n);
    values.resize(kAttentionKeyBlock * v_dim);
  }
};

// Keys [t0, t1) of (b, kv_head h) for the task's rows (r = s * group + g: position s, query head
// h * group + g); leaves each row's running max, sum and unnormalized output in `scratch`.
void decode_task(const UnitEpilogue& epilogue, const AttentionProblem& p, int64_t b, int64_t h, int64_t seq,
                 int64_t t0, int64_t t1, DecodeScratch& scratch) {
  constexpr int64_t block = kAttentionKeyBlock;
  const int64_t group = p.q_heads / p.kv_heads, rows = seq * group, n = (rows + 15) / 16 * 16;
  const int64_t k_pairs = p.k_dim / 2, pairs = (p.k_dim + p.rope_dim) / 2, v_dim = p.v_dim;
  uint32_t* query = scratch.query.data();
  for (int64_t r0 = 0; r0 < n; r0 += 16) {  // the rows past `rows` are zeros
    const uint16_t* q_rows[16];
    const uint16_t* rope_rows[16];
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t r = r0 + j, s = r / group, head = h * group + r % group;
      q_rows[j] = r < rows ? p.q + b * p.q_stride_b + head * p.q_stride_h + s * p.q_stride_s : nullptr;
      rope_rows[j] =
          r < rows && p.rope_dim ? p.q_rope + b * p.qr_stride_b + head * p.qr_stride_h + s * p.qr_stride_s : nullptr;
    }
    pairs_as_columns(epilogue, q_rows, rope_rows, k_pairs, pairs - k_pairs, query + r0, n);
  }
  TileSoftmax& tile = scratch.tile;
  tile.start(rows, v_dim, kAttentionKeyBlock, /*score_rows=*/n);

  const uint16_t* k = p.k_cache + b * p.k_stride_b + h * p.k_stride_h;
  const uint16_t* kr = p.rope_dim ? p.k_rope_cache + b * p.kr_stride_b + h * p.kr_stride_h : nullptr;
  const uint16_t* v = p.v_cache + b * p.v_stride_b + h * p.v_stride_h;
  const bool* mask = p.mask + b * p.mask_stride_b;
  const bool keys_are_values = k == v && p.k_stride_t == p.v_stride_t && p.k_dim >= p.v_dim;  // MLA's latent
  const auto* q_pairs = reinterpret_cast<const at::BFloat16*>(query);
  float* scores_t = scratch.scores_t.data();
  float* scores = tile.scores.data();
  bool visible[block];
  for (int64_t c0 = t0; c0 < t1; c0 += block) {
    const int64_t keys = std::min(block, t1 - c0);
    visible_keys(p, b, seq, c0, c0 + keys, visible);
    if (std::none_of(visible, visible + keys, [](bool x) { return x; })) continue;
    // Values t and t + 1 interleaved per column; zero where no row may see the key (its cache row
    // may hold anything) and past the block's keys. Meanwhile the next block's rows are prefetched,
    // to arrive while this block's GEMMs run: the score GEMM walks many rows at once, which the
    // hardware prefetchers follow worse than one row after another (measured: a cold 4096-token
    // MLA cache took 1.6x the time of a warm one without this).
    uint16_t* packed = scratch.values.data();
    for (int64_t t = 0; t < block; t += 2) {
      for (int64_t j = c0 + block + t; j < c0 + block + t + 2 && j < t1; ++j) {
        prefetch_row<1>(k + j * p.k_stride_t, p.k_dim);
        if (p.rope_dim) prefetch_row<1>(kr + j * p.kr_stride_t, p.rope_dim);
        if (!keys_are_values) prefetch_row<1>(v + j * p.v_stride_t, v_dim);
      }
      const uint16_t* v0 = t < keys && visible[t] ? v + (c0 + t) * p.v_stride_t : nullptr;
      const uint16_t* v1 = t + 1 < keys && visible[t + 1] ? v + (c0 + t + 1) * p.v_stride_t : nullptr;
      epilogue.interleave_rows(v0, v1, v_dim, packed + t * v_dim);
    }
    at::native::cpublas::brgemm(keys, n, p.k_dim, p.k_stride_t, n, n, /*add_C=*/false,
                                reinterpret_cast<const at::BFloat16*>(k + c0 * p.k_stride_t), q_pairs, scores_t);
    if (p.rope_dim) {
      at::native::cpublas::brgemm(keys, n, p.rope_dim, p.kr_stride_t, n, n, /*add_C=*/true,
                                  reinterpret_cast<const at::BFloat16*>(kr + c0 * p.kr_stride_t),
                                  q_pairs + 2 * k_pairs * n, scores_t);
    }
    // scores^T [keys][n] -> scores [n][block], 16 keys at a time through the unit's transpose (keys
    // past the block's read as zeros; the softmax masks them)
    for (int64_t t = 0; t < keys; t += 16) {
      const uint16_t* key_rows[16];
      for (int64_t j = 0; j < 16; ++j) {
        key_rows[j] = t + j < keys ? reinterpret_cast<const uint16_t*>(scores_t + (t + j) * n) : nullptr;
      }
      epilogue.transpose_pairs(key_rows, n, reinterpret_cast<uint32_t*>(scores + t), block);
    }
    tile.add_block(epilogue, rows, keys, block, mask + c0, group, p.mask_stride_s, p.scale,
                   reinterpret_cast<const at::BFloat16*>(packed), v_dim);
  }
}
}  // namespace

at::Tensor attention_brgemm(LinearUnit unit, const AttentionProblem& p, int64_t batch, int64_t seq, int64_t end,
                            AttentionTiling tiling, const at::TensorOptions& options) {
  const UnitEpilogue& epilogue = epilogue_of(unit);
  TORCH_CHECK(p.k_dim % 16 == 0 && p.rope_dim % 16 == 0 && p.v_dim % 16 == 0,
              "tilefx brgemm attention: head dims must be multiples of 16");
  constexpr int64_t block = kAttentionKeyBlock;
  Packed packed{p, end, (end + block - 1) / block * block, p.k_dim + p.rope_dim, {}, {}, {}};
  const int64_t heads = batch * p.kv_heads, blocks = packed.padded / block;
  packed.ranges.resize(batch * seq);
  at::parallel_for(0, batch * seq, 64, [&](int64_t begin, int64_t stop) {
    for (int64_t row = begin; row < stop; ++row) {
      packed.ranges[row] =
          allowed_range(p.mask + (row / seq) * p.mask_stride_b + (row % seq) * p.mask_stride_s, end);
    }
  });
  packed.keys.resize(heads * (packed.qdim / 2) * packed.padded);
  packed.values.resize(heads * packed.padded * p.v_dim);
  parallel_chunks(heads * blocks, /*min_chunk=*/1, [&](int64_t begin, int64_t stop) {
    bool visible[block];
    for (int64_t u = begin; u < stop; ++u) {
      const int64_t bh = u / blocks, t0 = (u % blocks) * block, t1 = std::min(t0 + block, end);
      const int64_t b = bh / p.kv_heads, h = bh % p.kv_heads;
      visible_keys(p, b, seq, t0, t1, visible);
      pack_keys(epilogue, packed, b, h, bh, t0, t0 + block, visible);
      pack_values(epilogue, packed, b, h, bh, t0, t0 + block, visible);
    }
  });

  at::Tensor y = at::empty({batch, p.q_heads, seq, p.v_dim}, options);
  const int64_t group = p.q_heads / p.kv_heads;
  const int64_t per_task = std::max<int64_t>(1, tiling.query_rows / group);  // positions per task
  const int64_t tiles = (seq + per_task - 1) / per_task;
  // The last positions see the most keys (causal): they go first, so the threads, taking
  // shrinking chunks as they free up, end together.
  parallel_chunks(heads * tiles, /*min_chunk=*/1, [&](int64_t begin, int64_t stop) {
    thread_local AlignedVector<uint16_t> query_rows;
    thread_local TileSoftmax tile_softmax;
    for (int64_t u = begin; u < stop; ++u) {
      const int64_t bh = u % heads, tile = tiles - 1 - u / heads;
      const int64_t s0 = tile * per_task;
      attend_tile(epilogue, packed, bh / p.kv_heads, bh % p.kv_heads, s0, std::min(per_task, seq - s0),
                  tiling.key_step, query_rows, tile_softmax, y.data_ptr<at::BFloat16>(), seq);
    }
    at::native::cpublas::brgemm_release();
  });
  return y;
}

at::Tensor attention_decode_brgemm(LinearUnit unit, const AttentionProblem& p, int64_t batch, int64_t seq,
                                   int64_t end, const at::TensorOptions& options) {
  const UnitEpilogue& epilogue = epilogue_of(unit);
  const int64_t group = p.q_heads / p.kv_heads, rows = seq * group;
  TORCH_CHECK(p.k_dim % 16 == 0 && p.rope_dim % 16 == 0 && p.v_dim % 16 == 0,
              "tilefx brgemm attention: head dims must be multiples of 16");
  TORCH_CHECK(rows <= kDecodeAttentionRows, "tilefx brgemm decode attention: ", seq, " new tokens times ", group,
              " query heads per KV head is past its ", kDecodeAttentionRows, " rows");
  constexpr int64_t block = kAttentionKeyBlock;
  const int64_t heads = batch * p.kv_heads, threads = at::get_num_threads();
  const int64_t blocks = std::max<int64_t>(1, (end + block - 1) / block);
  int64_t splits = std::min(blocks, std::max<int64_t>(1, (4 * threads + heads - 1) / heads));
  const int64_t split_len = (blocks + splits - 1) / splits * block;
  splits = std::max<int64_t>(1, (end + split_len - 1) / split_len);

  AttentionSplits parts(batch, p.kv_heads, seq, group, splits, p.v_dim);
  const int64_t qdim = p.k_dim + p.rope_dim, n = (rows + 15) / 16 * 16;
  parallel_chunks(heads * splits, /*min_chunk=*/1, [&](int64_t begin, int64_t stop) {
    thread_local DecodeScratch scratch;
    scratch.fit(n, qdim, p.v_dim);
    for (int64_t u = begin; u < stop; ++u) {
      const int64_t bh = u / splits, split = u % splits;
      const int64_t t0 = split * split_len, t1 = std::min(end, t0 + split_len);
      decode_task(epilogue, p, bh / p.kv_heads, bh % p.kv_heads, seq, t0, t1, scratch);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = parts.at(bh * seq + r / group, split) + r % group;
        parts.max[at] = scratch.tile.max[r];
        parts.sum[at] = scratch.tile.sum[r];
        std::copy(scratch.tile.out.begin() + r * p.v_dim, scratch.tile.out.begin() + (r + 1) * p.v_dim,
                  parts.out.begin() + at * p.v_dim);
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return merge_attention_splits(parts, options);
}

}  // namespace tilefx
