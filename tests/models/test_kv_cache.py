"""The tilefx KV cache: preallocated, checks before any state changes."""

import pytest
import torch

from tilefx.models.kv_cache import TilefxCache


def make():
    return TilefxCache(num_layers=2, kv_heads=2, head_dim=8, max_batch=2, max_seq_len=16)


def test_preallocated_once():
    cache = make()
    assert len(cache.layers) == 2 and cache.layers[0].keys.shape == (2, 2, 16, 8)
    assert cache.nbytes == 2 * 2 * (2 * 2 * 16 * 8) * 2


def test_check_fits_rejects_before_changing_state():
    cache = make()
    cache.start(1)
    cache.advance(10)
    with pytest.raises(ValueError, match="exceeds max_batch=2"):
        cache.check_fits(3, 1, continuing=False)
    with pytest.raises(ValueError, match="10 cached \\+ 7 new tokens = 17 exceeds max_seq_len=16"):
        cache.check_fits(1, 7, continuing=True)
    with pytest.raises(ValueError, match="batch size changed"):
        cache.check_fits(2, 1, continuing=True)
    assert cache.seq_len == 10 and int(cache.length) == 10
    cache.check_fits(1, 6, continuing=True)
    cache.check_fits(2, 16, continuing=False)


def test_update_writes_after_valid_prefix():
    cache = make()
    cache.start(1)
    cache.advance(3)
    k = torch.randn(1, 2, 2, 8, dtype=torch.bfloat16)
    keys, _ = cache.update(k, k, 0)
    assert keys.shape == (1, 2, 16, 8)
    assert torch.equal(cache.layers[0].keys[:1, :, 3:5], k)


def test_bad_sizes():
    with pytest.raises(ValueError, match="max_batch"):
        TilefxCache(num_layers=1, kv_heads=1, head_dim=8, max_batch=0, max_seq_len=16)
