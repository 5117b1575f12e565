"""top_k_logprobs (CPU kernel) against the pure-PyTorch reference (log_softmax, then a stable
descending sort): the indices exactly, equal logits (bf16 rows of a draft vocabulary hold many)
lower index first, -inf logits, strided inputs; the log-probabilities to fp32 rounding; its
argument errors."""

from __future__ import annotations

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash.ops import reference


def check(logits, k):
    want_values, want_ids = reference.top_k_logprobs(logits, k)
    values, ids = ops.top_k_logprobs(logits, k)
    assert values.dtype == torch.float32 and ids.dtype == torch.int64
    assert values.shape == ids.shape == (*logits.shape[:-1], k)
    assert torch.equal(ids, want_ids)
    finite = want_values.isfinite()
    assert torch.equal(finite, values.isfinite()) and torch.equal(values[~finite], want_values[~finite])
    torch.testing.assert_close(values[finite], want_values[finite], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 7, 49152), (3, 100), (5, 17), (2, 3, 1000), (4, 1)])
@pytest.mark.parametrize("k", [1, 4, 16])
def test_matches_reference(dtype, shape, k):
    gen = torch.Generator().manual_seed(hash((str(dtype), shape, k)) % 10_000)
    scale = torch.exp(torch.randn(*shape[:-1], 1, generator=gen))  # from flat to peaked rows
    logits = (torch.randn(shape, generator=gen) * 3 * scale).to(dtype)
    check(logits, min(k, shape[-1]))


def test_equal_logits_go_lower_index_first():
    logits = torch.zeros(2, 37)
    logits[1, [5, 9, 30]] = 2.0
    values, ids = ops.top_k_logprobs(logits, 5)
    assert ids.tolist() == [[0, 1, 2, 3, 4], [5, 9, 30, 0, 1]]
    torch.testing.assert_close(values[0], torch.full((5,), -torch.log(torch.tensor(37.0)).item()))
    check(torch.randint(-3, 3, (6, 500)).float(), 12)  # ties everywhere


def test_minus_infinity_and_whole_vocabulary():
    logits = torch.randn(3, 40)
    logits[:, ::3] = float("-inf")  # masked-out ids: last, in index order
    check(logits, 40)
    check(logits, 20)
    values, _ = ops.top_k_logprobs(logits, 40)
    torch.testing.assert_close(values.exp().sum(-1), torch.ones(3))


def test_strided_logits():
    base = torch.randn(2, 6, 300)
    check(base[:, 1:], 4)  # a draft block's positions 1.. of a [bs, B, V] tensor
    check(torch.randn(300, 5).t(), 4)  # transposed: the last dimension strided


def test_meta_and_errors():
    values, ids = ops.top_k_logprobs(torch.empty(2, 3, 50, device="meta"), 4)
    assert values.shape == ids.shape == (2, 3, 4) and values.dtype == torch.float32 and ids.dtype == torch.int64
    with pytest.raises(ValueError, match=r"k must be in \[1, V = 50\]"):
        ops.top_k_logprobs(torch.randn(2, 50), 51)
    with pytest.raises(ValueError, match=r"k must be in \[1, V = 50\]"):
        ops.top_k_logprobs(torch.randn(2, 50), 0)
    with pytest.raises(ValueError, match="logits must be float32, bfloat16 or float16"):
        ops.top_k_logprobs(torch.ones(2, 50, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="logits must have at least 1 dimension"):
        ops.top_k_logprobs(torch.tensor(1.0), 1)
    logits = torch.randn(3, 50)
    logits[2, 7] = float("nan")
    with pytest.raises(ValueError, match="logits row 2 holds NaN"):
        ops.top_k_logprobs(logits, 3)
