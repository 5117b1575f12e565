"""The training forward gives each block exactly what inference gives it (same mask, positions)."""

import pytest
import torch

from sglang_dflash.train.blocks import block_attention_mask
from sglang_dflash.train.forward import training_hidden
from tests.dflash_testlib import random_draft, tiny_target


@pytest.mark.parametrize("overrides", [{}, {"causal": True},
                                       {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 5}])
def test_training_blocks_equal_inference_blocks(overrides):
    target = tiny_target("llama", seed=2)
    block = 4
    draft = random_draft(target, layers=2, block_size=block, seed=4, **overrides)
    seq_len, anchors = 30, torch.tensor([1, 7, 8, 19, 26])
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(seq_len, draft.fc.in_features, generator=gen)
    embeds = torch.randn(anchors.numel() * block, draft.config.hidden_size, generator=gen)
    positions = (anchors[:, None] + torch.arange(block)).reshape(-1)
    trained = training_hidden(draft, features, embeds, positions, anchors, block)

    for j, a in enumerate(anchors.tolist()):
        draft.allocate_cache(num_slots=64, max_requests=1, max_context=64)
        draft.append_context([0], [a], features[:a])
        rows = slice(j * block, (j + 1) * block)
        inferred = draft(embeds[rows], torch.tensor([0]), block)
        torch.testing.assert_close(trained[rows], inferred, rtol=1e-4, atol=1e-4)


def test_mask_has_no_cross_block_leaks():
    mask = block_attention_mask(torch.tensor([3, 4]), 6, 2)
    assert mask[:2, 6:8].all() and not mask[:2, 8:].any() and not mask[2:, 6:8].any()
