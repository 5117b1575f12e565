"""gumbel_argmax (the drafter's noise-coupled sampler) against its pure-PyTorch spec, against the
target sample verify_block draws from the same noise, and its argument errors."""

from __future__ import annotations

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash.ops import reference


def _inputs(rows, n, dtype, scale, seed, with_ids):
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(rows, n, generator=g) * scale).to(dtype)
    scores[:, torch.randperm(n, generator=g)[: n // 5]] = float("-inf")  # masked columns never win
    ids = torch.randperm(4 * n + 3, generator=g)[:n] if with_ids else None  # a scattered sub-vocabulary
    offsets = torch.randint(0, 1 << 40, (rows,), generator=g) | (torch.arange(rows) << 33)
    row_ids = torch.randint(0, 16, (rows,), generator=g)
    return scores, ids, offsets, row_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n", [(1, 1), (3, 7), (5, 1000), (2, 16384)])
@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # noise-dominated .. score-dominated
@pytest.mark.parametrize("with_ids", [False, True])
def test_matches_reference(dtype, rows, n, scale, with_ids):
    scores, ids, offsets, row_ids = _inputs(rows, n, dtype, scale, rows * 7919 + n, with_ids)
    if n == 1:
        scores.fill_(0.5)
    seed = 1234567 + n
    out = ops.gumbel_argmax(scores, ids, seed, offsets, row_ids)
    want = reference.gumbel_argmax(scores, ids, seed, offsets, row_ids)
    assert out.dtype == torch.int64 and out.shape == (rows,)
    assert torch.equal(out, want)


def test_noise_decides_among_equal_scores_and_ties_take_the_lowest_column():
    n = 4096
    scores = torch.zeros(6, n)
    offsets = torch.arange(6) * 977
    rows = torch.zeros(6, dtype=torch.int64)
    out = ops.gumbel_argmax(scores, None, 5, offsets, rows)
    assert torch.equal(out, reference.gumbel_argmax(scores, None, 5, offsets, rows))
    assert len(set(out.tolist())) > 1  # the noise, not the (equal) scores, picks the column
    # The same id in two columns draws the same noise: an exact tie, won by the lower column.
    ids = torch.tensor([int(out[0]), 17, int(out[0])])
    assert ops.gumbel_argmax(torch.zeros(1, 3), ids, 5, offsets[:1], rows[:1]).item() == 0


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_agrees_with_the_target_sample_of_verify_block(temperature):
    """Scores = the target's own logits / T: the pick is exactly the token verify_block samples in
    that row, over the full vocabulary and over any sub-vocabulary that contains it."""
    g = torch.Generator().manual_seed(3)
    bs, block, vocab = 3, 4, 5000
    logits = torch.randn(bs * block, vocab, generator=g) * 3
    offsets = torch.randint(0, 1 << 50, (bs,), generator=g)
    temp = torch.full((bs,), temperature)
    target = reference.target_samples(logits, temp, torch.zeros(bs, dtype=torch.int32), torch.ones(bs),
                                      11, offsets, block)
    row_ids = torch.arange(block).repeat(bs)
    req_offsets = offsets.repeat_interleave(block)
    picked = ops.gumbel_argmax(logits / temperature, None, 11, req_offsets, row_ids)
    assert torch.equal(picked.view(bs, block), target)
    sub = torch.unique(torch.cat([target.flatten(), torch.randperm(vocab, generator=g)[:700]]))
    sub = sub[torch.randperm(sub.numel(), generator=g)]
    picked_sub = ops.gumbel_argmax((logits / temperature)[:, sub], sub, 11, req_offsets, row_ids)
    assert torch.equal(sub[picked_sub].view(bs, block), target)
    # And through the kernel itself: drafts picked this way are all accepted.
    candidates = torch.cat([torch.zeros(bs, 1, dtype=torch.int64), target[:, :-1]], dim=1)
    accept, _, _ = ops.verify_block(candidates, logits, temp, torch.zeros(bs, dtype=torch.int32),
                                    torch.ones(bs), 11, offsets)
    assert accept.tolist() == [block - 1] * bs


def test_meta_shape():
    out = ops.gumbel_argmax(torch.empty(3, 9, device="meta"), None, 0, torch.empty(3, dtype=torch.int64, device="meta"),
                            torch.empty(3, dtype=torch.int64, device="meta"))
    assert out.shape == (3,) and out.dtype == torch.int64


def _ok():
    return torch.randn(2, 5), torch.arange(5), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)


@pytest.mark.parametrize("change,match", [
    (dict(scores=torch.randn(5)), r"scores must be 2-D \[R, n\]"),
    (dict(scores=torch.randn(2, 5).double()), r"scores must be float32, bfloat16 or float16"),
    (dict(scores=torch.randn(2, 0)), r"scores must have at least one column"),
    (dict(scores=torch.randn(5, 2).T), r"scores must have a contiguous last dimension"),
    (dict(ids=torch.arange(4)), r"ids.shape\[0\] must be n = scores.shape\[1\] = 5"),
    (dict(ids=torch.arange(5).int()), r"ids must be Long"),
    (dict(ids=torch.tensor([0, 1, 2, 3, -4])), r"ids\[4\] = -4 is outside the token ids \[0, 2\^34\)"),
    (dict(offsets=torch.zeros(3, dtype=torch.int64)), r"offsets.shape\[0\] must be R = scores.shape\[0\] = 2"),
    (dict(rows=torch.zeros(2, dtype=torch.int32)), r"rows must be Long"),
    (dict(rows=torch.tensor([0, 1 << 32])), r"rows\[1\] = 4294967296 is outside the verify rows \[0, 2\^32\)"),
])
def test_rejects(change, match):
    scores, ids, offsets, rows = _ok()
    args = dict(scores=scores, ids=ids, offsets=offsets, rows=rows) | change
    with pytest.raises(ValueError, match=match):
        ops.gumbel_argmax(args["scores"], args["ids"], 0, args["offsets"], args["rows"])


def test_row_i_at_offset_o_draws_the_noise_of_row_0_at_offset_o_plus_i():
    """The noise key is offset + row: what lets the engine key every sample by its position."""
    g = torch.Generator().manual_seed(9)
    scores = torch.randn(6, 3000, generator=g)
    offsets = torch.randint(0, 1 << 50, (6,), generator=g)
    rows = torch.tensor([0, 1, 2, 5, 9, 15])
    shifted = ops.gumbel_argmax(scores, None, 4, offsets + rows, torch.zeros(6, dtype=torch.int64))
    assert torch.equal(ops.gumbel_argmax(scores, None, 4, offsets, rows), shifted)
    assert torch.equal(reference.gumbel_noise(4, 1000, 3, 64), reference.gumbel_noise(4, 1003, 0, 64))
    assert not torch.equal(reference.gumbel_noise(4, 1000, 3, 64), reference.gumbel_noise(4, 1000, 0, 64))
