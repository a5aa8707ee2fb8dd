"""tilefx.mla_attention and tilefx.linear_per_head: vs an independent oracle (HF's unabsorbed MLA math), opcheck."""

from __future__ import annotations

import contextlib

import pytest
import torch

import tilefx.custom_ops  # noqa: F401
from tilefx.custom_ops import linear as linear_ops
from tilefx.custom_ops import isa, tuning
from tilefx.custom_ops import weights
from tilefx.custom_ops.attention import mla_attention_reference


def _mla_inputs(batch, heads, seq, past, rank=64, rope=32, max_batch=3, max_len=200, left_pad=(), seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    q_latent, q_rope = randn(batch, heads, seq, rank), randn(batch, heads, seq, rope)
    latent, k_rope = randn(batch, 1, seq, rank), randn(batch, 1, seq, rope)
    latent_cache, rope_cache = randn(max_batch, 1, max_len, rank), randn(max_batch, 1, max_len, rope)
    positions = torch.arange(past, past + seq)
    causal = torch.arange(max_len)[None, :] <= positions[:, None]
    padding = torch.ones(batch, max_len, dtype=torch.bool)
    for row, pad in enumerate(left_pad):
        padding[row, :pad] = False
    mask = (causal[None] & padding[:, None, :])[:, None]
    return q_latent, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask


def _unabsorbed_oracle(batch, heads, seq, past, left_pad, nope=48, v_dim=40, seed=0):
    """HF's MLA: expand the latent cache through kv_b_proj to per-head K/V, then SDPA; and the
    absorbed inputs (q_latent = q_nope @ W_uk) the op gets for the same computation."""
    args = list(_mla_inputs(batch, heads, seq, past, left_pad=left_pad, seed=seed))
    q_latent, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask = args
    rank = latent.shape[-1]
    g = torch.Generator().manual_seed(seed + 1)
    kv_b = (torch.randn(heads * (nope + v_dim), rank, generator=g) / rank**0.5).to(torch.bfloat16)
    q_nope = torch.randn(batch, heads, seq, nope, generator=g).to(torch.bfloat16)
    w = kv_b.float().view(heads, nope + v_dim, rank)
    latents = latent_cache[:batch].clone().float()
    ropes = rope_cache[:batch].clone().float()
    latents[:, :, positions], ropes[:, :, positions] = latent.float(), k_rope.float()
    keys = torch.cat([torch.einsum("bltr,hdr->bhtd", latents, w[:, :nope]),
                      ropes.expand(batch, heads, -1, -1)], dim=-1)
    values = torch.einsum("bltr,hdr->bhtd", latents, w[:, nope:])
    query = torch.cat([q_nope.float(), q_rope.float()], dim=-1)
    want = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask[:batch], scale=0.1)
    args[0] = torch.matmul(q_nope.float(), w[:, :nope]).to(torch.bfloat16)  # absorbed query
    return args, kv_b, nope, v_dim, want.nan_to_num(0.0), q_nope


CASES = [
    # batch, heads, seq, past, left_pad
    (1, 16, 1, 0, ()),  # one token, empty cache
    (1, 16, 1, 150, ()),  # decode over a long prefix: keys split across threads
    (2, 5, 1, 30, (0, 7)),  # decode, batch > 1, padded row, heads not a multiple of the head tile
    (1, 4, 9, 0, ()),  # prefill, odd length
    (3, 6, 7, 11, (0, 3, 17)),  # extend onto a prefix; one row sees no key at first
    (2, 80, 30, 140, (0, 9)),  # more heads than the brgemm kernel's query tile, over two key blocks
]


def _forced_mla(kernel):
    """Prefill forced onto PyTorch's SDPA or the flash attention on brgemm tiles (``brgemm@RxK``: blocked R query
    rows x K keys), or decode (up to kDecodeAttentionRows rows: every case but the 80-head one) onto flash decoding
    on brgemm tiles ("tiles")."""
    if kernel == "tiles":
        return tuning.forced_decode_attention("mla", "brgemm")
    if kernel == "unit":
        return contextlib.nullcontext()
    kernel, _, tiling = kernel.partition("@")
    return tuning.forced_prefill("mla", kernel, tuple(map(int, tiling.split("x"))) if tiling else None)


# brgemm in its default blocking and the largest one tuning may choose
BRGEMM_LARGE = "brgemm@{}x{}".format(*tuning.ATTENTION_TILINGS[-1])


@pytest.mark.parametrize("kernel", ["unit", "sdpa", "brgemm", BRGEMM_LARGE, "tiles"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}h{c[1]}s{c[2]}p{c[3]}")
def test_absorbed_mla_equals_unabsorbed(kernel_path, case, kernel):
    """``kernel``: the choices tuning may make (_forced_mla)."""
    batch, heads, seq, past, pad = case
    if kernel != "unit" and (kernel_path == "reference" or (seq == 1 and kernel != "tiles")):
        pytest.skip("the prefill kernel is a native path's choice")
    args, kv_b, nope, v_dim, want, _ = _unabsorbed_oracle(batch, heads, seq, past, pad)
    latent_cache, rope_cache, positions = args[4], args[5], args[6]
    untouched = latent_cache[batch:].clone(), latent_cache[:, :, past + seq:].clone()
    with _forced_mla(kernel):
        o_latent = torch.ops.tilefx.mla_attention(*args, 0.1)
    assert o_latent.shape == args[0].shape and o_latent.is_contiguous()
    w_uv = weights.pack_mla_absorbed_weight(kv_b, heads, nope, True)
    got = linear_ops.linear_per_head(o_latent, w_uv, v_dim)
    rows = args[7][:, 0].any(-1).unsqueeze(1).expand(batch, heads, seq)  # rows that see a key
    err = (got.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
    assert err[rows].max() < 1e-2
    assert torch.all(got[~rows] == 0)
    # the new latent and rope key were written in place; nothing else changed
    assert torch.equal(latent_cache[:batch, :, positions], args[2])
    assert torch.equal(rope_cache[:batch, :, positions], args[3])
    assert torch.equal(latent_cache[batch:], untouched[0])
    assert torch.equal(latent_cache[:, :, past + seq:], untouched[1])


def test_decode_tiles_take_at_most_their_rows(kernel_path):
    """Forced onto brgemm tiles, decode runs there up to kDecodeAttentionRows query rows (16 heads: the result
    differs from the unit's in its roundings) and on the unit past them (80 heads: the unit's result bit for bit)."""
    if kernel_path == "reference":
        pytest.skip("the decode kernel is a native path's choice")
    for heads, tiled in ((16, True), (80, False)):
        args = _mla_inputs(1, heads, 1, 150)
        unit = torch.ops.tilefx.mla_attention(*args, 0.1)
        with _forced_mla("tiles"):
            got = torch.ops.tilefx.mla_attention(*args, 0.1)
        assert torch.equal(got, unit) != tiled, heads
        assert ((got.float() - unit.float()).norm() / unit.float().norm()).item() < 1e-2


PREFILL_CASES = [
    # batch, heads, seq, past, left_pad
    (1, 4, 9, 0, ()),  # a prompt: expanded where the brgemm kernel runs MLA prefill
    (2, 6, 20, 0, (0, 5)),  # a padded prompt
    (3, 6, 7, 11, (0, 3, 17)),  # extend onto a prefix; one row sees no key at first
    (1, 20, 3, 150, ()),  # a few tokens over a long prefix: absorbed (expanding 153 keys costs more)
]


def _mla_prefill_call(case, nope=32, v_dim=32):
    """``(call, want, args, kv_b, w_uk, w_uv)``: tilefx.mla_prefill on the oracle's inputs (the query's nope part,
    kv_b_proj and its absorbed packs); ``call(w_uk, w_uv, kv_b)`` runs it with the given weights."""
    batch, heads, seq, past, pad = case
    args, kv_b, nope, v_dim, want, q_nope = _unabsorbed_oracle(batch, heads, seq, past, pad, nope=nope, v_dim=v_dim)
    w_uk = weights.pack_mla_absorbed_weight(kv_b, heads, nope, False)
    w_uv = weights.pack_mla_absorbed_weight(kv_b, heads, nope, True)

    def call(w_uk=w_uk, w_uv=w_uv, kv_b=kv_b):
        return torch.ops.tilefx.mla_prefill(q_nope, *args[1:8], 0.1, w_uk, w_uv, kv_b)

    return call, want, args, kv_b, w_uk, w_uv


@pytest.mark.parametrize("kernel", ["unit", "brgemm", BRGEMM_LARGE])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"b{c[0]}h{c[1]}s{c[2]}p{c[3]}")
def test_mla_prefill_equals_unabsorbed(kernel_path, case, kernel):
    """The prefill graphs' op, absorbed (the unit) or expanded / absorbed by the multiply-adds (brgemm), equals HF's
    unabsorbed math; the new latent and rope key are written in place."""
    if kernel != "unit" and kernel_path == "reference":
        pytest.skip("the prefill kernel is a native path's choice")
    batch, heads, seq, past, _ = case
    call, want, args, _, _, _ = _mla_prefill_call(case)
    with _forced_mla(kernel):
        got = call()
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    rows = args[7][:, 0].any(-1).unsqueeze(1).expand(batch, heads, seq)
    err = (got.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
    assert err[rows].max() < 1e-2
    assert torch.all(got[~rows] == 0)
    assert torch.equal(args[4][:batch, :, args[6]], args[2]) and torch.equal(args[5][:batch, :, args[6]], args[3])


def test_mla_prefill_expands_a_prompt_and_absorbs_a_short_extend(kernel_path):
    """Which form ran, seen by what it reads: a prompt on the brgemm kernel reads kv_b_proj and not the absorbed
    packs (NaN there changes nothing); a few tokens over a long prefix read the packs and not kv_b_proj."""
    if kernel_path == "reference":
        pytest.skip("the forms are the native kernel's")
    with tuning.forced_attention("mla", "brgemm"):
        for case, expanded in ((PREFILL_CASES[0], True), (PREFILL_CASES[3], False)):
            call, want, args, kv_b, w_uk, w_uv = _mla_prefill_call(case)
            nan = float("nan")
            if expanded:
                got = call(w_uk=torch.full_like(w_uk, nan), w_uv=torch.full_like(w_uv, nan))
            else:
                got = call(kv_b=torch.full_like(kv_b, nan))
            err = (got.float() - want).norm() / want.norm()
            assert err < 1e-2, (case, expanded)


@pytest.mark.parametrize("budget", ["one head", "three heads", "none"])
def test_mla_prefill_expands_heads_in_chunks_within_its_budget(kernel_path, budget):
    """The expanded form runs over chunks of heads whose K/V fit the budget (1 or 3 of 20 heads here: the last
    chunk partial); with no head fitting, the absorbed form. Every way equals HF's math."""
    if kernel_path == "reference":
        pytest.skip("the forms are the native kernel's")
    case = (2, 20, 24, 0, (0, 5))
    call, want, args, kv_b, w_uk, w_uv = _mla_prefill_call(case)
    head_bytes = 2 * 2 * 2 * (24 + 128) * (32 + 32 + 32)  # batch 2, end 24, nope / rope / v 32
    bytes_ = {"one head": head_bytes, "three heads": 3 * head_bytes + 1, "none": head_bytes - 1}[budget]
    before = isa.native.get_mla_expand_budget()
    isa.native.set_mla_expand_budget(bytes_)
    try:
        with tuning.forced_attention("mla", "brgemm"):
            nan = float("nan")
            if budget == "none":  # absorbed: kv_b_proj is not read
                got = call(kv_b=torch.full_like(kv_b, nan))
            else:  # expanded: the packs are not read
                got = call(w_uk=torch.full_like(w_uk, nan), w_uv=torch.full_like(w_uv, nan))
    finally:
        isa.native.set_mla_expand_budget(before)
    rows = args[7][:, 0].any(-1).unsqueeze(1).expand(2, 20, 24)
    err = (got.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
    assert err[rows].max() < 1e-2 and torch.all(got[~rows] == 0)
    with pytest.raises(RuntimeError, match="byte count"):
        isa.native.set_mla_expand_budget(-1)


def test_mla_prefill_checks_kv_b_proj(kernel_path):
    call, _, _, kv_b, _, _ = _mla_prefill_call(PREFILL_CASES[0])
    with pytest.raises(RuntimeError, match="does not split into"):
        call(kv_b=kv_b[:-3])


def test_mla_prefill_opcheck(kernel_path):
    batch, heads, seq, past, pad = PREFILL_CASES[1]
    args, kv_b, nope, _, _, q_nope = _unabsorbed_oracle(batch, heads, seq, past, pad, nope=32, v_dim=32)
    packs = [weights.pack_mla_absorbed_weight(kv_b, heads, nope, value) for value in (False, True)]
    torch.library.opcheck(torch.ops.tilefx.mla_prefill.default, (q_nope, *args[1:8], 0.1, *packs, kv_b))


@pytest.mark.parametrize("case", CASES[:3] + CASES[4:], ids=lambda c: f"b{c[0]}h{c[1]}s{c[2]}p{c[3]}")
def test_native_matches_reference(kernel_path, case):
    batch, heads, seq, past, pad = case
    args = _mla_inputs(batch, heads, seq, past, left_pad=pad, seed=5)
    want = mla_attention_reference(*[a.clone() for a in args], 0.15)
    got = torch.ops.tilefx.mla_attention(*args, 0.15)
    rows = args[7][:, 0].any(-1).unsqueeze(1).expand(batch, heads, seq)
    err = (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1).clamp_min(1e-6)
    assert err[rows].max() < 1e-2


def test_native_matches_reference_at_deepseek_widths(kernel_path):
    """Decode at DeepSeek's latent and rope widths (512 + 64: the width the AVX512 unit's scores are compiled
    for), 16 heads, keys over several blocks split across threads, a padded row."""
    args = _mla_inputs(2, 16, 1, 150, rank=512, rope=64, left_pad=(0, 11), seed=6)
    want = mla_attention_reference(*[a.clone() for a in args], 0.05)
    got = torch.ops.tilefx.mla_attention(*args, 0.05)
    err = (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1).clamp_min(1e-6)
    assert err.max() < 1e-2


def test_mla_reads_only_valid_prefix(kernel_path):
    args = list(_mla_inputs(1, 8, 1, 20))
    before = torch.ops.tilefx.mla_attention(*[a.clone() for a in args], 0.2)
    args[4][:, :, 21:] = float("nan")
    args[5][:, :, 21:] = float("nan")
    assert torch.equal(before, torch.ops.tilefx.mla_attention(*args, 0.2))


def test_mla_opcheck(kernel_path):
    torch.library.opcheck(torch.ops.tilefx.mla_attention.default, (*_mla_inputs(2, 4, 3, 5, left_pad=(0, 2)), 0.2))


def test_mla_rejects_mismatched_shapes(kernel_path):
    args = list(_mla_inputs(1, 4, 1, 3))
    args[3] = args[3][..., :16]  # rope key narrower than the rope query
    with pytest.raises(RuntimeError, match="rope key|k_rope"):
        torch.ops.tilefx.mla_attention(*args, 0.2)


@pytest.mark.parametrize("value", [False, True], ids=["key_half", "value_half"])
@pytest.mark.parametrize("shape", [(1, 4, 1), (2, 4, 5), (4, 3)], ids=["decode", "batch2_prefill", "no_batch_dim"])
def test_linear_per_head(kernel_path, value, shape):
    heads, nope, v_dim, rank = 4, 48, 40, 64
    g = torch.Generator().manual_seed(7)
    kv_b = torch.randn(heads * (nope + v_dim), rank, generator=g).to(torch.bfloat16)
    per_head = kv_b.view(heads, nope + v_dim, rank)
    weight = per_head[:, nope:] if value else per_head[:, :nope].transpose(1, 2)  # [H, N, K]
    packed = weights.pack_mla_absorbed_weight(kv_b, heads, nope, value)
    assert torch.equal(weights.unpack_expert_down_weight(packed, *weight.shape[1:]), weight)
    x = torch.randn(*shape, weight.shape[2], generator=g).to(torch.bfloat16)
    want = torch.matmul(x.float(), weight.float().transpose(1, 2))
    got = linear_ops.linear_per_head(x, packed, weight.shape[1])
    assert got.shape == (*shape, weight.shape[1]) and got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


def test_linear_per_head_strided_rows_and_opcheck(kernel_path):
    kv_b = torch.randn(4 * 96, 64).to(torch.bfloat16)
    packed = weights.pack_mla_absorbed_weight(kv_b, 4, 64, False)
    x = torch.randn(2, 5, 4, 80).to(torch.bfloat16).transpose(1, 2)[..., :64]  # HF's q_nope: a strided view
    want = torch.matmul(x.float(), kv_b.float().view(4, 96, 64)[:, :64])
    got = linear_ops.linear_per_head(x, packed, 64)
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
    torch.library.opcheck(torch.ops.tilefx.linear_per_head.default, (x.contiguous(), packed, 64))


def test_pack_mla_absorbed_weight_is_memoized_and_checked():
    kv_b = torch.randn(4 * 96, 64).to(torch.bfloat16)
    assert weights.pack_mla_absorbed_weight(kv_b, 4, 64, True) is weights.pack_mla_absorbed_weight(kv_b, 4, 64, True)
    with pytest.raises(RuntimeError, match="does not split"):
        weights.pack_mla_absorbed_weight(kv_b, 5, 64, True)
