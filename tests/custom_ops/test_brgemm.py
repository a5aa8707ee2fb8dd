"""The linear ops on oneDNN's brgemm (csrc/linear_brgemm.cpp), prefill and decode, forced on every native path
and format: the choice tuning may make (tuning.ensure_gemm_tuned) changes no result. brgemm runs everywhere
(AMX tiles, oneDNN's AVX512-BF16 kernels, or its reference loop), so this covers the AMX path's GEMM code on
any CPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tilefx.custom_ops import isa, tuning
from tilefx.custom_ops import linear as linear_ops
from tilefx.custom_ops import weights

from quantized import dequantized, gemm_x

pytestmark = pytest.mark.skipif(isa.native is None, reason="native library not built")


def _weight(out_features, in_features, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=g) / in_features**0.5).to(torch.bfloat16)


def _relative_error(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def _linear_ops(format, rows, in_features, out_features, intermediate):
    """Random weights packed in ``format`` and x of ``rows`` rows: a function that runs linear (with bias),
    linear_float and linear_silu_mul on them (under whatever GEMM the caller forces), and their fp32 references
    (the plain linear's, the gated one's)."""
    weight, bias = _weight(out_features, in_features, 1), _weight(1, out_features, 3)[0]
    gate, up = _weight(intermediate, in_features, 2), _weight(intermediate, in_features, 4)
    packed = weights.pack_linear_weight(weight, format)
    gate_up = weights.pack_gate_up_weight(gate, up, format)
    scales = weights.packed_scales(packed) if format != "bf16" else None
    gate_up_scales = weights.packed_scales(gate_up) if format != "bf16" else None
    w, g, u = (dequantized(t, format) if format != "bf16" else t.float() for t in (weight, gate, up))
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)

    def run():
        return (linear_ops.linear(x, packed, bias, out_features, scales),
                torch.ops.tilefx.linear_float(x, packed, bias, out_features, scales),
                linear_ops.linear_silu_mul(x, gate_up, intermediate, gate_up_scales))

    return run, x.float() @ w.T + bias.float(), torch.nn.functional.silu(x.float() @ g.T) * (x.float() @ u.T)


@pytest.mark.parametrize("format", ["bf16", "int8", "fp8", "int4"])
@pytest.mark.parametrize("rows,in_features,blocks",
                         [(5, 300, 5), (70, 301, 5), (3, 256, 5), (70, 64, 90), (300, 320, 3)],
                         ids=["5x300", "70x301-odd", "3x256", "70x64-groups", "300x320-panels"])
@pytest.mark.parametrize("tiling", [tuning.GEMM_TILING_DEFAULT, (16, 64, "brgemm"), (256, 2048, "brgemm"),
                                    (64, 64, "tiles"), (16, 128, "tiles"), *tuning.GEMM_TILES],
                         ids=["64x1024", "16x64", "256x2048", "tiles-64x64", "tiles-16x128", "tiles-256x1024",
                              "tiles-128x1024", "tiles-256x512"])
def test_brgemm_prefill_matches_the_reference(kernel_path, format, rows, in_features, blocks, tiling):
    """linear (with bias), linear_float and linear_silu_mul over more rows than one brgemm tile (70 > 64), an odd
    K (padded pair) and a ragged last block; 90 blocks make chunks of several groups of blocks (a row tile meets a
    group at a time) and a ragged last group; 3 rows stays a GEMV on the unit whatever is forced. In each tiling
    tuning may choose: 16 rows x 64 pairs takes x in several row tiles and K in chunks with a ragged last one
    (150 and 151 pairs), 256 x 2048 all of both at once. 300 rows are two panels of rows (256 and 44), each taking
    K's chunks again. tilefx's AMX tiles take a panel of the tiling's rows at once: 70 rows are two 32-row steps
    and a 6-row tile, or at 16 rows five panels (the last 6 rows); K 320 (160 pairs) in chunks of 64 pairs (the last
    32) or one; a call of 96 rows or more (a 256-row panel) fetches the next one's bytes (the next block, the next
    chunk, the next panel's first, the next group's first), one of fewer rows (70, 44) reads its own bf16 blocks
    ahead; K of 300 or 301 (not a multiple of 32) stays on brgemm. A quantized block is
    dequantized one chunk at a time as the first panel of rows reaches it (int4's and fp8's 64-pair scale groups
    cut by the chunks of 64, and the last ragged)."""
    if kernel_path == "reference":
        pytest.skip("the reference path runs PyTorch's matmul; brgemm is a native path's choice")
    if tiling[2] == "tiles" and not tuning.amx_tiles_run():
        pytest.skip("tilefx's AMX tiles need a CPU with AMX")
    if format == "int4" and in_features % 4:
        pytest.skip("an int4 weight's inputs come in fours")
    # a ragged last block; gate/up take whole blocks
    run, want, want_gated = _linear_ops(format, rows, in_features, blocks * 32 + 7, blocks * 32)
    with tuning.forced_gemm(format, "brgemm"), tuning.forced_gemm_tiling(*tiling):
        got, got_float, gated = run()
    assert got.dtype == torch.bfloat16 and got_float.dtype == torch.float32
    assert _relative_error(got, want) < 1e-2
    assert _relative_error(got_float, want) < 1e-2
    assert _relative_error(gated, want_gated) < 1e-2
    with tuning.forced_gemm(format, "unit"):  # the same products on the unit's GEMM
        unit = run()[1]
        rounded = gemm_x(format, kernel_path, in_features) != "bf16"
    # (but the units' int8 GEMM rounds x, to int8 per 32 inputs or int16 per row: test_quantized_ops checks its
    # products)
    assert _relative_error(got_float, unit.float()) < (1e-2 if rounded else 1e-3)


@pytest.mark.parametrize("format", ["bf16", "int8"])
def test_brgemm_prefill_past_two_slabs_matches_the_reference(kernel_path, format):
    """A prompt of more than 2 x 1024 rows on brgemm runs in slabs of 1024 rows (linear_ops.cpp kBrgemmSlabRows),
    every block over one slab before the next: 2055 rows are two slabs and a last one of 7, each writing its own
    rows (checked slab by slab)."""
    if kernel_path == "reference":
        pytest.skip("the reference path runs PyTorch's matmul; brgemm is a native path's choice")
    rows = 2 * 1024 + 7
    run, want, want_gated = _linear_ops(format, rows, 64, 2 * 32 + 7, 64)
    with tuning.forced_gemm(format, "brgemm"):
        got, got_float, gated = run()
    for first in range(0, rows, 1024):
        part = slice(first, first + 1024)
        assert _relative_error(got[part], want[part]) < 1e-2
        assert _relative_error(got_float[part], want[part]) < 1e-2
        assert _relative_error(gated[part], want_gated[part]) < 1e-2


def test_prefill_gemm_choice_is_checked_and_defaults_to_the_path():
    with pytest.raises(RuntimeError, match="unknown prefill GEMM"):
        isa.native.set_prefill_gemm("bf16", "mkl")
    with pytest.raises(RuntimeError, match="unknown weight format"):
        isa.native.set_prefill_gemm("int3", "unit")
    with tuning.untuned():
        assert {isa.native.get_prefill_gemm(f) for f in weights.FORMATS} == {"default"}
    for path in isa.supported():
        units = isa.kernel_units(path)
        if path == "amx":
            assert units["linear"].startswith("brgemm above 4 rows")
        elif units:
            assert "brgemm" not in units["linear"]


def test_gemm_tiling_is_checked_and_defaults_to_64_rows_x_1024_pairs():
    for rows, pairs in ((8, 1024), (48 + 1, 1024), (512, 1024), (64, 32), (64, 100), (64, 16384)):
        with pytest.raises(RuntimeError, match="GEMM (tile|chunk)"):
            isa.native.set_gemm_tiling(rows, pairs, "brgemm")
    with pytest.raises(RuntimeError, match="unknown GEMM kernel 'mkl'"):
        isa.native.set_gemm_tiling(64, 1024, "mkl")
    if not tuning.amx_tiles_run():
        with pytest.raises(RuntimeError, match="'tiles' needs a CPU with AMX"):
            isa.native.set_gemm_tiling(64, 1024, "tiles")
    with tuning.untuned():
        assert tuple(isa.native.get_gemm_tiling()) == tuning.GEMM_TILING_DEFAULT == (64, 1024, "brgemm")
        with tuning.forced_gemm_tiling(128, 2048):
            assert tuple(isa.native.get_gemm_tiling()) == (128, 2048, "brgemm")
        assert tuple(isa.native.get_gemm_tiling()) == (64, 1024, "brgemm")


def test_decode_on_brgemm_keeps_its_blocking_whatever_the_tiling(kernel_path):
    """1 to 4 rows are not prefill: a tiling tuned on prefill shapes leaves decode's brgemm as it was timed (the
    same bits under any tiling; fp32 sums in other chunks would differ)."""
    if kernel_path == "reference":
        pytest.skip("the reference path runs PyTorch's matmul; brgemm is a native path's choice")
    run = _linear_ops("bf16", 4, 8200, 96, 64)[0]
    with tuning.untuned(), tuning.forced_decode_gemm("bf16", "brgemm"):
        default = run()
        with tuning.forced_gemm_tiling(16, 64):
            small = run()
        if tuning.amx_tiles_run():
            with tuning.forced_gemm_tiling(64, 64, "tiles"):
                assert all(torch.equal(a, b) for a, b in zip(default, run()))
    assert all(torch.equal(a, b) for a, b in zip(default, small))


def test_gemm_long_pairs_is_checked_and_defaults_to_the_tilings():
    for pairs in (-64, 32, 100, 16384):
        with pytest.raises(RuntimeError, match="long prompt's GEMM chunk"):
            isa.native.set_gemm_long_pairs(pairs)
    with tuning.untuned():
        assert isa.native.get_gemm_long_pairs() == 0
        with tuning.forced_gemm_long_pairs(128):
            assert isa.native.get_gemm_long_pairs() == 128
        assert isa.native.get_gemm_long_pairs() == 0


@pytest.mark.parametrize("format", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("tiling,rows", [(tuning.GEMM_TILING_DEFAULT, 300), ((64, 1024, "tiles"), 150),
                                         ((64, 1024, "tiles"), 300)], ids=["brgemm-300", "tiles-150", "tiles-300"])
def test_long_prompts_chunk_applies_over_several_panels_only(kernel_path, format, tiling, rows):
    """Rows past one panel (300 on brgemm: panels of 256 and 44; 150 on 64-row tiles, which a long prompt takes as
    one panel of 256 rows at most) take K (160 pairs) in the long prompt's chunks of 64 (the last 32), against the
    reference and the tiling's own chunk (the same products, summed in other fp32 chunks); one panel of the tiling's
    rows ignores it, bit for bit."""
    if kernel_path == "reference":
        pytest.skip("the reference path runs PyTorch's matmul; brgemm is a native path's choice")
    if tiling[2] == "tiles" and not tuning.amx_tiles_run():
        pytest.skip("tilefx's AMX tiles need a CPU with AMX")
    panel = 256 if tiling[2] == "brgemm" else tiling[0]
    run, want, want_gated = _linear_ops(format, rows, 320, 3 * 32 + 7, 3 * 32)
    one_panel = _linear_ops(format, panel, 320, 3 * 32 + 7, 3 * 32)[0]
    with tuning.forced_gemm(format, "brgemm"), tuning.forced_gemm_tiling(*tiling):
        with tuning.forced_gemm_long_pairs(0):
            whole, single = run(), one_panel()
        with tuning.forced_gemm_long_pairs(64):
            chunked, single_again = run(), one_panel()
    assert _relative_error(chunked[0], want) < 1e-2 and _relative_error(chunked[2], want_gated) < 1e-2
    assert _relative_error(chunked[1], whole[1]) < 1e-3
    assert all(torch.equal(a, b) for a, b in zip(single, single_again))


def test_gemm_timings_alternate_the_order_drop_the_first_round_and_keep_the_least(monkeypatch):
    order, current = [], []
    times = iter(range(100))

    def time_pass(tensors, inputs):
        order.append(current[-1])
        return float(next(times))

    @contextlib.contextmanager
    def force(choice):
        current.append(choice)
        yield

    monkeypatch.setattr(tuning, "_time_pass", time_pass)
    seconds = tuning._gemm_least([], [{}], ["a", "b", "c"], force, rounds=3)
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    # round 0 (times 0, 1, 2) dropped; then a took times 5, 6 and 11, b 4, 7, 10, c 3, 8, 9
    assert seconds == {"a": 5.0, "b": 4.0, "c": 3.0}


@pytest.mark.parametrize("seconds,confirm,want", [
    ({0: 1.0, 128: 1.0, 256: 1.0}, None, 0),  # level: the tiling's own chunk stays
    ({0: 1.0, 128: 0.9, 256: 0.95}, (1.0, 0.9), 128),
    ({0: 1.0, 128: 0.9, 256: 0.95}, (1.0, 0.99), 0),  # unconfirmed
    ({0: 1.0, 128: 1.0, 256: 0.99}, None, 0),  # within MIN_GAIN
])
def test_long_prompts_chunk_is_timed_against_the_tilings_own(monkeypatch, seconds, confirm, want):
    if isa.native is None:
        pytest.skip("native library not built")
    steps = []

    def least(tensors, inputs, choices, force, rounds=tuning.GEMM_ROUNDS):
        assert rounds == tuning.GEMM_LONG_ROUNDS
        steps.append((list(choices), inputs))
        if len(choices) == 2:  # the head to head
            return dict(zip(choices, confirm))
        return {c: seconds[c] for c in choices}

    monkeypatch.setattr(tuning, "_gemm_least", least)
    tensors = [(None, None, 32, 64)]
    with tuning.forced_gemm_long_pairs(256):
        chosen, gflops = tuning._tune_long_pairs(tensors, ["short", "long"], 1024)
        assert chosen == want == isa.native.get_gemm_long_pairs()
        # a chunk not below the tiling's is no candidate
        assert tuning._tune_long_pairs(tensors, ["short", "long"], 128)[0] == 0
    assert steps[0] == ([0, *tuning.GEMM_LONG_PAIRS], ["long"])  # on the longest prompt only
    assert len(steps) == (3 if confirm else 2) and steps[-1][0] == [0]
    assert set(gflops) == {0, *tuning.GEMM_LONG_PAIRS}
    line = tuning.GemmTilingChoice((64, 1024, "brgemm"), "tuned", long_pairs=chosen, long_gflops=gflops).line()
    assert f"; K chunks at {tuning.GEMM_ROWS[-1]} rows 1024 " in line
    assert ("K in chunks of 128 pairs over several panels" in line) == (want == 128)


@pytest.mark.parametrize("seconds,confirm,want", [
    ({0: 1.0, 128: 1.0, 256: 1.0}, None, 128),  # level: the kept chunk stays
    ({0: 1.0, 128: 1.02, 256: 1.0}, None, 128),  # behind by less than MIN_GAIN: still kept
    ({0: 0.9, 128: 1.0, 256: 0.95}, (1.0, 0.9), 0),  # the tiling's own, confirmed head to head
    ({0: 0.9, 128: 1.0, 256: 0.95}, (1.0, 0.99), 128),  # unconfirmed
])
def test_long_prompts_chunk_on_tiles_is_kept_unless_beaten(monkeypatch, seconds, confirm, want):
    if isa.native is None:
        pytest.skip("native library not built")
    heads = []

    def least(tensors, inputs, choices, force, rounds=tuning.GEMM_ROUNDS):
        if len(choices) == 2:
            heads.append(list(choices))
            return dict(zip(choices, confirm))
        return {c: seconds[c] for c in choices}

    monkeypatch.setattr(tuning, "_gemm_least", least)
    kept = tuning.long_pairs_kept((256, 1024, "tiles"))
    assert kept == 128 and tuning.long_pairs_kept((256, 1024, "brgemm")) == 0
    assert tuning.long_pairs_kept((256, 128, "tiles")) == 0  # not below the tiling's own chunk
    with tuning.forced_gemm_long_pairs(256):
        assert tuning._tune_long_pairs([(None, None, 32, 64)], ["long"], 1024, kept)[0] == want
    assert heads == ([[128, 0]] if confirm else [])


@pytest.mark.parametrize("chunks,tiles,confirm,want", [
    # the chunk at 64 rows, then the rows at the chunk kept, then the winner against the default head to head
    ({512: 1.2, 1024: 1.0, 2048: 1.0}, {32: 1.0, 64: 1.0, 128: 1.0, 256: 1.0}, None, (64, 1024)),  # all level
    ({512: 1.2, 1024: 1.0, 2048: 0.9}, {32: 1.0, 64: 0.9, 128: 0.8, 256: 0.85}, (1.0, 0.8), (128, 2048)),
    ({512: 1.2, 1024: 1.0, 2048: 0.99}, {32: 1.0, 64: 1.0, 128: 0.9, 256: 1.0}, (1.0, 0.9), (128, 1024)),
    ({512: 1.2, 1024: 1.0, 2048: 1.0}, {32: 1.0, 64: 1.0, 128: 0.9, 256: 1.0}, (1.0, 0.99), (64, 1024)),  # unconfirmed
])
def test_gemm_tiling_tuning_steps_through_chunks_rows_and_a_confirmation(monkeypatch, chunks, tiles, confirm, want):
    if isa.native is None:
        pytest.skip("native library not built")
    steps = []

    def least(tensors, inputs, tilings, force):
        tilings = list(tilings)
        steps.append(tilings)
        if all(rows == 64 for rows, *_ in tilings) and len(tilings) == len(tuning.GEMM_TILING_PAIRS):
            return {t: chunks[t[1]] for t in tilings}
        if len(tilings) == len(tuning.GEMM_TILING_ROWS):
            return {t: tiles[t[0]] for t in tilings}
        return dict(zip(tilings, confirm))

    monkeypatch.setattr(tuning, "_gemm_least", least)
    monkeypatch.setattr(tuning, "_gemm_pass", lambda format: ([], [], 1e9))
    monkeypatch.setattr(tuning, "amx_tiles_run", lambda: False)  # the tile kernel's step: the test below
    monkeypatch.setattr(tuning, "_tune_long_pairs", lambda tensors, inputs, pairs, kept=0: (0, {}))  # and the long chunk's
    want = (*want, "brgemm")
    with tuning.forced_gemm_tiling(*tuning.GEMM_TILING_DEFAULT):
        choice = tuning.tune_gemm_tiling(isa.current())
        assert choice.tiling == want == tuple(isa.native.get_gemm_tiling())
    assert len(steps) == (2 if confirm is None else 3)
    assert set(choice.gflops) == {*steps[0], *steps[1]}
    assert choice.line().startswith(f"prefill GEMM tiling: {want[0]} rows x {want[1]} K pairs a brgemm call (tuned")


@pytest.mark.parametrize("tile_seconds,want", [
    ((1.0, 1.0, 1.0), (64, 1024, "brgemm")),  # level: brgemm's tiling stays
    ((0.9, 0.8, 1.0), (128, 1024, "tiles")),
    ((0.99, 1.0, 1.0), (64, 1024, "brgemm")),  # within MIN_GAIN
])
def test_gemm_tiling_tuning_tries_the_tile_kernel_against_brgemms_tiling(monkeypatch, tile_seconds, want):
    if not tuning.amx_tiles_run():
        pytest.skip("tilefx's AMX tiles need a CPU with AMX")
    steps = []

    def least(tensors, inputs, tilings, force):
        tilings = list(tilings)
        steps.append(tilings)
        if any(kernel == "tiles" for *_, kernel in tilings):
            return {tilings[0]: 1.0, **dict(zip(tilings[1:], tile_seconds))}
        return {t: 1.0 for t in tilings}  # brgemm's tilings level: the default stays

    monkeypatch.setattr(tuning, "_gemm_least", least)
    monkeypatch.setattr(tuning, "_gemm_pass", lambda format: ([], [], 1e9))
    monkeypatch.setattr(tuning, "_decode_pass", lambda format: [(None, None, 64, 32)])  # the cold pass
    monkeypatch.setattr(tuning, "_tune_long_pairs", lambda tensors, inputs, pairs, kept=0: (0, {}))
    with tuning.forced_gemm_tiling(*tuning.GEMM_TILING_DEFAULT):
        choice = tuning.tune_gemm_tiling(isa.current())
        assert choice.tiling == want == tuple(isa.native.get_gemm_tiling())
    # the prefill pass, then the cold one, each with the tiling kept against the tile candidates
    assert steps[-2] == steps[-1] == [tuning.GEMM_TILING_DEFAULT, *tuning.GEMM_TILES]
    assert set(choice.cold_gflops) == set(steps[-1]) and "; cold weights at 128 rows" in choice.line()
    assert "tiles 128x1024" in choice.line()
    if want[2] == "tiles":
        assert choice.line().startswith("prefill GEMM tiling: 128 rows x 1024 K pairs a call of tilefx's AMX tiles")


@pytest.mark.parametrize("first,again,want", [
    ((1.0, 1.0), None, "unit"),  # level: the unit's GEMM stays
    ((1.0, 0.99), None, "unit"),  # within MIN_GAIN
    ((1.0, 0.8), (1.0, 0.8), "brgemm"),  # ahead, and again head to head
    ((1.0, 0.8), (1.0, 0.99), "unit"),  # unconfirmed: one noisy second decides nothing
])
def test_prefill_gemm_tuning_confirms_brgemm_head_to_head(monkeypatch, first, again, want):
    if isa.native is None:
        pytest.skip("native library not built")
    timings = iter([first, again])

    def least(tensors, inputs, choices, force, rounds=tuning.GEMM_ROUNDS):
        assert rounds == tuning.GEMM_CHOICE_ROUNDS
        return dict(zip(choices, next(timings)))

    monkeypatch.setattr(tuning, "_gemm_least", least)
    monkeypatch.setattr(tuning, "_gemm_pass", lambda format: ([], [], 1e9))
    with tuning.forced_gemm("int8", "default"):
        choice = tuning.tune_gemm("int8", isa.current())
        assert choice.gemm == want == isa.native.get_prefill_gemm("int8")
    # the times reported are the last timing's
    assert choice.brgemm_gflops == pytest.approx(1e9 / (again or first)[1] / 1e9)
    assert next(timings, "spent") == ("spent" if first[1] == 0.8 else again)


def test_gemm_tuning_times_both_caches_and_reloads(tmp_path, monkeypatch):
    path = isa.current()
    if path == "reference" or not tuning.brgemm_has_kernel():
        pytest.skip("brgemm has no compiled kernel on this CPU: nothing is timed (the unit's GEMM stays)")
    monkeypatch.setattr(tuning, "GEMM_SHAPES", ((96, 128),))
    monkeypatch.setattr(tuning, "GEMM_ROWS", (8, 16))
    monkeypatch.setattr(tuning, "GEMM_ROUNDS", 1)
    monkeypatch.setattr(tuning, "GEMM_TILING_ROWS", (32, 64))
    monkeypatch.setattr(tuning, "LAYER_SHAPES", ((96, 128),))  # the tile kernel's cold pass, where it runs
    monkeypatch.setattr(tuning, "cold_pass_bytes", lambda: 1 << 20)
    before, tiling = isa.native.get_prefill_gemm("int8"), tuple(isa.native.get_gemm_tiling())
    long_pairs = isa.native.get_gemm_long_pairs()
    try:
        first = tuning.ensure_gemm_tuned(["int8"], path=path, cache=tmp_path)
        assert first[0].how == "tuned" and first[0].gemm in ("unit", "brgemm")
        assert first[0].unit_gflops > 0 and first[0].brgemm_gflops > 0
        assert isa.native.get_prefill_gemm("int8") == first[0].gemm
        # brgemm's blocking is tuned where a format's prefill runs it
        on_brgemm = tuning.prefill_runs_brgemm(first[0].gemm, path)
        assert [type(c).__name__ for c in first[1:]] == (["GemmTilingChoice"] if on_brgemm else [])
        if on_brgemm:
            assert first[1].how == "tuned" and tuple(isa.native.get_gemm_tiling()) == first[1].tiling
            # the chunks at 64 rows, then 32 rows at the chunk the first step kept (a confirmation may still
            # return to the default after it)
            rows_step = {tiling for tiling in first[1].gflops if tiling[0] == 32}
            chunks = {(64, 512, "brgemm"), (64, 1024, "brgemm"), (64, 2048, "brgemm")}
            tiles = set(tuning.GEMM_TILES) if tuning.amx_tiles_run() else set()
            assert len(rows_step) == 1 and set(first[1].gflops) == {*chunks, *rows_step, *tiles}
            kept_pairs = next(iter(rows_step))[1]
            assert first[1].tiling in (tuning.GEMM_TILING_DEFAULT, (32, kept_pairs, "brgemm"),
                                       (64, kept_pairs, "brgemm"), *tiles)
        if on_brgemm:  # the long prompt's chunk, against the tiling's own
            assert set(first[1].long_gflops) == {0, *(p for p in tuning.GEMM_LONG_PAIRS if p < first[1].tiling[1])}
            assert first[1].long_pairs == isa.native.get_gemm_long_pairs() and first[1].long_pairs in first[1].long_gflops
        isa.native.set_prefill_gemm("int8", "default")
        isa.native.set_gemm_tiling(32, 64, "brgemm")
        isa.native.set_gemm_long_pairs(2048)
        again = tuning.ensure_gemm_tuned(["int8"], path=path, cache=tmp_path)
        assert [c.how for c in again] == ["cached"] * len(first) and isa.native.get_prefill_gemm("int8") == first[0].gemm
        assert "prefill GEMM int8" in again[0].line()
        if on_brgemm:
            assert again[1].tiling == first[1].tiling == tuple(isa.native.get_gemm_tiling())
            assert again[1].gflops == pytest.approx(first[1].gflops)
            assert again[1].cold_gflops == pytest.approx(first[1].cold_gflops)
            assert bool(first[1].cold_gflops) == tuning.amx_tiles_run()
            assert again[1].long_pairs == first[1].long_pairs == isa.native.get_gemm_long_pairs()
            assert again[1].long_gflops == pytest.approx(first[1].long_gflops)
        assert {c.how for c in tuning.ensure_gemm_tuned(["int8"], path=path, cache=tmp_path, enabled=False)} == {
            "untuned"}
    finally:
        isa.native.set_prefill_gemm("int8", before)
        isa.native.set_gemm_tiling(*tiling)
        isa.native.set_gemm_long_pairs(long_pairs)


@pytest.mark.parametrize("format", ["bf16", "int8", "fp8", "int4"])
@pytest.mark.parametrize("rows,in_features", [(1, 300), (4, 256), (2, 8200)], ids=["1x300-odd", "4x256", "2x8200"])
def test_brgemm_decode_matches_the_reference(kernel_path, format, rows, in_features):
    """1 to 4 rows with brgemm forced for decode: linear (with bias), linear_float and linear_silu_mul equal the
    reference, and (bf16) the unit's GEMV walk; K past one brgemm call (8200 > 2 * 1024 pairs) adds onto the partial
    result. Only 1 to 4 rows: prefill keeps its own choice, and fused_moe's experts keep the unit."""
    if kernel_path == "reference":
        pytest.skip("the reference path runs PyTorch's matmul; brgemm is a native path's choice")
    run, want, want_gated = _linear_ops(format, rows, in_features, 3 * 32 + 5, 2 * 32)
    with tuning.untuned(), tuning.forced_decode_gemm(format, "brgemm"):
        got, got_float, gated = run()
    assert _relative_error(got, want) < 1e-2 and _relative_error(got_float, want) < 1e-2
    assert _relative_error(gated, want_gated) < 1e-2
    if format != "bf16":  # brgemm multiplies the weights rounded to a bf16 panel: not the unit's products
        return
    with tuning.untuned():
        unit = run()[1]
    assert _relative_error(got_float, unit.float()) < 1e-3


def test_decode_gemm_choice_is_checked_and_defaults_to_the_unit():
    with pytest.raises(RuntimeError, match="unknown decode GEMM"):
        isa.native.set_decode_gemm("bf16", "default", 1)
    with pytest.raises(RuntimeError, match="unknown weight format"):
        isa.native.set_decode_gemm("int3", "unit", 0)
    with pytest.raises(RuntimeError, match="from 1 to 4 rows"):
        isa.native.set_decode_gemm("bf16", "brgemm", 5)
    with tuning.untuned():
        assert {tuple(isa.native.get_decode_gemm(f)) for f in weights.FORMATS} == {("unit", 0)}


def test_decode_gemm_runs_brgemm_from_its_row_count(kernel_path):
    """brgemm from 2 rows: 1 row is the unit's walk, bit for bit, and 2 and 4 rows are brgemm's (fp8, whose panel
    rounds each scaled weight to bf16 where the unit scales its sums: the two differ, so which ran shows)."""
    if kernel_path == "reference":
        pytest.skip("the reference path runs PyTorch's matmul; brgemm is a native path's choice")
    weight = _weight(64, 256, 5)
    packed = weights.pack_linear_weight(weight, "fp8")
    scales = weights.packed_scales(packed)
    xs = {rows: torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
          for rows in (1, 2, 4)}

    def run(gemm, from_rows=1):
        with tuning.untuned(), tuning.forced_decode_gemm("fp8", gemm, from_rows):
            return {rows: torch.ops.tilefx.linear_float(x, packed, None, 64, scales) for rows, x in xs.items()}

    unit, brgemm, from_two = run("unit"), run("brgemm"), run("brgemm", 2)
    assert not torch.equal(unit[2], brgemm[2])  # the two can be told apart
    assert torch.equal(from_two[1], unit[1])
    assert torch.equal(from_two[2], brgemm[2]) and torch.equal(from_two[4], brgemm[4])


@pytest.mark.parametrize("gbps,want", [
    ({1: (20.0, 25.0), 2: (18.0, 25.0), 4: (12.0, 25.0)}, 1),  # brgemm leads everywhere
    ({1: (25.0, 24.0), 2: (20.0, 24.0), 4: (12.0, 24.0)}, 2),  # the walk leads at one row only
    ({1: (25.0, 24.0), 2: (24.0, 24.5), 4: (12.0, 24.0)}, 4),  # within MIN_GAIN at 2 rows: the walk
    ({1: (20.0, 25.0), 2: (25.0, 24.0), 4: (12.0, 24.0)}, 4),  # a lead at 1 row alone does not count
    ({1: (35.0, 33.0), 2: (34.0, 33.0), 4: (34.0, 32.0)}, 0),  # the walk throughout (Zen 4)
])
def test_decode_gemm_choice_takes_brgemm_from_where_it_leads_onwards(gbps, want):
    assert tuning.choose_decode_gemm(gbps) == want


def test_decode_gemm_tuning_times_both_caches_and_reloads(tmp_path, monkeypatch):
    """bf16 only is timed (a quantized block reaches brgemm only through a bf16 copy), at 1, 2 and 4 rows; the
    walk tuning times the unit's walk even where brgemm was chosen for decode."""
    path = isa.current()
    if path == "reference" or not tuning.brgemm_has_kernel():
        pytest.skip("brgemm has no compiled kernel on this CPU: nothing is timed (the unit's walk stays)")
    monkeypatch.setattr(tuning, "MIN_PASS_BYTES", 8 << 20)
    monkeypatch.setattr(tuning, "MAX_PASS_BYTES", 8 << 20)
    monkeypatch.setattr(tuning, "ROUNDS", 1)
    monkeypatch.setattr(tuning, "CONFIRM_ROUNDS", 1)
    monkeypatch.setattr(tuning, "GEMM_SHAPES", ((96, 128),))
    monkeypatch.setattr(tuning, "GEMM_ROWS", (8,))
    monkeypatch.setattr(tuning, "GEMM_ROUNDS", 1)
    with tuning.untuned():
        first = tuning.ensure_gemm_tuned(["bf16", "int8"], path=path, cache=tmp_path)
        decode = [c for c in first if isinstance(c, tuning.DecodeGemmChoice)]
        assert [(c.format, c.how) for c in decode] == [("bf16", "tuned")]
        int8 = [c for c in first if type(c) is tuning.GemmChoice and c.format == "int8"]
        assert [c.x for c in int8] == [tuning.unit_gemm_x("int8", path)]
        assert sorted(decode[0].gbps) == [1, 2, 4] and all(u > 0 and b > 0 for u, b in decode[0].gbps.values())
        assert decode[0].from_rows == tuning.choose_decode_gemm(decode[0].gbps)
        assert tuple(isa.native.get_decode_gemm("bf16"))[1] == decode[0].from_rows
        assert tuple(isa.native.get_decode_gemm("int8")) == ("unit", 0)
        assert decode[0].line().startswith("decode GEMM bf16: ") and "4 row(s) unit walk" in decode[0].line()
        isa.native.set_decode_gemm("bf16", "unit", 0)
        again = tuning.ensure_gemm_tuned(["bf16"], path=path, cache=tmp_path)
        assert [(type(c).__name__, c.how) for c in again][:2] == [("DecodeGemmChoice", "cached"),
                                                                  ("GemmChoice", "cached")]
        assert again[0].gbps == decode[0].gbps and tuple(isa.native.get_decode_gemm("bf16"))[1] == decode[0].from_rows
        calls = []
        monkeypatch.setattr(tuning, "_time_pass", lambda *a: calls.append(isa.native.get_decode_gemm("bf16")) or 1.0)
        with tuning.forced_decode_gemm("bf16", "brgemm"):
            tuning.tune(tuning.decode_units(path)[0], "bf16", path)
        assert {tuple(c) for c in calls} == {("unit", 0)}


@pytest.mark.parametrize("format,path,decode,x", [
    ("int8", "avx2", "of up to 4 rows read x rounded to int16 per row", "int16 per row"),
    ("int8", "avx512_bf16", "of up to 4 rows read x rounded to int16 per row", "int8 per 32 inputs"),
    ("int4", "avx2", "of up to 4 rows read x as int16 words per row", "int16 per row"),
    ("int4", "avx512_bf16", "of up to 4 rows read x as int16 words per row", "int8 per 32 inputs"),
])
def test_activations_line_says_what_each_path_reads(format, path, decode, x):
    """explain()'s int8 and int4 lines: decode's form and word rows (csrc/kernels.h kGemvRows), and the unit
    GEMM's form; with TILEFX_INT8_ACTIVATIONS=bf16 the GEMM dequantizes."""
    import tilefx

    if path not in isa.supported():
        pytest.skip(f"this CPU does not run {path}")
    line_of = getattr(tilefx, f"_{format}_activations_line")
    with isa.forced(path), tuning.forced_gemm(format, "unit"):
        line = line_of()
        with isa.forced_int8_activations("bf16"):
            weight_only = line_of()
    assert decode in line and f"GEMMs read x as {x} " in line
    assert decode in weight_only and "dequantize the weights and read bf16" in weight_only


def test_int8_gemm_choice_says_how_its_unit_reads_x():
    unit = tuning.GemmChoice("int8", "unit", "cached", 500.0, 400.0, x="int16")
    assert unit.line() == "prefill GEMM int8: unit (x as int16 per row) (cached: unit 500 GFLOP/s, oneDNN brgemm 400)"
    brgemm = tuning.GemmChoice("int8", "brgemm", "tuned", 400.0, 500.0, 1.0, x="int8")
    assert "x as" not in brgemm.line()
    assert "x as" not in tuning.GemmChoice("bf16", "unit", "untuned").line()


@pytest.mark.parametrize("format", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("tokens,hidden_size,inter", [(40, 96, 96), (30, 130, 160)], ids=["40x96", "30x130-odd"])
def test_brgemm_experts_match_the_reference(kernel_path, format, tokens, hidden_size, inter):
    """fused_moe with brgemm forced: experts with more than 4 rows run it (where the unit reads bf16 pairs),
    those with fewer the unit; both projections, every format."""
    from tilefx.custom_ops.moe import experts_reference

    if kernel_path == "reference":
        pytest.skip("the reference path runs PyTorch's matmul; brgemm is a native path's choice")
    experts, g = 6, torch.Generator().manual_seed(tokens)
    gate_up = (torch.randn(experts, 2 * inter, hidden_size, generator=g) / hidden_size**0.5).to(torch.bfloat16)
    down = (torch.randn(experts, hidden_size, inter, generator=g) / inter**0.5).to(torch.bfloat16)
    w13 = weights.pack_expert_gate_up_weight(gate_up, format)
    w2 = weights.pack_expert_down_weight(down, format)
    scales = (weights.packed_scales(w13), weights.packed_scales(w2)) if format != "bf16" else (None, None)
    if format == "bf16":
        want_gate_up, want_down = gate_up, down
    else:  # gate and up quantized as the separate weights they are
        want_gate_up = torch.stack([torch.cat([dequantized(h, format) for h in e.chunk(2)]) for e in gate_up])
        want_down = torch.stack([dequantized(e, format) for e in down])
    x = torch.randn(tokens, hidden_size, generator=g).to(torch.bfloat16)
    # expert 5 gets one row (the unit runs it), the others many (brgemm)
    ids = torch.stack([torch.tensor([5, 4, 3])] + [torch.randperm(experts - 1, generator=g)[:3]
                                                   for _ in range(tokens - 1)]).to(torch.int32)
    topk_weights = torch.rand(tokens, 3, generator=g) + 0.1
    want = experts_reference(x, want_gate_up.to(torch.bfloat16), want_down.to(torch.bfloat16), topk_weights, ids)
    with tuning.forced_gemm(format, "brgemm"):
        got = torch.ops.tilefx.fused_moe(x, w13, w2, topk_weights, ids, w13_scales=scales[0], w2_scales=scales[1])
    assert _relative_error(got, want.float()) < 1e-2
