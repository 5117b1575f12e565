"""Edge cases of the CPU sampler's exact pruning (csrc/cpu/gumbel_max.h) and filter searches:
verify_block and gumbel_argmax against the spec, bit for bit, on fresh random inputs.

The kernels skip the Philox draws and the exact noise of tokens that provably cannot win, draw
32 Philox blocks at once (AVX-512, AVX2 or scalar code, picked by ATen's CPU capability), sample
the rows of a small batch in parallel waves, and narrow the top-p threshold with four probes a
pass; none of these may change a sample. Outputs are fresh tensors: blocks freed just before each
call are filled with a sentinel, so an element the kernel forgot to write shows up.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash.ops import reference

SENTINEL = -7


def _poison_allocator(*numels: int) -> None:
    """Free sentinel-filled blocks of the outputs' sizes, which the op's outputs then likely reuse."""
    junk = [torch.full((n,), SENTINEL, dtype=dtype) for n in numels for dtype in (torch.int64, torch.int32)]
    del junk


def _args(bs, temperature, top_k, top_p, gen):
    return dict(
        temperature=torch.full((bs,), float(temperature)),
        top_k=torch.full((bs,), int(top_k), dtype=torch.int32),
        top_p=torch.full((bs,), float(top_p)),
        seed=int(torch.randint(-(1 << 62), 1 << 62, (), generator=gen)),
        offsets=torch.randint(0, 1 << 62, (bs,), generator=gen),
    )


def _check_verify(cand, logits, args):
    bs, block = cand.shape
    _poison_allocator(bs, bs * block)
    got = ops.verify_block(cand, logits, **args)
    want = reference.verify_block(cand, logits, **args)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def _agreeing_drafts(logits, args, block, gen):
    """Drafts equal to the spec's samples except one request, so most rows get compared."""
    bs = args["temperature"].numel()
    cand = torch.randint(0, logits.shape[1], (bs, block), generator=gen)
    cand[:, 1:] = reference.target_samples(logits, block_size=block, **args)[:, :-1]
    if bs > 1 and block > 2:
        cand[1, 2] = (cand[1, 2] + 1) % logits.shape[1]
    return cand


# Vocabularies around the chunk sizes (4 ids a Philox block, 128 a chunk, 8 fp32 a vector).
@pytest.mark.parametrize("vocab", [1, 3, 5, 9, 127, 129, 130, 259, 1001])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (0.9, 40, 0.8)])
def test_vocab_not_a_multiple_of_the_chunk(vocab, temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(vocab * 31 + top_k)
    bs, block = 3, 4
    logits = torch.randn(bs * block, vocab, generator=gen) * 2
    args = _args(bs, temperature, top_k, top_p, gen)
    _check_verify(_agreeing_drafts(logits, args, block, gen), logits, args)


@pytest.mark.parametrize("temperature", [1e-3, 0.02, 50.0, 1e4])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7)])
def test_tiny_and_huge_temperatures(temperature, top_k, top_p):
    """Tiny T: scores far apart, almost every chunk skipped before any Philox draw. Huge T: scores
    within the noise's range everywhere, so nearly every Philox block is drawn."""
    gen = torch.Generator().manual_seed(int(temperature * 1000) + top_k)
    bs, block, vocab = 2, 3, 3000
    logits = torch.randn(bs * block, vocab, generator=gen) * 3
    args = _args(bs, temperature, top_k, top_p, gen)
    _check_verify(_agreeing_drafts(logits, args, block, gen), logits, args)


@pytest.mark.parametrize("kind", ["spread", "peaked", "ties_at_max", "masked", "one_left"])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (2, 0.3), (0, 0.05), (0, 0.999)])
def test_logit_shapes(kind, top_k, top_p):
    """Score layouts that move the search's seed and its pruning: a winner far from the max token,
    several tokens sharing the max (all kept by top-k 1), -inf masks (as grammar masks set them),
    a single finite token."""
    gen = torch.Generator().manual_seed(sum(map(ord, kind)) + 7 * top_k + int(100 * top_p))
    bs, block, vocab = 2, 3, 2051
    logits = torch.randn(bs * block, vocab, generator=gen)
    if kind == "spread":
        logits *= 0.05
    elif kind == "peaked":
        logits[:, torch.randint(0, vocab, (4,), generator=gen)] += 12
    elif kind == "ties_at_max":
        logits = (logits * 2).round() / 2
        logits[:, torch.randperm(vocab, generator=gen)[:5]] = 4.0
    elif kind == "masked":
        logits[torch.rand(logits.shape, generator=gen) < 0.95] = float("-inf")
        logits[:, 0] = 0.0
    elif kind == "one_left":
        logits.fill_(float("-inf"))
        logits[:, vocab - 2] = 1.5
    args = _args(bs, 1.0, top_k, top_p, gen)
    _check_verify(_agreeing_drafts(logits, args, block, gen), logits, args)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("bs", [1, 2, 5])
def test_row_waves_and_request_tasks(threads, bs):
    """Fewer requests than threads: a sampled request's rows are sampled in parallel waves, rows
    past the first rejection included; the accepted prefix and bonus must not depend on it."""
    gen = torch.Generator().manual_seed(threads * 10 + bs)
    block, vocab = 16, 4099
    logits = torch.randn(bs * block, vocab, generator=gen) * 2
    args = _args(bs, 0.8, 0, 0.95, gen)
    if bs > 1:
        args["temperature"][0] = 0.0  # a greedy request beside sampled ones
    cand = _agreeing_drafts(logits, args, block, gen)
    reject = 1 + int(torch.randint(0, block - 1, (), generator=gen))
    cand[-1, reject] = (cand[-1, reject] + 1) % vocab
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        _check_verify(cand, logits, args)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_full_vocabulary_low_precision(dtype):
    """Qwen's vocabulary in bf16 / fp16 with randn logits, the case where pruning before the
    Philox draws never applies and the per-lane bounds do all the work."""
    gen = torch.Generator().manual_seed(151936)
    bs, block, vocab = 1, 2, 151936
    logits = torch.randn(bs * block, vocab, generator=gen).to(dtype)
    for top_k, top_p in [(0, 1.0), (0, 0.9), (100, 1.0)]:
        args = _args(bs, 1.0, top_k, top_p, gen)
        _check_verify(_agreeing_drafts(logits, args, block, gen), logits, args)


def test_coarse_noise_bound_holds_for_every_lane():
    """gumbel_max.h's integer-only bound, ln 2 * (clz(k) - 7) + 1e-3 in fp32 with
    k = 2 * (2^23 - 1 - m) + 1 for a lane whose 23 high bits are m, is at least the noise of every
    one of the 2^23 values of u and nondecreasing in m: what makes its pruning exact."""
    m = torch.arange(1 << 23, dtype=torch.int64)
    noise = (-torch.log(-torch.log((2 * m + 1).double() / 2.0**24))).float()
    k = 2 * ((1 << 23) - 1 - m) + 1
    clz = 31 - torch.floor(torch.log2(k.double())).long()
    bound = torch.tensor(0.6931472, dtype=torch.float32) * (clz - 7).float() + torch.tensor(1e-3)
    assert (bound - noise).min() >= 9e-4
    assert (bound[1:] >= bound[:-1]).all()


# ------------------------------------------------------------------------------------------------
# gumbel_argmax


@pytest.mark.parametrize("n", [1, 2, 31, 33, 127, 129, 1000, 151936])
@pytest.mark.parametrize("with_ids", [False, True])
@pytest.mark.parametrize("scale", [1e-4, 2.0, 1e3])
def test_gumbel_argmax_sizes_and_scales(n, with_ids, scale):
    gen = torch.Generator().manual_seed(n + int(scale))
    rows = 3
    scores = torch.randn(rows, n, generator=gen) * scale
    if n > 4:
        scores[:, torch.randperm(n, generator=gen)[: n // 3]] = float("-inf")
    ids = torch.randperm(4 * n + 7, generator=gen)[:n] if with_ids else None
    offsets = torch.randint(0, 1 << 62, (rows,), generator=gen)
    row_ids = torch.randint(0, 16, (rows,), generator=gen)
    _poison_allocator(rows)
    out = ops.gumbel_argmax(scores, ids, 17, offsets, row_ids)
    assert torch.equal(out, reference.gumbel_argmax(scores, ids, 17, offsets, row_ids))


@pytest.mark.parametrize("with_ids", [False, True])
def test_gumbel_argmax_never_picks_nan(with_ids):
    """NaN scores never win (the spec's argmax would pick them): the result is the spec's over the
    scores with NaN as -inf, wherever the NaNs are, the first column included."""
    gen = torch.Generator().manual_seed(5)
    rows, n = 4, 777
    scores = torch.randn(rows, n, generator=gen)
    scores[torch.rand(rows, n, generator=gen) < 0.2] = float("nan")
    scores[:, 0] = float("nan")
    scores[1, 1:9] = float("nan")  # a whole first vector of NaNs
    ids = torch.randperm(n, generator=gen) if with_ids else None
    offsets = torch.randint(0, 1 << 62, (rows,), generator=gen)
    row_ids = torch.arange(rows)
    out = ops.gumbel_argmax(scores, ids, 3, offsets, row_ids)
    want = reference.gumbel_argmax(scores.nan_to_num(nan=float("-inf")), ids, 3, offsets, row_ids)
    assert torch.equal(out, want)


# ------------------------------------------------------------------------------------------------
# Every Philox code path

_PATH_SCRIPT = """
import torch
from sglang_dflash import ops
from sglang_dflash.ops import reference
from tests.test_ops_sampled_edges import _agreeing_drafts, _args, _check_verify

gen = torch.Generator().manual_seed(11)
logits = torch.randn(6, 1003, generator=gen) * 2
for top_k, top_p in [(0, 1.0), (9, 0.8)]:
    args = _args(2, 1.1, top_k, top_p, gen)
    _check_verify(_agreeing_drafts(logits, args, 3, gen), logits, args)
ids = torch.randperm(5000, generator=gen)[:1003]
for i in (None, ids):
    offsets, rows = torch.randint(0, 1 << 62, (6,), generator=gen), torch.arange(6)
    assert torch.equal(ops.gumbel_argmax(logits, i, 4, offsets, rows),
                       reference.gumbel_argmax(logits, i, 4, offsets, rows))
print("OK", torch.backends.cpu.get_cpu_capability())
"""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), ":").split(":", 1)[1].split())
    except OSError:
        return set()


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_every_philox_code_path(capability):
    """ATEN_CPU_CAPABILITY picks the scalar, AVX2 or AVX-512 Philox, so each path this machine can
    run is checked against the spec in its own process. ATen takes the variable's word even where
    the CPU lacks the instructions (its own kernels then fault), so a path the CPU cannot run is
    skipped."""
    needs = {"avx2": {"avx2"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}.get(capability, set())
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - _cpu_flags())}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", _PATH_SCRIPT], capture_output=True, text=True,
                          timeout=300, env=env, cwd=root)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
