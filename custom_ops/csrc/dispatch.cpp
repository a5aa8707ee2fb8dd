// The kernel path and its table of units (dispatch.h).
#include "dispatch.h"

#include <c10/util/Exception.h>

#include <atomic>

#include "ops.h"

namespace tilefx {
namespace {

std::atomic<int> current_path{static_cast<int>(Path::reference)};

}  // namespace

Path parse_path(const std::string& name) {
  if (name == "reference") return Path::reference;
  if (name == "avx2") return Path::avx2;
  if (name == "amx") return Path::amx;
  if (name == "avx512_bf16") return Path::avx512_bf16;
  if (name == "avx512_bf16_emulated") return Path::avx512_bf16_emulated;
  TORCH_CHECK(false, "tilefx: unknown kernel path '", name, "'");
}

void set_path(const std::string& name) {
  const Path parsed = parse_path(name);
  TORCH_CHECK(parsed != Path::avx512_bf16_emulated || kAvx512Emulation, "tilefx: no native kernels for path '", name,
              "' (this build has no SIMDe)");
  current_path = static_cast<int>(parsed);
}

Path path() { return static_cast<Path>(current_path.load(std::memory_order_relaxed)); }

bool cpu_has(const std::string& feature) {
  __builtin_cpu_init();
  if (feature == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                                      __builtin_cpu_supports("f16c");
  if (feature == "avx512_bf16") {
    // with VBMI (its byte tables decode fp8), VNNI (int8 and int4 decode) and GFNI (int4's high nibbles):
    // Zen 4+, Sapphire Rapids+
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("gfni") && __builtin_cpu_supports("f16c");
  }
  if (feature == "avx512_vnni") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni");
  if (feature == "amx") return amx_available();
  if (feature == "amx_tiles") return amx_tiles_usable();
  TORCH_CHECK(false, "unknown CPU feature '", feature, "'");
}

// One row per path: what each family runs where its native kernel takes the arguments.
KernelUnits units_for(Path path) {
  constexpr LinearUnit avx2 = LinearUnit::avx2, avx512 = LinearUnit::avx512;
  constexpr LinearUnit emulated = LinearUnit::avx512_emulated;
  constexpr AttentionUnit attention_avx2 = AttentionUnit::avx2, attention_avx512 = AttentionUnit::avx512;
  constexpr AttentionUnit attention_emulated = AttentionUnit::avx512_emulated;
  switch (path) {
    //                                       native brgemm      linear    per_head  moe       attention
    // PyTorch references only; the units are never read.
    case Path::reference:            return {false, false,      avx2,     avx2,     avx2,     attention_avx2};
    // Every family on its AVX2 unit (linear_avx2.cpp, attention_avx2.cpp).
    case Path::avx2:                 return {true,  false,      avx2,     avx2,     avx2,     attention_avx2};
    // brgemm (AMX tiles) for prefill-sized linears and experts; every AMX CPU also has
    // AVX512-BF16, which runs the decode GEMVs, the per-head linear, attention and the epilogues.
    case Path::amx:                  return {true,  true,       avx512,   avx512,   avx512,   attention_avx512};
    // Every family on vdpbf16ps (linear_avx512.cpp, attention_avx512.cpp).
    case Path::avx512_bf16:          return {true,  false,      avx512,   avx512,   avx512,   attention_avx512};
    // The AVX512-BF16 units on SIMDe: set_path refuses this path in builds without it.
    case Path::avx512_bf16_emulated: return {true,  false,      emulated, emulated, emulated, attention_emulated};
  }
  TORCH_CHECK(false, "tilefx: unknown kernel path ", static_cast<int>(path));
}

KernelUnits current_units() { return units_for(path()); }

const char* unit_name(LinearUnit unit) {
  switch (unit) {
    case LinearUnit::avx2: return "avx2";
    case LinearUnit::avx512: return "avx512_bf16";
    case LinearUnit::avx512_emulated: return "avx512_bf16_emulated";
  }
  return "unknown";
}

const char* unit_name(AttentionUnit unit) {
  switch (unit) {
    case AttentionUnit::avx2: return "avx2";
    case AttentionUnit::avx512: return "avx512_bf16";
    case AttentionUnit::avx512_emulated: return "avx512_bf16_emulated";
  }
  return "unknown";
}

}  // namespace tilefx
