"""Attention over the tilefx KV cache: ``tilefx::extend_attention``, ``tilefx::decode_attention``
and DeepSeek's weight-absorbed ``tilefx::mla_attention`` and ``tilefx::mla_prefill`` (at the end of
this module).

Both ops write the new keys/values into the cache in place and attend over the
valid prefix of the cache only. Conventions (DESIGN.md "KV cache and shapes"):

- ``q``       ``[B, Hq, S, D]``   queries of the new tokens (RoPE applied)
- ``k``, ``v`` ``[B, Hkv, S, D]``  keys/values of the new tokens
- ``k_cache``, ``v_cache`` ``[max_batch, Hkv, max_seq_len, D]``: whole buffers, never views,
  so Inductor mutates them in place instead of copying (pytorch#131192)
- ``positions`` ``[S]`` int64: cache slots of the new tokens, contiguous and increasing;
  the valid prefix is ``[0, positions[-1] + 1)``
- ``mask``    ``[B, 1, S, max_seq_len]`` bool, True where a query may attend a key
  (causal and padding, as transformers' sdpa mask); only the valid prefix is read
- returns     ``[B, Hq, S, D]``; query rows that may attend no key (left padding) are zero.

GQA is handled by grouping query heads onto their KV head, never by repeating K/V.
"""

from __future__ import annotations

import torch

from tilefx.custom_ops import isa

_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor positions, Tensor mask, float scale) -> Tensor"
)


def _check_shapes(q, k, v, k_cache, v_cache, positions, mask) -> None:
    batch, q_heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    torch._check(k.shape == (batch, kv_heads, seq, head_dim), lambda: f"k shape {tuple(k.shape)}")
    torch._check(v.shape[:3] == (batch, kv_heads, seq), lambda: f"v shape {tuple(v.shape)}")
    torch._check(q_heads % kv_heads == 0, lambda: f"{q_heads} query heads over {kv_heads} KV heads")
    torch._check(k_cache.shape[0] >= batch and k_cache.shape[1] == kv_heads, lambda: "k_cache shape")
    torch._check(v_cache.shape[:3] == k_cache.shape[:3], lambda: "v_cache shape")
    torch._check(positions.shape == (seq,), lambda: f"positions shape {tuple(positions.shape)}")
    torch._check(mask.dtype == torch.bool, lambda: f"mask dtype {mask.dtype}, expected bool")
    torch._check(mask.shape[-2] == seq and mask.shape[-1] == k_cache.shape[2], lambda: "mask shape")


def _write_kv(k, v, k_cache, v_cache, positions) -> int:
    """Write the new tokens' K/V into the cache rows of this batch; return the valid prefix length."""
    batch = k.shape[0]
    k_cache[:batch].index_copy_(2, positions, k.to(k_cache.dtype))
    v_cache[:batch].index_copy_(2, positions, v.to(v_cache.dtype))
    return int(positions[-1]) + 1


def _attend(q, keys, values, mask, scale):
    """Masked softmax attention in fp32: q ``[B, Hq, S, D]`` over ``keys``/``values`` ``[B, Hkv, T, *]``."""
    batch, q_heads, seq, _ = q.shape
    kv_heads, end = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    qg = q.float().reshape(batch, kv_heads, group * seq, -1)
    scores = torch.matmul(qg, keys.float().transpose(-1, -2)) * scale  # [B, Hkv, G*S, T]
    scores = scores.view(batch, kv_heads, group, seq, end)
    allowed = mask[:batch, :, :, :end].reshape(batch, 1, 1, seq, end)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no allowed key -> 0
    out = torch.matmul(probs.view(batch, kv_heads, group * seq, end), values.float())
    return out.view(batch, q_heads, seq, -1).to(q.dtype)


def attention_reference(q, k, v, k_cache, v_cache, positions, mask, scale):
    """The specification: write K/V into the cache, then masked softmax attention in fp32."""
    _check_shapes(q, k, v, k_cache, v_cache, positions, mask)
    batch = q.shape[0]
    end = _write_kv(k, v, k_cache, v_cache, positions)
    return _attend(q, k_cache[:batch, :, :end], v_cache[:batch, :, :end], mask, scale)


def attention_portable(q, k, v, k_cache, v_cache, positions, mask, scale):
    """The portable implementation (reference path): PyTorch's fused SDPA over the valid prefix, GQA in place."""
    _check_shapes(q, k, v, k_cache, v_cache, positions, mask)
    batch = q.shape[0]
    end = _write_kv(k, v, k_cache, v_cache, positions)
    out = torch.nn.functional.scaled_dot_product_attention(
        q,
        k_cache[:batch, :, :end],
        v_cache[:batch, :, :end],
        attn_mask=mask[:batch, :, :, :end],
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    if q.shape[2] > 1:  # left-padded prompt rows see no key: zero, not NaN
        out = out.masked_fill(~mask[:batch, :, :, :end].any(-1, keepdim=True), 0.0)
    return out


def _attention_fake(q, k, v, k_cache, v_cache, positions, mask, scale):
    _check_shapes(q, k, v, k_cache, v_cache, positions, mask)
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


# The ops' native CPU kernel (registered by custom_ops/__init__.py) takes the current kernel
# path; on the reference path, or without the native library, attention_portable runs.
_LIB = torch.library.Library("tilefx", "FRAGMENT")
for _name in ("extend_attention", "decode_attention", "attention_portable"):
    _LIB.define(_name + _SCHEMA)
    if _name == "attention_portable" or isa.native is None:
        _LIB.impl(_name, attention_portable, "CPU")
    torch.library.register_fake(f"tilefx::{_name}", _attention_fake, lib=_LIB)

extend_attention = torch.ops.tilefx.extend_attention.default
decode_attention = torch.ops.tilefx.decode_attention.default


# -- MLA --------------------------------------------------------------------------------
# DeepSeek's multi-head latent attention, weight-absorbed (the MLA pass): every query
# head attends the one latent "head" of the cache, key = [latent | rope key], value =
# the latent. Shapes:
# - ``q_latent`` ``[B, H, S, R]``: q_nope times the key half of ``kv_b_proj`` per head (R = kv_lora_rank)
# - ``q_rope``   ``[B, H, S, Dr]``: the rope part of the query (RoPE applied)
# - ``latent``, ``k_rope`` ``[B, 1, S, R]`` / ``[B, 1, S, Dr]``: the new tokens' normalized latent and rope key
# - ``latent_cache``, ``rope_cache`` ``[max_batch, 1, max_seq_len, R / Dr]``: whole buffers (as above)
# - returns ``[B, H, S, R]``: the attention-weighted latent per head (``kv_b_proj``'s value half maps it to V).
_MLA_SCHEMA = (
    "(Tensor q_latent, Tensor q_rope, Tensor latent, Tensor k_rope, Tensor(a!) latent_cache, "
    "Tensor(b!) rope_cache, Tensor positions, Tensor mask, float scale) -> Tensor"
)


def _check_mla_shapes(q, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask) -> None:
    """``q``: the absorbed query ``[B, H, S, R]`` (mla_attention) or its nope part (mla_prefill)."""
    batch, heads, seq, _ = q.shape
    rank, rope_dim = latent_cache.shape[-1], q_rope.shape[-1]
    torch._check(q_rope.shape[:3] == (batch, heads, seq), lambda: f"q_rope shape {tuple(q_rope.shape)}")
    torch._check(latent.shape == (batch, 1, seq, rank), lambda: f"latent shape {tuple(latent.shape)}")
    torch._check(k_rope.shape == (batch, 1, seq, rope_dim), lambda: f"k_rope shape {tuple(k_rope.shape)}")
    torch._check(latent_cache.shape[0] >= batch and latent_cache.shape[1] == 1,
                 lambda: f"latent_cache shape {tuple(latent_cache.shape)}")
    torch._check(rope_cache.shape[:3] == latent_cache.shape[:3] and rope_cache.shape[3] == rope_dim,
                 lambda: f"rope_cache shape {tuple(rope_cache.shape)}")
    torch._check(positions.shape == (seq,), lambda: f"positions shape {tuple(positions.shape)}")
    torch._check(mask.dtype == torch.bool, lambda: f"mask dtype {mask.dtype}, expected bool")
    torch._check(mask.shape[-2] == seq and mask.shape[-1] == latent_cache.shape[2], lambda: "mask shape")


def _check_absorbed_mla_shapes(q_latent, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask) -> None:
    _check_mla_shapes(q_latent, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask)
    torch._check(q_latent.shape[-1] == latent_cache.shape[-1], lambda: f"q_latent shape {tuple(q_latent.shape)}")


def mla_attention_reference(q_latent, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask, scale):
    """The specification: write the latent and rope key, then attention with key [latent | rope], value latent."""
    _check_absorbed_mla_shapes(q_latent, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask)
    batch = q_latent.shape[0]
    end = _write_kv(latent, k_rope, latent_cache, rope_cache, positions)
    values = latent_cache[:batch, :, :end]
    keys = torch.cat([values, rope_cache[:batch, :, :end]], dim=-1)
    return _attend(torch.cat([q_latent, q_rope], dim=-1), keys, values, mask, scale)


def mla_attention_portable(q_latent, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask, scale):
    """The portable implementation (reference path): PyTorch's fused SDPA, all heads over the one latent head."""
    _check_absorbed_mla_shapes(q_latent, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask)
    batch = q_latent.shape[0]
    end = _write_kv(latent, k_rope, latent_cache, rope_cache, positions)
    values = latent_cache[:batch, :, :end]
    allowed = mask[:batch, :, :, :end]
    out = torch.nn.functional.scaled_dot_product_attention(
        torch.cat([q_latent, q_rope], dim=-1),
        torch.cat([values, rope_cache[:batch, :, :end]], dim=-1),
        values,
        attn_mask=allowed,
        scale=scale,
        enable_gqa=True,
    )
    if q_latent.shape[2] > 1:
        out = out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    return out


def _mla_fake(q_latent, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask, scale):
    _check_absorbed_mla_shapes(q_latent, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask)
    return q_latent.new_empty(q_latent.shape)


for _name in ("mla_attention", "mla_attention_portable"):
    _LIB.define(_name + _MLA_SCHEMA)
    if _name == "mla_attention_portable" or isa.native is None:
        _LIB.impl(_name, mla_attention_portable, "CPU")
    torch.library.register_fake(f"tilefx::{_name}", _mla_fake, lib=_LIB)

mla_attention = torch.ops.tilefx.mla_attention.default


# -- MLA prefill -------------------------------------------------------------------------
# ``tilefx::mla_prefill`` is MLA from the query's nope part to the per-head values, the prefill
# graphs' form (the MLA pass): the same inputs as mla_attention with ``q_nope`` ``[B, H, S, Dn]``
# in place of the absorbed query, plus ``kv_b_proj``'s absorbed packs (``w_uk``, ``w_uv``,
# pack_mla_absorbed_weight) and the weight itself ``[H * (Dn + Dv), R]``; returns ``[B, H, S, Dv]``.
# The native kernel runs it absorbed (linear_per_head, mla_attention, linear_per_head) or, where
# the brgemm attention kernel runs MLA prefill and that costs fewer multiply-adds (a prompt over
# a short prefix), over K/V expanded from the latent: HF's math over the valid prefix only
# (csrc/attention_ops.cpp expanded_mla_pays).
_MLA_PREFILL_SCHEMA = (
    "(Tensor q_nope, Tensor q_rope, Tensor latent, Tensor k_rope, Tensor(a!) latent_cache, "
    "Tensor(b!) rope_cache, Tensor positions, Tensor mask, float scale, Tensor w_uk, Tensor w_uv, "
    "Tensor kv_b_proj) -> Tensor"
)


def _check_mla_prefill_shapes(q_nope, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask,
                              kv_b_proj) -> int:
    """The checks of mla_prefill's inputs; returns the value head dim."""
    _check_mla_shapes(q_nope, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask)
    heads, nope = q_nope.shape[1], q_nope.shape[-1]
    torch._check(kv_b_proj.dim() == 2 and kv_b_proj.shape[1] == latent_cache.shape[-1]
                 and kv_b_proj.shape[0] % heads == 0 and kv_b_proj.shape[0] // heads > nope,
                 lambda: f"kv_b_proj {tuple(kv_b_proj.shape)} does not split into {heads} heads of {nope} key rows "
                 f"and some value rows over a rank-{latent_cache.shape[-1]} latent")
    return kv_b_proj.shape[0] // heads - nope


def mla_prefill_reference(q_nope, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask, scale, w_uk,
                          w_uv, kv_b_proj):
    """The specification, HF's MLA: write the latent and rope key, expand the valid prefix's latent through
    ``kv_b_proj`` into per-head keys ``[k_nope | rope key]`` and values, attend in fp32. (The packs are not read.)"""
    v_dim = _check_mla_prefill_shapes(q_nope, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask,
                                      kv_b_proj)
    batch, heads, _, nope = q_nope.shape
    end = _write_kv(latent, k_rope, latent_cache, rope_cache, positions)
    kv = torch.nn.functional.linear(latent_cache[:batch, 0, :end].float(), kv_b_proj.float())
    kv = kv.view(batch, end, heads, nope + v_dim).transpose(1, 2)
    keys = torch.cat([kv[..., :nope], rope_cache[:batch, :, :end].float().expand(-1, heads, -1, -1)], dim=-1)
    return _attend(torch.cat([q_nope, q_rope], dim=-1), keys, kv[..., nope:], mask, scale)


def _mla_prefill_fake(q_nope, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask, scale, w_uk, w_uv,
                      kv_b_proj):
    v_dim = _check_mla_prefill_shapes(q_nope, q_rope, latent, k_rope, latent_cache, rope_cache, positions, mask,
                                      kv_b_proj)
    return q_nope.new_empty(q_nope.shape[:3] + (v_dim,))


isa.define_native_op(_LIB, "mla_prefill", _MLA_PREFILL_SCHEMA, mla_prefill_reference, _mla_prefill_fake)
mla_prefill = torch.ops.tilefx.mla_prefill.default
