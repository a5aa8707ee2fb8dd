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


def _filled(batch: int, tokens: int) -> TilefxCache:
    """A cache of ``batch`` rows holding ``tokens`` random tokens in every layer."""
    cache = TilefxCache(num_layers=2, kv_heads=2, head_dim=8, max_batch=4, max_seq_len=16, v_head_dim=4)
    cache.start(batch)
    for layer in range(2):
        cache.update(torch.randn(batch, 2, tokens, 8, dtype=torch.bfloat16),
                     torch.randn(batch, 2, tokens, 4, dtype=torch.bfloat16), layer)
    cache.advance(tokens)
    return cache


def test_crop_forgets_the_last_tokens_and_the_next_ones_overwrite_them():
    cache = _filled(1, 6)
    kept = cache.layers[0].keys[:1, :, :4].clone()
    cache.crop(0)
    assert cache.seq_len == 6
    cache.crop(-2)  # transformers' convention: a negative count of tokens to remove
    assert cache.seq_len == 4 and int(cache.length) == 4 and int(cache.get_seq_length()) == 4
    new = torch.randn(1, 2, 1, 8, dtype=torch.bfloat16)
    cache.update(new, torch.randn(1, 2, 1, 4, dtype=torch.bfloat16), 0)
    assert torch.equal(cache.layers[0].keys[:1, :, 4:5], new)
    assert torch.equal(cache.layers[0].keys[:1, :, :4], kept)
    assert cache.is_croppable


def test_crop_refuses_what_it_cannot_do_before_changing_state():
    cache = _filled(1, 3)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(2)
    with pytest.raises(ValueError, match="holds only 3 tokens"):
        cache.crop(-4)
    assert cache.seq_len == 3 and int(cache.length) == 3


def test_reorder_cache_gives_each_row_the_prefix_of_the_row_it_continues():
    cache = _filled(3, 5)
    before = [(layer.keys[:3, :, :5].clone(), layer.values[:3, :, :5].clone()) for layer in cache.layers]
    stale = cache.layers[0].keys[:3, :, 5:].clone()
    beams = torch.tensor([2, 0, 0])
    cache.reorder_cache(beams)
    for layer, (keys, values) in zip(cache.layers, before):
        assert torch.equal(layer.keys[:3, :, :5], keys[beams])
        assert torch.equal(layer.values[:3, :, :5], values[beams])
    assert torch.equal(cache.layers[0].keys[:3, :, 5:], stale)  # past the valid prefix: not read, not copied
    cache.reorder_cache(torch.arange(3))  # every row keeps its own: nothing moves
    assert torch.equal(cache.layers[1].values[:3, :, :5], before[1][1][beams])
    with pytest.raises(ValueError, match="for a batch of 3"):
        cache.reorder_cache(torch.tensor([0, 1]))


def test_a_continued_sequence_must_begin_with_the_cached_tokens():
    """The cache knows which tokens its rows hold (what generate() checks a next turn against), across a crop
    and a beam reorder."""
    cache = make()
    cache.start(2)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    cache.advance(4, ids)
    cache.check_continues(torch.cat([ids, torch.tensor([[1], [2]])], dim=1))
    cache.crop(-1)  # the last token forgotten: a continuation may change it
    cache.check_continues(torch.tensor([[5, 6, 7, 99], [9, 10, 11, 98]]))
    for wrong in (torch.tensor([[5, 6, 0, 8], [9, 10, 11, 12]]),  # another sequence in a row
                  ids[:1],  # another batch
                  ids[:, :2]):  # shorter than what the cache holds
        with pytest.raises(ValueError, match="do not begin with"):
            cache.check_continues(wrong)
    cache.reorder_cache(torch.tensor([1, 1]))  # both beams go on from row 1
    cache.check_continues(torch.tensor([[9, 10, 11], [9, 10, 11]]))
