"""CUDA kernels against the pure-PyTorch spec and the CPU twins (docs/design.md §3).

Every test here needs a CUDA GPU and an extension built with its CUDA kernels; without them the
module is skipped. Inputs are fresh random tensors for every case; outputs come from the caching
allocator after it was filled with NaNs, so an element the kernel never writes shows up; floating
outputs are compared per (row, head), so one wrong head cannot hide in a norm over the output.
After every test the device's error record must be empty: no kernel flags a valid index.
(tests/test_ops_exactness.py and tests/test_ops_index_errors.py hold more CUDA tests, written for
every device.)
"""

from __future__ import annotations

import importlib
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash.ops import reference, variants
from sglang_dflash.ops.testing import (
    follow_targets,
    make_attention_inputs,
    make_context_kv_inputs,
    make_tree,
    on_device,
)
from tests.kernel_devices import cuda_ready
from tests.test_ops_materialize_context_kv import assert_rows_close

pytestmark = pytest.mark.cuda

if not cuda_ready():
    pytest.skip("needs a CUDA GPU and the extension's CUDA kernels", allow_module_level=True)

DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def _no_device_errors():
    yield
    ops.check_device_errors(DEV)


def _poison_allocator(nbytes: int = 64 << 20) -> None:
    """Leave NaN-filled blocks in the caching allocator, which the op's outputs then reuse."""
    junk = [torch.full((nbytes // 4,), float("nan"), device=DEV) for _ in range(2)]
    junk += [torch.full((n,), float("nan"), device=DEV) for n in (1 << 10, 1 << 14, 1 << 18)]
    del junk


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Every (row, head): max |out - ref| / (1 + |ref|) <= the dtype's tolerance."""
    assert_rows_close(out.cpu(), ref.cpu(), TOL[dtype])


# fp16 is looser than the CPU tests' 2e-3: the tensor-core kernel rounds P to fp16 for P V.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


# ------------------------------------------------------------------------------------------------
# block_attention


def _attention_inputs(bs, block, hq, hkv, d, ctx_lens, dtype, table_dtype=torch.int32, width=None, seed=0,
                      unaligned=False):
    return on_device(make_attention_inputs(bs, block, hq, hkv, d, ctx_lens, dtype, seed=seed,
                                           table_dtype=table_dtype, width=width, unaligned=unaligned), DEV)


def _to_cpu(args: dict) -> dict:
    return {k: v.cpu() for k, v in args.items()}


ATTN_CASES = [
    # bs, B, Hq, Hkv, D, ctx_lens, window, causal
    (1, 16, 32, 8, 128, [1000], -1, False),
    (3, 16, 8, 2, 128, [0, 37, 300], -1, False),
    (2, 16, 4, 4, 64, [129, 64], -1, True),
    (2, 8, 16, 2, 256, [50, 500], -1, False),
    (4, 16, 32, 8, 128, [700, 1, 64, 2000], 64, False),
    (2, 16, 8, 1, 128, [300, 5], 7, True),
    (1, 4, 2, 1, 64, [3], 1, False),
    (2, 1, 8, 8, 128, [100, 0], -1, True),
    (5, 16, 64, 4, 64, [33, 1200, 0, 7, 515], 300, False),  # 256 query rows per kv head
    (64, 16, 32, 8, 128, [40] * 64, -1, False),  # enough CTAs: no split
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", ATTN_CASES)
def test_block_attention_matches_reference_and_cpu(case, dtype):
    bs, block, hq, hkv, d, ctx_lens, window, causal = case
    args = _attention_inputs(bs, block, hq, hkv, d, ctx_lens, dtype, seed=ATTN_CASES.index(case))
    scale = d**-0.5
    _poison_allocator()
    out = ops.block_attention(**args, block_size=block, sm_scale=scale, window=window, causal_block=causal)
    torch.cuda.synchronize()
    assert out.dtype == dtype and out.shape == args["q"].shape
    assert torch.isfinite(out).all(), "unwritten or non-finite output elements"
    ref = reference.block_attention(**args, block_size=block, sm_scale=scale, window=window, causal_block=causal)
    _assert_close(out, ref, dtype)
    cpu = ops.block_attention(**_to_cpu(args), block_size=block, sm_scale=scale, window=window, causal_block=causal)
    _assert_close(out, cpu, dtype)


def _cpu_cases(module, name):
    """The case list `name` (a list, or a function that builds one) of the CPU test module
    tests.`module`; [] when run from elsewhere, where the CPU tests are not importable."""
    try:
        cases = getattr(importlib.import_module(f"tests.{module}"), name)
    except ImportError:
        return []
    return cases() if callable(cases) else cases


@pytest.mark.parametrize("bs,block,hq,hkv,head_dim,ctx_lens,dtype,window,causal,seed",
                         _cpu_cases("test_ops_block_attention", "_grid_cases"))
def test_block_attention_cpu_test_grid(bs, block, hq, hkv, head_dim, ctx_lens, dtype, window,
                                       causal, seed):  # fmt: skip
    """The CPU kernel's test grid (same inputs, same layouts): CUDA == reference == CPU twin."""
    cpu_args = make_attention_inputs(
        bs, block, hq, hkv, head_dim, ctx_lens, dtype, seed=seed,
        table_dtype=torch.int64 if seed % 3 else torch.int32,
    )  # fmt: skip
    args = on_device(cpu_args, DEV)
    assert args["q"].stride() == cpu_args["q"].stride()
    kwargs = dict(block_size=block, window=window, causal_block=causal)
    _poison_allocator()
    out = ops.block_attention(**args, **kwargs)
    assert torch.isfinite(out).all()
    _assert_close(out, reference.block_attention(**args, **kwargs), dtype)
    _assert_close(out, ops.block_attention(**cpu_args, **kwargs), dtype)


@pytest.mark.parametrize("bs,nodes,hq,hkv,head_dim,ctx_lens,dtype,seed",
                         _cpu_cases("test_ops_block_attention", "_tree_cases"))
@pytest.mark.parametrize("aligned", [True, False])  # the tensor-core path (bf16 / fp16), and the SIMT path
def test_block_attention_tree_mode(bs, nodes, hq, hkv, head_dim, ctx_lens, dtype, seed, aligned):
    """The CPU kernel's tree cases (up to 70 nodes: 3 mask words per row): CUDA == reference == CPU."""
    cpu_args = make_attention_inputs(bs, nodes, hq, hkv, head_dim, ctx_lens, dtype, seed=seed, unaligned=not aligned)
    parents = make_tree(bs, nodes, 100, torch.Generator().manual_seed(seed), unused=0.1)[1]
    parents = parents.to(torch.int32 if seed % 2 else torch.int64)
    _poison_allocator()
    out = ops.block_attention(**on_device(cpu_args, DEV), block_size=nodes, tree_parents=parents.to(DEV))
    assert torch.isfinite(out).all()
    _assert_close(out, reference.block_attention(**cpu_args, block_size=nodes, tree_parents=parents), dtype)
    _assert_close(out, ops.block_attention(**cpu_args, block_size=nodes, tree_parents=parents), dtype)


@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_block_attention_generic_paths(d, table_dtype):
    """Odd head_dim, unaligned views (the non-tensor-core kernel) and both index dtypes."""
    for unaligned in (False, True):
        args = _attention_inputs(
            2, 16, 8, 2, d, [77, 600], torch.bfloat16, table_dtype, width=700, seed=d, unaligned=unaligned
        )
        _poison_allocator()
        out = ops.block_attention(**args, block_size=16, window=-1)
        ref = reference.block_attention(**args, block_size=16)
        _assert_close(out, ref, torch.bfloat16)


def test_block_attention_long_context_splits():
    """A long context with bs x Hkv far below the SM count: the split + merge path."""
    args = _attention_inputs(1, 16, 32, 8, 128, [32768], torch.bfloat16, width=40000, seed=3)
    out = ops.block_attention(**args, block_size=16)
    _assert_close(out, reference.block_attention(**args, block_size=16), torch.bfloat16)


def test_block_attention_deterministic_and_graph_capture():
    args = _attention_inputs(2, 16, 32, 8, 128, [900, 33], torch.bfloat16, width=1000, seed=11)
    eager = ops.block_attention(**args, block_size=16, window=100, causal_block=True)
    again = ops.block_attention(**args, block_size=16, window=100, causal_block=True)
    assert torch.equal(eager, again)

    static = {k: v.clone() for k, v in args.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (allocator, attributes) off the capture
        ops.block_attention(**static, block_size=16, window=100, causal_block=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.block_attention(**static, block_size=16, window=100, causal_block=True)
    # New data in the same buffers: the replay must see it.
    fresh = _attention_inputs(2, 16, 32, 8, 128, [433, 500], torch.bfloat16, width=1000, seed=12)
    for k in static:
        static[k].copy_(fresh[k])
    graph.replay()
    torch.cuda.synchronize()
    expected = ops.block_attention(**fresh, block_size=16, window=100, causal_block=True)
    assert torch.equal(captured, expected)


def test_block_attention_validation_errors():
    args = _attention_inputs(1, 4, 4, 2, 64, [10], torch.bfloat16)
    with pytest.raises(ValueError, match="k_cache"):
        bad = dict(args, k_cache=args["k_cache"].float())
        ops.block_attention(**bad, block_size=4)
    with pytest.raises(ValueError, match="window"):
        ops.block_attention(**args, block_size=4, window=0)


# Every compiled variant of block_attention's tensor-core kernel (ops.variants), against the spec.
# The cases cover each head_dim, row tiles beyond one CTA's rows (group 8), windows, causal
# blocks, trees, empty contexts and a long context (the split + merge path under each policy).
VARIANT_ATTN_CASES = [
    # bs, B, Hq, Hkv, D, ctx_lens, window, causal, tree
    (3, 16, 8, 2, 128, [0, 37, 300], -1, False, False),
    (2, 16, 4, 4, 64, [129, 64], -1, True, False),
    (2, 8, 16, 2, 256, [50, 500], -1, False, False),
    (4, 16, 32, 4, 128, [700, 1, 64, 2000], 64, False, False),  # group 8: 128 rows per kv head
    (2, 16, 8, 1, 64, [300, 5], 7, True, False),
    (2, 12, 8, 2, 128, [90, 400], -1, False, True),
    (1, 16, 32, 8, 128, [9000], -1, False, False),
]


def _in_variant(op: str, name: str, fn):
    """fn() with `name` selected; a variant that needs more shared memory than this GPU has is skipped."""
    with variants.using_variant(op, name):
        try:
            return fn()
        except ValueError as exc:
            if "bytes of shared memory" in str(exc):
                pytest.skip(str(exc))
            raise


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", VARIANT_ATTN_CASES)
@pytest.mark.parametrize("variant", variants.kernel_variants("block_attention"))
def test_block_attention_variant_matches_reference(variant, case, dtype):
    bs, block, hq, hkv, d, ctx_lens, window, causal, tree = case
    seed = VARIANT_ATTN_CASES.index(case)
    args = _attention_inputs(bs, block, hq, hkv, d, ctx_lens, dtype, seed=seed)
    parents = None
    if tree:
        parents = make_tree(bs, block, 100, torch.Generator().manual_seed(seed), unused=0.1)[1].to(DEV)
    kwargs = dict(block_size=block, window=window, causal_block=causal, tree_parents=parents)
    _poison_allocator()
    out = _in_variant("block_attention", variant, lambda: ops.block_attention(**args, **kwargs))
    torch.cuda.synchronize()
    assert out.dtype == dtype and out.shape == args["q"].shape
    assert torch.isfinite(out).all(), "unwritten or non-finite output elements"
    _assert_close(out, reference.block_attention(**args, **kwargs), dtype)


@pytest.mark.parametrize("variant", variants.kernel_variants("block_attention"))
def test_block_attention_variant_deterministic_and_graph_capture(variant):
    """Each variant: repeated calls are bit-identical; a graph captured inside the variant's scope
    replays that variant on new data (the same bits as an eager call in the scope)."""
    args = _attention_inputs(2, 16, 32, 8, 128, [900, 33], torch.bfloat16, width=1000, seed=11)
    kwargs = dict(block_size=16, window=100, causal_block=True)
    with variants.using_variant("block_attention", variant):
        eager = _in_variant("block_attention", variant, lambda: ops.block_attention(**args, **kwargs))
        assert torch.equal(eager, ops.block_attention(**args, **kwargs))
        static = {k: v.clone() for k, v in args.items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ops.block_attention(**static, **kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ops.block_attention(**static, **kwargs)
        fresh = _attention_inputs(2, 16, 32, 8, 128, [433, 500], torch.bfloat16, width=1000, seed=12)
        for k in static:
            static[k].copy_(fresh[k])
        expected = ops.block_attention(**fresh, **kwargs)
    graph.replay()  # outside the scope: the captured variant still runs
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)


def test_block_attention_variants_listed():
    names = variants.kernel_variants("block_attention")
    assert names[0] == "default" and len(names) == len(set(names)) > 1
    with pytest.raises(ValueError, match="no kernel variant"):
        with variants.using_variant("block_attention", "no-such-variant"):
            pass


# ------------------------------------------------------------------------------------------------
# verify_block


def _verify_inputs(bs, block, vocab, dtype, scale=3.0, seed=0, quantize=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(bs * block, vocab, generator=g) * scale
    if quantize:  # many exact ties
        logits = (logits * 2).round() / 2
    logits = logits.to(dtype)
    candidates = torch.randint(0, vocab, (bs, block), generator=g)
    return logits, candidates


def _params(bs, temperature, top_k, top_p, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    return (
        torch.full((bs,), float(temperature)),
        torch.full((bs,), int(top_k), dtype=torch.int32),
        torch.full((bs,), float(top_p)),
        torch.randint(0, 1 << 40, (bs,), generator=g),
    )


def _run_verify(device, candidates, logits, temperature, top_k, top_p, seed, offsets):
    out = ops.verify_block(
        candidates.to(device),
        logits.to(device),
        temperature.to(device),
        top_k.to(device),
        top_p.to(device),
        seed,
        offsets.to(device),
    )
    return [t.cpu() for t in out]


def _row_tokens(device, logits, temp, topk, topp, seed, offsets):
    """Every row's target token, as one request per row (B = 1: accept_len 0, bonus = token).

    The noise stream of a row depends on its row index within the block, which is 0 here; the
    block layout is covered by _block_outputs."""
    n = logits.shape[0]
    cand = torch.zeros(n, 1, dtype=torch.int64)
    return _run_verify(device, cand, logits, temp, topk, topp, seed, offsets)[1]


def _block_outputs(logits, temp, topk, topp, seed, offsets, block):
    """CUDA and CPU outputs for blocks whose drafts agree with the spec's samples, so every row's
    token shows up in out_tokens."""
    bs = temp.numel()
    y = reference.target_samples(
        logits.to(DEV), temp.to(DEV), topk.to(DEV), topp.to(DEV), seed, offsets.to(DEV), block
    ).cpu()
    cand = torch.cat([torch.zeros(bs, 1, dtype=torch.int64), y[:, :-1]], dim=1)
    gpu = _run_verify(DEV, cand, logits, temp, topk, topp, seed, offsets)
    cpu = _run_verify("cpu", cand, logits, temp, topk, topp, seed, offsets)
    return gpu, cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 7, 1000, 151936])
def test_verify_greedy_bit_identical(dtype, vocab):
    bs, block = 5, 16
    logits, cand = _verify_inputs(bs, block, vocab, dtype, seed=vocab, quantize=True)
    y = logits.float().argmax(-1).view(bs, block)
    cand[:3, 1:] = y[:3, :-1]  # full accepts for some requests
    cand[1, 5] = (cand[1, 5] + 1) % vocab if vocab > 1 else cand[1, 5]
    temp, topk, topp, offs = _params(bs, 0.0, 0, 1.0)
    _poison_allocator()
    gpu = _run_verify(DEV, cand, logits, temp, topk, topp, 5, offs)
    cpu = _run_verify("cpu", cand, logits, temp, topk, topp, 5, offs)
    ref = reference.verify_block(cand, logits, temp, topk, topp, 5, offs)
    for a, b, r in zip(gpu, cpu, ref, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a, r.cpu())


SAMPLING_CASES = [
    # temperature, top_k, top_p, logit scale, vocab
    (1.0, 0, 1.0, 3.0, 32000),  # temperature only
    (0.7, 20, 1.0, 3.0, 151936),  # top-k, candidates in shared memory
    (0.6, 20, 0.95, 5.0, 151936),  # Qwen3 defaults
    (1.0, 0, 0.9, 8.0, 50000),  # top-p alone, peaked rows: shared memory
    (1.0, 0, 0.99, 0.1, 50000),  # top-p alone, flat rows: the global-memory search
    (0.9, 6000, 1.0, 1.0, 20000),  # top-k above the shared-memory capacity
    (1.3, 50, 0.5, 2.0, 262144),  # the largest vocabulary
    (0.5, 3, 0.8, 1.0, 97),  # tiny vocabulary, odd size
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", SAMPLING_CASES)
def test_verify_sampling_matches_cpu(case, dtype):
    temperature, top_k, top_p, scale, vocab = case
    bs, block = 3, 8
    logits, _ = _verify_inputs(bs, block, vocab, dtype, scale=scale, seed=vocab + top_k)
    temp, topk, topp, offs = _params(bs, temperature, top_k, top_p, seed=top_k)
    seed = 1234 + top_k
    rep = lambda t: t.repeat_interleave(block)  # noqa: E731
    _poison_allocator()
    # Row by row. Documented tolerance: a row may differ only where float rounding of the top-p
    # mass sums or of the noise's log lands exactly on a decision boundary; none is expected here.
    rows = (logits, rep(temp), rep(topk), rep(topp), seed, rep(offs))
    assert torch.equal(_row_tokens(DEV, *rows), _row_tokens("cpu", *rows))
    # Whole blocks (row index i feeds the noise): identical accept results.
    gpu, cpu = _block_outputs(logits, temp, topk, topp, seed, offs, block)
    for a, b in zip(gpu, cpu, strict=True):
        assert torch.equal(a, b), (gpu, cpu)
    # The spec's sort-based top-p mask rounds differently; allow one boundary row.
    assert int((gpu[0] == block - 1).sum()) >= bs - 1, gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", SAMPLING_CASES + [(0.8, 0, 1.0, 30.0, 151936), (0.0, 0, 1.0, 3.0, 5003)])
@pytest.mark.parametrize("variant", variants.kernel_variants("verify_block"))
def test_verify_variant_matches_cpu(variant, case, dtype):
    """Each verify_block variant, row by row (B = 1, every row a request): the same tokens as the CPU
    twin (and repeated runs the same bits). The extra cases: peaked temperature-only rows (most ids
    pruned) and greedy rows of an odd vocabulary."""
    temperature, top_k, top_p, scale, vocab = case
    bs, block = 4, 8
    logits, _ = _verify_inputs(bs, block, vocab, dtype, scale=scale, seed=vocab + top_k + 1)
    temp, topk, topp, offs = _params(bs, temperature, top_k, top_p, seed=top_k + 2)
    rep = lambda t: t.repeat_interleave(block)  # noqa: E731
    rows = (logits, rep(temp), rep(topk), rep(topp), 99, rep(offs))
    _poison_allocator()
    with variants.using_variant("verify_block", variant):
        gpu = _row_tokens(DEV, *rows)
        assert torch.equal(gpu, _row_tokens(DEV, *rows))
    assert torch.equal(gpu, _row_tokens("cpu", *rows))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("variant", variants.kernel_variants("verify_block"))
def test_verify_variant_mixed_batch_unaligned_and_masked(variant, masked):
    """Greedy and sampled requests in one batch, rows 2 bytes off a 16-byte boundary, rows of mostly
    -inf (grammar masks) and one all -inf row: each variant equals the CPU twin."""
    gen = torch.Generator().manual_seed(5)
    bs, block, vocab = 4, 4, 3001
    full = torch.randn(bs * block, vocab + 1, generator=gen).to(torch.bfloat16)
    logits = full[:, 1:]
    if masked:
        logits[torch.rand(bs * block, vocab, generator=gen) < 0.7] = float("-inf")
        logits[0] = float("-inf")
    cand = torch.randint(0, vocab, (bs, block), generator=gen)
    temp = torch.tensor([0.0, 1.0, 0.7, 0.5])
    topk = torch.tensor([0, 10, 0, 3], dtype=torch.int32)
    topp = torch.tensor([1.0, 0.8, 1.0, 1.0])
    offs = torch.tensor([5, 6, 7, -8])
    with variants.using_variant("verify_block", variant):
        gpu = _run_verify(DEV, cand, logits, temp, topk, topp, -3, offs)
    cpu = _run_verify("cpu", cand, logits.contiguous(), temp, topk, topp, -3, offs)
    for a, b in zip(gpu, cpu, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("temperature,top_k,top_p", _cpu_cases("test_ops_verify", "STOCHASTIC_CASES"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_cpu_test_cases(temperature, top_k, top_p, dtype):
    """The CPU kernel's stochastic cases: CUDA == CPU twin == spec, every row compared."""
    from tests.test_ops_verify import stochastic_case

    case = stochastic_case(temperature, top_k, top_p, dtype)
    gpu, cpu = _run_verify(DEV, **case), _run_verify("cpu", **case)
    for a, b, r in zip(gpu, cpu, reference.verify_block(**case), strict=True):
        assert torch.equal(a, b) and torch.equal(a, r)


@pytest.mark.parametrize("masked", [False, True])
def test_verify_mixed_batch_and_masked_logits(masked):
    """Greedy and sampled requests in one batch, negative offsets / seed / temperature, and rows
    of mostly -inf logits (grammar masks)."""
    gen = torch.Generator().manual_seed(4)
    bs, block, vocab = 4, 4, 300
    logits = torch.randn(bs * block, vocab, generator=gen)
    if masked:
        logits[torch.rand(bs * block, vocab, generator=gen) < 0.7] = float("-inf")
        logits[0, :-1] = float("-inf")
        logits[0, -1] = 0.5
    cand = torch.randint(0, vocab, (bs, block), generator=gen)
    temp = torch.tensor([0.0, 1.0, -1.0, 0.5])
    topk = torch.tensor([0, 10, 3, 0], dtype=torch.int32)
    topp = torch.tensor([1.0, 0.8, 0.1, 1.0])
    offs = torch.tensor([5, 6, 7, -8])
    gpu = _run_verify(DEV, cand, logits, temp, topk, topp, -3, offs)
    cpu = _run_verify("cpu", cand, logits, temp, topk, topp, -3, offs)
    for a, b in zip(gpu, cpu, strict=True):
        assert torch.equal(a, b)


def test_verify_sampling_many_rows_rate():
    """Many rows of realistic settings: CUDA and CPU row tokens agree on all but a tiny fraction."""
    bs, block, vocab = 16, 16, 151936
    logits, _ = _verify_inputs(bs, block, vocab, torch.bfloat16, scale=4.0, seed=99)
    temp = torch.rand(bs) * 1.2 + 0.3
    topk = torch.tensor([0, 20, 50, 0] * 4, dtype=torch.int32)
    topp = torch.tensor([1.0, 0.95, 0.8, 0.9] * 4)
    offs = torch.randint(0, 1 << 40, (bs,))
    # One request per row (B = 1) so accept_len is 0 and bonus is that row's token.
    cand = torch.randint(0, vocab, (bs * block, 1))
    rep = lambda t: t.repeat_interleave(block)  # noqa: E731
    args = (cand, logits, rep(temp), rep(topk), rep(topp), 77, rep(offs))
    gpu = _run_verify(DEV, *args)
    cpu = _run_verify("cpu", *args)
    differ = int((gpu[1] != cpu[1]).sum())
    assert differ <= max(1, bs * block // 500), f"{differ} of {bs * block} rows differ"


def test_verify_unaligned_rows_and_strides():
    bs, block, vocab = 2, 4, 5003
    full, cand = _verify_inputs(bs, block, vocab + 1, torch.bfloat16, seed=5)
    logits = full[:, 1:]  # rows start 2 bytes past a 16-byte boundary, row stride odd
    cand = cand.clamp_max(vocab - 1)
    for temperature, top_k, top_p in [(0.0, 0, 1.0), (0.8, 10, 0.9), (1.0, 0, 1.0)]:
        temp, topk, topp, offs = _params(bs, temperature, top_k, top_p)
        gpu = _run_verify(DEV, cand, logits, temp, topk, topp, 3, offs)
        cpu = _run_verify("cpu", cand, logits.contiguous(), temp, topk, topp, 3, offs)
        for a, b in zip(gpu, cpu, strict=True):
            assert torch.equal(a, b)


def test_verify_graph_capture_and_determinism():
    bs, block, vocab = 4, 16, 32000
    logits, cand = _verify_inputs(bs, block, vocab, torch.float32, seed=8)
    temp = torch.tensor([0.0, 0.7, 1.0, 0.5])
    topk = torch.tensor([0, 20, 0, 100], dtype=torch.int32)
    topp = torch.tensor([1.0, 0.9, 1.0, 0.8])
    offs = torch.tensor([3, 1 << 35, 77, 0])
    static = [t.to(DEV) for t in (cand, logits, temp, topk, topp, offs)]
    first = ops.verify_block(*static[:5], 42, static[5])
    second = ops.verify_block(*static[:5], 42, static[5])
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.verify_block(*static[:5], 42, static[5])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.verify_block(*static[:5], 42, static[5])
    fresh, _ = _verify_inputs(bs, block, vocab, torch.float32, seed=9)
    static[1].copy_(fresh.to(DEV))
    graph.replay()
    torch.cuda.synchronize()
    expected = ops.verify_block(*static[:5], 42, static[5])
    for a, b in zip(captured, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("flat", [False, True])
def test_verify_from_ids_matches_cpu(ids_dtype, flat):
    bs, block = 9, 16
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 5, (bs, block), generator=g)
    cand = torch.randint(0, 5, (bs, block), generator=g)
    cand[::2, 1:] = ids[::2, :-1]
    target = (ids.reshape(-1) if flat else ids).to(ids_dtype)
    gpu = [t.cpu() for t in ops.verify_block_from_ids(cand.to(DEV), target.to(DEV))]
    cpu = ops.verify_block_from_ids(cand, target)
    ref = reference.verify_block_from_ids(cand, target)
    for a, b, r in zip(gpu, cpu, ref, strict=True):
        assert torch.equal(a, b) and torch.equal(a, r)


def test_verify_empty_batch():
    cand = torch.empty(0, 4, dtype=torch.int64, device=DEV)
    logits = torch.empty(0, 10, device=DEV)
    temp, topk, topp, offs = (t[:0].to(DEV) for t in _params(1, 1.0, 0, 1.0))
    acc, bonus, out = ops.verify_block(cand, logits, temp, topk, topp, 0, offs)
    assert acc.shape == (0,) and out.shape == (0, 4)


# ------------------------------------------------------------------------------------------------
# verify_tree


def _on_dev(case: dict) -> dict:
    return {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("bs,nodes,vocab", [(1, 1, 7), (5, 40, 50), (300, 24, 1000)])  # 300: several CTAs
def test_verify_tree_from_ids_matches_cpu(index_dtype, bs, nodes, vocab):
    gen = torch.Generator().manual_seed(bs + nodes)
    target = torch.randint(0, vocab, (bs, nodes), generator=gen)
    tokens, parents, depths = make_tree(bs, nodes, vocab, gen)
    tokens = follow_targets(tokens, parents, target, gen)
    args = [tokens, parents.to(index_dtype), depths, target.to(index_dtype).reshape(-1)]
    _poison_allocator()
    gpu = [t.cpu() for t in ops.verify_tree_from_ids(*(t.to(DEV) for t in args))]
    cpu = ops.verify_tree_from_ids(*args)
    ref = reference.verify_tree_from_ids(tokens, parents, depths, target)
    for a, b, r in zip(gpu, cpu, ref, strict=True):
        assert torch.equal(a, b) and torch.equal(a, r)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (0.7, 20, 0.9), (1.3, 0, 0.8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_tree_sampled_matches_cpu_and_reference(temperature, top_k, top_p, dtype):
    from tests.test_ops_verify_tree import sampled_tree_case

    case = sampled_tree_case(temperature, top_k, top_p, dtype, bs=4, nodes=24, vocab=5000)
    gpu = [t.cpu() for t in ops.verify_tree(**_on_dev(case))]
    for a, b, r in zip(gpu, ops.verify_tree(**case), reference.verify_tree(**case), strict=True):
        assert torch.equal(a, b) and torch.equal(a, r)
    assert int(gpu[0].sum()) > 0  # some drafts accepted: the sampled tokens were compared


def test_verify_tree_graph_capture():
    """verify_tree (verify_block on the per-node view, then the walk) syncs nothing with the host: it
    is captured, and a replay on fresh logits returns what an eager call does."""
    from tests.test_ops_verify_tree import sampled_tree_case

    static = _on_dev(sampled_tree_case(0.8, 20, 0.9, torch.float32, bs=4, nodes=16, seed=3))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.verify_tree(**static)  # warm-up, off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.verify_tree(**static)
    static["logits"].copy_(sampled_tree_case(0.8, 20, 0.9, torch.float32, bs=4, nodes=16, seed=4)["logits"])
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, ops.verify_tree(**static), strict=True):
        assert torch.equal(a, b)


def test_verify_tree_empty_batch():
    accept_len, path, out = ops.verify_tree_from_ids(*(torch.empty(0, 3, dtype=torch.int64, device=DEV),) * 4)
    assert accept_len.shape == (0,) and path.shape == out.shape == (0, 3)


# ------------------------------------------------------------------------------------------------
# materialize_context_kv


def _context_kv_on(args: dict, device) -> dict:
    """The op's arguments on `device`, views (weight row slices, padded pools) kept as views."""
    moved = {}
    for name, value in args.items():
        if isinstance(value, torch.Tensor):
            moved[name] = on_device({name: value}, device)[name]
        elif isinstance(value, list):
            moved[name] = list(on_device(dict(enumerate(value)), device).values())
        else:
            moved[name] = value
    return moved


CONTEXT_KV_CASES = [
    # (N, H, L, Hkv, D, rotary_dim, ctx dtype), make_context_kv_inputs options
    ((4, 576, 3, 3, 64, 64, torch.float16), dict()),  # the SmolLM2 drafter at decode
    ((64, 4096, 5, 8, 128, 128, torch.bfloat16), dict(skip=20, index_dtype=torch.int32)),  # Qwen3-8B drafter, 4 x 16
    ((37, 256, 2, 4, 128, 64, torch.bfloat16), dict(pool_dtype=torch.float32, is_neox=False, bias=True)),
    ((9, 96, 2, 3, 64, 30, torch.float32), dict(pad=1, poison="sentinel")),  # strided, unaligned pools
    ((300, 512, 3, 2, 80, 80, torch.float16), dict(pool_dtype=torch.bfloat16, cos_sin_dtype=torch.bfloat16)),
    ((5, 64, 17, 1, 64, 64, torch.float32), dict(skip=2)),  # more layers than one launch takes
    ((1, 64, 1, 1, 256, 2, torch.bfloat16), dict(is_neox=False)),
]


@pytest.mark.parametrize("shape,kwargs", CONTEXT_KV_CASES)
def test_materialize_context_kv_matches_reference_and_cpu(shape, kwargs):
    """Per (row, head) max error against the spec and the CPU twin; nothing else in the pools moves."""
    from tests.test_ops_materialize_context_kv import TOLERANCE, assert_rows_close, check_against_reference

    cpu_args = make_context_kv_inputs(*shape, seed=CONTEXT_KV_CASES.index((shape, kwargs)), **kwargs)
    args = _context_kv_on(cpu_args, DEV)
    _poison_allocator()
    check_against_reference(args)
    ops.materialize_context_kv(**cpu_args)
    slots = cpu_args["out_loc"][cpu_args["out_loc"] >= 0].long()
    tol = max(TOLERANCE[shape[-1]], TOLERANCE[cpu_args["k_caches"][0].dtype])
    for gpu, cpu in zip(args["k_caches"] + args["v_caches"], cpu_args["k_caches"] + cpu_args["v_caches"], strict=True):
        assert_rows_close(gpu.cpu()[slots], cpu[slots], tol)


@pytest.mark.parametrize("shape,kwargs", _cpu_cases("test_ops_materialize_context_kv", "_grid_cases"))
def test_materialize_context_kv_cpu_test_grid(shape, kwargs):
    from tests.test_ops_materialize_context_kv import check_against_reference

    check_against_reference(_context_kv_on(make_context_kv_inputs(*shape, **kwargs), DEV))


def test_materialize_context_kv_graph_capture():
    """No host sync inside: capturable, and a replay reads the new contents of its inputs."""
    from tests.test_ops_materialize_context_kv import check_against_reference

    static = _context_kv_on(make_context_kv_inputs(8, 256, 2, 2, 128, 128, torch.bfloat16, seed=1, skip=2), DEV)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (cuBLAS handles, allocator) off the capture
        ops.materialize_context_kv(**static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.materialize_context_kv(**static)
    fresh = _context_kv_on(make_context_kv_inputs(8, 256, 2, 2, 128, 128, torch.bfloat16, seed=2, skip=3), DEV)
    for name in ("ctx", "positions", "out_loc"):
        static[name].copy_(fresh[name])
    for pool in static["k_caches"] + static["v_caches"]:
        pool.fill_(float("nan"))
    check_against_reference(static, run=lambda **_: graph.replay())


# ------------------------------------------------------------------------------------------------
# Out-of-range indices (tests/test_ops_index_errors.py: recorded, raised by check_device_errors)


def test_index_error_recorded_in_a_graph_replay():
    """The error record works inside CUDA graphs: a bad candidate written into a captured verify's
    input buffer is raised by the check after the replay, and the next clean replay raises nothing."""
    bs, block, vocab = 2, 4, 100
    logits, cand = _verify_inputs(bs, block, vocab, torch.float32, seed=6)
    static = [t.to(DEV) for t in (cand, logits, *_params(bs, 0.0, 0, 1.0))]
    ops.verify_block(*static[:5], 0, static[5])  # warm-up, off the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.verify_block(*static[:5], 0, static[5])
    static[0][1, 3] = vocab + 7
    graph.replay()
    text = f"sglang_dflash.verify_block: candidates[1, 3] = {vocab + 7} is outside the vocabulary [0, {vocab})"
    with pytest.raises(RuntimeError, match=re.escape(text)):
        ops.check_device_errors(DEV)
    static[0][1, 3] = 0
    graph.replay()
    ops.check_device_errors(DEV)


_TRAP_SCRIPT = textwrap.dedent(
    """
    import torch
    from tests.test_ops_index_errors import CASES
    CASES[{name!r}][0](torch.device("cuda"))()
    torch.cuda.synchronize()
    print("NO TRAP")
    """
)


@pytest.mark.skipif(not torch.ops.sglang_dflash.device_checks_trap(),
                    reason="a debug build's behaviour (SGLANG_DFLASH_DEBUG=1); this build records index errors")
@pytest.mark.parametrize("name", ["attention_slot", "verify_candidate", "context_out_loc", "tree_depth"])
def test_debug_build_traps_with_the_error_text(name):
    """Built with SGLANG_DFLASH_DEBUG=1, a bad index prints the error's text and traps (in a child
    process: the trap ends its CUDA context)."""
    from tests.test_ops_index_errors import CASES

    proc = subprocess.run([sys.executable, "-c", _TRAP_SCRIPT.format(name=name)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "NO TRAP" not in proc.stdout, output
    assert f"sglang_dflash device check failed: {CASES[name][1]}" in output, output


def test_module_constants_sane():
    # Gumbel noise is bounded as sampling.h says, so the pruning in both twins is exact.
    assert -math.log(-math.log(1 - 2.0**-24)) < 16.7
