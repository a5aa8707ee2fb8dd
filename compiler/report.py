"""What compilation did, for ``tilefx.explain``: graphs, per-pass rewrites and fallbacks, timing."""

from __future__ import annotations

import collections
import dataclasses

import torch.fx

from tilefx.compiler.passes.base import PassResult


@dataclasses.dataclass
class GraphRecord:
    phase: str
    nodes: int
    tilefx_ops: dict[str, int]
    passes: list[PassResult]
    compile_seconds: float = 0.0


@dataclasses.dataclass
class PackSummary:
    """What models.packing.pack_model packed as the weights loaded."""

    tensors: int = 0
    packed_bytes: int = 0
    released_bytes: int = 0  # the sources' own memory, handed back
    seconds: float = 0.0


@dataclasses.dataclass
class CompileReport:
    graphs: list[GraphRecord] = dataclasses.field(default_factory=list)
    phase: str = "unknown"  # set by the runtime before each compiled call
    warmup_graphs: int = 0  # graphs compiled by compile_model's warm-up
    load_seconds: float = 0.0
    graph_breaks: int = 0
    packing: PackSummary = dataclasses.field(default_factory=PackSummary)
    released_bytes: int = 0  # weights packed while compiling, their unpacked copy released after warm-up
    kept_unpacked: int = 0  # weights packed while compiling whose unpacked copy is still needed (read unpacked)

    def record_graph(self, graph: torch.fx.Graph, results: list[PassResult]) -> None:
        self.graphs.append(
            GraphRecord(phase=self.phase, nodes=len(graph.nodes), tilefx_ops=tilefx_op_counts(graph), passes=results)
        )

    @property
    def recompiles(self) -> int:
        """Graphs compiled after warm-up: each is a recompilation the user paid for at run time."""
        return max(0, len(self.graphs) - self.warmup_graphs)

    @property
    def compile_seconds(self) -> float:
        return sum(g.compile_seconds for g in self.graphs)


def tilefx_op_counts(graph: torch.fx.Graph) -> dict[str, int]:
    counts: collections.Counter[str] = collections.Counter()
    for node in graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == "tilefx":
            counts[f"tilefx.{target._opname}"] += 1
    return dict(counts)
