"""What compilation did, for ``tilefx.explain``: graphs, per-pass rewrites and fallbacks, timing."""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING

import torch.fx

from tilefx.compiler.passes.base import PassResult

if TYPE_CHECKING:
    from tilefx.custom_ops.collectives import GlooCommunicator, ShmCommunicator
    from tilefx.custom_ops.openmp import IdleWait
    from tilefx.custom_ops.tuning import AttentionChoice, DecodeGemmChoice, GemmChoice, GemmTilingChoice, Tuned


@dataclasses.dataclass
class GraphRecord:
    phase: str
    nodes: int
    tilefx_ops: dict[str, int]
    passes: list[PassResult]
    passes_seconds: float = 0.0  # the tilefx passes on this graph
    compile_seconds: float = 0.0  # the whole backend call: AOT, the passes, Inductor (or its cache); or the load
    loaded: bool = False  # from tilefx's graph cache (compiler/graph_cache.py): no Dynamo, no backend call


@dataclasses.dataclass
class PackSummary:
    """What models.packing.pack_model packed as the weights loaded."""

    tensors: int = 0
    packed_bytes: int = 0  # values and scales
    released_bytes: int = 0  # the sources' own memory, handed back
    seconds: float = 0.0
    formats: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # format -> [tensors, bytes]
    kept_bf16: dict[str, int] = dataclasses.field(default_factory=dict)  # why a weight stayed bf16 -> how many
    stored_bf16: list[str] = dataclasses.field(default_factory=list)  # a quantized checkpoint's weights it holds in bf16

    def add(self, format: str, nbytes: int) -> None:
        self.tensors += 1
        self.packed_bytes += nbytes
        counts = self.formats.setdefault(format, [0, 0])
        counts[0] += 1
        counts[1] += nbytes

    def formats_line(self) -> str:
        """Which format the packed weights run in, why any stayed bf16 when another was asked for, and which an fp8
        checkpoint holds in bf16 (weights="auto" packs them so)."""
        held = ", ".join(f"{name} {count} ({nbytes / 2**20:.1f} MiB)" for name, (count, nbytes) in self.formats.items())
        kept = "; ".join(f"{count} {why}" for why, count in self.kept_bf16.items())
        stored = ", ".join(self.stored_bf16[:8]) + (f" and {len(self.stored_bf16) - 8} more"
                                                    if len(self.stored_bf16) > 8 else "")
        return (f"weight formats: {held or 'none packed'}" + (f"; kept bf16: {kept}" if kept else "")
                + (f"; bf16 as the quantized checkpoint stores them: {stored}" if stored else ""))


@dataclasses.dataclass
class CompileReport:
    graphs: list[GraphRecord] = dataclasses.field(default_factory=list)
    warmup_graphs: int = 0  # graphs compiled by compile_model's warm-up
    load_seconds: float = 0.0
    graph_breaks: int = 0
    packing: PackSummary = dataclasses.field(default_factory=PackSummary)
    released_bytes: int = 0  # weights packed while compiling, their unpacked copy released after warm-up
    kept_unpacked: int = 0  # weights packed while compiling whose unpacked copy is still needed (read unpacked)

    warmup_seconds: float = 0.0  # compile_model's warm-up steps: Dynamo tracing, the backend, the steps themselves
    total_seconds: float = 0.0  # all of compile_model, its imports included
    caches: dict[str, int] = dataclasses.field(default_factory=dict)  # cache counters moved by compile_model
    walks: list[Tuned] = dataclasses.field(default_factory=list)  # the decode walks' tuning (custom_ops/tuning.py)
    # the linear ops' GEMM per phase and format (tuning.py)
    gemms: list[GemmChoice | DecodeGemmChoice | GemmTilingChoice] = dataclasses.field(default_factory=list)
    attention: AttentionChoice | None = None  # prefill and decode attention's choices (custom_ops/tuning.py)
    placement: str | None = None  # tensor parallel: this rank's CPUs and why (models.placement.Placement.describe())
    collectives: ShmCommunicator | GlooCommunicator | None = None  # tensor parallel: this rank's communicator
    threads: IdleWait | None = None  # how the OpenMP workers wait between ops (custom_ops/openmp.py)

    def record_graph(self, graph: torch.fx.Graph, results: list[PassResult], phase: str,
                     passes_seconds: float = 0.0) -> GraphRecord:
        record = GraphRecord(phase=phase, nodes=len(graph.nodes), tilefx_ops=tilefx_op_counts(graph), passes=results,
                             passes_seconds=passes_seconds)
        self.graphs.append(record)
        return record

    @property
    def recompiles(self) -> int:
        """Graphs compiled after warm-up: each is a recompilation the user paid for at run time."""
        return max(0, len(self.graphs) - self.warmup_graphs)

    def tp_line(self) -> str:
        """Tensor parallel: this rank's place and its collectives so far."""
        stats = self.collectives.stats() if self.collectives is not None else {}
        where = self.placement if self.placement is not None else "not placed"
        kind = self.collectives.kind if self.collectives is not None else "none"
        waited = stats.get("wait_seconds")
        return (f"tensor parallel: {where}; collectives {kind}: "
                f"{stats.get('calls', 0)} calls, {stats.get('seconds', 0.0):.3f}s"
                + (f" (waiting for peers {waited:.3f}s)" if waited is not None else ""))

    def startup_line(self) -> str:
        """Where compile_model's time went (with freezing on, torch bypasses its AOT cache: every start
        re-runs AOT tracing, counted under inductor). Tracing is the warm-up less the backend calls: Dynamo, guards
        and the steps' own run time; inductor is the backend less the passes: AOT, codegen, C++ builds, or loading
        the graph from tilefx's graph cache (then there is no Dynamo: "trace" is the steps' own run time)."""
        warmup_graphs = self.graphs[: self.warmup_graphs]
        backend = sum(g.compile_seconds for g in warmup_graphs)
        passes = sum(g.passes_seconds for g in warmup_graphs)
        caches = dict(self.caches)
        loaded = sum(g.loaded for g in warmup_graphs)
        if loaded:
            caches["tilefx graphs loaded"] = loaded
        hits = ", ".join(f"{name} {count}" for name, count in sorted(caches.items())) or "none counted"
        tune = sum(choice.seconds for choice in [*self.walks, *self.gemms, *([self.attention] if self.attention else [])])
        other = self.total_seconds - self.load_seconds - self.packing.seconds - tune - self.warmup_seconds
        return (
            f"startup {self.total_seconds:.1f}s: imports and setup {max(0.0, other):.1f}s, load "
            f"{self.load_seconds:.1f}s, pack {self.packing.seconds:.1f}s, tune {tune:.1f}s, trace {max(0.0, self.warmup_seconds - backend):.1f}s, "
            f"passes {passes:.2f}s, inductor {backend - passes:.1f}s; caches: {hits}"
        )


# Counters torch keeps for its compile caches (torch._dynamo.utils.counters[group][name]).
CACHE_COUNTERS = {
    ("inductor", "fxgraph_cache_hit"): "fx graph hit",
    ("inductor", "fxgraph_cache_miss"): "fx graph miss",
    ("inductor", "fxgraph_cache_bypass"): "fx graph bypass",
    ("aot_autograd", "autograd_cache_hit"): "aot hit",
    ("aot_autograd", "autograd_cache_miss"): "aot miss",
    ("aot_autograd", "autograd_cache_bypass"): "aot bypass",
}


def cache_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {label: counters[group][name] for (group, name), label in CACHE_COUNTERS.items()}


def counters_since(before: dict[str, int]) -> dict[str, int]:
    """The cache counters that moved since ``before`` (a cache_counters() snapshot)."""
    return {label: count - before.get(label, 0) for label, count in cache_counters().items() if count != before.get(label, 0)}


def tilefx_op_counts(graph: torch.fx.Graph) -> dict[str, int]:
    counts: collections.Counter[str] = collections.Counter()
    for node in graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == "tilefx":
            counts[f"tilefx.{target._opname}"] += 1
    return dict(counts)
