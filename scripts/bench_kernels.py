#!/usr/bin/env python
"""tilefx kernels vs their reference and the PyTorch / oneDNN alternatives, on preset shapes.

    python scripts/bench_kernels.py                        # every dense preset
    python scripts/bench_kernels.py --presets llama-3.2-1b --json kernels.json
    python scripts/bench_kernels.py --weights int8,fp8     # quantized linears next to bf16 (default)
    python scripts/bench_kernels.py --presets llama-3.2-1b --moe-presets deepseek-v2-lite --moe-tokens 4096

For each op: relative error against the reference implementation (fresh random
bf16 inputs), median time, and for memory-bound cases GB/s and the fraction of
the streaming-read bandwidth measured in the same run: each M=1 linear pass (over
enough weight copies to miss the L3 cache, as decode does) alternates with a
streaming-read pass, and the fraction is best over best and, paired, the median over
passes of each pass's GB/s over the mean of the probes on either side of it.
Next to it, the same linear on oneDNN's brgemm (decode's other candidate, where brgemm has
a compiled kernel), torch's bf16 linear and oneDNN's packed one, each on cold copies.
Linears are measured as decode runs them, siblings fused (q/k/v as one weight,
gate/up with SiLU-and-mul as one op), and also unfused for comparison. Then what a
decode GEMV costs per call beyond its bytes, at this thread count and at one (the
intercept of time against bytes over five sizes): on many threads, where a small
weight's call is short, the share of a step that no bandwidth buys back. And one MoE
layer's routed experts per MoE preset: tilefx.fused_moe against HF's experts module
(transformers' default grouped_mm path, what stock PyTorch runs) on the same random
routing, for one token (GB/s of the selected experts' weights, a new routing each call)
and for prompts (GFLOP/s, and the GB/s of the experts its routing chose, each read once a
call: at a few rows an expert, as a short prompt gives them, a prompt's experts are bound by
memory, at many by compute).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import statistics
import sys
import time

import torch

from tilefx.custom_ops import attention as attention_ops
from tilefx.custom_ops import isa, tuning
from tilefx.custom_ops import linear as linear_ops
from tilefx.custom_ops import moe as moe_ops
from tilefx.custom_ops import weights as packed_weights
from tilefx.models.adapters import adapter_for
from tilefx.models.presets import get_preset

DENSE_PRESETS = ("llama-3.2-1b", "llama-3.2-3b", "qwen2.5-1.5b", "qwen3-1.7b")
MOE_PRESETS = ("qwen3-30b-a3b", "deepseek-v2-lite")


def median_seconds(fn, repeats: int) -> float:
    return interleaved_median_seconds([fn], repeats)[0]


def interleaved_median_seconds(fns, rounds: int) -> list[float]:
    """The median seconds of each of ``fns``, called in turn ``rounds`` times after one warm-up call each: two
    kernels compared in the same minutes of a shared machine's traffic."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for fn, t in zip(fns, times):
            start = time.perf_counter()
            fn()
            t.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def cold_copies(tensor: torch.Tensor, at_least_bytes: int | None = None,
                huge_pages: bool = False) -> list[torch.Tensor]:
    """Copies to cycle through, ``at_least_bytes`` in all (default ``tuning.cold_pass_bytes()``: 4x this CPU's
    L3, at least 256 MiB, as the tuning pass), so that the L3 misses, as the decode weight stream does. (A fixed
    256 MiB fitted in a Xeon's 300 MiB L3.)

    ``huge_pages``: each copy in transparent huge pages, as the linear pass holds packed
    weights (and as the streaming-read probe's buffer is); PyTorch's own weights live
    in ordinary pages, so its copies stay there.
    """
    # (a weight under 2 MiB counts as 2 MiB: a tiny preset's weights would otherwise take thousands of copies)
    count = max(1, -(-(at_least_bytes or tuning.cold_pass_bytes()) // max(tensor.nbytes, 2 << 20)))
    if not huge_pages:
        return [tensor.clone() for _ in range(count)]
    return [packed_weights.huge_page_empty(tuple(tensor.shape), tensor.dtype).copy_(tensor) for _ in range(count)]


def prefill_rounds(repeats: int) -> int:
    """Calls a prefill GEMM is timed over: a 100 ms GEMM's time moves by 10% from call to call here."""
    return max(5, repeats // 3)


def median_seconds_per_copy(fn, copies, repeats: int) -> float:
    return median_seconds(lambda: [fn(c) for c in copies], repeats) / len(copies)


def relative_error(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@dataclasses.dataclass(frozen=True)
class LinearCase:
    name: str  # what the preset uses it as
    N: int  # output features (for gate/up: of each of gate and up)
    K: int  # input features
    gate_up: bool = False  # tilefx.linear_silu_mul over gate and up packed together
    in_decode: bool = True  # False: only runs with fuse_linears=False (siblings unfused)

    @property
    def weight_bytes(self) -> int:
        return (2 if self.gate_up else 1) * self.N * self.K * 2


def linear_cases(preset_name: str) -> list[LinearCase]:
    """Every distinct linear the preset's decode step runs (siblings fused, as the linear pass does),
    then the unfused sibling projections for comparison."""
    config = get_preset(preset_name).build_config(layers=1)
    hidden, head_dim = config.hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim, config.intermediate_size
    return [
        LinearCase("qkv_proj", q + 2 * kv, hidden),
        LinearCase("o_proj", hidden, q),
        LinearCase("gate_up_proj + SiLU-and-mul", inter, hidden, gate_up=True),
        LinearCase("down_proj", hidden, inter),
        LinearCase("lm_head", config.vocab_size, hidden),
        LinearCase("q_proj (unfused)", q, hidden, in_decode=False),
        LinearCase("k/v_proj (unfused)", kv, hidden, in_decode=False),
        LinearCase("gate/up_proj (unfused)", inter, hidden, in_decode=False),
    ]


def distinct_cases(presets, decode_only: bool = False):
    """``(preset, case)`` for each linear shape the presets run, each shape once."""
    seen = set()
    for preset in presets:
        for case in linear_cases(preset):
            if (decode_only and not case.in_decode) or (case.N, case.K, case.gate_up) in seen:
                continue
            seen.add((case.N, case.K, case.gate_up))
            yield preset, case


def onednn_linear(x, packed):
    """oneDNN's packed bf16 linear, what Inductor's freezing runs where it supports bf16."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def onednn_cold_copies(weight) -> list[torch.Tensor] | None:
    """``weight`` reordered for oneDNN's decode linear, in enough copies to miss the L3 as decode does (timing
    one hot copy flatters it); None where this torch has no oneDNN bf16 linear."""
    try:
        copies = [torch.ops.mkldnn._reorder_linear_weight(c, 1) for c in cold_copies(weight)]
        onednn_linear(torch.randn(1, weight.shape[1]).to(torch.bfloat16), copies[0])
        return copies
    except (RuntimeError, AttributeError):
        return None


def paired_gbps(fn, copies, nbytes: int, probe, rounds: int) -> tuple[list[float], list[float]]:
    """GB/s of ``fn`` over every copy, ``rounds`` times, each pass between two streaming-read passes
    (``rounds + 1`` probes: probe, kernel, probe, ..., probe).

    Pairing the two keeps both in the same minute of this shared machine's traffic; the fraction of the stream
    is then best over best (as STREAM reports) and, per pass, the pass over the mean of the probes either side
    of it (``paired_fraction``): this machine's bandwidth can change several-fold from one second to the next,
    and a best or a median taken apart can pair a kernel pass of one minute with a probe of another.
    """
    fn(copies[0])
    kernel, stream = [], [probe()]
    for _ in range(rounds):
        start = time.perf_counter()
        for c in copies:
            fn(c)
        kernel.append(nbytes * len(copies) / (time.perf_counter() - start) / 1e9)
        stream.append(probe())
    return kernel, stream


def paired_fraction(kernel: list[float], stream: list[float]) -> float:
    """The median over passes of each kernel pass's GB/s over the mean of the probes before and after it."""
    return statistics.median(k / ((before + after) / 2) for k, before, after in zip(kernel, stream, stream[1:]))


def bench_linears(presets, repeats: int, prefill_rows: int, stream_mib: int) -> list[dict]:
    rows = []
    probe = isa.stream_probe(stream_mib)
    for preset, case in distinct_cases(presets):
        n, k = case.N, case.K
        weights = [(torch.randn(n, k) / k**0.5).to(torch.bfloat16) for _ in range(2 if case.gate_up else 1)]
        weight = torch.cat(weights)  # what PyTorch would read: one [N or 2N, K] linear
        if case.gate_up:
            packed = packed_weights.pack_gate_up_weight_reference(*weights)
            op = lambda x, w: linear_ops.linear_silu_mul(x, w, n)  # noqa: E731
            reference = lambda x, w: linear_ops.linear_silu_mul_reference(x, w, n)  # noqa: E731
        else:
            packed = packed_weights.pack_linear_weight_reference(weight)
            op = lambda x, w: linear_ops.linear(x, w, None, n)  # noqa: E731
            reference = lambda x, w: linear_ops.linear_reference(x, w, None, n)  # noqa: E731
        x = torch.randn(1, k).to(torch.bfloat16)
        err = relative_error(op(x, packed), reference(x, packed))
        copies = cold_copies(packed, huge_pages=True)
        tilefx_gbps, stream_gbps = paired_gbps(lambda w: op(x, w), copies, case.weight_bytes, probe, repeats)
        t_brgemm = None  # the decode GEMM's other candidate on the same packed blocks (tuning.tune_decode_gemm)
        if tuning.brgemm_has_kernel():
            with tuning.forced_decode_gemm("bf16", "brgemm"):
                t_brgemm = median_seconds_per_copy(lambda w: op(x, w), copies, repeats)
        del copies
        t_torch = median_seconds_per_copy(lambda w: torch.nn.functional.linear(x, w), cold_copies(weight), repeats)
        onednn = onednn_cold_copies(weight)
        t_onednn = median_seconds_per_copy(lambda w: onednn_linear(x, w), onednn, repeats) if onednn else None
        del onednn
        xp = torch.randn(prefill_rows, k).to(torch.bfloat16)
        t_prefill, t_prefill_torch = interleaved_median_seconds(
            [lambda: op(xp, packed), lambda: torch.nn.functional.linear(xp, weight)], prefill_rounds(repeats))
        flops = 2 * prefill_rows * weight.shape[0] * k
        best, gbps = max(tilefx_gbps), max(stream_gbps)
        rows.append({
            "preset": preset, "linear": case.name, "N": weight.shape[0], "K": k, "in_decode": case.in_decode,
            "rel_err": err, "stream_gbps": gbps, "tilefx_gbps": best, "fraction_of_stream": best / gbps,
            "tilefx_us": case.weight_bytes / best / 1e3,
            "fraction_of_stream_paired": paired_fraction(tilefx_gbps, stream_gbps),
            "torch_gbps": weight.nbytes / t_torch / 1e9,
            "onednn_gbps": weight.nbytes / t_onednn / 1e9 if t_onednn else None,
            "brgemm_gbps": case.weight_bytes / t_brgemm / 1e9 if t_brgemm else None,
            "prefill_tilefx_gflops": flops / t_prefill / 1e9,
            "prefill_torch_gflops": flops / t_prefill_torch / 1e9,
        })
        print(f"  {case.name} {weight.shape[0]}x{k}: {best:.1f} GB/s ({best / gbps:.0%} of {gbps:.1f}; paired "
              f"{rows[-1]['fraction_of_stream_paired']:.0%})", flush=True)
    return rows


def bench_quantized_linears(presets, formats, repeats: int, prefill_rows: int, stream_mib: int) -> list[dict]:
    """The linears decode runs, in each quantized format: error against the reference (dequantize, then
    an fp32 matmul), GB/s of the bytes read (values and scales), prefill GFLOP/s."""
    rows = []
    probe = isa.stream_probe(stream_mib)
    for preset, case in distinct_cases(presets, decode_only=True):
        n, k = case.N, case.K
        sources = [(torch.randn(n, k) / k**0.5).to(torch.bfloat16) for _ in range(2 if case.gate_up else 1)]
        x, xp = torch.randn(1, k).to(torch.bfloat16), torch.randn(prefill_rows, k).to(torch.bfloat16)
        for format in formats:
            label = format
            if case.gate_up:
                packed = packed_weights.pack_gate_up_weight(*sources, format)
                scales = packed_weights.packed_scales(packed)
                op = lambda x, w: linear_ops.linear_silu_mul(x, w, n, scales)  # noqa: E731
                reference = lambda x, w: linear_ops.linear_silu_mul_reference(x, w, n, scales)  # noqa: E731
            else:
                packed = packed_weights.pack_linear_weight(sources[0], format)
                scales = packed_weights.packed_scales(packed)
                op = lambda x, w: linear_ops.linear(x, w, None, n, scales)  # noqa: E731
                reference = lambda x, w: linear_ops.linear_reference(x, w, None, n, scales)  # noqa: E731
            nbytes = packed.nbytes + scales.nbytes
            err = relative_error(op(x, packed), reference(x, packed))
            kernel, stream = paired_gbps(lambda w: op(x, w), cold_copies(packed, huge_pages=True), nbytes, probe,
                                         repeats)
            t_prefill = median_seconds(lambda: op(xp, packed), prefill_rounds(repeats))
            best, gbps = max(kernel), max(stream)
            rows.append({"preset": preset, "linear": case.name, "format": label, "N": packed.shape[0] * packed_weights.BLOCK_N,
                         "K": k, "rel_err": err, "bytes": nbytes, "tilefx_gbps": best, "stream_gbps": gbps,
                         "fraction_of_stream": best / gbps, "fraction_of_stream_paired": paired_fraction(kernel, stream),
                         "tilefx_us": nbytes / best / 1e3,
                         "prefill_tilefx_gflops": 2 * prefill_rows * packed.shape[0] * packed_weights.BLOCK_N * k / t_prefill / 1e9})
            print(f"  {label} {case.name} {n}x{k}: {best:.1f} GB/s ({best / gbps:.0%} of {gbps:.1f}; paired "
                  f"{rows[-1]['fraction_of_stream_paired']:.0%})", flush=True)
    return rows


def attention_inputs(batch, q_heads, kv_heads, head_dim, seq, context, max_len):
    bf = dict(dtype=torch.bfloat16)
    q = torch.randn(batch, q_heads, seq, head_dim).to(**bf)
    k = torch.randn(batch, kv_heads, seq, head_dim).to(**bf)
    v = torch.randn(batch, kv_heads, seq, head_dim).to(**bf)
    k_cache = torch.randn(batch, kv_heads, max_len, head_dim).to(**bf)
    v_cache = torch.randn(batch, kv_heads, max_len, head_dim).to(**bf)
    positions = torch.arange(context - seq, context)
    mask = (torch.arange(max_len)[None, :] <= positions[:, None]).expand(batch, 1, seq, max_len).contiguous()
    return q, k, v, k_cache, v_cache, positions, mask


FIXED_COST_N = (512, 1024, 2048, 4096, 8192)  # output features of the GEMVs timed (K: the first preset's hidden size)


def bench_gemv_fixed_cost(preset: str, rounds: int, stream_mib: int) -> list[dict]:
    """What a decode GEMV costs beyond its bytes, at this thread count and at one thread: bf16 GEMVs of the
    preset's hidden size as K and ``FIXED_COST_N`` outputs, each over its own cold copies (huge pages), sizes
    interleaved over ``rounds`` rounds; time per call against bytes fitted to a line (least squares over the
    medians). The intercept is the cost of a call whatever its size (starting the threads, the last chunks'
    wait, the first misses of each stream), the slope the rate the bytes stream at. On many threads the
    intercept is a larger share of a small weight's call: the figure that says how much of a step it is."""
    k = get_preset(preset).build_config(layers=1).hidden_size
    x = torch.randn(1, k).to(torch.bfloat16)
    shapes = []
    for n in FIXED_COST_N:
        packed = packed_weights.pack_linear_weight((torch.randn(n, k) / k**0.5).to(torch.bfloat16), "bf16")
        shapes.append((n, packed.nbytes, cold_copies(packed, huge_pages=True)))
    threads = torch.get_num_threads()
    results = []
    for count in sorted({threads, 1}, reverse=True):
        torch.set_num_threads(count)
        probe = isa.stream_probe(stream_mib)
        seconds = {n: [] for n, _, _ in shapes}
        probes = []
        for round in range(rounds + 1):  # the first round pages the copies in and is dropped
            for n, nbytes, copies in shapes:
                start = time.perf_counter()
                for c in copies:
                    linear_ops.linear(x, c, None, n)
                if round:
                    seconds[n].append((time.perf_counter() - start) / len(copies))
            if round:
                probes.append(probe())
        sizes = [nbytes for _, nbytes, _ in shapes]
        medians = [statistics.median(seconds[n]) for n, _, _ in shapes]
        slope, fixed = statistics.linear_regression(sizes, medians)
        results.append({"threads": count, "K": k, "N": list(FIXED_COST_N), "bytes": sizes,
                        "us": [m * 1e6 for m in medians], "fixed_us": fixed * 1e6, "slope_gbps": 1 / slope / 1e9,
                        "stream_gbps": statistics.median(probes)})
    torch.set_num_threads(threads)
    return results


def bench_attention(preset: str, contexts, repeats: int, stream_mib: int) -> list[dict]:
    """The preset's attention: decode at each context and a 128-token prompt, on the unit (the "tilefx" column),
    on PyTorch's SDPA (the reference path) and, for decode, as flash decoding on brgemm tiles where brgemm has a
    compiled kernel (tuning's decode candidate); then DeepSeek-V2-Lite's MLA decode (16 heads over the latent 512
    + rope 64), unit against brgemm."""
    config = get_preset(preset).build_config(layers=1)
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    scale = head_dim**-0.5
    has_brgemm = tuning.brgemm_has_kernel()
    rows = []
    with tuning.untuned():
        for op_name, seq, context in [("decode_attention", 1, c) for c in contexts] + [("extend_attention", 128, 128)]:
            args = attention_inputs(1, heads, kv_heads, head_dim, seq, context, max(contexts) + 128)
            op = getattr(attention_ops, op_name)
            want = attention_ops.attention_reference(*args, scale)
            err = relative_error(op(*args, scale), want)
            with isa.forced("reference"):  # the reference path runs PyTorch's fused SDPA
                t_sdpa = median_seconds(lambda: op(*args, scale), repeats)
            t_tilefx = median_seconds(lambda: op(*args, scale), repeats)
            t_brgemm = None
            if has_brgemm and seq == 1:
                with tuning.forced_decode_attention("extend", "brgemm"):
                    err = max(err, relative_error(op(*args, scale), want))
                    t_brgemm = median_seconds(lambda: op(*args, scale), repeats)
            kv_bytes = 2 * kv_heads * context * head_dim * 2
            gbps = isa.stream_read_gbps(size_mib=stream_mib, repeats=3)
            rows.append({"preset": preset, "op": op_name, "new_tokens": seq, "context": context, "rel_err": err,
                         "tilefx_us": t_tilefx * 1e6, "sdpa_us": t_sdpa * 1e6,
                         "brgemm_us": t_brgemm * 1e6 if t_brgemm else None, "kv_gbps": kv_bytes / t_tilefx / 1e9,
                         "stream_gbps": gbps})
        mla = tuning.AttentionShape("mla", 16, 1, 512, 64, 128, 128)
        for context in contexts:
            call = tuning.decode_call(mla, context)
            t_unit = median_seconds(call, repeats)
            t_brgemm, err = None, 0.0
            if has_brgemm:
                unit_out = call()
                with tuning.forced_decode_attention("mla", "brgemm"):
                    err = relative_error(call(), unit_out)
                    t_brgemm = median_seconds(call, repeats)
            rows.append({"preset": "deepseek-v2-lite", "op": "mla_attention", "new_tokens": 1, "context": context,
                         "rel_err": err, "tilefx_us": t_unit * 1e6, "sdpa_us": None,
                         "brgemm_us": t_brgemm * 1e6 if t_brgemm else None,
                         "kv_gbps": context * (512 + 64) * 2 / t_unit / 1e9, "stream_gbps": None})
    return rows


def bench_inductor_glue(preset: str, steps: int) -> dict:
    """What Inductor's own kernels (norms, RoPE, residuals, SiLU-and-mul) cost in a tilefx decode step.

    Compiles a 2-layer cut of the preset with Inductor's kernel profiling on and
    times every generated kernel over ``steps`` decode steps; a native op would have
    to beat them including its dispatch cost, measured alongside.
    """
    import tilefx
    from tilefx.models.presets import build_model
    from tilefx.models.runtime import CACHE_ARG, cache_kwargs

    model = build_model(preset, layers=2)
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        compiled = tilefx.compile_model(model, max_seq_len=steps + 16, progress=False)
        ids = torch.randint(3, model.config.vocab_size - 1, (1, 8))
        with torch.no_grad():
            past = compiled(input_ids=ids, logits_to_keep=1)[CACHE_ARG]
            with torch.profiler.profile() as prof:
                for _ in range(steps):
                    compiled(input_ids=ids[:, :1], **cache_kwargs(past))
    kernels = [e for e in prof.key_averages() if "cpp_fused" in e.key]
    total_us = sum(e.self_cpu_time_total for e in kernels) / steps
    x = torch.randn(1, 64).to(torch.bfloat16)
    tiny = packed_weights.pack_linear_weight_reference(torch.randn(32, 64).to(torch.bfloat16))
    dispatch_us = median_seconds(lambda: linear_ops.linear(x, tiny, None, 32), 200) * 1e6
    per_step = sum(e.count for e in kernels) / steps
    return {"preset": preset, "layers": 2, "kernels_per_step": per_step, "inductor_us_per_step": total_us,
            "inductor_us_per_kernel": total_us / max(per_step, 1), "custom_op_call_us": dispatch_us,
            "top": [(e.key, e.self_cpu_time_total / steps) for e in sorted(kernels, key=lambda e: -e.self_cpu_time_total)[:5]]}


def hf_experts(config):
    """The family's HF experts module (fused 3-D ``gate_up_proj`` / ``down_proj``) with random bf16 weights, run
    as transformers runs it by default (``grouped_mm``)."""
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    config._experts_implementation = "grouped_mm"
    experts = getattr(module, adapter_for(config).moe.experts_class)(config)
    with torch.no_grad():
        for parameter in (experts.gate_up_proj, experts.down_proj):
            parameter.copy_(torch.randn(parameter.shape) * parameter.shape[-1] ** -0.5)
    return experts.to(torch.bfloat16).eval()


def random_routing(tokens: int, experts: int, top_k: int, generator):
    """Each token's ``top_k`` distinct experts, uniformly at random (a random-weight router's routing is as even),
    with weights summing to 1."""
    weights, ids = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


def disjoint_routings(experts: int, top_k: int, generator) -> list:
    """One token's routings that share no expert from one call to the next (call i takes experts ik .. ik + k - 1):
    cycling through them reads every expert once a cycle, from memory where the layer's experts exceed the
    last-level cache."""
    weights, _ = random_routing(1, experts, top_k, generator)
    return [(weights, torch.arange(i * top_k, (i + 1) * top_k, dtype=torch.int32)[None] % experts)
            for i in range(max(1, experts // top_k))]


def bench_moe(preset: str, tokens: list[int], repeats: int, stream_mib: int) -> list[dict]:
    """One MoE layer's routed experts of ``preset``: fused_moe against HF's experts module, at one token (other
    experts each call, so they come from memory as in decode) and at each of ``tokens`` (prompts)."""
    config = get_preset(preset).build_config(layers=1)
    dims = adapter_for(config).moe_dims(config)
    experts, hidden, inter, top_k = dims["num_experts"], dims["hidden"], dims["intermediate"], dims["top_k"]
    hf = hf_experts(config)
    w13 = packed_weights.pack_expert_gate_up_weight(hf.gate_up_proj.data)
    w2 = packed_weights.pack_expert_down_weight(hf.down_proj.data)
    g = torch.Generator().manual_seed(0)
    probe = isa.stream_probe(stream_mib)
    rows = []
    for n in (1, *tokens):
        x = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
        routings = disjoint_routings(experts, top_k, g) if n == 1 else [random_routing(n, experts, top_k, g)]
        weights, ids = routings[0]
        want = moe_ops.fused_moe_reference(x, w13, w2, weights, ids)
        err = relative_error(moe_ops.fused_moe(x, w13, w2, weights, ids), want)

        def per_call(fn):  # median seconds a call, cycling through the routings
            fn(*routings[0])
            times = []
            for i in range(max(repeats, 3) if n == 1 else max(3, repeats // 5)):
                w, r = routings[i % len(routings)]
                start = time.perf_counter()
                fn(w, r)
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        with torch.no_grad():
            stream = [probe()]
            t_tilefx = per_call(lambda w, r: moe_ops.fused_moe(x, w13, w2, w, r))
            stream.append(probe())
            t_hf = per_call(lambda w, r: hf(x, r.long(), w.to(torch.bfloat16)))
        pairs = n * top_k
        flops = 2 * pairs * 3 * inter * hidden
        expert_bytes = 3 * inter * hidden * 2  # a selected expert's gate, up and down weights, bf16
        read = ids.unique().numel() * expert_bytes  # each chosen expert's weights, once a call
        rows.append({"preset": preset, "tokens": n, "experts": experts, "top_k": top_k, "hidden": hidden,
                     "intermediate": inter, "rel_err": err, "tilefx_ms": t_tilefx * 1e3, "hf_ms": t_hf * 1e3,
                     "stream_gbps": statistics.mean(stream),
                     "tilefx_gbps": read / t_tilefx / 1e9, "hf_gbps": read / t_hf / 1e9,
                     "tilefx_gflops": flops / t_tilefx / 1e9, "hf_gflops": flops / t_hf / 1e9})
        print(f"  {preset} experts, {n} token(s): tilefx {t_tilefx * 1e3:.2f} ms, HF grouped_mm {t_hf * 1e3:.2f} ms",
              flush=True)
    return rows


def token_counts(text: str) -> list[int]:
    """``--moe-tokens``: prompts' token counts, comma-separated, each at least 2 (one token is always timed)."""
    try:
        counts = [int(t) for t in text.split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token counts") from None
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected token counts of at least 2")
    return counts


def quantized_formats(text: str) -> str:
    """``--weights``: the quantized formats to time, comma-separated. bf16 is always timed (the baseline
    every quantized row is compared with), so naming it adds nothing; an unknown format is an error."""
    names = [f for f in text.split(",") if f]
    unknown = [f for f in names if f not in packed_weights.FORMATS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown weight format {', '.join(unknown)}: expected a comma-separated "
                                         f"list of {', '.join(f for f in packed_weights.FORMATS if f != 'bf16')}")
    return ",".join(dict.fromkeys(f for f in names if f != "bf16"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=",".join(DENSE_PRESETS))
    parser.add_argument("--moe-presets", default=",".join(MOE_PRESETS),
                        help="MoE presets whose routed experts are timed (comma-separated; empty: none)")
    parser.add_argument("--moe-tokens", type=token_counts, default="128,1024",
                        help="prompts' tokens for the MoE experts (comma-separated; default 128,1024: a short prompt "
                             "gives each expert a few rows, a long one many)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prefill-rows", type=int, default=128)
    parser.add_argument("--contexts", default="128,512,2048")
    parser.add_argument("--stream-mib", type=int, default=1024, help="buffer of the streaming-read probe")
    parser.add_argument("--weights", default="int8,fp8", type=quantized_formats,
                        help="quantized formats to time next to bf16, which is always timed (comma-separated; "
                             "empty: none)")
    parser.add_argument("--no-tune", action="store_true",
                        help="time the decode walks' and prefill GEMMs' defaults instead of those tuned for this machine")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    presets = [p for p in args.presets.split(",") if p]
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"# kernel path {isa.current()} (supported here: {', '.join(isa.supported())}); "
          f"{torch.get_num_threads()} threads", flush=True)
    formats = ["bf16", *[f for f in args.weights.split(",") if f]]
    walks = tuning.ensure_tuned(formats, enabled=not args.no_tune)
    for walk in walks:
        print(f"# decode walk {walk.line()}", flush=True)
    for gemm in tuning.ensure_gemm_tuned(formats, enabled=not args.no_tune):
        print(f"# {gemm.line()}", flush=True)

    linears = bench_linears(presets, args.repeats, args.prefill_rows, args.stream_mib)
    print("\n## tilefx.linear, M=1 (decode) and M=%d (prefill)\n" % args.prefill_rows)
    print("| shape N x K | used as | rel err | tilefx GB/s | stream GB/s | of stream (best) | of stream (paired) "
          "| tilefx on brgemm GB/s | torch bf16 GB/s | oneDNN packed GB/s | prefill tilefx GFLOP/s | prefill torch GFLOP/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(linears, key=lambda r: not r["in_decode"]):
        onednn = f"{r['onednn_gbps']:.1f}" if r["onednn_gbps"] else "n/a"
        brgemm = f"{r['brgemm_gbps']:.1f}" if r["brgemm_gbps"] else "n/a"
        print(f"| {r['N']} x {r['K']} | {r['preset']} {r['linear']} | {r['rel_err']:.1e} | {r['tilefx_gbps']:.1f} "
              f"| {r['stream_gbps']:.1f} | {r['fraction_of_stream']:.0%} | {r['fraction_of_stream_paired']:.0%} "
              f"| {brgemm} | {r['torch_gbps']:.1f} | {onednn} "
              f"| {r['prefill_tilefx_gflops']:.0f} | {r['prefill_torch_gflops']:.0f} |")
    worst = min((r for r in linears if r["in_decode"]), key=lambda r: r["fraction_of_stream_paired"])
    print(f"\nslowest M=1 shape that decode runs: {worst['N']} x {worst['K']} ({worst['linear']}) at "
          f"{worst['fraction_of_stream_paired']:.0%} of the streaming read (paired: the median over passes of each "
          f"pass over the probes either side of it; best pass over best probe {worst['fraction_of_stream']:.0%}). "
          "N x K is the whole packed weight (gate and up together); '(unfused)' rows run only with fuse_linears=False.")

    formats = [f for f in args.weights.split(",") if f]
    quantized = bench_quantized_linears(presets, formats, args.repeats, args.prefill_rows, args.stream_mib)
    if quantized:
        bf16_us = {(r["preset"], r["linear"]): r["tilefx_us"] for r in linears}
        print(f"\n## quantized weights, M=1 (decode) and M={args.prefill_rows} (prefill)\n")
        print("| shape N x K | used as | format | rel err | MB read | tilefx GB/s | of stream (best) | of stream (paired) | us "
              "| speedup vs bf16 | prefill GFLOP/s |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in quantized:
            print(f"| {r['N']} x {r['K']} | {r['preset']} {r['linear']} | {r['format']} | {r['rel_err']:.1e} "
                  f"| {r['bytes'] / 1e6:.1f} | {r['tilefx_gbps']:.1f} | {r['fraction_of_stream']:.0%} "
                  f"| {r['fraction_of_stream_paired']:.0%} "
                  f"| {r['tilefx_us']:.0f} | {bf16_us[(r['preset'], r['linear'])] / r['tilefx_us']:.2f}x "
                  f"| {r['prefill_tilefx_gflops']:.0f} |")

    fixed_cost = bench_gemv_fixed_cost(presets[0], max(3, args.repeats // 3), args.stream_mib)
    print(f"\n## a decode GEMV's cost beyond its bytes (bf16, K {fixed_cost[0]['K']}, cold copies): time per call "
          "against bytes, fitted to a line\n")
    print("| threads | " + " | ".join(f"{b / 2**20:.0f} MiB us" for b in fixed_cost[0]["bytes"])
          + " | fixed us a call | slope GB/s | stream GB/s |")
    print("|---:|" + "---:|" * (len(FIXED_COST_N) + 3))
    for r in fixed_cost:
        print(f"| {r['threads']} | " + " | ".join(f"{us:.1f}" for us in r["us"])
              + f" | {r['fixed_us']:.1f} | {r['slope_gbps']:.1f} | {r['stream_gbps']:.1f} |")

    attention = bench_attention(presets[0], contexts, args.repeats, args.stream_mib)
    print(f"\n## attention ({presets[0]} heads; MLA: DeepSeek-V2-Lite's), the unit's kernel vs PyTorch SDPA over the "
          "valid prefix and (decode) flash decoding on brgemm tiles\n")
    print("| op | new tokens | context | rel err | unit us | SDPA us | brgemm us | KV read GB/s (unit) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in attention:
        sdpa = f"{r['sdpa_us']:.0f}" if r["sdpa_us"] else "n/a"
        brgemm = f"{r['brgemm_us']:.0f}" if r["brgemm_us"] else "n/a"
        print(f"| {r['op']} | {r['new_tokens']} | {r['context']} | {r['rel_err']:.1e} | {r['tilefx_us']:.0f} "
              f"| {sdpa} | {brgemm} | {r['kv_gbps']:.1f} |")

    moe = [row for preset in args.moe_presets.split(",") if preset
           for row in bench_moe(preset, args.moe_tokens, args.repeats, args.stream_mib)]
    if moe:
        print("\n## MoE routed experts, one layer: tilefx.fused_moe vs HF's experts module (grouped_mm), bf16, random "
              "routing\n")
        print("| preset | experts x I, top k | tokens | rel err | tilefx ms | HF ms | speedup | tilefx | HF | stream GB/s |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in moe:
            if r["tokens"] == 1:
                ours, theirs = f"{r['tilefx_gbps']:.1f} GB/s", f"{r['hf_gbps']:.1f} GB/s"
            else:
                ours = f"{r['tilefx_gflops']:.0f} GFLOP/s, {r['tilefx_gbps']:.1f} GB/s"
                theirs = f"{r['hf_gflops']:.0f} GFLOP/s, {r['hf_gbps']:.1f} GB/s"
            print(f"| {r['preset']} | {r['experts']} x {r['intermediate']}, {r['top_k']} | {r['tokens']} "
                  f"| {r['rel_err']:.1e} | {r['tilefx_ms']:.2f} | {r['hf_ms']:.2f} | {r['hf_ms'] / r['tilefx_ms']:.2f}x "
                  f"| {ours} | {theirs} | {r['stream_gbps']:.1f} |")
        print("\n(one token: the bytes of the selected experts' weights over the time; a prompt: its experts' "
              "multiply-adds over the time, and the bytes of the experts its routing chose, each read once; the "
              "streaming-read probe before and after tilefx's calls, averaged)")

    glue = bench_inductor_glue(presets[0], steps=20)
    print(f"\n## left to Inductor: its generated kernels in a tilefx decode step ({presets[0]}, 2 layers)\n")
    print(f"{glue['kernels_per_step']:.0f} kernels per step, {glue['inductor_us_per_step']:.0f} us in all "
          f"({glue['inductor_us_per_kernel']:.1f} us each); one tilefx custom-op call costs "
          f"{glue['custom_op_call_us']:.1f} us before any work, so a native norm or RoPE op cannot beat them.")
    for name, us in glue["top"]:
        print(f"  {us:7.1f} us  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"path": isa.current(), "walks": [dataclasses.asdict(w) for w in walks], "linear": linears, "quantized_linear": quantized, "attention": attention,
                       "moe": moe, "gemv_fixed_cost": fixed_cost, "glue": glue}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
