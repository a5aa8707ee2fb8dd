"""Base class of every tilefx graph pass."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect

import torch.fx


@dataclasses.dataclass
class PassResult:
    """What one pass did to one graph: regions rewritten and regions left alone, with why."""

    name: str
    rewritten: int = 0
    fallbacks: list[str] = dataclasses.field(default_factory=list)
    # id() of model parameters this pass packed: used only through the packed copy in this
    # graph, or also read unpacked (e.g. an lm_head tied to the input embedding).
    packed_exclusively: set[int] = dataclasses.field(default_factory=set)
    packed_shared: set[int] = dataclasses.field(default_factory=set)
    # (kind, why) -> where its line is in fallbacks and how many regions it counts (skip_counted)
    _counted: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def skip(self, where: str, why: str) -> None:
        self.fallbacks.append(f"{where}: {why}")

    def skip_counted(self, kind: str, why: str) -> None:
        """One more region of ``kind`` left alone for ``why``; regions alike share one line, "N kind region(s): why"
        (a decode graph's norms or RoPEs, two a layer, would otherwise list ~100 identical lines in explain())."""
        index, count = self._counted.get((kind, why), (len(self.fallbacks), 0))
        if count == 0:
            self.fallbacks.append("")
        self._counted[(kind, why)] = (index, count + 1)
        self.fallbacks[index] = f"{count + 1} {kind} region(s): {why}"


class TilefxPass:
    """One pass: ``__call__(graph) -> PassResult`` and ``uuid()`` for Inductor's FX graph cache.

    ``uuid()`` hashes the pass's module source and the shared graph helpers, the custom ops' sources, and the options the
    pass reads (``option_key``), so editing either invalidates cached compiled graphs
    (vLLM's ``InductorPass.hash_source``; pytorch#144344 for the custom ops).
    """

    name: str = "pass"

    def option_key(self) -> str:
        return ""

    def __call__(self, graph: torch.fx.Graph) -> PassResult:
        raise NotImplementedError

    def uuid(self) -> str:
        from tilefx import custom_ops

        from tilefx.compiler.passes import graph_utils

        digest = hashlib.sha256(inspect.getsource(inspect.getmodule(type(self))).encode())
        digest.update(inspect.getsource(graph_utils).encode())  # the helpers every pass matches with
        digest.update(custom_ops.source_hash().encode())
        digest.update(self.option_key().encode())
        return digest.hexdigest()
