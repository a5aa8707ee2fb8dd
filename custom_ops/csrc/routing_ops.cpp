// CPU kernels of the MoE routers, tilefx::topk_softmax and grouped_topk: the references'
// ATen calls from C++ on every native path, the references (*_portable) on the
// reference path.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <limits>
#include <tuple>

#include "dispatch.h"
#include "ops.h"

namespace tilefx {

// The router of Qwen-MoE and Mixtral: the same ATen calls as topk_softmax_reference (so the
// same bits and tie order as HF), without a Python frame per call.
std::tuple<at::Tensor, at::Tensor> topk_softmax_cpu(const at::Tensor& router_logits, int64_t top_k, bool renormalize) {
  if (current_units().native && router_logits.dim() == 2 && top_k >= 1 && top_k <= router_logits.size(1) &&
      at::isFloatingType(router_logits.scalar_type())) {
    const at::Tensor probs = at::softmax(router_logits, -1, at::kFloat);
    auto [weights, ids] = at::topk(probs, top_k, -1);
    if (renormalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
    return {weights, ids.to(at::kInt)};
  }
  static const auto portable = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("tilefx::topk_softmax_portable", "")
                                   .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, bool)>();
  return portable.call(router_logits, top_k, renormalize);
}

// DeepSeek's routers: grouped_topk_reference's ATen calls from C++ (same bits as HF). Arguments
// the reference would reject go to it, so its error messages stay the only ones.
std::tuple<at::Tensor, at::Tensor> grouped_topk_cpu(const at::Tensor& router_logits,
                                                    const c10::optional<at::Tensor>& correction_bias, int64_t top_k,
                                                    int64_t num_expert_group, int64_t topk_group,
                                                    c10::string_view scoring_func, bool renormalize,
                                                    double routed_scaling_factor) {
  const bool softmax = scoring_func == "softmax", sigmoid = scoring_func == "sigmoid";
  const int64_t experts = router_logits.dim() == 2 ? router_logits.size(1) : 0;
  const bool valid = router_logits.dim() == 2 && at::isFloatingType(router_logits.scalar_type()) && top_k >= 1 &&
                     top_k <= experts && (softmax || sigmoid) && num_expert_group >= 1 &&
                     experts % num_expert_group == 0 && topk_group >= 1 && topk_group <= num_expert_group &&
                     (!correction_bias || (correction_bias->dim() == 1 && correction_bias->size(0) == experts &&
                                           (num_expert_group == 1 || experts / num_expert_group >= 2)));
  if (current_units().native && valid) {
    const int64_t tokens = router_logits.size(0);
    const at::Tensor logits = router_logits.to(at::kFloat);
    const at::Tensor scores = softmax ? at::softmax(logits, -1, at::kFloat) : logits.sigmoid();
    at::Tensor choice = correction_bias ? scores + *correction_bias : scores;
    if (num_expert_group > 1) {
      const int64_t group_size = experts / num_expert_group;
      const at::Tensor grouped = choice.view({tokens, num_expert_group, group_size});
      const at::Tensor group_scores = correction_bias ? std::get<0>(grouped.topk(2, -1)).sum(-1)
                                                      : std::get<0>(grouped.max(-1));
      const at::Tensor group_idx = std::get<1>(at::topk(group_scores, topk_group, -1, true, /*sorted=*/false));
      const at::Tensor group_mask = at::zeros_like(group_scores).scatter_(1, group_idx, 1);
      const at::Tensor score_mask =
          group_mask.unsqueeze(-1).expand({tokens, num_expert_group, group_size}).reshape({tokens, experts});
      choice = choice.masked_fill(score_mask.to(at::kBool).logical_not(),
                                  correction_bias ? -std::numeric_limits<double>::infinity() : 0.0);
    }
    at::Tensor weights, ids;
    if (correction_bias) {
      ids = std::get<1>(at::topk(choice, top_k, -1, true, /*sorted=*/false));
      weights = scores.gather(1, ids);
    } else {
      std::tie(weights, ids) = at::topk(choice, top_k, -1, true, /*sorted=*/false);
    }
    if (renormalize) weights = weights / (weights.sum(-1, /*keepdim=*/true) + 1e-20);
    return {weights * routed_scaling_factor, ids.to(at::kInt)};
  }
  static const auto portable =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("tilefx::grouped_topk_portable", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const c10::optional<at::Tensor>&, int64_t,
                                                    int64_t, int64_t, c10::string_view, bool, double)>();
  return portable.call(router_logits, correction_bias, top_k, num_expert_group, topk_group, scoring_func,
                       renormalize, routed_scaling_factor);
}

}  // namespace tilefx
