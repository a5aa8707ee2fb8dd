"""The pass manager: runs tilefx's passes on each graph Dynamo captures, before Inductor sees it.

It runs the passes, in the order below, on the Torch-IR graph, records what each
did in a ``CompileReport`` (read by ``tilefx.explain``), dumps graphs before/after
each pass when ``TILEFX_DUMP_GRAPHS=<dir>`` is set, then turns every packing op
the passes inserted into a graph input holding the packed tensor
(``packings_as_inputs``). ``uuid()`` hashes passes + options; ``CacheKey`` puts it
in Inductor's config so the compile caches never reuse a graph compiled by other
passes or another tilefx.
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
from tilefx.compiler.passes.compute_once import ComputeOncePass
from tilefx.compiler.passes.base import PassResult, TilefxPass
from tilefx.compiler.passes.graph_utils import model_parameter
from tilefx.compiler.passes.kept_rows import KeptRowsPass
from tilefx.compiler.passes.linear import LinearPass
from tilefx.compiler.passes.mla import MlaPass
from tilefx.compiler.passes.moe import MoePass
from tilefx.compiler.passes.norm import NormPass
from tilefx.compiler.passes.partition import PartitionPass
from tilefx.compiler.passes.rope import RopePass
from tilefx.compiler.report import CompileReport, GraphRecord
from tilefx.custom_ops import collectives, weights


def build_passes(options: CompileOptions, moe_blocks: dict | None = None) -> list[TilefxPass]:
    """The passes, in order. ``moe_blocks``: module path of each sparse MoE block -> its ``Routing``
    (from the family adapter; the MoE pass needs no more of the model)."""
    passes: list[TilefxPass] = []
    if options.attention:
        passes.append(AttentionPass())
    if options.mla:
        passes.append(MlaPass())
    if options.moe and moe_blocks:
        passes.append(MoePass(moe_blocks))
    if options.tp_world_size > 1:  # on the experts' fused_moe, and on linears before the linear pass packs them
        passes.append(PartitionPass(collectives.TP_GROUP, options.tp_world_size))
    if options.linear:
        passes.append(LinearPass(fuse=options.fuse_linears))
    if options.rope:
        passes.append(RopePass())
    if options.norm:
        passes.append(NormPass())
    if options.kept_rows:  # after the linear and norm passes: it moves the slice up through their ops
        passes.append(KeptRowsPass())
    if options.compute_once:
        passes.append(ComputeOncePass())
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


def packings_as_inputs(gm: torch.fx.GraphModule, fake_mode) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    """Each packing op in ``gm`` run now, on the model's weights; its packed tensor becomes a new graph input.

    The packing ops serve the packings the loader made (or pack once, custom_ops/weights/),
    so this costs no copy. As inputs, packed weights are neither computed per call nor
    constants of the compiled graph: the graph is the same with or without Inductor's
    freezing, and the compile caches key it by the weights' shapes, never their values
    (AOT autograd's cache refuses frozen graphs). Returns the packed tensors, in the order
    of the new inputs, fake tensors of them for the example inputs, and a recipe per new
    input for the graph cache: ``["pack", op name, args, kwargs]`` with each weight as
    ``{"source": <Dynamo source>}`` (None when a weight has no source: a frozen graph's
    attribute), or ``["scales", index of the packed input]``.
    """
    packed: list[torch.Tensor] = []
    recipes: list | None = []
    inputs: dict[tuple, torch.fx.Node] = {}  # one input per packed tensor, shared by the ops that ask for it
    last_input = gm.graph.find_nodes(op="placeholder")[-1]

    def real(arg):
        if isinstance(arg, (list, tuple)):
            return [real(a) for a in arg]
        if not isinstance(arg, torch.fx.Node):
            return arg
        param = model_parameter(arg)
        if param is None:
            raise RuntimeError(f"{arg.format_node()}: a packing op reads something other than a model parameter")
        return param

    def recipe_arg(arg):
        if isinstance(arg, (list, tuple)):
            return [recipe_arg(a) for a in arg]
        if not isinstance(arg, torch.fx.Node):
            return arg
        grapharg = arg.meta.get("grapharg") if arg.op == "placeholder" else None
        if grapharg is None or grapharg.source is None:
            raise _NoSource
        return {"source": grapharg.source.name}

    def as_input(node: torch.fx.Node, tensor: torch.Tensor, recipe) -> torch.fx.Node:
        nonlocal last_input, recipes
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
               tensor.dtype)
        if key not in inputs:
            if recipes is not None:
                try:
                    recipes.append(recipe())
                except _NoSource:
                    recipes = None
            with gm.graph.inserting_after(last_input):
                last_input = inputs[key] = gm.graph.placeholder(f"tilefx_packed_{len(packed)}")
            # "example_value" as Dynamo's own inputs carry it, not "val": Inductor's C++ wrapper takes the inputs
            # of a graph whose placeholders have a "val" from those, and would call Dynamo's with None
            last_input.meta["example_value"] = fake_mode.from_tensor(tensor, static_shapes=True)
            last_input._dynamo_source = None  # AOT autograd asks each input of a Dynamo graph where it came from
            packed.append(tensor)
        node.replace_all_uses_with(inputs[key])
        gm.graph.erase_node(node)
        return inputs[key]

    held: dict[torch.fx.Node, torch.Tensor] = {}  # the inputs made so far -> their tensors
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in weights.PACKING_OPS]:
        with torch.no_grad():
            tensor = node.target(*real(node.args), **{name: real(value) for name, value in node.kwargs.items()})
        held[as_input(node, tensor, lambda: ["pack", node.target._opname, recipe_arg(node.args),
                                              {k: recipe_arg(v) for k, v in node.kwargs.items()}])] = tensor
    # A quantized packing's scales (tilefx.packed_scales of a packing op, now of its input) become inputs too.
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is weights.packed_scales]:
        of = node.args[0]  # the packed input, by now
        as_input(node, weights.scales_of(held[of]), lambda: ["scales", list(inputs.values()).index(of)])
    gm.graph.lint()
    gm.recompile()
    return packed, [inputs_node.meta["example_value"] for inputs_node in inputs.values()], recipes


class _NoSource(Exception):
    """A packing op reads a weight Dynamo gave no source (freezing made it a graph attribute)."""


class CacheKey(CustomGraphPass):
    """Installed as Inductor's ``pre_grad_custom_pass`` only for its ``uuid()`` (the passes already ran): FX graph
    and AOT autograd cache keys include it."""

    def __init__(self, uuid: str):
        self._uuid = uuid

    def __call__(self, graph: torch.fx.Graph) -> None:
        pass

    def uuid(self) -> str:
        return self._uuid


class PassManager:
    """Not an Inductor pass itself: the backend runs it before Inductor, and ``CacheKey`` carries its ``uuid()``."""

    def __init__(self, options: CompileOptions, report: CompileReport | None = None, passes=None,
                 moe_blocks: dict | None = None):
        self.options = options
        self.report = report if report is not None else CompileReport()
        self.passes = build_passes(options, moe_blocks) if passes is None else list(passes)
        self._dump_dir = os.environ.get("TILEFX_DUMP_GRAPHS")

    def __call__(self, graph: torch.fx.Graph, phase: str = "unknown") -> GraphRecord:
        """Rewrites ``graph``; returns its record in the report (``phase``: what the graph serves, as its caller
        knows it: "prefill" or "decode")."""
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
        return self.report.record_graph(graph, results, phase, passes_seconds=time.perf_counter() - start)

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
