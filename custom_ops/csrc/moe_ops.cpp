// CPU kernel of tilefx::fused_moe: argument checks, then the experts on the current
// path's unit (moe.cpp); the reference (fused_moe_portable) on the reference path.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "dispatch.h"
#include "kernels.h"
#include "layout.h"
#include "ops.h"

namespace tilefx {
namespace {

void check_moe(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
               const at::Tensor& topk_ids) {
  TORCH_CHECK(hidden.dim() == 2, "tilefx fused_moe: hidden must be [tokens, hidden_size], got ", hidden.sizes());
  const int64_t hidden_size = hidden.size(1);
  TORCH_CHECK(is_packing(w13, 1) && w13.is_contiguous() && packed_blocks(w13) % 2 == 0 &&
                  packed_pairs(w13) == pairs_of(hidden_size),
              "tilefx fused_moe: w13 must be pack_expert_gate_up_weight's [E, 2 * I/", kBlockN, ", ",
              pairs_of(hidden_size), ", ", kBlockN, ", 2], got ", w13.scalar_type(), " ", w13.sizes());
  const int64_t inter = expert_intermediate(w13);
  TORCH_CHECK(w2.scalar_type() == w13.scalar_type() && is_packing(w2, 1) && w2.is_contiguous() &&
                  w2.size(0) == w13.size(0) && packed_blocks(w2) == blocks_of(hidden_size) &&
                  packed_pairs(w2) == pairs_of(inter),
              "tilefx fused_moe: w2 must be pack_expert_down_weight's [", w13.size(0), ", ", blocks_of(hidden_size),
              ", ", pairs_of(inter), ", ", kBlockN, ", 2], got ", w2.scalar_type(), " ", w2.sizes());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == hidden.size(0) && topk_ids.scalar_type() == at::kInt,
              "tilefx fused_moe: topk_ids must be int32 [tokens, k] (the router ops' ids), got ", topk_ids.scalar_type(), " ",
              topk_ids.sizes());
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && at::isFloatingType(topk_weights.scalar_type()),
              "tilefx fused_moe: topk_weights must be floating [tokens, k] like topk_ids, got ",
              topk_weights.scalar_type(), " ", topk_weights.sizes());
}

}  // namespace

at::Tensor fused_moe_cpu(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                         const c10::optional<at::Tensor>& w13_scales, const c10::optional<at::Tensor>& w2_scales) {
  const KernelUnits units = current_units();
  if (hidden.scalar_type() == at::kBFloat16 && units.native) {
    check_moe(hidden, w13, w2, topk_weights, topk_ids);
    return fused_moe_native(hidden, w13, w2, topk_weights, topk_ids, w13_scales, w2_scales, units);
  }
  using Scales = const c10::optional<at::Tensor>&;
  static const auto portable = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("tilefx::fused_moe_portable", "")
                                   .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, const at::Tensor&, Scales, Scales)>();
  return portable.call(hidden, w13, w2, topk_weights, topk_ids, w13_scales, w2_scales);
}

}  // namespace tilefx
