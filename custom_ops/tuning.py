"""How the decode walks stream weights on this machine, tuned by measuring (FFTW / ATLAS style).

A decode linear is a GEMV that must read its weight at the memory's speed. How a walk
gets there depends on the CPU: two concurrent streams per thread and a short software
prefetch read at the streaming bandwidth on AMD Zen, while the same walk keeps too few
misses in flight on an Intel Xeon 6, where one block at a time without prefetch, or a
different distance, does better (docs/PERFORMANCE.md). So the walk's parameters are not constants:
``ensure_tuned`` times every candidate (``CANDIDATES``: streams per thread x prefetch
distance) on a decode-like pass over cold weights, once per CPU, thread count, kernel
sources, linear unit and weight format, keeps the fastest in the native table
(``csrc/tuning.h``) and caches the result as JSON next to tilefx's graph cache
(``cache_root()``), so a later process reads it instead of timing again.

Correctness never depends on the choice: every candidate computes the same products
(tests force each one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import pathlib
import statistics
import time

import torch

from tilefx.custom_ops import isa
from tilefx.custom_ops.weights import formats, layouts, memory

STREAMS = (1, 2)
PREFETCH_BYTES = (0, 256, 512, 1024, 2048, 4096)
CANDIDATES = tuple(itertools.product(STREAMS, PREFETCH_BYTES))
# A tuned choice replaces the default only when a second, independent head-to-head (CONFIRM_ROUNDS rounds of
# the two alone) finds it this much faster: the fastest of many noisy candidates looks faster than it is.
MIN_GAIN = 1.03
CONFIRM_ROUNDS = 7
# One decode-like layer (hidden 2048, Llama-3.2-1B's shapes: q/k/v, o, gate/up, down), repeated until the
# pass reads more than the last-level cache holds several times over, so every sample reads DRAM.
LAYER_SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))
MIN_PASS_BYTES, MAX_PASS_BYTES = 256 << 20, 1536 << 20
ROUNDS = 5


@dataclasses.dataclass(frozen=True)
class Tuned:
    """The walk one unit uses for one weight format, and where the choice came from."""

    unit: str
    format: str
    streams: int
    prefetch_bytes: int
    how: str  # "tuned" (timed now), "cached" (timed by an earlier process), "untuned" (tuning off)
    gbps: float = 0.0  # the choice's median GB/s over the timed pass (0: not timed)
    default_gbps: float = 0.0  # the default's, in the same run
    seconds: float = 0.0  # time spent timing

    def line(self) -> str:
        what = f"{self.unit} {self.format}: {self.streams} stream(s), prefetch {self.prefetch_bytes} B"
        if self.how == "untuned":
            return f"{what} (not tuned)"
        gain = f", {self.gbps:.1f} GB/s vs the default's {self.default_gbps:.1f}" if self.gbps else ""
        return f"{what} ({self.how}{gain}{f', {self.seconds:.1f}s' if self.how == 'tuned' else ''})"


def current(unit: str, format: str) -> tuple[int, int]:
    """(streams, prefetch bytes) the native kernels use now."""
    return tuple(isa.native.get_walk_tuning(unit, format))


@contextlib.contextmanager
def forced(unit: str, format: str, streams: int, prefetch_bytes: int):
    """Run a block with the given walk (tests, benchmarks)."""
    previous = current(unit, format)
    isa.native.set_walk_tuning(unit, format, streams, prefetch_bytes)
    try:
        yield
    finally:
        isa.native.set_walk_tuning(unit, format, *previous)


def candidates(unit: str, format: str) -> tuple[tuple[int, int], ...]:
    """The walks that differ on ``unit`` for ``format``: the AVX2 unit streams one quantized block at a time."""
    if unit == "avx2" and format != "bf16":
        return tuple(c for c in CANDIDATES if c[0] == 1)
    return CANDIDATES


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


def _machine_key(unit: str, format: str) -> str:
    """What the best walk depends on: the CPU, its flags, the threads, the kernels' sources, unit and format."""
    model, digest = _cpu_key().rsplit("|", 1)
    return f"{model}|threads={torch.get_num_threads()}|{unit}|{format}|{digest}"


def _last_level_cache_bytes() -> int:
    try:
        return max(int(os.sysconf("SC_LEVEL3_CACHE_SIZE")), 0)
    except (ValueError, OSError):
        return 0


def _decode_pass(format: str):
    """Cold weights of a decode-like pass in ``format`` (each packed tensor with its scales) and the input."""
    pass_bytes = min(max(MIN_PASS_BYTES, 4 * _last_level_cache_bytes()), MAX_PASS_BYTES)
    itemsize = formats.FORMATS[format].itemsize
    layer_bytes = sum(n * k * itemsize for n, k in LAYER_SHAPES)
    tensors = []
    for n, k in LAYER_SHAPES * max(1, -(-pass_bytes // layer_bytes)):
        shape = layouts.packed_shape(n, k)
        data = memory.huge_page_empty(shape, formats.FORMATS[format])
        if format == "bf16":
            data.normal_()
        else:  # values in range (int8: +-127; e4m3: no NaN codes); timing does not read them as numbers
            data.view(torch.uint8).random_(0, 256).bitwise_and_(0x77 if format == "fp8" else 0x7F)
        scales = torch.ones(formats.scales_shape(shape, format)) if format != "bf16" else None
        tensors.append((data, scales, n, k))
    return tensors


def _time_pass(tensors, inputs) -> float:
    start = time.perf_counter()
    for data, scales, n, k in tensors:
        torch.ops.tilefx.linear(inputs[k], data, None, n, scales)
    return time.perf_counter() - start


def _medians(tensors, inputs, unit: str, format: str, walks, rounds: int) -> dict[tuple[int, int], float]:
    """Median seconds of a pass per walk, the walks interleaved in every round (drift hits them alike)."""
    times: dict[tuple[int, int], list[float]] = {walk: [] for walk in walks}
    for _ in range(rounds):
        for walk in walks:
            with forced(unit, format, *walk):
                times[walk].append(_time_pass(tensors, inputs))
    return {walk: statistics.median(t) for walk, t in times.items()}


def tune(unit: str, format: str, path: str) -> Tuned:
    """Time every candidate walk on ``unit`` (a decode unit of kernel path ``path``) for ``format`` weights,
    interleaved over ``ROUNDS`` rounds, then the fastest against the default alone; set the fastest where it
    beats the default by ``MIN_GAIN``."""
    started = time.perf_counter()
    default = current(unit, format)
    tensors = _decode_pass(format)
    inputs = {k: torch.randn(1, k).to(torch.bfloat16) for _, k in LAYER_SHAPES}
    nbytes = sum(d.nbytes + (0 if s is None else s.nbytes) for d, s, _, _ in tensors)
    walks = tuple(dict.fromkeys((default, *candidates(unit, format))))
    with isa.forced(path), torch.inference_mode():
        _time_pass(tensors, inputs)  # warm-up: page in every tensor, settle the clocks
        search = _medians(tensors, inputs, unit, format, walks, ROUNDS)
        best = min(search, key=search.get)
        final = _medians(tensors, inputs, unit, format, tuple(dict.fromkeys((default, best))), CONFIRM_ROUNDS)
    if final[default] <= final[best] * MIN_GAIN:
        best = default
    isa.native.set_walk_tuning(unit, format, *best)
    return Tuned(unit, format, *best, how="tuned", gbps=nbytes / final[best] / 1e9,
                 default_gbps=nbytes / final[default] / 1e9, seconds=time.perf_counter() - started)


def ensure_tuned(formats_used, *, path: str | None = None, cache: pathlib.Path | None = None,
                 enabled: bool = True) -> list[Tuned]:
    """The walks of every decode unit of ``path`` (default: the current one) for each format in
    ``formats_used``: read from the cache file, else timed (``tune``) and saved; set in the native table.
    ``enabled=False`` reports what the table holds and times nothing."""
    path = path or isa.current()
    if isa.native is None or path == "reference":
        return []
    results = []
    store = (cache or cache_root()) / "tuning.json"
    try:
        saved = json.loads(store.read_text())
    except (OSError, ValueError):
        saved = {}
    changed = False
    for unit in decode_units(path):
        for format in sorted(set(formats_used)):
            if not enabled:
                results.append(Tuned(unit, format, *current(unit, format), how="untuned"))
                continue
            key = _machine_key(unit, format)
            entry = saved.get(key)
            if entry is not None:
                isa.native.set_walk_tuning(unit, format, entry["streams"], entry["prefetch_bytes"])
                results.append(Tuned(unit, format, entry["streams"], entry["prefetch_bytes"], how="cached",
                                     gbps=entry.get("gbps", 0.0), default_gbps=entry.get("default_gbps", 0.0)))
                continue
            tuned = tune(unit, format, path)
            saved[key] = {"streams": tuned.streams, "prefetch_bytes": tuned.prefetch_bytes, "gbps": tuned.gbps,
                          "default_gbps": tuned.default_gbps}
            changed = True
            results.append(tuned)
    if changed:
        with contextlib.suppress(OSError):  # a read-only cache directory: tuned again next time
            store.parent.mkdir(parents=True, exist_ok=True)
            temporary = store.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(saved, indent=1, sort_keys=True))
            temporary.replace(store)
    return results
