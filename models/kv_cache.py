"""The KV cache tilefx owns: preallocated once, shapes that never change.

``TilefxCache`` speaks transformers' ``Cache`` API, so the unmodified HF attention
code writes into it. Buffers are ``[max_batch, kv_heads, max_seq_len, head_dim]``
per layer (values ``v_head_dim`` wide), allocated once; a request of batch ``B`` uses
rows ``[:B]``. What a family stores comes from its adapter (``cache_dims``): for
DeepSeek's MLA, HF writes the normalized latent as a one-head key (``kv_lora_rank``)
and the shared rope key as a one-head value (``qk_rope_head_dim``). The
length written so far lives in a 0-d tensor (read by the compiled graph, so it
never becomes a guard) and in a Python int (read on the host, for validation).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tilefx.custom_ops import weights
from tilefx.models.adapters import FamilyAdapter


def _zeros(shape, dtype, device) -> torch.Tensor:
    """Cache buffers on the CPU live in huge pages: decode reads the whole valid prefix every token."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return weights.huge_page_empty(shape, dtype).zero_()


class TilefxCacheLayer(CacheLayerMixin):
    is_compileable = True
    is_sliding = False
    is_croppable = True  # the valid prefix is a length: cropping moves it back (TilefxCache.crop)

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.length = keys, values, length
        self.max_batch, self.num_heads, self.max_cache_len, self.head_dim = keys.shape
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist from the start
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # HF semantics of a static cache: write the new tokens after the valid prefix and
        # return the whole (batch rows of the) buffers; the attention pass turns this plus
        # the attention that reads it into one tilefx attention op over the valid prefix.
        batch, seq = key_states.shape[0], key_states.shape[2]
        positions = torch.arange(seq, device=self.device) + self.length
        self.keys[:batch].index_copy_(2, positions, key_states)
        self.values[:batch].index_copy_(2, positions, value_states)
        return self.keys[:batch], self.values[:batch]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self):
        return self.length

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.length.zero_()


class TilefxCache(Cache):
    """Preallocated KV cache for ``max_batch`` sequences of up to ``max_seq_len`` tokens."""

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        max_batch: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        v_head_dim: int | None = None,
    ):
        if max_batch < 1 or max_seq_len < 2:
            raise ValueError(f"max_batch={max_batch}, max_seq_len={max_seq_len}: need max_batch >= 1, max_seq_len >= 2")
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.seq_len = 0  # host copy of `length`
        self.batch = 0  # rows in use by the current request
        # The token ids each row's cached keys and values are of: a generate() that continues this cache must
        # begin with them (the model has this one cache, and a generate() without it starts another sequence)
        self.tokens = torch.zeros((max_batch, max_seq_len), dtype=torch.long)
        v_head_dim = v_head_dim or head_dim
        layers = [
            TilefxCacheLayer(
                _zeros((max_batch, kv_heads, max_seq_len, head_dim), dtype, device),
                _zeros((max_batch, kv_heads, max_seq_len, v_head_dim), dtype, device),
                self.length,
            )
            for _ in range(num_layers)
        ]
        super().__init__(layers=layers)

    @classmethod
    def for_config(cls, config, adapter: FamilyAdapter, *, max_batch: int, max_seq_len: int, dtype=torch.bfloat16,
                   device="cpu"):
        """The cache of a model with ``config`` (a tensor-parallel rank's: its local heads); ``adapter``: the
        family's (models/adapters.py), which says what a layer caches."""
        dims = adapter.cache_dims(config.get_text_config(decoder=True))
        return cls(
            num_layers=dims["layers"],
            kv_heads=dims["kv_heads"],
            head_dim=dims["k_head_dim"],
            v_head_dim=dims["v_head_dim"],
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            dtype=dtype,
            device=device,
        )

    @property
    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)

    def check_fits(self, batch: int, new_tokens: int, *, continuing: bool) -> None:
        """Raise ValueError, before any state changes, if a request does not fit."""
        if batch > self.max_batch:
            raise ValueError(
                f"batch size {batch} exceeds max_batch={self.max_batch}; "
                f"pass a larger max_batch to tilefx.compile_model() or split the batch"
            )
        if continuing and batch != self.batch:
            raise ValueError(f"batch size changed from {self.batch} to {batch} while continuing a sequence")
        past = self.seq_len if continuing else 0
        if past + new_tokens > self.max_seq_len:
            raise ValueError(
                f"{past} cached + {new_tokens} new tokens = {past + new_tokens} exceeds max_seq_len={self.max_seq_len}; "
                f"pass a larger max_seq_len to tilefx.compile_model() or shorten the prompt / max_new_tokens"
            )

    def start(self, batch: int) -> None:
        """Begin a new request: the valid prefix becomes empty (stale data is never read)."""
        self.length.zero_()
        self.seq_len, self.batch = 0, batch

    def advance(self, tokens: int, input_ids: torch.Tensor | None = None) -> None:
        """The next ``tokens`` positions are written; ``input_ids`` ``[batch, tokens]``: the tokens they hold."""
        if input_ids is not None:
            self.tokens[: input_ids.shape[0], self.seq_len : self.seq_len + tokens] = input_ids
        self.length.add_(tokens)
        self.seq_len += tokens

    def check_continues(self, input_ids: torch.Tensor) -> None:
        """Raise ValueError unless ``input_ids`` begin with the sequences this cache holds (what generate() given
        this cache computes only the rest of)."""
        batch, length = input_ids.shape
        if batch != self.batch or length < self.seq_len or not torch.equal(
                input_ids[:, : self.seq_len].cpu(), self.tokens[:batch, : self.seq_len]):
            raise ValueError(
                f"the cache passed to generate() holds {self.batch} sequence(s) of {self.seq_len} tokens that "
                f"input_ids {tuple(input_ids.shape)} do not begin with. A tilefx model has one KV cache, and each "
                "generate() without it starts a new sequence there: continue only the last sequence generated "
                "(its output ids, then the new ones), or pass the whole conversation without a cache"
            )

    def reset(self) -> None:
        self.start(0)

    def get_seq_length(self, layer_idx: int = 0):
        return self.length

    @property
    def is_compileable(self) -> bool:
        # False keeps generate() from building 4-D masks outside the graph (their shape would
        # change the guards); tilefx's forward normalizes the mask itself.
        return False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` of the batch goes on from the sequence row ``beam_idx[i]`` held.

        Copies the valid prefix of the rows that change, in every layer; rows that keep their own
        sequence are not touched (most steps, most beams).
        """
        beam_idx = beam_idx.to(device="cpu", dtype=torch.long)
        if beam_idx.dim() != 1 or beam_idx.numel() != self.batch:
            raise ValueError(f"reorder_cache: {tuple(beam_idx.shape)} beam indices for a batch of {self.batch}")
        moved = (beam_idx != torch.arange(self.batch)).nonzero()[:, 0]
        if moved.numel() == 0 or self.seq_len == 0:
            return
        sources = beam_idx[moved]
        self.tokens[moved, : self.seq_len] = self.tokens[sources, : self.seq_len]
        for layer in self.layers:
            for buffer in (layer.keys, layer.values):
                prefix = buffer[:, :, : self.seq_len]
                prefix.index_copy_(0, moved, prefix.index_select(0, sources))

    def activate_past_recording(self) -> None:
        """Nothing to record: every token stays in the buffers until overwritten, so a crop loses nothing."""

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count, 0 a no-op).

        Assisted generation verifies draft tokens in one forward and rolls back those it rejects. The buffers
        keep their values past the new length; the next tokens overwrite them and nothing reads them before.
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass the number of tokens to remove as a negative int")
        remove = -tokens_to_remove
        if remove > self.seq_len:
            raise ValueError(f"crop({tokens_to_remove}): the cache holds only {self.seq_len} tokens")
        self.length.sub_(remove)
        self.seq_len -= remove
