"""GrowingCache: appends in place, rolls back by shortening its view, and always shows exactly the
concatenation of what was kept (checked against a plain list of the updates)."""

from __future__ import annotations

import pytest
import torch

from sglang_dflash.engine.kv_cache import MIN_SPARE_COLUMNS, GrowingCache, GrowingLayer


def _update(cache, layer, n, bs=2, heads=3, dim=8, gen=None):
    k = torch.randn(bs, heads, n, dim, generator=gen)
    v = torch.randn(bs, heads, n, dim, generator=gen)
    keys, values = cache.update(k, v, layer)
    return k, v, keys, values


def test_updates_rollbacks_and_growth_match_concatenation():
    gen = torch.Generator().manual_seed(0)
    cache = GrowingCache()
    want = {layer: ([], []) for layer in range(2)}  # per layer: kept key and value pieces
    buffers = set()
    for n, keep in [(37, 37), (4, 2), (1, 1), (8, 0), (5, 3)] + [(4, 1)] * 40:
        for layer, (want_k, want_v) in want.items():
            k, v, keys, values = _update(cache, layer, n, gen=gen)
            want_k.append(k)
            want_v.append(v)
            torch.testing.assert_close(keys, torch.cat(want_k, dim=2), rtol=0, atol=0)
            torch.testing.assert_close(values, torch.cat(want_v, dim=2), rtol=0, atol=0)
            # Roll back the rejected tail the way the target adapter does: a shorter view.
            lay = cache.layers[layer]
            kept = lay.keys.shape[2] - (n - keep)
            lay.keys, lay.values = lay.keys[:, :, :kept], lay.values[:, :, :kept]
            want_k[-1], want_v[-1] = k[:, :, :keep], v[:, :, :keep]
        buffers.add(cache.layers[0]._key_buffer.data_ptr())
    assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 37 + 2 + 1 + 0 + 3 + 40
    # ~80 tokens: the first capacity plus at most one growth, never a copy per step.
    assert len(buffers) <= 2


def test_growth_keeps_contents_and_leaves_spare_columns():
    cache = GrowingCache()
    k, v, keys, _ = _update(cache, 0, 10)
    buffer = cache.layers[0]._key_buffer
    assert buffer.shape[2] == 10 + MIN_SPARE_COLUMNS
    assert keys.data_ptr() == buffer.data_ptr()
    k2, v2, keys, values = _update(cache, 0, MIN_SPARE_COLUMNS + 1)  # past the capacity: regrow
    assert cache.layers[0]._key_buffer.data_ptr() != buffer.data_ptr()
    torch.testing.assert_close(keys, torch.cat([k, k2], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat([v, v2], dim=2), rtol=0, atol=0)


def test_keys_replaced_from_outside_are_copied_into_a_fresh_buffer():
    """A batch gather (`keys[rows]`) is not a prefix of the buffer: the next update must start from
    it, not from the stale buffer."""
    cache = GrowingCache()
    k, v, _, _ = _update(cache, 0, 6, bs=3)
    layer = cache.layers[0]
    rows = torch.tensor([2, 0])
    layer.keys, layer.values = layer.keys[rows], layer.values[rows]
    k2, v2, keys, values = _update(cache, 0, 2, bs=2)
    torch.testing.assert_close(keys, torch.cat([k[rows], k2], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat([v[rows], v2], dim=2), rtol=0, atol=0)


def test_batch_mismatch_is_an_error():
    cache = GrowingCache()
    _update(cache, 0, 4, bs=2)
    with pytest.raises(ValueError, match="batch 3 on a cache of batch 2"):
        _update(cache, 0, 1, bs=3)
