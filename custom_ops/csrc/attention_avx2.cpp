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

  // Scaled queries in fp32, padded with zero heads to a multiple of kHeadTile.
  const int64_t padded_group = (group + kHeadTile - 1) / kHeadTile * kHeadTile;
  float* q = part.query;
  for (int64_t g = 0; g < padded_group; ++g) {
    const uint16_t* src = p.q + b * p.q_stride_b + (kv_head * group + g) * p.q_stride_h + s * p.q_stride_s;
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 v = g < group ? _mm256_mul_ps(load_bf16x8(src + d), _mm256_set1_ps(p.scale)) : _mm256_setzero_ps();
      _mm256_storeu_ps(q + g * dim + d, v);
    }
  }

  // Scores: each key row widened once per tile of heads.
  for (int64_t g0 = 0; g0 < padded_group; g0 += kHeadTile) {
    const float* q0 = q + g0 * dim;
    for (int64_t t = 0; t < keys; ++t) {
      if (!allowed[key_begin + t]) {
        for (int64_t g = g0; g < g0 + kHeadTile && g < group; ++g) part.scores[g * keys + t] = neg_inf;
        continue;
      }
      const uint16_t* k = k_rows + (key_begin + t) * p.kv_stride_t;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256 kv = load_bf16x8(k + d);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), kv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + dim + d), kv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 2 * dim + d), kv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 3 * dim + d), kv, a3);
      }
      alignas(16) float sums[4];
      _mm_store_ps(sums, hsum4(a0, a1, a2, a3));
      for (int64_t g = g0; g < g0 + kHeadTile && g < group; ++g) part.scores[g * keys + t] = sums[g - g0];
    }
  }

  // Softmax numerators per head (scores become probabilities times sum).
  for (int64_t g = 0; g < group; ++g) {
    float* row = part.scores + g * keys;
    __m256 vmax = _mm256_set1_ps(neg_inf);
    int64_t t = 0;
    for (; t + 8 <= keys; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row + t));
    float max = hmax(vmax);
    for (; t < keys; ++t) max = row[t] > max ? row[t] : max;
    part.max[g] = max;
    if (max == neg_inf) {  // no allowed key in this split
      part.sum[g] = 0.0f;
      for (t = 0; t < keys; ++t) row[t] = 0.0f;
      continue;
    }
    __m256 vsum = _mm256_setzero_ps();
    const __m256 vm = _mm256_set1_ps(max);
    for (t = 0; t + 8 <= keys; t += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + t), vm));
      _mm256_storeu_ps(row + t, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    for (; t < keys; ++t) {
      row[t] = row[t] == neg_inf ? 0.0f : std::exp(row[t] - max);
      sum += row[t];
    }
    part.sum[g] = sum;
  }

  // Unnormalized output: for a slice of 16 lanes, every key's value row times every head's weight.
  for (int64_t g0 = 0; g0 < group; g0 += kHeadTile) {
    const int64_t heads = group - g0 < kHeadTile ? group - g0 : kHeadTile;
    for (int64_t d = 0; d < dim; d += 8 * kValueVecs) {
      __m256 acc[kHeadTile][kValueVecs];
      for (int h = 0; h < kHeadTile; ++h)
        for (int j = 0; j < kValueVecs; ++j) acc[h][j] = _mm256_setzero_ps();
      for (int64_t t = 0; t < keys; ++t) {
        if (!allowed[key_begin + t]) continue;
        const uint16_t* v = v_rows + (key_begin + t) * p.kv_stride_t + d;
        const __m256 v0 = load_bf16x8(v), v1 = load_bf16x8(v + 8);
        for (int h = 0; h < kHeadTile; ++h) {
          if (h >= heads) break;
          const __m256 w = _mm256_broadcast_ss(part.scores + (g0 + h) * keys + t);
          acc[h][0] = _mm256_fmadd_ps(w, v0, acc[h][0]);
          acc[h][1] = _mm256_fmadd_ps(w, v1, acc[h][1]);
        }
      }
      for (int h = 0; h < heads; ++h) {
        _mm256_storeu_ps(part.out + (g0 + h) * dim + d, acc[h][0]);
        _mm256_storeu_ps(part.out + (g0 + h) * dim + d + 8, acc[h][1]);
      }
    }
  }
}

}  // namespace tilefx
