"""tilefx's graph cache: a second compile_model loads the first one's graphs and runs them without Dynamo."""

from __future__ import annotations

import pytest
import torch

import tilefx
from tilefx.compiler import CompileOptions
from tilefx.compiler.graph_cache import GraphCache, model_key, source_expression
from tilefx.models.presets import build_model

from helpers import assert_greedy_matches, padded_batch

MAX_SEQ_LEN = 64
CASES = {  # a dense model with the dynamic batch, an MoE model in int8 (packed scales as inputs); MLA and MoE in int8
    # under Inductor's C++ wrapper (every kind of tilefx op called from C++)
    "tiny-llama": ("tiny-llama", {"max_batch": 4}),
    "tiny-qwen3-moe": ("tiny-qwen3-moe", {"weights": "int8"}),
    "tiny-deepseek-v3-cpp-wrapper": ("tiny-deepseek-v3", {"weights": "int8", "cpp_wrapper": True}),
}


def _dynamo_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _prompts(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch)
    return padded_batch([torch.randint(3, 500, (9 - 2 * row,), generator=generator).tolist() for row in range(batch)])


@pytest.mark.parametrize("case", list(CASES))
def test_second_compile_loads_every_graph_and_generates_the_same(case, tmp_path, monkeypatch):
    monkeypatch.setenv("TILEFX_GRAPH_CACHE_DIR", str(tmp_path))
    preset, options = CASES[case]
    if options.get("cpp_wrapper"):  # Inductor's caches start empty, so that every graph is generated here
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    wrappers = []  # the graphs Inductor wrote a C++ wrapper for
    codegen = torch._inductor.graph.GraphLowering.codegen_with_cpp_wrapper
    monkeypatch.setattr(torch._inductor.graph.GraphLowering, "codegen_with_cpp_wrapper",
                        lambda self, *a, **k: wrappers.append(self) or codegen(self, *a, **k))
    first = tilefx.compile_model(build_model(preset, seed=3), max_seq_len=MAX_SEQ_LEN, **options)
    assert len(wrappers) == (len(first.tilefx.report.graphs) if options.get("cpp_wrapper") else 0)
    assert ("Inductor's C++ wrapper" in tilefx.explain(first)) == bool(options.get("cpp_wrapper"))
    cache = first.tilefx.graph_cache
    assert cache.loaded == [] and len(cache.saved) == len(first.tilefx.report.graphs) >= 2, tilefx.explain(first)
    # The process that compiled them calls them the same way from then on (no Dynamo frame per step).
    assert sorted(first.tilefx.loaded) == sorted(cache.saved) and None not in first.tilefx.loaded.values()

    before = _dynamo_graphs()
    second = tilefx.compile_model(build_model(preset, seed=3), max_seq_len=MAX_SEQ_LEN, **options)
    batches = [1, 3] if options.get("max_batch", 1) >= 3 else [1]
    reference = build_model(preset, seed=3)
    for batch in batches:
        ids, mask = _prompts(batch)
        expected = first.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        with torch.inference_mode():
            out = second.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert torch.equal(out, expected)
        assert_greedy_matches(reference, ids, mask, out)
    assert _dynamo_graphs() == before, "the second model traced with Dynamo"
    report, explained = second.tilefx.report, tilefx.explain(second)
    assert sorted(second.tilefx.graph_cache.loaded) == sorted(cache.saved), explained
    assert f"tilefx graphs loaded {report.warmup_graphs}" in explained and report.recompiles == 0
    # The records came back with the graphs: explain() still says what each pass did.
    assert [g.tilefx_ops for g in report.graphs] == [g.tilefx_ops for g in first.tilefx.report.graphs]


def test_global_inductor_freezing_does_not_change_tilefx_graphs(tmp_path, monkeypatch):
    """Inductor's freezing set for another model (the bench's stock torch.compile row) would make Dynamo turn
    parameters into attributes: tilefx traces under its own option, so its graphs keep weights as inputs."""
    monkeypatch.setenv("TILEFX_GRAPH_CACHE_DIR", str(tmp_path))
    with torch._inductor.config.patch(freezing=True):
        model = tilefx.compile_model(build_model("tiny-qwen2", seed=5), max_seq_len=MAX_SEQ_LEN)
        ids, mask = _prompts(1)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert len(model.tilefx.graph_cache.saved) == 2, tilefx.explain(model)
    assert_greedy_matches(build_model("tiny-qwen2", seed=5), ids, mask, out)


def test_damaged_artifact_falls_back_to_dynamo_and_is_saved_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEFX_GRAPH_CACHE_DIR", str(tmp_path))
    first = tilefx.compile_model(build_model("tiny-qwen2", seed=5), max_seq_len=MAX_SEQ_LEN)
    artifacts = sorted(first.tilefx.graph_cache.directory.glob("graph-*.bin"))
    assert len(artifacts) == 2
    artifacts[0].write_bytes(artifacts[0].read_bytes()[:-7] + b"damaged")
    second = tilefx.compile_model(build_model("tiny-qwen2", seed=5), max_seq_len=MAX_SEQ_LEN)
    cache = second.tilefx.graph_cache
    assert len(cache.loaded) == 1 and len(cache.saved) == 1
    assert "not loaded (ValueError: artifact does not match its manifest entry)" in tilefx.explain(second)
    ids, mask = _prompts(1)
    assert torch.equal(second.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False),
                       first.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
    third = tilefx.compile_model(build_model("tiny-qwen2", seed=5), max_seq_len=MAX_SEQ_LEN)
    assert len(third.tilefx.graph_cache.loaded) == 2


def test_key_changes_with_options_shapes_config_and_the_callers_sources(tmp_path):
    model = build_model("tiny-llama", seed=0)
    (tmp_path / "caller.py").write_text("STEPS = 1\n")

    def key(model=model, options=CompileOptions(max_seq_len=64), uuid="uuid"):
        return model_key(model, options, uuid, sources=[tmp_path])

    first = key()
    assert first == key(build_model("tiny-llama", seed=1))  # values: inputs
    assert first != key(options=CompileOptions(max_seq_len=128))
    assert first != key(options=CompileOptions(max_seq_len=64, weights="int8"))
    # what only the runtime reads between graph calls does not
    assert first == key(options=CompileOptions(max_seq_len=64, prefill_chunk=16, recycle_buffers=False))
    assert first != key(uuid="another pass manager")
    assert first != key(build_model("tiny-llama", layers=1))
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):  # compiled code differs
        assert first != key()
    threads = torch.get_num_threads()
    try:  # Inductor's kernels are generated for the process's thread count
        torch.set_num_threads(threads + 1)
        assert first != key()
    finally:
        torch.set_num_threads(threads)
    assert first == key()
    (tmp_path / "caller.py").write_text("STEPS = 2\n")  # the code above the compiler that shapes the graphs
    assert first != key()


def test_cache_is_off_where_graphs_cannot_be_called_from_sources():
    model = build_model("tiny-llama", seed=0)
    assert GraphCache.open(model, CompileOptions(graph_cache=False), "u", sources=[]) is None
    assert GraphCache.open(model, CompileOptions(freezing=True), "u", sources=[]) is None  # weights: constants
    assert GraphCache.open(model, CompileOptions(inductor=False), "u", sources=[]) is None  # nothing compiled
    with torch.compiler.config.patch(force_disable_caches=True):
        assert GraphCache.open(model, CompileOptions(), "u", sources=[]) is None


def test_source_expressions_only_index_and_read():
    tensor = torch.zeros(2, 3)
    frame = {"kwargs": {"input_ids": tensor}}
    assert source_expression("L['kwargs']['input_ids']")(frame) is tensor
    assert source_expression("L['kwargs']['input_ids'].size()[1]")(frame) == 3
    for code in ("__import__('os')", "L['kwargs']['input_ids'].zero_()", "open('/etc/passwd')", "[x for x in L]"):
        with pytest.raises(ValueError, match="not an input source"):
            source_expression(code)
