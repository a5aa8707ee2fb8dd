#!/usr/bin/env python
"""Eager vs stock torch.compile vs tilefx: TTFT and TPOT of generate(), in one process.

    python scripts/bench_tpot.py                       # Llama-3.2-1B preset, prompt 128, 32 new tokens
    python scripts/bench_tpot.py --preset qwen3-1.7b --layers 8 --json out.json --plot out.png
    python scripts/bench_tpot.py --path ./my-checkpoint
    python scripts/bench_tpot.py --modes tilefx --weights bf16,int8,fp8   # one tilefx row per weight format
    python scripts/bench_tpot.py --modes tilefx --weights int8,int4,int4/x8   # int4/x8: TILEFX_INT4_ACTIVATIONS=int8
    python scripts/bench_tpot.py --modes torch.compile,tilefx --profile   # also: where a prefill's and a step's time go
    python scripts/bench_tpot.py --modes tilefx --options '{"recycle_buffers": false}'   # compile_model options
    torchrun --nproc-per-node 2 scripts/bench_tpot.py --tp 2 --preset llama-3.2-1b   # tensor parallel (tilefx only)

Each mode runs the same greedy request through transformers' generate(); a streamer
timestamps every token. Modes are interleaved, runs repeated, medians reported. The
memory floor is the bytes one decode step must read (weights, with the embedding
table only when lm_head is tied to it, plus the KV cache) over the streaming-read
bandwidth measured in this run; for a tilefx row, the bytes its packed weights hold
in their format (quantized values and their scales), so each format is held to its
own floor. The bandwidth is probed between samples, and "TPOT / floor" is the median
of each sample's TPOT over the floor at the mean of the probes around it; the speedup columns are
medians of each run's ratios. (A shared machine's bandwidth drifts within one run:
against the run's median probe that drift would read as the kernels'.) A run's TTFT is the
least of ``--ttft-prompts`` prompts (the timed request's, then one-token requests, the modes
in turn, after the TPOT samples): a prompt is compute-bound, and what disturbs it (other tenants'
load, the probe just before it) only ever adds to its time.

With ``--tp N`` (under torchrun) every rank compiles the model with ``tp=N`` (a preset is
written to a temporary checkpoint by rank 0 first) and runs the same requests; rank 0
prints the table, the floor is the rank's own bytes over the bandwidth it measured
while the other ranks measured theirs, and the communication share is the time spent
inside the collectives (waiting for the other ranks included) over the time of the
timed generate() calls.

With ``--profile`` each mode also runs one more request under ``torch.profiler`` and prints
where its prefill's time goes (from the prompt to the first new token) and its decode steps' (from
the first new token to the last, per step): each op's own time (its self time: a tilefx op's kernel,
one row per shape of its inputs; a compiled graph's Inductor kernels and Python wrapper under
"## Call CompiledFxGraph ##"), and what no op covers (generate()'s Python between the ops); for a
linear or fused_moe, the rate its weights (with their scales; fused_moe's routed experts, an upper
bound where tokens share them) were read at and its GFLOP/s. The profiler adds a few microseconds to
every op, so the step it shows is a little slower than TPOT.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM

import tilefx
from tilefx.custom_ops import isa, weights
from tilefx.models.adapters import adapter_for
from tilefx.models.presets import build_model

MODES = ("eager", "torch.compile", "tilefx")


class TokenClock:
    """A generate() streamer that timestamps each put(): the prompt first, then every new token."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value):
        self.stamps.append(time.perf_counter())

    def end(self):
        pass


def expert_share(moe: dict, batch: int) -> float:
    """The share of a MoE layer's routed experts one decode step of ``batch`` sequences reads: each token's
    router picks ``top_k`` of ``num_experts``; over ``batch`` tokens, the expected number of distinct experts
    (routing taken as uniform)."""
    experts, top_k = moe["num_experts"], moe["top_k"]
    return 1.0 - (1.0 - top_k / experts) ** batch


def decode_bytes(model, context: int, batch: int = 1) -> int:
    """Bytes one decode step of ``batch`` sequences reads: every weight once (the input embedding only a row),
    plus each sequence's KV cache.

    Of a MoE layer's routed experts, a step reads only those its tokens' routers chose (``expert_share``).
    """
    embed = model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings().weight
    total = sum(p.nbytes for p in model.parameters())
    if lm_head.data_ptr() != embed.data_ptr():
        total -= embed.nbytes
    adapter = adapter_for(model.config)
    if adapter.moe is not None:
        experts = sum(p.nbytes for name, p in model.named_parameters() if ".experts." in name)
        total -= int(experts * (1.0 - expert_share(adapter.moe_dims(model.config), batch)))
    return total + batch * kv_cache_bytes(model, context)


def kv_cache_bytes(model, context: int) -> int:
    """The KV cache one decode step reads at ``context`` tokens (a tilefx model's: what its cache holds per token,
    a tensor-parallel rank's heads only)."""
    runtime = getattr(model, "tilefx", None)
    if runtime is not None:
        cache = runtime.cache
        return cache.nbytes * context // (runtime.options.max_batch * runtime.options.max_seq_len)
    dims = adapter_for(model.config).cache_dims(model.config)
    per_token = dims["layers"] * dims["kv_heads"] * (dims["k_head_dim"] + dims["v_head_dim"])
    return per_token * context * model.get_input_embeddings().weight.element_size()


def packed_decode_bytes(model, context: int, batch: int = 1) -> int:
    """``decode_bytes`` of a tilefx-compiled model, from what it holds: each packed weight in its format
    (values and scales; routed experts' share as above), the parameters left unpacked (the input
    embedding only when tied, as packed), plus the KV cache."""
    packings, unpacked = {}, 0
    embed = model.get_input_embeddings().weight
    for param in model.parameters():
        hits = weights.packings_of(param)
        for packed, _ in hits:
            packings[id(packed)] = packed
        if not hits and param is not embed:
            unpacked += param.nbytes
    adapter = adapter_for(model.config)
    moe = adapter.moe_dims(model.config) if adapter.moe is not None else None
    total = unpacked
    for packed in packings.values():
        share = expert_share(moe, batch) if moe and packed.layout.startswith("expert") else 1.0
        total += int(packed.nbytes * share)
    return total + batch * kv_cache_bytes(model, context)


# New tokens of the request each mode runs before the timed ones (no more than --new-tokens: the models' caches hold
# the prompt and --new-tokens, and a warm-up of 3 refused --new-tokens 2).
WARM_UP_TOKENS = 3


def greedy(model, input_ids, new_tokens: int, **kwargs):
    return model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        # exactly new_tokens from random weights: no end-of-sequence token at all. (min_new_tokens
        # would do it too, but its logits processor scans the whole vocabulary for EOS every
        # step, a cost a plain generate() never pays.)
        eos_token_id=None,
        do_sample=False,
        **kwargs,
    )


def token_times(model, input_ids, new_tokens: int, **kwargs) -> list[float]:
    """Seconds from the start of a greedy request to each of its new tokens."""
    clock = TokenClock()
    start = time.perf_counter()
    greedy(model, input_ids, new_tokens, streamer=clock, **kwargs)
    return [stamp - start for stamp in clock.stamps[1:]]  # [0] is the prompt


def timed_generate(model, input_ids, new_tokens: int, **kwargs) -> tuple[float, float]:
    times = token_times(model, input_ids, new_tokens, **kwargs)
    return times[0], statistics.median(b - a for a, b in zip(times, times[1:]))


def time_to_first_token(model, input_ids, **kwargs) -> float:
    """TTFT of a one-token request: no decode step after it."""
    return token_times(model, input_ids, 1, **kwargs)[0]


class ProfiledTokens(TokenClock):
    """A generate() streamer that also marks each token in torch.profiler's trace."""

    def put(self, value):
        with torch.profiler.record_function(TOKEN_MARK):
            super().put(value)


TOKEN_MARK = "bench_tpot: token"
LINEAR_OPS = ("tilefx::linear", "tilefx::linear_silu_mul", "tilefx::linear_float")
ELEMENT_BYTES = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "signed char": 1, "unsigned char": 1,
                 "c10::Float8_e4m3fn": 1}


def op_weight_bytes(name: str, shapes, dtypes) -> int:
    """The weight bytes one call of a tilefx linear or fused_moe reads, from its inputs' shapes and dtypes: a
    linear's inputs after x (the packed weight, its scales, a bias); fused_moe's w13, w2 and their scales for
    each routed (token, expert), an upper bound where tokens share experts."""
    sizes = [math.prod(shape) * ELEMENT_BYTES.get(dtype, 0) for shape, dtype in zip(shapes, dtypes)]
    if name in LINEAR_OPS:
        return sum(sizes[1:])
    if name == "tilefx::fused_moe" and len(shapes) >= 5 and shapes[1]:
        experts, routed = shapes[1][0], math.prod(shapes[4])
        per_expert = sum(size // experts for i, size in enumerate(sizes) if i in (1, 2) or i >= 5)
        return per_expert * min(routed, experts)
    return 0


def op_flops(name: str, shapes, dtypes) -> int:
    """The floating-point operations (2 per multiply-add) one call of a tilefx linear or fused_moe does, from its
    inputs' shapes and dtypes: every row of x times the whole weight; fused_moe's routed rows each times one
    expert's w13 and w2. int4 holds two weights a byte; 0 where the dtypes are unknown."""
    if not dtypes or len(shapes) < 2 or not shapes[0] or not shapes[1]:
        return 0
    weights = [math.prod(shape) * (2 if dtype == "unsigned char" else 1) for shape, dtype in zip(shapes, dtypes)]
    if name in LINEAR_OPS:
        return 2 * math.prod(shapes[0][:-1]) * weights[1]
    if name == "tilefx::fused_moe" and len(shapes) >= 5:
        return 2 * math.prod(shapes[4]) * (weights[1] + weights[2]) // shapes[1][0]
    return 0


def ops_between(events, begin: float, end: float, per: int, top: int) -> dict:
    """The self times of the ops that start in [begin, end), per ``per`` (steps or one prompt): the largest
    ``top`` by name (tilefx ops by name and input shapes), the rest summed, and the time no op covers; for a
    linear or fused_moe the rate its weights were read at and its GFLOP/s."""
    totals = {}
    for event in events:
        if not begin <= event.time_range.start < end or event.name == TOKEN_MARK:
            continue
        key = event.name
        if key.startswith("tilefx::"):  # one row per shape: qkv, o_proj, down_proj, lm_head apart
            key += " " + " ".join(str(shape) for shape in event.input_shapes if shape)
        calls, us, weight_bytes, flops = totals.get(key, (0, 0.0, 0, 0))
        # (input_dtypes is recent: an older torch's events lack it, and the GB/s column stays empty)
        dtypes = getattr(event, "input_dtypes", None) or []
        totals[key] = (calls + 1, us + event.self_cpu_time_total,
                       weight_bytes + op_weight_bytes(event.name, event.input_shapes, dtypes),
                       flops + op_flops(event.name, event.input_shapes, dtypes))
    ops = sorted(({"op": key, "calls": calls / per, "ms": us / per / 1e3,
                   "weight_gbps": weight_bytes / (us * 1e3) if weight_bytes and us else None,
                   "gflops": flops / (us * 1e3) if flops and us else None}
                  for key, (calls, us, weight_bytes, flops) in totals.items()), key=lambda o: -o["ms"])
    ms = (end - begin) / per / 1e3
    shown, rest = ops[:top], ops[top:]
    shown.append({"op": f"{len(rest)} other ops", "calls": sum(o["calls"] for o in rest),
                  "ms": sum(o["ms"] for o in rest), "weight_gbps": None, "gflops": None})
    shown.append({"op": "outside any op (Python between the ops)", "calls": None,
                  "ms": ms - sum(o["ms"] for o in ops), "weight_gbps": None, "gflops": None})
    return {"ms": ms, "ops": shown}


def profile_request(model, input_ids, new_tokens: int, top: int = 12, **kwargs) -> dict:
    """Where one request's time goes (``--profile``): one request under torch.profiler; its prefill (from the
    prompt to the first new token) and its decode steps (from the first new token to the last, per step), op by
    op (``ops_between``)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        greedy(model, input_ids, new_tokens, streamer=ProfiledTokens(), **kwargs)
    events = prof.events()
    marks = sorted(e.time_range.start for e in events if e.name == TOKEN_MARK)  # [0] the prompt, then each token
    return {"prefill": ops_between(events, marks[0], marks[1], 1, top),
            "decode": ops_between(events, marks[1], marks[-1], len(marks) - 2, top)}


def print_profile(mode: str, profile: dict, prompt_len: int) -> None:
    """The profile's two tables; a prefill's with each linear's GFLOP/s (a decode step's would repeat its GB/s)."""
    for phase, what, per in (("prefill", f"the prefill of {prompt_len} tokens", "a prompt"),
                             ("decode", "one decode step", "a step")):
        window, prefill = profile[phase], phase == "prefill"
        print(f"\n{mode}: {what} under the profiler, {window['ms']:.2f} ms\n")
        print(f"| op (self time) | calls {per} | ms {per} | share | weight GB/s |" + (" GFLOP/s |" if prefill else ""))
        print("|---|---:|---:|---:|---:|" + ("---:|" if prefill else ""))
        for op in window["ops"]:
            calls = f"{op['calls']:.0f}" if op["calls"] is not None else "-"
            gbps = f"{op['weight_gbps']:.1f}" if op["weight_gbps"] else "-"
            gflops = (f" {op['gflops']:.0f} |" if op["gflops"] else " - |") if prefill else ""
            print(f"| {op['op'][:100]} | {calls} | {op['ms']:.3f} | {op['ms'] / window['ms'] * 100:.1f}% | {gbps} |"
                  + gflops)


def stock_compile(model, max_seq_len: int):
    """What a user gets from torch.compile alone: static cache, freezing, fullgraph."""
    torch._inductor.config.freezing = True
    model.forward = torch.compile(model.forward, fullgraph=True)
    return dict(cache_implementation="static", max_cache_len=max_seq_len)



INT4_X8 = "int4/x8"  # int4 weights, decode reading x as int8 (isa.forced_int4_activations)


def x_form(mode: str):
    """The int4 activation form a row runs under: int8 for an ``int4/x8`` row, else the process's."""
    return isa.forced_int4_activations("int8") if mode.endswith(INT4_X8) else contextlib.nullcontext()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default="llama-3.2-1b", help="preset name (default: llama-3.2-1b)")
    source.add_argument("--path", help="a local HF model directory instead of a preset")
    parser.add_argument("--layers", type=int, help="cut the preset to this many layers")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ttft-prompts", type=int, default=3, metavar="N",
                        help="prompts each mode's TTFT is timed over in a run, the least kept (default 3)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per generate() call (TPOT is per step)")
    parser.add_argument("--long-context", type=int, default=0, metavar="N",
                        help="also time tilefx's decode after an N-token prompt, in the same runs")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    parser.add_argument("--weights", default=None,
                        help="comma-separated weight formats for tilefx (auto, bf16, int8, fp8, int4; int4/x8: int4 with "
                             "decode reading x as int8, TILEFX_INT4_ACTIVATIONS=int8): one tilefx row each "
                             "(default: bf16 for a preset, auto for --path: what the checkpoint holds)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG bar chart here")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel ranks (run under torchrun; tilefx only)")
    parser.add_argument("--cpp-wrapper", action="store_true",
                        help="compile tilefx's graphs with Inductor's C++ wrapper (the cpp_wrapper option)")
    parser.add_argument("--options", default="{}", metavar="JSON",
                        help="compile_model options for every tilefx row (fields of CompileOptions), e.g. "
                             "'{\"recycle_buffers\": false}' to time a runtime option's effect")
    parser.add_argument("--profile", action="store_true",
                        help="also print where each mode's prefill and decode step go, op by op (torch.profiler)")
    args = parser.parse_args(argv)
    args.compile_options = compile_options(args, parser)
    if args.ttft_prompts < 1:
        parser.error("--ttft-prompts must be at least 1")
    if args.tp > 1:
        return main_tp(args, parser)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    formats = [f for f in (args.weights or ("auto" if args.path else "bf16")).split(",") if f]
    if unknown := set(formats) - {"auto", *weights.FORMATS, INT4_X8}:
        parser.error(f"unknown weight formats {sorted(unknown)}; choose from {('auto', *weights.FORMATS, INT4_X8)}")
    if "tilefx" in modes:  # one tilefx row per format: "tilefx" (bf16), "tilefx int8", ...
        at = modes.index("tilefx")
        modes[at : at + 1] = ["tilefx" if f == "bf16" else f"tilefx {f}" for f in formats]
    if args.long_context and "tilefx" not in modes:
        parser.error("--long-context times tilefx in bf16: include tilefx in --modes and bf16 in --weights")
    max_seq_len = max(args.prompt_len, args.long_context) + args.new_tokens

    if args.batch < 1:
        parser.error("--batch must be at least 1")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (TPOT is the time from one new token to the next)")
    name = args.path or f"{args.preset}" + (f" ({args.layers} layers)" if args.layers else "")
    print(f"# {name}: prompt {args.prompt_len}, {args.new_tokens} new tokens, batch {args.batch}, {args.runs} runs, "
          f"{torch.get_num_threads()} threads" + (f"; tilefx options {args.options}" if args.options != "{}" else ""),
          flush=True)
    # A checkpoint directory: transformers' own load for eager / torch.compile (an FP8 checkpoint dequantized, as
    # transformers runs it on a CPU), and each tilefx row compiles the directory itself, as a user would.
    hf_modes = [m for m in modes if not m.startswith("tilefx")]
    if args.path:
        base = AutoModelForCausalLM.from_pretrained(args.path, dtype=torch.bfloat16).eval() if hf_modes else None
    else:
        base = build_model(args.preset, layers=args.layers)
    models, gen_kwargs = {}, {}
    for mode in modes:
        start = time.perf_counter()
        # torch.compile leaves the weights alone: it shares the eager model's (a shallow copy with its own
        # forward); tilefx packs and releases them, so it gets its own model unless it runs alone
        shared = len(modes) > 1
        model = base if mode == "eager" else copy.copy(base) if mode == "torch.compile" else (
            copy.deepcopy(base) if shared and not args.path else base)
        gen_kwargs[mode] = {}
        if mode == "torch.compile":
            gen_kwargs[mode] = stock_compile(model, args.prompt_len + args.new_tokens)  # its own need only
        elif mode.startswith("tilefx"):
            format = mode.split()[1] if " " in mode else "bf16"
            source = args.path if args.path else model
            with x_form(mode):  # (the walk tuning times int4 in the form it will read)
                model = tilefx.compile_model(source, max_seq_len=max_seq_len, max_batch=args.batch,
                                             weights=format.removesuffix("/x8"), **args.compile_options)
        models[mode] = model
        print(f"# {mode}: ready in {time.perf_counter() - start:.0f}s", flush=True)

    generator = torch.Generator().manual_seed(0)
    vocab_size = models[modes[0]].config.vocab_size
    input_ids = torch.randint(10, vocab_size - 1, (args.batch, args.prompt_len), generator=generator)
    long_ids = torch.randint(10, vocab_size - 1, (1, args.long_context), generator=generator)
    long_context = args.long_context > 0
    with torch.no_grad():
        for mode in modes:  # warm-up: compiles stock torch.compile's graphs for these shapes
            with x_form(mode):
                timed_generate(models[mode], input_ids, min(WARM_UP_TOKENS, args.new_tokens), **gen_kwargs[mode])
        samples = {mode: [] for mode in modes}
        long_samples, bandwidth = [], []
        bandwidth.append(isa.stream_read_gbps())
        for _ in range(args.runs):
            timed, prompts = {}, {}
            for mode in modes:
                with x_form(mode):
                    ttft, tpot = timed_generate(models[mode], input_ids, args.new_tokens, **gen_kwargs[mode])
                bandwidth.append(isa.stream_read_gbps())  # each sample's floor: the probes just before and after it
                timed[mode], prompts[mode] = (tpot, (bandwidth[-2] + bandwidth[-1]) / 2), [ttft]
            # TTFT from more prompts, the modes in turn, after the TPOT samples (so that no probe moves away from
            # its sample). A prompt is compute-bound and what disturbs it only adds to its time: on a shared 2-core
            # Zen 4 a prompt right after the probe ran ~10% long, and a third of all prompts 15-90% long
            # (docs/PERFORMANCE.md, thirty-seventh session). So a run keeps its least.
            for _ in range(args.ttft_prompts - 1):
                for mode in modes:
                    with x_form(mode):
                        prompts[mode].append(time_to_first_token(models[mode], input_ids, **gen_kwargs[mode]))
            for mode in modes:
                samples[mode].append((min(prompts[mode]), *timed[mode], prompts[mode]))
            if long_context:
                long_samples.append(timed_generate(models["tilefx"], long_ids, args.new_tokens))
        profiles = {}
        if args.profile:  # after the timed runs, so the profiler's cost is in none of them
            for mode in modes:
                with x_form(mode):
                    profiles[mode] = profile_request(models[mode], input_ids, args.new_tokens, **gen_kwargs[mode])

    gbps = statistics.median(bandwidth)
    context = args.prompt_len + args.new_tokens // 2  # the KV cache read by the median decode step
    step_bytes = (decode_bytes(base, context, args.batch) if base is not None
                  else packed_decode_bytes(models[modes[0]], context, args.batch))
    floor_ms = step_bytes / (gbps * 1e9) * 1e3
    rows = []
    for mode in modes:
        ttft = statistics.median(s[0] for s in samples[mode]) * 1e3
        tpot = statistics.median(s[1] for s in samples[mode]) * 1e3
        own_bytes = packed_decode_bytes(models[mode], context, args.batch) if mode.startswith("tilefx") else step_bytes
        own_floor = own_bytes / (gbps * 1e9) * 1e3
        # each sample against the bandwidth probed around it: a shared machine's bandwidth drifts within
        # a run, which a ratio to the run's median probe would count as the kernels'
        over_floor = statistics.median(s[1] * s[2] * 1e9 / own_bytes for s in samples[mode])
        rows.append({"mode": mode, "ttft_ms": ttft, "tpot_ms": tpot, "decode_gb": own_bytes / 1e9,
                     "floor_ms": own_floor, "tpot_over_floor": over_floor,
                     "samples": [{"ttft_ms": s[0] * 1e3, "tpot_ms": s[1] * 1e3, "stream_gbps": s[2],
                                  "ttft_prompts_ms": [t * 1e3 for t in s[3]]}
                                 for s in samples[mode]]})

    def run_ratio(reference: str, mode: str, measure: int = 1) -> float | None:
        """The median over runs of each run's ratio reference / mode of TPOT (measure 1) or TTFT (0):
        the runs' drift cancels."""
        if reference not in samples:
            return None
        return statistics.median(r[measure] / s[measure] for r, s in zip(samples[reference], samples[mode]))

    print(f"\nstreaming read {gbps:.1f} GB/s; decode reads {step_bytes / 1e9:.2f} GB "
          f"-> memory floor {floor_ms:.1f} ms/token\n")
    print("| mode | decode reads GB | floor ms | TTFT ms | TPOT ms | TPOT / floor | TPOT speedup vs eager "
          "| vs torch.compile | vs tilefx bf16 | TTFT speedup vs tilefx bf16 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    references = {"speedup_vs_eager": "eager", "speedup_vs_torch_compile": "torch.compile",
                  "speedup_vs_tilefx_bf16": "tilefx"}
    for row in rows:
        shown = {name: run_ratio(reference, row["mode"]) for name, reference in references.items()}
        row.update({name: value for name, value in shown.items() if value is not None})
        # TTFT too, per run: one prefill is one moment of a drifting machine, and formats differ little in it
        ttft_vs_bf16 = run_ratio("tilefx", row["mode"], measure=0)
        if ttft_vs_bf16 is not None:
            row["ttft_speedup_vs_tilefx_bf16"] = ttft_vs_bf16
        speedup, vs_stock, vs_bf16, ttft_vs = (f"{v:.2f}x" if v is not None else "-"
                                               for v in (*shown.values(), ttft_vs_bf16))
        print(f"| {row['mode']} | {row['decode_gb']:.2f} | {row['floor_ms']:.1f} | {row['ttft_ms']:.1f} "
              f"| {row['tpot_ms']:.1f} | {row['tpot_over_floor']:.2f} | {speedup} | {vs_stock} | {vs_bf16} "
              f"| {ttft_vs} |")
    if long_context:
        long_ttft = statistics.median(s[0] for s in long_samples) * 1e3
        long_tpot = statistics.median(s[1] for s in long_samples) * 1e3
        short_tpot = next(r["tpot_ms"] for r in rows if r["mode"] == "tilefx")
        long_floor = packed_decode_bytes(models["tilefx"], args.long_context + args.new_tokens // 2) / (gbps * 1e9) * 1e3
        print(f"\n| tilefx context | TTFT ms | TPOT ms | TPOT / floor | TPOT / TPOT at prompt {args.prompt_len} (median per run) |")
        print("|---|---:|---:|---:|---:|")
        print(f"| prompt {args.prompt_len} | - | {short_tpot:.1f} | {short_tpot / floor_ms:.2f} | 1.00 |")
        # Each run times both contexts back to back: the median of the per-run ratios cancels the
        # machine's drift between runs, which a ratio of the two medians would not.
        growth = statistics.median(l[1] / s[1] for l, s in zip(long_samples, samples["tilefx"]))
        print(f"| prompt {args.long_context} | {long_ttft:.1f} | {long_tpot:.1f} | {long_tpot / long_floor:.2f} "
              f"| {growth:.3f} |")
        rows.append({"mode": f"tilefx, prompt {args.long_context}", "ttft_ms": long_ttft, "tpot_ms": long_tpot,
                     "tpot_over_floor": long_tpot / long_floor, "tpot_over_short_context": growth})
    for row in rows:
        if row["mode"] in profiles:
            row["profile"] = profiles[row["mode"]]
            print_profile(row["mode"], row["profile"], args.prompt_len)
    for mode in (m for m in modes if m.startswith("tilefx")):
        with x_form(mode):
            print(f"\n[{mode}]\n" + tilefx.explain(models[mode]))
    result = {"model": name, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "batch": args.batch,
              "runs": args.runs, "tilefx_options": args.compile_options,
              "threads": torch.get_num_threads(), "stream_gbps": gbps, "floor_ms": floor_ms, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar([r["mode"] for r in rows], [r["tpot_ms"] for r in rows], color=["#999", "#69c", "#e73", "#f9a", "#c51", "#fc6", "#7b4"][: len(rows)])
        ax.axhline(floor_ms, color="k", linestyle="--", label=f"memory floor {floor_ms:.1f} ms")
        ax.set_ylabel("TPOT (ms, median)")
        ax.set_title(f"{name}, prompt {args.prompt_len}")
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


def compile_options(args, parser) -> dict:
    """--options as compile_model keywords, with --cpp-wrapper; the ones the bench sets itself are refused."""
    try:
        options = json.loads(args.options)
    except json.JSONDecodeError as error:
        parser.error(f"--options is not JSON: {error}")
    if not isinstance(options, dict):
        parser.error(f"--options must be a JSON object of CompileOptions fields, got {args.options}")
    if taken := sorted(set(options) & {"max_seq_len", "max_batch", "weights", "tp"}):
        parser.error(f"--options: {', '.join(taken)} are the bench's own (--prompt-len, --batch, --weights, --tp)")
    return {"cpp_wrapper": args.cpp_wrapper, **options}


def main_tp(args, parser) -> int:
    """``--tp N``: one tilefx row per weight format, every rank timing the same requests."""
    import tempfile

    import torch.distributed as dist

    from tilefx.custom_ops import collectives

    if args.batch != 1:
        parser.error("--tp times batch 1 only")
    from tilefx.models.checkpoint import write_checkpoint

    if set(args.modes.split(",")) - {"tilefx", ""}:
        parser.error("--tp runs tilefx only: pass --modes tilefx")
    if args.long_context or args.plot or args.profile:
        parser.error("--tp: --long-context, --plot and --profile are not supported")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    temporary = None
    path = [args.path]
    if args.path is None:
        if rank == 0:
            temporary = tempfile.mkdtemp(prefix="tilefx-bench-")
            say(f"# writing preset {args.preset} to {temporary}", flush=True)
            path = [str(write_checkpoint(args.preset, f"{temporary}/ckpt", layers=args.layers))]
        dist.broadcast_object_list(path, src=0)
    formats = [f for f in (args.weights or "auto").split(",") if f]
    max_seq_len = args.prompt_len + args.new_tokens
    name = args.path or f"{args.preset}" + (f" ({args.layers} layers)" if args.layers else "")
    rows = []
    try:
        for format in formats:
            start = time.perf_counter()
            model = tilefx.compile_model(path[0], tp=args.tp, max_seq_len=max_seq_len, max_batch=1, weights=format,
                                         **args.compile_options)
            say(f"# tilefx {format}, tp={args.tp}: ready in {time.perf_counter() - start:.0f}s, "
                f"{torch.get_num_threads()} threads per rank", flush=True)
            communicator = collectives.group(collectives.TP_GROUP)
            ids = torch.randint(10, model.config.vocab_size - 1, (1, args.prompt_len),
                                generator=torch.Generator().manual_seed(0))
            timed_generate(model, ids, min(WARM_UP_TOKENS, args.new_tokens))
            samples, bandwidth, shares, waits = [], [], [], []
            for _ in range(args.runs):
                dist.barrier()
                bandwidth.append(isa.stream_read_gbps())
                dist.barrier()
                before, wall = communicator.stats(), time.perf_counter()
                ttft, tpot = timed_generate(model, ids, args.new_tokens)
                wall, after = time.perf_counter() - wall, communicator.stats()
                shares.append((after["seconds"] - before["seconds"]) / wall)
                if after["wait_seconds"] is not None:
                    waits.append((after["wait_seconds"] - before["wait_seconds"]) / wall)
                # TTFT the least of the run's prompts, as without --tp
                samples.append((min([ttft] + [time_to_first_token(model, ids) for _ in range(args.ttft_prompts - 1)]),
                                tpot))
            gbps = statistics.median(bandwidth)
            every_rank = [None] * dist.get_world_size()  # each rank's median waiting share: who waits for whom
            dist.all_gather_object(every_rank, statistics.median(waits) if waits else None)
            step_bytes = packed_decode_bytes(model, args.prompt_len + args.new_tokens // 2)
            row = {"mode": f"tilefx {format} tp={args.tp}", "ttft_ms": statistics.median(s[0] for s in samples) * 1e3,
                   "tpot_ms": statistics.median(s[1] for s in samples) * 1e3, "decode_gb": step_bytes / 1e9,
                   "floor_ms": step_bytes / (gbps * 1e9) * 1e3, "stream_gbps": gbps,
                   "communication_share": statistics.median(shares),
                   "waiting_share": statistics.median(waits) if waits else None, "collectives": communicator.kind,
                   "waiting_share_per_rank": every_rank}
            row["tpot_over_floor"] = row["tpot_ms"] / row["floor_ms"]
            rows.append(row)
            say(f"\n[rank 0]\n{tilefx.explain(model)}")
            del model
    finally:
        if temporary is not None:
            import shutil

            shutil.rmtree(temporary, ignore_errors=True)
    say(f"\n# {name}: prompt {args.prompt_len}, {args.new_tokens} new tokens, {args.runs} runs, rank 0's figures\n")
    say("| mode | collectives | rank's decode reads GB | stream GB/s | floor ms | TTFT ms | TPOT ms | TPOT / floor "
        "| in collectives | of which waiting |")
    say("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        waiting = f"{r['waiting_share'] * 100:.1f}%" if r["waiting_share"] is not None else "-"
        say(f"| {r['mode']} | {r['collectives']} | {r['decode_gb']:.2f} | {r['stream_gbps']:.1f} | {r['floor_ms']:.1f} "
            f"| {r['ttft_ms']:.1f} | {r['tpot_ms']:.1f} | {r['tpot_over_floor']:.2f} | "
            f"{r['communication_share'] * 100:.1f}% | {waiting} |")
    for r in rows:
        if r["waiting_share_per_rank"][0] is not None:
            say(f"# {r['mode']}: each rank's share of time waiting for the others: "
                + ", ".join(f"rank {i} {w * 100:.1f}%" for i, w in enumerate(r["waiting_share_per_rank"])))
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump({"model": name, "tp": args.tp, "rows": rows}, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
