// The module: registers the ops' CPU kernels with the dispatcher (the *_ops.cpp files)
// and exposes the kernel path and the memory helpers to Python.
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <torch/version.h>

#include <map>
#include <memory>
#include <string>

#include "activations.h"
#include "dispatch.h"
#include "ops.h"
#include "tuning.h"

namespace tilefx {

// collectives.cpp: the Python functions the collectives call for groups shared memory cannot serve. Declared here,
// not in ops.h, so that only the two files that talk to Python parse pybind11.
void set_collective_fallbacks(pybind11::object all_reduce, pybind11::object all_gather);

namespace {

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
  cpu_kernels->impl("mla_prefill", TORCH_FN(mla_prefill_cpu));
  cpu_kernels->impl("rope", TORCH_FN(rope_cpu));
  cpu_kernels->impl("rms_norm", TORCH_FN(rms_norm_cpu));
  cpu_kernels->impl("add_rms_norm", TORCH_FN(add_rms_norm_cpu));
  cpu_kernels->impl("all_reduce", TORCH_FN(all_reduce_cpu));
  cpu_kernels->impl("all_gather", TORCH_FN(all_gather_cpu));
}

// One row of the dispatch table, for custom_ops.isa.kernel_units.
std::map<std::string, std::string> kernel_units(const std::string& name) {
  const KernelUnits units = units_for(parse_path(name));
  if (!units.native) return {};
  return {{"linear", units.brgemm_prefill ? std::string("brgemm above ") + std::to_string(kGemvRows) +
                                                " rows, else " + unit_name(units.linear)
                                          : unit_name(units.linear)},
          {"linear_float", unit_name(units.linear)},
          {"linear_per_head", unit_name(units.per_head)},
          {"fused_moe", unit_name(units.moe)},
          {"attention", unit_name(units.attention)}};
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
  m.def("set_int4_activations", &tilefx::set_int4_activations,
        "how int4 decode reads x: int16 (15-bit words, the default) or int8 (per 32 inputs)");
  m.def("get_int4_activations", &tilefx::get_int4_activations, "int16 or int8");
  m.def("set_int8_activations", &tilefx::set_int8_activations,
        "how an int8 or int4 GEMM on the units reads x: int8 (integer products, the default: int8 per 32 inputs on "
        "the AVX512-BF16 units, int16 words on AVX2) or bf16 (over dequantized blocks)");
  m.def("get_int8_activations", &tilefx::get_int8_activations, "int8 or bf16");
  m.def("cpu_has", &tilefx::cpu_has,
        "whether this CPU runs the given kernel ISA: avx2, avx512_bf16, avx512_vnni, amx; amx_tiles: tilefx's own "
        "AMX kernel (the tile state granted)");
  m.def("set_walk_tuning", &tilefx::set_walk_tuning,
        "how the decode walks of a linear unit stream weights of a format: streams per thread, prefetch bytes, "
        "prefetch hint (nta, t0, t1)");
  m.def("get_walk_tuning", &tilefx::get_walk_tuning,
        "(streams, prefetch bytes, prefetch hint) of a linear unit and weight format");
  m.def("walk_streams", &tilefx::get_walk_streams,
        "the most streams a linear unit's M = 1 GEMV reads a weight format in (what set_walk_tuning takes)");
  m.def("set_prefill_attention", &tilefx::set_prefill_attention,
        "the kernel an attention family (extend, mla) runs from how many new tokens on: unit (every length), "
        "sdpa (PyTorch's) or brgemm (a flash attention over oneDNN brgemm tiles)");
  m.def("get_prefill_attention", &tilefx::get_prefill_attention,
        "(kernel, from_tokens) of an attention family's prefill; (unit, 0) when the unit runs every length");
  m.def("set_attention_tiling", &tilefx::set_attention_tiling,
        "the blocking of an attention family's (extend, mla) flash attention on brgemm tiles: query rows a task, keys "
        "a step (a multiple of 128)");
  m.def("get_attention_tiling", &tilefx::get_attention_tiling, "(query rows, key step) of an attention family");
  m.def("set_gemm_tiling", &tilefx::set_gemm_tiling,
        "the linear ops' brgemm blocking: rows of x a call multiplies (16 to 256), K pairs a chunk (64 to 8192), "
        "the kernel (brgemm: oneDNN's calls; tiles: tilefx's AMX kernel)");
  m.def("get_gemm_tiling", &tilefx::get_gemm_tiling, "(rows, pairs, kernel) of the linear ops' brgemm blocking");
  m.def("set_gemm_long_pairs", &tilefx::set_gemm_long_pairs,
        "the K chunk (64 to 8192 pairs, or 0: the tiling's) of a linear whose rows span several panels");
  m.def("get_gemm_long_pairs", &tilefx::gemm_long_pairs, "the K chunk of a linear whose rows span several panels");
  m.def("set_decode_attention", &tilefx::set_decode_attention,
        "the kernel an attention family (extend, mla) runs for a few new tokens: unit or brgemm (flash decoding "
        "over oneDNN brgemm tiles)");
  m.def("get_decode_attention", &tilefx::get_decode_attention, "the decode attention kernel of a family");
  m.def("set_mla_expand_budget", &tilefx::set_mla_expand_budget,
        "bytes of expanded keys and values MLA prefill's expanded form holds at once (0: always absorbed)");
  m.def("get_mla_expand_budget", &tilefx::mla_expand_budget, "the MLA expansion budget in bytes");
  m.def("set_prefill_gemm", &tilefx::set_prefill_gemm,
        "the GEMM the linear ops run above 4 rows for weights of a format: default (the path's), unit or brgemm");
  m.def("get_prefill_gemm", &tilefx::get_prefill_gemm, "the prefill GEMM chosen for a weight format");
  m.def("set_decode_gemm", &tilefx::set_decode_gemm,
        "what the linear ops run at 1 to 4 rows for weights of a format: unit (its GEMV walk) or brgemm from a row "
        "count on");
  m.def("get_decode_gemm", &tilefx::get_decode_gemm, "(choice, from_rows) of a weight format's decode; (unit, 0)");
  m.def("set_decode_split", &tilefx::set_decode_split,
        "split K of a decode linear over weights of a format into slices where it has fewer than this many "
        "tasks a thread (0: never)");
  m.def("get_decode_split", &tilefx::get_decode_split, "the decode split of a weight format (tasks a thread; 0: off)");
  m.def("kernel_units", &tilefx::kernel_units,
        "the unit each op family runs on a path (empty for reference): the dispatch table's row");
  m.attr("avx512_emulation") = tilefx::kAvx512Emulation;
  // The torch this library was compiled against (custom_ops/isa.py refuses another minor version).
  m.attr("torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
  m.def("huge_page_empty", &tilefx::huge_page_empty,
        "an uninitialized tensor in 2 MiB-aligned memory advised for transparent huge pages");
  m.def("pack_vnni_blocks", &tilefx::pack_vnni_blocks,
        "write a weight's rows into packed blocks [blocks, pairs, 32, 2] (zero padded), on every thread");
  m.def("pack_int4_blocks", &tilefx::pack_int4_blocks,
        "write int4 values' rows (nibbles one a byte, two a byte, or two a byte as words [n, k / 8, 4]) into the int4 "
        "packing's blocks [blocks, pairs, 16, 2] (zero padded), on every thread");
  m.def("drop_file_mapping_pages", &tilefx::drop_file_mapping_pages,
        "drop this process's pages of file mappings whose path ends with `suffix`, but those of `keep` ranges; with "
        "the GIL held throughout (safe from a background thread)");
  m.def("awq_paired_nibbles", &tilefx::awq_paired_nibbles,
        "an AWQ qweight [K, N / 8] (outputs in `order` within a word) as nibbles two a byte [N, K / 2], on every thread");
  m.def("quantize_rows_int8", &tilefx::quantize_rows_int8,
        "int8 values and per-row scales of a bf16 weight, as formats.quantize_rows gives them, on every thread");
  m.def("quantize_blocks_fp8", &tilefx::quantize_blocks_fp8,
        "e4m3 values and 128 x 128 block scales of a bf16 weight, as formats.quantize_rows gives them");
  m.def("quantize_groups_int4", &tilefx::quantize_groups_int4,
        "int4 values (one a byte) and per-row, per-128-input scales and zero points of a bf16 weight, as "
        "formats.quantize_rows gives them");
  m.def("shm_open_group", &tilefx::shm_open_group,
        "map every rank's segment file (created and sized by custom_ops/collectives.py); returns a group handle");
  m.def("shm_close_group", &tilefx::shm_close_group, "unmap a group's segments");
  m.def("shm_all_reduce", &tilefx::shm_all_reduce, "sum a tensor over the group's ranks (fp32 sums, ranks in order)");
  m.def("shm_all_gather", &tilefx::shm_all_gather, "the ranks' tensors side by side along the last dim");
  m.def("shm_stats", &tilefx::shm_stats, "(collectives, seconds in them, seconds waiting for peers)");
  m.def("shm_name_group", &tilefx::shm_name_group, "bind an op group name to a shared-memory group");
  m.def("set_collective_fallbacks", &tilefx::set_collective_fallbacks,
        "the Python implementations tilefx.all_reduce / all_gather call for groups that are not shared-memory ones");
  m.def("hold_recycled_buffers", &tilefx::hold_recycled_buffers,
        "keep freed CPU blocks of at least min_bytes for reuse until the last hold is released (the first hold "
        "installs the recycler as PyTorch's CPU allocator)");
  m.def("release_recycled_buffers", &tilefx::release_recycled_buffers, "end a hold; the last one frees the kept blocks");
  m.def("recycled_buffer_stats", &tilefx::recycled_buffer_stats,
        "(holds, kept blocks, kept bytes, large requests reused while held, large requests made new while held)");
  m.def("stream_read_gbps", &tilefx::stream_read_gbps, "one streaming-read pass over a buffer, GB/s (AVX2 loads, 1 or 2 streams per thread)");
}
