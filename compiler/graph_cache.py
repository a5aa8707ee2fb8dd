"""Compiled graphs kept on disk with how to call them: a warm start loads them and skips Dynamo.

A warm start with Inductor's caches hot still spent much of its time in Dynamo,
re-tracing every decoder layer to rebuild graphs whose compiled code the caches held
(docs/PERFORMANCE.md). Nothing in that trace is needed again: the runtime already
picks which graph a call needs (its *call class*: batch 1 or the dynamic batch, prefill
or decode, logits kept), and every input of a graph is either a tensor Dynamo names by an
expression over the frame's locals (``L['kwargs']['input_ids']``,
``L['forward'].__self__._modules['lm_head']._parameters['weight']``, a size such as
``L['kwargs']['input_ids'].size()[1]``) or a packed weight the passes made from such
tensors. So the backend's result for each call class is saved as

- the compiled function, bundled by AOT autograd (the artifact ``torch._dynamo.aot_compile``
  and ``standalone_compile(aot=True)`` save; its C++ kernels come from Inductor's cache),
- the source expression of each Dynamo input and a recipe per packed input (the packing op
  and the sources of its weights),
- the graph's ``GraphRecord`` for ``tilefx.explain`` (parameters by name, not id).

A later process whose key matches loads these and calls the compiled functions itself:
no Dynamo, no guards (the runtime chooses the graph; the key covers what the trace read).
The key hashes tilefx's sources (the compiler's and the custom ops'; the caller names the
directories of the code above them that shapes the graphs: the runtime's, the facade's),
torch's (``torch_key``), the CPU's flags and Inductor's vector ISA, the thread count Inductor's kernels were
generated for, transformers' version and
the model class's source file, Inductor's config, the model's config, the names, shapes and
dtypes of its parameters and buffers, the options, the kernel path and the Python version. Only graphs
that are safe to call this way are saved: one output (the logits) and a source for every
input. Saving or loading that fails leaves the Dynamo path in charge, with the reason in
``tilefx.explain``. The cache lives in ``<Inductor cache dir>/tilefx/`` (``TILEFX_GRAPH_CACHE_DIR``
moves it; the compiled kernels stay in Inductor's cache); it is off when
Inductor's caches are (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``) or with
``graph_cache=False``.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import json
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

import tilefx.custom_ops
from tilefx.compiler.passes.base import PassResult
from tilefx.compiler.report import GraphRecord

FORMAT_VERSION = 1
# The compiler's and the custom ops' sources are in every key; the code above them is named by the caller.
OWN_SOURCES = (pathlib.Path(__file__).parent, pathlib.Path(tilefx.custom_ops.__file__).parent)


def source_expression(expression: str):
    """``expression`` (a Dynamo source name) as a function of ``L``, after checking that it only indexes, reads
    attributes and calls ``size()``: the manifest is data, never code."""
    tree = ast.parse(expression, mode="eval")
    for node in ast.walk(tree):
        allowed = isinstance(node, (ast.Expression, ast.Subscript, ast.Attribute, ast.Load, ast.Constant))
        allowed = allowed or (isinstance(node, ast.Name) and node.id == "L")
        allowed = allowed or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                              and node.func.attr == "size" and not node.args and not node.keywords)
        if not allowed:
            raise ValueError(f"graph cache: {expression!r} is not an input source ({type(node).__name__})")
    return eval(f"lambda L: {expression}", {"__builtins__": {}})  # noqa: S307 (checked above)


@dataclasses.dataclass
class Saveable:
    """What the backend keeps of a graph it compiled, for the runtime to save under the call's class."""

    inputs: list[str]  # Dynamo's inputs, in order: each one's source expression
    extras: list  # the packed inputs appended after them: ["pack", op name, args] or ["scales", index]
    compiled: Callable  # compile_fx's result, compiled with AOT autograd's bundled cache on
    record: GraphRecord


class LoadedGraph:
    """A saved graph called without Dynamo: resolves its inputs from the runtime's call and returns the logits."""

    def __init__(self, compiled, inputs: list[str], extras: list, forward):
        self.compiled = compiled
        self.forward = forward
        resolvers = [source_expression(source) for source in inputs]
        model_locals = {"forward": forward}
        # Weights and buffers are the model's for good (resolved once); the rest comes from each call.
        self.fixed = [resolve(model_locals) if source.startswith("L['forward']") else None
                      for source, resolve in zip(inputs, resolvers)]
        self.per_call = [(index, resolve) for index, (source, resolve) in enumerate(zip(inputs, resolvers))
                         if not source.startswith("L['forward']")]
        self.extras = _run_recipes(extras, model_locals)

    def __call__(self, kwargs: dict) -> torch.Tensor:
        call_locals = {"forward": self.forward, "kwargs": kwargs}
        args = list(self.fixed)
        for index, resolve in self.per_call:
            args[index] = resolve(call_locals)
        return self.compiled(*args, *self.extras)[0]


def _run_recipes(extras: list, model_locals: dict) -> list[torch.Tensor]:
    from tilefx.custom_ops import weights

    def value(arg):
        if isinstance(arg, dict):
            return source_expression(arg["source"])(model_locals)
        if isinstance(arg, list):
            return [value(a) for a in arg]
        return arg

    tensors: list[torch.Tensor] = []
    with torch.no_grad():
        for recipe in extras:
            if recipe[0] == "pack":
                _, op_name, args, kwargs = recipe
                op = getattr(torch.ops.tilefx, op_name).default
                if op not in weights.PACKING_OPS:
                    raise ValueError(f"graph cache: {op_name} is not a packing op")
                tensors.append(op(*value(args), **{name: value(v) for name, v in kwargs.items()}))
            else:
                tensors.append(weights.scales_of(tensors[recipe[1]]))
    return tensors


class GraphCache:
    """One model's saved graphs: ``<dir>/graphs.json`` (call class -> inputs, recipes, record, artifact file)."""

    def __init__(self, directory: pathlib.Path, key: str):
        self.directory = directory
        self.key = key
        self.loaded: list[str] = []  # call classes served from disk in this process
        self.saved: list[str] = []
        self.problems: list[str] = []  # why a graph was not saved or not loaded

    @classmethod
    def open(cls, model, options, uuid: str, *, sources: Sequence[pathlib.Path]) -> GraphCache | None:
        """The cache for ``model`` (None where it is off). ``sources``: directories of the caller's code that
        shapes the graphs, hashed into the key with the compiler's own (``model_key``)."""
        if not options.graph_cache or options.freezing or not options.fullgraph or not options.inductor:
            # frozen graphs read weights as constants, not sources; graph breaks: several per call; without
            # Inductor nothing is compiled to keep
            return None
        if torch.compiler.config.force_disable_caches:
            return None
        key = model_key(model, options, uuid, sources=sources)
        return cls(tilefx.custom_ops.tuning.cache_root() / key[:40], key)

    # -- reading ---------------------------------------------------------------------------
    def manifest(self) -> dict:
        try:
            data = json.loads((self.directory / "graphs.json").read_text())
        except (OSError, ValueError):
            return {}
        if data.get("version") != FORMAT_VERSION or data.get("key") != self.key:
            return {}
        return data.get("graphs", {})

    def load(self, call: str, model, report) -> LoadedGraph | None:
        """The saved graph of ``call``, ready to run on ``model`` (None when there is none or it fails to load:
        the reason goes to ``problems``). Appends its record to ``report.graphs``."""
        entry = self.manifest().get(call)
        if entry is None:
            return None
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

        start = time.perf_counter()
        try:
            data = (self.directory / entry["artifact"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise ValueError("artifact does not match its manifest entry")
            compiled = BundledAOTAutogradSerializableCallable.deserialize_compile_artifacts(data)
            forward = type(model).forward.__get__(model)
            graph = LoadedGraph(compiled, entry["inputs"], entry["extras"], forward)
        except Exception as error:  # a stale or damaged entry: Dynamo compiles it again and overwrites it
            self.problems.append(f"{call}: not loaded ({type(error).__name__}: {error})")
            return None
        record = _record_from_dict(entry["record"], model)
        record.compile_seconds = time.perf_counter() - start
        report.graphs.append(record)
        self.loaded.append(call)
        return graph

    def adopt(self, call: str, saveable: Saveable, model) -> LoadedGraph | None:
        """A graph Dynamo just compiled, called as a loaded one from then on: the process that compiled it
        skips Dynamo's guards and frame setup on every later call too (a fixed cost per decode step), and runs
        the same path as the processes that load it. None where it cannot be (the reason in ``problems``)."""
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

        try:
            compiled = BundledAOTAutogradSerializableCallable(saveable.compiled)
            return LoadedGraph(compiled, saveable.inputs, saveable.extras, type(model).forward.__get__(model))
        except Exception as error:  # Dynamo's compiled code keeps serving the call class
            self.problems.append(f"{call}: not called directly ({type(error).__name__}: {error})")
            return None

    # -- writing ---------------------------------------------------------------------------
    def save(self, call: str, saveable: Saveable, model) -> None:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

        try:
            if getattr(saveable.compiled, "serialize", None) is None:
                raise ValueError("AOT autograd gave no serializable result")
            data = BundledAOTAutogradSerializableCallable.serialize_compile_artifacts(
                BundledAOTAutogradSerializableCallable(saveable.compiled))
            self.directory.mkdir(parents=True, exist_ok=True)
            artifact = f"graph-{hashlib.sha256(call.encode()).hexdigest()[:16]}.bin"
            _write_atomic(self.directory / artifact, data)
            graphs = self.manifest()
            graphs[call] = {"inputs": saveable.inputs, "extras": saveable.extras, "artifact": artifact,
                            "sha256": hashlib.sha256(data).hexdigest(), "record": _record_to_dict(saveable.record, model)}
            manifest = {"version": FORMAT_VERSION, "key": self.key, "graphs": graphs}
            _write_atomic(self.directory / "graphs.json", json.dumps(manifest, indent=1).encode())
        except Exception as error:  # the cache is an optimisation: the compiled graph runs either way
            self.problems.append(f"{call}: not saved ({type(error).__name__}: {error})")
            return
        self.saved.append(call)

    def not_saved(self, call: str, why: str) -> None:
        """``call``'s graph was compiled but cannot be saved (``why``: the backend's reason)."""
        self.problems.append(f"{call}: not saved ({why})")

    def line(self) -> str:
        """For ``tilefx.explain``."""
        parts = [f"{len(self.loaded)} loaded", f"{len(self.saved)} saved"]
        return f"graph cache {self.directory}: " + ", ".join(parts) + "".join(f"; {p}" for p in self.problems)


def model_key(model, options, uuid: str, *, sources: Sequence[pathlib.Path]) -> str:
    """Everything a captured graph depends on, hashed (see the module docstring). ``sources``: directories of
    the caller's code (their ``*.py`` files) hashed with ``OWN_SOURCES``."""
    import transformers
    from torch._inductor.codecache import torch_key
    from torch._inductor.utils import parallel_num_threads

    from tilefx.custom_ops import isa

    digest = hashlib.sha256()
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    inductor = repr(sorted(torch._inductor.config.save_config_portable().items()))  # e.g. a caller's config.patch
    # A cache directory can outlive the CPU (a shared home, a VM moved): the compiled kernels use its ISA.
    cpu = f"{pick_vec_isa()} {_cpu_flags()}"
    # Inductor writes `#pragma omp parallel num_threads(N)` into its kernels (its own cache keys on N): loaded
    # into a process of another thread count, each of its kernels resizes OpenMP's team against the custom ops'
    # and libgomp ends and recreates the surplus threads every time (docs/PERFORMANCE.md, the Xeon's 16 threads).
    threads = f"threads={parallel_num_threads()}"
    for part in (str(FORMAT_VERSION), sys.version, transformers.__version__, options.key(), uuid, isa.current(),
                 cpu, threads, inductor, model.config.to_json_string(use_diff=False)):
        digest.update(part.encode())
        digest.update(b"\0")
    digest.update(torch_key())
    digest.update(_sources_hash([*OWN_SOURCES, *sources]).encode())
    try:
        digest.update(pathlib.Path(inspect.getsourcefile(type(model))).read_bytes())
    except (OSError, TypeError):
        digest.update(type(model).__qualname__.encode())
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}\0".encode())
    return digest.hexdigest()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return ""


def _sources_hash(roots: Sequence[pathlib.Path]) -> str:
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, prefix=".tmp-") as file:
        file.write(data)
    os.replace(file.name, path)


def _parameter_names(model) -> dict[int, str]:
    """id() of each parameter -> its first name (a tied weight has several)."""
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def _record_to_dict(record: GraphRecord, model) -> dict:
    names = _parameter_names(model)
    return {
        "phase": record.phase, "nodes": record.nodes, "tilefx_ops": record.tilefx_ops,
        "passes": [{"name": r.name, "rewritten": r.rewritten, "fallbacks": r.fallbacks,
                    "packed_exclusively": sorted(names[i] for i in r.packed_exclusively if i in names),
                    "packed_shared": sorted(names[i] for i in r.packed_shared if i in names)} for r in record.passes],
    }


def _record_from_dict(data: dict, model) -> GraphRecord:
    ids = {name: key for key, name in _parameter_names(model).items()}
    passes = [PassResult(name=p["name"], rewritten=p["rewritten"], fallbacks=list(p["fallbacks"]),
                         packed_exclusively={ids[n] for n in p["packed_exclusively"]},
                         packed_shared={ids[n] for n in p["packed_shared"]}) for p in data["passes"]]
    return GraphRecord(phase=data["phase"], nodes=data["nodes"], tilefx_ops=dict(data["tilefx_ops"]), passes=passes,
                       loaded=True)  # the passes did not run in this process
