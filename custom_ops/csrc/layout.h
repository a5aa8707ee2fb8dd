// The packed layouts' shape arithmetic for the generic translation units (the ISA units see only
// kernels.h, which defines the layout itself). Python's one home for the same arithmetic is
// custom_ops/weights/layouts.py; these two say the same thing and nothing else re-derives it.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kernels.h"

namespace tilefx {

// Blocks of kBlockN output columns that hold `features` columns.
inline int64_t blocks_of(int64_t features) { return (features + kBlockN - 1) / kBlockN; }
// K pairs that hold `features` inputs (K padded to even).
inline int64_t pairs_of(int64_t features) { return (features + 1) / 2; }

// Whether `t` is a packing [lead..., blocks, pairs, kBlockN, 2] with `lead` leading dims (0: a
// linear or gate_up packing; 1: per expert or per head); int4 (uint8, two values a byte):
// [lead..., blocks, pairs, kBlockN / 2, 2].
inline bool is_packing(const at::Tensor& t, int64_t lead) {
  const int64_t columns = t.scalar_type() == at::kByte ? kBlockN / 2 : kBlockN;
  return t.dim() == lead + 4 && t.size(-2) == columns && t.size(-1) == 2;
}
inline int64_t packed_blocks(const at::Tensor& t) { return t.size(-4); }
inline int64_t packed_pairs(const at::Tensor& t) { return t.size(-3); }
// Values of one block (kBlockN columns x every K pair).
inline int64_t block_values(int64_t pairs) { return pairs * kPairValues; }

// A gate_up packing of two [out_features, K] weights interleaves their blocks: 2 * blocks_of(out_features).
inline int64_t gate_up_blocks(int64_t out_features) { return 2 * blocks_of(out_features); }
// The intermediate size of an expert_gate_up packing [E, 2 * I / kBlockN, ...].
inline int64_t expert_intermediate(const at::Tensor& w13) { return w13.size(1) / 2 * kBlockN; }

// Scale groups per packed block of `pairs` K pairs: fp8 one per kFp8GroupPairs, int4 one per kInt4GroupPairs.
inline int64_t groups_per_block(WeightFormat format, int64_t pairs) {
  if (format == WeightFormat::int4) return (pairs + kInt4GroupPairs - 1) / kInt4GroupPairs;
  return (pairs + kFp8GroupPairs - 1) / kFp8GroupPairs;
}
// Scale values per packed block: int8 one per column (fp32), fp8 one per group (fp32), int4 a scale and a
// zero point per group and column (fp16).
inline int64_t scales_per_block(WeightFormat format, int64_t pairs) {
  if (format == WeightFormat::int8) return kBlockN;
  if (format == WeightFormat::int4) return groups_per_block(format, pairs) * 2 * kBlockN;
  return groups_per_block(format, pairs);
}

}  // namespace tilefx
