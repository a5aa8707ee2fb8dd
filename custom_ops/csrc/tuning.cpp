// The walk tuning table (tuning.h).
#include "tuning.h"

#include <c10/util/Exception.h>

#include "ops.h"

#include <atomic>

namespace tilefx {
namespace {

constexpr int kUnits = 3, kFormats = kWeightFormats;

// The defaults, before (or without) tuning, and what a tuning keeps where no walk beats them by
// MIN_GAIN: a machine whose memory is slow that minute (a shared host) times most walks alike.
// Measured on Zen 4 (docs/PERFORMANCE.md, the fortieth session), the AVX512 units:
// - int8, fp8, int4 (one cache line per K pair): two blocks at once with no software prefetch reads
//   12-20% faster than prefetching 4 KiB ahead at full memory speed, and level when memory is slow;
// - bf16 (two lines per K pair): 1 KiB ahead reads 5% faster than no prefetch when memory is slow and
//   2-7% slower at full speed; it stays 1 KiB ahead.
// On the thirtieth session's Xeon, prefetching 2-4 KiB ahead into the caches (t0, t1) read ~2x the
// defaults of then: a gain the tuning finds in any minute.
// The AVX2 unit (Zen 2/3) prefetches 1 KiB ahead; its int8 and fp8 GEMVs read a block's two halves of K as
// their two streams (two blocks' sums would spill its 16 registers), 10-18% faster than one stream on Zen 3
// (the forty-third session); int4 reads one block at a time (walk_streams, kernels.h).
constexpr WalkTuning default_tuning(int unit, int format) {
  if (format == static_cast<int>(WeightFormat::bf16)) return {2, 1024, PrefetchHint::nta};
  if (unit == static_cast<int>(LinearUnit::avx2)) {
    return {walk_streams(/*avx2_unit=*/true, static_cast<WeightFormat>(format)), 1024, PrefetchHint::nta};
  }
  return {2, 0, PrefetchHint::nta};
}

struct Slot {
  std::atomic<int64_t> streams, prefetch_bytes;
  std::atomic<PrefetchHint> prefetch_hint;
};

constexpr const char* kHintNames[] = {"nta", "t0", "t1"};  // PrefetchHint's order

Slot* table() {
  static Slot slots[kUnits][kFormats] = {};
  static const bool filled = [] {
    for (int u = 0; u < kUnits; ++u) {
      for (int f = 0; f < kFormats; ++f) {
        const WalkTuning t = default_tuning(u, f);
        slots[u][f].streams = t.streams;
        slots[u][f].prefetch_bytes = t.prefetch_bytes;
        slots[u][f].prefetch_hint = t.prefetch_hint;
      }
    }
    return true;
  }();
  (void)filled;
  return &slots[0][0];
}

LinearUnit parse_unit(const std::string& name) {
  if (name == "avx2") return LinearUnit::avx2;
  if (name == "avx512_bf16") return LinearUnit::avx512;
  if (name == "avx512_bf16_emulated") return LinearUnit::avx512_emulated;
  TORCH_CHECK(false, "tilefx tuning: unknown linear unit '", name, "' (avx2, avx512_bf16, avx512_bf16_emulated)");
}

WeightFormat parse_format(const std::string& name) {
  if (name == "bf16") return WeightFormat::bf16;
  if (name == "int8") return WeightFormat::int8;
  if (name == "fp8") return WeightFormat::fp8;
  if (name == "int4") return WeightFormat::int4;
  TORCH_CHECK(false, "tilefx tuning: unknown weight format '", name, "' (bf16, int8, fp8, int4)");
}

Slot& slot(LinearUnit unit, WeightFormat format) {
  return table()[static_cast<int>(unit) * kFormats + static_cast<int>(format)];
}

// Per AttentionFamily: (from_tokens << 2) | PrefillAttention, one word so a reader never sees half a choice.
std::atomic<int64_t> prefill_attention_choice[2] = {0, 0};
constexpr const char* kAttentionKernels[] = {"unit", "sdpa", "brgemm"};
std::atomic<int> decode_attention_choice[2] = {0, 0};  // DecodeAttention, per AttentionFamily
// Per AttentionFamily: (query_rows << 32) | key_step, one word so a reader never sees half a tiling.
constexpr int64_t kDefaultTiling = int64_t{64} << 32 | 128;
std::atomic<int64_t> attention_tiling_choice[2] = {kDefaultTiling, kDefaultTiling};
// (rows << 32) | pairs | tiles, one word so a reader never sees half a tiling.
std::atomic<int64_t> gemm_tiling_choice{int64_t{64} << 32 | 1024};
std::atomic<int64_t> gemm_long_pairs_choice{0};
// A GEMM's K chunk, the tiling's or a long prompt's: 64 to 8192 pairs, a multiple of 64.
bool is_gemm_chunk(int64_t pairs) { return pairs >= 64 && pairs <= 8192 && pairs % 64 == 0; }
std::atomic<int> prefill_gemm[kFormats] = {};  // PrefillGemm, per WeightFormat
std::atomic<int64_t> decode_brgemm_from[kFormats] = {};  // decode_on_brgemm's row count, per WeightFormat (0: never)
std::atomic<int64_t> expand_budget{int64_t{256} << 20};  // mla_expand_budget
std::atomic<int64_t> split_tasks[kFormats] = {};  // decode_split, per WeightFormat (0: never split)

AttentionFamily parse_family(const std::string& name) {
  if (name == "extend") return AttentionFamily::extend;
  if (name == "mla") return AttentionFamily::mla;
  TORCH_CHECK(false, "tilefx tuning: unknown attention family '", name, "' (extend, mla)");
}

}  // namespace

int64_t mla_expand_budget() { return expand_budget.load(std::memory_order_relaxed); }

void set_mla_expand_budget(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "tilefx tuning: the MLA expansion budget is a byte count, got ", bytes);
  expand_budget = bytes;
}

PrefillAttention prefill_attention(AttentionFamily family, int64_t seq) {
  const int64_t choice = prefill_attention_choice[static_cast<int>(family)].load(std::memory_order_relaxed);
  const auto kernel = static_cast<PrefillAttention>(choice & 3);
  return kernel != PrefillAttention::unit && seq >= (choice >> 2) ? kernel : PrefillAttention::unit;
}

void set_prefill_attention(const std::string& family, const std::string& kernel, int64_t from_tokens) {
  const int which = static_cast<int>(parse_family(family));
  for (int k = 0; k < 3; ++k) {
    if (kernel != kAttentionKernels[k]) continue;
    if (k == 0) {
      prefill_attention_choice[which] = 0;
      return;
    }
    TORCH_CHECK(from_tokens >= 2 && from_tokens < (int64_t{1} << 40), "tilefx tuning: ", kernel,
                " takes prefill from 2 new tokens on, got ", from_tokens);
    prefill_attention_choice[which] = from_tokens << 2 | k;
    return;
  }
  TORCH_CHECK(false, "tilefx tuning: unknown prefill attention kernel '", kernel, "' (unit, sdpa, brgemm)");
}

std::tuple<std::string, int64_t> get_prefill_attention(const std::string& family) {
  const int64_t choice = prefill_attention_choice[static_cast<int>(parse_family(family))].load();
  return {kAttentionKernels[choice & 3], choice >> 2};
}

AttentionTiling attention_tiling(AttentionFamily family) {
  const int64_t choice = attention_tiling_choice[static_cast<int>(family)].load(std::memory_order_relaxed);
  return {choice >> 32, choice & 0xFFFFFFFF};
}

void set_attention_tiling(const std::string& family, int64_t query_rows, int64_t key_step) {
  TORCH_CHECK(query_rows >= 16 && query_rows <= 1024, "tilefx tuning: an attention tile takes 16 to 1024 query rows, got ",
              query_rows);
  TORCH_CHECK(key_step >= kAttentionKeyBlock && key_step <= 2048 && key_step % kAttentionKeyBlock == 0,
              "tilefx tuning: an attention step takes a multiple of ", kAttentionKeyBlock, " keys up to 2048, got ",
              key_step);
  attention_tiling_choice[static_cast<int>(parse_family(family))] = query_rows << 32 | key_step;
}

std::tuple<int64_t, int64_t> get_attention_tiling(const std::string& family) {
  const AttentionTiling tiling = attention_tiling(parse_family(family));
  return {tiling.query_rows, tiling.key_step};
}

GemmTiling gemm_tiling() {
  const int64_t choice = gemm_tiling_choice.load(std::memory_order_relaxed);
  return {choice >> 32, choice & 0xFFFFFFFE, (choice & 1) != 0};
}

void set_gemm_tiling(int64_t rows, int64_t pairs, const std::string& kernel) {
  TORCH_CHECK(rows >= 16 && rows <= kMaxGemmRows && rows % 16 == 0, "tilefx tuning: a GEMM tile takes 16 to ",
              kMaxGemmRows, " rows of x, a multiple of 16, got ", rows);
  TORCH_CHECK(is_gemm_chunk(pairs), "tilefx tuning: a GEMM chunk takes 64 to 8192 K pairs, a multiple of 64, got ",
              pairs);
  TORCH_CHECK(kernel == "brgemm" || kernel == "tiles", "tilefx tuning: unknown GEMM kernel '", kernel,
              "' (brgemm, tiles)");
  const bool tiles = kernel == "tiles";
  TORCH_CHECK(!tiles || amx_tiles_usable(), "tilefx tuning: the GEMM kernel 'tiles' needs a CPU with AMX");
  gemm_tiling_choice = rows << 32 | pairs | int64_t{tiles};  // pairs is even: bit 0 holds the kernel
}

std::tuple<int64_t, int64_t, std::string> get_gemm_tiling() {
  const GemmTiling tiling = gemm_tiling();
  return {tiling.rows, tiling.pairs, tiling.tiles ? "tiles" : "brgemm"};
}

int64_t gemm_long_pairs() { return gemm_long_pairs_choice.load(std::memory_order_relaxed); }

void set_gemm_long_pairs(int64_t pairs) {
  TORCH_CHECK(pairs == 0 || is_gemm_chunk(pairs),
              "tilefx tuning: a long prompt's GEMM chunk takes 64 to 8192 K pairs, a multiple of 64, or 0 (the "
              "tiling's), got ", pairs);
  gemm_long_pairs_choice = pairs;
}

DecodeAttention decode_attention(AttentionFamily family, int64_t rows) {
  if (rows > kDecodeAttentionRows) return DecodeAttention::unit;
  return static_cast<DecodeAttention>(
      decode_attention_choice[static_cast<int>(family)].load(std::memory_order_relaxed));
}

void set_decode_attention(const std::string& family, const std::string& kernel) {
  TORCH_CHECK(kernel == "unit" || kernel == "brgemm", "tilefx tuning: unknown decode attention kernel '", kernel,
              "' (unit, brgemm)");
  decode_attention_choice[static_cast<int>(parse_family(family))] = kernel == "brgemm";
}

std::string get_decode_attention(const std::string& family) {
  return decode_attention_choice[static_cast<int>(parse_family(family))].load() ? "brgemm" : "unit";
}

bool prefill_on_brgemm(const KernelUnits& units, WeightFormat format, int64_t rows) {
  if (rows <= kGemvRows) return false;
  switch (static_cast<PrefillGemm>(prefill_gemm[static_cast<int>(format)].load(std::memory_order_relaxed))) {
    case PrefillGemm::unit: return false;
    case PrefillGemm::brgemm: return true;
    case PrefillGemm::path_default: break;
  }
  return units.brgemm_prefill;
}

void set_prefill_gemm(const std::string& format, const std::string& choice) {
  PrefillGemm parsed;
  if (choice == "default") {
    parsed = PrefillGemm::path_default;
  } else if (choice == "unit") {
    parsed = PrefillGemm::unit;
  } else if (choice == "brgemm") {
    parsed = PrefillGemm::brgemm;
  } else {
    TORCH_CHECK(false, "tilefx tuning: unknown prefill GEMM '", choice, "' (default, unit, brgemm)");
  }
  prefill_gemm[static_cast<int>(parse_format(format))] = static_cast<int>(parsed);
}

std::string get_prefill_gemm(const std::string& format) {
  switch (static_cast<PrefillGemm>(prefill_gemm[static_cast<int>(parse_format(format))].load())) {
    case PrefillGemm::unit: return "unit";
    case PrefillGemm::brgemm: return "brgemm";
    case PrefillGemm::path_default: break;
  }
  return "default";
}

bool decode_on_brgemm(WeightFormat format, int64_t rows) {
  const int64_t from = decode_brgemm_from[static_cast<int>(format)].load(std::memory_order_relaxed);
  return from > 0 && rows >= from && rows <= kGemvRows;
}

void set_decode_gemm(const std::string& format, const std::string& choice, int64_t from_rows) {
  const int which = static_cast<int>(parse_format(format));
  if (choice == "unit") {
    decode_brgemm_from[which] = 0;
    return;
  }
  TORCH_CHECK(choice == "brgemm", "tilefx tuning: unknown decode GEMM '", choice, "' (unit, brgemm)");
  TORCH_CHECK(from_rows >= 1 && from_rows <= kGemvRows, "tilefx tuning: brgemm takes decode from 1 to ", kGemvRows,
              " rows on, got ", from_rows);
  decode_brgemm_from[which] = from_rows;
}

std::tuple<std::string, int64_t> get_decode_gemm(const std::string& format) {
  const int64_t from = decode_brgemm_from[static_cast<int>(parse_format(format))].load();
  return {from > 0 ? "brgemm" : "unit", from};
}

int64_t decode_split(WeightFormat format) {
  return split_tasks[static_cast<int>(format)].load(std::memory_order_relaxed);
}

void set_decode_split(const std::string& format, int64_t tasks_per_thread) {
  const WeightFormat parsed = parse_format(format);
  TORCH_CHECK(tasks_per_thread >= 0 && tasks_per_thread <= 64,
              "tilefx tuning: a decode split is 0 (off) to 64 tasks a thread, got ", tasks_per_thread);
  TORCH_CHECK(parsed != WeightFormat::int4 || tasks_per_thread == 0,
              "tilefx tuning: int4 decode does not split K (its scale groups and x sums are per whole block)");
  split_tasks[static_cast<int>(parsed)] = tasks_per_thread;
}

int64_t get_decode_split(const std::string& format) { return decode_split(parse_format(format)); }

WalkTuning walk_tuning(LinearUnit unit, WeightFormat format) {
  const Slot& s = slot(unit, format);
  return {s.streams.load(std::memory_order_relaxed), s.prefetch_bytes.load(std::memory_order_relaxed),
          s.prefetch_hint.load(std::memory_order_relaxed)};
}

void set_walk_tuning(const std::string& unit, const std::string& format, int64_t streams, int64_t prefetch_bytes,
                     const std::string& prefetch_hint) {
  const LinearUnit which = parse_unit(unit);
  const WeightFormat kind = parse_format(format);
  const int64_t most = walk_streams(which == LinearUnit::avx2, kind);
  TORCH_CHECK(streams >= 1 && streams <= most, "tilefx tuning: the ", unit, " unit reads ", format, " in 1",
              most > 1 ? std::string(" or ") + std::to_string(most) : std::string(), " stream(s), got ", streams);
  TORCH_CHECK(prefetch_bytes >= 0 && prefetch_bytes <= 65536 && prefetch_bytes % 64 == 0,
              "tilefx tuning: prefetch_bytes must be a multiple of 64 in [0, 65536], got ", prefetch_bytes);
  int hint = 0;
  while (hint < 3 && prefetch_hint != kHintNames[hint]) ++hint;
  TORCH_CHECK(hint < 3, "tilefx tuning: prefetch_hint must be nta, t0 or t1, got '", prefetch_hint, "'");
  Slot& s = slot(which, kind);
  s.streams = streams;
  s.prefetch_bytes = prefetch_bytes;
  s.prefetch_hint = static_cast<PrefetchHint>(hint);
}

int64_t get_walk_streams(const std::string& unit, const std::string& format) {
  return walk_streams(parse_unit(unit) == LinearUnit::avx2, parse_format(format));
}

std::tuple<int64_t, int64_t, std::string> get_walk_tuning(const std::string& unit, const std::string& format) {
  const WalkTuning t = walk_tuning(parse_unit(unit), parse_format(format));
  return {t.streams, t.prefetch_bytes, kHintNames[static_cast<int>(t.prefetch_hint)]};
}

}  // namespace tilefx
