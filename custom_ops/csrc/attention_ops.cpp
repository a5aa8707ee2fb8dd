// CPU kernels of tilefx::decode_attention, extend_attention and mla_attention: argument
// checks, the new tokens' cache writes, the split of the keys over the threads and the
// merge of the splits; each task runs the path's attention unit (dispatch.h). Prefill may
// run PyTorch's SDPA or the flash attention over brgemm tiles instead, as tuned (tuning.h). The
// references (*_portable) on the reference path.
#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <utility>
#include <vector>

#include "dispatch.h"
#include "kernels.h"
#include "ops.h"
#include "parallel.h"
#include "tuning.h"

namespace tilefx {
namespace {

// `t` itself when its last dimension is dense (what the kernels index), else a contiguous copy.
at::Tensor unit_stride(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// K/V of the new tokens into the cache rows [0, B) at `positions` (one row copy per token and head).
void write_kv(const at::Tensor& new_rows, at::Tensor& cache, const int64_t* positions) {
  const at::Tensor rows = unit_stride(new_rows);
  const int64_t batch = rows.size(0), heads = rows.size(1), seq = rows.size(2), dim = rows.size(3);
  const at::BFloat16* src = rows.data_ptr<at::BFloat16>();
  at::BFloat16* dst = cache.data_ptr<at::BFloat16>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t s = 0; s < seq; ++s)
        std::memcpy(dst + b * cache.stride(0) + h * cache.stride(1) + positions[s] * cache.stride(2),
                    src + b * rows.stride(0) + h * rows.stride(1) + s * rows.stride(2), dim * sizeof(at::BFloat16));
}

// What every attention op does before attending: checks the mask and the new tokens'
// positions (contiguous increasing cache slots), writes each (new rows, cache) pair at
// those positions, and returns the end of the keys to attend (last position + 1).
int64_t write_new_tokens(const at::Tensor& mask, const at::Tensor& positions_in, int64_t batch, int64_t seq,
                         int64_t max_len, std::initializer_list<std::pair<const at::Tensor*, at::Tensor*>> writes) {
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(0) >= batch &&
                  mask.size(2) == seq && mask.size(3) == max_len,
              "tilefx attention: mask must be bool [B, 1, S, max_len], got ", mask.scalar_type(), " ", mask.sizes());
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  TORCH_CHECK(seq > 0 && positions.dim() == 1 && positions.numel() == seq,
              "tilefx attention: one position per new token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t s = 0; s < seq; ++s) {
    TORCH_CHECK(pos[s] >= 0 && pos[s] < max_len && (s == 0 || pos[s] == pos[s - 1] + 1),
                "tilefx attention: positions must be increasing cache slots below ", max_len);
  }
  for (const auto& [rows, cache] : writes) write_kv(*rows, *cache, pos);
  return pos[seq - 1] + 1;
}

void attention_task(AttentionUnit unit, const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t s,
                    int64_t key_begin, int64_t key_end, const AttentionPartial& part) {
  switch (unit) {
    case AttentionUnit::avx2: return attention_task_avx2(p, b, kv_head, s, key_begin, key_end, part);
    case AttentionUnit::avx512: return attention_task_avx512(p, b, kv_head, s, key_begin, key_end, part);
    case AttentionUnit::avx512_emulated:
#ifdef TILEFX_AVX512_EMULATION
      return attention_task_avx512_emulated(p, b, kv_head, s, key_begin, key_end, part);
#endif
      break;  // unreachable: set_path refuses the emulated path in builds without it
  }
}

// Runs `p` (query, cache and mask pointers set) on `unit` over keys [0, end) and returns
// [batch, q_heads, seq, v_dim] bf16. Tasks are (batch row, KV head, query row, key
// split); with few rows the keys are split so every thread has work (flash-decoding),
// and the splits are merged here.
at::Tensor run_attention(AttentionUnit unit, const AttentionProblem& p, int64_t batch, int64_t seq, int64_t end,
                         const at::TensorOptions& options) {
  const int64_t q_heads = p.q_heads, kv_heads = p.kv_heads, dim = p.v_dim;
  const int64_t group = q_heads / kv_heads;
  const int64_t rows = batch * kv_heads * seq;
  const int64_t threads = at::get_num_threads();
  int64_t splits = 1;
  if (rows < 4 * threads) splits = std::min<int64_t>((4 * threads + rows - 1) / rows, (end + 63) / 64);
  const int64_t split_len = (end + splits - 1) / splits;
  splits = (end + split_len - 1) / split_len;

  AttentionSplits parts(batch, kv_heads, seq, group, splits, dim);
  const size_t scratch_floats = attention_scratch_floats(p);
  parallel_chunks(rows * splits, /*min_chunk=*/1, [&](int64_t begin, int64_t stop) {
    thread_local std::vector<float> scratch;
    if (scratch.size() < scratch_floats) scratch.resize(scratch_floats);
    for (int64_t task = begin; task < stop; ++task) {
      const int64_t row = task / splits, split = task % splits;
      const int64_t s = row % seq, kv_head = (row / seq) % kv_heads, b = row / (seq * kv_heads);
      const int64_t key_begin = split * split_len, key_end = std::min(end, key_begin + split_len);
      const int64_t at = parts.at(row, split);
      AttentionPartial out{&parts.max[at], &parts.sum[at], &parts.out[at * dim], scratch.data()};
      attention_task(unit, p, b, kv_head, s, key_begin, key_end, out);
    }
  });
  return merge_attention_splits(parts, options);
}

void rope_heads(AttentionUnit unit, const uint16_t* x, int64_t x_stride, uint16_t* out, int64_t out_stride,
                int64_t heads, const uint16_t* cos, const uint16_t* sin, int64_t dim) {
  switch (unit) {
    case AttentionUnit::avx2: return rope_heads_avx2(x, x_stride, out, out_stride, heads, cos, sin, dim);
    case AttentionUnit::avx512: return rope_heads_avx512(x, x_stride, out, out_stride, heads, cos, sin, dim);
    case AttentionUnit::avx512_emulated:
#ifdef TILEFX_AVX512_EMULATION
      return rope_heads_avx512_emulated(x, x_stride, out, out_stride, heads, cos, sin, dim);
#endif
      break;  // unreachable: set_path refuses the emulated path in builds without it
  }
}

// Whether the native kernel takes rope's arguments: bf16 throughout, the shapes rope.py names, each row's values
// dense. Anything else runs the reference.
bool rope_native_takes(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (x.scalar_type() != at::kBFloat16 || x.dim() != 4 || x.size(3) % 2 != 0 || x.stride(3) != 1) return false;
  for (const at::Tensor* table : {&cos, &sin}) {
    if (table->scalar_type() != at::kBFloat16 || table->dim() != 4 || table->stride(3) != 1 ||
        (table->size(0) != 1 && table->size(0) != x.size(0)) || table->size(1) != 1 ||
        table->size(2) != x.size(2) || table->size(3) != x.size(3)) {
      return false;
    }
  }
  return true;
}

}  // namespace

at::Tensor merge_attention_splits(const AttentionSplits& parts, const at::TensorOptions& options) {
  const int64_t group = parts.group, splits = parts.splits, dim = parts.dim, seq = parts.seq;
  const int64_t kv_heads = parts.kv_heads, q_heads = kv_heads * group, rows = parts.batch * kv_heads * seq;
  at::Tensor y = at::empty({parts.batch, q_heads, seq, dim}, options);
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t stop) {
    std::vector<float> acc(dim);
    for (int64_t row = begin; row < stop; ++row) {
      const int64_t s = row % seq, kv_head = (row / seq) % kv_heads, b = row / (seq * kv_heads);
      for (int64_t g = 0; g < group; ++g) {
        float global_max = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < splits; ++i) global_max = std::max(global_max, parts.max[parts.at(row, i) + g]);
        std::fill(acc.begin(), acc.end(), 0.0f);
        float total = 0.0f;
        if (global_max != -std::numeric_limits<float>::infinity()) {
          for (int64_t i = 0; i < splits; ++i) {
            const int64_t at = parts.at(row, i) + g;
            if (parts.sum[at] == 0.0f) continue;
            const float w = std::exp(parts.max[at] - global_max);
            total += w * parts.sum[at];
            const float* src = &parts.out[at * dim];
            for (int64_t d = 0; d < dim; ++d) acc[d] += w * src[d];
          }
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        at::BFloat16* dst = out + ((b * q_heads + kv_head * group + g) * seq + s) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<at::BFloat16>(acc[d] * inv);
      }
    }
  });
  return y;
}

namespace {

// Whether row b of `mask` is plain causal over keys [0, end) for every b < batch: the new
// tokens start the sequence (end == seq) and none is padding.
bool plain_causal(const at::Tensor& mask, int64_t batch, int64_t seq, int64_t end) {
  if (end != seq) return false;
  const bool* m = mask.data_ptr<bool>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = 0; s < seq; ++s) {
      const bool* row = m + b * mask.stride(0) + s * mask.stride(2);
      for (int64_t t = 0; t < end; ++t) {
        if (row[t] != (t <= s)) return false;
      }
    }
  }
  return true;
}

// Prefill through PyTorch's scaled_dot_product_attention over the valid prefix of the cache
// (the new tokens already written): `keys` / `values` [batch, kv_heads, end, *]. A plain causal
// mask runs as is_causal (the flash kernel then skips the future's blocks); any other mask is
// passed as it is, and query rows that may attend no key are zero, as the units make them.
at::Tensor attention_sdpa(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                          const at::Tensor& mask, int64_t batch, int64_t seq, int64_t end, double scale) {
  const bool causal = plain_causal(mask, batch, seq, end);
  c10::optional<at::Tensor> allowed;
  if (!causal) allowed = mask.slice(0, 0, batch).slice(3, 0, end);
  at::Tensor out = at::scaled_dot_product_attention(q, keys, values, allowed, 0.0, causal, scale,
                                                    /*enable_gqa=*/q.size(1) != keys.size(1));
  if (!causal) out.masked_fill_(allowed->logical_not().all(-1, /*keepdim=*/true), 0.0);
  return out;
}

at::Tensor attention_native(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                            at::Tensor v_cache, const at::Tensor& positions_in, const at::Tensor& mask_in, double scale,
                            const KernelUnits& units) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q_in, &k, &v, &k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 4,
                "tilefx attention: q, k, v and the caches must be 4-D bfloat16, got ", t->scalar_type(), " ",
                t->sizes());
  }
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "tilefx attention: caches must be contiguous and of one shape");
  const int64_t batch = q_in.size(0), q_heads = q_in.size(1), seq = q_in.size(2), dim = q_in.size(3);
  const int64_t kv_heads = k.size(1), max_len = k_cache.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == batch && k.size(2) == seq && k.size(3) == dim,
              "tilefx attention: k/v ", k.sizes(), " do not match q ", q_in.sizes());
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0 && k_cache.size(1) == kv_heads && k_cache.size(0) >= batch &&
                  k_cache.size(3) == dim,
              "tilefx attention: cache ", k_cache.sizes(), " does not fit k ", k.sizes());
  TORCH_CHECK(dim % 16 == 0, "tilefx attention: head_dim must be a multiple of 16, got ", dim);
  const int64_t end = write_new_tokens(mask_in, positions_in, batch, seq, max_len, {{&k, &k_cache}, {&v, &v_cache}});

  const at::Tensor q = unit_stride(q_in), mask = unit_stride(mask_in);
  // A few new tokens may run flash decoding on brgemm tiles (tuning.h decode_attention), whatever prefill runs.
  const bool decode_tiles =
      decode_attention(AttentionFamily::extend, seq * (q_heads / kv_heads)) == DecodeAttention::brgemm;
  const PrefillAttention kernel =
      decode_tiles ? PrefillAttention::unit : prefill_attention(AttentionFamily::extend, seq);
  if (kernel == PrefillAttention::sdpa) {
    const at::Tensor keys = k_cache.slice(0, 0, batch).slice(2, 0, end);
    const at::Tensor values = v_cache.slice(0, 0, batch).slice(2, 0, end);
    return attention_sdpa(q, keys, values, mask, batch, seq, end, scale).contiguous();
  }
  const AttentionProblem p{bf16_bits(q), q.stride(0), q.stride(1), q.stride(2),
                           nullptr, 0, 0, 0,
                           bf16_bits(k_cache), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                           nullptr, 0, 0, 0,
                           bf16_bits(v_cache), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                           mask.data_ptr<bool>(), mask.stride(0), mask.stride(2),
                           q_heads, kv_heads, dim, /*rope_dim=*/0, /*v_dim=*/dim, static_cast<float>(scale)};
  if (decode_tiles) return attention_decode_brgemm(units.linear, p, batch, seq, end, q.options());
  if (kernel == PrefillAttention::brgemm) {
    return attention_brgemm(units.linear, p, batch, seq, end, attention_tiling(AttentionFamily::extend), q.options());
  }
  return run_attention(units.attention, p, batch, seq, end, q.options());
}

// The checks both MLA ops make of what they write and attend: 4-D bf16 queries (`q`: the
// absorbed or the nope part), the new tokens' latent and rope key, and the contiguous caches
// [max_batch, 1, max_len, rank / rope] they fit.
void check_mla_inputs(const char* op, const at::Tensor& q, const at::Tensor& q_rope, const at::Tensor& latent,
                      const at::Tensor& k_rope, const at::Tensor& latent_cache, const at::Tensor& rope_cache) {
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&q, &q_rope, &latent, &k_rope, &latent_cache, &rope_cache}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 4, "tilefx ", op,
                ": queries, latent, rope key and caches must be 4-D bfloat16, got ", t->scalar_type(), " ",
                t->sizes());
  }
  const int64_t batch = q.size(0), seq = q.size(2), rank = latent_cache.size(3), rope_dim = q_rope.size(3);
  TORCH_CHECK(latent_cache.is_contiguous() && rope_cache.is_contiguous() &&
                  latent_cache.sizes().slice(0, 3) == rope_cache.sizes().slice(0, 3) && latent_cache.size(1) == 1 &&
                  latent_cache.size(0) >= batch && rope_cache.size(3) == rope_dim,
              "tilefx ", op, ": caches ", latent_cache.sizes(), " / ", rope_cache.sizes(), " do not fit the queries ",
              q.sizes(), " / ", q_rope.sizes());
  TORCH_CHECK(q_rope.sizes().slice(0, 3) == q.sizes().slice(0, 3) &&
                  latent.sizes() == at::IntArrayRef({batch, 1, seq, rank}) &&
                  k_rope.sizes() == at::IntArrayRef({batch, 1, seq, rope_dim}),
              "tilefx ", op, ": latent ", latent.sizes(), " / rope key ", k_rope.sizes(), " do not match the queries ",
              q.sizes());
  TORCH_CHECK(rank % 16 == 0 && rope_dim % 16 == 0, "tilefx ", op,
              ": kv_lora_rank and the rope dim must be multiples of 16, got ", rank, ", ", rope_dim);
}

// Weight-absorbed MLA over the latent cache: key = [latent | rope key], value = the
// latent, every query head against the one latent "head". Writes the new tokens'
// latent and rope key first.
at::Tensor mla_attention_native(const at::Tensor& q_latent_in, const at::Tensor& q_rope_in, const at::Tensor& latent,
                                const at::Tensor& k_rope, at::Tensor latent_cache, at::Tensor rope_cache,
                                const at::Tensor& positions_in, const at::Tensor& mask_in, double scale,
                                const KernelUnits& units) {
  check_mla_inputs("mla_attention", q_latent_in, q_rope_in, latent, k_rope, latent_cache, rope_cache);
  const int64_t batch = q_latent_in.size(0), heads = q_latent_in.size(1), seq = q_latent_in.size(2);
  const int64_t rank = q_latent_in.size(3), rope_dim = q_rope_in.size(3), max_len = latent_cache.size(2);
  TORCH_CHECK(latent_cache.size(3) == rank, "tilefx mla_attention: latent cache ", latent_cache.sizes(),
              " does not fit the queries ", q_latent_in.sizes());
  const int64_t end = write_new_tokens(mask_in, positions_in, batch, seq, max_len,
                                       {{&latent, &latent_cache}, {&k_rope, &rope_cache}});

  const at::Tensor q = unit_stride(q_latent_in), qr = unit_stride(q_rope_in), mask = unit_stride(mask_in);
  // A few new tokens may run flash decoding on brgemm tiles (tuning.h decode_attention), whatever prefill runs.
  const bool decode_tiles =
      decode_attention(AttentionFamily::mla, seq * heads) == DecodeAttention::brgemm;
  const PrefillAttention kernel =
      decode_tiles ? PrefillAttention::unit : prefill_attention(AttentionFamily::mla, seq);
  if (kernel == PrefillAttention::sdpa) {
    // The value (the latent) is the key's first `rank` dims: attending with the whole key as
    // the value gives the same first `rank` outputs, and SDPA's flash kernel takes only one
    // head dim for keys and values.
    const at::Tensor keys = at::cat({latent_cache.slice(0, 0, batch).slice(2, 0, end),
                                     rope_cache.slice(0, 0, batch).slice(2, 0, end)}, -1);
    const at::Tensor out = attention_sdpa(at::cat({q, qr}, -1), keys, keys, mask, batch, seq, end, scale);
    return out.narrow(-1, 0, rank).contiguous();
  }
  const AttentionProblem p{bf16_bits(q), q.stride(0), q.stride(1), q.stride(2),
                           bf16_bits(qr), qr.stride(0), qr.stride(1), qr.stride(2),
                           bf16_bits(latent_cache), latent_cache.stride(0), latent_cache.stride(1),
                           latent_cache.stride(2),
                           bf16_bits(rope_cache), rope_cache.stride(0), rope_cache.stride(1), rope_cache.stride(2),
                           bf16_bits(latent_cache), latent_cache.stride(0), latent_cache.stride(1),
                           latent_cache.stride(2),
                           mask.data_ptr<bool>(), mask.stride(0), mask.stride(2),
                           heads, /*kv_heads=*/1, rank, rope_dim, /*v_dim=*/rank, static_cast<float>(scale)};
  if (decode_tiles) return attention_decode_brgemm(units.linear, p, batch, seq, end, q.options());
  if (kernel == PrefillAttention::brgemm) {
    return attention_brgemm(units.linear, p, batch, seq, end, attention_tiling(AttentionFamily::mla), q.options());
  }
  return run_attention(units.attention, p, batch, seq, end, q.options());
}

// Whether MLA prefill should attend over keys and values expanded from the latent (the MHA
// form: kv_b_proj over the valid prefix, then every head over its own 128 + 64-wide keys and
// 128-wide values) rather than absorbed (every head over the one 512 + 64-wide latent head,
// through the per-head projections before and after). Multiply-adds per head: the expanded
// form pays for the expansion of every key, the absorbed one for the projections of every
// query row and for wider keys and values in every (query, key) pair the causal mask allows.
bool expanded_mla_pays(int64_t seq, int64_t end, int64_t rank, int64_t nope, int64_t rope, int64_t v_dim) {
  const double pairs = static_cast<double>(seq) * (end - seq) + 0.5 * static_cast<double>(seq) * (seq + 1);
  const double expanded = static_cast<double>(end) * rank * (nope + v_dim) + pairs * (nope + rope + v_dim);
  const double absorbed = static_cast<double>(seq) * rank * (nope + v_dim) + pairs * (2 * rank + rope);
  return expanded < absorbed;
}

// The expanded form holds each head's keys and values twice (expanded, then packed for brgemm):
// it runs over chunks of heads that hold at most mla_expand_budget() bytes at once (tuning.h),
// and takes the absorbed form, which expands nothing, where one head alone holds more.
int64_t expanded_head_bytes(int64_t batch, int64_t end, int64_t nope, int64_t rope, int64_t v_dim) {
  return 2 * 2 * batch * (end + kAttentionKeyBlock) * (nope + rope + v_dim);
}

// MLA prefill in the MHA form (expanded_mla_pays): writes the new tokens' latent and rope key,
// then per chunk of `chunk` heads expands the valid prefix's latent through their rows of
// kv_b_proj (oneDNN's bf16 GEMM) into per-head keys and values and attends on the brgemm kernel
// (its softmax on `unit`) with the one rope key shared by every head.
at::Tensor mla_expanded(const at::Tensor& q_nope, const at::Tensor& q_rope, const at::Tensor& latent,
                        const at::Tensor& k_rope, at::Tensor latent_cache, at::Tensor rope_cache,
                        const at::Tensor& positions, const at::Tensor& mask_in, double scale, const at::Tensor& kv_b,
                        int64_t end, int64_t chunk, LinearUnit unit) {
  const int64_t batch = q_nope.size(0), heads = q_nope.size(1), seq = q_nope.size(2), nope = q_nope.size(3);
  const int64_t rope_dim = q_rope.size(3), v_dim = kv_b.size(0) / heads - nope, width = nope + v_dim;
  check_mla_inputs("mla_prefill", q_nope, q_rope, latent, k_rope, latent_cache, rope_cache);
  write_new_tokens(mask_in, positions, batch, seq, latent_cache.size(2),
                   {{&latent, &latent_cache}, {&k_rope, &rope_cache}});
  const at::Tensor latents = latent_cache.slice(0, 0, batch).select(1, 0).slice(1, 0, end);
  const at::Tensor q = unit_stride(q_nope), qr = unit_stride(q_rope), mask = unit_stride(mask_in);
  at::Tensor y;
  for (int64_t h0 = 0; h0 < heads; h0 += chunk) {
    const int64_t n = std::min(chunk, heads - h0);
    // [batch, end, n * width]: head h0 + i's key at [i * width, + nope), its value after it.
    const at::Tensor kv = at::linear(latents, kv_b.narrow(0, h0 * width, n * width)).contiguous();
    const uint16_t* k = bf16_bits(kv);
    const AttentionProblem p{bf16_bits(q) + h0 * q.stride(1), q.stride(0), q.stride(1), q.stride(2),
                             bf16_bits(qr) + h0 * qr.stride(1), qr.stride(0), qr.stride(1), qr.stride(2),
                             k, end * n * width, width, n * width,
                             bf16_bits(rope_cache), rope_cache.stride(0), /*kr_stride_h=*/0, rope_cache.stride(2),
                             k + nope, end * n * width, width, n * width,
                             mask.data_ptr<bool>(), mask.stride(0), mask.stride(2),
                             n, /*kv_heads=*/n, nope, rope_dim, v_dim, static_cast<float>(scale)};
    at::Tensor part = attention_brgemm(unit, p, batch, seq, end, attention_tiling(AttentionFamily::mla), q.options());
    if (n == heads) return part;
    if (!y.defined()) y = at::empty({batch, heads, seq, v_dim}, q.options());
    y.narrow(1, h0, n).copy_(part);
  }
  return y;
}

}  // namespace

at::Tensor mla_prefill_cpu(const at::Tensor& q_nope, const at::Tensor& q_rope, const at::Tensor& latent,
                           const at::Tensor& k_rope, const at::Tensor& latent_cache, const at::Tensor& rope_cache,
                           const at::Tensor& positions, const at::Tensor& mask, double scale, const at::Tensor& w_uk,
                           const at::Tensor& w_uv, const at::Tensor& kv_b) {
  const KernelUnits units = current_units();
  if (!units.native) {
    static const auto portable =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("tilefx::mla_prefill_portable", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                              const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    return portable.call(q_nope, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask, scale, w_uk, w_uv,
                         kv_b);
  }
  TORCH_CHECK(q_nope.dim() == 4 && kv_b.dim() == 2 && kv_b.size(0) % q_nope.size(1) == 0 &&
                  kv_b.size(0) / q_nope.size(1) > q_nope.size(3) && latent_cache.dim() == 4 &&
                  kv_b.size(1) == latent_cache.size(3),
              "tilefx mla_prefill: kv_b_proj ", kv_b.sizes(), " does not split into ", q_nope.size(1),
              " heads of ", q_nope.size(-1), " key rows and some value rows over the latent ", latent_cache.sizes());
  const int64_t batch = q_nope.size(0), heads = q_nope.size(1), seq = q_nope.size(2), nope = q_nope.size(3);
  const int64_t rank = latent_cache.size(3), rope_dim = q_rope.size(-1), v_dim = kv_b.size(0) / heads - nope;
  TORCH_CHECK(positions.numel() == seq && seq > 0, "tilefx mla_prefill: one position per new token");
  const int64_t end = positions.reshape({-1})[seq - 1].item<int64_t>() + 1;
  const bool bf16 = q_nope.scalar_type() == at::kBFloat16 && q_rope.scalar_type() == at::kBFloat16 &&
                    latent.scalar_type() == at::kBFloat16 && k_rope.scalar_type() == at::kBFloat16 &&
                    latent_cache.scalar_type() == at::kBFloat16 && rope_cache.scalar_type() == at::kBFloat16 &&
                    kv_b.scalar_type() == at::kBFloat16;
  const int64_t chunk = mla_expand_budget() / expanded_head_bytes(batch, end, nope, rope_dim, v_dim);
  if (bf16 && nope % 16 == 0 && rope_dim % 16 == 0 && v_dim % 16 == 0 && chunk > 0 &&
      prefill_attention(AttentionFamily::mla, seq) == PrefillAttention::brgemm &&
      expanded_mla_pays(seq, end, rank, nope, rope_dim, v_dim)) {
    return mla_expanded(q_nope, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask, scale,
                        kv_b.contiguous(), end, chunk, units.linear);
  }
  const at::Tensor q_latent = linear_per_head_cpu(q_nope, w_uk, rank);
  const at::Tensor o_latent =
      mla_attention_cpu(q_latent, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask, scale);
  return linear_per_head_cpu(o_latent, w_uv, v_dim);
}

at::Tensor attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& positions, const at::Tensor& mask,
                         double scale) {
  const KernelUnits units = current_units();
  if (units.native && q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 && q.dim() == 4 &&
      q.size(3) % 16 == 0) {
    return attention_native(q, k.to(at::kBFloat16), v.to(at::kBFloat16), k_cache, v_cache, positions, mask, scale,
                            units);
  }
  static const auto portable =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("tilefx::attention_portable", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return portable.call(q, k, v, k_cache, v_cache, positions, mask, scale);
}

at::Tensor mla_attention_cpu(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& latent,
                             const at::Tensor& k_rope, const at::Tensor& latent_cache, const at::Tensor& rope_cache,
                             const at::Tensor& positions, const at::Tensor& mask, double scale) {
  const KernelUnits units = current_units();
  if (units.native && q_latent.scalar_type() == at::kBFloat16 && latent_cache.scalar_type() == at::kBFloat16 &&
      q_latent.dim() == 4 && q_latent.size(3) % 16 == 0 && q_rope.dim() == 4 && q_rope.size(3) % 16 == 0) {
    return mla_attention_native(q_latent, q_rope.to(at::kBFloat16), latent.to(at::kBFloat16),
                                k_rope.to(at::kBFloat16), latent_cache, rope_cache, positions, mask, scale,
                                units);
  }
  static const auto portable =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("tilefx::mla_attention_portable", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return portable.call(q_latent, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask, scale);
}

at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const KernelUnits units = current_units();
  if (!units.native || !rope_native_takes(x, cos, sin)) {
    static const auto portable =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("tilefx::rope_portable", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    return portable.call(x, cos, sin);
  }
  const int64_t batch = x.size(0), heads = x.size(1), seq = x.size(2), dim = x.size(3);
  at::Tensor out = at::empty({batch, seq, heads, dim}, x.options()).transpose(1, 2);
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto* cos_at = reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>());
  const auto* sin_at = reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>());
  // a table of batch 1 serves every batch row
  const int64_t cos_b = cos.size(0) == 1 ? 0 : cos.stride(0), sin_b = sin.size(0) == 1 ? 0 : sin.stride(0);
  // one task a token (all its heads, the tables' row read once); tokens in groups of ~4096 values
  const int64_t grain = std::max<int64_t>(1, 4096 / (heads * dim));
  at::parallel_for(0, batch * seq, grain, [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const int64_t b = token / seq, s = token % seq;
      rope_heads(units.attention, src + b * x.stride(0) + s * x.stride(2), x.stride(1),
                 dst + b * out.stride(0) + s * out.stride(2), out.stride(1), heads,
                 cos_at + b * cos_b + s * cos.stride(2), sin_at + b * sin_b + s * sin.stride(2), dim);
    }
  });
  return out;
}

}  // namespace tilefx
