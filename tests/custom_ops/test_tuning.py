"""The tuned decode walks (custom_ops/tuning.py): every candidate computes the same products on every unit,
and tuning times, chooses, caches and reloads."""

from __future__ import annotations

import json

import pytest
import torch

from tilefx.custom_ops import isa, tuning
from tilefx.custom_ops import linear as linear_ops
from tilefx.custom_ops import moe as moe_ops
from tilefx.custom_ops import weights

from quantized import dequantized

pytestmark = pytest.mark.skipif(isa.native is None, reason="native library not built")


def _relative_error(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def _weight(out_features, in_features, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=g) / in_features**0.5).to(torch.bfloat16)


def _linear_and_gate_up(out_features, in_features, format, seed):
    """A weight packed for linear and, with a second one, for linear_silu_mul in ``format`` (with their scales),
    and the two as fp32 values the kernels must multiply by (dequantized where quantized)."""
    weight, up = _weight(out_features, in_features, seed), _weight(out_features, in_features, seed + 1)
    packed = weights.pack_linear_weight(weight, format)
    gate_up = weights.pack_gate_up_weight(weight, up, format)
    scales = weights.packed_scales(packed) if format != "bf16" else None
    gate_up_scales = weights.packed_scales(gate_up) if format != "bf16" else None
    w, u = (dequantized(t, format) if format != "bf16" else t.float() for t in (weight, up))
    return packed, scales, gate_up, gate_up_scales, w, u


# Every kernel a walk compiles (streams x prefetch none / nta / t0 / t1), and nta's distances from short to past a
# block's end: a prefetch never changes a product, so the other distances run the same code.
WALKS = [w for w in tuning.CANDIDATES if (w[1] in (0, 256, 4096) and w[2] == "nta") or (w[1] == 1024 and w[2] != "nta")]


@pytest.mark.parametrize("format", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("candidate", WALKS, ids=[f"s{s}-p{p}-{h}" for s, p, h in WALKS])
def test_every_candidate_walk_matches_the_reference(kernel_path, format, candidate):
    """Plain and gate/up GEMVs (1 to 4 rows, the decode rows; an odd block count: two streams plus one; an odd
    count of K pairs: where 2-4 rows read a block's halves of K as two streams, one pair is left after them)
    under each forced walk."""
    units = tuning.decode_units(kernel_path)
    if not units:
        pytest.skip("the reference path has no native walk")
    out_features, in_features = 7 * 32, 302
    packed, scales, gate_up, gate_up_scales, w, u = _linear_and_gate_up(out_features, in_features, format, seed=1)
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        with tuning.forced(units[0], format, *candidate):
            got = linear_ops.linear(x, packed, None, out_features, scales)
            gated = linear_ops.linear_silu_mul(x, gate_up, out_features, gate_up_scales)
        assert _relative_error(got, x.float() @ w.T) < 1e-2
        want_gated = torch.nn.functional.silu(x.float() @ w.T) * (x.float() @ u.T)
        assert _relative_error(gated, want_gated) < 1e-2


@pytest.mark.parametrize("candidate", [(1, 0, "nta"), (2, 4096, "t0")], ids=["one-stream", "two-streams"])
def test_fused_moe_reads_its_experts_with_the_tuned_walk(kernel_path, candidate):
    units = tuning.decode_units(kernel_path)
    if not units:
        pytest.skip("the reference path has no native walk")
    experts, hidden, inter = 4, 96, 64
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
    down = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(torch.bfloat16)
    w13, w2 = weights.pack_expert_gate_up_weight(gate_up), weights.pack_expert_down_weight(down)
    x = torch.randn(1, hidden, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 2]], dtype=torch.int32)
    topk = torch.tensor([[0.6, 0.4]])
    want = moe_ops.experts_reference(x, gate_up, down, topk, ids)
    with tuning.forced(units[-1], "bf16", *candidate):
        got = moe_ops.fused_moe(x, w13, w2, topk, ids)
    assert _relative_error(got, want.float()) < 1e-2


@pytest.mark.parametrize("format", ["bf16", "int8", "fp8"])
def test_a_decode_split_along_k_matches_the_reference(kernel_path, format):
    """A decode split into K slices (forced: 64 tasks a thread, so every shape here splits) computes the same
    products: plain, gate/up and fp32-out linears at 1 and 2 rows; 5 blocks (an odd pair left) and K of 2200
    (bf16: 4 slices of 320 pairs, on fp8's scale groups, the last one shorter; int8 / fp8: 2 of 576 and 524). Its fp32 sums differ in their last bits
    from the unsplit walk's (another summation order): the split ran."""
    units = tuning.decode_units(kernel_path)
    if not units:
        pytest.skip("the reference path has no native walk")
    out_features, in_features = 5 * 32, 2200
    packed, scales, gate_up, gate_up_scales, w, u = _linear_and_gate_up(out_features, in_features, format, seed=3)
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    for rows in (1, 2):
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        with tuning.forced_split(format, 0):
            unsplit = linear_ops.linear_float(x, packed, None, out_features, scales)
        with tuning.forced_split(format, 64):
            got = linear_ops.linear(x, packed, bias, out_features, scales)
            got_float = linear_ops.linear_float(x, packed, None, out_features, scales)
            gated = linear_ops.linear_silu_mul(x, gate_up, out_features, gate_up_scales)
        assert _relative_error(got, x.float() @ w.T + bias.float()) < 1e-2
        assert _relative_error(got_float, x.float() @ w.T) < 1e-2
        assert (got_float != unsplit).any()
        want_gated = torch.nn.functional.silu(x.float() @ w.T) * (x.float() @ u.T)
        assert _relative_error(gated, want_gated) < 1e-2


@pytest.mark.parametrize(("out_features", "in_features"),
                         [(64, 2048), (32 * 9, 1024), (32 * 40, 4096), (64, 768), (64, 1023), (64, 1022)])
@pytest.mark.parametrize("tasks_per_thread", [0, 1, 4, 16])
@pytest.mark.parametrize("format", ["bf16", "int8"])
def test_tuning_knows_which_shapes_split(out_features, in_features, tasks_per_thread, format):
    """tuning.splits (which decides whether the split is worth timing) says what the kernels do: a linear splits
    exactly where its fp32 sums change with the split on (int8's slices hold twice the K pairs of bf16's)."""
    if not tuning.decode_units(isa.current()):
        pytest.skip("the reference path has no native walk")
    weight = _weight(out_features, in_features, 6)  # (its packing's scales are found through it)
    packed = weights.pack_linear_weight(weight, format)
    scales = weights.packed_scales(packed) if format != "bf16" else None
    x = torch.randn(1, in_features, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with tuning.forced_split(format, 0):
        unsplit = linear_ops.linear_float(x, packed, None, out_features, scales)
    with tuning.forced_split(format, tasks_per_thread):
        split = linear_ops.linear_float(x, packed, None, out_features, scales)
    assert tuning.splits(out_features, in_features, format, tasks_per_thread, torch.get_num_threads()) == bool(
        (split != unsplit).any())


def test_the_split_is_timed_where_it_would_split_and_kept_only_where_it_wins(monkeypatch):
    """At this machine's thread count the pass's shapes split only with many tasks a thread: the stage times each
    candidate that splits some shape against no split, and keeps one only where a fake clock makes it faster."""
    path = isa.current()
    if not tuning.decode_units(path):
        pytest.skip("the reference path has no native walk")
    unit = tuning.decode_units(path)[0]
    threads = torch.get_num_threads()
    many = next(n for n in (1, 2, 4, 8, 16, 32, 64)
                if any(tuning.splits(n_out, k, "bf16", n, threads) for n_out, k in tuning.LAYER_SHAPES))
    monkeypatch.setattr(tuning, "SPLIT_CANDIDATES", (many,))
    tensors = [(weights.pack_linear_weight(_weight(64, 512, 8), "bf16"), None, 64, 512)]
    inputs = {512: torch.randn(1, 512).to(torch.bfloat16)}
    for faster, want in ((True, many), (False, 0)):
        def fake_pass(tensors_, inputs_):
            split_on = isa.native.get_decode_split("bf16") > 0
            return 1.0 if split_on == faster else 2.0

        monkeypatch.setattr(tuning, "_time_pass", fake_pass)
        choice, gbps = tuning._tune_split(tensors, inputs, unit, "bf16", tuning.current(unit, "bf16"), 1 << 20)
        assert choice == want and set(gbps) == {0, many}
    monkeypatch.setattr(tuning, "SPLIT_CANDIDATES", ())
    assert tuning._tune_split(tensors, inputs, unit, "bf16", tuning.current(unit, "bf16"), 1 << 20) == (0, {})


def test_the_native_table_refuses_what_the_kernels_do_not_take():
    unit = tuning.decode_units(isa.current())[0] if tuning.decode_units(isa.current()) else "avx2"
    for streams, prefetch, hint in ((3, 1024, "nta"), (1, 100, "nta"), (2, -64, "nta"), (2, 1 << 20, "nta"),
                                    (2, 1024, "t2")):
        with pytest.raises(RuntimeError, match="tilefx tuning"):
            isa.native.set_walk_tuning(unit, "bf16", streams, prefetch, hint)
    with pytest.raises(RuntimeError, match="unknown weight format"):
        isa.native.set_walk_tuning(unit, "int3", 1, 0, "nta")
    for format, tasks in (("bf16", -1), ("bf16", 65), ("int4", 4)):
        with pytest.raises(RuntimeError, match="tilefx tuning"):
            isa.native.set_decode_split(format, tasks)


@pytest.mark.parametrize("unit", ["avx2", "avx512_bf16"])
def test_the_walks_tuned_are_those_the_unit_reads(unit):
    """The library says how many streams a unit's GEMV reads each format in (walk_streams); the tuning's candidates
    stay within it and the table refuses more: the AVX2 unit reads int4 one block at a time."""
    for format in ("bf16", "int8", "fp8", "int4"):
        most = isa.native.walk_streams(unit, format)
        walks = tuning.candidates(unit, format)
        assert {w[0] for w in walks} == set(range(1, most + 1))
        if most < 2:
            with pytest.raises(RuntimeError, match="reads int4 in 1 stream"):
                isa.native.set_walk_tuning(unit, format, 2, 1024, "nta")
    assert (isa.native.walk_streams("avx2", "int4"), isa.native.walk_streams(unit, "bf16")) == (1, 2)


def test_the_pass_misses_the_largest_cache_sysfs_gives(tmp_path, monkeypatch):
    """The tuning pass (and bench_kernels' cold copies) cycle through 4x the largest cache, read from sysfs as
    Linux writes it: a Xeon's 300 MiB L3 makes a 1200 MiB pass, not the 256 MiB floor it would sit inside."""
    for index, size in enumerate(["48K", "2048K", "307200K", "junk"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert tuning.last_level_cache_bytes(tmp_path) == 300 << 20
    assert tuning.last_level_cache_bytes(tmp_path / "missing") == 0
    monkeypatch.setattr(tuning, "CPU_CACHES", tmp_path)
    assert tuning.cold_pass_bytes() == 1200 << 20
    monkeypatch.setattr(tuning, "CPU_CACHES", tmp_path / "missing")
    assert tuning.cold_pass_bytes() == tuning.MIN_PASS_BYTES


@pytest.mark.parametrize("format", ["bf16", "int8", "fp8", "int4"])
def test_the_timed_weights_are_random_values_in_range(format, monkeypatch):
    """The tuning pass's weights (one random block repeated, then the start of the block where the packing is not
    a whole number of blocks): every byte written, values as the kernels take them (no NaN or infinity, int8
    within +-127, e4m3 without its NaN codes)."""
    monkeypatch.setattr(tuning, "_FILL_BLOCK_BYTES", 6000)
    data, scales, *_ = tuning._random_packing(96, 2048, format)
    raw = data.view(-1).view(torch.uint8)
    tail = raw.numel() % 6000
    assert tail and raw.numel() > 6000
    assert len(torch.unique(raw)) >= 64  # random, not a constant or a short cycle (fp8: 0x77 leaves 64 codes)
    assert raw[-tail:].ne(0).float().mean() > 0.9 and raw[:6000].ne(0).float().mean() > 0.9  # written to the end
    if format == "bf16":
        assert torch.isfinite(data).all()
    elif format == "int8":
        assert (data.view(torch.int8) != -128).all()
    elif format == "fp8":
        assert ((raw & 0x7F) != 0x7F).all()
    assert (scales is None) == (format == "bf16")


def test_tuning_times_chooses_caches_and_reloads(tmp_path, monkeypatch):
    """A short search (small pass, one round) sets a candidate, saves it, and the next call reads it back."""
    path = isa.current()
    if not tuning.decode_units(path):
        pytest.skip("the reference path has no native walk")
    monkeypatch.setattr(tuning, "MIN_PASS_BYTES", 8 << 20)
    monkeypatch.setattr(tuning, "MAX_PASS_BYTES", 8 << 20)
    monkeypatch.setattr(tuning, "ROUNDS", 1)
    monkeypatch.setattr(tuning, "CONFIRM_ROUNDS", 1)
    unit = tuning.decode_units(path)[0]
    before = tuning.current(unit, "int8")
    try:
        first = tuning.ensure_tuned(["int8"], path=path, cache=tmp_path)
        assert [t.how for t in first] == ["tuned"] * len(first) and first[0].gbps > 0
        assert first[0].walk in tuning.candidates(unit, "int8")
        assert tuning.current(unit, "int8") == first[0].walk
        saved = json.loads((tmp_path / "tuning.json").read_text())
        assert len(saved) == len(first) and all(unit in key for key in saved)
        assert all(entry["split"] == isa.native.get_decode_split("int8") for entry in saved.values())
        isa.native.set_walk_tuning(unit, "int8", *before)
        again = tuning.ensure_tuned(["int8"], path=path, cache=tmp_path)
        assert [t.how for t in again] == ["cached"] * len(again)
        assert tuning.current(unit, "int8") == first[0].walk
        assert "cached" in again[0].line()
        off = tuning.ensure_tuned(["int8"], path=path, cache=tmp_path, enabled=False)
        assert [t.how for t in off] == ["untuned"] * len(off)
    finally:
        isa.native.set_walk_tuning(unit, "int8", *before)


def test_the_walk_search_reads_one_row_and_a_batch_in_turn(monkeypatch):
    """A pass whose inputs are (one row, a batch) reads each repetition of the layer's shapes with them in turn, so
    every shape meets both; the search times bf16 walks at one row and four, quantized ones at one and two, and the
    split at one."""
    rows = []
    monkeypatch.setattr(torch.ops.tilefx, "linear", lambda x, *args: rows.append(x.shape[0]))
    shapes = len(tuning.LAYER_SHAPES)
    tuning._time_pass([(None, None, n, k) for n, k in tuning.LAYER_SHAPES * 3],
                      {k: (torch.zeros(1, k), torch.zeros(4, k)) for _, k in tuning.LAYER_SHAPES})
    assert rows == [1] * shapes + [4] * shapes + [1] * shapes
    for format, batch in (("bf16", 4), ("int8", 2), ("fp8", 2), ("int4", 2)):
        assert tuning.BATCH_ROWS.get(format, tuning.BATCH_ROWS_QUANTIZED) == batch


def test_the_search_times_the_batch_rows(monkeypatch):
    path = isa.current()
    if not tuning.decode_units(path):
        pytest.skip("the reference path has no native walk")
    unit = tuning.decode_units(path)[-1]
    seen = {}

    def medians(tensors, inputs, unit_, format, walks_, rounds):
        seen.setdefault("walks", {k: tuple(x.shape[0] for x in xs) for k, xs in inputs.items()})
        return {w: 1.0 for w in walks_}

    def split(tensors, inputs, *args):
        seen["split"] = {k: x.shape[0] for k, x in inputs.items()}
        return 0, {}

    monkeypatch.setattr(tuning, "MIN_PASS_BYTES", 1 << 20)
    monkeypatch.setattr(tuning, "MAX_PASS_BYTES", 1 << 20)
    monkeypatch.setattr(tuning, "_medians", medians)
    monkeypatch.setattr(tuning, "_tune_split", split)
    before = tuning.current(unit, "bf16")
    try:
        tuning.tune(unit, "bf16", path)
    finally:
        isa.native.set_walk_tuning(unit, "bf16", *before)
    assert set(seen["walks"].values()) == {(1, 4)} and set(seen["split"].values()) == {1}


def test_the_search_scouts_hints_then_distances(tmp_path, monkeypatch):
    """With a fake clock where one walk off the default's hint and distance is fastest, the two-stage search finds
    it: the scouts (every streams x hint at SCOUT_BYTES, and no prefetch) lead it to the hint and streams, the
    distances to the distance; only those walks are timed."""
    path = isa.current()
    if not tuning.decode_units(path):
        pytest.skip("the reference path has no native walk")
    unit = tuning.decode_units(path)[-1]
    walks = tuning.candidates(unit, "bf16")
    target = (2, 512, "t1") if (2, 512, "t1") in walks else (1, 512, "t1")
    seconds = {w: 2.0 - (w[2] == target[2]) * 0.5 - (w[0] == target[0]) * 0.2 - (w == target) * 0.3 for w in walks}
    timed = []

    def medians(tensors, inputs, unit_, format, walks_, rounds):
        timed.extend(walks_)
        return {w: seconds[w] for w in walks_}

    monkeypatch.setattr(tuning, "MIN_PASS_BYTES", 1 << 20)
    monkeypatch.setattr(tuning, "MAX_PASS_BYTES", 1 << 20)
    monkeypatch.setattr(tuning, "_medians", medians)
    before = tuning.current(unit, "bf16")
    try:
        tuned = tuning.tune(unit, "bf16", path)
        assert tuned.walk == target == tuning.current(unit, "bf16")
        assert "prefetch 512 B t1" in tuned.line()
        assert set(timed) <= set(tuning.scouts(walks)) | set(tuning.distances(walks, *target[::2])) | {before}
        assert len(set(timed)) < len(walks) / 2
    finally:
        isa.native.set_walk_tuning(unit, "bf16", *before)


@pytest.mark.parametrize("shape", [tuning.AttentionShape("extend", 4, 2, 32), tuning.AttentionShape("mla", 4, 1, 64, 32, 32, 16)],
                         ids=["extend", "mla"])
def test_attention_tuning_times_every_kernel_caches_and_reloads(tmp_path, monkeypatch, shape):
    """Short prompts, one round: the unit, SDPA and (where it has a compiled kernel) brgemm are all timed at every
    length, the choice is one of them from one of the length classes (the unit: 0), set in the native table,
    saved, and read back by the next call."""
    path = isa.current()
    if not tuning.decode_units(path):
        pytest.skip("the reference path has no native attention")
    monkeypatch.setattr(tuning, "ATTENTION_LENGTHS", ((8, 2), (32, 24)))
    monkeypatch.setattr(tuning, "DECODE_ATTENTION_CONTEXTS", (16, 200))
    monkeypatch.setattr(tuning, "ATTENTION_ROUNDS", 1)
    before = isa.native.get_prefill_attention(shape.family), isa.native.get_decode_attention(shape.family)
    # MLA's prompts are timed through the op the prefill graphs run, mla_prefill (per-head values out; it
    # expands K/V from the latent where that pays), not the absorbed mla_attention (latent out)
    out_dim = shape.v_dim if shape.family == "mla" else shape.head_dim
    assert tuning.prefill_call(shape, 8)().shape == (1, shape.heads, 8, out_dim)
    try:
        first = tuning.ensure_attention_tuned(shape, path=path, cache=tmp_path)
        timed = ["unit", "sdpa"] + (["brgemm"] if tuning.brgemm_has_kernel() else [])
        assert first.how == "tuned" and sorted(first.ms) == sorted(timed)
        assert all(len(ms) == 2 and all(t > 0 for t in ms) for ms in first.ms.values())
        assert (first.kernel, first.from_tokens) in {("unit", 0)} | {(k, n) for k in timed[1:] for n in (2, 24)}
        assert isa.native.get_prefill_attention(shape.family) == (first.kernel, first.from_tokens)
        assert sorted(first.decode_ms) == sorted(k for k in ("unit", "brgemm") if k in timed)
        assert all(len(ms) == 2 and all(t > 0 for t in ms) for ms in first.decode_ms.values())
        assert isa.native.get_decode_attention(shape.family) == first.decode_kernel
        isa.native.set_prefill_attention(shape.family, "sdpa" if first.kernel == "unit" else "unit", 2)
        isa.native.set_decode_attention(shape.family, "brgemm" if first.decode_kernel == "unit" else "unit")
        again = tuning.ensure_attention_tuned(shape, path=path, cache=tmp_path)
        assert again.how == "cached" and (again.kernel, again.from_tokens) == (first.kernel, first.from_tokens)
        assert isa.native.get_prefill_attention(shape.family) == (first.kernel, first.from_tokens)
        assert again.decode_kernel == first.decode_kernel == isa.native.get_decode_attention(shape.family)
        assert again.decode_ms == first.decode_ms
        assert "prefill attention" in again.line() and "cached" in again.line() and "unit" in again.line()
        assert again.decode_line().startswith("decode attention (") and "context 200 unit" in again.decode_line()
        assert tuning.ensure_attention_tuned(shape, path=path, cache=tmp_path, enabled=False).how == "untuned"
        assert tuning.ensure_attention_tuned(None, path=path, cache=tmp_path) is None
    finally:
        isa.native.set_prefill_attention(shape.family, *before[0])
        isa.native.set_decode_attention(shape.family, before[1])


@pytest.mark.parametrize("ms,want", [
    ({"unit": (1, 1, 1), "sdpa": (2, 2, 2), "brgemm": (2, 2, 2)}, ("unit", 0)),  # the unit leads everywhere
    ({"unit": (2, 2, 2), "sdpa": (1, 1, 1), "brgemm": (3, 3, 3)}, ("sdpa", 2)),
    ({"unit": (1, 2, 2), "sdpa": (2, 1.5, 1.5), "brgemm": (2, 1, 1)}, ("brgemm", 12)),
    ({"unit": (2, 1, 2), "sdpa": (1, 2, 1), "brgemm": (3, 3, 3)}, ("sdpa", 24)),  # must lead at every longer class
    ({"unit": (2, 2, 2), "sdpa": (1, 1, 1.99)}, ("unit", 0)),  # under MIN_GAIN at the longest: the unit
    ({"unit": (1, 1, 1)}, ("unit", 0)),
])
def test_attention_choice_is_the_fastest_from_the_first_class_it_leads(monkeypatch, ms, want):
    """The kernel fastest at the longest prompt takes prompts from the first length class where it beats the unit
    and beats it at every longer one."""
    monkeypatch.setattr(tuning, "ATTENTION_LENGTHS", ((8, 2), (16, 12), (32, 24)))
    assert tuning.choose_attention(ms) == want


@pytest.mark.parametrize("ms,want", [
    ({"unit": (1.0, 4.0), "brgemm": (0.5, 2.0)}, "brgemm"),
    ({"unit": (1.0, 4.0), "brgemm": (1.2, 2.0)}, "unit"),  # must lead at every context
    ({"unit": (1.0, 4.0), "brgemm": (0.99, 3.99)}, "unit"),  # under MIN_GAIN
    ({"unit": (1.0, 4.0)}, "unit"),  # brgemm not timed (no compiled kernel)
])
def test_decode_attention_choice_is_brgemm_only_where_it_leads_everywhere(ms, want):
    assert tuning.choose_decode_attention(ms) == want


@pytest.mark.parametrize("times,want", [
    ((2.0, 1.0, 1.5), 1),  # the fastest at the longest prompt
    ((2.0, 1.99, 1.98), 0),  # under MIN_GAIN: the default
    ((1.0, 3.0, 0.5), 2),  # only the longest prompt decides
])
def test_attention_tiling_is_the_fastest_by_min_gain_at_the_longest_prompt(monkeypatch, times, want):
    tilings = tuning.ATTENTION_TILINGS
    ms = {tiling: (0.1, t) for tiling, t in zip(tilings, times)}
    assert tuning.choose_tiling(ms) == tilings[want]


def test_attention_tiling_table_takes_what_the_kernel_can_run():
    before = isa.native.get_attention_tiling("mla") if isa.native else None
    if before is None:
        pytest.skip("no native library")
    try:
        isa.native.set_attention_tiling("mla", 256, 768)
        assert tuple(isa.native.get_attention_tiling("mla")) == (256, 768)
        for rows, keys in ((8, 128), (64, 100), (64, 4096), (2048, 128)):
            with pytest.raises(RuntimeError, match="tilefx tuning: an attention"):
                isa.native.set_attention_tiling("mla", rows, keys)
        with pytest.raises(RuntimeError, match="unknown attention family"):
            isa.native.set_attention_tiling("gqa", 64, 128)
    finally:
        isa.native.set_attention_tiling("mla", *before)


def test_attention_tuning_sets_what_the_timings_choose(monkeypatch):
    """tune_attention times each prefill and decode kernel through the native table it forces (fake calls charge
    each kernel's ms)."""
    path = isa.current()
    if not tuning.decode_units(path):
        pytest.skip("the reference path has no native attention")
    monkeypatch.setattr(tuning, "ATTENTION_LENGTHS", ((8, 2), (16, 12), (32, 24)))
    monkeypatch.setattr(tuning, "ATTENTION_ROUNDS", 1)
    monkeypatch.setattr(tuning, "brgemm_has_kernel", lambda: True)
    shape = tuning.AttentionShape("extend", 2, 1, 16)
    before = isa.native.get_prefill_attention("extend")
    clock = [0.0]  # perf_counter, advanced by the fake calls: each "takes" its kernel's ms
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    ms = {"unit": (1, 2, 2), "sdpa": (2, 1.5, 1.5), "brgemm": (2, 1, 1)}
    # brgemm's blockings: the second is the fastest (its times are brgemm's), the third slower than the default
    tiling_ms = dict(zip(tuning.ATTENTION_TILINGS, [(2.2, 1.2, 1.3), (2, 1, 1), (2.5, 1.5, 1.5)]))

    def fake_call(shape_, seq):
        index = [n for n, _ in tuning.ATTENTION_LENGTHS].index(seq)

        def call():
            kernel = isa.native.get_prefill_attention("extend")[0]
            table = tiling_ms[tuple(isa.native.get_attention_tiling("extend"))] if kernel == "brgemm" else ms[kernel]
            clock[0] += table[index]

        return call

    decode_ms = {"unit": (1, 4), "brgemm": (0.5, 2)}

    def fake_decode_call(shape_, context):
        index = tuning.DECODE_ATTENTION_CONTEXTS.index(context)

        def call():
            clock[0] += decode_ms[isa.native.get_decode_attention("extend")][index]

        return call

    monkeypatch.setattr(tuning, "prefill_call", fake_call)
    monkeypatch.setattr(tuning, "decode_call", fake_decode_call)
    before_decode = isa.native.get_decode_attention("extend")
    before_tiling = isa.native.get_attention_tiling("extend")
    try:
        choice = tuning.tune_attention(shape, path)
        assert (choice.kernel, choice.from_tokens) == ("brgemm", 12)
        assert choice.ms == {k: tuple(1e3 * t for t in v) for k, v in ms.items()}
        assert choice.tiling == tuning.ATTENTION_TILINGS[1] == tuple(isa.native.get_attention_tiling("extend"))
        assert choice.tiling_ms.keys() == tiling_ms.keys()
        assert all(choice.tiling_ms[t] == pytest.approx(tuple(1e3 * x for x in v)) for t, v in tiling_ms.items())
        assert isa.native.get_prefill_attention("extend") == ("brgemm", 12)
        rows, keys = tuning.ATTENTION_TILINGS[1]
        assert f"flash attention on oneDNN brgemm ({rows} query rows x {keys} keys a step) from 12 tokens" in choice.line()
        assert choice.decode_kernel == "brgemm" == isa.native.get_decode_attention("extend")
        assert choice.decode_ms == {k: tuple(1e3 * t for t in v) for k, v in decode_ms.items()}
        assert "flash decoding on oneDNN brgemm" in choice.decode_line()
    finally:
        isa.native.set_prefill_attention("extend", *before)
        isa.native.set_decode_attention("extend", before_decode)
        isa.native.set_attention_tiling("extend", *before_tiling)
