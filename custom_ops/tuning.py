"""How the decode walks stream weights on this machine, tuned by measuring (FFTW / ATLAS style).

A decode linear is a GEMV that must read its weight at the memory's speed. How a walk
gets there depends on the CPU: two concurrent streams per thread and a short non-temporal
software prefetch read at the streaming bandwidth on AMD Zen, while the same walk keeps too few
misses in flight on an Intel Xeon 6, where one block at a time without prefetch, or a
different distance, does better (docs/PERFORMANCE.md). So the walk's parameters are not constants:
``ensure_tuned`` searches the candidates (``candidates``: streams per thread x prefetch distance x
prefetch hint; then, where some weight of the pass has too few column blocks for the threads, how
many tasks a thread a decode splits K into: ``SPLIT_CANDIDATES``) on a decode-like pass over cold
weights, once per CPU, thread count, kernel sources, linear unit and weight format, keeps the fastest in the native table
(``csrc/tuning.h``) and caches the result as JSON next to tilefx's graph cache
(``cache_root()``), so a later process reads it instead of timing again.

The same module picks the linear ops' GEMM (``ensure_gemm_tuned``: the unit's or oneDNN's brgemm, above 4 rows
per weight format, at 1 to 4 rows for bf16) and attention's per model (``ensure_attention_tuned``: for prefill the
path's attention unit, PyTorch's own SDPA or tilefx's flash attention on brgemm, for decode the unit or flash
decoding on brgemm, timed on the model's head shape); see below.

Correctness never depends on the choice: every candidate computes the same products
(tests force each one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import statistics
import time

import torch

from tilefx.custom_ops import isa, weights
from tilefx.custom_ops.weights import formats, layouts, memory

STREAMS = (1, 2)
PREFETCH_BYTES = (0, 256, 512, 1024, 2048, 4096)  # 0: no prefetch
PREFETCH_HINTS = ("nta", "t0", "t1")  # csrc/kernels.h PrefetchHint
# A walk is (streams, prefetch bytes, prefetch hint); without prefetch the hint means nothing and is "nta".
CANDIDATES = tuple((s, d, h) for s in STREAMS for d in PREFETCH_BYTES for h in PREFETCH_HINTS if d or h == "nta")
# The search first times every streams x hint at this one distance, and no prefetch (``scouts``: 8 walks), then every
# distance for the best prefetching streams and hint (``distances``: 5): 13 of the 32 walks, taking the hint's and
# the distance's effects to be apart.
SCOUT_BYTES = 1024
# A tuned choice replaces the default only when a second, independent head-to-head (CONFIRM_ROUNDS rounds of
# the two alone) finds it this much faster: the fastest of many noisy candidates looks faster than it is.
MIN_GAIN = 1.03
CONFIRM_ROUNDS = 7


def fastest_by_min_gain(seconds: dict, default):
    """The choice of least ``seconds`` where it beats ``default``'s by ``MIN_GAIN``; else ``default``."""
    fastest = min(seconds, key=seconds.get)
    return fastest if seconds[fastest] * MIN_GAIN < seconds[default] else default


def confirmed_fastest(seconds: dict, default, time_again) -> tuple:
    """``fastest_by_min_gain(seconds, default)``, where a winner other than ``default`` must win again head to head
    (``time_again([default, winner])``, seconds per choice): the fastest of several noisy candidates looks faster
    than it is. Returns (the choice, the head to head's seconds, or None where none ran)."""
    chosen = fastest_by_min_gain(seconds, default)
    if chosen == default:
        return chosen, None
    again = time_again([default, chosen])
    return fastest_by_min_gain(again, default), again


# One decode-like layer (hidden 2048, Llama-3.2-1B's shapes: q/k/v, o, gate/up, down), repeated until the
# pass reads more than the last-level cache holds several times over, so every sample reads DRAM.
LAYER_SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))
MIN_PASS_BYTES, MAX_PASS_BYTES = 256 << 20, 1536 << 20
ROUNDS = 5
# Decode split along K (csrc/tuning.h decode_split): tasks a thread below which a decode linear splits its blocks'
# K into slices, timed with the chosen walk where some shape of the pass would split at this thread count (on
# many cores; on 2 threads none does). 0: never split, the default.
SPLIT_CANDIDATES = (4, 8)
SPLIT_BYTES = 32 << 10  # csrc/tuning.h kSplitBytes: bytes of each block a slice holds at least


@dataclasses.dataclass(frozen=True)
class Tuned:
    """The walk one unit uses for one weight format, and where the choice came from."""

    unit: str
    format: str
    streams: int
    prefetch_bytes: int
    prefetch_hint: str
    how: str  # "tuned" (timed now), "cached" (timed by an earlier process), "untuned" (tuning off)
    gbps: float = 0.0  # the choice's median GB/s over the timed pass (0: not timed)
    default_gbps: float = 0.0  # the default's, in the same run
    seconds: float = 0.0  # time spent timing
    split: int = 0  # decode split: tasks a thread below which K is split (0: never)
    split_gbps: dict = dataclasses.field(default_factory=dict)  # tasks a thread (0: unsplit) -> GB/s, where timed

    @property
    def walk(self) -> tuple[int, int, str]:
        return self.streams, self.prefetch_bytes, self.prefetch_hint

    def line(self) -> str:
        prefetch = f"prefetch {self.prefetch_bytes} B {self.prefetch_hint}" if self.prefetch_bytes else "no prefetch"
        what = f"{self.unit} {self.format}: {self.streams} stream(s), {prefetch}"
        if self.how == "untuned":
            return f"{what} (not tuned)"
        if self.split:
            what += f", K split below {self.split} tasks a thread"
        gain = f", {self.gbps:.1f} GB/s vs the default's {self.default_gbps:.1f}" if self.gbps else ""
        if self.split_gbps:
            gain += "; K split: " + ", ".join(f"{'none' if n == 0 else f'{n} tasks a thread'} {g:.1f} GB/s"
                                              for n, g in self.split_gbps.items())
        return f"{what} ({self.how}{gain}{f', {self.seconds:.1f}s' if self.how == 'tuned' else ''})"


def current(unit: str, format: str) -> tuple[int, int, str]:
    """(streams, prefetch bytes, prefetch hint) the native kernels use now."""
    return tuple(isa.native.get_walk_tuning(unit, format))


@contextlib.contextmanager
def _temporarily(getter, setter, key: tuple, value: tuple):
    """A native table's entry ``key`` at ``value`` for a block, then back to what it was."""
    previous = getter(*key)
    setter(*key, *value)
    try:
        yield
    finally:
        setter(*key, *(previous if isinstance(previous, tuple) else (previous,)))


def forced(unit: str, format: str, streams: int, prefetch_bytes: int, prefetch_hint: str = "nta"):
    """Run a block with the given walk (tests, benchmarks)."""
    return _temporarily(isa.native.get_walk_tuning, isa.native.set_walk_tuning, (unit, format),
                        (streams, prefetch_bytes, prefetch_hint))


def forced_split(format: str, tasks_per_thread: int):
    """Run a block with the decode split of ``format`` at ``tasks_per_thread`` (0: off; tests, benchmarks)."""
    return _temporarily(isa.native.get_decode_split, isa.native.set_decode_split, (format,), (tasks_per_thread,))


def splits(out_features: int, in_features: int, format: str, tasks_per_thread: int, threads: int) -> bool:
    """Whether a decode linear of this shape over ``format`` weights splits K at ``tasks_per_thread`` on ``threads``
    threads (csrc/linear_ops.cpp split_slice_pairs: fewer block pairs than the tasks wanted, K wide enough for 2
    slices of SPLIT_BYTES of a block)."""
    blocks, k_pairs, columns, values = layouts.packed_shape(out_features, in_features)
    pair_bytes = columns * values * formats.FORMATS[format].itemsize
    return (0 < tasks_per_thread and format != "int4" and -(-blocks // 2) < tasks_per_thread * threads
            and k_pairs // (SPLIT_BYTES // pair_bytes) >= 2)


def candidates(unit: str, format: str) -> tuple[tuple[int, int, str], ...]:
    """The walks that differ on ``unit`` for ``format``: those of no more streams than the unit's GEMV reads that
    format in (the library's ``walk_streams``: the AVX2 unit reads int4 one block at a time)."""
    most = isa.native.walk_streams(unit, format)
    return tuple(c for c in CANDIDATES if c[0] <= most)


def decode_units(path: str) -> tuple[str, ...]:
    """The linear units that run decode GEMVs on ``path`` (the plain linears' and the experts')."""
    units = isa.kernel_units(path)
    return tuple(sorted({units[op] for op in ("linear_float", "moe") if op in units}))


def cache_root() -> pathlib.Path:
    """Where tilefx keeps what it caches per machine: ``TILEFX_GRAPH_CACHE_DIR``, else ``tilefx/`` in
    Inductor's cache directory."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return pathlib.Path(os.environ.get("TILEFX_GRAPH_CACHE_DIR") or os.path.join(cache_dir(), "tilefx"))


@functools.cache
def _cpu_key() -> str:
    """The CPU's model name and a digest of its flags and of the kernels' sources."""
    from tilefx import custom_ops  # the package imports this module

    model, flags = "unknown", ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].strip()
    return f"{model}|{hashlib.sha256(f'{flags}|{custom_ops.source_hash()}'.encode()).hexdigest()[:16]}"


def _machine_key(*parts) -> str:
    """A tuning cache key: what every choice depends on (the CPU, its flags, the threads, the kernels' sources)
    and ``parts``, what names the choice (a walk's unit and format; a path and what was timed on it)."""
    model, digest = _cpu_key().rsplit("|", 1)
    return "|".join([model, f"threads={torch.get_num_threads()}", *map(str, parts), digest])


def _store(cache: pathlib.Path | None) -> pathlib.Path:
    return (cache or cache_root()) / "tuning.json"


CPU_CACHES = pathlib.Path("/sys/devices/system/cpu/cpu0/cache")
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def last_level_cache_bytes(caches: pathlib.Path | None = None) -> int:
    """The size of the largest cache CPU 0 has (Linux sysfs: ``index*/size``, such as ``32768K``); 0 where
    unknown. (Python's ``os.sysconf`` often lacks ``SC_LEVEL3_CACHE_SIZE``: it raised here, and every tuning
    pass was 256 MiB, inside a Xeon's 300 MiB L3.)"""
    sizes = []
    for path in (caches or CPU_CACHES).glob("index*/size"):
        try:
            text = path.read_text().strip()
            sizes.append(int(text[:-1]) * _SIZE_UNITS[text[-1]] if text[-1:] in _SIZE_UNITS else int(text))
        except (OSError, ValueError):
            continue
    return max(sizes, default=0)


def _random_packing(n: int, k: int, format: str):
    """``(packed, scales, n, k)``: an [n, k] weight's packing in ``format`` holding random values in range
    (int8: +-127; e4m3: no NaN codes), in huge pages as packed weights are; timing does not read them as numbers.
    One random block of ``_FILL_BLOCK_BYTES`` is repeated over the packing: drawing random values for every byte
    of a tuning pass took ~3 s on a 2-core Zen 4 (bf16's ``normal_`` over 256 MiB and more), most of a tuning."""
    shape = formats.stored_shape(layouts.packed_shape(n, k), format)
    data = memory.huge_page_empty(shape, formats.FORMATS[format])
    raw = data.view(-1).view(torch.uint8)
    block = _random_bytes(min(raw.numel(), _FILL_BLOCK_BYTES), format)
    whole = raw.numel() - raw.numel() % block.numel()
    raw[:whole].view(-1, block.numel()).copy_(block.expand(whole // block.numel(), -1))
    raw[whole:].copy_(block[: raw.numel() - whole])
    scales = torch.ones(formats.scales_shape(shape, format), dtype=formats.SCALE_DTYPES[format]) \
        if format != "bf16" else None
    return data, scales, n, k


_FILL_BLOCK_BYTES = 1 << 20


def _random_bytes(nbytes: int, format: str) -> torch.Tensor:
    """``nbytes`` random bytes of values in range for ``format`` (``nbytes`` even)."""
    if format == "bf16":
        return torch.empty(nbytes // 2, dtype=torch.bfloat16).normal_().view(torch.uint8)
    # (int4: any byte is two nibbles)
    return torch.empty(nbytes, dtype=torch.uint8).random_(0, 256).bitwise_and_(
        {"fp8": 0x77, "int8": 0x7F}.get(format, 0xFF))


def _random_packing_bytes(n: int, k: int, format: str) -> int:
    shape = formats.stored_shape(layouts.packed_shape(n, k), format)
    return math.prod(shape) * formats.FORMATS[format].itemsize


def cold_pass_bytes() -> int:
    """Bytes a pass must cycle through to miss the last-level cache as decode's weight stream does: 4x that
    cache (a non-LRU L3 keeps part of a pass only somewhat larger than itself), within ``MIN_PASS_BYTES`` and
    ``MAX_PASS_BYTES``. The tuning passes and ``scripts/bench_kernels.py`` size their cold weights by it."""
    return min(max(MIN_PASS_BYTES, 4 * last_level_cache_bytes()), MAX_PASS_BYTES)


def _decode_pass(format: str):
    """Cold weights of a decode-like pass in ``format`` (each packed tensor with its scales) and the input."""
    pass_bytes = cold_pass_bytes()
    layer_bytes = sum(_random_packing_bytes(n, k, format) for n, k in LAYER_SHAPES)
    return [_random_packing(n, k, format) for n, k in LAYER_SHAPES * max(1, -(-pass_bytes // layer_bytes))]


def _pass_bytes(tensors) -> int:
    """The bytes a pass over ``tensors`` (``_decode_pass``'s) reads: the packed values and their scales."""
    return sum(d.nbytes + (0 if s is None else s.nbytes) for d, s, _, _ in tensors)


def _time_pass(tensors, inputs) -> float:
    """Seconds of one pass over ``tensors`` (``_decode_pass``'s): each against ``inputs[k]``, or where that is a
    tuple, its entries in turn from one repetition of the layer's shapes to the next (every shape meets each)."""
    start = time.perf_counter()
    for i, (data, scales, n, k) in enumerate(tensors):
        x = inputs[k]
        if isinstance(x, tuple):
            x = x[i // len(LAYER_SHAPES) % len(x)]
        torch.ops.tilefx.linear(x, data, None, n, scales)
    return time.perf_counter() - start


def _interleaved_medians(tensors, inputs, choices, rounds: int, force) -> dict:
    """Median seconds of a pass per choice, run under ``force(choice)``, the choices interleaved in every round
    (drift hits them alike)."""
    times = {choice: [] for choice in choices}
    for _ in range(rounds):
        for choice in choices:
            with force(choice):
                times[choice].append(_time_pass(tensors, inputs))
    return {choice: statistics.median(t) for choice, t in times.items()}


def _medians(tensors, inputs, unit: str, format: str, walks, rounds: int) -> dict[tuple, float]:
    """Median seconds of a pass per walk (``_interleaved_medians``)."""
    return _interleaved_medians(tensors, inputs, walks, rounds, lambda walk: forced(unit, format, *walk))


def scouts(walks) -> tuple:
    """The search's first stage over ``walks`` (``candidates``'): no prefetch, and every hint at ``SCOUT_BYTES``,
    for each stream count."""
    return tuple(w for w in walks if w[1] in (0, SCOUT_BYTES))


def distances(walks, streams: int, hint: str) -> tuple:
    """The second stage: every prefetch distance with the streams and hint of the best prefetching scout."""
    return tuple(w for w in walks if w[0] == streams and w[1] and w[2] == hint)


# Rows of a batch's decode the walk search times besides one row, per format: the most the walk streams (bf16 4,
# kGemvRows; quantized 2, quantized_gemv_rows' least). On the Xeon 6 two walks read the same at one row and 0.86x
# apart at four (`t1` 4096 B against `t0` 2048 B ahead; docs/PERFORMANCE.md, fifty-second session), and a search
# at one row kept the one that cost batch 4 its steps.
BATCH_ROWS = {"bf16": 4}
BATCH_ROWS_QUANTIZED = 2


def tune(unit: str, format: str, path: str) -> Tuned:
    """Search the walks on ``unit`` (a decode unit of kernel path ``path``) for ``format`` weights in two stages
    (``scouts``, then ``distances``), each interleaved over ``ROUNDS`` rounds, then the fastest against the default
    alone; set the fastest where it beats the default by ``MIN_GAIN``. The pass reads its repetitions of the
    layer's shapes at one row and at a batch's rows in turn (``BATCH_ROWS``), so a walk is kept for both."""
    started = time.perf_counter()
    default = current(unit, format)
    tensors = _decode_pass(format)
    batch_rows = BATCH_ROWS.get(format, BATCH_ROWS_QUANTIZED)
    inputs = {k: (torch.randn(1, k).to(torch.bfloat16), torch.randn(batch_rows, k).to(torch.bfloat16))
              for _, k in LAYER_SHAPES}
    nbytes = _pass_bytes(tensors)
    walks = candidates(unit, format)
    with isa.forced(path), forced_decode_gemm(format, "unit", 0), torch.inference_mode():
        _time_pass(tensors, inputs)  # warm-up: page in every tensor, settle the clocks
        scouted = _medians(tensors, inputs, unit, format, tuple(dict.fromkeys((default, *scouts(walks)))), ROUNDS)
        best = min(scouted, key=scouted.get)
        prefetching = min((w for w in scouted if w[1]), key=scouted.get)
        refined = _medians(tensors, inputs, unit, format,
                           tuple(dict.fromkeys((best, *distances(walks, prefetching[0], prefetching[2])))), ROUNDS)
        best = min(refined, key=refined.get)
        final = _medians(tensors, inputs, unit, format, tuple(dict.fromkeys((default, best))), CONFIRM_ROUNDS)
        if final[default] <= final[best] * MIN_GAIN:
            best = default
        # (a split serves 1-2 rows: it is timed at one)
        split, split_gbps = _tune_split(tensors, {k: x[0] for k, x in inputs.items()}, unit, format, best, nbytes)
    isa.native.set_walk_tuning(unit, format, *best)
    isa.native.set_decode_split(format, split)
    return Tuned(unit, format, *best, how="tuned", gbps=nbytes / final[best] / 1e9,
                 default_gbps=nbytes / final[default] / 1e9, seconds=time.perf_counter() - started,
                 split=split, split_gbps=split_gbps)


def _tune_split(tensors, inputs, unit: str, format: str, walk: tuple, nbytes: int) -> tuple[int, dict]:
    """The decode split for ``format`` with ``walk`` set: each of SPLIT_CANDIDATES that would split some shape of
    the pass at this thread count against no split, interleaved over ``ROUNDS``, the fastest confirmed against no
    split over ``CONFIRM_ROUNDS`` (it must win by ``MIN_GAIN``). (0, {}) where no candidate would split."""
    if format == "int4":
        return 0, {}
    threads = torch.get_num_threads()
    tried = [n for n in SPLIT_CANDIDATES if any(splits(n_out, k, format, n, threads) for n_out, k in LAYER_SHAPES)]
    if not tried:
        return 0, {}

    def medians(choices, rounds):
        with forced(unit, format, *walk):
            return _interleaved_medians(tensors, inputs, choices, rounds, lambda n: forced_split(format, n))

    timed = medians((0, *tried), ROUNDS)
    best = min(timed, key=timed.get)
    if best:
        final = medians((0, best), CONFIRM_ROUNDS)
        if final[0] <= final[best] * MIN_GAIN:
            best = 0
    return best, {n: nbytes / t / 1e9 for n, t in timed.items()}


def _saved(store: pathlib.Path) -> dict:
    try:
        return json.loads(store.read_text())
    except (OSError, ValueError):
        return {}


def _save(store: pathlib.Path, saved: dict) -> None:
    with contextlib.suppress(OSError):  # a read-only cache directory: tuned again next time
        store.parent.mkdir(parents=True, exist_ok=True)
        temporary = store.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(saved, indent=1, sort_keys=True))
        temporary.replace(store)


def ensure_tuned(formats_used, *, path: str | None = None, cache: pathlib.Path | None = None,
                 enabled: bool = True) -> list[Tuned]:
    """The walks of every decode unit of ``path`` (default: the current one) for each format in
    ``formats_used``: read from the cache file, else timed (``tune``) and saved; set in the native table.
    ``enabled=False`` reports what the table holds and times nothing."""
    path = path or isa.current()
    if isa.native is None or path == "reference":
        return []
    results = []
    store = _store(cache)
    saved = _saved(store)
    changed = False
    for unit in decode_units(path):
        for format in sorted(set(formats_used)):
            if not enabled:
                results.append(Tuned(unit, format, *current(unit, format), how="untuned",
                                     split=isa.native.get_decode_split(format)))
                continue
            # (int4's walk is timed with x in the form decode reads it: isa.int4_activations)
            key = _machine_key(unit, format, *(["x=" + isa.int4_activations()] if format == "int4" else []))
            entry = saved.get(key)
            if entry is not None and "split" in entry:  # (entries from before the split: timed again)
                walk = entry["streams"], entry["prefetch_bytes"], entry["prefetch_hint"]
                isa.native.set_walk_tuning(unit, format, *walk)
                isa.native.set_decode_split(format, entry["split"])
                results.append(Tuned(unit, format, *walk, how="cached", gbps=entry.get("gbps", 0.0),
                                     default_gbps=entry.get("default_gbps", 0.0), split=entry["split"],
                                     split_gbps={int(n): g for n, g in entry.get("split_gbps", {}).items()}))
                continue
            tuned = tune(unit, format, path)
            saved[key] = {"streams": tuned.streams, "prefetch_bytes": tuned.prefetch_bytes,
                          "prefetch_hint": tuned.prefetch_hint, "gbps": tuned.gbps, "default_gbps": tuned.default_gbps,
                          "split": tuned.split, "split_gbps": tuned.split_gbps}
            changed = True
            results.append(tuned)
    if changed:
        _save(store, saved)
    return results


# -- Prefill attention: the path's attention unit, PyTorch's SDPA or a flash attention on brgemm ----------
# The unit's kernel attends one query row at a time; PyTorch's flash SDPA tiles queries and keys through
# oneDNN GEMMs; tilefx's own flash attention (csrc/attention_brgemm.cpp) makes a tile of query rows (every
# query head of a KV head: GQA and MLA's head folding) one brgemm over each block of keys, AMX where the CPU
# has it. Which leads depends on the CPU and the heads' shape, so each is timed on the model's own head shape
# at a short and a long prompt (brgemm only where it has a compiled kernel). The fastest at the long prompt,
# if it beats the unit there, takes the prompts from the first length class where it leads the unit (and
# leads at every longer one): csrc/tuning.h prefill_attention.
# brgemm is timed in each of its blockings (ATTENTION_TILINGS: query rows a task, keys a step; csrc/tuning.h
# AttentionTiling): larger ones share each brgemm call's fixed cost and the softmax's per-row work among more
# scores, at the price of masked work on the causal diagonal. The fastest at the long prompt, where it beats the
# default by MIN_GAIN, is brgemm's blocking and its times are brgemm's.
# Decode (one new token over a long context) is timed the same way, the unit against flash decoding on brgemm
# tiles (csrc/tuning.h decode_attention): brgemm where it has a compiled kernel and beats the unit at every context
# timed. MLA's 16 heads over one latent head make a tile brgemm fills; GQA's 4 to 8 query heads per KV head
# fill a quarter to half of it.
ATTENTION_LENGTHS = ((128, 2), (1024, 384))  # (the prompt length timed, the first length of its class)
ATTENTION_ROUNDS = 3
ATTENTION_KERNELS = ("unit", "sdpa", "brgemm")  # csrc/tuning.h PrefillAttention
DECODE_ATTENTION_CONTEXTS = (1024, 4096)  # cached tokens a decode step attends, timed
DECODE_ATTENTION_KERNELS = ("unit", "brgemm")  # csrc/tuning.h DecodeAttention
_KERNEL_NAMES = {"unit": "the unit's kernel", "sdpa": "PyTorch SDPA", "brgemm": "flash attention on oneDNN brgemm"}
ATTENTION_TILINGS = ((64, 128), (128, 256), (256, 512))  # (query rows, keys a step); the first is the default


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """One model's attention as the prefill ops see it (a tensor-parallel rank's own heads)."""

    family: str  # "extend" (extend_attention) or "mla" (mla_attention: every head over the one latent head)
    heads: int  # query heads
    kv_heads: int  # mla: 1
    head_dim: int  # mla: kv_lora_rank
    rope_dim: int = 0  # mla: qk_rope_head_dim
    nope_dim: int = 0  # mla: qk_nope_head_dim (mla_prefill's query part and expanded keys)
    v_dim: int = 0  # mla: v_head_dim (mla_prefill's values)

    def describe(self) -> str:
        if self.family == "mla":
            return f"mla, {self.heads} heads over the latent {self.head_dim} + rope {self.rope_dim}"
        return f"{self.heads} query / {self.kv_heads} KV heads of {self.head_dim}"


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    """Which kernel prefill attention runs from how many new tokens (the unit below), and where that came from."""

    shape: AttentionShape
    kernel: str  # one of ATTENTION_KERNELS
    from_tokens: int  # 0 for the unit (every length)
    how: str  # "tuned", "cached", "untuned"
    ms: dict = dataclasses.field(default_factory=dict)  # kernel -> median ms per ATTENTION_LENGTHS entry
    seconds: float = 0.0  # prefill's and decode's timing together
    decode_kernel: str = "unit"  # one of DECODE_ATTENTION_KERNELS
    decode_ms: dict = dataclasses.field(default_factory=dict)  # kernel -> median ms per DECODE_ATTENTION_CONTEXTS
    tiling: tuple = ATTENTION_TILINGS[0]  # brgemm's (query rows, keys a step)
    tiling_ms: dict = dataclasses.field(default_factory=dict)  # tiling -> brgemm's median ms per ATTENTION_LENGTHS

    def decode_line(self) -> str:
        what = f"decode attention ({self.shape.describe()}): " + (
            "flash decoding on oneDNN brgemm" if self.decode_kernel == "brgemm" else _KERNEL_NAMES["unit"])
        if self.how == "untuned":
            return f"{what} (not tuned)"
        kernels = [k for k in DECODE_ATTENTION_KERNELS if k in self.decode_ms]
        timed = "; ".join(f"context {n} " + ", ".join(f"{k} {self.decode_ms[k][i]:.2f} ms" for k in kernels)
                          for i, n in enumerate(DECODE_ATTENTION_CONTEXTS))
        return f"{what} ({self.how}: {timed})"

    def line(self) -> str:
        what = _KERNEL_NAMES[self.kernel]
        if self.kernel == "brgemm":
            what += f" ({self.tiling[0]} query rows x {self.tiling[1]} keys a step)"
        if self.kernel != "unit":
            what += f" from {self.from_tokens} tokens"
        if self.shape.family == "mla" and self.kernel == "brgemm":  # csrc/attention_ops.cpp mla_prefill_cpu
            what += ", over K/V expanded from the latent where that costs fewer multiply-adds"
        what = f"prefill attention ({self.shape.describe()}): {what}"
        if self.how == "untuned":
            return f"{what} (not tuned)"
        kernels = [k for k in ATTENTION_KERNELS if k in self.ms]
        timed = "; ".join(f"{n} tokens " + ", ".join(f"{k} {self.ms[k][i]:.1f} ms" for k in kernels)
                          for i, (n, _) in enumerate(ATTENTION_LENGTHS))
        if len(self.tiling_ms) > 1:
            timed += f"; brgemm at {ATTENTION_LENGTHS[-1][0]} tokens " + ", ".join(
                f"{rows}x{keys} {ms[-1]:.1f} ms" for (rows, keys), ms in self.tiling_ms.items())
        return f"{what} ({self.how}: {timed}{f', {self.seconds:.1f}s' if self.how == 'tuned' else ''})"


def forced_attention(family: str, kernel: str, tokens: int = 2):
    """Run a block with ``family``'s prefill on ``kernel`` from ``tokens`` new tokens on (the unit: every length)."""
    return _temporarily(isa.native.get_prefill_attention, isa.native.set_prefill_attention, (family,),
                        (kernel, tokens))


def forced_attention_tiling(family: str, query_rows: int, key_step: int):
    """Run a block with ``family``'s flash attention on brgemm tiles blocked as given (tests, benchmarks)."""
    return _temporarily(isa.native.get_attention_tiling, isa.native.set_attention_tiling, (family,),
                        (query_rows, key_step))


def forced_prefill(family: str, kernel: str, tiling: tuple | None = None):
    """Run a block with ``family``'s prefill on ``kernel`` and, for brgemm, blocked as ``tiling`` (query rows, keys a
    step; None: as it is)."""
    stack = contextlib.ExitStack()
    stack.enter_context(forced_attention(family, kernel))
    if tiling is not None:
        stack.enter_context(forced_attention_tiling(family, *tiling))
    return stack


def forced_decode_attention(family: str, kernel: str):
    """Run a block with ``family``'s decode attention on ``kernel`` ("unit" or "brgemm")."""
    return _temporarily(isa.native.get_decode_attention, isa.native.set_decode_attention, (family,), (kernel,))


def _attention_call(shape: AttentionShape, seq: int, past: int):
    """``seq`` new tokens at positions [past, past + seq) through ``shape``'s attention op, over a cache of random
    keys and values (fresh random inputs; the new tokens' rows are written over theirs), causally masked."""
    g = torch.Generator().manual_seed(past + seq)

    def rand(*size):
        return torch.randn(*size, generator=g).to(torch.bfloat16)

    end = past + seq
    positions = torch.arange(past, end)
    mask = torch.ones(seq, end, dtype=torch.bool).tril(past)[None, None]
    if shape.family == "mla" and seq > 1:  # what the prefill graphs run: mla_prefill, expanded where that pays
        heads, rank, nope = shape.heads, shape.head_dim, shape.nope_dim
        kv_b = (torch.randn(heads * (nope + shape.v_dim), rank, generator=g) * rank**-0.5).to(torch.bfloat16)
        w_uk, w_uv = (weights.pack_mla_absorbed_weight_reference(kv_b, heads, nope, value) for value in (False, True))
        args = (rand(1, heads, seq, nope), rand(1, heads, seq, shape.rope_dim), rand(1, 1, seq, rank),
                rand(1, 1, seq, shape.rope_dim), rand(1, 1, end, rank), rand(1, 1, end, shape.rope_dim), positions,
                mask, (nope + shape.rope_dim) ** -0.5, w_uk, w_uv, kv_b)
        return lambda: torch.ops.tilefx.mla_prefill(*args)
    if shape.family == "mla":
        args = (rand(1, shape.heads, seq, shape.head_dim), rand(1, shape.heads, seq, shape.rope_dim),
                rand(1, 1, seq, shape.head_dim), rand(1, 1, seq, shape.rope_dim), rand(1, 1, end, shape.head_dim),
                rand(1, 1, end, shape.rope_dim), positions, mask, (shape.head_dim + shape.rope_dim) ** -0.5)
        return lambda: torch.ops.tilefx.mla_attention(*args)
    args = (rand(1, shape.heads, seq, shape.head_dim), rand(1, shape.kv_heads, seq, shape.head_dim),
            rand(1, shape.kv_heads, seq, shape.head_dim), rand(1, shape.kv_heads, end, shape.head_dim),
            rand(1, shape.kv_heads, end, shape.head_dim), positions, mask, shape.head_dim**-0.5)
    return lambda: torch.ops.tilefx.extend_attention(*args)


def decode_call(shape: AttentionShape, context: int):
    """One new token at position ``context - 1`` over a full cache (_attention_call): what tuning times for decode,
    and what ``scripts/bench_kernels.py`` times for its MLA rows."""
    return _attention_call(shape, 1, context - 1)


def _time_kernels(calls, kernels, force) -> dict[str, tuple[float, ...]]:
    """Median ms of each call of ``calls`` under ``force(kernel)`` for each of ``kernels``, interleaved,
    ``ATTENTION_ROUNDS`` rounds after one dropped warm-up round."""
    ms: dict[str, list[float]] = {k: [] for k in kernels}
    for call in calls:
        times: dict[str, list[float]] = {k: [] for k in kernels}
        for _ in range(ATTENTION_ROUNDS + 1):
            for kernel in kernels:
                with force(kernel):
                    start = time.perf_counter()
                    call()
                    times[kernel].append(time.perf_counter() - start)
        for kernel in kernels:
            ms[kernel].append(statistics.median(times[kernel][1:]) * 1e3)
    return {k: tuple(v) for k, v in ms.items()}


def choose_decode_attention(ms: dict) -> str:
    """brgemm where it was timed and beats the unit by ``MIN_GAIN`` at every context; else the unit."""
    if "brgemm" not in ms:
        return "unit"
    return "brgemm" if all(b * MIN_GAIN < u for b, u in zip(ms["brgemm"], ms["unit"])) else "unit"


def choose_tiling(ms: dict) -> tuple:
    """brgemm's blocking from each tiling's median ms per ``ATTENTION_LENGTHS`` entry: the fastest at the longest
    prompt where it beats the default (the first of ``ATTENTION_TILINGS``) there by ``MIN_GAIN``."""
    return fastest_by_min_gain({tiling: times[-1] for tiling, times in ms.items()}, ATTENTION_TILINGS[0])


def prefill_call(shape: AttentionShape, seq: int):
    """A prompt of ``seq`` tokens from position 0 (_attention_call)."""
    return _attention_call(shape, seq, 0)


def choose_attention(ms: dict) -> tuple[str, int]:
    """``(kernel, from_tokens)`` from each kernel's median ms per ``ATTENTION_LENGTHS`` entry: the fastest at the
    longest prompt if it beats the unit there by ``MIN_GAIN``, from the first length class where it beats the
    unit by that at every longer one; else the unit."""
    kernel = min((k for k in ms if k != "unit"), key=lambda k: ms[k][-1], default="unit")
    from_tokens = 0
    for i in reversed(range(len(ATTENTION_LENGTHS))):
        if kernel == "unit" or ms[kernel][i] * MIN_GAIN >= ms["unit"][i]:
            break
        from_tokens = ATTENTION_LENGTHS[i][1]
    return (kernel, from_tokens) if from_tokens else ("unit", 0)


def tune_attention(shape: AttentionShape, path: str) -> AttentionChoice:
    """Time each prefill kernel on ``shape`` at each of ``ATTENTION_LENGTHS`` and each decode kernel at each of
    ``DECODE_ATTENTION_CONTEXTS`` (brgemm only where it has a compiled kernel), set the choices."""
    started = time.perf_counter()
    has_brgemm = brgemm_has_kernel()
    kernels = [k for k in ATTENTION_KERNELS if k != "brgemm" or has_brgemm]
    decode_kernels = [k for k in DECODE_ATTENTION_KERNELS if k != "brgemm" or has_brgemm]
    # brgemm once per blocking: "brgemm@i" is ATTENTION_TILINGS[i]
    candidates = [k for k in kernels if k != "brgemm"] + [f"brgemm@{i}" for i in range(len(ATTENTION_TILINGS))
                                                          if "brgemm" in kernels]

    def force(candidate):
        kernel, _, index = candidate.partition("@")
        return forced_prefill(shape.family, kernel, ATTENTION_TILINGS[int(index)] if index else None)

    with isa.forced(path), torch.inference_mode():
        timed = _time_kernels([prefill_call(shape, seq) for seq, _ in ATTENTION_LENGTHS], candidates, force)
        decode_ms = _time_kernels([decode_call(shape, n) for n in DECODE_ATTENTION_CONTEXTS], decode_kernels,
                                  lambda kernel: forced_decode_attention(shape.family, kernel))
    tiling_ms = {ATTENTION_TILINGS[int(c.partition("@")[2])]: v for c, v in timed.items() if c.startswith("brgemm")}
    tiling = choose_tiling(tiling_ms) if tiling_ms else ATTENTION_TILINGS[0]
    ms = {k: v for k, v in timed.items() if not k.startswith("brgemm")}
    if tiling_ms:
        ms["brgemm"] = tiling_ms[tiling]
    kernel, from_tokens = choose_attention(ms)
    decode_kernel = choose_decode_attention(decode_ms)
    isa.native.set_prefill_attention(shape.family, kernel, from_tokens)
    isa.native.set_attention_tiling(shape.family, *tiling)
    isa.native.set_decode_attention(shape.family, decode_kernel)
    return AttentionChoice(shape, kernel, from_tokens, "tuned", ms, time.perf_counter() - started, decode_kernel,
                           decode_ms, tiling, tiling_ms)


def ensure_attention_tuned(shape: AttentionShape | None, *, path: str | None = None,
                           cache: pathlib.Path | None = None, enabled: bool = True) -> AttentionChoice | None:
    """``shape``'s prefill attention choice: read from the cache file, else timed (``tune_attention``) and saved;
    set in the native table. ``enabled=False`` (or no shape) keeps what the table holds."""
    path = path or isa.current()
    if isa.native is None or path == "reference" or shape is None:
        return None
    if not enabled:
        return AttentionChoice(shape, *isa.native.get_prefill_attention(shape.family), "untuned",
                               decode_kernel=isa.native.get_decode_attention(shape.family),
                               tiling=tuple(isa.native.get_attention_tiling(shape.family)))
    store = _store(cache)
    saved = _saved(store)
    key = _machine_key(path, "attention", shape.family, shape.heads, shape.kv_heads, shape.head_dim, shape.rope_dim,
                       shape.nope_dim, shape.v_dim)
    entry = saved.get(key)
    if entry is not None and "tiling" in entry:  # (an entry from before brgemm's blocking was tuned is timed again)
        tiling = tuple(entry["tiling"])
        isa.native.set_prefill_attention(shape.family, entry["kernel"], entry["from_tokens"])
        isa.native.set_attention_tiling(shape.family, *tiling)
        isa.native.set_decode_attention(shape.family, entry["decode_kernel"])
        ms = {k: tuple(v) for k, v in entry["ms"].items()}
        decode_ms = {k: tuple(v) for k, v in entry["decode_ms"].items()}
        tiling_ms = {tuple(t): tuple(v) for t, v in entry["tiling_ms"]}
        return AttentionChoice(shape, entry["kernel"], entry["from_tokens"], "cached", ms,
                               decode_kernel=entry["decode_kernel"], decode_ms=decode_ms, tiling=tiling,
                               tiling_ms=tiling_ms)
    choice = tune_attention(shape, path)
    saved[key] = {"kernel": choice.kernel, "from_tokens": choice.from_tokens,
                  "ms": {k: list(v) for k, v in choice.ms.items()}, "decode_kernel": choice.decode_kernel,
                  "decode_ms": {k: list(v) for k, v in choice.decode_ms.items()}, "tiling": list(choice.tiling),
                  "tiling_ms": [[list(t), list(v)] for t, v in choice.tiling_ms.items()]}
    _save(store, saved)
    return choice


# -- The linear ops' GEMMs: the unit's or oneDNN's brgemm ------------------------------------------------------
# brgemm (csrc/linear_brgemm.cpp) is oneDNN's GEMM kernel, what stock PyTorch's bf16 matmul runs: AMX tiles on
# an AMX CPU, JIT AVX512-BF16 code on other AVX512-BF16 CPUs, a reference loop elsewhere. Where it has a JIT
# kernel, both are timed:
# - prefill (above 4 rows), per weight format, on prefill-shaped linears, a short and a long prompt's rows in
#   one pass (csrc/tuning.h prefill_on_brgemm); elsewhere the path's default stays (the unit's GEMM);
# - decode (1 to 4 rows), bf16 only, on the walk tuning's pass over cold weights at 1, 2 and 4 rows, against
#   the unit's tuned walk (csrc/tuning.h decode_on_brgemm): brgemm from the row count on where it wins there
#   and at every larger count (AMX makes 4 rows cost what 1 does; the unit's GEMV does 4 times the work per
#   byte). brgemm reads a quantized block only through a bf16 copy of it (the prefill route): the unit, which
#   reads it at its own width, stays for those.
GEMM_SHAPES = ((3072, 2048), (2048, 8192))  # Llama-3.2-1B's q/k/v and down projections
GEMM_ROWS = (128, 1024)
GEMM_ROUNDS = 3
# The unit-or-brgemm choice's rounds: more, since for int8 and int4 it also decides how x is read, and on Zen 4
# the integer GEMM (~570 GFLOP/s against brgemm's ~430) lost it to noise in one tuning of four over three rounds.
GEMM_CHOICE_ROUNDS = 5
# The linear ops' blocking on brgemm (csrc/tuning.h GemmTiling: rows of x a call multiplies, K pairs a chunk), timed
# where brgemm runs a format's prefill (tune_gemm_tiling). One tiling serves every format: a quantized block is
# dequantized whole before either applies. On a 2-core Zen 4 (oneDNN's AVX512-BF16 kernels) the rows moved nothing
# and chunks of 512 pairs or fewer cost 15-20% (docs/PERFORMANCE.md); AMX's tiles take 16 rows of x at a time, and
# its GEMM rate makes the caches' traffic a larger share, so there the answer may differ.
GEMM_TILING_DEFAULT = (64, 1024, "brgemm")
GEMM_TILING_PAIRS = (512, 1024, 2048)
GEMM_TILING_ROWS = (32, 64, 128, 256)
# Where the CPU has AMX, tilefx's own tile kernel (csrc/linear_amx.cpp) runs in place of brgemm's calls: a panel
# of rows at once over each chunk, fetching the next chunk's weights while it multiplies (a brgemm call cannot).
# These run against brgemm's tiling kept on the prefill pass and on a pass over cold weights (the decode pass's
# copies, past the last-level cache) at a short prompt's GEMM_COLD_ROWS: the prefill pass's weights sit in cache
# after its first round, so it times the products, not the stream the kernel hides; a prompt reads every weight
# from DRAM once. The two passes' times are summed.
GEMM_TILES = ((256, 1024, "tiles"), (128, 1024, "tiles"), (256, 512, "tiles"))
GEMM_COLD_ROWS = 128
# A call whose rows span several panels (a long prompt) multiplies each weight chunk again per panel, from cache
# after the first; there a smaller K chunk keeps the block's part in L1 while the panel's row tiles pass (csrc/
# tuning.h gemm_long_pairs). These chunks, below the tiling's own, are timed against it on the prefill pass's
# longest prompt (the last of GEMM_ROWS) with the tiling kept.
GEMM_LONG_PAIRS = (128, 256)
# Its rounds: more than the tilings' (a pass here is one long prompt, ~25 ms), since one noisy minute must not
# cost a long prompt its chunk: on the Xeon 6 the 128-pair chunk measured 9% off Llama-1B's 1024-token TTFT,
# yet one tuning of three rounds in eight timed it 8% behind (docs/PERFORMANCE.md, forty-eighth session).
GEMM_LONG_ROUNDS = 7
# The chunk kept unless another beats it (above) where the tile kernel runs: 128 pairs. The pass above times hot
# weights, where the chunk leads by little (2.5-6.5% on the Xeon 6), but a prompt reads its weights from DRAM,
# where it leads by 9% (Llama-1B's four GEMMs at 1024 rows, cold copies) and so does TTFT (0.91x at 1024 tokens),
# and one tuning in about eight still put the tiling's own chunk 10% ahead, on a machine whose stock TTFT then
# read 1.5x its usual (docs/PERFORMANCE.md, forty-ninth session). Measured on AMX CPUs only: elsewhere (brgemm's
# calls) the tiling's own chunk is kept unless a smaller one wins.
GEMM_LONG_PAIRS_ON_TILES = 128


def long_pairs_kept(tiling: tuple) -> int:
    """The long prompt's chunk ``_tune_long_pairs`` keeps unless another beats it, for ``tiling``."""
    rows, pairs, kernel = tiling
    return GEMM_LONG_PAIRS_ON_TILES if kernel == "tiles" and GEMM_LONG_PAIRS_ON_TILES < pairs else 0

DECODE_GEMM_FORMATS = ("bf16",)
DECODE_GEMM_ROWS = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class GemmChoice:
    """Which GEMM the linear ops run above 4 rows for one weight format, and where the choice came from."""

    format: str
    gemm: str  # "unit", "brgemm" or "default" (the path's: brgemm on amx, else the unit)
    how: str  # "tuned", "cached", "untuned"
    unit_gflops: float = 0.0
    brgemm_gflops: float = 0.0
    seconds: float = 0.0
    x: str = ""  # int8, int4: how the unit's GEMM reads x (GEMM_X), as it was timed

    def line(self) -> str:
        what = f"prefill GEMM {self.format}: {self.gemm}"
        if self.x and self.gemm == "unit":
            what += f" (x as {GEMM_X[self.x]})"
        if self.how == "untuned":
            return f"{what} (not tuned)"
        return (f"{what} ({self.how}: unit {self.unit_gflops:.0f} GFLOP/s, oneDNN brgemm {self.brgemm_gflops:.0f}"
                f"{f', {self.seconds:.1f}s' if self.how == 'tuned' else ''})")


@dataclasses.dataclass(frozen=True)
class GemmTilingChoice:
    """The linear ops' blocking on brgemm, and where it came from."""

    tiling: tuple  # (rows of x a call, K pairs a chunk, kernel: "brgemm" or "tiles")
    how: str  # "tuned", "cached", "untuned"
    gflops: dict = dataclasses.field(default_factory=dict)  # tiling -> GFLOP/s of the tuning pass
    seconds: float = 0.0
    cold_gflops: dict = dataclasses.field(default_factory=dict)  # the tile step's: GFLOP/s on cold weights
    long_pairs: int = 0  # the K chunk over several panels of rows; 0: the tiling's
    long_gflops: dict = dataclasses.field(default_factory=dict)  # K chunk (0: the tiling's) -> GFLOP/s

    def line(self) -> str:
        rows, pairs, kernel = self.tiling
        call = "a brgemm call" if kernel == "brgemm" else "a call of tilefx's AMX tiles"
        what = f"prefill GEMM tiling: {rows} rows x {pairs} K pairs {call}"
        if self.long_pairs:
            what += f", K in chunks of {self.long_pairs} pairs over several panels of rows"
        if self.how == "untuned":
            return f"{what} (not tuned)"
        rates = ", ".join(f"{_tiling_name(t)} {g:.0f}" for t, g in sorted(self.gflops.items()))
        if self.cold_gflops:
            rates += f"; cold weights at {GEMM_COLD_ROWS} rows " + ", ".join(
                f"{_tiling_name(t)} {g:.0f}" for t, g in sorted(self.cold_gflops.items()))
        if self.long_gflops:
            rates += f"; K chunks at {GEMM_ROWS[-1]} rows " + ", ".join(
                f"{chunk or pairs} {g:.0f}" for chunk, g in sorted(self.long_gflops.items()))
        return f"{what} ({self.how}: GFLOP/s {rates}{f', {self.seconds:.1f}s' if self.how == 'tuned' else ''})"


@dataclasses.dataclass(frozen=True)
class DecodeGemmChoice:
    """What the linear ops run at 1 to 4 rows for one weight format: the unit's walk, or oneDNN's brgemm from
    ``from_rows`` rows on; and where the choice came from."""

    format: str
    from_rows: int  # brgemm from this many rows on; 0: the unit at every count
    how: str  # "tuned", "cached", "untuned"
    gbps: dict = dataclasses.field(default_factory=dict)  # rows: (unit walk GB/s, brgemm GB/s)
    seconds: float = 0.0

    def line(self) -> str:
        what = f"decode GEMM {self.format}: " + (f"brgemm from {self.from_rows} row(s)" if self.from_rows else "unit")
        if self.how == "untuned":
            return f"{what} (not tuned)"
        rates = "; ".join(f"{rows} row(s) unit walk {unit:.1f} GB/s, oneDNN brgemm {brgemm:.1f}"
                          for rows, (unit, brgemm) in sorted(self.gbps.items()))
        return f"{what} ({self.how}: {rates}{f'; {self.seconds:.1f}s' if self.how == 'tuned' else ''})"


def brgemm_has_kernel() -> bool:
    """Whether oneDNN's brgemm runs compiled code here (AMX or AVX512-BF16) rather than its reference loop."""
    return isa.native is not None and (isa.native.cpu_has("amx") or isa.native.cpu_has("avx512_bf16"))


@functools.cache
def brgemm_runs() -> bool:
    """Whether oneDNN's brgemm runs here at all. torch 2.13 runs its bf16 brgemm over VNNI-packed weights only
    where oneDNN has a kernel for it and raises elsewhere (a CPU with AVX2 and no AVX512: Zen 2 and 3). Tuning
    never picks brgemm there (brgemm_has_kernel), so only forcing it (tests, benchmarks) would reach it. One
    5-row linear forced onto it tells, once a process."""
    if isa.native is None:
        return False
    if brgemm_has_kernel():
        return True
    from . import linear as linear_ops
    from . import weights

    native = [path for path in isa.BUILT if isa.unsupported_reason(path) is None]
    if not native:
        return False
    packed = weights.pack_linear_weight(torch.ones(32, 64, dtype=torch.bfloat16))
    try:
        with isa.forced(native[0]), forced_gemm("bf16", "brgemm"):
            linear_ops.linear(torch.ones(5, 64, dtype=torch.bfloat16), packed, None, 32)
    except RuntimeError:
        return False
    return True


# How a GEMM over integer weights reads x (gemm_x), in words.
GEMM_X = {"int8": "int8 per 32 inputs", "int16": "int16 per row", "bf16": "bf16 over dequantized blocks"}
INTEGER_FORMATS = ("int8", "int4")  # the weight formats whose GEMMs can multiply integers


def linear_unit(path: str) -> str:
    """The unit whose own kernels run the linear ops on ``path`` ("avx512_bf16", "avx2", ...; on ``amx`` the one
    below brgemm's rows), or "" on the reference path."""
    return isa.kernel_units(path).get("linear", "").split(", else ")[-1]


def unit_gemm_x(format: str, path: str) -> str:
    """How the unit's own GEMM over ``format`` weights on ``path`` reads x (csrc/activations.h activation_form), for
    int8 and int4 weights: ``int8`` per 32 inputs on the AVX512-BF16 units (``vpdpbusd``; int8 where K padded to even
    is a multiple of 4, else as ``bf16``), ``int16`` per row on AVX2 (``vpmaddwd``); else ``bf16`` over dequantized
    blocks: fp8, the reference path, and where ``isa.int8_activations()`` asks for it."""
    if format not in INTEGER_FORMATS or path == "reference" or isa.native is None or isa.int8_activations() != "int8":
        return "bf16"
    return "int8" if linear_unit(path).startswith("avx512") else "int16"


def gemm_x(format: str, path: str) -> str:
    """How a linear or expert of more than 4 rows over ``format`` weights on ``path`` reads x: as the unit's GEMM
    does (``unit_gemm_x``) where the prefill GEMM chosen for the format is the unit's, else ``bf16`` (oneDNN's brgemm
    multiplies bf16 x by a dequantized block)."""
    if isa.native is not None and prefill_runs_brgemm(isa.native.get_prefill_gemm(format), path):
        return "bf16"
    return unit_gemm_x(format, path)


def forced_gemm(format: str, gemm: str):
    """Run a block with the linear ops' prefill GEMM for ``format`` weights forced ("unit", "brgemm", "default")."""
    return _temporarily(isa.native.get_prefill_gemm, isa.native.set_prefill_gemm, (format,), (gemm,))


def forced_decode_gemm(format: str, gemm: str, from_rows: int = 1):
    """Run a block with the linear ops' decode GEMM for ``format`` weights forced: "unit", or "brgemm" from
    ``from_rows`` rows on."""
    return _temporarily(isa.native.get_decode_gemm, isa.native.set_decode_gemm, (format,), (gemm, from_rows))


def _gemm_pass(format: str):
    """Random packings of ``GEMM_SHAPES`` in ``format`` and x at each of ``GEMM_ROWS`` rows: (tensors, inputs,
    flops of one pass)."""
    tensors = [_random_packing(n, k, format) for n, k in GEMM_SHAPES]
    inputs = [{k: torch.randn(rows, k).to(torch.bfloat16) for _, k in GEMM_SHAPES} for rows in GEMM_ROWS]
    return tensors, inputs, sum(2 * rows * n * k for n, k in GEMM_SHAPES for rows in GEMM_ROWS)


def _gemm_least(tensors, inputs, choices, force, rounds: int = GEMM_ROUNDS) -> dict:
    """Least seconds of one pass over ``tensors`` at every row count of ``inputs`` per choice, run under
    ``force(choice)``, the choices interleaved over ``rounds`` rounds after one dropped (it warms up and
    JIT-compiles brgemm), in reverse order every other round (no choice always runs after the same one). The
    least, not the median: a GEMM pass multiplies from cache, so the machine's noise only ever adds to it, and
    noise does not slow every kernel alike (on Zen 4 one noisy second put the int8 GEMM's median at 348 GFLOP/s,
    its usual 570, while brgemm's held at 403; docs/PERFORMANCE.md, fifty-eighth session)."""
    times = {choice: [] for choice in choices}
    for round in range(rounds + 1):
        for choice in (choices if round % 2 == 0 else choices[::-1]):
            with force(choice):
                times[choice].append(sum(_time_pass(tensors, by_k) for by_k in inputs))
    return {choice: min(t[1:]) for choice, t in times.items()}


def tune_gemm(format: str, path: str) -> GemmChoice:
    """Time the unit's GEMM and brgemm on ``GEMM_SHAPES`` at each of ``GEMM_ROWS`` rows in ``format``,
    interleaved over ``GEMM_CHOICE_ROUNDS`` rounds; set brgemm where the pass is faster on it by ``MIN_GAIN``,
    then again head to head (for int8 and int4 the choice is also how x is read: one noisy second must not make
    it)."""
    started = time.perf_counter()
    tensors, inputs, flops = _gemm_pass(format)

    def least(choices):
        return _gemm_least(tensors, inputs, choices, lambda gemm: forced_gemm(format, gemm), GEMM_CHOICE_ROUNDS)

    with isa.forced(path), torch.inference_mode():
        seconds = least(["unit", "brgemm"])
        gemm, again = confirmed_fastest(seconds, "unit", least)
        seconds = again or seconds  # a head to head's times are the ones reported
    isa.native.set_prefill_gemm(format, gemm)
    return GemmChoice(format, gemm, "tuned", flops / seconds["unit"] / 1e9, flops / seconds["brgemm"] / 1e9,
                      time.perf_counter() - started,
                      unit_gemm_x(format, path) if format in INTEGER_FORMATS else "")


def _tiling_name(tiling: tuple) -> str:
    """A tiling as the tuning line and the cache name it: ``64x1024``, ``tiles 256x128``."""
    rows, pairs, kernel = tiling
    return f"{rows}x{pairs}" if kernel == "brgemm" else f"{kernel} {rows}x{pairs}"


def _tiling_of(name: str) -> tuple:
    """The tiling ``_tiling_name`` named."""
    kernel, _, dims = name.rpartition(" ")
    rows, pairs = dims.split("x")
    return int(rows), int(pairs), kernel or "brgemm"


def forced_gemm_tiling(rows: int, pairs: int, kernel: str = "brgemm"):
    """Run a block with the linear ops' brgemm blocking forced: ``rows`` of x a call, K in chunks of ``pairs``, on
    oneDNN's brgemm calls or (``kernel="tiles"``, a CPU with AMX) tilefx's tile kernel."""
    return _temporarily(isa.native.get_gemm_tiling, isa.native.set_gemm_tiling, (), (rows, pairs, kernel))


def forced_gemm_long_pairs(pairs: int):
    """Run a block with the K chunk of linears whose rows span several panels forced (0: the tiling's)."""
    return _temporarily(isa.native.get_gemm_long_pairs, isa.native.set_gemm_long_pairs, (), (pairs,))


def amx_tiles_run() -> bool:
    """Whether tilefx's AMX tile kernel runs here (a CPU with AMX, whose tile state Linux granted this process)."""
    return isa.native is not None and isa.native.cpu_has("amx_tiles")


def tune_gemm_tiling(path: str) -> GemmTilingChoice:
    """Time brgemm's blockings on the prefill GEMM pass in bf16, each step's candidates interleaved over
    ``GEMM_ROUNDS`` rounds: the K chunk (``GEMM_TILING_PAIRS``) at the default rows, then the rows
    (``GEMM_TILING_ROWS``) at the chunk kept, each step keeping a candidate only where it beats the one before
    by ``MIN_GAIN``; a winner other than the default must beat it again head to head. Where the CPU has AMX, the
    tile kernel's candidates (``GEMM_TILES``) then run against the tiling kept, on this pass plus one over cold
    weights at ``GEMM_COLD_ROWS`` rows, and replace it where they beat it by ``MIN_GAIN`` on the two together.
    Last, with the tiling kept, the long prompt's K chunk (``GEMM_LONG_PAIRS`` against the tiling's own) on the
    pass's longest prompt, kept likewise. Set the result."""
    started = time.perf_counter()
    tensors, inputs, flops = _gemm_pass("bf16")
    default = GEMM_TILING_DEFAULT

    def least(tilings):
        return _gemm_least(tensors, inputs, tilings, lambda tiling: forced_gemm_tiling(*tiling))

    with isa.forced(path), torch.inference_mode(), forced_gemm("bf16", "brgemm"):
        isa.native.set_gemm_long_pairs(0)  # the tilings are timed with their own chunks
        seconds = least([(default[0], pairs, "brgemm") for pairs in GEMM_TILING_PAIRS])
        _, pairs, _ = fastest_by_min_gain(seconds, default)
        tiles = least([(rows, pairs, "brgemm") for rows in GEMM_TILING_ROWS])
        seconds.update(tiles)
        tiling = fastest_by_min_gain(tiles, (default[0], pairs, "brgemm"))
        if tiling != default:  # the fastest of several noisy candidates looks faster than it is
            tiling = fastest_by_min_gain(least([default, tiling]), default)
        cold_gflops = {}
        if amx_tiles_run():
            kernels = [tiling, *GEMM_TILES]
            hot = least(kernels)
            seconds.update(hot)
            cold_tensors = _decode_pass("bf16")
            cold_inputs = [{k: torch.randn(GEMM_COLD_ROWS, k).to(torch.bfloat16) for _, k in LAYER_SHAPES}]
            cold = _gemm_least(cold_tensors, cold_inputs, kernels, lambda tiling: forced_gemm_tiling(*tiling))
            cold_flops = sum(2 * GEMM_COLD_ROWS * n * k for _, _, n, k in cold_tensors)
            del cold_tensors
            cold_gflops = {t: cold_flops / s / 1e9 for t, s in cold.items()}
            tiling = fastest_by_min_gain({t: hot[t] + cold[t] for t in kernels}, tiling)
        isa.native.set_gemm_tiling(*tiling)
        long_pairs, long_gflops = _tune_long_pairs(tensors, inputs, tiling[1], long_pairs_kept(tiling))
    gflops = {t: flops / s / 1e9 for t, s in seconds.items()}
    return GemmTilingChoice(tiling, "tuned", gflops, time.perf_counter() - started, cold_gflops, long_pairs,
                            long_gflops)


def _tune_long_pairs(tensors, inputs, tiling_pairs: int, kept: int = 0) -> tuple[int, dict]:
    """The K chunk over several panels of rows with the tiling set: each of ``GEMM_LONG_PAIRS`` below
    ``tiling_pairs`` and the tiling's own (0) on ``tensors`` at the prefill pass's longest prompt (the last of
    ``inputs``, GEMM_ROWS'), interleaved over ``GEMM_LONG_ROUNDS`` rounds, against ``kept`` (``long_pairs_kept``):
    another must beat it again head to head, by ``MIN_GAIN`` both times. Sets it; returns (the chunk, GFLOP/s per
    candidate)."""
    longest = inputs[-1:]
    candidates = [0, *(pairs for pairs in GEMM_LONG_PAIRS if pairs < tiling_pairs)]
    kept = kept if kept in candidates else 0

    def least(choices):
        return _gemm_least(tensors, longest, choices, forced_gemm_long_pairs, GEMM_LONG_ROUNDS)

    seconds = least(candidates)
    chosen, _ = confirmed_fastest(seconds, kept, least)
    isa.native.set_gemm_long_pairs(chosen)
    flops = sum(2 * GEMM_ROWS[-1] * n * k for _, _, n, k in tensors)
    return chosen, {pairs: flops / s / 1e9 for pairs, s in seconds.items()}


def choose_decode_gemm(gbps: dict[int, tuple[float, float]]) -> int:
    """From how many rows on brgemm runs decode, given (unit walk, brgemm) GB/s per timed row count: the fewest
    rows where it leads by ``MIN_GAIN`` there and at every larger count; 0 (the unit throughout) where it does
    not lead at the largest."""
    from_rows = 0
    for rows in sorted(gbps, reverse=True):
        unit, brgemm = gbps[rows]
        if brgemm < unit * MIN_GAIN:
            break
        from_rows = rows
    return from_rows


def tune_decode_gemm(format: str, path: str) -> DecodeGemmChoice:
    """Time the unit's GEMV walk (as tuned) and brgemm at each of ``DECODE_GEMM_ROWS`` rows on the walk tuning's
    pass over cold ``format`` weights, interleaved over ``ROUNDS`` rounds; set brgemm from the row count
    ``choose_decode_gemm`` gives."""
    started = time.perf_counter()
    tensors = _decode_pass(format)
    nbytes = _pass_bytes(tensors)
    gbps = {}
    with isa.forced(path), torch.inference_mode():
        for rows in DECODE_GEMM_ROWS:
            inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in LAYER_SHAPES}
            times: dict[str, list[float]] = {"unit": [], "brgemm": []}
            for round in range(ROUNDS + 1):  # the first round pages the weights in (and JIT-compiles brgemm)
                for gemm in times:
                    with forced_decode_gemm(format, gemm):
                        elapsed = _time_pass(tensors, inputs)
                    if round:
                        times[gemm].append(elapsed)
            gbps[rows] = tuple(nbytes / statistics.median(times[g]) / 1e9 for g in ("unit", "brgemm"))
    from_rows = choose_decode_gemm(gbps)
    isa.native.set_decode_gemm(format, "brgemm" if from_rows else "unit", from_rows)
    return DecodeGemmChoice(format, from_rows, "tuned", gbps, time.perf_counter() - started)


def _tuned_prefill_gemm(format: str, path: str, saved: dict) -> tuple[GemmChoice, bool]:
    """The prefill GEMM of ``format`` from ``saved``, else timed and put there; (choice, whether timed)."""
    # (int8's and int4's unit is timed reading x in the form its GEMM reads it: isa.int8_activations)
    key = _machine_key(path, "prefill_gemm", format,
                       *(["x=" + isa.int8_activations()] if format in INTEGER_FORMATS else []))
    entry = saved.get(key)
    if entry is not None:
        isa.native.set_prefill_gemm(format, entry["gemm"])
        return GemmChoice(format, entry["gemm"], "cached", entry["unit_gflops"], entry["brgemm_gflops"],
                          x=unit_gemm_x(format, path) if format in INTEGER_FORMATS else ""), False
    choice = tune_gemm(format, path)
    saved[key] = {"gemm": choice.gemm, "unit_gflops": choice.unit_gflops, "brgemm_gflops": choice.brgemm_gflops}
    return choice, True


def _tuned_decode_gemm(format: str, path: str, saved: dict) -> tuple[DecodeGemmChoice, bool]:
    """The decode GEMM of ``format`` from ``saved``, else timed and put there; (choice, whether timed)."""
    key = _machine_key(path, "decode_gemm", format)
    entry = saved.get(key)
    if entry is not None:
        from_rows = entry["from_rows"]
        isa.native.set_decode_gemm(format, "brgemm" if from_rows else "unit", from_rows)
        gbps = {int(rows): tuple(rates) for rows, rates in entry["gbps"].items()}
        return DecodeGemmChoice(format, from_rows, "cached", gbps), False
    choice = tune_decode_gemm(format, path)
    saved[key] = {"from_rows": choice.from_rows, "gbps": {str(rows): list(r) for rows, r in choice.gbps.items()}}
    return choice, True


def _tuned_gemm_tiling(path: str, saved: dict) -> tuple[GemmTilingChoice, bool]:
    """The brgemm blocking from ``saved``, else timed and put there; (choice, whether timed)."""
    key = _machine_key(path, "gemm_tiling")
    entry = saved.get(key)
    if entry is not None:
        tiling = _tiling_of(entry["tiling"])
        isa.native.set_gemm_tiling(*tiling)
        long_pairs = entry.get("long_pairs", 0)
        isa.native.set_gemm_long_pairs(long_pairs)
        gflops = {_tiling_of(t): g for t, g in entry["gflops"].items()}
        cold = {_tiling_of(t): g for t, g in entry.get("cold_gflops", {}).items()}
        long = {int(pairs): g for pairs, g in entry.get("long_gflops", {}).items()}
        return GemmTilingChoice(tiling, "cached", gflops, cold_gflops=cold, long_pairs=long_pairs,
                                long_gflops=long), False
    choice = tune_gemm_tiling(path)
    saved[key] = {"tiling": _tiling_name(choice.tiling),
                  "gflops": {_tiling_name(t): g for t, g in choice.gflops.items()},
                  "cold_gflops": {_tiling_name(t): g for t, g in choice.cold_gflops.items()},
                  "long_pairs": choice.long_pairs, "long_gflops": {str(p): g for p, g in choice.long_gflops.items()}}
    return choice, True


def prefill_runs_brgemm(gemm: str, path: str) -> bool:
    """Whether a format's prefill GEMM choice (``GemmChoice.gemm``) runs brgemm on ``path``."""
    return gemm == "brgemm" or (gemm == "default" and isa.kernel_units(path).get("linear", "").startswith("brgemm"))


def ensure_gemm_tuned(formats_used, *, path: str | None = None, cache: pathlib.Path | None = None,
                      enabled: bool = True) -> list[GemmChoice | DecodeGemmChoice | GemmTilingChoice]:
    """The linear ops' decode GEMM (bf16's) and prefill GEMM of each format in ``formats_used``, and brgemm's
    blocking where some format's prefill runs it: read from the cache file, else timed (``tune_decode_gemm``,
    ``tune_gemm``, ``tune_gemm_tiling``) and saved; set in the native table. Nothing is timed where brgemm has no
    compiled kernel (the defaults stay) or with ``enabled=False``. Call after ``ensure_tuned``: decode's unit
    candidate is the tuned walk."""
    path = path or isa.current()
    if isa.native is None or path == "reference" or not brgemm_has_kernel():
        return []
    used = sorted(set(formats_used))
    decode = [f for f in used if f in DECODE_GEMM_FORMATS]
    if not enabled:
        prefill = [GemmChoice(f, isa.native.get_prefill_gemm(f), "untuned") for f in used]
        tiling = [GemmTilingChoice(tuple(isa.native.get_gemm_tiling()), "untuned",
                                   long_pairs=isa.native.get_gemm_long_pairs())] \
            if any(prefill_runs_brgemm(c.gemm, path) for c in prefill) else []
        return [*(DecodeGemmChoice(f, isa.native.get_decode_gemm(f)[1], "untuned") for f in decode), *prefill, *tiling]
    store = _store(cache)
    saved = _saved(store)
    results, changed = [], False
    for format in decode:
        choice, timed = _tuned_decode_gemm(format, path, saved)
        results.append(choice)
        changed |= timed
    for format in used:
        choice, timed = _tuned_prefill_gemm(format, path, saved)
        results.append(choice)
        changed |= timed
    if any(isinstance(c, GemmChoice) and prefill_runs_brgemm(c.gemm, path) for c in results):
        choice, timed = _tuned_gemm_tiling(path, saved)
        results.append(choice)
        changed |= timed
    if changed:
        _save(store, saved)
    return results


@contextlib.contextmanager
def untuned():
    """Run a block with the GEMM and attention choices at their defaults (the path's prefill GEMM, the unit's
    decode walk unsplit, the unit's attention), as the op tests expect whatever an earlier compile_model in the process
    tuned."""
    with contextlib.ExitStack() as stack:
        for format in formats.FORMATS:
            stack.enter_context(forced_gemm(format, "default"))
            stack.enter_context(forced_decode_gemm(format, "unit", 0))
            stack.enter_context(forced_split(format, 0))
        stack.enter_context(forced_gemm_tiling(*GEMM_TILING_DEFAULT))
        stack.enter_context(forced_gemm_long_pairs(0))
        for family in ("extend", "mla"):
            stack.enter_context(forced_attention(family, "unit"))
            stack.enter_context(forced_decode_attention(family, "unit"))
        yield
