"""GPTQ and AWQ 4-bit checkpoints as the hub ships them, repacked at load into tilefx's int4 format.

A quantized linear ``X`` (``[N, K]``: N outputs, K inputs, groups of G inputs) is stored as:

- GPTQ (``quant_method: gptq``): ``X.qweight`` int32 ``[K / 8, N]``, nibble j (bits 4j..4j+3) of
  ``qweight[r, n]`` the value of input ``8r + j``; ``X.qzeros`` int32 ``[K / G, N / 8]``, nibble j of
  ``qzeros[g, c]`` the zero point of output ``8c + j``, stored minus one in the original (``checkpoint_format``
  ``gptq``) format and as it is in ``gptq_v2``; ``X.scales`` fp16 ``[K / G, N]``; ``X.g_idx`` int32 ``[K]``, each
  input's group (``k // G`` unless ``desc_act`` reordered them).
- AWQ GEMM (``quant_method: awq``, ``version: gemm``): ``X.qweight`` int32 ``[K, N / 8]``, packed along N in the
  order ``AWQ_ORDER``: nibble i of ``qweight[k, c]`` the value of output ``8c + AWQ_ORDER[i]``; ``X.qzeros`` int32
  ``[K / G, N / 8]`` in the same order, as they are; ``X.scales`` fp16 ``[K / G, N]``.

Both mean ``W[n, k] = (q - z) * s`` with the value's group's zero point and scale: tilefx's int4 (one scale and
zero point per output and 128 inputs) holds that exactly where G is 128, a multiple of it, or the whole row.
``read_int4`` gives one linear's nibbles (GPTQ's words as the file holds them; AWQ's unpacked two a byte) and
those params; the loader (models/shard_loading.py) marks each parameter with its parts (``weights.attach_int4_parts``),
which packing reads and repacks layer by layer. ``write_int4`` is the inverse, for checkpoints written here.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from tilefx.custom_ops import isa, weights

METHODS = ("gptq", "awq")
SUPPORTED = ("GPTQ (quant_method 'gptq', bits 4, group_size a multiple of 128 or -1, sym or asym, checkpoint_format "
             "'gptq' or 'gptq_v2', inputs in order: desc_act false or a g_idx of k // group_size) and AWQ (quant_method "
             "'awq', version 'gemm', bits 4, zero_point true, group_size a multiple of 128)")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output 8c + AWQ_ORDER[i]
TENSORS = ("qweight", "qzeros", "scales", "g_idx")  # a quantized linear X's tensors: X.qweight, ...
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


class UnsupportedInt4Error(ValueError):
    """The 4-bit checkpoint is quantized in a way tilefx cannot run."""


@dataclasses.dataclass(frozen=True)
class Int4Scheme:
    """How a GPTQ / AWQ checkpoint stores its linears (from its ``quantization_config``)."""

    method: str  # "gptq" or "awq"
    group_size: int  # inputs per group; -1: one group a row
    zero_offset: int = 0  # added to a stored zero point (GPTQ's original format stores z - 1)


def scheme_of(fields: dict) -> Int4Scheme:
    """The scheme a ``quantization_config`` (as a dict) describes; ``UnsupportedInt4Error`` naming what is not."""
    method = str(getattr(fields.get("quant_method"), "value", fields.get("quant_method"))).lower()
    bits = fields.get("bits", fields.get("w_bit"))
    group = fields.get("group_size", fields.get("q_group_size", 128))
    problems = []
    if method not in METHODS:
        problems.append(f"quant_method={method!r}")
    if bits != 4:
        problems.append(f"bits={bits!r}")
    if group != -1 and (not isinstance(group, int) or group <= 0 or group % weights.INT4_GROUP):
        problems.append(f"group_size={group!r} (tilefx's int4 groups are {weights.INT4_GROUP} inputs: a checkpoint's "
                        f"groups must be whole multiples of them)")
    offset = 0
    if method == "gptq":
        stored = fields.get("checkpoint_format") or fields.get("format") or "gptq"
        if stored not in ("gptq", "gptq_v2") or fields.get("is_marlin_format") or fields.get("is_bitblas_format"):
            problems.append(f"checkpoint_format={stored!r} (a permuted kernel layout)")
        offset = 1 if stored == "gptq" else 0
        if fields.get("dynamic"):
            problems.append("dynamic per-module overrides")
    elif method == "awq":
        version = str(fields.get("version", "gemm")).lower()
        if version != "gemm":
            problems.append(f"version={version!r}")
        if fields.get("zero_point", True) is not True:
            problems.append("zero_point=False")
    if problems:
        raise UnsupportedInt4Error(f"this 4-bit checkpoint has {', '.join(problems)}, which tilefx cannot load; it "
                                   f"runs {SUPPORTED}")
    return Int4Scheme(method, group, offset)


def quantized_modules(names) -> set[str]:
    """The modules of a checkpoint's tensor ``names`` stored as 4-bit (those with an ``X.qweight``)."""
    return {name[: -len(".qweight")] for name in names if name.endswith(".qweight")}


def check_tensors(module: str, names) -> None:
    """Refuse, naming it, a quantized linear without its scales or zero points: its nibbles mean nothing alone."""
    missing = [f"{module}.{t}" for t in ("scales", "qzeros") if f"{module}.{t}" not in names]
    if missing:
        raise ValueError(f"{module}.qweight has no {' or '.join(missing)}: 4-bit values mean nothing without their "
                         f"scales and zero points. The checkpoint is incomplete: download it again.")


def logical_shape(opened, files: dict, module: str, scheme: Int4Scheme) -> tuple[int, int]:
    """``[N, K]`` of 4-bit linear ``module``, from its ``qweight``'s shape alone (``opened``: shard_loading's)."""
    rows, cols = opened(files[f"{module}.qweight"]).get_slice(f"{module}.qweight").get_shape()
    return (cols, 8 * rows) if scheme.method == "gptq" else (8 * cols, rows)


def _unpack(words: torch.Tensor, order=None) -> torch.Tensor:
    """int32 ``[..., C]`` -> its nibbles ``[..., C, 8]`` (uint8), nibble i at position ``order[i]`` (default: i)."""
    nibbles = ((words[..., None] >> _SHIFTS) & 0xF).to(torch.uint8)
    if order is None:
        return nibbles
    out = torch.empty_like(nibbles)
    out[..., list(order)] = nibbles
    return out


def _pack(nibbles: torch.Tensor, order=None) -> torch.Tensor:
    """``_unpack``'s inverse: nibbles ``[..., C, 8]`` -> int32 ``[..., C]``."""
    if order is not None:
        nibbles = nibbles[..., list(order)]
    words = (nibbles.to(torch.int64) << _SHIFTS.long()).sum(dim=-1)  # the fields do not overlap
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # as int32 bits


def awq_paired_nibbles(qweight: torch.Tensor, native: bool = True) -> torch.Tensor:
    """An AWQ ``qweight`` (int32 ``[K, N / 8]``, 8 outputs a word in ``AWQ_ORDER``) as nibbles two a byte ``[N, K /
    2]`` (``weights.pair_nibbles``): natively (csrc/memory.cpp, every thread) where the library is built, else
    torch's ops (the reference, 0.16 GB/s: most of an AWQ checkpoint's load)."""
    if native and isa.native is not None and qweight.shape[0] % 2 == 0:
        return isa.native.awq_paired_nibbles(qweight.contiguous(), list(AWQ_ORDER))
    k, words = qweight.shape
    return weights.pair_nibbles(_unpack(qweight, AWQ_ORDER).reshape(k, 8 * words).T)


def read_int4(tensor, names, module: str, scheme: Int4Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear ``module``'s 4-bit tensors (``tensor(name)`` reads one of the checkpoint's tensors ``names``) as
    tilefx's int4: its nibbles (``weights.Int4Rows``' forms) and fp16 params ``[N, ceil(K / 128), 2]``
    (scale, zero point). GPTQ's nibbles are its ``qweight``'s words in place (``gptq_words``: a view, so a GPTQ
    checkpoint read from a file costs no memory until packing reads it); AWQ's (and GPTQ's on a big-endian CPU)
    are unpacked into a tensor of their own, two a byte ``[N, K / 2]``."""
    qweight, qzeros = tensor(f"{module}.qweight"), tensor(f"{module}.qzeros")
    scales = tensor(f"{module}.scales").to(torch.float16)
    if scheme.method == "gptq":
        rows, n = qweight.shape
        k = 8 * rows
        if sys.byteorder == "little":
            nibbles = gptq_words(qweight)
        else:
            nibbles = weights.pair_nibbles(_unpack(qweight.T.contiguous()).reshape(n, k))
        zeros = _unpack(qzeros).reshape(qzeros.shape[0], -1)[:, :n]  # [G, N]
    else:
        k, words = qweight.shape
        n = 8 * words
        nibbles = awq_paired_nibbles(qweight)
        zeros = _unpack(qzeros, AWQ_ORDER).reshape(qzeros.shape[0], -1)[:, :n]
    group = k if scheme.group_size == -1 else scheme.group_size
    groups = -(-k // group)
    if scales.shape != (groups, n) or zeros.shape[0] != groups:
        raise ValueError(f"{module}: scales {tuple(scales.shape)} / qzeros {tuple(qzeros.shape)} do not hold "
                         f"{groups} groups of {group} inputs for a [{n}, {k}] weight")
    if scheme.method == "gptq" and f"{module}.g_idx" in names:
        order = torch.arange(k) // group
        if not torch.equal(tensor(f"{module}.g_idx").long(), order):
            raise UnsupportedInt4Error(
                f"{module}.g_idx is not k // group_size: the checkpoint was quantized with desc_act (act-order), its "
                f"inputs' groups out of order, which tilefx's int4 groups cannot hold. Use a checkpoint made with "
                f"desc_act=False (most hub GPTQ-Int4 models are).")
    if k % 4:
        raise UnsupportedInt4Error(f"{module}: {k} inputs; tilefx's int4 reads inputs in fours")
    per_group = torch.arange(-(-k // weights.INT4_GROUP)) * weights.INT4_GROUP // group  # each 128-group's group
    zero = zeros[per_group].T.to(torch.float16) + scheme.zero_offset
    params = torch.stack([scales[per_group].T, zero], dim=-1).contiguous()
    return nibbles, params


def gptq_words(qweight: torch.Tensor) -> torch.Tensor:
    """A GPTQ ``qweight`` (int32 ``[K / 8, N]``, little-endian) as output rows of words ``[N, K / 8, 4]``: a view, no
    byte copied. A word holds 8 consecutive inputs, input i at bits 4i, so its bytes are already two inputs each,
    the even one low: ``weights.pair_nibbles``' order, each row's words ``N`` words apart."""
    return qweight.T.unsqueeze(-1).view(torch.uint8)


def write_int4(weight: torch.Tensor, scheme: Int4Scheme, symmetric: bool) -> dict[str, torch.Tensor]:
    """A bf16 ``[N, K]`` weight as ``scheme`` stores it (round to nearest per group; symmetric: zero point 8, scale
    max|w| / 7; else the group's range over 15): ``{"qweight": ..., "qzeros": ..., "scales": ..., "g_idx": ...}``."""
    n, k = weight.shape
    group = k if scheme.group_size == -1 else scheme.group_size
    w = weight.float().view(n, k // group, group)
    if symmetric:
        scale = (w.abs().amax(dim=-1) / 7).clamp_min(1e-8).half()
        zero = torch.full_like(scale, 8, dtype=torch.int32)
    else:
        scale, zero = asymmetric_params(w)
    q = torch.round(w / scale.float()[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    return pack_int4(q, scale, zero, scheme)


def asymmetric_params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups ``w [..., group]``'s fp16 scale and int zero point (the range, with 0 in it, over 15 steps)."""
    low, high = w.amin(dim=-1).clamp_max(0), w.amax(dim=-1).clamp_min(0)
    scale = ((high - low) / 15).clamp_min(1e-8).half()
    return scale, torch.round(-low / scale.float()).clamp(0, 15).to(torch.int32)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, scheme: Int4Scheme) -> dict[str, torch.Tensor]:
    """Nibbles ``q [N, K]`` (uint8, 0-15) with fp16 ``scale`` and int ``zero`` ``[N, G]`` (G groups of the scheme's
    size, the last one partial where K is not a multiple) in ``scheme``'s tensors."""
    n, k = q.shape
    group = k if scheme.group_size == -1 else scheme.group_size
    groups = scale.shape[1]
    stored_zero = (zero - scheme.zero_offset).clamp(0, 15).to(torch.uint8)  # [N, G]
    if scheme.method == "gptq":
        qweight = _pack(q.T.reshape(k // 8, 8, n).transpose(1, 2))  # [K/8, N]
        qzeros = _pack(stored_zero.T.reshape(groups, n // 8, 8))
        tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scale.half().T.contiguous(),
                   "g_idx": (torch.arange(k) // group).to(torch.int32)}
    else:
        qweight = _pack(q.T.reshape(k, n // 8, 8), AWQ_ORDER)  # [K, N/8]
        qzeros = _pack(stored_zero.T.reshape(groups, n // 8, 8), AWQ_ORDER)
        tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scale.half().T.contiguous()}
    return {name: t.contiguous() for name, t in tensors.items()}
