"""What ``compile_model`` installs on the model: a forward that owns the cache and the shapes.

``model.forward`` becomes ``TilefxRuntime.forward``: it checks that the request fits,
starts or continues the tilefx cache, gives the compiled graph inputs of fixed
shape (the 4-D attention mask over the whole cache, explicit position ids, the cache), and
marks the prompt length dynamic, so one graph serves every prefill and one every
decode step. Batch 1 has graphs of its own (the decode step users wait on stays
specialized); every batch from 2 to ``max_batch`` shares one pair in which the batch
is a dynamic dim, so startup does not grow with ``max_batch``. A graph an earlier process
saved for the same call class and key (compiler/graph_cache.py) is loaded and called
directly, without Dynamo; the others go through Dynamo once, are saved, and are then
called the same way. ``model.generate``
gets an up-front check of the whole request; everything else is transformers' own
``generate``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import pathlib
import threading
import types
import warnings
import weakref
from collections.abc import Sequence

import torch
from transformers import GenerationConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from tilefx.compiler import Backend, CompileOptions, CompileReport
from tilefx.compiler.graph_cache import GraphCache, Saveable
from tilefx.custom_ops import buffers
from tilefx.models.adapters import FamilyAdapter
from tilefx.models.kv_cache import TilefxCache

# transformers 5.24 renamed the KV cache's keyword and output field from `past_key_values` to
# `cache` (the old name still works, with a warning, until 5.40). The runtime accepts both and
# speaks the name of the installed version, which its model outputs' fields tell.
CACHE_ARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_kwargs(cache) -> dict:
    """``{name: cache}`` for a forward call, under this transformers version's name for it."""
    return {CACHE_ARG: cache}


def _private_frame(forward):
    """A function with its own code object that calls ``forward``.

    Dynamo keeps compiled graphs and counts recompiles per code object. HF's forward
    is one code object shared by every model of a class (and by transformers'
    decorator wrapper across classes), so each compiled model gets its own frame.
    """

    def tilefx_forward(**kwargs):
        return forward(**kwargs)

    code = tilefx_forward.__code__.replace(co_name=f"tilefx_forward_{id(forward):x}")
    return types.FunctionType(code, tilefx_forward.__globals__, code.co_name, None, tilefx_forward.__closure__)


class TilefxRuntime:
    def __init__(self, model, adapter: FamilyAdapter, options: CompileOptions, report: CompileReport | None = None,
                 cache_config=None, sources: Sequence[pathlib.Path] = ()):
        """``sources``: directories of the code above the runtime that shapes its graphs (the facade's), for the
        graph cache's key; the runtime adds its own package."""
        self.model = model
        self.options = options
        self.report = report if report is not None else CompileReport()
        self.cache = TilefxCache.for_config(  # cache_config: a tensor-parallel rank's local heads (models/tp.py)
            cache_config or model.config, adapter, max_batch=options.max_batch, max_seq_len=options.max_seq_len,
            dtype=options.dtype
        )
        self.eager_forward = type(model).forward.__get__(model)
        self.eager_generate = type(model).generate.__get__(model)
        self.backend = Backend(options, self.report, moe_blocks=adapter.moe_blocks(model.config))
        # Graphs saved by an earlier process with the same key run without Dynamo (compiler/graph_cache.py);
        # graphs Dynamo compiles here are saved for the next one.
        self.graph_cache = GraphCache.open(model, options, self.backend.pass_manager.uuid(),
                                           sources=(pathlib.Path(__file__).parent, *sources))
        self.loaded: dict[str, object] = {}  # call class -> LoadedGraph, or None: nothing to load
        # Inductor writes the thread count into its kernels (`omp parallel num_threads(N)`); the custom ops use
        # the process's. Run at another count, every kernel resizes OpenMP's team against them, and libgomp
        # ends and recreates threads each time (docs/PERFORMANCE.md, sixteenth session): warned once.
        self.threads = torch.get_num_threads()
        self._warned_threads = False
        self._key_slots = torch.arange(options.max_seq_len)  # the cache's slots, for the 4-D mask (_attention_mask)
        # One request at a time: the model has one KV cache, which two threads' requests would overwrite in
        # turn (a server's thread pool calls generate() so). A second caller waits for the first to end.
        self._lock = threading.RLock()
        # The model is tilefx's: its modules and weights do not change after compile_model (packed
        # weights are graph inputs made once). Guards on the modules' attributes, thousands of them
        # checked before every decode step, are not installed.
        guard_options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        frame = _private_frame(self.eager_forward)
        self.compiled_forward = torch.compile(frame, backend=self.backend, fullgraph=options.fullgraph, dynamic=False,
                                              options=guard_options)
        # Dynamo keeps the graphs it compiled for a code object on the code object, and a cycle through them
        # outlives the model: without this, a deleted model's packed weights (the graphs' inputs) stayed in memory.
        weakref.finalize(model, torch._dynamo.reset_code, frame.__code__).atexit = False
        # Prefill, decode (and prefill with full logits), for batch 1 and for the dynamic batch:
        # stay under Dynamo's per-frame limit, past which a frame silently runs eagerly.
        needed = 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, needed)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 8 * needed
        )

    def install(self) -> None:
        model = self.model
        # Plain functions carrying HF's signatures: generate() inspects forward's parameters.
        model.forward = functools.wraps(self.eager_forward)(lambda *a, **k: self.forward(*a, **k))
        model.generate = functools.wraps(self.eager_generate)(lambda *a, **k: self.generate(*a, **k))
        model.save_pretrained = functools.wraps(type(model).save_pretrained)(self.refuse_save)
        model.tilefx = self

    @staticmethod
    def refuse_save(*args, **kwargs):
        """Packed weights are the only copy: a packed parameter's data is its weight in packed order (bf16) or
        zeros (quantized formats), so transformers would write a checkpoint of wrong values."""
        raise ValueError(
            "save_pretrained: a tilefx-compiled model holds its linear weights packed for this CPU (quantized where "
            "weights= asked), so its parameters no longer hold the checkpoint's values. Save the model before "
            "tilefx.compile_model, or keep the checkpoint: compile_model(path) reads it again, and tilefx's graph "
            "cache makes that start warm"
        )

    def keep_only_packed_weights(self) -> None:
        """After warm-up: weights the graphs packed (those the loader did not) give up their unpacked
        copy where every compiled graph reads them only packed (custom_ops/weights.py, ``release``).

        Graphs compiled later (a new phase) get the same packed tensors, so they stay
        correct; the eager module, however, must not be run on this model object any
        more (its packed weights hold packed-order data).
        """
        from tilefx.custom_ops import weights

        exclusive, shared = set(), set()
        for graph in self.report.graphs:
            for result in graph.passes:
                exclusive |= result.packed_exclusively
                shared |= result.packed_shared
        released, kept = weights.release_sources(exclusive - shared)
        self.report.released_bytes += released
        self.report.kept_unpacked = kept + len(shared)

    # -- forward -----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        with self._lock:  # one request at a time (generate() holds it already, re-entrant)
            return self._forward(*args, **kwargs)

    # The graphs are traced on normal tensors under no_grad. A caller in inference_mode
    # would hand Dynamo inference tensors, whose dispatch keys differ (Dynamo guards on
    # them): every graph would compile again. Outside inference mode the inputs built
    # below are normal tensors whatever mode the caller is in, and the logits too.
    @torch.inference_mode(False)
    def _forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        **kwargs,
    ):
        given_cache = kwargs.pop("cache", None)
        if given_cache is not None and past_key_values is not None:
            raise ValueError("pass the KV cache once: `cache` or `past_key_values`, not both")
        given_cache = past_key_values if given_cache is None else given_cache
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("tilefx-compiled models take input_ids (inputs_embeds is not supported)")
        for flag in ("output_attentions", "output_hidden_states", "labels"):
            if kwargs.pop(flag, None):
                raise ValueError(f"{flag} is not supported by a tilefx-compiled model; use the eager model for it")
        if kwargs:
            raise ValueError(f"unsupported forward arguments: {sorted(kwargs)}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be a count of last rows (an int >= 0), got {logits_to_keep!r}")
        self._check_threads()
        cache = self.cache
        if given_cache is not None and given_cache is not cache and int(given_cache.get_seq_length()) > 0:
            raise ValueError(f"a tilefx-compiled model continues only its own KV cache (the `cache` its outputs "
                             f"return), not a {type(given_cache).__name__} holding tokens")
        batch, seq = input_ids.shape
        continuing = given_cache is cache and cache.seq_len > 0
        cache.check_fits(batch, seq, continuing=continuing)
        past = cache.seq_len if continuing else 0
        mask = self._full_mask(attention_mask, batch, past + seq)
        if position_ids is None:
            position_ids = (mask[:, : past + seq].cumsum(-1) - 1).clamp_min(0)[:, past:]
        position_ids = position_ids.expand(batch, seq)
        if not continuing:
            cache.start(batch)
        if seq == 1 or logits_to_keep >= seq:
            logits_to_keep = 0 if seq > 1 else 1  # all rows: the same logits whatever the count asked
        with buffers.recycled() if self.options.recycle_buffers else contextlib.nullcontext():
            if logits_to_keep <= 1:
                logits = self._run_prompt(input_ids, position_ids, mask, logits_to_keep)
            else:
                # Some rows' logits but not all (assisted generation verifies draft tokens so): a graph per count
                # would compile again for every draft length. The prefix up to the first row kept runs as a
                # prompt keeping its last row, the rest continues the sequence keeping all of theirs: graphs
                # that exist.
                split = seq - logits_to_keep + 1
                head = self._run_prompt(input_ids[:, :split], position_ids[:, :split], mask, 1)
                rest = 1 if seq - split == 1 else 0
                logits = torch.cat([head, self._run(input_ids[:, split:], position_ids[:, split:], mask, rest)],
                                   dim=1)
        if return_dict is False:
            return (logits, cache)
        return CausalLMOutputWithPast(logits=logits, **cache_kwargs(cache))

    def _run_prompt(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                    logits_to_keep: int) -> torch.Tensor:
        """``_run`` over new tokens in calls of at most ``options.prefill_chunk`` of them (evened out: no short
        last call), each continuing the cache: the logits the whole would have (the last row's, or every row's)."""
        seq, chunk = input_ids.shape[1], self.options.prefill_chunk
        if not chunk or seq <= chunk:
            return self._run(input_ids, position_ids, mask, logits_to_keep)
        calls = -(-seq // chunk)
        size = -(-seq // calls)
        kept = []
        for start in range(0, seq, size):
            end = min(seq, start + size)
            logits = self._run(input_ids[:, start:end], position_ids[:, start:end], mask,
                               logits_to_keep if end - start > 1 else 1)
            if logits_to_keep == 0 or end == seq:
                kept.append(logits)
        return kept[0] if len(kept) == 1 else torch.cat(kept, dim=1)

    def _run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
             logits_to_keep: int) -> torch.Tensor:
        """One compiled graph's call on the next ``input_ids`` of the sequence the cache holds; the cache
        advances past them. ``logits_to_keep``: 1 (the last row's) or 0 (every row's)."""
        cache = self.cache
        batch, seq = input_ids.shape
        # Fresh tensors with canonical strides: a [B, 1] slice of a longer tensor is "contiguous"
        # but its strides differ, and Dynamo guards on strides.
        input_ids = input_ids.clone(memory_format=torch.contiguous_format)
        position_ids = position_ids.clone(memory_format=torch.contiguous_format)
        allowed = self._attention_mask(mask, cache.seq_len, seq)
        if seq > 1:
            # Inductor sizes a dynamic dim's kernels by its hint, by default the first call's (the warm-up's 2
            # tokens): loops over a few heads times the tokens then run on one thread, however long the prompt
            # (RoPE's rotated halves of K). As long a prompt as fits is the hint instead. For Llama-1B those
            # loops are small (two 0.5 MB copies a layer at 1024 tokens): TTFT within the noise either way, and
            # no cost at 16 tokens (docs/PERFORMANCE.md, fiftieth session).
            for tensor, dim in ((input_ids, 1), (position_ids, 1), (allowed, 2)):
                torch._dynamo.mark_dynamic(tensor, dim, min=2, max=self.options.max_seq_len,
                                           hint_override=self.options.max_seq_len)
        if batch > 1 and self.options.max_batch > 2:  # (2 is the only batch above 1: static)
            for tensor in (input_ids, position_ids, allowed):
                torch._dynamo.mark_dynamic(tensor, 0, min=2, max=self.options.max_batch)
        arguments = dict(input_ids=input_ids, attention_mask=allowed, position_ids=position_ids,
                         use_cache=True, logits_to_keep=logits_to_keep, **cache_kwargs(cache))
        call = self._call_class(batch, seq, logits_to_keep)
        if call not in self.loaded:
            self.loaded[call] = self.graph_cache.load(call, self.model, self.report) if self.graph_cache else None
        with torch.no_grad():
            if self.loaded[call] is not None:
                logits = self.loaded[call](arguments)
            else:
                logits = self._dynamo_forward(call, "prefill" if seq > 1 else "decode", arguments)
        cache.advance(seq, input_ids)
        return logits

    def _check_threads(self) -> None:
        threads = torch.get_num_threads()
        if threads != self.threads and not self._warned_threads:
            self._warned_threads = True
            warnings.warn(f"tilefx: this model was compiled for {self.threads} threads and runs at {threads} "
                          "(torch.set_num_threads after compile_model): its Inductor kernels keep their thread "
                          "count, and switching between the two every op costs thread start-ups; call "
                          "torch.set_num_threads before compile_model", RuntimeWarning, stacklevel=3)

    def _call_class(self, batch: int, seq: int, logits_to_keep: int) -> str:
        """Which graph serves a call: the runtime's inputs make every call of one class trace the same graph."""
        batches = "1" if batch == 1 else ("2" if self.options.max_batch == 2 else f"2-{self.options.max_batch}")
        return f"batch {batches}, {'prefill' if seq > 1 else 'decode'}, logits_to_keep {logits_to_keep}"

    def _dynamo_forward(self, call: str, phase: str, arguments: dict) -> torch.Tensor:
        # Dynamo makes parameters graph attributes (not inputs) when freezing is on at trace time
        # (its prepare_freezing, or Inductor's freezing set by the caller for other models: the
        # bench's stock torch.compile row does): the backend's config patch comes too late for that.
        with self.backend.compiling(phase, saveable=self.graph_cache is not None) as compiled, \
                torch._dynamo.config.patch(prepare_freezing=self.options.freezing), \
                torch._inductor.config.patch(freezing=self.options.freezing):
            out = self.compiled_forward(**arguments)
        if self.graph_cache is not None and compiled:  # one graph: the graph cache is off without fullgraph
            graph = compiled[-1]
            if isinstance(graph, Saveable):
                self.graph_cache.save(call, graph, self.model)
                self.loaded[call] = self.graph_cache.adopt(call, graph, self.model)
            else:
                self.graph_cache.not_saved(call, graph)
        return out.logits

    def _attention_mask(self, mask: torch.Tensor, start: int, seq: int) -> torch.Tensor:
        """The mask transformers builds for the next ``seq`` tokens (cache slots from ``start``) from the 2-D
        ``mask`` [B, max_seq_len]: [B, 1, seq, max_seq_len] bool, True where query s may attend key t, that is
        t <= start + s and ``mask`` keeps t (causal and padding; tilefx refuses sliding windows).

        Built here, with ATen, and passed to the graph 4-D, which transformers takes as it is (masking_utils:
        a 4-D mask is returned as given). Traced inside the graph, Inductor computed it element by element with
        64-bit index vectors and wrote one copy of it per layer (each attention op's input): 16 ms of a 1024-token
        prompt for 2 layers' copies, 16 times that per copy at 4096 tokens (docs/PERFORMANCE.md)."""
        causal = self._key_slots[None, :] <= torch.arange(start, start + seq)[:, None]  # [seq, max_seq_len]
        return (causal[None] & mask.bool()[:, None, :]).unsqueeze(1)

    def _full_mask(self, attention_mask, batch: int, length: int) -> torch.Tensor:
        mask = torch.zeros(batch, self.options.max_seq_len, dtype=torch.long)
        if attention_mask is None:
            mask[:, :length] = 1
            return mask
        if attention_mask.dim() != 2 or attention_mask.shape != (batch, length):
            raise ValueError(
                f"attention_mask must be 2-D [batch, past + new tokens] = [{batch}, {length}], "
                f"got shape {tuple(attention_mask.shape)}"
            )
        mask[:, :length] = attention_mask
        return mask

    # -- generate ----------------------------------------------------------------------
    def generate(self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, **kwargs):
        with self._lock:  # (the whole request: its forwards take the lock again, in this thread)
            return self._generate(inputs, generation_config, **kwargs)

    def _generate(self, inputs: torch.Tensor | None, generation_config: GenerationConfig | None, **kwargs):
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        if input_ids is None:
            raise ValueError("tilefx-compiled generate() needs input_ids")
        config = copy.deepcopy(generation_config or self.model.generation_config)
        config.update(**{k: v for k, v in kwargs.items() if hasattr(config, k)})
        batch, prompt = input_ids.shape
        batch *= max(config.num_return_sequences or 1, config.num_beams or 1)  # each beam is a row
        new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt
        self.cache.check_fits(batch, prompt + new, continuing=False)
        given_cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if given_cache is self.cache and self.cache.seq_len > 0:  # a conversation's next turn
            self.cache.check_continues(input_ids)
        return self.eager_generate(inputs, generation_config=generation_config, **kwargs)
