"""tilefx.compiler: the torch.compile backend, the pass manager and its passes, the options."""

from tilefx.compiler.backend import Backend
from tilefx.compiler.options import CompileOptions
from tilefx.compiler.pass_manager import PassManager, build_passes
from tilefx.compiler.report import CompileReport

__all__ = ["Backend", "CompileOptions", "CompileReport", "PassManager", "build_passes"]
