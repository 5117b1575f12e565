"""verify_block (CPU kernel): exact against the reference, and statistically lossless."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from sglang_dflash import ops
from sglang_dflash.ops import reference

P_VALUE_FLOOR = 1e-3  # the statistical tests use fixed seeds, so they are deterministic


def sampling_args(bs, temperature=0.0, top_k=0, top_p=1.0, offsets=None):
    return dict(
        temperature=torch.full((bs,), temperature, dtype=torch.float32),
        top_k=torch.full((bs,), top_k, dtype=torch.int32),
        top_p=torch.full((bs,), top_p, dtype=torch.float32),
        offsets=torch.arange(bs, dtype=torch.int64) * 1000 + 17 if offsets is None else offsets,
    )


def drafts_agreeing_with(target_ids, gen, accept_prob=0.8):
    """Candidates whose drafts copy the target's tokens until a random first disagreement."""
    bs, block = target_ids.shape
    cand = torch.randint(0, 1 << 30, (bs, block), generator=gen) % (target_ids.max() + 1)
    cand[:, 1:] = target_ids[:, :-1]
    for b in range(bs):
        for i in range(1, block):
            if torch.rand((), generator=gen) > accept_prob:
                cand[b, i] = (cand[b, i] + 1 + torch.randint(0, 5, (), generator=gen)) % (target_ids.max() + 1)
                break
    return cand


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs,block,vocab", [(1, 1, 7), (3, 4, 1000), (8, 16, 4099), (5, 2, 32000)])
def test_greedy_matches_reference(bs, block, vocab, dtype):
    gen = torch.Generator().manual_seed(bs * 131 + block)
    # A coarse grid of values makes exact ties common, which checks the lowest-index rule.
    logits = (torch.randint(-40, 40, (bs * block, vocab), generator=gen) / 4).to(dtype)
    target = logits.float().argmax(-1).view(bs, block)
    cand = drafts_agreeing_with(target, gen)
    args = sampling_args(bs)
    got = ops.verify_block(cand, logits, seed=5, **args)
    want = reference.verify_block(cand, logits, seed=5, **args)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_greedy_accepts_every_length():
    """Every accept length 0..B-1 occurs and out_tokens has the documented layout."""
    block, vocab = 8, 50
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(block * block, vocab, generator=gen)
    target = logits.argmax(-1).view(block, block)
    cand = torch.empty(block, block, dtype=torch.int64)
    cand[:, 0] = 3
    cand[:, 1:] = target[:, :-1]
    for b in range(block - 1):  # request b disagrees at draft b + 1
        cand[b, b + 1] = (target[b, b] + 1) % vocab
    accept_len, bonus, out = ops.verify_block(cand, logits, seed=0, **sampling_args(block))
    assert accept_len.tolist() == list(range(block))
    for b in range(block):
        assert bonus[b] == target[b, b]
        assert out[b, :b].tolist() == cand[b, 1 : b + 1].tolist()
        assert out[b, b] == bonus[b] and (out[b, b + 1 :] == -1).all()


@pytest.mark.parametrize("ids_dtype,shape_2d", [(torch.int64, True), (torch.int32, False)])
def test_from_ids_matches_reference(ids_dtype, shape_2d):
    gen = torch.Generator().manual_seed(11)
    bs, block = 6, 16
    target = torch.randint(0, 30, (bs, block), generator=gen)
    cand = drafts_agreeing_with(target, gen, accept_prob=0.9)
    ids = (target if shape_2d else target.flatten()).to(ids_dtype)
    got = ops.verify_block_from_ids(cand, ids)
    want = reference.verify_block_from_ids(cand, target)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


STOCHASTIC_CASES = [
    # temperature, top_k, top_p
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.3, 20, 1.0),
    (1.0, 0, 0.9),
    (0.8, 50, 0.5),
    (1.0, 1, 1.0),
    (2.0, 0, 0.05),
    (1.0, 5000, 0.999),  # top-k larger than V: off
]


def stochastic_case(temperature, top_k, top_p, dtype):
    """verify_block's arguments for a STOCHASTIC_CASES row (also run on CUDA by test_cuda_ops):
    drafts that agree with the spec's samples, so every row gets compared, except one request."""
    gen = torch.Generator().manual_seed(int(temperature * 100) + top_k)
    bs, block, vocab = 3, 4, 1203
    logits = (torch.randn(bs * block, vocab, generator=gen) * 3).to(dtype)
    cand = torch.randint(0, vocab, (bs, block), generator=gen)
    args = dict(logits=logits, **sampling_args(bs, temperature, top_k, top_p), seed=99)
    cand[:, 1:] = reference.target_samples(**args, block_size=block)[:, :-1]
    cand[0, 2] = (cand[0, 2] + 1) % vocab
    return dict(candidates=cand, **args)


@pytest.mark.parametrize("temperature,top_k,top_p", STOCHASTIC_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stochastic_matches_reference(temperature, top_k, top_p, dtype):
    """Same Philox noise, same filters: the kernel's samples equal the spec's, row by row."""
    case = stochastic_case(temperature, top_k, top_p, dtype)
    for g, w in zip(ops.verify_block(**case), reference.verify_block(**case), strict=True):
        assert torch.equal(g, w)


def test_mixed_batch_greedy_and_sampled():
    gen = torch.Generator().manual_seed(4)
    bs, block, vocab = 4, 4, 300
    logits = torch.randn(bs * block, vocab, generator=gen)
    cand = torch.randint(0, vocab, (bs, block), generator=gen)
    args = dict(
        temperature=torch.tensor([0.0, 1.0, -1.0, 0.5]),
        top_k=torch.tensor([0, 10, 3, 0], dtype=torch.int32),
        top_p=torch.tensor([1.0, 0.8, 0.1, 1.0]),
        offsets=torch.tensor([5, 6, 7, -8]),
    )
    for g, w in zip(ops.verify_block(cand, logits, seed=-3, **args),
                    reference.verify_block(cand, logits, seed=-3, **args), strict=True):
        assert torch.equal(g, w)


def first_tokens(logits_row, n, temperature, top_k, top_p, seed, offsets):
    """The bonus of n requests that share one row of logits and whose only draft never matches."""
    vocab = logits_row.numel()
    cand = torch.full((n, 2), vocab - 1, dtype=torch.int64)
    logits = torch.stack([logits_row, torch.zeros_like(logits_row)]).repeat(n, 1)
    logits[0::2, vocab - 1] = -1e9  # the draft token is never sampled in row 0
    args = sampling_args(n, temperature, top_k, top_p, offsets=offsets)
    accept_len, bonus, _ = ops.verify_block(cand, logits, seed=seed, **args)
    assert (accept_len == 0).all()
    return bonus


def filtered_probs(logits_row, temperature, top_k, top_p):
    x = logits_row.float() * (1.0 / torch.tensor(temperature))
    keep = reference.sampling_mask(x, top_k, top_p)
    return torch.softmax(x.masked_fill(~keep, float("-inf")), 0).double().numpy()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 6, 1.0),
                                                     (1.0, 0, 0.7), (1.5, 8, 0.9)])
def test_first_token_follows_target_distribution(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(21)
    vocab, n = 16, 20000
    row = torch.randn(vocab, generator=gen) * 1.5
    row[vocab - 1] = -1e9
    bonus = first_tokens(row, n, temperature, top_k, top_p, seed=1234,
                         offsets=torch.arange(n, dtype=torch.int64) * 7 + 3)
    probs = filtered_probs(row, temperature, top_k, top_p)
    counts = np.bincount(bonus.numpy(), minlength=vocab)
    assert counts[probs == 0].sum() == 0, "sampled a token the filters exclude"
    support = probs > 0
    if support.sum() > 1:
        expected = probs[support] / probs[support].sum() * counts.sum()
        result = stats.chisquare(counts[support], expected)
        assert result.pvalue > P_VALUE_FLOOR, (counts, probs * n)


def test_accept_length_follows_its_law():
    """P(accept >= n) = prod_{i<n} p_i(draft_{i+1}) for a fixed block of drafts."""
    gen = torch.Generator().manual_seed(8)
    block, vocab, n = 5, 6, 20000
    rows = torch.randn(block, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (block,), generator=gen)
    probs = torch.softmax(rows, -1).double()
    p_match = [float(probs[i, drafts[i + 1]]) for i in range(block - 1)]
    law = []
    survive = 1.0
    for i in range(block):
        stop = 1 - p_match[i] if i < block - 1 else 1.0
        law.append(survive * stop)
        survive *= p_match[i] if i < block - 1 else 0.0
    cand = drafts.repeat(n, 1)
    logits = rows.repeat(n, 1)
    args = sampling_args(n, 1.0, offsets=torch.arange(n, dtype=torch.int64) * 3 + 1)
    accept_len, _, _ = ops.verify_block(cand, logits, seed=77, **args)
    counts = np.bincount(accept_len.numpy(), minlength=block)
    law = np.array(law) / sum(law)
    assert stats.chisquare(counts, law * counts.sum()).pvalue > P_VALUE_FLOOR, (counts, law)


def test_same_seed_same_result_and_offsets_independent():
    gen = torch.Generator().manual_seed(2)
    vocab, n = 8, 8000
    row = torch.randn(vocab, generator=gen)
    offsets = torch.arange(n, dtype=torch.int64)
    a = first_tokens(row, n, 1.0, 0, 1.0, seed=5, offsets=offsets)
    assert torch.equal(a, first_tokens(row, n, 1.0, 0, 1.0, seed=5, offsets=offsets))
    # Another seed, and shifted offsets, give samples independent of the first ones.
    for b in (first_tokens(row, n, 1.0, 0, 1.0, seed=6, offsets=offsets),
              first_tokens(row, n, 1.0, 0, 1.0, seed=5, offsets=offsets + n)):
        table = np.zeros((vocab, vocab))
        np.add.at(table, (a.numpy(), b.numpy()), 1)
        table = table[table.sum(1) > 0][:, table.sum(0) > 0]
        assert stats.chi2_contingency(table).pvalue > P_VALUE_FLOOR


def test_rows_of_a_block_get_independent_noise():
    """Rows 0 and 1 of one request must not reuse noise: their samples are independent."""
    gen = torch.Generator().manual_seed(9)
    vocab, n = 6, 8000
    row = torch.randn(vocab, generator=gen)
    row[vocab - 1] = -1e9  # never sampled, so a draft of vocab - 1 is always rejected
    logits = torch.stack([row, row]).repeat(n, 1)
    args = sampling_args(n, 1.0, offsets=torch.arange(n, dtype=torch.int64))
    cand = torch.full((n, 2), vocab - 1, dtype=torch.int64)
    first = ops.verify_block(cand, logits, seed=3, **args)[1]  # row 0's sample
    cand[:, 1] = first
    accept_len, second, _ = ops.verify_block(cand, logits, seed=3, **args)  # row 1's sample
    assert (accept_len == 1).all()
    table = np.zeros((vocab, vocab))
    np.add.at(table, (first.numpy(), second.numpy()), 1)
    table = table[table.sum(1) > 0][:, table.sum(0) > 0]
    assert stats.chi2_contingency(table).pvalue > P_VALUE_FLOOR


def test_gumbel_noise_uses_philox_known_answer():
    """The reference Philox4x32-10 reproduces the Random123 known-answer vectors."""
    zero = torch.zeros(1, dtype=torch.int64)
    assert [int(x) for x in reference.philox4x32_10([zero] * 4, (0, 0))] == [
        0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = torch.full((1,), 0xFFFFFFFF, dtype=torch.int64)
    assert [int(x) for x in reference.philox4x32_10([ones] * 4, (0xFFFFFFFF, 0xFFFFFFFF))] == [
        0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.9, 7, 0.8)])
def test_masked_logits(temperature, top_k, top_p):
    """-inf logits (grammar or banned-token masks) are never chosen, and match the reference."""
    gen = torch.Generator().manual_seed(31)
    bs, block, vocab = 4, 3, 333
    logits = torch.randn(bs * block, vocab, generator=gen)
    logits[torch.rand(bs * block, vocab, generator=gen) < 0.7] = float("-inf")
    logits[0, :-1] = float("-inf")  # only the last token allowed
    logits[0, -1] = 0.5
    cand = torch.randint(0, vocab, (bs, block), generator=gen)
    args = sampling_args(bs, temperature, top_k, top_p)
    got = ops.verify_block(cand, logits, seed=8, **args)
    for g, w in zip(got, reference.verify_block(cand, logits, seed=8, **args), strict=True):
        assert torch.equal(g, w)
    assert got[1][0] == vocab - 1
    assert torch.isfinite(logits.view(bs, block, vocab)[torch.arange(bs), got[0].long(), got[1]]).all()
