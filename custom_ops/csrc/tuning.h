// How the decode walks stream a weight on this machine: streams per thread, software prefetch
// distance and hint, per (unit, weight format). The same walk streamed near the bandwidth
// on AMD Zen and far below it on an Intel Xeon 6 (docs/PERFORMANCE.md), so these are
// not constants: custom_ops/tuning.py times the candidates on the machine that runs (once,
// cached by CPU) and sets the winners here. Every op call reads them once (walk_tuning).
#pragma once
#include <cstdint>
#include <string>
#include <tuple>

#include "dispatch.h"
#include "kernels.h"

namespace tilefx {

struct WalkTuning {
  int64_t streams;         // M = 1: streams a thread reads a weight in (1 up to walk_streams, kernels.h)
  int64_t prefetch_bytes;  // software prefetch distance of each stream (0: none)
  PrefetchHint prefetch_hint;
};

WalkTuning walk_tuning(LinearUnit unit, WeightFormat format);
// `unit` and `format` by the names isa.kernel_units and weights.FORMATS use; refuses others and
// values outside what the kernels take (streams 1 up to the unit's walk_streams; prefetch 0..65536 bytes, a
// multiple of 64; hint "nta", "t0" or "t1").
void set_walk_tuning(const std::string& unit, const std::string& format, int64_t streams, int64_t prefetch_bytes,
                     const std::string& prefetch_hint);
std::tuple<int64_t, int64_t, std::string> get_walk_tuning(const std::string& unit, const std::string& format);
// How many streams a unit's M = 1 GEMV reads a format in (walk_streams, kernels.h): what the tuning may set.
int64_t get_walk_streams(const std::string& unit, const std::string& format);

// Prefill attention: from how many new tokens on an attention op runs another kernel than the
// path's attention unit (one query row at a time): PyTorch's own scaled_dot_product_attention
// (its flash kernel, GEMMs through oneDNN) or tilefx's flash attention over oneDNN brgemm tiles
// (attention_brgemm.cpp: AMX where the CPU has it). Which is fastest depends on the CPU and the
// head shapes (the unit led on AMD Zen for Llama's heads, PyTorch's on an Intel Xeon 6, see
// docs/PERFORMANCE.md), so custom_ops/tuning.py times them per model at load and sets this; the
// default keeps the unit at every length. Decode has its own choice (below).
enum class AttentionFamily : int { extend = 0, mla = 1 };
enum class PrefillAttention : int { unit = 0, sdpa = 1, brgemm = 2 };
// The kernel an op of `family` runs for `seq` new tokens.
PrefillAttention prefill_attention(AttentionFamily family, int64_t seq);
// `family` "extend" or "mla"; `kernel` "unit", "sdpa" or "brgemm"; `from_tokens` at least 2 for
// sdpa / brgemm (the unit below it), ignored for the unit.
void set_prefill_attention(const std::string& family, const std::string& kernel, int64_t from_tokens);
// (kernel, from_tokens); ("unit", 0) when the unit runs every length.
std::tuple<std::string, int64_t> get_prefill_attention(const std::string& family);

// The flash attention on brgemm tiles' blocking (attention_brgemm.cpp), per family: the query rows a
// task takes and the keys each step of the online softmax multiplies (a multiple of the packing's
// kAttentionKeyBlock). Larger blocks share each brgemm call's fixed cost (a change of kernel, twice a
// step, which on AMX loads a new tile configuration) and the softmax's per-row work among more scores,
// at the price of more masked work on the causal diagonal and a larger working set (SGLang's CPU
// kernel grows its blocks with the prompt). custom_ops/tuning.py times the candidates per model at
// load with the prefill kernels; (64, 128) by default.
struct AttentionTiling {
  int64_t query_rows, key_step;
};
AttentionTiling attention_tiling(AttentionFamily family);
// `family` "extend" or "mla"; `query_rows` 16 to 1024, `key_step` a multiple of 128 up to 2048.
void set_attention_tiling(const std::string& family, int64_t query_rows, int64_t key_step);
std::tuple<int64_t, int64_t> get_attention_tiling(const std::string& family);

// Decode attention (a few new tokens: at most kDecodeAttentionRows query rows per KV head, and
// below the prefill choice's from_tokens): the path's attention unit (fp32 FMAs, one query row at a
// time) or flash decoding over oneDNN brgemm tiles (attention_brgemm.cpp: AMX where the CPU has
// it), per family; the unit by default. custom_ops/tuning.py times both per model at load.
enum class DecodeAttention : int { unit = 0, brgemm = 1 };
DecodeAttention decode_attention(AttentionFamily family, int64_t rows);
// `family` "extend" or "mla"; `kernel` "unit" or "brgemm".
void set_decode_attention(const std::string& family, const std::string& kernel);
std::string get_decode_attention(const std::string& family);

// MLA prefill's expanded form (attention_ops.cpp) holds at most this many bytes of expanded and
// packed keys and values at once (256 MiB by default): it runs over chunks of heads that fit,
// and takes the absorbed form where one head does not (0: always absorbed).
int64_t mla_expand_budget();
void set_mla_expand_budget(int64_t bytes);

// Prefill linears (more than kGemvRows rows): the unit's GEMM or oneDNN's brgemm
// (linear_brgemm.cpp), per weight format. By default the path's row of the dispatch table
// decides (brgemm on amx); custom_ops/tuning.py times both where brgemm has a JIT kernel
// (AVX512-BF16 or AMX) and sets the faster.
enum class PrefillGemm : int { path_default = 0, unit = 1, brgemm = 2 };
bool prefill_on_brgemm(const KernelUnits& units, WeightFormat format, int64_t rows);
// `format` bf16 / int8 / fp8 / int4; `choice` "default", "unit" or "brgemm".
void set_prefill_gemm(const std::string& format, const std::string& choice);
std::string get_prefill_gemm(const std::string& format);

// The linear ops' blocking on brgemm (linear_brgemm.cpp): the rows of x one brgemm call multiplies by
// a block (at most kMaxGemmRows) and the K pairs of the block it takes at once, each later chunk adding
// to the first's result. More rows share each of the block's loads among more of x's (what AMX's tiles
// need, with their small register file); fewer pairs keep both operands' parts in L2. Which is best
// depends on the CPU's GEMM rate against its caches, so custom_ops/tuning.py times the candidates where
// brgemm runs prefill; (64, 1024) on oneDNN's brgemm by default. `tiles`: tilefx's own AMX kernel
// (linear_amx.cpp) instead of brgemm's calls, where the CPU has AMX and tuning found it faster: it takes a panel
// of `rows` rows at once and the same chunks, fetching the next chunk's weights while it multiplies. One
// tiling for every weight format (a quantized block is dequantized whole before either).
struct GemmTiling {
  int64_t rows, pairs;
  bool tiles;
};
constexpr int64_t kMaxGemmRows = 256;
GemmTiling gemm_tiling();
// `rows` 16 to kMaxGemmRows, a multiple of 16; `pairs` 64 to 8192, a multiple of 64; `kernel` "brgemm" or
// "tiles" (a CPU with AMX only).
void set_gemm_tiling(int64_t rows, int64_t pairs, const std::string& kernel);
std::tuple<int64_t, int64_t, std::string> get_gemm_tiling();
// The K chunk of a call whose rows span several panels (linear_brgemm.cpp: a long prompt), in place of the
// tiling's; 0: the tiling's. Such a call multiplies each chunk of weights again for every panel, so after the
// first panel the weights come from cache, and a smaller chunk keeps the block's part in L1 across the panel's
// row tiles (on the tile kernel, panels of the most rows scratch holds, whatever the tiling's); one panel (a
// short prompt) reads each weight from memory once, where a longer chunk gives the next chunk's fetch longer
// to land. Timed by custom_ops/tuning.py with the tiling. 64 to 8192 pairs, a multiple of 64, or 0.
int64_t gemm_long_pairs();
void set_gemm_long_pairs(int64_t pairs);

// Decode linears (1 to kGemvRows rows): the unit's GEMV walk or oneDNN's brgemm over the same
// packed blocks, per weight format: brgemm from a row count on (its AMX tiles make 4 rows cost
// what 1 does, where the unit's GEMV does 4 times the work per byte), the unit below it; the unit
// at every count by default. custom_ops/tuning.py times both at 1, 2 and 4 rows for bf16 where
// brgemm has a JIT kernel (on a Xeon with AMX oneDNN's GEMV out-read the unit's walk on 2 threads,
// docs/PERFORMANCE.md). The linear ops only: fused_moe's expert GEMVs stay on the unit.
bool decode_on_brgemm(WeightFormat format, int64_t rows);
// `format` bf16 / int8 / fp8 / int4; `choice` "unit" (from_rows ignored) or "brgemm" from
// `from_rows` (1 to kGemvRows) rows on.
void set_decode_gemm(const std::string& format, const std::string& choice, int64_t from_rows);
// (choice, from_rows); ("unit", 0) when the unit runs every row count.
std::tuple<std::string, int64_t> get_decode_gemm(const std::string& format);

// Decode linears over few column blocks for the threads: a decode linear's tasks are pairs of column
// blocks, and one with fewer than `tasks_per_thread` of them a thread (Llama-1B's o_proj and down_proj
// have 32: on 32 threads one each, on 64 half the threads idle) splits each block's K into slices, so
// that it has that many, each at least kSplitBytes of every block (a shorter stream costs: on Zen 4 at
// 67 GB/s, 16 KiB int8 slices read 7-9% slower, docs/PERFORMANCE.md); the slices' fp32 sums are added
// in a fixed order (the same result on every thread count) and the last task of a block pair stores
// them. Whether that beats the threads' wait for the slowest of few long tasks depends on the CPU, so
// custom_ops/tuning.py times it per weight format where it would split; off (0) by default. bf16, int8
// and fp8 at 1 or 2 rows, on the unit's walk (linear_ops.cpp).
constexpr int64_t kSplitBytes = 32 << 10;
int64_t decode_split(WeightFormat format);
// `format` bf16 / int8 / fp8 (int4: 0 only); `tasks_per_thread` 0 (never split) to 64.
void set_decode_split(const std::string& format, int64_t tasks_per_thread);
int64_t get_decode_split(const std::string& format);

// An op reads the walk once per call (walk_tuning) and sets it on each of its problems.
inline void apply_tuning(LinearProblem& p, const WalkTuning& walk) {
  p.streams = walk.streams;
  p.prefetch_bytes = walk.prefetch_bytes;
  p.prefetch_hint = walk.prefetch_hint;
}

}  // namespace tilefx
