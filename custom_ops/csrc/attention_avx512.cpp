// Attention over the KV cache on AVX512-BF16: the AVX2 unit's task (attention_avx2.cpp: one
// (batch row, KV head, query row, key split), the query heads of the KV head together, the
// keys in blocks with an online softmax, MLA's key in two parts), with both products on
// vdpbf16ps over the bf16 cache as it is, no widening:
// - scores: each key row times each query row in 32-value chunks, 16 fp32 partial sums a
//   vector; the vectors of 4 keys x 4 heads are summed by one transposing tree (45 shuffles
//   and adds for 16 scores), so no score pays a horizontal sum of its own;
// - values: two keys at a time, their value rows interleaved into (key t, key t + 1) pairs by
//   one unpack per 32 values, times the two keys' weights broadcast as a bf16 pair.
// The weights are rounded to bf16 and the softmax sums them as rounded (as the flash attention
// on brgemm tiles does). Per key this is under a third of the AVX2 unit's instructions; where
// 512-bit instructions issue at half rate (Zen 4) it still computes about as long as the memory
// takes to deliver the rows, so the next block's rows are prefetched while a block computes
// (kernels.h NextBlockPrefetch). A task with no masked key scores its whole tiles at a width fixed
// when compiled (dense_scores), with no per-key test.
//
// The same source builds twice, as linear_avx512.cpp does: for the CPU, and as
// attention_avx512_emulated.cpp on SIMDe, so the tests run this code on any CPU.
#include <algorithm>
#include <limits>

#include "bf16_scalar.h"
#include "kernels.h"
#include "vec_avx512.h"

namespace tilefx {
namespace {

constexpr int kHeadTile = kAttentionHeadTile;
constexpr int kKeyTile = 4;     // keys per score tree: kKeyTile x kHeadTile scores fill 16 lanes
constexpr int kQueryChunk = 32;  // bf16 values per vdpbf16ps: the query parts are zero-padded to it
constexpr int kValueVecs = 4;   // 16-value output vectors per head per pass over a block's values

// The lane of key k (of a tile of kKeyTile) and head h in a tile's scores: [key pair][head][key
// of the pair], so that the weights rounded to bf16 are (key t, key t + 1) pairs per head as they
// stand, which the values' product broadcasts. Lanes j, j ^ 1 and j ^ 8 hold one head.
constexpr int lane_of(int key, int head) { return (key / 2) * 8 + head * 2 + key % 2; }

constexpr __mmask16 lanes_of_key(int key) {
  __mmask16 lanes = 0;
  for (int h = 0; h < kHeadTile; ++h) lanes |= __mmask16(1u << lane_of(key, h));
  return lanes;
}

// 16 vectors -> one: lane j holds the sum of v[j]'s lanes. Pairs of vectors are combined
// within 128-bit lanes (unpack ps, then pd), then the 128-bit lanes (shuffle_f32x4) twice.
static inline __m512 sum_tree(__m512 (&v)[16]) {
  __m512 pairs[8], quads[4], octets[2];
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i) {
    octets[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(octets[0], octets[1], 0x88),
                       _mm512_shuffle_f32x4(octets[0], octets[1], 0xDD));
}

// Every lane gets the max / sum of the lanes of its head (lane_of).
static inline __m512 head_max(__m512 v) {
  v = _mm512_max_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
  return _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
}
static inline __m512 head_sum(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
  return _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
}

// Adds to acc[lane_of(k, h)] the products of one chunk of the kKeyTile keys' rows (`keys`) with the same
// chunk of the query rows of the tile's heads (at `q`, row stride `q_stride`).
static inline void add_chunk(const __m512bh (&keys)[kKeyTile], const uint16_t* q, int64_t q_stride,
                             __m512 (&acc)[16]) {
#pragma GCC unroll 4
  for (int h = 0; h < kHeadTile; ++h) {
    const __m512bh query = as_pairs(_mm512_loadu_si512(q + h * q_stride));
    for (int k = 0; k < kKeyTile; ++k) acc[lane_of(k, h)] = _mm512_dpbf16_ps(acc[lane_of(k, h)], query, keys[k]);
  }
}

// Adds to acc[lane_of(k, h)] the products of `len` values of key rows rows[k] with the query
// rows of the tile's heads (q, row stride `q_stride`, zero-padded to kQueryChunk): `len` is a
// multiple of 16, and a last chunk of 16 reads only 16 values of each key row.
static inline void add_products(const uint16_t* const (&rows)[kKeyTile], const uint16_t* q, int64_t q_stride,
                                int64_t len, __m512 (&acc)[16]) {
  for (int64_t d = 0; d < len; d += kQueryChunk) {
    const __mmask32 live = len - d >= kQueryChunk ? ~__mmask32{0} : __mmask32{0xFFFF};
    __m512bh keys[kKeyTile];
    for (int k = 0; k < kKeyTile; ++k) keys[k] = as_pairs(_mm512_maskz_loadu_epi16(live, rows[k] + d));
    add_chunk(keys, q + d, q_stride, acc);
  }
}

// What one task holds while it walks its keys, laid out in its scratch (attention_scratch_floats).
struct TaskState {
  uint16_t* query;    // [padded group][q_stride] bf16: each head's k_dim then rope_dim values, zero-padded
  int64_t q_stride;   // k_part + rope_part
  int64_t k_part;     // k_dim rounded up to kQueryChunk
  float* max;         // [head tiles][16]: a tile's running max (scaled scores), per lane (lane_of)
  float* sum;         // [head tiles][16]: its running sum of the weights as rounded
  float* acc;         // [padded group][v_dim]: unnormalized output
  float* scores;      // [block / kKeyTile][16]: one block's raw scores of one head tile
  uint32_t* weights;  // [block / 2][kHeadTile]: their weights, a bf16 (key t, key t + 1) pair per head
  const uint16_t* zero;  // a zero row, read for the block's padding keys and the masked keys' values
};

// Adds to acc the products of the rows of kKeyTile keys from `k` (row stride `stride`) with the query
// rows of the tile's heads, kChunks whole chunks: add_products at a width fixed when compiled, with
// plain loads and the row pointers computed, not looked up.
template <int kChunks>
static inline void add_rows(const uint16_t* k, int64_t stride, const uint16_t* q, int64_t q_stride, __m512 (&acc)[16]) {
#pragma GCC unroll 16
  for (int c = 0; c < kChunks; ++c) {
    __m512bh keys[kKeyTile];
    for (int j = 0; j < kKeyTile; ++j) keys[j] = as_pairs(_mm512_loadu_si512(k + j * stride + kQueryChunk * c));
    add_chunk(keys, q + kQueryChunk * c, q_stride, acc);
  }
}

// The scores of the first `tiles` whole key tiles of a block of a task none of whose keys is masked
// (first key row `k`, rope key row `k_rope`) for the head tile whose queries are at `q`, keys kChunks
// chunks wide and rope keys kRopeChunks: block_scores' common case, a decode step over an unbroken run
// of keys, with no per-key test: scores and softmax 1.35x faster than block_scores on warm caches (docs/PERFORMANCE.md,
// thirty-eighth session).
template <int kChunks, int kRopeChunks>
void dense_scores(const AttentionProblem& p, const TaskState& st, const uint16_t* k, const uint16_t* k_rope,
                  int64_t tiles, const uint16_t* q, NextBlockPrefetch& next) {
  for (int64_t i = 0; i < tiles; ++i) {
    next.step(p);
    __m512 acc[16];
    for (auto& a : acc) a = _mm512_setzero_ps();
    add_rows<kChunks>(k + i * kKeyTile * p.k_stride_t, p.k_stride_t, q, st.q_stride, acc);
    if constexpr (kRopeChunks > 0) {
      add_rows<kRopeChunks>(k_rope + i * kKeyTile * p.kr_stride_t, p.kr_stride_t, q + st.k_part, st.q_stride, acc);
    }
    _mm512_storeu_ps(st.scores + i * 16, sum_tree(acc));
  }
}

using DenseScores = void (*)(const AttentionProblem&, const TaskState&, const uint16_t*, const uint16_t*, int64_t,
                             const uint16_t*, NextBlockPrefetch&);

// dense_scores at the widths of `p`'s heads where it is built for them (64, 128 and 256 wide; MLA's
// 512 + 64), else nullptr.
DenseScores dense_scores_for(const AttentionProblem& p) {
  if (p.k_dim % kQueryChunk != 0 || p.rope_dim % kQueryChunk != 0) return nullptr;
  const int64_t chunks = p.k_dim / kQueryChunk, rope_chunks = p.rope_dim / kQueryChunk;
  if (rope_chunks == 0 && chunks == 2) return &dense_scores<2, 0>;
  if (rope_chunks == 0 && chunks == 4) return &dense_scores<4, 0>;
  if (rope_chunks == 0 && chunks == 8) return &dense_scores<8, 0>;
  if (rope_chunks == 2 && chunks == 16) return &dense_scores<16, 2>;
  return nullptr;
}

// The scores of keys [first, keys) of a block (first key row `k`, rope key row `k_rope`; `first` a
// multiple of kKeyTile) for the head tile whose queries are at `q`, tiles of kKeyTile keys, -inf where
// masked or past `keys`; each tile takes its step of `next`.
void block_scores(const AttentionProblem& p, const TaskState& st, const uint16_t* k, const uint16_t* k_rope,
                  const bool* allowed, bool dense, int64_t first, int64_t keys, const uint16_t* q,
                  NextBlockPrefetch& next) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = first; t < keys; t += kKeyTile) {
    next.step(p);
    __m512 acc[16];
    for (auto& a : acc) a = _mm512_setzero_ps();
    const uint16_t* rows[kKeyTile];
    __mmask16 live = 0;
    for (int j = 0; j < kKeyTile; ++j) {
      const bool in_block = t + j < keys;
      rows[j] = in_block ? k + (t + j) * p.k_stride_t : st.zero;
      if (in_block && (dense || allowed[t + j])) live |= lanes_of_key(j);
    }
    add_products(rows, q, st.q_stride, p.k_dim, acc);
    if (p.rope_dim) {
      for (int j = 0; j < kKeyTile; ++j) rows[j] = t + j < keys ? k_rope + (t + j) * p.kr_stride_t : st.zero;
      add_products(rows, q + st.k_part, st.q_stride, p.rope_dim, acc);
    }
    // a masked key's row may hold anything, NaN included: its score is replaced, not added to
    _mm512_storeu_ps(st.scores + t / kKeyTile * 16, _mm512_mask_mov_ps(neg_inf, live, sum_tree(acc)));
  }
}

// Online softmax over one block's scores (`tiles` of 16 lanes) of a head tile: writes the weights
// exp(scale * score - max') rounded to bf16, updates the tile's running max and sum, and returns
// per lane the factor exp(max - max') its head's accumulated output must be scaled by. A head with
// no allowed key yet keeps max -inf and weights 0.
__m512 softmax_block(const TaskState& st, int64_t tiles, float scale, float* max, float* sum) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 block_max = neg_inf;
  for (int64_t i = 0; i < tiles; ++i) block_max = _mm512_max_ps(block_max, _mm512_loadu_ps(st.scores + 16 * i));
  const __m512 old_max = _mm512_loadu_ps(max);
  const __m512 new_max = _mm512_max_ps(old_max, _mm512_mul_ps(head_max(block_max), _mm512_set1_ps(scale)));
  // old -inf: nothing accumulated yet, the factor is 0 (and -inf - -inf would be NaN)
  const __m512 alpha =
      _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(old_max, neg_inf, _CMP_NEQ_OQ), exp512(_mm512_sub_ps(old_max, new_max)));
  const __m512 factor = _mm512_set1_ps(scale * 1.44269504088896341f);
  const __m512 bias = _mm512_mul_ps(new_max, _mm512_set1_ps(-1.44269504088896341f));
  const __m512 floor = _mm512_set1_ps(-126.0f);
  __m512 block_sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < tiles; ++i) {
    const __m512 x = _mm512_loadu_ps(st.scores + 16 * i);
    const __mmask16 live = _mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ);  // masked keys weigh exactly 0
    const __m512 e = _mm512_maskz_mov_ps(live, exp2_for_bf16(_mm512_max_ps(_mm512_fmadd_ps(x, factor, bias), floor)));
    const __m256i rounded = round_bf16x16(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(st.weights + 8 * i), rounded);
    block_sum = _mm512_add_ps(block_sum, widen_bf16x16(rounded));
  }
  _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_loadu_ps(sum), alpha, head_sum(block_sum)));
  _mm512_storeu_ps(max, new_max);
  return alpha;
}

// Value pairs of two rows: word 2i of a result is `first`'s value, word 2i + 1 `second`'s. Per 32
// values, unpacked within 128-bit lanes: `low` holds values 0-3, 8-11, 16-19 and 24-27 of the
// chunk, `high` the others (kLowLanes / kHighLanes say which; the accumulators keep that order
// while a block's keys are added). A last 16 values are one permute, in natural order.
alignas(64) constexpr int32_t kLowLanes[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
alignas(64) constexpr int32_t kHighLanes[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
// and back: the chunk's first and second 16 values from (low, high)
alignas(64) constexpr int32_t kFirstHalf[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
alignas(64) constexpr int32_t kSecondHalf[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
alignas(64) constexpr uint16_t kInterleave16[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};

// acc[h] = acc[h] * alpha[h] + sum over the block's key pairs of their weights times their value
// rows, for kVecs x 16 values from `d` (the block's value rows stay in L1 across the slices).
template <int kVecs>
void block_values(const TaskState& st, const uint16_t* const* v_rows, int64_t pairs, __m512 alpha, int64_t d,
                  int64_t v_dim, float* acc) {
  constexpr int kChunks = kVecs / 2;  // 32-value chunks; then one 16-value vector where kVecs is odd
  const __m512i low_lanes = _mm512_load_si512(kLowLanes), high_lanes = _mm512_load_si512(kHighLanes);
  __m512 out[kHeadTile][kVecs];
#pragma GCC unroll 4
  for (int h = 0; h < kHeadTile; ++h) {
    const __m512 a = _mm512_permutexvar_ps(_mm512_set1_epi32(lane_of(0, h)), alpha);
    const float* row = acc + h * v_dim + d;
    for (int c = 0; c < kChunks; ++c) {
      const __m512 first = _mm512_loadu_ps(row + 32 * c), second = _mm512_loadu_ps(row + 32 * c + 16);
      out[h][2 * c] = _mm512_mul_ps(a, _mm512_permutex2var_ps(first, low_lanes, second));
      out[h][2 * c + 1] = _mm512_mul_ps(a, _mm512_permutex2var_ps(first, high_lanes, second));
    }
    if (kVecs % 2) out[h][kVecs - 1] = _mm512_mul_ps(a, _mm512_loadu_ps(row + 32 * kChunks));
  }
  const __m512i interleave16 = _mm512_load_si512(kInterleave16);
  for (int64_t i = 0; i < pairs; ++i) {
    const uint16_t* first = v_rows[2 * i] + d;
    const uint16_t* second = v_rows[2 * i + 1] + d;
    __m512bh values[kVecs];
    for (int c = 0; c < kChunks; ++c) {
      const __m512i a = _mm512_loadu_si512(first + 32 * c), b = _mm512_loadu_si512(second + 32 * c);
      values[2 * c] = as_pairs(_mm512_unpacklo_epi16(a, b));
      values[2 * c + 1] = as_pairs(_mm512_unpackhi_epi16(a, b));
    }
    if (kVecs % 2) {
      const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + 32 * kChunks)));
      const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + 32 * kChunks)));
      values[kVecs - 1] = as_pairs(_mm512_permutex2var_epi16(a, interleave16, b));
    }
#pragma GCC unroll 4
    for (int h = 0; h < kHeadTile; ++h) {
      const __m512bh w = as_pairs(_mm512_set1_epi32(static_cast<int>(st.weights[i * kHeadTile + h])));
      for (int j = 0; j < kVecs; ++j) out[h][j] = _mm512_dpbf16_ps(out[h][j], values[j], w);
    }
  }
  const __m512i first_half = _mm512_load_si512(kFirstHalf), second_half = _mm512_load_si512(kSecondHalf);
#pragma GCC unroll 4
  for (int h = 0; h < kHeadTile; ++h) {
    float* row = acc + h * v_dim + d;
    for (int c = 0; c < kChunks; ++c) {
      _mm512_storeu_ps(row + 32 * c, _mm512_permutex2var_ps(out[h][2 * c], first_half, out[h][2 * c + 1]));
      _mm512_storeu_ps(row + 32 * c + 16, _mm512_permutex2var_ps(out[h][2 * c], second_half, out[h][2 * c + 1]));
    }
    if (kVecs % 2) _mm512_storeu_ps(row + 32 * kChunks, out[h][kVecs - 1]);
  }
}

void all_values(const TaskState& st, const uint16_t* const* v_rows, int64_t pairs, __m512 alpha, int64_t v_dim,
                float* acc) {
  for (int64_t d = 0; d < v_dim; d += 16 * kValueVecs) {
    switch (std::min<int64_t>(kValueVecs, (v_dim - d) / 16)) {
      case 1: block_values<1>(st, v_rows, pairs, alpha, d, v_dim, acc); break;
      case 2: block_values<2>(st, v_rows, pairs, alpha, d, v_dim, acc); break;
      case 3: block_values<3>(st, v_rows, pairs, alpha, d, v_dim, acc); break;
      default: block_values<kValueVecs>(st, v_rows, pairs, alpha, d, v_dim, acc); break;
    }
  }
}

}  // namespace

void TILEFX_AVX512_ENTRY(attention_task)(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t s,
                                         int64_t key_begin, int64_t key_end, const AttentionPartial& part) {
  const int64_t group = p.q_heads / p.kv_heads, v_dim = p.v_dim;
  const bool* allowed = p.mask + b * p.mask_stride_b + s * p.mask_stride_s;
  const TaskKeys keys = attended_keys(allowed, key_begin, key_end);
  if (keys.begin == keys.end) return no_keys(group, part);

  // the scratch, in the order attention_scratch_floats counts it
  const int64_t padded_group = (group + kHeadTile - 1) / kHeadTile * kHeadTile, head_tiles = padded_group / kHeadTile;
  const int64_t block = attention_key_block(p);  // even
  TaskState st;
  st.k_part = (p.k_dim + kQueryChunk - 1) / kQueryChunk * kQueryChunk;
  st.q_stride = st.k_part + (p.rope_dim + kQueryChunk - 1) / kQueryChunk * kQueryChunk;
  st.max = part.scratch;
  st.sum = st.max + head_tiles * 16;
  st.acc = st.sum + head_tiles * 16;
  st.scores = st.acc + padded_group * v_dim;
  st.weights = reinterpret_cast<uint32_t*>(st.scores + (block + kKeyTile) * kHeadTile);
  uint16_t* zero = reinterpret_cast<uint16_t*>(st.weights + (block + kKeyTile) / 2 * kHeadTile);
  const int64_t zero_len = std::max(st.q_stride, v_dim);
  std::fill(zero, zero + zero_len, uint16_t{0});
  st.zero = zero;
  st.query = zero + zero_len;
  std::fill(st.query, st.query + padded_group * st.q_stride, uint16_t{0});
  for (int64_t g = 0; g < group; ++g) {
    const int64_t head = kv_head * group + g;
    const uint16_t* q = p.q + b * p.q_stride_b + head * p.q_stride_h + s * p.q_stride_s;
    std::copy(q, q + p.k_dim, st.query + g * st.q_stride);
    if (p.rope_dim) {
      const uint16_t* q_rope = p.q_rope + b * p.qr_stride_b + head * p.qr_stride_h + s * p.qr_stride_s;
      std::copy(q_rope, q_rope + p.rope_dim, st.query + g * st.q_stride + st.k_part);
    }
  }
  std::fill(st.max, st.max + head_tiles * 16, -std::numeric_limits<float>::infinity());
  std::fill(st.sum, st.sum + head_tiles * 16, 0.0f);
  std::fill(st.acc, st.acc + padded_group * v_dim, 0.0f);

  const uint16_t* k_first = p.k_cache + b * p.k_stride_b + kv_head * p.k_stride_h;
  const uint16_t* rope_first = p.rope_dim ? p.k_rope_cache + b * p.kr_stride_b + kv_head * p.kr_stride_h : nullptr;
  const uint16_t* v_first = p.v_cache + b * p.v_stride_b + kv_head * p.v_stride_h;
  const uint16_t* v_rows[kMaxAttentionKeyBlock];
  const DenseScores fast_scores = dense_scores_for(p);
  NextBlockPrefetch next(p, k_first, rope_first, v_first);
  for (int64_t t0 = keys.begin; t0 < keys.end; t0 += block) {
    const int64_t n = std::min(block, keys.end - t0), pairs = (n + 1) / 2;
    const bool* block_allowed = allowed + t0;
    // a masked key's value row may hold NaN, which a weight of 0 would not cancel: the zero row instead
    for (int64_t t = 0; t < 2 * pairs; ++t) {
      v_rows[t] = t < n && (keys.dense || block_allowed[t]) ? v_first + (t0 + t) * p.v_stride_t : st.zero;
    }
    const uint16_t* k = k_first + t0 * p.k_stride_t;
    const uint16_t* k_rope = rope_first ? rope_first + t0 * p.kr_stride_t : nullptr;
    const int64_t key_tiles = (n + kKeyTile - 1) / kKeyTile;
    next.ask(t0 + block, std::min(t0 + 2 * block, keys.end), head_tiles * key_tiles);
    // a task with no masked key: its whole tiles on the fixed-width path, a last partial tile key by key
    const int64_t fast_keys = fast_scores && keys.dense ? n / kKeyTile * kKeyTile : 0;
    for (int64_t tile = 0; tile < head_tiles; ++tile) {
      const uint16_t* q = st.query + tile * kHeadTile * st.q_stride;
      if (fast_keys > 0) fast_scores(p, st, k, k_rope, fast_keys / kKeyTile, q, next);
      block_scores(p, st, k, k_rope, block_allowed, keys.dense, fast_keys, n, q, next);
      const __m512 alpha = softmax_block(st, key_tiles, p.scale, st.max + tile * 16, st.sum + tile * 16);
      all_values(st, v_rows, pairs, alpha, v_dim, st.acc + tile * kHeadTile * v_dim);
    }
  }

  for (int64_t g = 0; g < group; ++g) {
    const int64_t at = g / kHeadTile * 16 + lane_of(0, g % kHeadTile);
    part.sum[g] = st.sum[at];
    part.max[g] = st.sum[at] > 0.0f ? st.max[at] : -std::numeric_limits<float>::infinity();
    std::copy(st.acc + g * v_dim, st.acc + (g + 1) * v_dim, part.out + g * v_dim);
  }
}

// RoPE (kernels.h rope_heads_avx2), 16 values of each half at a time, the tables' vectors loaded once for every
// head; a half that is not a multiple of 16 ends one value at a time.
void TILEFX_AVX512_ENTRY(rope_heads)(const uint16_t* x, int64_t x_stride, uint16_t* out, int64_t out_stride,
                                     int64_t heads, const uint16_t* cos, const uint16_t* sin, int64_t dim) {
  const int64_t half = dim / 2, whole = half / 16 * 16;
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 cos_lo = load_bf16x16(cos + i), cos_hi = load_bf16x16(cos + half + i);
    const __m512 sin_lo = load_bf16x16(sin + i), sin_hi = load_bf16x16(sin + half + i);
    for (int64_t h = 0; h < heads; ++h) {
      const uint16_t* row = x + h * x_stride;
      uint16_t* dst = out + h * out_stride;
      const __m512 lo = load_bf16x16(row + i), hi = load_bf16x16(row + half + i);
      store_bf16x16(dst + i, _mm512_fnmadd_ps(hi, sin_lo, _mm512_mul_ps(lo, cos_lo)));
      store_bf16x16(dst + half + i, _mm512_fmadd_ps(lo, sin_hi, _mm512_mul_ps(hi, cos_hi)));
    }
  }
  for (int64_t h = 0; h < heads && whole < half; ++h) {
    const uint16_t* row = x + h * x_stride;
    uint16_t* dst = out + h * out_stride;
    for (int64_t i = whole; i < half; ++i) {
      const float lo = bf16_to_float(row[i]), hi = bf16_to_float(row[half + i]);
      dst[i] = float_to_bf16(lo * bf16_to_float(cos[i]) - hi * bf16_to_float(sin[i]));
      dst[half + i] = float_to_bf16(hi * bf16_to_float(cos[half + i]) + lo * bf16_to_float(sin[half + i]));
    }
  }
}

}  // namespace tilefx
