"""End to end: compiled greedy tokens equal HF eager's, per family; recompiles; bad requests."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses

import pytest
import torch

import tilefx
from tilefx.custom_ops import openmp, tuning
from tilefx.models.presets import build_model

from helpers import (assert_draws_from_reference_logits, assert_greedy_matches,
                     assert_greedy_matches_on_emulated_avx512, assert_recycling_changes_nothing, graph_calls,
                     padded_batch, reference_sequence_logprobs)

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
MAX_SEQ_LEN = 64
MAX_BATCH = 4  # batches 2-4 share graphs with a dynamic batch dim


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    """(eager reference, compiled model) with identical weights; compiled once per module and family."""
    reference = build_model(request.param, seed=7)
    compiled = tilefx.compile_model(build_model(request.param, seed=7), max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    return reference, compiled


def _prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (length,), generator=generator).tolist()


@pytest.mark.parametrize("length", [1, 5, 17])
def test_greedy_batch1_matches_eager(pair, length):
    reference, compiled = pair
    ids, mask = padded_batch([_prompt(length, length)])
    out = compiled.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert out.shape == (1, length + 12)
    exact = assert_greedy_matches(reference, ids, mask, out)
    assert exact >= 10  # well-separated logits: near-ties (bf16-equal logits) are rare


def test_prefill_kernels_are_sized_for_the_longest_prompt(pair, monkeypatch):
    # Inductor decides a kernel's threads by the dynamic dim's hint: the warm-up's 2 tokens would make a long
    # prompt's head-by-token loops serial
    _, compiled = pair
    marked = []
    mark_dynamic = torch._dynamo.mark_dynamic
    monkeypatch.setattr(torch._dynamo, "mark_dynamic", lambda *args, **kwargs: (marked.append(kwargs),
                                                                                   mark_dynamic(*args, **kwargs)))
    compiled.generate(torch.tensor([_prompt(6, 3)]), max_new_tokens=1, do_sample=False)
    token_dims = [kwargs for kwargs in marked if kwargs.get("max") == MAX_SEQ_LEN]
    assert token_dims and all(kwargs.get("hint_override") == MAX_SEQ_LEN for kwargs in token_dims)


def test_greedy_batch2_padded_matches_eager(pair):
    reference, compiled = pair
    ids, mask = padded_batch([_prompt(9, 1), _prompt(4, 2)])
    out = compiled.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert_greedy_matches(reference, ids, mask, out)
    # each row equals the same prompt run alone
    for row, length in ((0, 9), (1, 4)):
        alone_ids, alone_mask = padded_batch([_prompt(length, row + 1)])
        alone = compiled.generate(alone_ids, attention_mask=alone_mask, max_new_tokens=10, do_sample=False)
        assert torch.equal(out[row, -10:], alone[0, -10:])


def test_greedy_on_the_avx512_unit_matches_eager(pair):
    """The linears on the AVX512-BF16 unit."""
    reference, compiled = pair
    ids, mask = padded_batch([_prompt(9, 1), _prompt(4, 2)])
    assert assert_greedy_matches_on_emulated_avx512(reference, compiled, ids, mask, new_tokens=10) >= 16


def test_sampling_with_seed_is_reproducible(pair):
    _, compiled = pair
    ids, mask = padded_batch([_prompt(6, 3)])
    runs = []
    for _ in range(2):
        torch.manual_seed(42)
        runs.append(compiled.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=True, top_k=20))
    assert torch.equal(runs[0], runs[1])
    assert runs[0].shape == (1, 16) and int(runs[0].max()) < compiled.config.vocab_size


def test_sampling_draws_from_the_references_distribution(pair):
    """Sampling draws from logits equal to the reference's after each drawn prefix, and each token drawn with
    ``top_k=4`` is among the reference's 4 most likely. Several seeds, a padded batch of 2: drawn tokens leave the
    greedy path, so the cache continues sequences that greedy decoding never makes."""
    reference, compiled = pair
    ids, mask = padded_batch([_prompt(8, 6), _prompt(5, 7)])
    greedy = compiled.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    off_greedy = 0
    for seed in range(3):
        torch.manual_seed(seed)
        out = compiled.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=4,
                                temperature=0.9, output_logits=True, return_dict_in_generate=True)
        assert_draws_from_reference_logits(reference, ids, mask, out, 4)
        off_greedy += int((out.sequences[:, 8:] != greedy[:, 8:]).any(-1).sum())
    assert off_greedy >= 3  # sampling, not greedy decoding under another name


def test_no_recompiles_after_warmup(pair):
    _, compiled = pair
    report = compiled.tilefx.report
    before = len(report.graphs)
    for length, new in ((3, 4), (11, 7), (2, 1), (30, 9), (8, 20)):
        ids, mask = padded_batch([_prompt(length, length)])
        compiled.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    assert len(report.graphs) == before, tilefx.explain(compiled)
    assert report.recompiles == 0


GRAD_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "grad": torch.enable_grad}


@pytest.mark.parametrize("mode", sorted(GRAD_MODES))
def test_no_graph_compiles_in_any_grad_mode(pair, mode):
    """Warm-up traced under no_grad; a caller in inference_mode (inference tensors carry other dispatch
    keys, which Dynamo guards on) or with grad enabled gets the same graphs, at every batch size."""
    reference, compiled = pair
    report = compiled.tilefx.report
    before = len(report.graphs)
    assert report.warmup_graphs == 4  # prefill and decode for batch 1, and for batches 2..MAX_BATCH
    for batch in range(1, MAX_BATCH + 1):
        prompts = [_prompt(3 + 2 * row, 11 + batch + row) for row in range(batch)]
        ids, mask = padded_batch(prompts)
        with GRAD_MODES[mode]():
            out = compiled.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
            logits = compiled(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits  # as generate() asks
        assert not logits.requires_grad and not logits.is_inference()
        assert_greedy_matches(reference, ids, mask, out)
    assert len(report.graphs) == before, tilefx.explain(compiled)
    assert report.recompiles == 0


def test_compiled_inside_inference_mode_generates_outside_it():
    """Weights and cache made under a caller's inference_mode are still normal tensors: the cache is
    updated in place outside inference mode, which inference tensors refuse."""
    reference, model = build_model("tiny-llama", seed=3), build_model("tiny-llama", seed=3)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="inference tensors"):
            tilefx.compile_model(build_model("tiny-llama", seed=3), max_seq_len=32, progress=False)
        compiled = tilefx.compile_model(model, max_seq_len=32, progress=False)
    assert not compiled.tilefx.cache.length.is_inference()
    ids, mask = padded_batch([_prompt(5, 21)])
    out = compiled.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert_greedy_matches(reference, ids, mask, out)
    assert compiled.tilefx.report.recompiles == 0


def test_without_inductor_the_rewritten_graphs_run_as_they_are(monkeypatch):
    """inductor=False, the switch that tells Inductor's faults from the passes': the same tilefx ops run, with
    the glue op by op, Inductor never called, and greedy tokens equal eager's."""
    from tilefx.compiler import backend

    def refuse(*args, **kwargs):
        raise AssertionError("Inductor was called with inductor=False")

    monkeypatch.setattr(backend, "compile_fx", refuse)
    reference = build_model("tiny-qwen3", seed=3)
    compiled = tilefx.compile_model(build_model("tiny-qwen3", seed=3), max_seq_len=32, inductor=False,
                                    progress=False)
    ids, mask = padded_batch([_prompt(6, 22)])
    out = compiled.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert assert_greedy_matches(reference, ids, mask, out) >= 6
    graphs = compiled.tilefx.report.graphs
    assert {g.phase for g in graphs} == {"prefill", "decode"} and compiled.tilefx.report.recompiles == 0
    for graph in graphs:
        assert graph.tilefx_ops["tilefx.linear"] > 0 and graph.tilefx_ops["tilefx.linear_silu_mul"] == 2
    assert compiled.tilefx.graph_cache is None
    assert "Inductor off (inductor=False)" in tilefx.explain(compiled)


def test_too_long_request_fails_cleanly_then_recovers(pair):
    reference, compiled = pair
    ids, mask = padded_batch([_prompt(40, 4)])
    with pytest.raises(ValueError, match="max_seq_len=64"):
        compiled.generate(ids, attention_mask=mask, max_new_tokens=30)
    long_ids = torch.randint(3, 500, (1, MAX_SEQ_LEN + 1))
    with pytest.raises(ValueError, match="max_seq_len"):
        compiled(input_ids=long_ids)
    ids, mask = padded_batch([_prompt(7, 5)])
    out = compiled.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert_greedy_matches(reference, ids, mask, out)


def test_running_at_another_thread_count_warns_once(pair):
    """Inductor's kernels keep the thread count they were compiled for: a caller who changes it afterwards is
    told, once, and the model still generates."""
    import warnings

    _, compiled = pair
    runtime, threads = compiled.tilefx, torch.get_num_threads()
    ids, mask = padded_batch([_prompt(5, 6)])
    try:
        runtime._warned_threads = False
        torch.set_num_threads(threads + 1)
        with pytest.warns(RuntimeWarning, match=f"compiled for {threads} threads and runs at {threads + 1}"):
            compiled.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            compiled.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    finally:
        torch.set_num_threads(threads)
        runtime._warned_threads = False
    with warnings.catch_warnings():  # at the compiled count: silent
        warnings.simplefilter("error", RuntimeWarning)
        compiled.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)


def test_batch_over_max_fails_cleanly_then_recovers(pair):
    reference, compiled = pair
    ids, mask = padded_batch([_prompt(5, s) for s in range(MAX_BATCH + 1)])
    with pytest.raises(ValueError, match=f"max_batch={MAX_BATCH}"):
        compiled.generate(ids, attention_mask=mask, max_new_tokens=4)
    with pytest.raises(ValueError, match=f"max_batch={MAX_BATCH}"):
        compiled(input_ids=ids, attention_mask=mask)
    ids, mask = padded_batch([_prompt(5, 0)])
    out = compiled.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert_greedy_matches(reference, ids, mask, out)


def test_forward_logits_match_eager(pair):
    """A plain forward: every position's logits (a graph of its own, compiled at this call: one family stands for
    the others, whose warm-up graphs return one position's logits as generate() asks)."""
    reference, compiled = pair
    if compiled.config.model_type != "llama":
        pytest.skip("one family runs the all-positions graph")
    ids, mask = padded_batch([_prompt(12, 9), _prompt(12, 10)])
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=mask).logits.float()
        want = reference(input_ids=ids, attention_mask=mask).logits.float()
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


def test_some_rows_logits_come_from_the_graphs_there_are(pair):
    """``logits_to_keep`` between 1 and the prompt (how assisted generation verifies drafts) runs the prompt graph
    and the all-rows one (test_forward_logits_match_eager's), not a graph per count; the rows equal eager's."""
    reference, compiled = pair
    if compiled.config.model_type != "llama":
        pytest.skip("one family runs the all-positions graph")
    ids, mask = padded_batch([_prompt(12, 9)])
    with torch.no_grad():
        compiled(input_ids=ids, attention_mask=mask)  # the all-rows graph, compiled here if no test did yet
        report = compiled.tilefx.report
        graphs, recompiles = len(report.graphs), report.recompiles
        for keep in (2, 5, 12, 20):
            got = compiled(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits.float()
            want = reference(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits.float()
            assert got.shape == want.shape == (1, min(keep, 12), compiled.config.vocab_size)
            torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())
    assert (len(report.graphs), report.recompiles) == (graphs, recompiles)
    with pytest.raises(ValueError, match="logits_to_keep must be a count"):
        compiled(input_ids=ids, attention_mask=mask, logits_to_keep=torch.tensor([3, 5]))


def test_prompt_lookup_decoding_matches_eager(pair):
    """Assisted generation, its drafts from the prompt: several tokens verified a forward, the rejected ones
    cropped from the cache. Every token is still the reference's greedy choice."""
    reference, compiled = pair
    if compiled.config.model_type != "llama":
        pytest.skip("one family runs the all-positions graph")
    ids, mask = padded_batch([_prompt(6, 4) * 4])  # a repetitive prompt: drafts to find
    with graph_calls(compiled.tilefx) as calls:
        out = compiled.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                prompt_lookup_num_tokens=4)
    assert out.shape == (1, 24 + 24)
    assert_greedy_matches(reference, ids, mask, out)
    assert sum(calls) > 24 + 24  # drafts were verified: more tokens went through the graphs than were kept
    assert len(calls) < 24, calls  # and some accepted: fewer steps than tokens


def test_prompt_lookup_with_sampling_draws_from_the_references_distribution(pair):
    """Assisted generation while sampling: transformers keeps a draft token only where the token it draws from the
    compiled logits equals it, and crops the rest from the cache. Each token's logits are the reference's after
    its prefix (a crop that forgot nothing leaves the rejected drafts in the context: 0.2-0.8 nat apart)."""
    reference, compiled = pair
    if compiled.config.model_type != "llama":
        pytest.skip("one family runs the all-positions graph")
    ids, mask = padded_batch([_prompt(6, 4) * 4])
    for seed in range(2):
        torch.manual_seed(seed)
        with graph_calls(compiled.tilefx) as calls:
            out = compiled.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=True, top_k=3,
                                    prompt_lookup_num_tokens=4, output_logits=True, return_dict_in_generate=True)
        assert out.sequences.shape == (1, 24 + 20)
        assert_draws_from_reference_logits(reference, ids, mask, out, 3)
        assert max(calls[1:]) > 1  # drafts were verified


def test_an_assistant_model_drafts_for_the_compiled_one(pair):
    """Assisted generation with a draft model of the same vocabulary, eager or compiled (another seed: it drafts
    wrong tokens too, which the compiled model rejects and crops)."""
    reference, compiled = pair
    if compiled.config.model_type != "llama":
        pytest.skip("one family runs the all-positions graph")
    eager_draft = build_model("tiny-llama", seed=8)
    compiled_draft = tilefx.compile_model(build_model("tiny-llama", seed=8), max_seq_len=MAX_SEQ_LEN, warmup=False)
    ids, mask = padded_batch([_prompt(7, 5)])
    for draft in (eager_draft, compiled_draft):
        with graph_calls(compiled.tilefx) as calls:
            out = compiled.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                                    assistant_model=draft, num_assistant_tokens=3,
                                    num_assistant_tokens_schedule="constant")
        assert_greedy_matches(reference, ids, mask, out)
        assert max(calls[1:]) > 1  # drafts verified several at a time
    # the draft continues and crops its own cache: its prompt and decode graphs serve every round
    assert [graph.phase for graph in compiled_draft.tilefx.report.graphs] == ["prefill", "decode"]


@contextlib.contextmanager
def prefill_chunk(runtime, tokens: int):
    """The compiled model's prompts in calls of at most ``tokens`` (compile_model's prefill_chunk) for a block: the
    option is the runtime's alone, the graphs take any prompt length."""
    options = runtime.options
    runtime.options = dataclasses.replace(options, prefill_chunk=tokens)
    try:
        yield
    finally:
        runtime.options = options


def test_a_long_prompt_runs_in_chunks_with_the_same_results(pair):
    """A prompt longer than prefill_chunk runs as prefill calls of at most that many tokens (evened out), each
    continuing the cache: the same greedy tokens and logits as one call (the last row's, and every row's), a padded
    batch too, and no graph compiled for it."""
    reference, compiled = pair
    runtime = compiled.tilefx
    ids, mask = padded_batch([_prompt(23, 13), _prompt(17, 14)])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    all_rows = compiled.config.model_type == "llama"  # every row's logits too (one family compiles that graph)
    # Bit for bit on the unit's attention (and the brgemm kernel's: its key blocks lie where they lie in the cache);
    # SDPA, where tuning picks it, takes another of its kernels for a prompt that continues a cache. (Positions
    # off by a chunk moved these tiny models' logits by 0.7-17% of their largest.)
    with tuning.forced_attention("extend", "unit"):
        with torch.no_grad():
            want = compiled(input_ids=ids, attention_mask=mask).logits if all_rows else None
        whole = compiled.generate(ids, **kwargs)
        graphs, recompiles = len(runtime.report.graphs), runtime.report.recompiles
        with prefill_chunk(runtime, 8), graph_calls(runtime) as calls:
            chunked = compiled.generate(ids, **kwargs)
        if all_rows:
            with torch.no_grad(), prefill_chunk(runtime, 6), graph_calls(runtime) as all_calls:
                got = compiled(input_ids=ids, attention_mask=mask).logits
            assert all_calls == [6, 6, 6, 5] and torch.equal(got, want)
    assert calls[:4] == [8, 8, 7, 1]  # 23 tokens: 3 calls of at most 8, then the decode steps
    assert torch.equal(chunked.sequences, whole.sequences)
    assert all(torch.equal(a, b) for a, b in zip(chunked.logits, whole.logits))
    assert_greedy_matches(reference, ids, mask, chunked.sequences)
    assert (len(runtime.report.graphs), runtime.report.recompiles) == (graphs, recompiles)


def test_recycled_buffers_change_no_token_or_logit(pair):
    reference, compiled = pair
    ids, mask = padded_batch([_prompt(11, 3), _prompt(6, 4)])
    assert_recycling_changes_nothing(compiled, ids, mask)


def test_a_conversations_next_turn_continues_its_cache(pair):
    """transformers' multi-turn pattern: the next generate() gets the last one's output ids plus the new turn and
    its cache, and computes only what the cache lacks. The tokens equal the reference's over the whole text."""
    reference, compiled = pair
    ids, mask = padded_batch([_prompt(9, 11)])
    first = compiled.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                              return_dict_in_generate=True)
    turn = torch.cat([first.sequences, torch.tensor([_prompt(4, 12)])], dim=1)
    with graph_calls(compiled.tilefx) as calls:
        second = compiled.generate(turn, attention_mask=torch.ones_like(turn), max_new_tokens=6, do_sample=False,
                                   cache=first.cache)
    assert calls[0] == 5  # the last token of the first turn (never fed back) and the 4 new ones
    assert_greedy_matches(reference, turn, torch.ones_like(turn), second)


def test_a_cache_another_request_restarted_is_refused(pair):
    """One model, one KV cache: a generate() without a cache starts its sequence there. Continuing an earlier
    conversation's cache after that would read another sequence's keys and values; it is refused, and so is a
    cache that is not the model's."""
    reference, compiled = pair
    ids_a, _ = padded_batch([_prompt(7, 13)])
    ids_b, _ = padded_batch([_prompt(5, 14)])
    a = compiled.generate(ids_a, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    b = compiled.generate(ids_b, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    turn = torch.cat([a.sequences, torch.tensor([[7, 8]])], dim=1)
    with pytest.raises(ValueError, match="do not begin with"):
        compiled.generate(turn, max_new_tokens=3, do_sample=False, cache=a.cache)
    # the refusal changed nothing: b's sequence goes on
    turn_b = torch.cat([b.sequences, torch.tensor([[7, 8]])], dim=1)
    out = compiled.generate(turn_b, max_new_tokens=3, do_sample=False, cache=b.cache)
    assert_greedy_matches(reference, turn_b, torch.ones_like(turn_b), out)
    foreign = reference.generate(ids_a, max_new_tokens=2, do_sample=False, return_dict_in_generate=True).cache
    with pytest.raises(ValueError, match="only its own KV cache"):
        compiled.generate(torch.cat([ids_a, torch.tensor([[7, 8]])], dim=1), max_new_tokens=3, cache=foreign)


def test_requests_from_several_threads_each_get_their_own_tokens(pair):
    """A server's thread pool calls generate() from several threads at once. The model has one KV cache: the
    requests run one at a time, and each gets what it gets alone (before the lock: every one of them wrong)."""
    _, compiled = pair
    if compiled.config.model_type != "llama":
        pytest.skip("the lock is the runtime's, the same for every family")
    prompts = [padded_batch([_prompt(length, length)])[0] for length in (5, 9, 13, 7)]
    alone = [compiled.generate(ids, max_new_tokens=12, do_sample=False) for ids in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda ids: compiled.generate(ids, max_new_tokens=12, do_sample=False), prompts))
    for want, got in zip(alone, together):
        assert torch.equal(got, want)


def test_saving_the_compiled_model_is_refused(pair, tmp_path):
    """Its parameters hold packed bf16 (in packed order) or nothing: save_pretrained would write a checkpoint of
    wrong values without a word (15 of tiny-llama's 21 tensors, before)."""
    _, compiled = pair
    with pytest.raises(ValueError, match="Save the model before tilefx.compile_model"):
        compiled.save_pretrained(tmp_path)
    assert not any(tmp_path.iterdir())


def test_beam_search_scores_each_beam_as_the_reference_does(pair):
    """Beam search reorders the cache's rows every step (``reorder_cache``). Each beam's score, as the run summed
    it, equals its tokens' log-probs under the reference: a row going on from a wrong prefix would score apart."""
    reference, compiled = pair
    graphs = len(compiled.tilefx.report.graphs)
    for seed in (0, 2):
        ids, mask = padded_batch([_prompt(9, seed)])
        out = compiled.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, num_beams=4,
                                num_return_sequences=4, length_penalty=0.0, output_scores=True,
                                return_dict_in_generate=True)
        beams = out.sequences
        assert beams.shape == (4, 19) and torch.equal(beams[:, :9], ids.expand(4, 9))
        assert len({tuple(row) for row in beams.tolist()}) == 4
        # 10 tokens' log-probs summed: each within bf16's ~0.01-0.03 nat of the reference's (the whole sum was
        # 0.111 apart once in a full suite run); a beam going on from a wrong prefix is 0.2-0.8 apart at every step
        torch.testing.assert_close(out.sequences_scores, reference_sequence_logprobs(reference, beams, 9), rtol=0,
                                   atol=0.03 * 10)
    assert len(compiled.tilefx.report.graphs) == graphs  # the batch-2-4 graphs warm-up compiled
    with pytest.raises(ValueError, match=f"max_batch={MAX_BATCH}"):
        compiled.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=MAX_BATCH + 1)


def test_sleeping_openmp_workers_are_warned_of_and_explained(monkeypatch):
    """OMP_WAIT_POLICY=passive (read by the runtime at torch's import, here only by tilefx's check) makes every op
    of a decode step wake its threads: compile_model warns, explain() says so. No warm-up: nothing compiles."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    with pytest.warns(RuntimeWarning, match="OMP_WAIT_POLICY=passive makes the OpenMP workers sleep"):
        compiled = tilefx.compile_model(build_model("tiny-llama"), max_seq_len=16, warmup=False, progress=False)
    assert "idle workers sleep between ops (OMP_WAIT_POLICY=passive)" in tilefx.explain(compiled)


def test_explain_reports_rewrites(pair):
    _, compiled = pair
    text = tilefx.explain(compiled)
    layers = compiled.config.num_hidden_layers
    assert f"tilefx.extend_attention x{layers}" in text
    assert f"tilefx.decode_attention x{layers}" in text
    assert f"recompiles since warm-up {compiled.tilefx.report.recompiles}" in text
    assert "working memory: prompts over 4096 tokens in calls of at most that many; CPU buffers of 1 MiB and more " \
           "recycled within each forward" in text
    startup = next(line for line in text.splitlines() if line.startswith("startup "))
    assert all(part in startup for part in ("load", "pack", "tune", "trace", "passes", "inductor", "caches: ")), startup
    walks = [line for line in text.splitlines() if line.startswith("decode walk ")]
    assert walks and all(("tuned" in line or "cached" in line) and "prefetch" in line for line in walks), walks
    from tilefx.custom_ops import tuning

    if tuning.brgemm_has_kernel():  # the linear ops' GEMM per phase: the unit's or oneDNN's brgemm, timed
        gemms = [line for line in text.splitlines() if " GEMM bf16: " in line]  # decode's first (the walk's after)
        assert [line.split(" GEMM")[0] for line in gemms] == ["decode", "prefill"], gemms
        assert all("tuned" in line or "cached" in line for line in gemms), gemms
        tiling = [line for line in text.splitlines() if line.startswith("prefill GEMM tiling: ")]
        # brgemm's blocking, tuned where prefill runs brgemm
        assert len(tiling) == (1 if ": brgemm (" in gemms[1] else 0), (gemms, tiling)
        assert all("tuned" in line or "cached" in line for line in tiling), tiling
    threads = [line for line in text.splitlines() if line.startswith("threads (")]
    assert len(threads) == 1 and ("spin" in threads[0]) == (openmp.idle_wait().sleeps is None), threads
    config = compiled.config
    attention = [line for line in text.splitlines() if line.startswith("prefill attention ")]
    assert len(attention) == 1 and ("tuned" in attention[0] or "cached" in attention[0]), attention
    assert f"{config.num_attention_heads} query / {config.num_key_value_heads} KV heads" in attention[0]
    decode = [line for line in text.splitlines() if line.startswith("decode attention ")]
    assert len(decode) == 1 and ("tuned" in decode[0] or "cached" in decode[0]) and "context" in decode[0], decode


def test_weights_are_packed_as_they_load_and_held_once(pair, monkeypatch):
    from tilefx.custom_ops import weights

    _, compiled = pair
    fills = []
    original = weights.fill.fill  # what every packing ends in
    monkeypatch.setattr(weights.fill, "fill", lambda *a, **k: fills.append(a[0]) or original(*a, **k))
    ids, mask = padded_batch([_prompt(6, 3)])
    compiled.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert fills == []  # the graphs read the packed tensors made at load
    linears = [m for m in compiled.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7 * compiled.config.num_hidden_layers + 1
    for module in linears:  # the parameter's storage is the (fused) packed copy: one copy in memory
        packed = weights.packed_copy(module.weight)
        assert packed is not None and weights.is_released(module.weight)
        assert packed.untyped_storage().data_ptr() == module.weight.untyped_storage().data_ptr()
    report = compiled.tilefx.report
    assert report.packing.released_bytes == sum(m.weight.nbytes for m in linears)
    assert report.released_bytes == 0  # nothing was left for the graphs to pack
