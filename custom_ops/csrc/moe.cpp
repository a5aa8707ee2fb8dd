// tilefx::fused_moe on the native path: the routed experts of a MoE layer in one op.
//
// Tokens are sorted by expert (counting sort of the (token, slot) pairs), so each
// selected expert's weights are read once per step whatever number of its tokens:
//   1. gather: the rows of x routed to each expert, one after another, in the form the
//      unit reads (activations.h);
//   2. gate/up: per expert, silu(x_e @ gate_e^T) * (x_e @ up_e^T) -> act_e, the gate/up
//      GEMM with SiLU-and-mul in its epilogue (linear_avx2.cpp, linear_avx512.cpp), written
//      in the form the down projection reads: bf16 on the AVX512-BF16 units (as HF's bf16
//      experts compute it), fp32 on AVX2;
//   3. down: per expert, act_e @ down_e^T -> out_e, rounded to bf16 (as HF's experts return it);
//   4. combine: y[t] = sum_k w[t, k] * out[pair (t, k)], fp32, rounded once to bf16 (the unit's
//      weighted_sum_row).
// Its buffers are the size of the routed rows (tokens x top_k), hundreds of MB a layer for a
// long prompt, each a fresh mapping whose pages fault in on first touch: so each is written
// once, in the narrowest form its reader takes.
// Steps 2 and 3 hand the threads contiguous chunks of (expert, column block) work
// units over the active experts only (parallel_chunks: taken on demand), so in decode
// a thread streams a few experts' weights front to back and experts that no token
// chose are never touched.
#include <ATen/Parallel.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "aligned.h"
#include "activations.h"
#include "kernels.h"
#include "layout.h"
#include "ops.h"
#include "parallel.h"
#include "tuning.h"

namespace tilefx {

namespace {

struct ExpertRows {
  int64_t expert, begin, count;  // rows [begin, begin + count) of the sorted pairs
};

// Runs `linear` (a LinearProblem for one expert) over work units: each expert owns
// `blocks_per_expert` consecutive units; threads take contiguous chunks of them on demand.
// An expert with more than kGemvRows rows runs oneDNN's brgemm where tuning chose it for the
// format (prefill_on_brgemm) and the unit reads bf16 pairs, brgemm's form (the AVX512-BF16
// units; the AVX2 unit's fp32 rows keep its own GEMM).
template <typename MakeProblem>
void for_expert_blocks(const KernelUnits& units, const std::vector<ExpertRows>& experts, int64_t blocks_per_expert,
                       MakeProblem make_problem) {
  const LinearUnit isa = units.moe;
  const int64_t work = static_cast<int64_t>(experts.size()) * blocks_per_expert;
  // the problem of the expert with the most rows needs the most (a quantized GEMM adds its panel)
  const ExpertRows& largest = *std::max_element(experts.begin(), experts.end(), [](const auto& a, const auto& b) {
    return a.count < b.count;
  });
  const LinearProblem widest = make_problem(largest);
  auto on_brgemm = [&](const LinearProblem& p) { return reads_pairs(isa) && prefill_on_brgemm(units, p.format, p.M); };
  const size_t scratch_floats =
      std::max(linear_scratch_floats(widest), on_brgemm(widest) ? brgemm_scratch_floats(widest) : int64_t{0});
  parallel_chunks(work, /*min_chunk=*/4, [&](int64_t begin, int64_t end) {
    thread_local AlignedVector<float> scratch;
    if (scratch.size() < scratch_floats) scratch.resize(scratch_floats);
    for (int64_t unit = begin; unit < end;) {
      const int64_t i = unit / blocks_per_expert, first = unit % blocks_per_expert;
      const int64_t last = std::min(blocks_per_expert, first + (end - unit));
      const LinearProblem p = make_problem(experts[i]);
      if (on_brgemm(p)) {
        linear_blocks_brgemm(isa, p, first, last, scratch.data());
      } else {
        linear_blocks(isa, p, first, last, scratch.data());
      }
      unit += last - first;
    }
  });
}

// One packed [E, ...] expert tensor (and its scales, for int8 / fp8 experts), checked once per call;
// `attach` points a problem at expert `e`'s part.
struct ExpertWeights {
  LinearProblem whole{};  // the experts' weights and format (`attach` takes the walk from `walk`)
  WalkTuning walk{};      // read once per call, like the path
  int64_t values_per_expert = 0, scales_per_expert = 0;

  ExpertWeights(const at::Tensor& packed, const c10::optional<at::Tensor>& scales, LinearUnit unit)
      : values_per_expert(packed[0].numel()),
        scales_per_expert(scales ? scales->numel() / packed.size(0) : 0) {
    attach_weight(whole, packed, scales);
    walk = walk_tuning(unit, whole.format);
  }

  void attach(LinearProblem& p, int64_t e) const {
    p.format = whole.format;
    p.k_groups = whole.k_groups;
    apply_tuning(p, walk);
    if (whole.format == WeightFormat::bf16) {
      p.w = whole.w + e * values_per_expert;
    } else if (whole.format == WeightFormat::int4) {
      p.wq = whole.wq + e * values_per_expert;
      p.int4_params = whole.int4_params + e * scales_per_expert;
    } else {
      p.wq = whole.wq + e * values_per_expert;
      p.scales = whole.scales + e * scales_per_expert;
    }
  }
};

}  // namespace

// Arguments checked by the caller (moe_ops.cpp): hidden [T, H] bf16; w13 [E, 2 * I/32, H/2 (padded), 32, 2]
// (pack_gate_up_weight per expert); w2 [E, H/32 (padded), I/2 (padded), 32, 2]; topk_ids [T, k] in [0, E).
// The experts may be int8 / fp8 (both in one format) with their scales (attach_weight checks them): each
// expert's problem then runs the quantized walk of its unit (linear_walk.h), as a quantized linear does.
at::Tensor fused_moe_native(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                            const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                            const c10::optional<at::Tensor>& w13_scales, const c10::optional<at::Tensor>& w2_scales,
                            const KernelUnits& units) {
  const LinearUnit unit = units.moe;
  const int64_t tokens = hidden.size(0), hidden_size = hidden.size(1), top_k = topk_ids.size(1);
  const int64_t num_experts = w13.size(0), inter = expert_intermediate(w13);
  const int64_t h_pairs = packed_pairs(w13), i_pairs = packed_pairs(w2);
  const int64_t ldx = 2 * h_pairs, ld_act = 2 * i_pairs;
  at::Tensor y = at::empty({tokens, hidden_size}, hidden.options());
  if (tokens == 0) return y;

  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t pairs = tokens * top_k;

  // Counting sort of the (token, slot) pairs by expert, stable in pair order.
  std::vector<int64_t> start(num_experts + 1, 0), sorted(pairs), row_of_pair(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < num_experts, "tilefx fused_moe: expert id ", id[i], " outside [0, ",
                num_experts, ")");
    ++start[id[i] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < pairs; ++i) {
    sorted[fill[id[i]]] = i;
    row_of_pair[i] = fill[id[i]]++;
  }
  const ExpertWeights w13_experts(w13, w13_scales, unit), w2_experts(w2, w2_scales, unit);
  // The rows of the experts that read x as words (int8 / int4 experts of up to kGemvRows rows: one list serves
  // both projections) and of those that run a GEMM (int8 experts read their integer form there, off brgemm).
  std::vector<ExpertRows> active;
  RowPlan plan;
  plan.gemm_on_brgemm = reads_pairs(unit) && prefill_on_brgemm(units, w13_experts.whole.format, kGemvRows + 1);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t count = start[e + 1] - start[e];
    if (count == 0) continue;
    active.push_back({e, start[e], count});
    (count <= kGemvRows ? plan.words : plan.gemm).push_back({start[e], count});
  }

  // 1. gather the routed rows of x in the form the experts' unit reads (int8 / int4 experts: as words too, for
  // the experts that get at most kGemvRows rows).
  const at::Tensor x = hidden.contiguous();
  const uint16_t* x_bits = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const Activations xs(unit, w13_experts.whole.format, pairs, hidden_size, ldx, &plan,
                       [&](int64_t r) { return x_bits + (sorted[r] / top_k) * hidden_size; });

  // 2. gate/up with SiLU-and-mul -> act, in the form the down projection reads: bf16 pairs on the
  // AVX512-BF16 units (rounded as HF's bf16 experts compute it), written so by the epilogue, fp32 on AVX2.
  // Every row is some expert's, and its gate/up writes columns [0, I); only the columns past I (w2's K
  // padding, which the down projection reads) are zeroed here.
  const bool act_pairs = reads_pairs(unit);
  at::Tensor act_tensor = at::empty({pairs, ld_act}, hidden.options().dtype(act_pairs ? at::kBFloat16 : at::kFloat));
  if (ld_act > inter) act_tensor.narrow(1, inter, ld_act - inter).zero_();
  for_expert_blocks(units, active, inter / kBlockN, [&](const ExpertRows& r) {
    LinearProblem p{nullptr, nullptr, nullptr, nullptr, r.count, inter, h_pairs, ldx, nullptr, ld_act,
                    /*silu_mul=*/true};
    if (act_pairs) {
      p.y = reinterpret_cast<uint16_t*>(act_tensor.data_ptr<at::BFloat16>()) + r.begin * ld_act;
    } else {
      p.yf = act_tensor.data_ptr<float>() + r.begin * ld_act;
    }
    w13_experts.attach(p, r.expert);
    xs.attach(p, r.begin);
    return p;
  });
  const Activations act_rows =
      act_pairs ? Activations(unit, w2_experts.whole.format, bf16_bits(act_tensor), pairs, ld_act, ld_act, ld_act,
                              &plan)
                : Activations(unit, w2_experts.whole.format, act_tensor.data_ptr<float>(), pairs, ld_act, &plan);

  // 3. down -> out, each (token, expert) pair's row rounded to bf16 as HF's experts return it.
  at::Tensor out_tensor = at::empty({pairs, hidden_size}, hidden.options());
  at::BFloat16* out = out_tensor.data_ptr<at::BFloat16>();
  for_expert_blocks(units, active, packed_blocks(w2), [&](const ExpertRows& r) {
    LinearProblem p{nullptr, nullptr, nullptr, reinterpret_cast<uint16_t*>(out + r.begin * hidden_size), r.count,
                    hidden_size, i_pairs, ld_act, nullptr, hidden_size, /*silu_mul=*/false};
    w2_experts.attach(p, r.expert);
    act_rows.attach(p, r.begin);
    return p;
  });

  // 4. weighted combine in fp32, on the unit's vectors.
  const float* w = weights.data_ptr<float>();
  const uint16_t* out_bits = bf16_bits(out_tensor);
  uint16_t* y_bits = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const UnitEpilogue& epilogue = epilogue_of(unit);
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<const uint16_t*> rows(top_k);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t s = 0; s < top_k; ++s) rows[s] = out_bits + row_of_pair[t * top_k + s] * hidden_size;
      epilogue.weighted_sum_row(rows.data(), w + t * top_k, top_k, hidden_size, y_bits + t * hidden_size);
    }
  });
  return y;
}

}  // namespace tilefx
