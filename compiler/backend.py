"""The torch.compile backend: tilefx passes, then Inductor with freezing."""

from __future__ import annotations

import time

import torch
from torch._inductor.compile_fx import compile_fx

from tilefx.compiler.options import CompileOptions
from tilefx.compiler.pass_manager import PassManager
from tilefx.compiler.report import CompileReport


class Backend:
    """``torch.compile(fn, backend=Backend(options))``.

    The pass manager is installed as Inductor's ``pre_grad_custom_pass`` with early
    timing, so it runs on every compiled graph (its report is complete even on an FX
    graph cache hit) and Inductor's cache key covers the graph it produced.
    """

    def __init__(self, options: CompileOptions, report: CompileReport | None = None, moe_blocks: dict | None = None):
        self.options = options
        self.report = report if report is not None else CompileReport()
        self.pass_manager = PassManager(options, self.report, moe_blocks=moe_blocks)

    def inductor_config(self) -> dict:
        return {
            "pre_grad_custom_pass": self.pass_manager,
            "pre_grad_pass_timing": "early",
            "freezing": self.options.freezing,
            # The wrapper checks every extern op's output size, stride and alignment in Python
            # before using it: debugging aids that cost microseconds per op on every decode step.
            "size_asserts": False,
            "alignment_asserts": False,
        }

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        start = time.perf_counter()
        graphs_before = len(self.report.graphs)
        compiled = compile_fx(gm, example_inputs, config_patches=self.inductor_config())
        if len(self.report.graphs) > graphs_before:
            self.report.graphs[-1].compile_seconds = time.perf_counter() - start
        return compiled
