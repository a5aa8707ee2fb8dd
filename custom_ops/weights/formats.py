"""Weight formats: what a packed tensor's values mean, and fp8 checkpoints' block scales.

``FORMATS``: ``bf16``; ``int8`` (symmetric, one fp32 scale per output channel); ``fp8``
(e4m3, one fp32 scale per 128 x 128 block of the source, the hub's ``weight_scale_inv``:
``W = q * scale``); ``int4`` (unsigned nibbles with an fp16 scale and zero point per output
channel and 128 inputs, ``W = (q - z) * s``: GPTQ's and AWQ's meaning, and RTN's here).
A quantized packing holds its 1-byte values in the same element order as bf16 (``[blocks, K/2,
32, 2]``; int4 two a byte, ``[blocks, K/2, 16, 2]`` in the order ``layouts.int4_interleave``
gives) and its scales in packed-block order, ``[blocks, 32]`` (int8: per packed column),
``[blocks, K/128]`` (fp8: per block and 128 inputs) or ``[blocks, K/128, 2, 32]`` (int4: per
group, the 32 columns' scales then their zero points), so
kernels never map a block back to its source rows and gate/up interleaving or sibling
fusion need no scale bookkeeping of their own. ``quantize_rows`` is the specification of
quantizing, ``dequantize`` of reading a packed tensor back.

An fp8 checkpoint's weight arrives quantized: ``attach_checkpoint_scales`` records its
block scales (in this module's table, keyed by the parameter), and packing reads them. An
int4 checkpoint's weight arrives as its rows, ``Int4Rows`` (``attach_int4_parts``), which
packing reads, the loader's deferred until then.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from tilefx.custom_ops import isa
from tilefx.custom_ops.weights import layouts
from tilefx.custom_ops.weights.layouts import BLOCK_N

# format -> the packed tensor's dtype (the kernels read the format from it)
FORMATS = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}
FP8_GROUP = 128  # fp8 scale blocks: 128 output channels x 128 inputs (the hub's weight_block_size)
FP8_MAX = 448.0  # largest finite e4m3 value
INT4_GROUP = 128  # int4 scale groups: 128 inputs of one output channel (csrc/kernels.h kInt4GroupPairs)
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.uint8)
SCALE_DTYPES = {"int8": torch.float32, "fp8": torch.float32, "int4": torch.float16}
# what the quantized kernels read (MLA's per-head halves: bf16); "experts" is can_pack's name for the pair
QUANTIZED_LAYOUTS = ("linear", "gate_up", "experts", "expert_gate_up", "expert_down")


def format_of(packed: torch.Tensor) -> str:
    """The format of a packed tensor (its dtype)."""
    for name, dtype in FORMATS.items():
        if packed.dtype == dtype:
            return name
    raise ValueError(f"{packed.dtype} is not a packed weight format ({', '.join(FORMATS)})")


def check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"unknown weight format {format!r}; expected one of {', '.join(FORMATS)}")


def scales_shape(packed_shape: tuple[int, ...], format: str) -> tuple[int, ...]:
    """The scales of a packing of ``packed_shape`` (``[..., blocks, pairs, 32 (int4: 16), 2]``) in ``format``:
    int8 ``[..., blocks, 32]``, fp8 ``[..., blocks, ceil(K / 128)]``, int4 ``[..., blocks, ceil(K / 128), 2, 32]``;
    bf16 has none (``()``)."""
    *lead, blocks, pairs, _, _ = packed_shape
    if format == "int8":
        return (*lead, blocks, BLOCK_N)
    if format == "fp8":
        return (*lead, blocks, -(-2 * pairs // FP8_GROUP))
    if format == "int4":
        return (*lead, blocks, -(-2 * pairs // INT4_GROUP), 2, BLOCK_N)
    return ()


def logical_shape(packed: torch.Tensor) -> tuple[int, ...]:
    """The layout shape ``[..., blocks, pairs, 32, 2]`` a packed tensor holds (``stored_shape``'s inverse)."""
    if packed.dtype == torch.uint8:
        return (*packed.shape[:-2], BLOCK_N, 2)
    return tuple(packed.shape)


def stored_shape(layout_shape: tuple[int, ...], format: str) -> tuple[int, ...]:
    """The packed tensor's shape for a layout's ``[..., blocks, pairs, 32, 2]`` in ``format`` (int4: two values a
    byte, ``[..., blocks, pairs, 16, 2]``)."""
    if format == "int4":
        return (*layout_shape[:-2], BLOCK_N // 2, 2)
    return tuple(layout_shape)


def check_scales(op: str, packed: torch.Tensor, scales: torch.Tensor | None) -> None:
    """The scales an op was given for ``packed``: none for an unquantized weight, else ``packed_scales``'
    fp32 ``scales_shape``."""
    if packed.dtype not in QUANTIZED_DTYPES:
        torch._check(scales is None, lambda: f"tilefx.{op}: a {packed.dtype} weight takes no scales")
        return
    format = format_of(packed)
    want, dtype = scales_shape(tuple(packed.shape), format), SCALE_DTYPES[format]
    torch._check(scales is not None and scales.dtype == dtype and tuple(scales.shape) == want,
                 lambda: f"tilefx.{op}: a {format} weight needs its {dtype} scales {list(want)} (packed_scales), got "
                         f"{None if scales is None else (scales.dtype, tuple(scales.shape))}")
    if format == "int4":
        torch._check(packed.shape[-3] % 2 == 0, lambda: f"tilefx.{op}: an int4 weight's inputs come in fours, got "
                                                        f"{2 * packed.shape[-3]}")


def quantize_rows(weight: torch.Tensor, format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [n, k]`` quantized: ``(values, scales)`` with ``weight ~ values * scales``.

    int8: symmetric per row, ``scale = max|w| / 127``, values rounded to nearest in [-127, 127], scales ``[n]``.
    fp8: e4m3 per 128 x 128 block, ``scale = max|w| / 448`` (the hub's ``weight_scale_inv``), values
    rounded to nearest e4m3, scales ``[ceil(n / 128), ceil(k / 128)]``. All-zero rows or blocks get scale 1.
    int4: round to nearest (RTN), asymmetric per row and 128 inputs (min to max, 0 included: the quality table in
    docs/PERFORMANCE.md measured symmetric far worse): ``scale = (max - min) / 15`` rounded to fp16, zero point
    ``round(-min / scale)``, values ``round(w / scale) + zero`` in [0, 15] (uint8 ``[n, k]``), scales ``[n,
    ceil(k / 128), 2]`` fp16 (the scale and the zero point).
    """
    n, k = weight.shape
    if isa.native is not None and weight.dtype == torch.bfloat16 and weight.stride(-1) == 1:
        return _quantize_natively(weight, format)  # the same, bit for bit, in one pass (csrc/memory.cpp)
    w = weight.float()
    if format == "int8":
        scale = w.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale
    if format == "int4":
        groups = -(-k // INT4_GROUP)
        padded = torch.nn.functional.pad(w, (0, groups * INT4_GROUP - k)).view(n, groups, INT4_GROUP)
        low, high = padded.amin(dim=2).clamp_max(0), padded.amax(dim=2).clamp_min(0)  # 0 stays exact
        scale = ((high - low) / 15).half()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # (an underflow to 0 included)
        zero = torch.round(-low / scale.float()).clamp_(0, 15)
        values = torch.round(padded / scale.float()[..., None] + zero[..., None]).clamp_(0, 15).to(torch.uint8)
        return values.view(n, -1)[:, :k], torch.stack([scale, zero.half()], dim=-1)
    if format != "fp8":
        raise ValueError(f"quantize_rows: format {format!r} is not a quantized format (int8, fp8, int4)")
    rows, cols = -(-n // FP8_GROUP), -(-k // FP8_GROUP)
    blocks = torch.nn.functional.pad(w, (0, cols * FP8_GROUP - k, 0, rows * FP8_GROUP - n))
    blocks = blocks.view(rows, FP8_GROUP, cols, FP8_GROUP)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.view(rows * FP8_GROUP, cols * FP8_GROUP)[:n, :k], scale


def _quantize_natively(weight: torch.Tensor, format: str) -> tuple[torch.Tensor, torch.Tensor]:
    if format not in ("int8", "fp8", "int4"):
        raise ValueError(f"quantize_rows: format {format!r} is not a quantized format (int8, fp8, int4)")
    n, k = weight.shape
    values = torch.empty((n, k), dtype=FORMATS[format])
    if format == "int8":
        scales = torch.empty(n)
        isa.native.quantize_rows_int8(weight, values, scales)
    elif format == "fp8":
        scales = torch.empty(-(-n // FP8_GROUP), -(-k // FP8_GROUP))
        isa.native.quantize_blocks_fp8(weight, values, scales)
    else:
        scales = torch.empty(n, -(-k // INT4_GROUP), 2, dtype=torch.float16)
        isa.native.quantize_groups_int4(weight, values, scales)
    return values, scales


def write_scales(out: torch.Tensor, row_scales: torch.Tensor) -> None:
    """``quantize_rows``' scales of some rows into their blocks' packed-order scales ``out``."""
    if row_scales.dim() == 1:  # int8: one per row (padding rows: 0, their values are 0)
        padded = torch.zeros(out.shape[0] * BLOCK_N)
        padded[: row_scales.shape[0]] = row_scales
        out.copy_(padded.view(-1, BLOCK_N))
    elif row_scales.dim() == 3:  # int4: [rows, groups, 2] -> [blocks, groups, 2, 32] (padding rows: 0 and 0)
        padded = row_scales.new_zeros((out.shape[0] * BLOCK_N, *row_scales.shape[1:]))
        padded[: row_scales.shape[0]] = row_scales
        out.copy_(padded.view(out.shape[0], BLOCK_N, *row_scales.shape[1:]).permute(0, 2, 3, 1))
    else:  # fp8: a 128-row scale block covers 4 packed blocks
        out.copy_(row_scales.repeat_interleave(FP8_GROUP // BLOCK_N, dim=0)[: out.shape[0]])


def dequantize(packed: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """A packed tensor's values in fp32, same shape and order (the references' first step; bf16: widened)."""
    if packed.dtype == torch.bfloat16:
        return packed.float()
    if format_of(packed) == "int4":  # scales [..., blocks, groups, 2, 32]: per group of 64 pairs and column
        values = layouts.int4_values(packed).float()  # [..., blocks, pairs, 32, 2]
        pairs = values.shape[-3]
        per_pair = scales.float().repeat_interleave(INT4_GROUP // 2, dim=-3)[..., :pairs, :, :]
        scale, zero = per_pair[..., 0, :], per_pair[..., 1, :]
        return (values - zero[..., None]) * scale[..., None]
    values = packed.float()
    if format_of(packed) == "int8":  # scales [..., blocks, 32]: per column of the block
        return values * scales[..., :, None, :, None]
    pairs = packed.shape[-3]  # fp8, scales [..., blocks, groups]: pair p lies in group 2p // 128
    per_pair = scales.repeat_interleave(FP8_GROUP // 2, dim=-1)[..., :pairs]
    return values * per_pair[..., None, None]


# -- checkpoints whose weights arrive quantized: fp8 (block scales), int4 (GPTQ / AWQ, models/int4.py) ----------

# parameter -> its checkpoint scales (held by the parameter object's identity, not on the tensor)
_checkpoint_scales = WeakTensorKeyDictionary()
# int4 parameter -> its rows as packing reads them (the parameter's own data holds no memory: untouched zeros)
_checkpoint_int4 = WeakTensorKeyDictionary()


def pair_nibbles(values: torch.Tensor) -> torch.Tensor:
    """Nibbles one a byte ``[..., K]`` (K even) as two a byte ``[..., K / 2]``, the even input in the low half."""
    return values[..., 0::2] | (values[..., 1::2] << 4)


def split_nibbles(paired: torch.Tensor) -> torch.Tensor:
    """``pair_nibbles``' inverse: ``[..., K / 2]`` -> ``[..., K]``, one nibble a byte."""
    return torch.stack([paired & 0xF, paired >> 4], dim=-1).flatten(-2)


@dataclasses.dataclass(frozen=True)
class Int4Rows:
    """Rows of an int4 checkpoint's weight (a linear's, or an expert's gate, up or down) as packing reads them:
    ``read()`` gives their nibbles (``int4_rows``' forms) and fp16 params ``[rows, ceil(K / 128), 2]``, per row and
    128 inputs the scale and the zero point (``W = (q - z) * s``). The loader defers the read to packing
    (models/shard_loading.py), so that a checkpoint's bytes are read once, as packing consumes them; ``held_bytes``:
    what the part holds until then (0 for a deferred read)."""

    rows: int
    read: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    held_bytes: int = 0

    @classmethod
    def of(cls, nibbles: torch.Tensor, params: torch.Tensor) -> Int4Rows:
        """Rows already read (held until packed)."""
        return cls(nibbles.shape[0], lambda: (nibbles, params), nibbles.nbytes + params.nbytes)

    def read_checked(self, k: int, name: str = "int4 checkpoint rows") -> tuple[torch.Tensor, torch.Tensor]:
        """``read()``, checked to hold ``rows`` rows of ``k`` inputs with their params."""
        nibbles, params = self.read()
        if not _is_int4_rows(nibbles, k) or nibbles.shape[0] != self.rows:
            raise ValueError(f"{name}: nibbles must be uint8 rows, two a byte [{self.rows}, {k // 2}] or words "
                             f"[{self.rows}, {k // 8}, 4], got {nibbles.dtype} {tuple(nibbles.shape)}")
        if params.dtype != torch.float16 or tuple(params.shape) != (self.rows, -(-k // INT4_GROUP), 2):
            raise ValueError(f"{name}: {self.rows} rows of {k} inputs need fp16 scales and zero points "
                             f"[{self.rows}, {-(-k // INT4_GROUP)}, 2], got {params.dtype} {tuple(params.shape)}")
        return nibbles, params


def attach_checkpoint_int4(weight: torch.Tensor, nibbles: torch.Tensor, params: torch.Tensor) -> None:
    """``attach_int4_parts`` with rows already read: nibbles ``[..., N, K / 2]`` two a byte (``pair_nibbles``) and
    fp16 ``params [..., N, ceil(K / 128), 2]``."""
    matrices = [(nibbles, params)] if weight.dim() == 2 else zip(nibbles, params) if nibbles.dim() == 3 else ()
    parts = [(Int4Rows.of(n, p),) for n, p in matrices]
    for part in _flat(parts):  # (read: check now)
        part.read_checked(weight.shape[-1])
    attach_int4_parts(weight, parts)


def attach_int4_parts(weight: torch.Tensor, parts) -> None:
    """Mark ``weight`` (a uint8 ``[N, K]`` or experts' ``[E, N, K]``, normally ``memory.untouched_zeros``: it stands
    for the weight in the graphs that trace it) as an int4 checkpoint's, whose rows are ``parts`` (``Int4Rows``):
    per matrix (the one of ``[N, K]``, or each expert's) a sequence of parts whose rows make its N (an expert's
    gate's, then up's: each read from its own tensor in the file). Packing reads them (as they are into an int4
    packing, else dequantized a chunk at a time)."""
    if weight.dtype != torch.uint8 or weight.dim() not in (2, 3) or weight.shape[-1] % 2:
        raise ValueError(f"int4 checkpoint weight {weight.dtype} {tuple(weight.shape)}: a uint8 [N, K] or experts' "
                         f"[E, N, K] (K even)")
    n = weight.shape[-2]
    if len(parts) != (weight.shape[0] if weight.dim() == 3 else 1) or not all(
            all(isinstance(part, Int4Rows) for part in rows) and sum(part.rows for part in rows) == n
            for rows in parts):
        raise ValueError(f"int4 checkpoint weight {tuple(weight.shape)}: its parts must be Int4Rows, {n} rows per "
                         f"matrix (per matrix, the one or each expert's, a sequence of parts), got {parts!r:.200}")
    _checkpoint_int4[weight] = [tuple(rows) for rows in parts]


def _is_int4_rows(part, k: int) -> bool:
    return isinstance(part, torch.Tensor) and part.dtype == torch.uint8 and part.stride(-1) == 1 and (
        (part.dim() == 2 and part.shape[1] == k // 2) or (part.dim() == 3 and tuple(part.shape[1:]) == (k // 8, 4)))


def checkpoint_int4(weight: torch.Tensor):
    """The parts ``attach_int4_parts`` gave ``weight``, a list per matrix of tuples of ``Int4Rows``; None where it
    holds no int4 checkpoint's."""
    return _checkpoint_int4.get(weight)


def int4_parts(weight: torch.Tensor) -> list[Int4Rows]:
    """Every ``Int4Rows`` of int4 checkpoint weight ``weight`` (none where it is not one)."""
    return _flat(checkpoint_int4(weight) or [])


def _flat(parts) -> list[Int4Rows]:
    return [part for rows in parts for part in rows]


def int4_rows(part: torch.Tensor) -> torch.Tensor:
    """An int4 checkpoint's rows of nibbles as two a byte ``[n, K / 2]`` (``pair_nibbles``). They are held either
    so, or as the bytes of 32-bit words of 8 inputs ``[n, K / 8, 4]``: a GPTQ qweight read in place from its file
    (models/int4.py), whose words lie K / 8 apart. Those are joined here, a copy: one chunk at a time only."""
    return part if part.dim() == 2 else part.reshape(part.shape[0], -1)


def joined_int4(parts, k: int) -> Int4Rows:
    """One ``Int4Rows`` for ``parts``' rows one after another (read and joined where there are several)."""
    if len(parts) == 1:
        return parts[0]
    read = [part.read_checked(k) for part in parts]
    return Int4Rows.of(torch.cat([int4_rows(n) for n, _ in read]), torch.cat([p for _, p in read]))


def attach_checkpoint_scales(weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """Mark ``weight`` (e4m3 values as an fp8 checkpoint holds them) with its ``weight_scale_inv``: one fp32 per
    128 x 128 block (``[ceil(N / 128), ceil(K / 128)]``; 3-D experts ``[E, ...]`` per expert, and a fused
    gate_up ``[E, 2I, H]`` has the blocks of gate and up, each of its own rows). ``pack`` then reads it as is
    (fp8) or dequantizes it a chunk at a time (other formats), so no bf16 copy of it ever exists whole. (An int4
    checkpoint's weights: ``attach_int4_parts``.)"""
    if weight.dtype != torch.float8_e4m3fn or scale_inv.dtype != torch.float32:
        raise ValueError(f"an fp8 checkpoint weight is float8_e4m3fn with float32 scales, got {weight.dtype} "
                         f"with {scale_inv.dtype}")
    if scale_inv.dim() != weight.dim() or scale_inv.shape[:-2] != weight.shape[:-2] or \
            scale_inv.shape[-1] != -(-weight.shape[-1] // FP8_GROUP):
        raise ValueError(f"weight_scale_inv {tuple(scale_inv.shape)} does not hold 128 x 128 blocks of a weight "
                         f"{tuple(weight.shape)}")
    _checkpoint_scales[weight] = scale_inv


def checkpoint_scales(weight: torch.Tensor) -> torch.Tensor | None:
    """The scales ``attach_checkpoint_scales`` gave ``weight``, or None (a bf16 weight; an int4 checkpoint's params
    are its parts', ``checkpoint_int4``)."""
    return _checkpoint_scales.get(weight)


def checkpoint_format(weight: torch.Tensor) -> str:
    """The format a weight arrived in: ``fp8`` / ``int4`` for a quantized checkpoint's (with its scales), else bf16."""
    if checkpoint_int4(weight) is not None:
        return "int4"
    return "bf16" if checkpoint_scales(weight) is None else "fp8"


def is_checkpoint_quantized(weight: torch.Tensor) -> bool:
    """Whether ``weight`` holds a quantized checkpoint's values (fp8 with its scales, or int4's parts)."""
    return checkpoint_format(weight) != "bf16"


def forget_checkpoint_scales(weight: torch.Tensor) -> None:
    """``weight`` no longer holds checkpoint values (dequantized, or released after packing)."""
    _checkpoint_scales.pop(weight, None)
    _checkpoint_int4.pop(weight, None)


def dequantize_int4_rows(values: torch.Tensor, params: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """int4 checkpoint nibbles ``values [n, k]`` with their ``params [n, groups, 2]`` in ``dtype``: ``(q - z) * s``
    in fp32 (exact), rounded once."""
    n, k = values.shape
    per_input = params.float().repeat_interleave(INT4_GROUP, dim=1)[:, :k]
    return ((values.float() - per_input[..., 1]) * per_input[..., 0]).to(dtype)


def check_checkpoint_scales(weight: torch.Tensor, scales: torch.Tensor) -> None:
    expected = (-(-weight.shape[0] // FP8_GROUP), -(-weight.shape[1] // FP8_GROUP))
    if tuple(scales.shape) != expected:
        raise ValueError(f"fp8 weight {tuple(weight.shape)}: weight_scale_inv is {tuple(scales.shape)}, expected "
                         f"{expected} (one per 128 x 128 block)")


def refuse_nan_codes(values: torch.Tensor) -> None:
    """e4m3 has two NaN codes (0x7F, 0xFF): no quantizer writes them, a corrupt checkpoint might. The kernels
    decode every other code, so a checkpoint weight holding one is refused rather than poisoning outputs.
    Checked 1 MiB at a time: temporaries the size of a whole chunk would stay in malloc's heap once freed."""
    flat = values.reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), 1 << 20):
        if ((flat[start : start + (1 << 20)] & 0x7F) == 0x7F).any():
            raise ValueError("an fp8 checkpoint weight holds NaN e4m3 codes (0x7F / 0xFF): the checkpoint is "
                             "corrupt or not e4m3")


def dequantize_blocks(values: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """``values [n, k]`` (e4m3) times their 128 x 128 block ``scales``, in ``dtype``: ``q * scale_inv`` in fp32,
    rounded once, as transformers dequantizes an fp8 checkpoint."""
    n, k = values.shape
    per_row = scales.repeat_interleave(FP8_GROUP, dim=0)[:n].repeat_interleave(FP8_GROUP, dim=1)[:, :k]
    return (values.float() * per_row).to(dtype)


def can_pack(layout: str, weights, x_dtype: torch.dtype | None = None, format: str = "bf16") -> str | None:
    """Why ``weights`` (tensors or example values) cannot be packed in ``layout`` and ``format``, or None when
    they can.

    Passes and the loader ask this instead of checking dtypes and block sizes themselves.
    """
    weights = list(weights)
    if any(w is None for w in weights):
        return "weight value unknown"
    check_format(format)
    if format != "bf16" and layout not in QUANTIZED_LAYOUTS:
        return f"{format} weights: the {layout} kernels read bf16 only"
    dtypes = {w.dtype for w in weights}
    if any(w.dtype != torch.bfloat16 and not is_checkpoint_quantized(w) for w in weights):
        return (f"dtype {sorted(map(str, dtypes))}: packed weights are packed from bf16 or from a quantized "
                f"checkpoint's weights (with their scales)")
    if format == "int4" and any(w.shape[-1] % 4 for w in weights):
        return f"in_features {[w.shape[-1] for w in weights]}: int4 reads inputs in fours"
    if len(dtypes) > 1 and layout != "experts":  # experts: gate_up and down are packed apart
        return f"siblings of different dtypes {sorted(map(str, dtypes))}"
    if x_dtype is not None and x_dtype != torch.bfloat16:
        return f"activations are {x_dtype}: packed linears take bf16 activations"
    return layouts.shape_problem(layout, weights)
