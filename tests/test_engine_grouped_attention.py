"""The "sdpa_grouped" attention: the same values as HF's own sdpa path (KV heads repeated, boolean
mask handed to SDPA), and its per-forward mask preparation reused across layers only while it is
valid (same mask tensor, unchanged, same group / length / dtype) and dropped with the mask."""

from __future__ import annotations

import gc
import types

import pytest
import torch
import torch.nn.functional as F

from sglang_dflash.engine import grouped_attention
from sglang_dflash.engine.grouped_attention import grouped_additive_mask, grouped_sdpa_forward

MODULE = types.SimpleNamespace(training=False, is_causal=True)


def _hf_sdpa(query, key, value, mask):
    """HF's sdpa path: repeat every KV head over its query heads, boolean mask as given."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    mask = None if mask is None else mask[..., :key.shape[2]]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs,heads,kv_heads,q,kv",
                         [(1, 9, 3, 2, 40), (3, 4, 1, 5, 17), (2, 6, 6, 1, 9), (2, 8, 2, 8, 64)])
def test_matches_hf_sdpa_with_repeated_kv_heads(dtype, bs, heads, kv_heads, q, kv):
    gen = torch.Generator().manual_seed(bs * 100 + q * 10 + kv)
    query = torch.randn(bs, heads, q, 16, generator=gen).to(dtype)
    key = torch.randn(bs, kv_heads, kv, 16, generator=gen).to(dtype)
    value = torch.randn(bs, kv_heads, kv, 16, generator=gen).to(dtype)
    # Left padding per row (as the engine's batched cache has) and the block's causal part; a wider
    # mask than kv (HF may pass one) is cut to kv.
    valid = torch.arange(kv + 3)[None] >= torch.randint(0, kv // 2, (bs, 1), generator=gen)
    causal = torch.ones(q, kv + 3, dtype=torch.bool).tril(kv - q)
    mask = (valid[:, None, None, :] & causal[None, None]).clone()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for _ in range(2):  # the second call reuses the prepared mask
        got, _ = grouped_sdpa_forward(MODULE, query, key, value, mask)
        torch.testing.assert_close(got, _hf_sdpa(query, key, value, mask), rtol=tol, atol=tol)
    # No mask: causal over the last q keys, spelled out.
    got, _ = grouped_sdpa_forward(MODULE, query, key, value, None)
    want = _hf_sdpa(query, key, value, torch.ones(q, kv, dtype=torch.bool).tril(kv - q)[None, None])
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_prepared_mask_is_bitwise_what_sdpa_made_of_the_boolean_mask():
    """Reusing the additive mask changes no bit: the output equals SDPA given the boolean mask
    repeated over the group (the per-layer path this replaced)."""
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(2, 3, 4 * 3, 32, generator=gen)  # 3 KV heads, each with a group of 3 x 4 query rows
    key, value = (torch.randn(2, 3, 20, 32, generator=gen) for _ in range(2))
    mask = torch.rand(2, 1, 4, 20, generator=gen) > 0.4
    mask[..., 0] = True
    repeated = mask[:, :, None].expand(2, 1, 3, 4, 20).reshape(2, 1, 12, 20)
    want = F.scaled_dot_product_attention(query, key, value, attn_mask=repeated)
    for _ in range(3):
        prepared = grouped_additive_mask(mask, 3, 20, query.dtype)
        got = F.scaled_dot_product_attention(query, key, value, attn_mask=prepared)
        assert torch.equal(got, want)


def test_prepared_mask_is_reused_only_while_valid():
    mask = torch.rand(2, 1, 3, 12, generator=torch.Generator().manual_seed(1)) > 0.5
    first = grouped_additive_mask(mask, 2, 10, torch.float32)
    assert grouped_additive_mask(mask, 2, 10, torch.float32) is first  # the next layer's call
    # The rows are (query head of the group, query position): the mask repeats once per head.
    want = torch.where(mask[..., :10], 0.0, float("-inf")).repeat(1, 1, 3, 1)
    assert torch.equal(grouped_additive_mask(mask, 3, 10, torch.float32), want)  # another group
    assert grouped_additive_mask(mask, 3, 11, torch.float32).shape == (2, 1, 9, 11)  # another length
    assert grouped_additive_mask(mask, 3, 11, torch.bfloat16).dtype == torch.bfloat16  # another dtype
    before = grouped_additive_mask(mask, 3, 10, torch.float32)
    mask[:, :, :, 0] = ~mask[:, :, :, 0]  # changed in place: prepared anew
    after = grouped_additive_mask(mask, 3, 10, torch.float32)
    assert after is not before
    assert torch.equal(after, torch.where(mask[..., :10], 0.0, float("-inf")).repeat(1, 1, 3, 1))
    equal_copy = mask.clone()  # equal values, another tensor: prepared anew, not looked up by value
    assert grouped_additive_mask(equal_copy, 3, 10, torch.float32) is not after
    additive = torch.randn(1, 1, 2, 5)
    assert torch.equal(grouped_additive_mask(additive, 2, 5, torch.float32), additive.repeat(1, 1, 2, 1))


def test_prepared_mask_is_dropped_with_its_mask():
    mask = torch.ones(1, 1, 2, 8, dtype=torch.bool)
    grouped_additive_mask(mask, 3, 8, torch.float32)
    assert getattr(grouped_attention._last, "entry", None) is not None
    del mask
    gc.collect()
    assert getattr(grouped_attention._last, "entry", None) is None
