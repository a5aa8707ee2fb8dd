// CPU kernels of tilefx::linear, linear_float, linear_silu_mul and linear_per_head:
// argument checks, threading (parallel_chunks for the streaming linears) and the unit
// the current path runs (dispatch.h); the references (*_portable) on the reference
// path. Also the unit-generic calls that moe.cpp shares (ops.h).
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "aligned.h"
#include "activations.h"
#include "dispatch.h"
#include "kernels.h"
#include "layout.h"
#include "ops.h"
#include "parallel.h"
#include "tuning.h"

namespace tilefx {

void linear_blocks(LinearUnit unit, const LinearProblem& p, int64_t block_begin, int64_t block_end, float* scratch) {
  switch (unit) {
    case LinearUnit::avx2: return linear_blocks_avx2(p, block_begin, block_end, scratch);
    case LinearUnit::avx512: return linear_blocks_avx512(p, block_begin, block_end, scratch);
    case LinearUnit::avx512_emulated:
#ifdef TILEFX_AVX512_EMULATION
      return linear_blocks_avx512_emulated(p, block_begin, block_end, scratch);
#endif
      break;  // unreachable: set_path refuses the emulated path in builds without it
  }
}

WeightFormat weight_format(const at::Tensor& packed) {
  switch (packed.scalar_type()) {
    case at::kBFloat16: return WeightFormat::bf16;
    case at::kChar: return WeightFormat::int8;
    case at::kFloat8_e4m3fn: return WeightFormat::fp8;
    case at::kByte: return WeightFormat::int4;
    default:
      TORCH_CHECK(false, "tilefx: packed weights are bf16, int8, float8_e4m3fn or uint8 (int4), got ",
                  packed.scalar_type());
  }
}

void attach_weight(LinearProblem& p, const at::Tensor& packed, const c10::optional<at::Tensor>& scales) {
  p.format = weight_format(packed);
  if (p.format == WeightFormat::bf16) {
    TORCH_CHECK(!scales, "tilefx: a bf16 weight takes no scales");
    p.w = bf16_bits(packed);
    return;
  }
  // [..., blocks, pairs, 32 (int4: 16), 2] -> scales: scales_per_block values per block
  const bool int4 = p.format == WeightFormat::int4;
  const int64_t pairs = packed_pairs(packed);
  const int64_t per_block = scales_per_block(p.format, pairs);
  const int64_t blocks = packed.numel() / (pairs * pair_bytes(p.format));
  const at::ScalarType scale_type = int4 ? at::kHalf : at::kFloat;
  TORCH_CHECK(scales && scales->scalar_type() == scale_type && scales->is_contiguous() &&
                  scales->numel() == blocks * per_block,
              "tilefx: a ", packed.scalar_type(), " weight ", packed.sizes(), " needs contiguous ", scale_type,
              " scales, ", per_block, " per packed block (weights.packed_scales)");
  TORCH_CHECK(!int4 || pairs % 2 == 0, "tilefx: an int4 weight's inputs come in fours (two K pairs a load), got ",
              2 * pairs);
  p.wq = static_cast<const uint8_t*>(packed.data_ptr());
  p.k_groups = p.format == WeightFormat::int8 ? 0 : groups_per_block(p.format, pairs);
  if (int4) {
    p.int4_params = reinterpret_cast<const uint16_t*>(scales->data_ptr<at::Half>());
  } else {
    p.scales = scales->data_ptr<float>();
  }
}

namespace {

void check_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "tilefx linear: x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK(is_packing(packed, 0) && packed.is_contiguous(),
              "tilefx linear: weight must be packed by pack_linear_weight ([N/", kBlockN, ", K/2, ", kBlockN,
              ", 2]), got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(pairs_of(x.size(-1)) == packed_pairs(packed),
              "tilefx linear: x has ", x.size(-1), " features, the packed weight ", 2 * packed_pairs(packed));
  TORCH_CHECK(blocks_of(out_features) == packed_blocks(packed),
              "tilefx linear: out_features ", out_features, " does not match the packed weight");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->size(0) == out_features &&
                    bias->is_contiguous(),
                "tilefx linear: bias must be contiguous bf16 [", out_features, "]");
  }
}

// Rows of x a brgemm prefill multiplies at a time (linear_native).
constexpr int64_t kBrgemmSlabRows = 1024;

// Decode split along K (tuning.h decode_split): K pairs per slice for a problem over `pairs`
// block pairs, 0 where it does not split. Slices start on fp8's scale groups.
int64_t split_slice_pairs(const LinearProblem& p, int64_t pairs, bool brgemm) {
  const int64_t per_thread = decode_split(p.format);
  if (per_thread == 0 || brgemm || p.M > 2 || p.format == WeightFormat::int4) return 0;
  const int64_t wanted = per_thread * at::get_num_threads();
  const int64_t most = p.K_pairs / (kSplitBytes / pair_bytes(p.format));
  if (pairs >= wanted || most < 2) return 0;
  const int64_t slices = std::min(most, (wanted + pairs - 1) / pairs);
  const int64_t len = ((p.K_pairs + slices - 1) / slices + kFp8GroupPairs - 1) / kFp8GroupPairs * kFp8GroupPairs;
  return len < p.K_pairs ? len : 0;
}

// `p` over its K pairs [k0, k1) as a plain linear over the packed blocks (every block its kBlockN
// columns of `width`), writing fp32 sums to `sums` ([p.M, width]): no bias, no SiLU-and-mul.
LinearProblem k_slice(const LinearProblem& p, int64_t k0, int64_t k1, float* sums, int64_t width) {
  LinearProblem q = p;
  q.block_pairs = p.K_pairs;
  q.K_pairs = k1 - k0;
  if (p.format == WeightFormat::bf16) {
    q.w = p.w + k0 * kPairValues;
  } else {
    q.wq = p.wq + k0 * kQPairBytes;
    if (p.format == WeightFormat::fp8) q.scales = p.scales + k0 / kFp8GroupPairs;  // k0 starts a group
  }
  switch (p.x_form) {
    case ActivationForm::fp32: q.x = p.x_fp32() + 2 * k0; break;
    case ActivationForm::bf16_pairs: q.x = p.x_pairs() + k0; break;
    case ActivationForm::int16_words: q.x = p.x_words() + k0; break;
    default: TORCH_CHECK(false, "tilefx linear: a K slice of x in form ", static_cast<int>(p.x_form));
  }
  q.bias = nullptr;
  q.y = nullptr;
  q.yf = sums;
  q.ldy = q.N = width;
  q.silu_mul = false;
  return q;
}

// The decode of `p` (1 or 2 rows over `blocks` packed blocks) in tasks of one block pair (blocks 2u,
// 2u + 1: gate and up of output block u with SiLU-and-mul) and one K slice of `slice_pairs`. Each task
// writes its slice's fp32 sums; the one that completes a pair adds its slices in slice order, so the
// result does not depend on which thread ran what, and stores them through the unit's epilogue.
void linear_split_k(LinearUnit unit, const LinearProblem& p, int64_t blocks, int64_t slice_pairs) {
  const int64_t slices = (p.K_pairs + slice_pairs - 1) / slice_pairs, pairs = (blocks + 1) / 2;
  const int64_t width = blocks * kBlockN, rows = p.M;
  thread_local AlignedVector<float> all_sums;  // [slices][rows][width], the calling thread's
  if (all_sums.size() < static_cast<size_t>(slices * rows * width)) all_sums.resize(slices * rows * width);
  float* sums = all_sums.data();
  std::unique_ptr<std::atomic<int64_t>[]> done(new std::atomic<int64_t>[pairs]);
  for (int64_t u = 0; u < pairs; ++u) done[u].store(0, std::memory_order_relaxed);
  const UnitEpilogue& epilogue = epilogue_of(unit);
  auto store_pair = [&](int64_t u) {
    alignas(64) float tile[2][2 * kBlockN];  // per block of the pair, rows of kBlockN
    const int64_t first = 2 * u, count = std::min<int64_t>(2, blocks - first);
    for (int64_t i = 0; i < count; ++i) {
      for (int64_t m = 0; m < rows; ++m) {
        float* out = tile[i] + m * kBlockN;
        const float* part = sums + m * width + (first + i) * kBlockN;
        std::copy(part, part + kBlockN, out);
        for (int64_t s = 1; s < slices; ++s)
          for (int64_t j = 0; j < kBlockN; ++j) out[j] += part[s * rows * width + j];
      }
    }
    if (p.silu_mul) return epilogue.store_silu_mul(p, u * kBlockN, tile[0], tile[1]);
    for (int64_t i = 0; i < count; ++i) epilogue.store(p, (first + i) * kBlockN, tile[i]);
  };
  parallel_chunks(pairs * slices, /*min_chunk=*/1, [&](int64_t begin, int64_t end) {
    alignas(64) float scratch[4 * 2 * kBlockN];  // linear_scratch_floats of a decode of 2 rows (M <= 2)
    for (int64_t t = begin; t < end; ++t) {
      const int64_t u = t / slices, s = t % slices;
      const int64_t k0 = s * slice_pairs, k1 = std::min(p.K_pairs, k0 + slice_pairs);
      const LinearProblem q = k_slice(p, k0, k1, sums + s * rows * width, width);
      linear_blocks(unit, q, 2 * u, std::min(blocks, 2 * u + 2), scratch);
      if (done[u].fetch_add(1, std::memory_order_acq_rel) == slices - 1) store_pair(u);
    }
  });
}

// Arguments checked by linear_cpu / linear_silu_mul_cpu. Per-call fixed cost matters
// here (decode makes about a hundred short calls): no ATen temporaries but the result.
// Prefill runs the unit's GEMM or oneDNN's brgemm, decode the unit's GEMV walk or brgemm, as
// tuning chose (prefill_on_brgemm, decode_on_brgemm).
at::Tensor linear_native(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t out_features, bool silu_mul, bool float_out, const KernelUnits& kernel_units,
                         const c10::optional<at::Tensor>& scales) {
  const LinearUnit unit = kernel_units.linear;
  const int64_t in_features = x.size(-1);
  const int64_t k_pairs = packed_pairs(packed), ldx = 2 * k_pairs;
  // No dispatcher round trips before the weight stream starts: with the caches cold after
  // the previous weight's stream, reshape and at::empty each cost microseconds, a share of a
  // small GEMV (docs/PERFORMANCE.md).
  const at::Tensor x2 = x.is_contiguous() ? x : x.contiguous();
  const int64_t rows = in_features == 0 ? 0 : x2.numel() / in_features;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  at::Tensor y = at::detail::empty_cpu(out_shape, float_out ? at::kFloat : at::kBFloat16, /*pin_memory=*/false,
                                       c10::nullopt);
  if (rows == 0) return y;

  LinearProblem p{/*x=*/nullptr, /*w=*/nullptr, bias ? bf16_bits(*bias) : nullptr,
                  float_out ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), rows, out_features,
                  k_pairs, ldx, /*yf=*/float_out ? y.data_ptr<float>() : nullptr, /*ldy=*/out_features, silu_mul};
  attach_weight(p, packed, scales);
  apply_tuning(p, walk_tuning(unit, p.format));
  const bool brgemm = prefill_on_brgemm(kernel_units, p.format, rows) || decode_on_brgemm(p.format, rows);
  const Activations activations(gemm_reader(unit, brgemm), gemm_x_format(p.format, brgemm), bf16_bits(x2), rows,
                                in_features, in_features, ldx);
  activations.attach(p, 0);
  const int64_t blocks = packed_blocks(packed);
  if (const int64_t slice_pairs = split_slice_pairs(p, (blocks + 1) / 2, brgemm)) {
    linear_split_k(unit, p, blocks, slice_pairs);
    return y;
  }
  const int64_t units = silu_mul ? blocks / 2 : blocks;
  const size_t scratch_floats =
      brgemm ? brgemm_scratch_floats(p) : linear_scratch_floats(p);
  // On brgemm a prompt of more than kBrgemmSlabRows rows runs in slabs of that many, every block over one slab
  // before the next: each group of blocks reads x whole (linear_brgemm.cpp), and 4096 rows of x at K 2048 (16 MiB)
  // left the L3 between groups while a wide weight and its output streamed past: DeepSeek-V2-Lite's dense gate/up
  // (2 x 10944 x 2048) ran at 423 GFLOP/s over 4096 rows and 438-448 in four calls of 1024 on Zen 4. Each slab
  // reads the weight again, at 1024 rows a tenth of a byte a FLOP.
  const int64_t slab = brgemm && rows > 2 * kBrgemmSlabRows ? kBrgemmSlabRows : rows;
  for (int64_t m0 = 0; m0 < rows; m0 += slab) {
    LinearProblem part = p;
    if (slab < rows) {  // (brgemm: x is bf16 pairs)
      part.M = std::min(slab, rows - m0);
      part.x = p.x_pairs() + m0 * (ldx / 2);
      if (p.y) part.y = p.y + m0 * p.ldy;
      if (p.yf) part.yf = p.yf + m0 * p.ldy;
    }
    parallel_chunks(units, /*min_chunk=*/2, [&](int64_t begin, int64_t end) {
      thread_local AlignedVector<float> scratch;
      if (scratch.size() < scratch_floats) scratch.resize(scratch_floats);
      if (brgemm) {
        linear_blocks_brgemm(unit, part, begin, end, scratch.data());
      } else {
        linear_blocks(unit, part, begin, end, scratch.data());
      }
    });
  }
  return y;
}

// One linear per head: y[..., h, s, :] = x[..., h, s, :] @ W_h^T, with W packed per
// head ([H, N/32, K/2, 32, 2], the expert layout). MLA's absorbed projections: the
// query through each head's key half of kv_b_proj, the attended latent through its
// value half. Work units are (row group, head, column block), in contiguous ranges.
at::Tensor linear_per_head_native(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                                  LinearUnit isa) {
  const int64_t heads = packed.size(0), blocks = packed_blocks(packed), k_pairs = packed_pairs(packed), ldx = 2 * k_pairs;
  const int64_t seq = x.size(-2), in_features = x.size(-1);
  const at::Tensor x4 = x.reshape({-1, heads, seq, in_features});
  const int64_t groups = x4.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  at::Tensor y = at::empty(out_shape, x.options());
  if (x4.numel() == 0) return y;

  // Activations [groups, H, S, ldx], K padded to even, in the unit's base form (bf16 weights).
  const uint16_t* x_bits = bf16_bits(x4);
  const Activations xa(isa, WeightFormat::bf16, groups * heads * seq, in_features, ldx, /*plan=*/nullptr,
                       [&](int64_t row) {
                         const int64_t s = row % seq, h = (row / seq) % heads, g = row / (seq * heads);
                         return x_bits + g * x4.stride(0) + h * x4.stride(1) + s * x4.stride(2);
                       });
  uint16_t* y_bits = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const uint16_t* w_bits = bf16_bits(packed);
  const int64_t head_weight = blocks * block_values(k_pairs);
  const size_t scratch_floats = 2 * std::max<int64_t>(seq, 2) * kBlockN;
  const WalkTuning walk = walk_tuning(isa, WeightFormat::bf16);
  at::parallel_for(0, groups * heads * blocks, 1, [&](int64_t begin, int64_t end) {
    thread_local AlignedVector<float> scratch;
    if (scratch.size() < scratch_floats) scratch.resize(scratch_floats);
    for (int64_t unit = begin; unit < end;) {  // one call per (group, head) run of blocks
      const int64_t matrix = unit / blocks, first = unit % blocks;
      const int64_t last = std::min(blocks, first + (end - unit));
      const int64_t h = matrix % heads;
      LinearProblem p{/*x=*/nullptr, w_bits + h * head_weight, nullptr, y_bits + matrix * seq * out_features, seq,
                      out_features, k_pairs, ldx, /*yf=*/nullptr, /*ldy=*/out_features, /*silu_mul=*/false};
      apply_tuning(p, walk);
      xa.attach(p, matrix * seq);
      linear_blocks(isa, p, first, last, scratch.data());
      unit += last - first;
    }
  });
  return y;
}

// tilefx::linear (bf16 result) and tilefx::linear_float (fp32 result: routers that HF
// computes in fp32 from bf16 weights and activations, such as DeepSeek's, get the same
// values without an fp32 weight copy).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t out_features, bool float_out, const c10::optional<at::Tensor>& scales) {
  const KernelUnits units = current_units();
  if (x.scalar_type() == at::kBFloat16 && units.native) {
    check_packed(x, packed, bias, out_features);
    return linear_native(x, packed, bias, out_features, /*silu_mul=*/false, float_out, units, scales);
  }
  using Portable = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t,
                              const c10::optional<at::Tensor>&);
  static const auto bf16_out =
      c10::Dispatcher::singleton().findSchemaOrThrow("tilefx::linear_portable", "").typed<Portable>();
  static const auto fp32_out =
      c10::Dispatcher::singleton().findSchemaOrThrow("tilefx::linear_float_portable", "").typed<Portable>();
  return (float_out ? fp32_out : bf16_out).call(x, packed, bias, out_features, scales);
}

}  // namespace

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t out_features, const c10::optional<at::Tensor>& scales) {
  return packed_linear(x, packed, bias, out_features, /*float_out=*/false, scales);
}

at::Tensor linear_float_cpu(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t out_features, const c10::optional<at::Tensor>& scales) {
  return packed_linear(x, packed, bias, out_features, /*float_out=*/true, scales);
}

at::Tensor linear_silu_mul_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                               const c10::optional<at::Tensor>& scales) {
  const KernelUnits units = current_units();
  if (x.scalar_type() == at::kBFloat16 && units.native) {
    const int64_t blocks = gate_up_blocks(out_features);
    TORCH_CHECK(is_packing(packed, 0) && packed_blocks(packed) == blocks,
                "tilefx linear_silu_mul: weight must be packed by pack_gate_up_weight (", blocks,
                " blocks for ", out_features, " features), got ", packed.sizes());
    check_packed(x, packed, c10::nullopt, blocks * kBlockN);
    return linear_native(x, packed, c10::nullopt, out_features, /*silu_mul=*/true, /*float_out=*/false, units,
                         scales);
  }
  static const auto portable = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("tilefx::linear_silu_mul_portable", "")
                                   .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                                     const c10::optional<at::Tensor>&)>();
  return portable.call(x, packed, out_features, scales);
}

at::Tensor linear_per_head_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  const KernelUnits units = current_units();
  if (x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && units.native) {
    TORCH_CHECK(is_packing(packed, 1) && packed.is_contiguous(),
                "tilefx linear_per_head: weight must be packed per head ([H, N/", kBlockN, ", K/2, ", kBlockN,
                ", 2]), got ", packed.sizes());
    TORCH_CHECK(x.dim() >= 3 && x.size(-3) == packed.size(0) && x.stride(-1) == 1,
                "tilefx linear_per_head: x must be [..., ", packed.size(0), " heads, S, K] with contiguous rows, got ",
                x.sizes());
    TORCH_CHECK(pairs_of(x.size(-1)) == packed_pairs(packed) && blocks_of(out_features) == packed_blocks(packed),
                "tilefx linear_per_head: x ", x.sizes(), " -> ", out_features, " features does not fit the packed ",
                packed.sizes());
    return linear_per_head_native(x, packed, out_features, units.per_head);
  }
  static const auto portable = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("tilefx::linear_per_head_portable", "")
                                   .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  return portable.call(x, packed, out_features);
}

}  // namespace tilefx
