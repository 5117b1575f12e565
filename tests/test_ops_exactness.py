"""Kernel tests a wrong kernel cannot pass, on every device (the CPU always, CUDA where present).

- block_attention's mask, exactly: with q = 0 every score is equal, and with V = the key's position
  each output row is the mean of the positions it sees, a closed form that any off-by-one in the
  causal, bidirectional or sliding-window rule moves by at least 0.5.
- The same, and the per-(row, head) accuracy tests, under forced flash-decoding split counts on CUDA
  (1 and 32, many of them empty; the knob is read once per process, so one subprocess each).
- gumbel_argmax's picks equal the reference's, a difference allowed only where the two picks' noisy
  scores, recomputed in float64, are a near-tie that float rounding may decide either way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash.ops import reference
from sglang_dflash.ops.testing import make_attention_inputs, on_device
from tests.kernel_devices import DEVICES, cuda_ready

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------
# block_attention: the mask

MASK_CASES = [
    # bs, B, Hq, Hkv, D, ctx_lens, window, causal
    (3, 16, 4, 2, 64, [0, 63, 300], -1, False),  # bidirectional block, 64-key tile edges
    (2, 16, 8, 2, 128, [64, 129], -1, True),  # causal block
    (2, 8, 4, 1, 64, [200, 5], 7, False),  # sliding window, bidirectional
    (2, 16, 4, 4, 64, [130, 1], 33, True),  # sliding window, causal
    (1, 4, 2, 1, 64, [10], 1, False),  # window 1: each row sees only itself
    (1, 8, 2, 1, 256, [95], 40, False),  # D 256: 32-key tiles on CUDA
    (1, 16, 32, 4, 64, [100], 20, True),  # 16 x 8 query rows per kv head: two CUDA row tiles
    (2, 4, 6, 2, 80, [17, 70], -1, True),  # D 80: the CUDA SIMT kernel in every dtype
    (3, 1, 4, 2, 64, [0, 1, 450], -1, True),  # B = 1 (decode)
]


def visible_mean(ctx: int, block: int, i: int, window: int, causal: bool) -> float:
    """The mean position of the keys row i of a block after `ctx` context tokens sees: they are the
    positions [lo, hi] (docs/design.md §3.1), so the mean is (lo + hi) / 2."""
    pos = ctx + i
    lo, hi = 0, pos if causal else ctx + block - 1
    if window >= 1:
        lo, hi = max(lo, pos - window + 1), min(hi, pos + window - 1)
    return (lo + hi) / 2


def mask_inputs(case, dtype, seed):
    """Random inputs with q = 0 and V = each key's position; the slots no request uses hold NaN in K
    and V, so reading one shows in the output."""
    bs, block, hq, hkv, d, ctx_lens, _, _ = case
    args = make_attention_inputs(bs, block, hq, hkv, d, ctx_lens, dtype, seed=seed)
    args["q"].zero_()
    k_cache, v_cache = args["k_cache"], args["v_cache"]
    used = torch.zeros(k_cache.shape[0], dtype=torch.bool)
    for b, ctx in enumerate(ctx_lens):
        slots = args["req_to_token"][int(args["req_pool_indices"][b]), :ctx].long()
        used[slots] = True
        v_cache[slots] = torch.arange(ctx, dtype=dtype)[:, None, None]
        args["v_block"][b * block : (b + 1) * block] = torch.arange(ctx, ctx + block, dtype=dtype)[:, None, None]
    k_cache[~used] = float("nan")
    v_cache[~used] = float("nan")
    return args


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16 cannot hold positions > 256
@pytest.mark.parametrize("case", MASK_CASES, ids=[f"case{i}" for i in range(len(MASK_CASES))])
def test_block_attention_mask_is_exact(case, dtype, device):
    bs, block, hq, _, d, ctx_lens, window, causal = case
    args = on_device(mask_inputs(case, dtype, seed=MASK_CASES.index(case)), device)
    out = ops.block_attention(**args, block_size=block, window=window, causal_block=causal).double().cpu()
    expected = torch.tensor([visible_mean(ctx, block, i, window, causal) for ctx in ctx_lens for i in range(block)],
                            dtype=torch.float64)
    # Equal weights of exactly 1 and integer positions: the fp32 sums are exact, so the output is
    # the mean up to the final division (~2^-23); in fp16 it is exactly representable.
    err = (out - expected[:, None, None]).abs().amax(-1) / expected.clamp_min(1)[:, None]
    row, head = divmod(int(err.argmax()), hq)
    assert err.max() <= 2.0**-20, (
        f"query row {row} (request {row // block}, block row {row % block}), head {head}: mean position "
        f"{out[row, head, 0].item()}, its visible keys' is {expected[row].item()}")
    ops.check_device_errors(device)


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA GPU and the CUDA kernels")
@pytest.mark.parametrize("splits", [1, 32])
def test_block_attention_forced_split_counts(splits):
    """The exact mask test and the CUDA accuracy tests (per (row, head) against the reference and the
    CPU twin) pass with the split count forced by SGLANG_DFLASH_ATTN_SPLITS, not only with the one
    the kernel picks."""
    tests = ["tests/test_ops_exactness.py::test_block_attention_mask_is_exact",
             "tests/test_cuda_ops.py::test_block_attention_matches_reference_and_cpu"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", *tests],
                          cwd=ROOT, env=dict(os.environ, SGLANG_DFLASH_ATTN_SPLITS=str(splits)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# gumbel_argmax


def assert_gumbel_picks(got, scores, ids, seed, offsets, rows):
    """got (a kernel's picks) equals the reference's, but for rows where the two picks' scores plus
    noise, recomputed in float64, differ by a few fp32 roundings and not at all in exact arithmetic
    (an exact tie has a defined winner, the lower column)."""
    want = reference.gumbel_argmax(scores, ids, seed, offsets, rows)
    got = got.cpu()
    for r in (got != want).nonzero().flatten().tolist():
        cols = int(got[r]), int(want[r])
        token = [c if ids is None else int(ids[c]) for c in cols]
        noise = reference.gumbel_noise(seed, int(offsets[r]), int(rows[r]), max(token) + 1, dtype=torch.float64)
        x = [float(scores[r, c]) for c in cols]
        g = [float(noise[t]) for t in token]
        gap = abs(x[0] + g[0] - x[1] - g[1])
        assert 0 < gap <= 2.0**-21 * sum(map(abs, x + g)), (
            f"row {r}: picked column {cols[0]}, the reference {cols[1]}; scores + noise "
            f"{x[0] + g[0]!r} and {x[1] + g[1]!r} are no near-tie")


GUMBEL_CASES = [
    # rows, n, with ids, scale (noise-dominated .. score-dominated)
    (3, 1, False, 1.0),
    (7, 1000, True, 1.0),
    (16, 4096, False, 0.05),
    (5, 20000, True, 8.0),
    (48, 1024, True, 1.0),  # many rows (CUDA: one CTA each)
    (4, 49152, False, 0.5),  # long rows (CUDA: 192 columns per thread)
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n,with_ids,scale", GUMBEL_CASES)
def test_gumbel_argmax_is_exact_up_to_near_ties(rows, n, with_ids, scale, dtype, device):
    g = torch.Generator().manual_seed(rows * 31 + n)
    scores = ((torch.randn(rows, n, generator=g) * scale * 4).round() / 4).to(dtype)  # many exact score ties
    scores[:, torch.randperm(n, generator=g)[: n // 5]] = float("-inf")  # masked columns never win
    ids = torch.randperm(3 * n + 1, generator=g)[:n] if with_ids else None
    if ids is not None and n > 1:
        ids[-1] = ids[0]  # the same token in two columns: an exact tie, the lower column wins
    offsets = torch.randint(0, 1 << 50, (rows,), generator=g)
    verify_rows = torch.randint(0, 16, (rows,), generator=g)
    got = ops.gumbel_argmax(scores.to(device), None if ids is None else ids.to(device), 77, offsets.to(device),
                            verify_rows.to(device))
    ops.check_device_errors(device)
    assert_gumbel_picks(got, scores, ids, 77, offsets, verify_rows)
