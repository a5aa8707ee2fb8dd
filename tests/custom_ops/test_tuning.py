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


@pytest.mark.parametrize("format", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("candidate", tuning.CANDIDATES, ids=[f"s{s}-p{p}" for s, p in tuning.CANDIDATES])
def test_every_candidate_walk_matches_the_reference(kernel_path, format, candidate):
    """Plain and gate/up GEMVs (1 and 2 rows; an odd block count: two streams plus one) under each forced walk."""
    units = tuning.decode_units(kernel_path)
    if not units:
        pytest.skip("the reference path has no native walk")
    out_features, in_features = 7 * 32, 300
    weight, up = _weight(out_features, in_features, 1), _weight(out_features, in_features, 2)
    packed = weights.pack_linear_weight(weight, format)
    gate_up = weights.pack_gate_up_weight(weight, up, format)
    scales = weights.packed_scales(packed) if format != "bf16" else None
    gate_up_scales = weights.packed_scales(gate_up) if format != "bf16" else None
    w, u = (dequantized(t, format) if format != "bf16" else t.float() for t in (weight, up))
    for rows in (1, 2):
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        with tuning.forced(units[0], format, *candidate):
            got = linear_ops.linear(x, packed, None, out_features, scales)
            gated = linear_ops.linear_silu_mul(x, gate_up, out_features, gate_up_scales)
        assert _relative_error(got, x.float() @ w.T) < 1e-2
        want_gated = torch.nn.functional.silu(x.float() @ w.T) * (x.float() @ u.T)
        assert _relative_error(gated, want_gated) < 1e-2


@pytest.mark.parametrize("candidate", [(1, 0), (2, 4096)], ids=["one-stream", "two-streams"])
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


def test_the_native_table_refuses_what_the_kernels_do_not_take():
    unit = tuning.decode_units(isa.current())[0] if tuning.decode_units(isa.current()) else "avx2"
    for streams, prefetch in ((3, 1024), (1, 100), (2, -64), (2, 1 << 20)):
        with pytest.raises(RuntimeError, match="tilefx tuning"):
            isa.native.set_walk_tuning(unit, "bf16", streams, prefetch)
    with pytest.raises(RuntimeError, match="unknown weight format"):
        isa.native.set_walk_tuning(unit, "int3", 1, 0)


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
        assert (first[0].streams, first[0].prefetch_bytes) in tuning.candidates(unit, "int8")
        assert tuning.current(unit, "int8") == (first[0].streams, first[0].prefetch_bytes)
        saved = json.loads((tmp_path / "tuning.json").read_text())
        assert len(saved) == len(first) and all(unit in key for key in saved)
        isa.native.set_walk_tuning(unit, "int8", *before)
        again = tuning.ensure_tuned(["int8"], path=path, cache=tmp_path)
        assert [t.how for t in again] == ["cached"] * len(again)
        assert tuning.current(unit, "int8") == (first[0].streams, first[0].prefetch_bytes)
        assert "cached" in again[0].line()
        off = tuning.ensure_tuned(["int8"], path=path, cache=tmp_path, enabled=False)
        assert [t.how for t in off] == ["untuned"] * len(off)
    finally:
        isa.native.set_walk_tuning(unit, "int8", *before)


@pytest.mark.parametrize("shape", [tuning.AttentionShape("extend", 4, 2, 32), tuning.AttentionShape("mla", 4, 1, 64, 32)],
                         ids=["extend", "mla"])
def test_attention_tuning_times_both_routes_caches_and_reloads(tmp_path, monkeypatch, shape):
    """Short prompts, one round: the unit and SDPA are both timed at every length, the threshold is one of
    the length classes' (or 0), set in the native table, saved, and read back by the next call."""
    path = isa.current()
    if not tuning.decode_units(path):
        pytest.skip("the reference path has no native attention")
    monkeypatch.setattr(tuning, "ATTENTION_LENGTHS", ((8, 2), (32, 24)))
    monkeypatch.setattr(tuning, "ATTENTION_ROUNDS", 1)
    before = isa.native.get_sdpa_from_tokens(shape.family)
    try:
        first = tuning.ensure_attention_tuned(shape, path=path, cache=tmp_path)
        assert first.how == "tuned" and len(first.unit_ms) == len(first.sdpa_ms) == 2
        assert all(t > 0 for t in first.unit_ms + first.sdpa_ms)
        assert first.sdpa_from in (0, 2, 24)
        assert isa.native.get_sdpa_from_tokens(shape.family) == first.sdpa_from
        isa.native.set_sdpa_from_tokens(shape.family, 0 if first.sdpa_from else 2)
        again = tuning.ensure_attention_tuned(shape, path=path, cache=tmp_path)
        assert again.how == "cached" and again.sdpa_from == first.sdpa_from
        assert isa.native.get_sdpa_from_tokens(shape.family) == first.sdpa_from
        assert "prefill attention" in again.line() and "cached" in again.line()
        assert tuning.ensure_attention_tuned(shape, path=path, cache=tmp_path, enabled=False).how == "untuned"
        assert tuning.ensure_attention_tuned(None, path=path, cache=tmp_path) is None
    finally:
        isa.native.set_sdpa_from_tokens(shape.family, before)


def test_attention_threshold_is_the_first_class_sdpa_leads_from(monkeypatch):
    """SDPA takes prompts from the first length class where it is faster and stays faster at every longer one."""
    path = isa.current()
    if not tuning.decode_units(path):
        pytest.skip("the reference path has no native attention")
    monkeypatch.setattr(tuning, "ATTENTION_LENGTHS", ((8, 2), (16, 12), (32, 24)))
    monkeypatch.setattr(tuning, "ATTENTION_ROUNDS", 1)
    shape = tuning.AttentionShape("extend", 2, 1, 16)
    before = isa.native.get_sdpa_from_tokens("extend")
    clock = [0.0]  # perf_counter, advanced by the fake calls: each "takes" its row's ms
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    for unit_ms, sdpa_ms, want in (((1, 1, 1), (2, 2, 2), 0), ((2, 2, 2), (1, 1, 1), 2),
                                   ((1, 2, 2), (2, 1, 1), 12), ((2, 1, 2), (1, 2, 1), 24)):

        def fake_call(shape_, seq, unit_ms=unit_ms, sdpa_ms=sdpa_ms):
            index = [n for n, _ in tuning.ATTENTION_LENGTHS].index(seq)

            def call():
                sdpa = isa.native.get_sdpa_from_tokens("extend") != 0
                clock[0] += (sdpa_ms if sdpa else unit_ms)[index]

            return call

        monkeypatch.setattr(tuning, "_prefill_call", fake_call)
        try:
            assert tuning.tune_attention(shape, path).sdpa_from == want
        finally:
            isa.native.set_sdpa_from_tokens("extend", before)
