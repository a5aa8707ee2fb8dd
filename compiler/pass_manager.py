"""The pass manager: the one object installed into Inductor's config (``pre_grad_custom_pass``).

It runs tilefx's passes, in the order below, on the Torch-IR graph Dynamo captured,
before AOT autograd functionalizes it. It records what each pass did in a
``CompileReport`` (read by ``tilefx.explain``), dumps graphs before/after each pass
when ``TILEFX_DUMP_GRAPHS=<dir>`` is set, and hashes passes + options in ``uuid()``
so Inductor's FX graph cache never reuses a graph compiled by other passes.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import time

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from tilefx.compiler.options import CompileOptions
from tilefx.compiler.passes.attention import AttentionPass
from tilefx.compiler.passes.base import PassResult, TilefxPass
from tilefx.compiler.passes.graph_utils import model_parameter
from tilefx.compiler.passes.linear import LinearPass
from tilefx.compiler.passes.mla import MlaPass
from tilefx.compiler.passes.moe import MoePass
from tilefx.compiler.report import CompileReport
from tilefx.custom_ops import weights


def build_passes(options: CompileOptions, moe_blocks: dict | None = None) -> list[TilefxPass]:
    """The passes, in order. ``moe_blocks``: module path of each sparse MoE block -> its ``Routing``
    (from the family adapter; the MoE pass needs no more of the model)."""
    passes: list[TilefxPass] = []
    if options.attention:
        passes.append(AttentionPass())
    if options.mla:
        passes.append(MlaPass())
    if options.moe and moe_blocks:
        passes.append(MoePass(moe_blocks, freezing=options.freezing))
    if options.linear:
        passes.append(LinearPass(freezing=options.freezing, fuse=options.fuse_linears))
    return passes


def check_released_weights_read_packed(graph: torch.fx.Graph) -> None:
    """A weight the loader packed and released holds packed-order values: after the passes, only
    packing ops may read it. Anything else would compute with scrambled weights, so it is an error."""
    for node in graph.nodes:
        param = model_parameter(node)
        if param is None or not weights.is_released(param):
            continue
        readers = [user for user in node.users if user.target not in weights.PACKING_OPS]
        if readers:
            packing = weights.packing_of(param)
            raise RuntimeError(
                f"{node.target}: this weight was packed at load ({packing.describe() if packing else 'packed'}) "
                f"but the rewritten graph still reads it through {readers[0].format_node()}; no pass took over "
                f"that use (see tilefx.explain). Compile with the option that disables the region's pass "
                f"(linear=False, moe=False, fuse_linears=False) to keep such weights unpacked."
            )


class PassManager(CustomGraphPass):
    def __init__(self, options: CompileOptions, report: CompileReport | None = None, passes=None,
                 moe_blocks: dict | None = None):
        self.options = options
        self.report = report if report is not None else CompileReport()
        self.passes = build_passes(options, moe_blocks) if passes is None else list(passes)
        self._dump_dir = os.environ.get("TILEFX_DUMP_GRAPHS")

    def __call__(self, graph: torch.fx.Graph) -> None:
        start = time.perf_counter()
        results: list[PassResult] = []
        graph_index = len(self.report.graphs)
        self._dump(graph, graph_index, "0-captured")
        for step, tilefx_pass in enumerate(self.passes, start=1):
            result = tilefx_pass(graph)
            graph.lint()
            results.append(result)
            self._dump(graph, graph_index, f"{step}-after-{tilefx_pass.name}")
        check_released_weights_read_packed(graph)
        self.report.record_graph(graph, results, passes_seconds=time.perf_counter() - start)

    def uuid(self) -> str:
        digest = hashlib.sha256(self.options.key().encode())
        for tilefx_pass in self.passes:
            digest.update(tilefx_pass.uuid().encode())
        return digest.hexdigest()

    def _dump(self, graph: torch.fx.Graph, graph_index: int, stage: str) -> None:
        if self._dump_dir:
            path = pathlib.Path(self._dump_dir) / f"graph{graph_index}-{stage}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(str(graph))
