// Attention over the KV cache on AVX2 + FMA: one task is one (batch row, KV head,
// query row, key split). The query heads sharing the KV head are processed
// together (GQA without repeating K/V): each key and value row is read once per
// task for all of them. Scores are fp32; softmax is per split (running max and sum),
// and the dispatch code merges the splits (flash-decoding). MLA (absorbed) is the
// same loop with the key in two parts, [latent | rope key], and the value read
// from the latent buffer: every query head shares the one latent "KV head".
#include <cmath>
#include <limits>

#include "kernels.h"

// This unit (and only this unit) is compiled for AVX2 + FMA; ops.cpp calls it only
// where CPUID reports both.
#pragma GCC target("avx2,fma")
#include "vec_avx2.h"

namespace tilefx {
namespace {

constexpr int kHeadTile = 4;   // query heads per pass over the keys
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

}  // namespace

void attention_task_avx2(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t s, int64_t key_begin,
                         int64_t key_end, const AttentionPartial& part) {
  const int64_t group = p.q_heads / p.kv_heads;
  const int64_t k_dim = p.k_dim, rope_dim = p.rope_dim, qdim = k_dim + rope_dim, v_dim = p.v_dim;
  const bool* allowed = p.mask + b * p.mask_stride_b + s * p.mask_stride_s;
  // Masked keys at either end (the causal future of a prompt row, left padding) cost nothing.
  while (key_begin < key_end && !allowed[key_begin]) ++key_begin;
  while (key_end > key_begin && !allowed[key_end - 1]) --key_end;
  const int64_t keys = key_end - key_begin;
  if (keys == 0) {
    for (int64_t g = 0; g < group; ++g) {
      part.max[g] = -std::numeric_limits<float>::infinity();
      part.sum[g] = 0.0f;
    }
    return;
  }
  const uint16_t* k_rows = p.k_cache + b * p.k_stride_b + kv_head * p.k_stride_h;
  const uint16_t* kr_rows = rope_dim ? p.k_rope_cache + b * p.kr_stride_b + kv_head * p.kr_stride_h : nullptr;
  const uint16_t* v_rows = p.v_cache + b * p.v_stride_b + kv_head * p.v_stride_h;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Inside the trimmed range a decode row has no masked key; a padded batch row may.
  bool dense = true;
  for (int64_t t = key_begin; t < key_end && dense; ++t) dense = allowed[t];

  // Scaled queries in fp32, padded with zero heads to a multiple of kHeadTile.
  const int64_t padded_group = (group + kHeadTile - 1) / kHeadTile * kHeadTile;
  float* q = part.query;
  for (int64_t g = 0; g < padded_group; ++g) {
    const int64_t head = kv_head * group + (g < group ? g : 0);
    load_query(p.q + b * p.q_stride_b + head * p.q_stride_h + s * p.q_stride_s, k_dim, p.scale, g >= group,
               q + g * qdim);
    if (rope_dim) {
      load_query(p.q_rope + b * p.qr_stride_b + head * p.qr_stride_h + s * p.qr_stride_s, rope_dim, p.scale,
                 g >= group, q + g * qdim + k_dim);
    }
  }

  // Per tile of kHeadTile heads, scores are laid out [key][head]: one 4-lane store per
  // key, and softmax runs on 8-lane vectors of two keys. An odd key count gets one
  // padding key of -inf so every loop walks whole pairs.
  const int64_t padded_keys = keys + (keys & 1);
  for (int64_t g0 = 0; g0 < padded_group; g0 += kHeadTile) {
    const int64_t heads = group - g0 < kHeadTile ? group - g0 : kHeadTile;
    const float* q0 = q + g0 * qdim;
    float* scores = part.scores + (g0 / kHeadTile) * padded_keys * kHeadTile;

    int64_t t = 0;
    if (dense) {
      for (; t + 2 <= keys; t += 2) {
        const int64_t at = key_begin + t;
        __m256 a[kHeadTile], c[kHeadTile];
#pragma GCC unroll 4
        for (int h = 0; h < kHeadTile; ++h) a[h] = c[h] = _mm256_setzero_ps();
        scores_two_keys(k_rows + at * p.k_stride_t, k_rows + (at + 1) * p.k_stride_t, q0, qdim, k_dim, a, c);
        if (rope_dim) {
          scores_two_keys(kr_rows + at * p.kr_stride_t, kr_rows + (at + 1) * p.kr_stride_t, q0 + k_dim, qdim,
                          rope_dim, a, c);
        }
        _mm_storeu_ps(scores + t * kHeadTile, hsum4(a[0], a[1], a[2], a[3]));
        _mm_storeu_ps(scores + (t + 1) * kHeadTile, hsum4(c[0], c[1], c[2], c[3]));
      }
    }
    for (; t < keys; ++t) {
      const int64_t at = key_begin + t;
      if (!dense && !allowed[at]) {
        _mm_storeu_ps(scores + t * kHeadTile, _mm_set1_ps(neg_inf));
        continue;
      }
      __m256 a[kHeadTile];
#pragma GCC unroll 4
      for (int h = 0; h < kHeadTile; ++h) a[h] = _mm256_setzero_ps();
      scores_one_key(k_rows + at * p.k_stride_t, q0, qdim, k_dim, a);
      if (rope_dim) scores_one_key(kr_rows + at * p.kr_stride_t, q0 + k_dim, qdim, rope_dim, a);
      _mm_storeu_ps(scores + t * kHeadTile, hsum4(a[0], a[1], a[2], a[3]));
    }
    if (padded_keys > keys) _mm_storeu_ps(scores + keys * kHeadTile, _mm_set1_ps(neg_inf));

    // Softmax numerators, per head (lane) of the tile.
    __m256 vmax = _mm256_set1_ps(neg_inf);
    for (int64_t t = 0; t < padded_keys; t += 2) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(scores + t * kHeadTile));
    __m128 max4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    alignas(16) float head_max[kHeadTile];
    _mm_store_ps(head_max, max4);
    for (int h = 0; h < kHeadTile; ++h) {
      if (head_max[h] == neg_inf) head_max[h] = 0.0f;  // no allowed key: every weight becomes 0 below
    }
    max4 = _mm_load_ps(head_max);
    const __m256 vm = _mm256_set_m128(max4, max4);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t t = 0; t < padded_keys; t += 2) {
      float* row = scores + t * kHeadTile;
      const __m256 x = _mm256_loadu_ps(row);
      // exp256 clamps -inf to ~1e-38: masked keys must weigh exactly 0.
      const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(x, vm)),
                                     _mm256_cmp_ps(x, _mm256_set1_ps(neg_inf), _CMP_NEQ_OQ));
      _mm256_storeu_ps(row, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    alignas(16) float head_sum[kHeadTile];
    _mm_store_ps(head_sum, _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1)));
    for (int64_t h = 0; h < heads; ++h) {
      part.sum[g0 + h] = head_sum[h];
      part.max[g0 + h] = head_sum[h] > 0.0f ? head_max[h] : neg_inf;
    }

    // Unnormalized output: per slice of 16 lanes, every key's value row times each head's weight.
    for (int64_t d = 0; d < v_dim; d += 8 * kValueVecs) {
      __m256 acc[kHeadTile][kValueVecs];
#pragma GCC unroll 4
      for (int h = 0; h < kHeadTile; ++h)
        for (int j = 0; j < kValueVecs; ++j) acc[h][j] = _mm256_setzero_ps();
      for (int64_t t = 0; t < keys; ++t) {
        if (!dense && !allowed[key_begin + t]) continue;
        __m256 v0, v1;  // the even and the odd elements of the 16-value slice
        load_vnni_pair(v_rows + (key_begin + t) * p.v_stride_t + d, v0, v1);
        const float* w = scores + t * kHeadTile;
#pragma GCC unroll 4
        for (int h = 0; h < kHeadTile; ++h) {
          const __m256 wh = _mm256_broadcast_ss(w + h);
          acc[h][0] = _mm256_fmadd_ps(wh, v0, acc[h][0]);
          acc[h][1] = _mm256_fmadd_ps(wh, v1, acc[h][1]);
        }
      }
      // Constant trip count (the accumulators stay in registers); padding heads are dropped.
#pragma GCC unroll 4
      for (int h = 0; h < kHeadTile; ++h) {
        if (h < heads) {  // back to natural order: interleave even and odd elements
          const __m256 low = _mm256_unpacklo_ps(acc[h][0], acc[h][1]);
          const __m256 high = _mm256_unpackhi_ps(acc[h][0], acc[h][1]);
          _mm256_storeu_ps(part.out + (g0 + h) * v_dim + d, _mm256_permute2f128_ps(low, high, 0x20));
          _mm256_storeu_ps(part.out + (g0 + h) * v_dim + d + 8, _mm256_permute2f128_ps(low, high, 0x31));
        }
      }
    }
  }
}

}  // namespace tilefx
