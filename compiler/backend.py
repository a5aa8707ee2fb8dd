"""The torch.compile backend: tilefx passes, packed weights as graph inputs, then Inductor."""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator

import torch
from torch._inductor.compile_fx import compile_fx

from tilefx.compiler.graph_cache import Saveable
from tilefx.compiler.options import CompileOptions
from tilefx.compiler.pass_manager import CacheKey, PassManager, packings_as_inputs
from tilefx.compiler.report import CompileReport, GraphRecord


# Loop iterations each thread must get before a static-shape graph's generated kernels run a loop in parallel.
STATIC_MIN_CHUNK = 4096


class Backend:
    """``torch.compile(fn, backend=Backend(options))``.

    Each graph Dynamo captures goes through the passes (every time, cache hit or not:
    the report is complete and the packed weights are found), then its packing ops
    become inputs holding the packed tensors, which the returned function appends to
    Dynamo's arguments on every call. Inductor's compile caches see the rewritten graph
    and, through ``CacheKey``, the passes' and options' ``uuid()``. The runtime runs its
    compiled forward inside ``compiling``, which says what the graphs serve and hands back
    what saving them in tilefx's graph cache needs.
    """

    def __init__(self, options: CompileOptions, report: CompileReport | None = None, moe_blocks: dict | None = None):
        self.options = options
        self.report = report if report is not None else CompileReport()
        self.pass_manager = PassManager(options, self.report, moe_blocks=moe_blocks)
        self.cache_key = CacheKey(self.pass_manager.uuid())
        self._compiling: tuple[str, bool, list[Saveable | str]] | None = None  # compiling()'s arguments and list

    @contextlib.contextmanager
    def compiling(self, phase: str, saveable: bool = False) -> Iterator[list[Saveable | str]]:
        """The graphs Dynamo compiles inside the block: recorded as serving ``phase`` ("prefill", "decode") and,
        with ``saveable`` (tilefx's graph cache on), compiled under AOT autograd's bundled cache so they can be
        saved (compiler/graph_cache.py). Yields a list that gets, per graph compiled with ``saveable``, what
        saving it needs or why it cannot be saved."""
        compiled: list[Saveable | str] = []
        self._compiling = (phase, saveable, compiled)
        try:
            yield compiled
        finally:
            self._compiling = None

    def inductor_config(self, static_shapes: bool = False) -> dict:
        config = {
            "pre_grad_custom_pass": self.cache_key,
            "freezing": self.options.freezing,
            "cpp_wrapper": self.options.cpp_wrapper,
            # The wrapper checks every extern op's output size, stride and alignment in Python
            # before using it: debugging aids that cost microseconds per op on every decode step.
            "size_asserts": False,
            "alignment_asserts": False,
        }
        if static_shapes:
            # Inductor parallelizes a loop once each thread gets 512 iterations: batch 1's decode step's norms
            # and RoPE (2048 values) then pay an OpenMP fork and join each, ~5 us of a ~9 us kernel on the Xeon
            # 6 (docs/PERFORMANCE.md, fiftieth session). Only where every size is known: a dynamic dim (a
            # prefill's tokens, a batch) is judged by its hint, the warm-up's, which would make the kernels of
            # long prompts and big batches serial too.
            config["cpp.min_chunk_size"] = STATIC_MIN_CHUNK
        return config

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        start = time.perf_counter()
        sources = [getattr(node.meta.get("grapharg"), "source", None) for node in gm.graph.find_nodes(op="placeholder")]
        outputs = gm.graph.output_node().args[0]
        phase, saveable, kept = self._compiling if self._compiling is not None else ("unknown", False, [])
        gm = _own_copy(gm)
        record = self.pass_manager(gm.graph, phase)
        packed, fakes, recipes = packings_as_inputs(gm, torch._guards.detect_fake_mode(example_inputs))
        if self.options.inductor:
            with torch._functorch.config.patch(bundled_autograd_cache=saveable):
                config = self.inductor_config(static_shapes=_static(example_inputs))
                compiled = compile_fx(gm, [*example_inputs, *fakes], config_patches=config)
        else:  # the rewritten graph as it is: its own generated Python runs the ops
            compiled = gm.forward
        record.compile_seconds = time.perf_counter() - start
        if saveable:
            kept.append(_saveable(sources, outputs, recipes, compiled, record))
        return _with_inputs(compiled, packed)


def _saveable(sources: list, outputs, recipes: list | None, compiled, record: GraphRecord) -> Saveable | str:
    """What the graph cache needs to save a compiled graph, or why it cannot call it from sources."""
    if None in sources or recipes is None:
        return "an input Dynamo gave no source"
    if not isinstance(outputs, (list, tuple)) or len(outputs) != 1:
        count = len(outputs) if isinstance(outputs, (list, tuple)) else "not a list of"
        return f"{count} outputs (the graph cache calls graphs that return the logits only)"
    return Saveable([source.name for source in sources], recipes, compiled, record)


_DYNAMO_ATTRIBUTES = ("_param_name_to_source", "_source_to_user_stacks", "_backend_id", "compile_subgraph_reason")


def _static(example_inputs) -> bool:
    """Whether a graph's inputs have no symbolic size (no dynamic dim, no SymInt argument)."""
    for value in example_inputs:
        sizes = value.shape if isinstance(value, torch.Tensor) else (value,)
        if any(isinstance(size, torch.SymInt) for size in sizes):
            return False
    return True


def _own_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` over a copy of its graph (nodes and their meta shallow-copied; weights shared): Dynamo reads its
    graph's inputs again after the backend returns, so the inputs the backend adds must not be in it."""
    nodes: dict[torch.fx.Node, torch.fx.Node] = {}
    graph = torch.fx.Graph(tracer_cls=gm.graph._tracer_cls)
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    value, output = graph.graph_copy(gm.graph, nodes, return_output_node=True)
    graph.output(value, type_expr=getattr(output, "type", None)).meta = copy.copy(output.meta)
    for old, new in nodes.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    own = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    own.meta = dict(gm.meta)
    for name in _DYNAMO_ATTRIBUTES:
        if hasattr(gm, name):
            setattr(own, name, getattr(gm, name))
    return own


def _with_inputs(compiled, extra: list[torch.Tensor]):
    """``compiled`` (called as Dynamo calls a backend's result: ``*args``) with ``extra`` after the caller's arguments."""
    if not extra:
        return compiled
    return lambda *args: compiled(*args, *extra)
