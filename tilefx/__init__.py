"""tilefx: make Hugging Face causal LMs decode fast on CPUs.

    model = tilefx.compile_model("meta-llama/Llama-3.2-1B")   # hub id, HF cache, local dir or PreTrainedModel
    out = model.generate(input_ids, max_new_tokens=64)         # plain transformers generate()
    print(tilefx.explain(model))
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
import warnings

import torch
from tqdm.auto import tqdm

__version__ = "0.1.0"
__all__ = ["compile_model", "explain", "__version__"]


# Weights, packings and the KV cache are normal tensors even for a caller in inference
# mode: the runtime updates the cache in place outside it (models/runtime.py, forward).
@torch.inference_mode(False)
def compile_model(
    source,
    *,
    max_seq_len: int = 2048,
    max_batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    trust_remote_code: bool = False,
    revision: str | None = None,
    local_files_only: bool = False,
    warmup: bool = True,
    progress: bool = True,
    tp: int = 1,
    **options,
):
    """Load ``source`` and return it compiled: still a ``PreTrainedModel``, ``generate()`` unchanged.

    ``source`` is a hub id, a directory (``save_pretrained`` layout, safetensors), or a
    ``PreTrainedModel``. The KV cache is preallocated for ``max_batch`` sequences of
    ``max_seq_len`` tokens (prompt + new tokens); larger requests raise ``ValueError``.
    With ``warmup`` the prefill and decode graphs are compiled here rather than on the
    first request: one pair for batch 1 and, with ``max_batch`` above 1, one pair for
    every batch from 2 to ``max_batch`` (the batch a dynamic dim). Other keyword
    arguments are fields of ``tilefx.compiler.CompileOptions``.

    ``tp=N``: tensor parallel over N ranks started by torchrun (every rank calls this with
    the same arguments; models/tp.py): each rank binds to its cores, reads only its slice of
    the weights, and its graphs sum the ranks' partial results; ``generate()`` returns the
    same tokens on every rank.
    """
    started = time.perf_counter()
    import tilefx.custom_ops  # noqa: F401  (registers the tilefx ops)
    from tilefx.compiler import CompileOptions, CompileReport
    from tilefx.compiler.report import cache_counters, counters_since
    from tilefx.custom_ops import openmp, tuning
    from tilefx.models.load import load_for_rank, place_rank, resolve_source
    from tilefx.models.packing import pack_model
    from tilefx.models.runtime import TilefxRuntime

    option_names = [f.name for f in dataclasses.fields(CompileOptions)]
    unknown = sorted(set(options) - set(option_names))
    if unknown:
        raise TypeError(f"compile_model: unknown option {', '.join(map(repr, unknown))}; expected one of "
                        f"{', '.join(option_names)} (fields of tilefx.compiler.CompileOptions)")
    for name in ("tp_rank", "tp_world_size"):
        if name in options:
            raise TypeError(f"compile_model: {name} is set by tp= (the process group gives the rank)")
    opts = CompileOptions(max_seq_len=max_seq_len, max_batch=max_batch, dtype=dtype, **options)
    # What to load, decided before any weight is read: the config, the family adapter (resolved once, for every
    # step below) and, with tp, this rank's place in the process group and the split (models/load.py).
    resolved = resolve_source(source, tp=tp, moe=opts.moe, trust_remote_code=trust_remote_code, revision=revision,
                              local_files_only=local_files_only)
    opts = dataclasses.replace(opts, tp_rank=resolved.rank, tp_world_size=resolved.world_size)
    report = CompileReport()
    report.threads = openmp.idle_wait()
    if (why := openmp.warning(report.threads)) is not None:
        warnings.warn(why, RuntimeWarning, stacklevel=2)
    warmup_batches = [b for b in (1, 2) if b <= max_batch] if warmup else []
    batches = {1: "batch 1", 2: f"batch 2-{max_batch}" if max_batch > 2 else "batch 2"}
    steps = ["load", "pack"] + [f"compile {batches[b]}" for b in warmup_batches]
    quiet = not progress or os.environ.get("TILEFX_QUIET") == "1" or resolved.rank != 0
    bar = tqdm(steps, desc="tilefx", disable=quiet, leave=False)  # tensor parallel: rank 0's bar only
    placed = place_rank(resolved)
    # Tune the decode walks before the weights load: the timed pass's memory is gone before the checkpoint
    # arrives, so it adds nothing to the peak. The formats are the options' (or the checkpoint's) and bf16.
    bar.set_postfix_str("tune decode walks")
    formats = {"bf16", resolved.checkpoint_format if opts.weights == "auto" else opts.weights}
    report.walks = tuning.ensure_tuned(formats, enabled=opts.tune)
    bar.set_postfix_str("tune prefill")
    report.gemms = tuning.ensure_gemm_tuned(formats, enabled=opts.tune)
    report.attention = tuning.ensure_attention_tuned(
        resolved.adapter.prefill_attention(resolved.rank_config, opts.mla), enabled=opts.tune)
    bar.set_postfix_str("load")
    start = time.perf_counter()
    loaded = load_for_rank(resolved, dtype=dtype, placed=placed, progress=not bar.disable)
    model = loaded.model
    report.placement, report.collectives = loaded.placement, loaded.collectives
    report.load_seconds = time.perf_counter() - start
    bar.update()
    bar.set_postfix_str("pack weights")
    report.packing = pack_model(model, resolved.adapter, opts, progress=not bar.disable)
    bar.update()
    runtime = TilefxRuntime(model, resolved.adapter, opts, report, cache_config=loaded.cache_config,
                            sources=[pathlib.Path(__file__).parent])  # in the graph cache's key
    runtime.install()
    counters_before, warmup_start = cache_counters(), time.perf_counter()
    for batch in warmup_batches:
        bar.set_postfix_str(f"compile prefill+decode, {batches[batch]}")
        _warm_up(model, batch)
        bar.update()
    report.warmup_seconds = time.perf_counter() - warmup_start
    report.caches = counters_since(counters_before)
    bar.close()
    report.warmup_graphs = len(report.graphs)
    if warmup:
        runtime.keep_only_packed_weights()
    report.total_seconds = time.perf_counter() - started
    return model


def _warm_up(model, batch: int) -> None:
    """One prefill and one decode step, called as generate() calls them: compiles both graphs."""
    from tilefx.models.runtime import CACHE_ARG, cache_kwargs

    ids = torch.ones(batch, 2, dtype=torch.long)
    out = model(input_ids=ids, logits_to_keep=1)
    model(input_ids=ids[:, :1], **cache_kwargs(out[CACHE_ARG]))
    model.tilefx.cache.reset()


def _prompt_x(format: str) -> str:
    """How a prompt's GEMMs over ``format`` (int8, int4) weights read x on the current path (tuning.gemm_x;
    TILEFX_INT8_ACTIVATIONS)."""
    from tilefx.custom_ops import isa, tuning

    x = tuning.gemm_x(format, isa.current())
    if x != "bf16":
        return (f"a prompt's GEMMs read x as {tuning.GEMM_X[x]} (TILEFX_INT8_ACTIVATIONS=bf16: bf16 over dequantized "
                "blocks)")
    return "a prompt's GEMMs dequantize the weights and read bf16"


def _int8_activations_line() -> str:
    """How the int8 linears read x on the current path: decode as int16 words; a prompt's GEMMs as ``_prompt_x``."""
    from tilefx.custom_ops import isa

    if not isa.kernel_units(isa.current()):
        return "activations: the int8 linears read x as it is (the reference path)"
    return ("activations: the int8 linears of up to 4 rows read x rounded to int16 per row (one scale "
            "each, 15 bits); " + _prompt_x("int8"))


def _int4_activations_line() -> str:
    """How the int4 linears read x on the current path: decode as isa.int4_activations (TILEFX_INT4_ACTIVATIONS)
    says; a prompt's GEMMs as ``_prompt_x``."""
    from tilefx.custom_ops import isa

    if not isa.kernel_units(isa.current()):
        return "activations: the int4 linears and experts read x as it is (the reference path)"
    if isa.int4_activations() == "int8":
        how = "int8 per 32 inputs (TILEFX_INT4_ACTIVATIONS=int8)"
    else:
        how = "int16 words per row (15 bits; TILEFX_INT4_ACTIVATIONS=int8 reads int8 per 32 inputs)"
    return f"activations: the int4 linears and experts of up to 4 rows read x as {how}; " + _prompt_x("int4")


def _working_memory_line(opts) -> str:
    from tilefx.custom_ops import buffers

    chunks = f"prompts over {opts.prefill_chunk} tokens in calls of at most that many" if opts.prefill_chunk \
        else "every prompt in one call"
    if not opts.recycle_buffers:
        return f"working memory: {chunks}; CPU buffers not recycled (recycle_buffers=False)"
    stats = buffers.stats()
    return (f"working memory: {chunks}; CPU buffers of {buffers.DEFAULT_MIN_BYTES // 2**20} MiB and more recycled "
            f"within each forward (in this process {stats['reused']} requests served by a kept block, "
            f"{stats['made']} made anew)")


def explain(model) -> str:
    """What tilefx did to ``model``: regions rewritten per pass, fallbacks and why, graphs, recompiles, timing."""
    runtime = getattr(model, "tilefx", None)
    if runtime is None:
        return "not compiled by tilefx (call tilefx.compile_model first)"
    report, opts = runtime.report, runtime.options
    lines = [
        f"tilefx {__version__}: {type(model).__name__} ({model.config.model_type}), dtype {opts.dtype}, "
        f"max_batch {opts.max_batch}, max_seq_len {opts.max_seq_len}",
        f"KV cache: {runtime.cache.nbytes / 2**20:.2f} MiB preallocated",
        _working_memory_line(opts),
        f"weights: {report.packing.tensors} packed as they loaded ({report.packing.packed_bytes / 2**20:.1f} MiB, "
        f"sources released {report.packing.released_bytes / 2**20:.1f} MiB); packed while compiling and released "
        f"after warm-up {report.released_bytes / 2**20:.1f} MiB ({report.kept_unpacked} also kept unpacked)",
        report.packing.formats_line(),
        *([_int8_activations_line()] if "int8" in report.packing.formats else []),
        *([_int4_activations_line()] if "int4" in report.packing.formats else []),
        *(f"decode walk {walk.line()}" for walk in report.walks),
        *(gemm.line() for gemm in report.gemms),
        *([report.attention.line(), report.attention.decode_line()] if report.attention is not None else []),
        *([report.threads.line()] if report.threads is not None else []),
        report.startup_line(),
        *([runtime.graph_cache.line()] if runtime.graph_cache is not None else []),
        *([report.tp_line()] if opts.tp_world_size > 1 else []),
        f"graphs {len(report.graphs)} ({report.warmup_graphs} at warm-up), recompiles since warm-up "
        f"{report.recompiles}, graph breaks {report.graph_breaks}" + (" (fullgraph)" if opts.fullgraph else "")
        + ("; Inductor's C++ wrapper" if opts.cpp_wrapper else "")
        + ("" if opts.inductor else "; Inductor off (inductor=False): the glue runs op by op"),
    ]
    for index, graph in enumerate(report.graphs):
        ops = ", ".join(f"{name} x{count}" for name, count in sorted(graph.tilefx_ops.items())) or "none"
        lines.append(f"graph {index} [{graph.phase}]: {graph.nodes} nodes, {graph.compile_seconds:.1f}s (passes "
                     f"{graph.passes_seconds:.1f}s); tilefx ops: {ops}")
        for result in graph.passes:
            lines.append(f"  pass {result.name}: {result.rewritten} rewritten, {len(result.fallbacks)} left alone")
            lines.extend(f"    fallback {why}" for why in result.fallbacks)
    return "\n".join(lines)
