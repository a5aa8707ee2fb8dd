"""tilefx attention ops: reference vs an independent oracle (torch SDPA over repeated K/V), opcheck."""

from __future__ import annotations

import pytest
import torch

import contextlib

import tilefx.custom_ops  # noqa: F401
from tilefx.custom_ops import isa, tuning
from tilefx.custom_ops.attention import attention_reference


def _op(op_name, kernel_path):
    """``(op, context)``: ``extend_attention_sdpa`` / ``_brgemm`` are extend_attention with prefill forced onto
    PyTorch's SDPA / the flash attention on brgemm tiles, ``*_tiles`` the op with decode forced onto flash decoding
    on brgemm tiles (the choices tuning may make; csrc/tuning.h), on every native path."""
    if op_name == "reference":
        return attention_reference, contextlib.nullcontext()
    if op_name.endswith("_tiles"):  # decode (up to kDecodeAttentionRows rows per KV head) as flash decoding on brgemm
        if kernel_path == "reference":
            pytest.skip("the reference path runs SDPA already; the choice is the native kernels'")
        return getattr(torch.ops.tilefx, op_name.removesuffix("_tiles")), tuning.forced_decode_attention("extend",
                                                                                                         "brgemm")
    if op_name.startswith("extend_attention_"):  # extend_attention_brgemm@RxK: brgemm blocked R query rows x K keys
        if kernel_path == "reference":
            pytest.skip("the reference path runs SDPA already; the choice is the native kernels'")
        kernel, _, tiling = op_name.rsplit("_", 1)[1].partition("@")
        tiling = tuple(map(int, tiling.split("x"))) if tiling else None
        return torch.ops.tilefx.extend_attention, tuning.forced_prefill("extend", kernel, tiling)
    return getattr(torch.ops.tilefx, op_name), contextlib.nullcontext()


# brgemm in its default blocking and in each other one tuning may choose
PREFILL_OPS = ("extend_attention", "extend_attention_sdpa", "extend_attention_brgemm",
               *(f"extend_attention_brgemm@{rows}x{keys}" for rows, keys in tuning.ATTENTION_TILINGS[1:]),
               "extend_attention_tiles")
DECODE_OPS = ("decode_attention", "decode_attention_tiles")


def _inputs(batch, q_heads, kv_heads, seq, past, head_dim=32, max_batch=3, max_len=320, left_pad=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    bf = dict(dtype=torch.bfloat16)
    q = torch.randn(batch, q_heads, seq, head_dim, generator=g).to(**bf)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g).to(**bf)
    v = torch.randn(batch, kv_heads, seq, head_dim, generator=g).to(**bf)
    k_cache = torch.randn(max_batch, kv_heads, max_len, head_dim, generator=g).to(**bf)
    v_cache = torch.randn(max_batch, kv_heads, max_len, head_dim, generator=g).to(**bf)
    positions = torch.arange(past, past + seq)
    key_pos = torch.arange(max_len)
    causal = key_pos[None, :] <= positions[:, None]  # [S, L]
    padding = torch.ones(batch, max_len, dtype=torch.bool)
    for row, pad in enumerate(left_pad):
        padding[row, :pad] = False
    mask = (causal[None] & padding[:, None, :])[:, None]  # [B, 1, S, L]
    return q, k, v, k_cache, v_cache, positions, mask


def _oracle(q, k, v, k_cache, v_cache, positions, mask, scale):
    batch, q_heads = q.shape[:2]
    keys, values = k_cache[:batch].clone(), v_cache[:batch].clone()
    keys[:, :, positions] = k
    values[:, :, positions] = v
    rep = q_heads // k.shape[1]
    keys, values = keys.repeat_interleave(rep, 1).float(), values.repeat_interleave(rep, 1).float()
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), keys, values, attn_mask=mask[:batch], scale=scale)
    return out.nan_to_num(0.0), keys, values


CASES = [
    # batch, q_heads, kv_heads, seq, past, left_pad
    (1, 4, 4, 1, 0, ()),  # one token, empty cache
    (1, 8, 2, 1, 20, ()),  # decode, GQA
    (2, 8, 2, 1, 13, (0, 5)),  # decode, batch > 1, padded row
    (1, 4, 1, 7, 0, ()),  # prefill, odd length, MQA
    (2, 6, 3, 9, 11, (3, 0)),  # extend onto a prefix, padded
    (3, 4, 2, 17, 0, (0, 4, 16)),  # prefill, one query row fully padded
    (1, 12, 2, 1, 300, ()),  # decode over a long prefix: the keys are split across threads
    (2, 5, 1, 3, 150, (0, 40)),  # group not a multiple of the kernel's head tile
    (1, 8, 8, 1, 300, ()),  # decode, one task per KV head walks several key blocks (online softmax across them)
    (2, 4, 4, 5, 279, (0, 141)),  # extend over several key blocks, padded
    (1, 2, 1, 150, 20, ()),  # a long prompt onto a prefix: several query tiles and key blocks of the brgemm kernel
    (1, 2, 1, 280, 0, ()),  # a prompt past 256 keys: a larger blocking's last step holds fewer keys than its others
]


@pytest.mark.parametrize(
    "op_name,case",
    [(op, c) for op in (*PREFILL_OPS, *DECODE_OPS, "reference") for c in CASES
     if op not in DECODE_OPS or c[3] == 1],  # decode takes one token
    ids=lambda x: x if isinstance(x, str) else f"b{x[0]}h{x[1]}/{x[2]}s{x[3]}p{x[4]}",
)
def test_matches_oracle(kernel_path, op_name, case):
    batch, q_heads, kv_heads, seq, past, pad = case
    q, k, v, k_cache, v_cache, positions, mask = _inputs(batch, q_heads, kv_heads, seq, past, left_pad=pad)
    want, keys, _ = _oracle(q, k, v, k_cache, v_cache, positions, mask, 0.2)
    untouched = k_cache[batch:].clone(), k_cache[:, :, past + seq :].clone()
    op, context = _op(op_name, kernel_path)
    with context:
        got = op(q, k, v, k_cache, v_cache, positions, mask, 0.2)
    assert got.shape == q.shape and got.dtype == q.dtype and got.is_contiguous()
    rows = mask[:, 0].any(-1)  # query rows with at least one visible key
    err = (got.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
    assert err[rows.unsqueeze(1).expand_as(err)].max() < 1e-2
    assert torch.all(got.float()[~rows.unsqueeze(1).expand_as(err)] == 0)
    # the new tokens were written in place; nothing else changed
    torch.testing.assert_close(k_cache[:batch, :, positions], k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache[:batch, :, positions], v, rtol=0, atol=0)
    assert torch.equal(k_cache[batch:], untouched[0])
    assert torch.equal(k_cache[:, :, past + seq :], untouched[1])


@pytest.mark.parametrize("op_name", [*DECODE_OPS, "reference"])
def test_reads_only_valid_prefix(kernel_path, op_name):
    op, context = _op(op_name, kernel_path)
    q, k, v, k_cache, v_cache, positions, mask = _inputs(1, 4, 2, 1, 10)
    with context:
        before = op(q, k, v, k_cache.clone(), v_cache.clone(), positions, mask, 0.3)
        k_cache[:, :, 11:] = float("nan")  # the padded tail: never read
        v_cache[:, :, 11:] = float("nan")
        after = op(q, k, v, k_cache, v_cache, positions, mask, 0.3)
    assert torch.equal(before, after)


@pytest.mark.parametrize("op_name", [*PREFILL_OPS, *DECODE_OPS, "reference"])
def test_mask_with_holes(kernel_path, op_name):
    """Keys masked in the middle of the range (every block has some) weigh nothing; the native kernels do not
    even read them as numbers (NaN rows there: the unit skips them, the brgemm kernels pack their values as zeros
    and mask their scores), the reference multiplies them by zero weights."""
    q, k, v, k_cache, v_cache, positions, mask = _inputs(2, 8, 4, 1, 290, seed=1)
    holes = torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)) < 0.3
    holes[..., 290] = False  # the new token stays visible
    mask = mask & ~holes
    want, _, _ = _oracle(q, k, v, k_cache, v_cache, positions, mask, 0.2)
    op, context = _op(op_name, kernel_path)
    if op_name not in ("extend_attention_sdpa", "reference") and kernel_path != "reference":
        hidden = ~mask[:, 0, 0, :290].unsqueeze(1).expand(-1, 4, -1)
        k_cache[:2, :, :290][hidden] = float("nan")
        v_cache[:2, :, :290][hidden] = float("nan")
    with context:
        got = op(q, k, v, k_cache, v_cache, positions, mask, 0.2)
    err = (got.float() - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.max() < 1e-2


@pytest.mark.parametrize("op_name", [op for op in PREFILL_OPS if "brgemm" in op])
@pytest.mark.parametrize("hole", [False, True], ids=["unbroken", "one-hole"])
def test_brgemm_blocks_every_row_sees_whole(kernel_path, op_name, hole):
    """A mask that lets every row see every valid key (a bidirectional prompt over a prefix; 155 keys, so the last
    block holds 27) after each row's left padding: the flash attention on brgemm tiles hands the softmax such blocks
    with no mask to read, the last one's length not a multiple of a vector; with one hole in one row, that row's
    tile reads its mask again. Either way, the oracle's result."""
    q, k, v, k_cache, v_cache, positions, mask = _inputs(2, 8, 2, 5, 150, left_pad=(0, 21), seed=5)
    mask = mask.clone()
    mask[0, 0, :, :155] = True
    mask[1, 0, :, 21:155] = True
    if hole:
        mask[1, 0, 2, 140] = False
    want, _, _ = _oracle(q, k, v, k_cache, v_cache, positions, mask, 0.2)
    op, context = _op(op_name, kernel_path)
    with context:
        got = op(q, k, v, k_cache, v_cache, positions, mask, 0.2)
    assert ((got.float() - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-2


@pytest.mark.parametrize("op_name", ["extend_attention", "decode_attention"])
def test_opcheck(kernel_path, op_name):
    seq = 1 if op_name == "decode_attention" else 5
    args = _inputs(2, 4, 2, seq, 3, left_pad=(0, 1))
    torch.library.opcheck(getattr(torch.ops.tilefx, op_name).default, (*args, 0.25))


@pytest.mark.parametrize("kernel", ["sdpa", "brgemm"])
@pytest.mark.parametrize("past", [0, 6], ids=["prompt", "extend"])
def test_prefill_kernel_from_its_threshold(kernel_path, past, kernel):
    """Below the threshold the unit runs, from it SDPA (plain causal from position 0: is_causal; onto a prefix:
    the mask) or the brgemm kernel; all equal the oracle, so the choice tuning makes changes no result."""
    if kernel_path == "reference":
        pytest.skip("the reference path runs SDPA already; the choice is the native kernels'")
    for seq in (3, 8):
        q, k, v, k_cache, v_cache, positions, mask = _inputs(1, 8, 2, seq, past, seed=seq)
        want, _, _ = _oracle(q, k, v, k_cache, v_cache, positions, mask, 0.2)
        with tuning.forced_attention("extend", kernel, 5):
            got = torch.ops.tilefx.extend_attention(q, k, v, k_cache, v_cache, positions, mask, 0.2)
            assert isa.native.get_prefill_attention("extend") == (kernel, 5)
        assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("op_name", ["extend_attention_brgemm", "extend_attention_tiles"])
def test_brgemm_kernels_take_head_dims_past_their_vector_steps(kernel_path, op_name):
    """Heads of 48 (24 bf16 pairs: the packing's 16-pair transpose, then 8 more; the values' interleave 32 columns,
    then 16) attend as the oracle does."""
    q, k, v, k_cache, v_cache, positions, mask = _inputs(2, 4, 2, 3, 150, head_dim=48, left_pad=(0, 7), seed=3)
    want, _, _ = _oracle(q, k, v, k_cache, v_cache, positions, mask, 0.2)
    op, context = _op(op_name, kernel_path)
    with context:
        got = op(q, k, v, k_cache, v_cache, positions, mask, 0.2)
    assert ((got.float() - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-2


@pytest.mark.parametrize("head_dim", [16, 48, 80, 144])
@pytest.mark.parametrize("seq", [1, 3], ids=["decode", "prompt"])
def test_unit_takes_head_dims_past_its_vector_steps(kernel_path, seq, head_dim):
    """The attention unit over heads that are not a multiple of its steps (the AVX512 unit: scores 32 values a
    product, then 16; values 64 a pass, in 32-value chunks, then 16), a group padded to its head tile (3 of 4)
    and an odd number of keys (its key pairs and tiles of 4), decode and a short prompt, padded batch rows."""
    q, k, v, k_cache, v_cache, positions, mask = _inputs(2, 6, 2, seq, 147, head_dim=head_dim, left_pad=(0, 9),
                                                         seed=head_dim)
    want, _, _ = _oracle(q, k, v, k_cache, v_cache, positions, mask, 0.15)
    op = torch.ops.tilefx.decode_attention if seq == 1 else torch.ops.tilefx.extend_attention
    context = tuning.forced_attention("extend", "unit", 2) if kernel_path != "reference" else contextlib.nullcontext()
    with context:
        got = op(q, k, v, k_cache, v_cache, positions, mask, 0.15)
    assert ((got.float() - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-2


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [4, 8])
@pytest.mark.parametrize("holes", [False, True], ids=["dense", "holes"])
def test_unit_fixed_width_heads(kernel_path, head_dim, group, holes):
    """Decode on the unit at the head widths its AVX512 scores are compiled for (whole tiles of unmasked keys at a
    fixed width, the rest key by key): one and two head tiles, keys over several blocks split across threads with
    a last partial tile, a left-padded row, and (holes) masked keys inside a row's run, whose tasks take the
    key-by-key path."""
    q, k, v, k_cache, v_cache, positions, mask = _inputs(2, 2 * group, 2, 1, 300, head_dim=head_dim,
                                                         left_pad=(0, 9), seed=head_dim + group)
    if holes:
        mask[1, 0, 0, 100:180:7] = False
    want, _, _ = _oracle(q, k, v, k_cache, v_cache, positions, mask, head_dim**-0.5)
    got = torch.ops.tilefx.decode_attention(q, k, v, k_cache, v_cache, positions, mask, head_dim**-0.5)
    assert ((got.float() - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-2


def test_prefill_attention_choice_refuses_bad_input():
    if isa.native is None:
        pytest.skip("native library not built")
    with pytest.raises(RuntimeError, match="from 2 new tokens"):
        isa.native.set_prefill_attention("extend", "sdpa", 1)
    with pytest.raises(RuntimeError, match="unknown attention family"):
        isa.native.set_prefill_attention("decode", "sdpa", 2)
    with pytest.raises(RuntimeError, match="unknown prefill attention kernel"):
        isa.native.set_prefill_attention("extend", "flash", 2)
    with tuning.forced_attention("mla", "unit", 7):
        assert isa.native.get_prefill_attention("mla") == ("unit", 0)
    with pytest.raises(RuntimeError, match="unknown decode attention kernel"):
        isa.native.set_decode_attention("extend", "sdpa")
    with pytest.raises(RuntimeError, match="unknown attention family"):
        isa.native.set_decode_attention("decode", "brgemm")
    with tuning.forced_decode_attention("mla", "brgemm"):
        assert isa.native.get_decode_attention("mla") == "brgemm"
        assert isa.native.get_decode_attention("extend") == "unit"
