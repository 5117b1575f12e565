"""Training blocks: anchors, packed inputs and labels, loss weights, the block-sparse mask."""

import math

import pytest
import torch

from sglang_dflash.train.blocks import (
    block_attention_mask,
    default_gamma,
    loss_weights,
    pack_blocks,
    sample_anchors,
)


@pytest.mark.parametrize("seq_len,block,num_anchors", [(40, 4, 5), (40, 16, 100), (16, 16, 3), (300, 8, 32)])
def test_anchors_are_valid_distinct_sorted(seq_len, block, num_anchors):
    gen = torch.Generator().manual_seed(seq_len + block)
    loss_mask = torch.rand(seq_len, generator=gen) < 0.6
    valid = [a for a in range(1, seq_len - block + 1) if loss_mask[a + 1]]
    for _ in range(20):
        anchors = sample_anchors(loss_mask, block, num_anchors, generator=gen)
        assert anchors.numel() == min(num_anchors, len(valid))
        assert anchors.tolist() == sorted(set(anchors.tolist()))
        assert set(anchors.tolist()) <= set(valid)
        assert all(a + block - 1 <= seq_len - 1 for a in anchors.tolist())


def test_anchors_cover_the_valid_set_uniformly():
    loss_mask = torch.ones(30, dtype=torch.bool)
    loss_mask[:10] = False  # prompt
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(30)
    for _ in range(2000):
        counts[sample_anchors(loss_mask, 4, 3, generator=gen)] += 1
    valid = list(range(9, 27))  # a + 1 >= 10 and a <= 30 - 4
    assert counts[valid].min() > 0 and counts.sum() == 6000
    assert counts[[i for i in range(30) if i not in valid]].sum() == 0
    expected = 6000 / len(valid)
    assert (counts[valid] - expected).abs().max() < 0.25 * expected


def test_no_anchor_when_nothing_fits():
    assert sample_anchors(torch.ones(5, dtype=torch.bool), 8, 4).numel() == 0
    assert sample_anchors(torch.zeros(50, dtype=torch.bool), 4, 4).numel() == 0


def test_loss_weights_decay_from_the_first_draft_row():
    w = loss_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    assert torch.allclose(w[1:], torch.exp(-torch.arange(15) / 7.0))
    assert default_gamma(16) == 7 and default_gamma(8) == 4
    assert math.isclose(loss_weights(8, default_gamma(8))[5].item(), math.exp(-1.0), rel_tol=1e-6)


def test_pack_blocks_inputs_labels_weights():
    ids = torch.arange(100, 130)
    loss_mask = torch.ones(30, dtype=torch.bool)
    loss_mask[12] = False
    anchors = torch.tensor([3, 10])
    packed = pack_blocks(ids, loss_mask, anchors, 4, mask_token_id=7, gamma=4.0)
    assert packed.input_ids.tolist() == [103, 7, 7, 7, 110, 7, 7, 7]
    assert packed.positions.tolist() == [3, 4, 5, 6, 10, 11, 12, 13]
    assert packed.labels.tolist() == [103, 104, 105, 106, 110, 111, 112, 113]
    decay = loss_weights(4, 4.0)
    assert torch.allclose(packed.weights, torch.cat([decay, decay * torch.tensor([1.0, 1.0, 0.0, 1.0])]))


def test_block_mask_matches_its_definition():
    anchors = torch.tensor([2, 5, 9])
    block, ctx = 4, 13
    mask = block_attention_mask(anchors, ctx, block)
    assert mask.shape == (12, ctx + 12) and mask.dtype == torch.bool
    for row in range(12):
        j = row // block
        for key in range(ctx + 12):
            if key < ctx:
                expected = key < anchors[j]
            else:
                expected = (key - ctx) // block == j
            assert bool(mask[row, key]) == expected, (row, key)
