"""Shared test helpers: comparing generated tokens with an eager reference."""

from __future__ import annotations

import contextlib
import functools
import runpy
import sys

import pytest

import torch

from tilefx.models.adapters import adapter_for
from tilefx.models.kv_cache import TilefxCache
from tilefx.models.presets import build_model
from tilefx.models.runtime import cache_kwargs

CLOSE_LOGPROB_NATS = 0.1  # vLLM's close-logprobs rule for near-tied bf16 logits


def padded_batch(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts into input_ids and attention_mask, as generate() expects for decoder-only models."""
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :] = torch.tensor(prompt)
        mask[row, length - len(prompt) :] = 1
    return ids, mask


@torch.no_grad()
def reference_logprobs(model, sequences: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eager HF log-probs of each next token, teacher-forced on ``sequences``."""
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=sequences, attention_mask=mask, position_ids=positions, use_cache=False).logits
    return torch.log_softmax(logits.float(), dim=-1)


def reference_sequence_logprobs(reference, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The sum of each row's generated tokens' (those after ``prompt_len``) log-probs under ``reference``: a beam's
    score, as beam search sums it with ``length_penalty=0``."""
    logprobs = reference_logprobs(reference, sequences, torch.ones_like(sequences))[:, prompt_len - 1 : -1]
    return logprobs.gather(-1, sequences[:, prompt_len:, None])[..., 0].sum(-1)


def assert_greedy_matches(reference, prompt_ids, prompt_mask, generated) -> int:
    """Every generated token is the reference's argmax, or within 0.1 nat of it. Returns the exact matches.

    A row that emitted the EOS token is finished: generate() fills the rest of it with the pad token,
    which is checked as such, not judged as the model's choice (nor counted as a match).
    """
    prompt_len = prompt_ids.shape[1]
    new = generated.shape[1] - prompt_len
    assert torch.equal(generated[:, :prompt_len], prompt_ids)
    mask = torch.cat([prompt_mask, torch.ones(prompt_ids.shape[0], new, dtype=torch.long)], dim=1)
    logprobs = reference_logprobs(reference, generated, mask)
    config = reference.generation_config
    eos = [e for e in (config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id])
           if e is not None]
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)  # as generate() pads
    finished = torch.zeros(generated.shape[0], dtype=torch.bool)
    exact = 0
    for step in range(new):
        position = prompt_len + step
        step_logprobs = logprobs[:, position - 1]
        chosen = generated[:, position]
        assert (chosen[finished] == pad).all(), f"step {step}: a finished row continued: {chosen.tolist()}"
        best = step_logprobs.argmax(-1)
        gap = step_logprobs.max(-1).values - step_logprobs.gather(-1, chosen[:, None])[:, 0]
        assert (gap[~finished] <= CLOSE_LOGPROB_NATS).all(), (
            f"step {step}: generated {chosen.tolist()}, reference argmax {best.tolist()}, gap {gap.tolist()} nats"
        )
        exact += int((chosen == best)[~finished].sum())
        finished |= torch.isin(chosen, torch.tensor(eos, dtype=chosen.dtype))
    return exact


def assert_draws_from_reference_logits(reference, prompt_ids, prompt_mask, output, top_k: int,
                                       routing_flips: int = 0) -> None:
    """A sampled ``generate(..., output_logits=True, return_dict_in_generate=True)``: the logits each token was
    drawn from equal the reference's after the same prefix (log-probs within 0.1 nat over the reference's 8 most
    likely tokens; a wrong cache row moves them by 0.2-0.8 on the tiny presets, at nearly every step), and each
    token is among the reference's ``top_k`` (or within 0.1 nat of the k-th, a bf16 near-tie at the edge). A row's
    steps after its EOS are generate()'s padding and not checked. ``routing_flips``: steps a row may be further
    apart, for an MoE whose router had two experts near-tied and bf16 rounding chose the other (the tiny MoE
    presets: 0.19-0.24 nat at one step in a few runs)."""
    generated, prompt_len = output.sequences, prompt_ids.shape[1]
    assert torch.equal(generated[:, :prompt_len], prompt_ids)
    new = generated[:, prompt_len:]
    mask = torch.cat([prompt_mask, torch.ones_like(new)], dim=1)
    want = reference_logprobs(reference, generated, mask)[:, prompt_len - 1 : -1]
    got = torch.log_softmax(torch.stack(output.logits, dim=1).float(), dim=-1)
    assert got.shape == want.shape
    eos = reference.generation_config.eos_token_id
    is_eos = torch.isin(new, torch.tensor(eos if isinstance(eos, list) else [eos])).long()
    drawing = (is_eos.cumsum(-1) - is_eos) == 0
    likely = want.topk(8, dim=-1).indices
    apart = (got.gather(-1, likely) - want.gather(-1, likely)).abs().amax(-1)
    flips = ((apart > CLOSE_LOGPROB_NATS) & drawing).sum(-1)
    assert (flips <= routing_flips).all(), f"log-probs apart by (row, step) nats: {apart.tolist()}"
    kth = want.topk(top_k, dim=-1).values[..., -1]
    below = kth - want.gather(-1, new[..., None])[..., 0]
    outside = (below > CLOSE_LOGPROB_NATS) & drawing
    assert not outside.any(), f"tokens outside the reference's top {top_k} at {outside.nonzero().tolist()}"


@contextlib.contextmanager
def graph_calls(runtime):
    """Inside the block, the new tokens of each compiled graph call of ``runtime`` (``TilefxRuntime._run``), in a
    list the block gets."""
    calls: list[int] = []
    run = runtime._run

    def counted(input_ids, *args, **kwargs):
        calls.append(input_ids.shape[1])
        return run(input_ids, *args, **kwargs)

    runtime._run = counted
    try:
        yield calls
    finally:
        del runtime._run  # the class's method again


def assert_recycling_changes_nothing(compiled, ids, mask, new_tokens: int = 6) -> None:
    """The runtime holds the buffer recycler around each forward (custom_ops/buffers.py); held here with min_bytes 1,
    every CPU block a forward frees (these tiny models have none of 1 MiB) is handed to a later request of about its
    size, not zeroed: the same tokens and logits, bit for bit, as with the recycler off, and nothing kept after."""
    import dataclasses
    from unittest import mock

    from tilefx.custom_ops import buffers, isa

    if isa.native is None:
        pytest.skip("the recycler is the native library's")
    runtime = compiled.tilefx
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    options = runtime.options
    runtime.options = dataclasses.replace(options, recycle_buffers=False)
    try:
        with mock.patch.object(buffers, "recycled", wraps=buffers.recycled) as holds:
            plain = compiled.generate(ids, **kwargs)
        assert holds.call_count == 0
    finally:
        runtime.options = options
    before = buffers.stats()
    with mock.patch.object(buffers, "recycled", wraps=buffers.recycled) as holds:
        with buffers.recycled(min_bytes=1):
            recycled = compiled.generate(ids, **kwargs)
    assert holds.call_count == 1 + new_tokens  # the test's own hold, the prefill and each decode step but the last
    assert buffers.stats()["reused"] > before["reused"] and buffers.stats()["kept_blocks"] == 0
    assert torch.equal(recycled.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(recycled.logits, plain.logits))


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_generates_like(reference, compiled) -> None:
    """Greedy tokens of ``compiled`` agree with ``reference`` (close-logprobs rule) for a 1- and a 13-token
    prompt and a padded batch of 2 (the two-row GEMVs), with no recompile."""
    for length in (1, 13):
        ids, mask = padded_batch([random_prompt(length, length)])
        out = compiled.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        assert assert_greedy_matches(reference, ids, mask, out) >= 8
    ids, mask = padded_batch([random_prompt(7, 1), random_prompt(3, 2)])
    out = compiled.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert_greedy_matches(reference, ids, mask, out)
    assert compiled.tilefx.report.recompiles == 0


def assert_greedy_matches_on_emulated_avx512(reference, compiled, ids, mask, new_tokens: int) -> int:
    """Greedy tokens from the same compiled graphs with the native linears on the AVX512-BF16 unit (SIMDe-emulated
    where the CPU has no AVX512; the kernels read the path on every call) equal eager's. Returns the exact matches."""
    from tilefx.custom_ops import isa

    reason = isa.unsupported_reason(isa.EMULATED_AVX512)
    if reason is not None:
        pytest.skip(reason)
    with isa.forced(isa.EMULATED_AVX512):  # (the reference too: an int4 oracle rounds x as the path's decode does)
        out = compiled.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
        return assert_greedy_matches(reference, ids, mask, out)


# -- pass tests (vLLM tests/compile/backend.py) -----------------------------------------

SDPA = torch._C._nn.scaled_dot_product_attention


def count(graph, predicate) -> int:
    return sum(1 for n in graph.nodes if predicate(n))


def is_sdpa(n):
    return n.op == "call_function" and n.target is SDPA


def is_index_copy(n):
    return n.op == "call_method" and n.target == "index_copy_"


def is_op(name):
    return lambda n: n.op == "call_function" and n.target is getattr(torch.ops.tilefx, name).default


class PassTestBackend:
    """Runs only the given passes on the Dynamo graph and records it before and after (vLLM's TestBackend)."""

    def __init__(self, *passes):
        self.passes, self.before, self.after, self.results = passes, [], [], []

    def __call__(self, gm, example_inputs):
        self.before.append(gm.graph.__class__())
        self.before[-1].graph_copy(gm.graph, {})
        for p in self.passes:
            self.results.append(p(gm.graph))
        gm.graph.lint()
        gm.recompile()
        self.after.append(gm.graph)
        return gm.forward


def run(model, cache, ids, backend, **kwargs):
    """One forward over an empty tilefx cache, compiled with ``backend`` (``kwargs``: more of the forward's)."""
    batch, seq = ids.shape
    mask = torch.zeros(batch, cache.max_seq_len, dtype=torch.long)
    mask[:, :seq] = 1
    positions = torch.arange(seq).expand(batch, seq).contiguous()
    fn = torch.compile(type(model).forward.__get__(model), backend=backend, fullgraph=True)
    with torch.no_grad():
        return fn(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                  **cache_kwargs(cache), **kwargs).logits


def run_on_new_cache(model, ids, backend, **kwargs):
    """``run`` over a new tilefx cache of the model (2 rows of 32 tokens); returns the logits and the cache."""
    cache = TilefxCache.for_config(model.config, adapter_for(model.config), max_batch=2, max_seq_len=32)
    cache.start(ids.shape[0])
    return run(model, cache, ids, backend, **kwargs), cache


def without_and_with(model, ids, *passes):
    """The logits of one forward over a new cache without the passes and with them (each compiled afresh), and the
    backend that ran them (its graphs before and after, its results)."""
    torch._dynamo.reset()
    want = run_on_new_cache(model, ids, PassTestBackend())[0]
    torch._dynamo.reset()
    backend = PassTestBackend(*passes)
    return want, run_on_new_cache(model, ids, backend)[0], backend


def decode_step(graph_pass, family: str = "tiny-llama"):
    """One new token of the family's tiny model over a new cache, compiled afresh with ``graph_pass``: the model, the
    pass's result and the graph after it."""
    model = tiny_model(family)
    torch._dynamo.reset()
    backend = PassTestBackend(graph_pass)
    run_on_new_cache(model, torch.tensor([[5]]), backend)
    return model, backend.results[0], backend.after[0]


@functools.cache
def tiny_model(family: str):
    """The preset's model with seed 3, built once per test process (pass tests only read it)."""
    return build_model(family, seed=3)




def eager_logits_and_routing_ties(model, ids, router_class: str, top_k: int):
    """HF eager's logits for ``ids``, and which positions a router near-tie makes ambiguous: those where some
    layer's router had its k-th and (k+1)-th logits within 2 bf16 ulps (a random tiny MoE has exact bf16 ties),
    and every later position of the row (attention reads them). There the experts chosen follow the rounding, so
    a numerically equal computation may choose the other one: the logits are compared elsewhere."""
    ties = torch.zeros(ids.shape, dtype=torch.bool)

    def record(module, args, out):
        logits = (out[0] if isinstance(out, tuple) else out).detach().float().view(*ids.shape, -1)
        top = logits.topk(top_k + 1, dim=-1).values
        ulp = top[..., top_k - 1].abs() * 2.0**-7
        ties.logical_or_(top[..., top_k - 1] - top[..., top_k] <= 2 * ulp)

    hooks = [m.register_forward_hook(record) for m in model.modules() if type(m).__name__ == router_class]
    assert hooks, f"no {router_class} in the model"
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    return logits, ties.long().cummax(dim=-1).values.bool()


def run_script(name: str, argv: list[str]) -> None:
    """Run ``scripts/<name>`` as ``__main__`` with ``argv``; it must exit with status 0."""
    old = sys.argv
    sys.argv = [name, *argv]
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path(f"scripts/{name}", run_name="__main__")
        assert done.value.code == 0
    finally:
        sys.argv = old


@contextlib.contextmanager
def adapter_lookups():
    """The model types ``adapters.adapter_for`` is asked for while the block runs, from any tilefx module (each
    module's imported name for it is swapped for a counting one)."""
    import tilefx.models.load  # noqa: F401  (the modules compile_model uses, imported before the swap)
    import tilefx.models.packing  # noqa: F401
    import tilefx.models.runtime  # noqa: F401
    from tilefx.models import adapters

    real, calls = adapters.adapter_for, []

    def counting(config):
        calls.append(getattr(config, "model_type", None))
        return real(config)

    holders = [module for name, module in list(sys.modules.items())
               if name.startswith("tilefx") and getattr(module, "adapter_for", None) is real]
    for module in holders:
        module.adapter_for = counting
    try:
        yield calls
    finally:
        for module in holders:
            module.adapter_for = real
