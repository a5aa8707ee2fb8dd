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

    def skip(self, where: str, why: str) -> None:
        self.fallbacks.append(f"{where}: {why}")


def example_value(node) -> torch.Tensor | None:
    """The example tensor Dynamo recorded for a graph node (None for non-tensors and constants)."""
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def model_parameter(node) -> torch.nn.Parameter | None:
    """The model parameter a node stands for: a graph attribute (freezing at trace time) or a Dynamo input."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "get_attr":
        value = getattr(node.graph.owning_module, node.target, None)
    elif node.op == "placeholder" and node.meta.get("grapharg") is not None:
        value = node.meta["grapharg"].example
    else:
        return None
    return value if isinstance(value, torch.nn.Parameter) else None



class TilefxPass:
    """One pass: ``__call__(graph) -> PassResult`` and ``uuid()`` for Inductor's FX graph cache.

    ``uuid()`` hashes the pass's module source, the custom ops' sources, and the options the
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

        digest = hashlib.sha256(inspect.getsource(inspect.getmodule(type(self))).encode())
        digest.update(custom_ops.source_hash().encode())
        digest.update(self.option_key().encode())
        return digest.hexdigest()
