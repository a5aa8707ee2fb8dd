// Tensor-level entry points of the native kernels: argument checks, threading
// (parallel_chunks for the streaming ops, at::parallel_for elsewhere), and the choice of ISA unit. Python (custom_ops/*.py) picks
// which entry point an op calls; see custom_ops/isa.py.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace tilefx {

// Defined in linear_amx.cpp (oneDNN brgemm; only where AMX exists).
bool amx_available();
at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t out_features);

// Defined in moe.cpp.
at::Tensor fused_moe_native(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                            const at::Tensor& topk_weights, const at::Tensor& topk_ids, LinearUnit unit);

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

void write_activation_row(LinearUnit unit, const uint16_t* src, int64_t n, int64_t ldx, void* rows, int64_t row) {
  if (unit == LinearUnit::avx2) {
    float* dst = static_cast<float*>(rows) + row * ldx;
    bf16_to_float_avx2(src, dst, n);
    if (ldx > n) dst[n] = 0.0f;
  } else {
    uint16_t* dst = static_cast<uint16_t*>(rows) + row * ldx;
    std::memcpy(dst, src, n * sizeof(uint16_t));
    if (ldx > n) dst[n] = 0;
  }
}

void attach_activations(LinearProblem& p, LinearUnit unit, const void* rows, int64_t row) {
  if (unit == LinearUnit::avx2) {
    p.x = static_cast<const float*>(rows) + row * p.ldx;
  } else {
    p.x_pairs = static_cast<const uint32_t*>(rows) + row * p.ldx / 2;
  }
}

namespace {

bool cpu_has(const std::string& feature) {
  __builtin_cpu_init();
  if (feature == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (feature == "avx512_bf16") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  if (feature == "amx") return amx_available();
  TORCH_CHECK(false, "unknown CPU feature '", feature, "'");
}

const uint16_t* bf16_bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "tilefx linear: x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == kBlockN &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "tilefx linear: weight must be packed by pack_linear_weight (bf16 [N/", kBlockN, ", K/2, ", kBlockN,
              ", 2]), got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(x.size(-1) <= 2 * packed.size(1) && x.size(-1) > 2 * packed.size(1) - 2,
              "tilefx linear: x has ", x.size(-1), " features, the packed weight ", 2 * packed.size(1));
  TORCH_CHECK(out_features > packed.size(0) * kBlockN - kBlockN && out_features <= packed.size(0) * kBlockN,
              "tilefx linear: out_features ", out_features, " does not match the packed weight");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->size(0) == out_features &&
                    bias->is_contiguous(),
                "tilefx linear: bias must be contiguous bf16 [", out_features, "]");
  }
}

// x as the unit reads it (write_activation_row), in a reused thread-local buffer when
// small, else in `storage`. bf16 x with even K already is the AVX512-BF16 unit's pairs.
void prepare_activations(const at::Tensor& x2, int64_t rows, LinearUnit unit, LinearProblem& p, at::Tensor& storage) {
  const int64_t in_features = x2.size(-1), ldx = p.ldx;
  const uint16_t* x_bits = bf16_bits(x2);
  const bool pairs = unit != LinearUnit::avx2;
  if (pairs && ldx == in_features && reinterpret_cast<uintptr_t>(x_bits) % alignof(uint32_t) == 0) {
    return attach_activations(p, unit, x_bits, 0);
  }
  constexpr int64_t kReusedBytes = 1 << 18;
  const int64_t bytes = rows * ldx * (pairs ? sizeof(uint16_t) : sizeof(float));
  thread_local std::vector<float> reused;
  void* buffer;
  if (bytes <= kReusedBytes) {
    reused.resize(kReusedBytes / sizeof(float));
    buffer = reused.data();
  } else {
    storage = at::empty({rows, ldx}, x2.options().dtype(pairs ? at::kBFloat16 : at::kFloat));
    buffer = storage.data_ptr();
  }
  for (int64_t m = 0; m < rows; ++m) write_activation_row(unit, x_bits + m * in_features, in_features, ldx, buffer, m);
  attach_activations(p, unit, buffer, 0);
}

// Arguments checked by linear_cpu / linear_silu_mul_cpu. Per-call fixed cost matters
// here (decode makes ~100 calls of 20-150 us each): x is converted into a reused
// thread-local buffer, not an ATen temporary.
at::Tensor linear_native(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t out_features, bool silu_mul, bool float_out, LinearUnit unit) {
  const int64_t in_features = x.size(-1);
  const int64_t k_pairs = packed.size(1), ldx = 2 * k_pairs;
  // No dispatcher round trips before the weight stream starts: a decode call spends
  // a few us in them (reshape and at::empty, measured 3 and 3 us with caches cold
  // after the previous weight's stream), ~4% of a 1536 x 1536 GEMV.
  const at::Tensor x2 = x.is_contiguous() ? x : x.contiguous();
  const int64_t rows = in_features == 0 ? 0 : x2.numel() / in_features;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  at::Tensor y = at::detail::empty_cpu(out_shape, float_out ? at::kFloat : at::kBFloat16, /*pin_memory=*/false,
                                       c10::nullopt);
  if (rows == 0) return y;

  LinearProblem p{/*x=*/nullptr, bf16_bits(packed), bias ? bf16_bits(*bias) : nullptr,
                  float_out ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), rows, out_features,
                  k_pairs, ldx, /*yf=*/float_out ? y.data_ptr<float>() : nullptr, /*ldy=*/out_features, silu_mul};
  at::Tensor activations;
  prepare_activations(x2, rows, unit, p, activations);
  const int64_t units = silu_mul ? packed.size(0) / 2 : packed.size(0);
  const size_t scratch_floats = 2 * std::max<int64_t>(rows, 2) * kBlockN;
  parallel_chunks(units, /*min_chunk=*/2, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;
    if (scratch.size() < scratch_floats) scratch.resize(scratch_floats);
    linear_blocks(unit, p, begin, end, scratch.data());
  });
  return y;
}

// `t` itself when its last dimension is dense (what the kernels index), else a contiguous copy.
at::Tensor unit_stride(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// K/V of the new tokens into the cache rows [0, B) at `positions` (one row copy per token and head).
void write_kv(const at::Tensor& new_rows, at::Tensor& cache, const int64_t* positions) {
  const at::Tensor rows = unit_stride(new_rows);
  const int64_t batch = rows.size(0), heads = rows.size(1), seq = rows.size(2), dim = rows.size(3);
  const at::BFloat16* src = rows.data_ptr<at::BFloat16>();
  at::BFloat16* dst = cache.data_ptr<at::BFloat16>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t s = 0; s < seq; ++s)
        std::memcpy(dst + b * cache.stride(0) + h * cache.stride(1) + positions[s] * cache.stride(2),
                    src + b * rows.stride(0) + h * rows.stride(1) + s * rows.stride(2), dim * sizeof(at::BFloat16));
}

// What every attention op does before attending: checks the mask and the new tokens'
// positions (contiguous increasing cache slots), writes each (new rows, cache) pair at
// those positions, and returns the end of the keys to attend (last position + 1).
int64_t write_new_tokens(const at::Tensor& mask, const at::Tensor& positions_in, int64_t batch, int64_t seq,
                         int64_t max_len, std::initializer_list<std::pair<const at::Tensor*, at::Tensor*>> writes) {
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(0) >= batch &&
                  mask.size(2) == seq && mask.size(3) == max_len,
              "tilefx attention: mask must be bool [B, 1, S, max_len], got ", mask.scalar_type(), " ", mask.sizes());
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  TORCH_CHECK(seq > 0 && positions.dim() == 1 && positions.numel() == seq,
              "tilefx attention: one position per new token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t s = 0; s < seq; ++s) {
    TORCH_CHECK(pos[s] >= 0 && pos[s] < max_len && (s == 0 || pos[s] == pos[s - 1] + 1),
                "tilefx attention: positions must be increasing cache slots below ", max_len);
  }
  for (const auto& [rows, cache] : writes) write_kv(*rows, *cache, pos);
  return pos[seq - 1] + 1;
}

// Runs `p` (query, cache and mask pointers set) over keys [0, end) and returns
// [batch, q_heads, seq, v_dim] bf16. Tasks are (batch row, KV head, query row, key
// split); with few rows the keys are split so every thread has work (flash-decoding),
// and the splits are merged here.
at::Tensor run_attention(const AttentionProblem& p, int64_t batch, int64_t seq, int64_t end,
                         const at::TensorOptions& options) {
  const int64_t q_heads = p.q_heads, kv_heads = p.kv_heads, dim = p.v_dim;
  const int64_t group = q_heads / kv_heads;
  const int64_t rows = batch * kv_heads * seq;
  const int64_t threads = at::get_num_threads();
  int64_t splits = 1;
  if (rows < 4 * threads) splits = std::min<int64_t>((4 * threads + rows - 1) / rows, (end + 63) / 64);
  const int64_t split_len = (end + splits - 1) / splits;
  splits = (end + split_len - 1) / split_len;

  std::vector<float> max(rows * splits * group), sum(rows * splits * group), part(rows * splits * group * dim);
  const size_t scratch_floats = attention_scratch_floats(p);
  parallel_chunks(rows * splits, /*min_chunk=*/1, [&](int64_t begin, int64_t stop) {
    thread_local std::vector<float> scratch;
    if (scratch.size() < scratch_floats) scratch.resize(scratch_floats);
    for (int64_t task = begin; task < stop; ++task) {
      const int64_t row = task / splits, split = task % splits;
      const int64_t s = row % seq, kv_head = (row / seq) % kv_heads, b = row / (seq * kv_heads);
      const int64_t key_begin = split * split_len, key_end = std::min(end, key_begin + split_len);
      const int64_t at = task * group;
      AttentionPartial out{&max[at], &sum[at], &part[at * dim], scratch.data()};
      attention_task_avx2(p, b, kv_head, s, key_begin, key_end, out);
    }
  });

  // Merge the splits of each (row, head); rows that may attend no key are zero.
  at::Tensor y = at::empty({batch, q_heads, seq, dim}, options);
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t stop) {
    std::vector<float> acc(dim);
    for (int64_t row = begin; row < stop; ++row) {
      const int64_t s = row % seq, kv_head = (row / seq) % kv_heads, b = row / (seq * kv_heads);
      for (int64_t g = 0; g < group; ++g) {
        float global_max = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < splits; ++i) global_max = std::max(global_max, max[(row * splits + i) * group + g]);
        std::fill(acc.begin(), acc.end(), 0.0f);
        float total = 0.0f;
        if (global_max != -std::numeric_limits<float>::infinity()) {
          for (int64_t i = 0; i < splits; ++i) {
            const int64_t at = (row * splits + i) * group + g;
            if (sum[at] == 0.0f) continue;
            const float w = std::exp(max[at] - global_max);
            total += w * sum[at];
            const float* src = &part[at * dim];
            for (int64_t d = 0; d < dim; ++d) acc[d] += w * src[d];
          }
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        at::BFloat16* dst = out + ((b * q_heads + kv_head * group + g) * seq + s) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<at::BFloat16>(acc[d] * inv);
      }
    }
  });
  return y;
}

at::Tensor attention_avx2(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                          at::Tensor v_cache, const at::Tensor& positions_in, const at::Tensor& mask_in,
                          double scale) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q_in, &k, &v, &k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 4,
                "tilefx attention: q, k, v and the caches must be 4-D bfloat16, got ", t->scalar_type(), " ",
                t->sizes());
  }
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "tilefx attention: caches must be contiguous and of one shape");
  const int64_t batch = q_in.size(0), q_heads = q_in.size(1), seq = q_in.size(2), dim = q_in.size(3);
  const int64_t kv_heads = k.size(1), max_len = k_cache.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == batch && k.size(2) == seq && k.size(3) == dim,
              "tilefx attention: k/v ", k.sizes(), " do not match q ", q_in.sizes());
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0 && k_cache.size(1) == kv_heads && k_cache.size(0) >= batch &&
                  k_cache.size(3) == dim,
              "tilefx attention: cache ", k_cache.sizes(), " does not fit k ", k.sizes());
  TORCH_CHECK(dim % 16 == 0, "tilefx attention: head_dim must be a multiple of 16, got ", dim);
  const int64_t end = write_new_tokens(mask_in, positions_in, batch, seq, max_len, {{&k, &k_cache}, {&v, &v_cache}});

  const at::Tensor q = unit_stride(q_in), mask = unit_stride(mask_in);
  AttentionProblem p{bf16_bits(q), q.stride(0), q.stride(1), q.stride(2),
                     nullptr, 0, 0, 0,
                     bf16_bits(k_cache), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     nullptr, 0, 0, 0,
                     bf16_bits(v_cache), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                     mask.data_ptr<bool>(), mask.stride(0), mask.stride(2),
                     q_heads, kv_heads, dim, /*rope_dim=*/0, /*v_dim=*/dim, static_cast<float>(scale)};
  return run_attention(p, batch, seq, end, q.options());
}

// Weight-absorbed MLA over the latent cache: key = [latent | rope key], value = the
// latent, every query head against the one latent "head". Writes the new tokens'
// latent and rope key first.
at::Tensor mla_attention_avx2(const at::Tensor& q_latent_in, const at::Tensor& q_rope_in, const at::Tensor& latent,
                              const at::Tensor& k_rope, at::Tensor latent_cache, at::Tensor rope_cache,
                              const at::Tensor& positions_in, const at::Tensor& mask_in, double scale) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q_latent_in, &q_rope_in, &latent, &k_rope,
                                                                        &latent_cache, &rope_cache}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 4,
                "tilefx mla_attention: queries, latent, rope key and caches must be 4-D bfloat16, got ",
                t->scalar_type(), " ", t->sizes());
  }
  const int64_t batch = q_latent_in.size(0), heads = q_latent_in.size(1), seq = q_latent_in.size(2);
  const int64_t rank = q_latent_in.size(3), rope_dim = q_rope_in.size(3), max_len = latent_cache.size(2);
  TORCH_CHECK(latent_cache.is_contiguous() && rope_cache.is_contiguous() &&
                  latent_cache.sizes().slice(0, 3) == rope_cache.sizes().slice(0, 3) && latent_cache.size(1) == 1 &&
                  latent_cache.size(0) >= batch && latent_cache.size(3) == rank && rope_cache.size(3) == rope_dim,
              "tilefx mla_attention: caches ", latent_cache.sizes(), " / ", rope_cache.sizes(),
              " do not fit the queries ", q_latent_in.sizes(), " / ", q_rope_in.sizes());
  TORCH_CHECK(q_rope_in.sizes().slice(0, 3) == q_latent_in.sizes().slice(0, 3) &&
                  latent.sizes() == at::IntArrayRef({batch, 1, seq, rank}) &&
                  k_rope.sizes() == at::IntArrayRef({batch, 1, seq, rope_dim}),
              "tilefx mla_attention: latent ", latent.sizes(), " / rope key ", k_rope.sizes(),
              " do not match the queries ", q_latent_in.sizes());
  TORCH_CHECK(rank % 16 == 0 && rope_dim % 16 == 0,
              "tilefx mla_attention: kv_lora_rank and the rope dim must be multiples of 16, got ", rank, ", ",
              rope_dim);
  const int64_t end = write_new_tokens(mask_in, positions_in, batch, seq, max_len,
                                       {{&latent, &latent_cache}, {&k_rope, &rope_cache}});

  const at::Tensor q = unit_stride(q_latent_in), qr = unit_stride(q_rope_in), mask = unit_stride(mask_in);
  AttentionProblem p{bf16_bits(q), q.stride(0), q.stride(1), q.stride(2),
                     bf16_bits(qr), qr.stride(0), qr.stride(1), qr.stride(2),
                     bf16_bits(latent_cache), latent_cache.stride(0), latent_cache.stride(1), latent_cache.stride(2),
                     bf16_bits(rope_cache), rope_cache.stride(0), rope_cache.stride(1), rope_cache.stride(2),
                     bf16_bits(latent_cache), latent_cache.stride(0), latent_cache.stride(1), latent_cache.stride(2),
                     mask.data_ptr<bool>(), mask.stride(0), mask.stride(2),
                     heads, /*kv_heads=*/1, rank, rope_dim, /*v_dim=*/rank, static_cast<float>(scale)};
  return run_attention(p, batch, seq, end, q.options());
}

// Streaming-read bandwidth over `buffer`, GB/s, one pass: every thread reads a
// contiguous slice as `streams` (1 or 2) sequential streams, with the loads the kernels use.
double stream_read_gbps(const at::Tensor& buffer, int64_t streams) {
  TORCH_CHECK(buffer.is_contiguous(), "stream_read_gbps: buffer must be contiguous");
  TORCH_CHECK(streams == 1 || streams == 2, "stream_read_gbps: streams must be 1 or 2");
  const int64_t chunk = 128 * streams;
  const int64_t chunks = buffer.nbytes() / chunk;
  const char* data = static_cast<const char*>(buffer.data_ptr());
  std::atomic<float> sink{0.0f};
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t stop) {
    sink = sink + stream_read_avx2(data + begin * chunk, (stop - begin) * chunk, static_cast<int>(streams));
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return chunks * chunk / seconds / 1e9;
}

// An uninitialized tensor in 2 MiB-aligned memory advised to be backed by transparent
// huge pages. Decode streams every packed weight once per token: with 4 KiB pages that
// is one TLB miss per 4 KiB, and a page walk whose entries other traffic (a long KV
// cache) evicts from the caches; measured here, huge pages made decode ~15% faster.
at::Tensor huge_page_empty(const std::vector<int64_t>& sizes, at::ScalarType dtype) {
  constexpr size_t kHugePage = size_t{2} << 20;
  int64_t numel = 1;
  for (int64_t size : sizes) numel *= size;
  const size_t bytes = std::max<size_t>(1, numel * c10::elementSize(dtype));
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* data = std::aligned_alloc(kHugePage, rounded);
  TORCH_CHECK(data != nullptr, "tilefx: out of memory allocating ", rounded, " bytes");
  madvise(data, rounded, MADV_HUGEPAGE);  // advice only: without THP the memory is ordinary pages
  return torch::from_blob(data, sizes, [](void* p) { std::free(p); }, at::TensorOptions().dtype(dtype));
}

// The kernel path the CPU kernels take (custom_ops/isa.py sets it): the dispatcher calls
// these directly, with no Python in between (~7 us per call saved; decode makes ~130).
// avx512_bf16_emulated runs the AVX512-BF16 unit on SIMDe (tests only; see kernels.h).
enum class Path : int { reference = 0, avx2 = 1, amx = 2, avx512_bf16 = 3, avx512_bf16_emulated = 4 };
std::atomic<int> current_path{static_cast<int>(Path::reference)};

#ifdef TILEFX_AVX512_EMULATION
constexpr bool kAvx512Emulation = true;
#else
constexpr bool kAvx512Emulation = false;
#endif

void set_path(const std::string& path) {
  if (path == "reference") current_path = static_cast<int>(Path::reference);
  else if (path == "avx2") current_path = static_cast<int>(Path::avx2);
  else if (path == "amx") current_path = static_cast<int>(Path::amx);
  else if (path == "avx512_bf16") current_path = static_cast<int>(Path::avx512_bf16);
  else if (path == "avx512_bf16_emulated" && kAvx512Emulation)
    current_path = static_cast<int>(Path::avx512_bf16_emulated);
  else TORCH_CHECK(false, "tilefx: no native kernels for path '", path, "'");
}

Path path() { return static_cast<Path>(current_path.load(std::memory_order_relaxed)); }

// The unit of the dense linears on the current path: AVX512-BF16 where the path is
// avx512_bf16; AVX2 on avx2, and on amx for what the AMX unit does not serve.
LinearUnit linear_unit() {
  switch (path()) {
    case Path::avx512_bf16: return LinearUnit::avx512;
    case Path::avx512_bf16_emulated: return LinearUnit::avx512_emulated;
    default: return LinearUnit::avx2;
  }
}

// tilefx::linear (bf16 result) and tilefx::linear_float (fp32 result: routers that HF
// computes in fp32 from bf16 weights and activations, such as DeepSeek's, get the same
// values without an fp32 weight copy). AMX serves the bf16 result; the AVX2 or AVX512-BF16 unit (linear_unit) both.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t out_features, bool float_out) {
  if (x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && path() != Path::reference) {
    check_packed(x, packed, bias, out_features);
    if (path() == Path::amx && !float_out) return linear_amx(x, packed, bias, out_features);
    return linear_native(x, packed, bias, out_features, /*silu_mul=*/false, float_out, linear_unit());
  }
  using Portable = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t);
  static const auto bf16_out =
      c10::Dispatcher::singleton().findSchemaOrThrow("tilefx::linear_portable", "").typed<Portable>();
  static const auto fp32_out =
      c10::Dispatcher::singleton().findSchemaOrThrow("tilefx::linear_float_portable", "").typed<Portable>();
  return (float_out ? fp32_out : bf16_out).call(x, packed, bias, out_features);
}

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t out_features) {
  return packed_linear(x, packed, bias, out_features, /*float_out=*/false);
}

at::Tensor linear_float_cpu(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t out_features) {
  return packed_linear(x, packed, bias, out_features, /*float_out=*/true);
}

at::Tensor linear_silu_mul_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  if (x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && path() != Path::reference) {
    const int64_t blocks = (out_features + kBlockN - 1) / kBlockN;
    TORCH_CHECK(packed.dim() == 4 && packed.size(0) == 2 * blocks,
                "tilefx linear_silu_mul: weight must be packed by pack_gate_up_weight (", 2 * blocks,
                " blocks for ", out_features, " features), got ", packed.sizes());
    check_packed(x, packed, c10::nullopt, 2 * blocks * kBlockN);
    if (path() != Path::amx) {
      return linear_native(x, packed, c10::nullopt, out_features, /*silu_mul=*/true, /*float_out=*/false,
                           linear_unit());
    }
    // AMX: one GEMM over the interleaved blocks, then the epilogue in ATen.
    const at::Tensor both = linear_amx(x, packed, c10::nullopt, 2 * blocks * kBlockN).unflatten(-1, {blocks, 2, kBlockN});
    const at::Tensor gate = both.select(-2, 0).to(at::kFloat), up = both.select(-2, 1).to(at::kFloat);
    return (at::silu(gate) * up).flatten(-2).narrow(-1, 0, out_features).to(at::kBFloat16);
  }
  static const auto portable = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("tilefx::linear_silu_mul_portable", "")
                                   .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  return portable.call(x, packed, out_features);
}

// One linear per head: y[..., h, s, :] = x[..., h, s, :] @ W_h^T, with W packed per
// head ([H, N/32, K/2, 32, 2], the expert layout). MLA's absorbed projections: the
// query through each head's key half of kv_b_proj, the attended latent through its
// value half. Work units are (row group, head, column block), in contiguous ranges.
at::Tensor linear_per_head_native(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                                  LinearUnit isa) {
  const int64_t heads = packed.size(0), blocks = packed.size(1), k_pairs = packed.size(2), ldx = 2 * k_pairs;
  const int64_t seq = x.size(-2), in_features = x.size(-1);
  const at::Tensor x4 = x.reshape({-1, heads, seq, in_features});
  const int64_t groups = x4.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  at::Tensor y = at::empty(out_shape, x.options());
  if (x4.numel() == 0) return y;

  // Activations [groups, H, S, ldx], K padded to even: fp32 (AVX2) or bf16 pairs (AVX512-BF16).
  const at::Tensor xa_tensor =
      at::empty({groups, heads, seq, ldx}, x.options().dtype(isa == LinearUnit::avx2 ? at::kFloat : at::kBFloat16));
  void* xa = xa_tensor.data_ptr();
  const uint16_t* x_bits = bf16_bits(x4);
  at::parallel_for(0, groups * heads * seq, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t s = row % seq, h = (row / seq) % heads, g = row / (seq * heads);
      write_activation_row(isa, x_bits + g * x4.stride(0) + h * x4.stride(1) + s * x4.stride(2), in_features, ldx,
                           xa, row);
    }
  });
  uint16_t* y_bits = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const uint16_t* w_bits = bf16_bits(packed);
  const int64_t head_weight = blocks * k_pairs * kBlockN * 2;
  const size_t scratch_floats = 2 * std::max<int64_t>(seq, 2) * kBlockN;
  at::parallel_for(0, groups * heads * blocks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;
    if (scratch.size() < scratch_floats) scratch.resize(scratch_floats);
    for (int64_t unit = begin; unit < end;) {  // one call per (group, head) run of blocks
      const int64_t matrix = unit / blocks, first = unit % blocks;
      const int64_t last = std::min(blocks, first + (end - unit));
      const int64_t h = matrix % heads;
      LinearProblem p{/*x=*/nullptr, w_bits + h * head_weight, nullptr, y_bits + matrix * seq * out_features, seq,
                      out_features, k_pairs, ldx, /*yf=*/nullptr, /*ldy=*/out_features, /*silu_mul=*/false};
      attach_activations(p, isa, xa, matrix * seq);
      linear_blocks(isa, p, first, last, scratch.data());
      unit += last - first;
    }
  });
  return y;
}

at::Tensor linear_per_head_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  if (x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && path() != Path::reference) {
    TORCH_CHECK(packed.dim() == 5 && packed.size(3) == kBlockN && packed.size(4) == 2 && packed.is_contiguous(),
                "tilefx linear_per_head: weight must be packed per head ([H, N/", kBlockN, ", K/2, ", kBlockN,
                ", 2]), got ", packed.sizes());
    TORCH_CHECK(x.dim() >= 3 && x.size(-3) == packed.size(0) && x.stride(-1) == 1,
                "tilefx linear_per_head: x must be [..., ", packed.size(0), " heads, S, K] with contiguous rows, got ",
                x.sizes());
    TORCH_CHECK(x.size(-1) <= 2 * packed.size(2) && x.size(-1) > 2 * packed.size(2) - 2 &&
                    out_features > (packed.size(1) - 1) * kBlockN && out_features <= packed.size(1) * kBlockN,
                "tilefx linear_per_head: x ", x.sizes(), " -> ", out_features, " features does not fit the packed ",
                packed.sizes());
    return linear_per_head_native(x, packed, out_features, linear_unit());
  }
  static const auto portable = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("tilefx::linear_per_head_portable", "")
                                   .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  return portable.call(x, packed, out_features);
}

void check_moe(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
               const at::Tensor& topk_ids) {
  TORCH_CHECK(hidden.dim() == 2, "tilefx fused_moe: hidden must be [tokens, hidden_size], got ", hidden.sizes());
  const int64_t hidden_size = hidden.size(1);
  TORCH_CHECK(w13.scalar_type() == at::kBFloat16 && w13.dim() == 5 && w13.is_contiguous() && w13.size(1) % 2 == 0 &&
                  w13.size(3) == kBlockN && w13.size(4) == 2 && w13.size(2) == (hidden_size + 1) / 2,
              "tilefx fused_moe: w13 must be pack_expert_gate_up_weight's bf16 [E, 2 * I/", kBlockN, ", ",
              (hidden_size + 1) / 2, ", ", kBlockN, ", 2], got ", w13.scalar_type(), " ", w13.sizes());
  const int64_t inter = w13.size(1) / 2 * kBlockN;
  TORCH_CHECK(w2.scalar_type() == at::kBFloat16 && w2.dim() == 5 && w2.is_contiguous() && w2.size(0) == w13.size(0) &&
                  w2.size(1) == (hidden_size + kBlockN - 1) / kBlockN && w2.size(2) == (inter + 1) / 2 &&
                  w2.size(3) == kBlockN && w2.size(4) == 2,
              "tilefx fused_moe: w2 must be pack_expert_down_weight's bf16 [", w13.size(0), ", ",
              (hidden_size + kBlockN - 1) / kBlockN, ", ", (inter + 1) / 2, ", ", kBlockN, ", 2], got ",
              w2.scalar_type(), " ", w2.sizes());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == hidden.size(0) && topk_ids.scalar_type() == at::kInt,
              "tilefx fused_moe: topk_ids must be int32 [tokens, k] (the router ops' ids), got ", topk_ids.scalar_type(), " ",
              topk_ids.sizes());
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && at::isFloatingType(topk_weights.scalar_type()),
              "tilefx fused_moe: topk_weights must be floating [tokens, k] like topk_ids, got ",
              topk_weights.scalar_type(), " ", topk_weights.sizes());
}

at::Tensor fused_moe_cpu(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  if (hidden.scalar_type() == at::kBFloat16 && path() != Path::reference) {
    check_moe(hidden, w13, w2, topk_weights, topk_ids);
    return fused_moe_native(hidden, w13, w2, topk_weights, topk_ids, linear_unit());  // AMX CPUs run AVX2
  }
  static const auto portable = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("tilefx::fused_moe_portable", "")
                                   .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, const at::Tensor&)>();
  return portable.call(hidden, w13, w2, topk_weights, topk_ids);
}

// The router of Qwen-MoE and Mixtral: the same ATen calls as topk_softmax_reference (so the
// same bits and tie order as HF), without a Python frame per call (~0.1 ms per MoE layer).
std::tuple<at::Tensor, at::Tensor> topk_softmax_cpu(const at::Tensor& router_logits, int64_t top_k, bool renormalize) {
  if (path() != Path::reference && router_logits.dim() == 2 && top_k >= 1 && top_k <= router_logits.size(1) &&
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
  if (path() != Path::reference && valid) {
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

at::Tensor attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& positions, const at::Tensor& mask,
                         double scale) {
  if (path() != Path::reference && q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
      q.dim() == 4 && q.size(3) % 16 == 0) {
    return attention_avx2(q, k.to(at::kBFloat16), v.to(at::kBFloat16), k_cache, v_cache, positions, mask, scale);
  }
  static const auto portable =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("tilefx::attention_portable", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return portable.call(q, k, v, k_cache, v_cache, positions, mask, scale);
}

at::Tensor mla_attention_cpu(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& latent,
                             const at::Tensor& k_rope, const at::Tensor& latent_cache, const at::Tensor& rope_cache,
                             const at::Tensor& positions, const at::Tensor& mask, double scale) {
  if (path() != Path::reference && q_latent.scalar_type() == at::kBFloat16 &&
      latent_cache.scalar_type() == at::kBFloat16 && q_latent.dim() == 4 && q_latent.size(3) % 16 == 0 &&
      q_rope.dim() == 4 && q_rope.size(3) % 16 == 0) {
    return mla_attention_avx2(q_latent, q_rope.to(at::kBFloat16), latent.to(at::kBFloat16),
                              k_rope.to(at::kBFloat16), latent_cache, rope_cache, positions, mask, scale);
  }
  static const auto portable =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("tilefx::mla_attention_portable", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return portable.call(q_latent, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask, scale);
}

// Called once by custom_ops/__init__.py after the op schemas are defined.
std::unique_ptr<torch::Library> cpu_kernels;
void register_cpu_kernels() {
  TORCH_CHECK(!cpu_kernels, "tilefx: CPU kernels are already registered");
  cpu_kernels = std::make_unique<torch::Library>(torch::Library::IMPL, "tilefx", c10::DispatchKey::CPU, __FILE__,
                                                 __LINE__);
  cpu_kernels->impl("linear", TORCH_FN(linear_cpu));
  cpu_kernels->impl("linear_silu_mul", TORCH_FN(linear_silu_mul_cpu));
  cpu_kernels->impl("linear_per_head", TORCH_FN(linear_per_head_cpu));
  cpu_kernels->impl("linear_float", TORCH_FN(linear_float_cpu));
  cpu_kernels->impl("fused_moe", TORCH_FN(fused_moe_cpu));
  cpu_kernels->impl("topk_softmax", TORCH_FN(topk_softmax_cpu));
  cpu_kernels->impl("grouped_topk", TORCH_FN(grouped_topk_cpu));
  cpu_kernels->impl("decode_attention", TORCH_FN(attention_cpu));
  cpu_kernels->impl("extend_attention", TORCH_FN(attention_cpu));
  cpu_kernels->impl("mla_attention", TORCH_FN(mla_attention_cpu));
}

}  // namespace
}  // namespace tilefx

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tilefx native CPU kernels (see custom_ops/csrc/kernels.h)";
  m.def("set_path", &tilefx::set_path,
        "the kernel path the CPU kernels take: reference, avx2, avx512_bf16, amx "
        "(or avx512_bf16_emulated in builds with SIMDe)");
  m.def("register_cpu_kernels", &tilefx::register_cpu_kernels,
        "register the CPU kernels of tilefx::linear, linear_silu_mul, fused_moe, the routers and the attention ops with the dispatcher");
  m.def("cpu_has", &tilefx::cpu_has, "whether this CPU runs the given kernel ISA: avx2, avx512_bf16, amx");
  m.attr("avx512_emulation") = tilefx::kAvx512Emulation;
  m.def("huge_page_empty", &tilefx::huge_page_empty,
        "an uninitialized tensor in 2 MiB-aligned memory advised for transparent huge pages");
  m.def("stream_read_gbps", &tilefx::stream_read_gbps, "one streaming-read pass over a buffer, GB/s (AVX2 loads, 1 or 2 streams per thread)");
}
