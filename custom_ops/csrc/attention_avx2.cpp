// Attention over the KV cache on AVX2 + FMA: one task is one (batch row, KV head,
// query row, key split). The query heads sharing the KV head are processed
// together (GQA without repeating K/V): each key and value row is read once per
// task for all of them. Scores are fp32; softmax is per split (running max and sum),
// and the dispatch code merges the splits (flash-decoding).
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

}  // namespace

void attention_task_avx2(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t s, int64_t key_begin,
                         int64_t key_end, const AttentionPartial& part) {
  const int64_t group = p.q_heads / p.kv_heads;
  const int64_t dim = p.head_dim;  // multiple of 16 (checked by the dispatch code)
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
  const uint16_t* k_rows = p.k_cache + b * p.kv_stride_b + kv_head * p.kv_stride_h;
  const uint16_t* v_rows = p.v_cache + b * p.kv_stride_b + kv_head * p.kv_stride_h;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Inside the trimmed range a decode row has no masked key; a padded batch row may.
  bool dense = true;
  for (int64_t t = key_begin; t < key_end && dense; ++t) dense = allowed[t];

  // Scaled queries in fp32, padded with zero heads to a multiple of kHeadTile.
  const int64_t padded_group = (group + kHeadTile - 1) / kHeadTile * kHeadTile;
  float* q = part.query;
  // Rows are read 16 values at a time as one 32-byte load split into even and odd
  // elements (load_vnni_pair): queries are stored in that order too, per 16-value
  // chunk [8 even | 8 odd], so a dot product pairs them up without any shuffle.
  for (int64_t g = 0; g < padded_group; ++g) {
    const uint16_t* src = p.q + b * p.q_stride_b + (kv_head * group + g) * p.q_stride_h + s * p.q_stride_s;
    for (int64_t d = 0; d < dim; d += 16) {
      __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
      if (g < group) load_vnni_pair(src + d, even, odd);
      _mm256_storeu_ps(q + g * dim + d, _mm256_mul_ps(even, _mm256_set1_ps(p.scale)));
      _mm256_storeu_ps(q + g * dim + d + 8, _mm256_mul_ps(odd, _mm256_set1_ps(p.scale)));
    }
  }

  // Per tile of kHeadTile heads, scores are laid out [key][head]: one 4-lane store per
  // key, and softmax runs on 8-lane vectors of two keys. An odd key count gets one
  // padding key of -inf so every loop walks whole pairs.
  const int64_t padded_keys = keys + (keys & 1);
  for (int64_t g0 = 0; g0 < padded_group; g0 += kHeadTile) {
    const int64_t heads = group - g0 < kHeadTile ? group - g0 : kHeadTile;
    const float* q0 = q + g0 * dim;
    float* scores = part.scores + (g0 / kHeadTile) * padded_keys * kHeadTile;

    // Two keys per iteration: eight independent FMA chains hide the FMA latency.
    int64_t t = 0;
    if (dense) {
      for (; t + 2 <= keys; t += 2) {
        const uint16_t* k = k_rows + (key_begin + t) * p.kv_stride_t;
        const uint16_t* k_next = k + p.kv_stride_t;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int64_t d = 0; d < dim; d += 16) {
          __m256 ka_even, ka_odd, kb_even, kb_odd;
          load_vnni_pair(k + d, ka_even, ka_odd);
          load_vnni_pair(k_next + d, kb_even, kb_odd);
#define TILEFX_QK_HEAD(h, acc_a, acc_b)                                              \
  {                                                                                  \
    const __m256 q_even = _mm256_loadu_ps(q0 + (h) * dim + d);                       \
    const __m256 q_odd = _mm256_loadu_ps(q0 + (h) * dim + d + 8);                    \
    acc_a = _mm256_fmadd_ps(q_odd, ka_odd, _mm256_fmadd_ps(q_even, ka_even, acc_a)); \
    acc_b = _mm256_fmadd_ps(q_odd, kb_odd, _mm256_fmadd_ps(q_even, kb_even, acc_b)); \
  }
          TILEFX_QK_HEAD(0, a0, b0)
          TILEFX_QK_HEAD(1, a1, b1)
          TILEFX_QK_HEAD(2, a2, b2)
          TILEFX_QK_HEAD(3, a3, b3)
#undef TILEFX_QK_HEAD
        }
        _mm_storeu_ps(scores + t * kHeadTile, hsum4(a0, a1, a2, a3));
        _mm_storeu_ps(scores + (t + 1) * kHeadTile, hsum4(b0, b1, b2, b3));
      }
    }
    for (; t < keys; ++t) {
      if (!dense && !allowed[key_begin + t]) {
        _mm_storeu_ps(scores + t * kHeadTile, _mm_set1_ps(neg_inf));
        continue;
      }
      const uint16_t* k = k_rows + (key_begin + t) * p.kv_stride_t;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < dim; d += 16) {
        __m256 k_even, k_odd;
        load_vnni_pair(k + d, k_even, k_odd);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d + 8), k_odd, _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), k_even, a0));
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + dim + d + 8), k_odd,
                             _mm256_fmadd_ps(_mm256_loadu_ps(q0 + dim + d), k_even, a1));
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 2 * dim + d + 8), k_odd,
                             _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 2 * dim + d), k_even, a2));
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 3 * dim + d + 8), k_odd,
                             _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 3 * dim + d), k_even, a3));
      }
      _mm_storeu_ps(scores + t * kHeadTile, hsum4(a0, a1, a2, a3));
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
    for (int64_t d = 0; d < dim; d += 8 * kValueVecs) {
      __m256 acc[kHeadTile][kValueVecs];
#pragma GCC unroll 4
      for (int h = 0; h < kHeadTile; ++h)
        for (int j = 0; j < kValueVecs; ++j) acc[h][j] = _mm256_setzero_ps();
      for (int64_t t = 0; t < keys; ++t) {
        if (!dense && !allowed[key_begin + t]) continue;
        __m256 v0, v1;  // the even and the odd elements of the 16-value slice
        load_vnni_pair(v_rows + (key_begin + t) * p.kv_stride_t + d, v0, v1);
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
          _mm256_storeu_ps(part.out + (g0 + h) * dim + d, _mm256_permute2f128_ps(low, high, 0x20));
          _mm256_storeu_ps(part.out + (g0 + h) * dim + d + 8, _mm256_permute2f128_ps(low, high, 0x31));
        }
      }
    }
  }
}

}  // namespace tilefx
