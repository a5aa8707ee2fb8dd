// Declarations shared by the generic translation units (the *_ops.cpp files, moe.cpp,
// memory.cpp, register.cpp): the ops' CPU kernels, which register.cpp registers, and
// what they call across files. The ISA units never include it (see kernels.h).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dispatch.h"
#include "kernels.h"
#include "tuning.h"

namespace tilefx {

inline const uint16_t* bf16_bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

// Column blocks [block_begin, block_end) of `p` on `unit` (linear_ops.cpp; moe.cpp runs
// its experts through it too). `p`'s activations come from activations.h in the form `unit` reads.
void linear_blocks(LinearUnit unit, const LinearProblem& p, int64_t block_begin, int64_t block_end, float* scratch);
// The format of a packed weight (its dtype), and `p` pointed at it: p.w (bf16) or p.wq and
// its `scales` (checked against the packed shape).
WeightFormat weight_format(const at::Tensor& packed);
void attach_weight(LinearProblem& p, const at::Tensor& packed, const c10::optional<at::Tensor>& scales);

// linear_brgemm.cpp: the linear ops on oneDNN's brgemm (prefill, or decode where tuning chose it). Work units
// [begin, end) as linear_blocks takes them (blocks, or gate/up pairs with silu_mul); x in
// bf16 pairs; the results leave through `unit`'s epilogue. `scratch`: brgemm_scratch_floats(p).
bool amx_available();
// What the brgemm kernels borrow from `unit` (kernels.h UnitEpilogue).
const UnitEpilogue& epilogue_of(LinearUnit unit);
int64_t brgemm_scratch_floats(const LinearProblem& p);
// A prefill on AMX tiles writes its output with non-temporal stores (linear_brgemm.cpp kStreamRows).
void linear_blocks_brgemm(LinearUnit unit, const LinearProblem& p, int64_t begin, int64_t end, float* scratch);

// linear_amx.cpp: tilefx's own AMX kernel, what linear_blocks_brgemm runs instead of brgemm's calls where the
// tiling says so (tuning.h GemmTiling::tiles). amx_tiles_usable: the CPU has AMX and this process may use its
// tiles. multiply_tiles: `rows` rows of x (bf16, row stride ldx) times `pairs` K pairs (a multiple of 16) of
// `blocks` (1 or 2) packed bf16 blocks, block j from b[j] (its pair row at the chunk's start) into c[j]
// ([rows][kBlockN] fp32, added to with `add`), fetching `next_bytes` from each of next[0] and next[1] (the
// chunks the caller multiplies next, whatever their count; null: nothing) into L2 over its steps, and, with
// `ahead_bytes` and two blocks, its own blocks' bytes that far ahead of its first row tile's loads (one block, a
// group's odd last, reads none ahead). It sets the calling thread's tile configuration; release_tiles gives the
// tile state back.
bool amx_tiles_usable();
void multiply_tiles(const uint16_t* x, int64_t ldx, int64_t rows, int64_t blocks, const uint16_t* const* b,
                    int64_t pairs, float* const* c, bool add, const void* const* next, int64_t next_bytes,
                    int64_t ahead_bytes);
void release_tiles();

// moe.cpp.
// w13_scales / w2_scales: those of int8 / fp8 experts (weights.packed_scales), else empty.
at::Tensor fused_moe_native(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                            const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                            const c10::optional<at::Tensor>& w13_scales, const c10::optional<at::Tensor>& w2_scales,
                            const KernelUnits& units);

// The CPU kernels of the tilefx ops. Each runs the current path's unit (dispatch.h),
// or the op's *_portable reference.
// linear_ops.cpp (scales: those of a quantized weight)
at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t out_features, const c10::optional<at::Tensor>& scales);
at::Tensor linear_float_cpu(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t out_features, const c10::optional<at::Tensor>& scales);
at::Tensor linear_silu_mul_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                               const c10::optional<at::Tensor>& scales);
at::Tensor linear_per_head_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t out_features);
// moe_ops.cpp
at::Tensor fused_moe_cpu(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                         const c10::optional<at::Tensor>& w13_scales, const c10::optional<at::Tensor>& w2_scales);
// routing_ops.cpp
std::tuple<at::Tensor, at::Tensor> topk_softmax_cpu(const at::Tensor& router_logits, int64_t top_k, bool renormalize);
std::tuple<at::Tensor, at::Tensor> grouped_topk_cpu(const at::Tensor& router_logits,
                                                    const c10::optional<at::Tensor>& correction_bias, int64_t top_k,
                                                    int64_t num_expert_group, int64_t topk_group,
                                                    c10::string_view scoring_func, bool renormalize,
                                                    double routed_scaling_factor);
// attention_brgemm.cpp: keys per tile of the flash attention over brgemm tiles (N of its score GEMM,
// K of its value GEMM); the keys it packs per call are the valid prefix rounded up to a tile.
constexpr int64_t kAttentionKeyBlock = 128;
// Prefill attention of `p` over keys [0, end) as a flash attention over oneDNN brgemm tiles blocked
// as `tiling` says (tuning.h), the online softmax on `unit` (the path's linear unit); [batch, q_heads,
// seq, v_dim] bf16, rows that may attend no key zero.
at::Tensor attention_brgemm(LinearUnit unit, const AttentionProblem& p, int64_t batch, int64_t seq, int64_t end,
                            AttentionTiling tiling, const at::TensorOptions& options);
// Decode attention of `p` (seq new tokens times the query heads per KV head: at most
// kDecodeAttentionRows, kernels.h) over keys [0, end) as flash decoding over brgemm tiles: the keys
// split across tasks, the cache rows read as they lie (scores^T = K . Q^T); same result as above.
at::Tensor attention_decode_brgemm(LinearUnit unit, const AttentionProblem& p, int64_t batch, int64_t seq,
                                   int64_t end, const at::TensorOptions& options);

// Flash decoding's partial results: per query row (b, kv_head, s), key split and query head g of
// the KV head's group, the running max, the sum of exp and the unnormalized output.
struct AttentionSplits {
  int64_t batch, kv_heads, seq, group, splits, dim;
  std::vector<float> max, sum, out;
  AttentionSplits(int64_t batch, int64_t kv_heads, int64_t seq, int64_t group, int64_t splits, int64_t dim)
      : batch(batch), kv_heads(kv_heads), seq(seq), group(group), splits(splits), dim(dim),
        max(batch * kv_heads * seq * splits * group), sum(max.size()), out(max.size() * dim) {}
  // Index of head 0 of row (b * kv_heads + kv_head) * seq + s in `split` (times dim in `out`).
  int64_t at(int64_t row, int64_t split) const { return (row * splits + split) * group; }
};
// The splits merged into [batch, kv_heads * group, seq, dim] bf16; rows that may attend no key are zero.
at::Tensor merge_attention_splits(const AttentionSplits& parts, const at::TensorOptions& options);

// attention_ops.cpp (decode_attention and extend_attention share attention_cpu)
at::Tensor attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& positions, const at::Tensor& mask,
                         double scale);
at::Tensor mla_attention_cpu(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& latent,
                             const at::Tensor& k_rope, const at::Tensor& latent_cache, const at::Tensor& rope_cache,
                             const at::Tensor& positions, const at::Tensor& mask, double scale);
// norm_ops.cpp: tilefx::rms_norm and tilefx::add_rms_norm (custom_ops/norm.py).
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps);
// tilefx::rope: the rotate-half RoPE of x [B, H, S, D] with tables [B or 1, 1, S, D], written [B, S, H, D]-major
// (custom_ops/rope.py).
at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// tilefx::mla_prefill: MLA from q_nope to the per-head values, absorbed (linear_per_head,
// mla_attention, linear_per_head) or, where the brgemm attention kernel runs MLA prefill and
// that costs fewer multiply-adds, over K/V expanded from the latent (attention_ops.cpp).
at::Tensor mla_prefill_cpu(const at::Tensor& q_nope, const at::Tensor& q_rope, const at::Tensor& latent,
                           const at::Tensor& k_rope, const at::Tensor& latent_cache, const at::Tensor& rope_cache,
                           const at::Tensor& positions, const at::Tensor& mask, double scale, const at::Tensor& w_uk,
                           const at::Tensor& w_uv, const at::Tensor& kv_b);

// memory.cpp, called from Python through the module.
at::Tensor huge_page_empty(const std::vector<int64_t>& sizes, at::ScalarType dtype);
void pack_vnni_blocks(at::Tensor& out, const at::Tensor& weight);
void pack_int4_blocks(at::Tensor& out, const at::Tensor& values, bool two_a_byte);
int64_t drop_file_mapping_pages(const std::string& suffix, std::vector<std::pair<int64_t, int64_t>> keep);
at::Tensor awq_paired_nibbles(const at::Tensor& qweight, const std::vector<int64_t>& order);
void quantize_rows_int8(const at::Tensor& weight, at::Tensor& values, at::Tensor& scales);
void quantize_blocks_fp8(const at::Tensor& weight, at::Tensor& values, at::Tensor& scales);
void quantize_groups_int4(const at::Tensor& weight, at::Tensor& values, at::Tensor& params);
double stream_read_gbps(const at::Tensor& buffer, int64_t streams);

// recycling.cpp: large CPU buffers kept for reuse while a hold is open (holds nest; the last release frees
// what is kept). Stats: (holds, kept blocks, kept bytes, large requests served by a kept block while held,
// large requests that made a new one while held).
void hold_recycled_buffers(int64_t min_bytes);
void release_recycled_buffers();
std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> recycled_buffer_stats();

// collectives.cpp: shared-memory groups of tensor-parallel ranks on one host.
int64_t shm_open_group(const std::vector<std::string>& paths, int64_t rank, int64_t slot_bytes, double timeout_s);
void shm_close_group(int64_t handle);
at::Tensor shm_all_reduce(int64_t handle, const at::Tensor& x);
at::Tensor shm_all_gather(int64_t handle, const at::Tensor& x);
std::tuple<int64_t, double, double> shm_stats(int64_t handle);
void shm_name_group(const std::string& name, int64_t handle);
at::Tensor all_reduce_cpu(const at::Tensor& x, c10::string_view group);
at::Tensor all_gather_cpu(const at::Tensor& x, c10::string_view group, int64_t size);

}  // namespace tilefx
