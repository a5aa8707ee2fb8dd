// Attention over the KV cache on AVX2 + FMA: one task is one (batch row, KV head,
// query row, key split). The query heads sharing the KV head are processed
// together (GQA without repeating K/V): each key and value row is read once per
// task for all of them. Keys are walked in blocks with an online softmax (running
// max and sum, fp32) so each block's rows stay in cache for all passes over it; the
// dispatch code merges the splits (flash-decoding). MLA (absorbed) is the
// same loop with the key in two parts, [latent | rope key], and the value read
// from the latent buffer: every query head shares the one latent "KV head".
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels.h"

// This unit (and only this unit) is compiled for AVX2 + FMA; the ops (dispatch.h) call
// it only where CPUID reports both.
#pragma GCC target("avx2,fma")
#include "vec_avx2.h"

namespace tilefx {
namespace {

constexpr int kHeadTile = kAttentionHeadTile;
constexpr int kValueVecs = 2;  // 8-lane output vectors per head per pass over the values

// Scores of two keys (a, b) for the kHeadTile query heads at q0 (row stride `qdim`),
// over `len` values of the key part at ka / kb and the query columns from q0:
// eight independent FMA chains hide the FMA latency.
inline void scores_two_keys(const uint16_t* ka, const uint16_t* kb, const float* q0, int64_t qdim,
                                   int64_t len, __m256 (&a)[kHeadTile], __m256 (&b)[kHeadTile]) {
  for (int64_t d = 0; d < len; d += 16) {
    __m256 ka_even, ka_odd, kb_even, kb_odd;
    load_vnni_pair(ka + d, ka_even, ka_odd);
    load_vnni_pair(kb + d, kb_even, kb_odd);
#pragma GCC unroll 4
    for (int h = 0; h < kHeadTile; ++h) {
      const __m256 q_even = _mm256_loadu_ps(q0 + h * qdim + d);
      const __m256 q_odd = _mm256_loadu_ps(q0 + h * qdim + d + 8);
      a[h] = _mm256_fmadd_ps(q_odd, ka_odd, _mm256_fmadd_ps(q_even, ka_even, a[h]));
      b[h] = _mm256_fmadd_ps(q_odd, kb_odd, _mm256_fmadd_ps(q_even, kb_even, b[h]));
    }
  }
}

inline void scores_one_key(const uint16_t* k, const float* q0, int64_t qdim, int64_t len,
                                  __m256 (&a)[kHeadTile]) {
  for (int64_t d = 0; d < len; d += 16) {
    __m256 k_even, k_odd;
    load_vnni_pair(k + d, k_even, k_odd);
#pragma GCC unroll 4
    for (int h = 0; h < kHeadTile; ++h) {
      a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + h * qdim + d + 8), k_odd,
                             _mm256_fmadd_ps(_mm256_loadu_ps(q0 + h * qdim + d), k_even, a[h]));
    }
  }
}

// Scaled query rows in fp32, the rope part after the first part, per 16-value chunk
// in [8 even | 8 odd] order (how load_vnni_pair splits a key row).
inline void load_query(const uint16_t* src, int64_t len, float scale, bool zero, float* dst) {
  for (int64_t d = 0; d < len; d += 16) {
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    if (!zero) load_vnni_pair(src + d, even, odd);
    _mm256_storeu_ps(dst + d, _mm256_mul_ps(even, _mm256_set1_ps(scale)));
    _mm256_storeu_ps(dst + d + 8, _mm256_mul_ps(odd, _mm256_set1_ps(scale)));
  }
}

// The rows of a block of keys, and which of them the mask allows.
struct KeyRows {
  const uint16_t* k;
  const uint16_t* k_rope;
  const uint16_t* v;  // the key rows again for MLA
  const bool* allowed;
};

// Scores of keys [0, keys) of a block for the kHeadTile heads at q0, laid out
// [key][head] (one 4-lane store per key; softmax then runs on 8-lane vectors of
// two keys). Masked keys score -inf. Prefetches as `ahead` says (kernels.h).
template <bool kDense>
void block_scores(const AttentionProblem& p, const KeyRows& rows, int64_t keys, const float* q0, float* scores,
                  const AttentionPrefetch& ahead) {
  const int64_t k_dim = p.k_dim, rope_dim = p.rope_dim, qdim = k_dim + rope_dim;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
  if (kDense) {
    for (; t + 2 <= keys; t += 2) {
      prefetch_attention_rows(ahead, p, t, 2);
      __m256 a[kHeadTile], c[kHeadTile];
#pragma GCC unroll 4
      for (int h = 0; h < kHeadTile; ++h) a[h] = c[h] = _mm256_setzero_ps();
      scores_two_keys(rows.k + t * p.k_stride_t, rows.k + (t + 1) * p.k_stride_t, q0, qdim, k_dim, a, c);
      if (rope_dim) {
        scores_two_keys(rows.k_rope + t * p.kr_stride_t, rows.k_rope + (t + 1) * p.kr_stride_t, q0 + k_dim, qdim,
                        rope_dim, a, c);
      }
      _mm_storeu_ps(scores + t * kHeadTile, hsum4(a[0], a[1], a[2], a[3]));
      _mm_storeu_ps(scores + (t + 1) * kHeadTile, hsum4(c[0], c[1], c[2], c[3]));
    }
  }
  for (; t < keys; ++t) {
    prefetch_attention_rows(ahead, p, t, 1);
    if (!kDense && !rows.allowed[t]) {
      _mm_storeu_ps(scores + t * kHeadTile, _mm_set1_ps(neg_inf));
      continue;
    }
    __m256 a[kHeadTile];
#pragma GCC unroll 4
    for (int h = 0; h < kHeadTile; ++h) a[h] = _mm256_setzero_ps();
    scores_one_key(rows.k + t * p.k_stride_t, q0, qdim, k_dim, a);
    if (rope_dim) scores_one_key(rows.k_rope + t * p.kr_stride_t, q0 + k_dim, qdim, rope_dim, a);
    _mm_storeu_ps(scores + t * kHeadTile, hsum4(a[0], a[1], a[2], a[3]));
  }
  if (keys & 1) _mm_storeu_ps(scores + keys * kHeadTile, _mm_set1_ps(neg_inf));
}

// Online softmax over one block for the kHeadTile heads whose running max and sum
// are at `max` / `sum`: turns the block's scores into weights exp(score - max'),
// updates both, and returns the factor exp(max - max') the heads' accumulated
// output must be scaled by.
inline __m128 softmax_block(float* scores, int64_t padded_keys, float* max, float* sum) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m128 vneg_inf = _mm_set1_ps(neg_inf);
  __m256 vmax = _mm256_set1_ps(neg_inf);
  for (int64_t t = 0; t < padded_keys; t += 2) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(scores + t * kHeadTile));
  const __m128 old_max = _mm_loadu_ps(max);
  const __m128 new_max = _mm_max_ps(old_max, _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1)));
  // A head with no allowed key yet keeps max -inf; its weights are 0 against any finite reference.
  const __m128 reference = _mm_and_ps(new_max, _mm_cmpneq_ps(new_max, vneg_inf));
  // exp256 clamps -inf to ~1e-38: masked keys and empty history must weigh exactly 0.
  const __m128 alpha = _mm_and_ps(_mm256_castps256_ps128(exp256(_mm256_castps128_ps256(_mm_sub_ps(old_max, reference)))),
                                  _mm_cmpneq_ps(old_max, vneg_inf));
  const __m256 vref = _mm256_set_m128(reference, reference);
  const __m256 wneg_inf = _mm256_set1_ps(neg_inf);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded_keys; t += 2) {
    float* row = scores + t * kHeadTile;
    const __m256 x = _mm256_loadu_ps(row);
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(x, vref)), _mm256_cmp_ps(x, wneg_inf, _CMP_NEQ_OQ));
    _mm256_storeu_ps(row, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  const __m128 block_sum = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
  _mm_storeu_ps(sum, _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(sum), alpha), block_sum));
  _mm_storeu_ps(max, new_max);
  return alpha;
}

// acc[h] = acc[h] * alpha[h] + sum over the block's keys of weight[key][h] * V[key],
// per slice of 16 value lanes (kept in [8 even | 8 odd] order until the task ends).
// The block's value rows stay in L1 across the slices.
template <bool kDense>
void block_values(const AttentionProblem& p, const KeyRows& rows, int64_t keys, const float* weights, __m128 alpha,
                  float* acc) {
  const int64_t v_dim = p.v_dim;
  alignas(16) float scale[kHeadTile];
  _mm_store_ps(scale, alpha);
  for (int64_t d = 0; d < v_dim; d += 8 * kValueVecs) {
    __m256 out[kHeadTile][kValueVecs];
#pragma GCC unroll 4
    for (int h = 0; h < kHeadTile; ++h) {
      const __m256 s = _mm256_set1_ps(scale[h]);
      for (int j = 0; j < kValueVecs; ++j) out[h][j] = _mm256_mul_ps(s, _mm256_loadu_ps(acc + h * v_dim + d + 8 * j));
    }
    for (int64_t t = 0; t < keys; ++t) {
      // Masked rows may hold anything (even NaN, which a weight of 0 would not cancel).
      if (!kDense && !rows.allowed[t]) continue;
      __m256 v0, v1;  // the even and the odd elements of the 16-value slice
      load_vnni_pair(rows.v + t * p.v_stride_t + d, v0, v1);
      const float* w = weights + t * kHeadTile;
#pragma GCC unroll 4
      for (int h = 0; h < kHeadTile; ++h) {
        const __m256 wh = _mm256_broadcast_ss(w + h);
        out[h][0] = _mm256_fmadd_ps(wh, v0, out[h][0]);
        out[h][1] = _mm256_fmadd_ps(wh, v1, out[h][1]);
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < kHeadTile; ++h)
      for (int j = 0; j < kValueVecs; ++j) _mm256_storeu_ps(acc + h * v_dim + d + 8 * j, out[h][j]);
  }
}

template <bool kDense>
void attend_blocks(const AttentionProblem& p, const KeyRows& first, int64_t keys, int64_t padded_group,
                   const float* query, float* max, float* sum, float* acc, float* scores) {
  const int64_t qdim = p.k_dim + p.rope_dim, v_dim = p.v_dim, block = attention_key_block(p);
  auto advance = [&](const KeyRows& rows, int64_t by) {
    return KeyRows{rows.k + by * p.k_stride_t, rows.k_rope ? rows.k_rope + by * p.kr_stride_t : nullptr,
                   rows.v + by * p.v_stride_t, rows.allowed + by};
  };
  for (int64_t t0 = 0; t0 < keys; t0 += block) {
    const int64_t n = keys - t0 < block ? keys - t0 : block;
    const KeyRows rows = advance(first, t0);
    const AttentionPrefetch ahead = attention_prefetch(p, rows.k, rows.k_rope, rows.v, keys - t0);
    for (int64_t g0 = 0; g0 < padded_group; g0 += kHeadTile) {
      block_scores<kDense>(p, rows, n, query + g0 * qdim, scores, g0 == 0 ? ahead : AttentionPrefetch{});
      const __m128 alpha = softmax_block(scores, n + (n & 1), max + g0, sum + g0);
      block_values<kDense>(p, rows, n, scores, alpha, acc + g0 * v_dim);
    }
  }
}

}  // namespace

void attention_task_avx2(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t s, int64_t key_begin,
                         int64_t key_end, const AttentionPartial& part) {
  const int64_t group = p.q_heads / p.kv_heads;
  const int64_t k_dim = p.k_dim, rope_dim = p.rope_dim, qdim = k_dim + rope_dim, v_dim = p.v_dim;
  const bool* allowed = p.mask + b * p.mask_stride_b + s * p.mask_stride_s;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const TaskKeys attended = attended_keys(allowed, key_begin, key_end);
  if (attended.begin == attended.end) return no_keys(group, part);
  key_begin = attended.begin;
  const int64_t keys = attended.end - attended.begin;
  const bool dense = attended.dense;

  // Scratch: scaled fp32 queries padded with zero heads to a multiple of kHeadTile,
  // then running max, sum and output per head, then one block's scores.
  const int64_t padded_group = (group + kHeadTile - 1) / kHeadTile * kHeadTile;
  float* query = part.scratch;
  float* max = query + padded_group * qdim;
  float* sum = max + padded_group;
  float* acc = sum + padded_group;
  float* scores = acc + padded_group * v_dim;
  for (int64_t g = 0; g < padded_group; ++g) {
    const int64_t head = kv_head * group + (g < group ? g : 0);
    load_query(p.q + b * p.q_stride_b + head * p.q_stride_h + s * p.q_stride_s, k_dim, p.scale, g >= group,
               query + g * qdim);
    if (rope_dim) {
      load_query(p.q_rope + b * p.qr_stride_b + head * p.qr_stride_h + s * p.qr_stride_s, rope_dim, p.scale,
                 g >= group, query + g * qdim + k_dim);
    }
    max[g] = neg_inf;
    sum[g] = 0.0f;
  }
  std::fill(acc, acc + padded_group * v_dim, 0.0f);

  const KeyRows first{
      p.k_cache + b * p.k_stride_b + kv_head * p.k_stride_h + key_begin * p.k_stride_t,
      rope_dim ? p.k_rope_cache + b * p.kr_stride_b + kv_head * p.kr_stride_h + key_begin * p.kr_stride_t : nullptr,
      p.v_cache + b * p.v_stride_b + kv_head * p.v_stride_h + key_begin * p.v_stride_t, allowed + key_begin};
  if (dense) {
    attend_blocks<true>(p, first, keys, padded_group, query, max, sum, acc, scores);
  } else {
    attend_blocks<false>(p, first, keys, padded_group, query, max, sum, acc, scores);
  }

  // Back to natural order (interleave each slice's even and odd elements); padding heads are dropped.
  for (int64_t g = 0; g < group; ++g) {
    part.max[g] = sum[g] > 0.0f ? max[g] : neg_inf;
    part.sum[g] = sum[g];
    for (int64_t d = 0; d < v_dim; d += 16) {
      const __m256 even = _mm256_loadu_ps(acc + g * v_dim + d), odd = _mm256_loadu_ps(acc + g * v_dim + d + 8);
      const __m256 low = _mm256_unpacklo_ps(even, odd), high = _mm256_unpackhi_ps(even, odd);
      _mm256_storeu_ps(part.out + g * v_dim + d, _mm256_permute2f128_ps(low, high, 0x20));
      _mm256_storeu_ps(part.out + g * v_dim + d + 8, _mm256_permute2f128_ps(low, high, 0x31));
    }
  }
}

}  // namespace tilefx

namespace tilefx {

void flash_block_softmax_avx2(float* scores, int64_t rows, int64_t keys, int64_t ld, const bool* mask,
                              int64_t group, int64_t mask_stride, float scale, float* max, float* sum,
                              uint16_t* weights, float* out, int64_t v_dim) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m256 vneg_inf = _mm256_set1_ps(neg_inf), vscale = _mm256_set1_ps(scale);
  // Lane j of the 8 keys at t is allowed: the mask byte is set and t + j < keys.
  auto allowed8 = [&](const bool* m, int64_t t) {
    if (m == nullptr) {  // every key allowed: lanes j with t + j < keys
      return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(keys - t, 8))),
                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    }
    __m256i bytes;
    if (t + 8 <= keys) {
      bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m + t)));
    } else {
      alignas(32) int32_t lanes[8] = {};
      for (int64_t j = 0; t + j < keys; ++j) lanes[j] = m[t + j];
      bytes = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
    }
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(bytes, _mm256_setzero_si256()));
  };
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * ld;
    uint16_t* w = weights + r * ld;
    const bool* m = mask ? mask + (r / group) * mask_stride : nullptr;
    __m256 vmax = vneg_inf;
    for (int64_t t = 0; t < keys; t += 8) {
      const __m256 x = _mm256_blendv_ps(vneg_inf, _mm256_mul_ps(_mm256_loadu_ps(s + t), vscale), allowed8(m, t));
      _mm256_storeu_ps(s + t, x);
      vmax = _mm256_max_ps(vmax, x);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float old_max = max[r], new_max = std::max(old_max, _mm_cvtss_f32(m4));
    if (new_max == neg_inf) {  // nothing allowed so far: weights 0, the row's output stays 0
      std::fill(w, w + ld, uint16_t{0});
      continue;
    }
    const __m256 vref = _mm256_set1_ps(new_max);
    __m256 vsum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t < keys; t += 8) {
      const __m256 x = _mm256_loadu_ps(s + t);
      // exp256 clamps -inf to ~1e-38: masked keys must weigh exactly 0.
      const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(x, vref)), _mm256_cmp_ps(x, vneg_inf, _CMP_NEQ_OQ));
      store_bf16x8(w + t, e);  // ld is a multiple of 8
      vsum = _mm256_add_ps(vsum, load_bf16x8(w + t));  // the sum of what the GEMM multiplies
    }
    std::fill(w + t, w + ld, uint16_t{0});
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
    s4 = _mm_hadd_ps(s4, s4);
    s4 = _mm_hadd_ps(s4, s4);
    // (a block that leaves the row's max as it was, as most past the first few do, calls no exp)
    const float alpha = old_max == neg_inf ? 0.0f : old_max == new_max ? 1.0f : std::exp(old_max - new_max);
    sum[r] = sum[r] * alpha + _mm_cvtss_f32(s4);
    max[r] = new_max;
    if (alpha != 1.0f) {
      float* o = out + r * v_dim;
      const __m256 va = _mm256_set1_ps(alpha);
      for (int64_t d = 0; d < v_dim; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), va));
    }
  }
}

void rope_heads_avx2(const uint16_t* x, int64_t x_stride, uint16_t* out, int64_t out_stride, int64_t heads,
                     const uint16_t* cos, const uint16_t* sin, int64_t dim) {
  const int64_t half = dim / 2, whole = half / 8 * 8;
  for (int64_t h = 0; h < heads; ++h) {
    const uint16_t* row = x + h * x_stride;
    uint16_t* dst = out + h * out_stride;
    for (int64_t i = 0; i < whole; i += 8) {
      const __m256 lo = load_bf16x8(row + i), hi = load_bf16x8(row + half + i);
      store_bf16x8(dst + i, _mm256_fnmadd_ps(hi, load_bf16x8(sin + i), _mm256_mul_ps(lo, load_bf16x8(cos + i))));
      store_bf16x8(dst + half + i,
                   _mm256_fmadd_ps(lo, load_bf16x8(sin + half + i), _mm256_mul_ps(hi, load_bf16x8(cos + half + i))));
    }
    for (int64_t i = whole; i < half; ++i) {
      const float lo = bf16_to_float(row[i]), hi = bf16_to_float(row[half + i]);
      dst[i] = float_to_bf16(lo * bf16_to_float(cos[i]) - hi * bf16_to_float(sin[i]));
      dst[half + i] = float_to_bf16(hi * bf16_to_float(cos[half + i]) + lo * bf16_to_float(sin[half + i]));
    }
  }
}

}  // namespace tilefx
