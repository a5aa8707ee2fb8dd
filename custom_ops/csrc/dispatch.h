// The kernel path the native ops take, and the one table of what each op family runs
// on it. custom_ops/isa.py sets the path; the dispatcher calls the ops' CPU kernels
// directly, with no Python in between (decode makes over a hundred calls), and
// each kernel reads the path's units once per call.
#pragma once
#include <cstdint>
#include <string>

#include "kernels.h"  // kGemvRows

namespace tilefx {

// avx512_bf16_emulated runs the AVX512-BF16 unit on SIMDe (tests only; see kernels.h).
enum class Path : int { reference = 0, avx2 = 1, amx = 2, avx512_bf16 = 3, avx512_bf16_emulated = 4 };

#ifdef TILEFX_AVX512_EMULATION
constexpr bool kAvx512Emulation = true;
#else
constexpr bool kAvx512Emulation = false;
#endif

// The path named "reference", "avx2", "amx", "avx512_bf16" or "avx512_bf16_emulated";
// refuses anything else.
Path parse_path(const std::string& name);
// Takes a path parse_path names; avx512_bf16_emulated only in builds with SIMDe.
void set_path(const std::string& path);
Path path();

// Whether this CPU runs the given kernel ISA: "avx2", "avx512_bf16", "avx512_vnni" or "amx" (oneDNN's AMX
// kernels); "amx_tiles": tilefx's own AMX kernel (AMX, and Linux granted this process the tile state).
bool cpu_has(const std::string& feature);

// The unit that computes a linear's column blocks (linear_blocks, ops.h). It reads
// the activations as fp32 (avx2) or bf16 pairs (the AVX512-BF16 units).
enum class LinearUnit { avx2, avx512, avx512_emulated };

// The unit that runs one attention task (kernels.h).
enum class AttentionUnit { avx2, avx512, avx512_emulated };

// What each op family runs on one path. Each op's CPU kernel first checks that its
// native kernel takes the arguments (for most, that they are bf16) and otherwise calls
// its *_portable reference, on any path. The routers (topk_softmax, grouped_topk) are
// the same ATen calls on every native path.
struct KernelUnits {
  bool native;              // false: every op calls its *_portable reference (PyTorch)
  bool brgemm_prefill;      // the linear ops above kGemvRows rows on oneDNN's brgemm (AMX tiles; linear_brgemm.cpp)
                            // unless tuning chose otherwise (tuning.h prefill_on_brgemm)
  LinearUnit linear;        // linear_float, and linear / linear_silu_mul where brgemm is not used
  LinearUnit per_head;      // linear_per_head
  LinearUnit moe;           // fused_moe's expert GEMMs
  AttentionUnit attention;  // decode_attention, extend_attention, mla_attention
};

KernelUnits units_for(Path path);
// The name of a unit, as custom_ops.isa.kernel_units reports it.
const char* unit_name(LinearUnit unit);
const char* unit_name(AttentionUnit unit);
// Read once per op call, so one call never mixes two paths' units.
KernelUnits current_units();

}  // namespace tilefx
