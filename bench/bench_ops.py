"""CPU op benchmark: each kernel side by side with its pure-PyTorch reference, in one process.

Prints, per shape, the median time of both, the ratio (reference / kernel) and the kernel's
achieved bandwidth over the bytes it must read (context K/V for block_attention; for
verify_block the logits rows up to each request's first rejection; for skinny_linear the
weights and inputs) and that as % of this machine's measured read bandwidth (a sum over 256 MiB:
the memory roofline of a kernel that streams its inputs once), and writes the table to
bench/results/cpu_ops.json. skinny_linear's baseline is torch's own F.linear (BLAS),
the op it replaces, and with an int8 weight (the int8 drafter's) it is the same kernel on the bf16
weight (what that drafter ran before); its weights are SmolLM2-135M's shapes, as many copies as
the model has layers, so they stream from memory as in a decode step rather than sitting in cache.
w8a8_linear's baseline is skinny_linear on the same int8 weights (the drafter's path without VNNI).
On a CPU with AVX-512, skinny_linear's and block_attention's AVX-512 paths are also timed against
their AVX2 paths (run in a child process, in turns) at the rows of draft-tree verifies, and on a
CPU with AMX skinny_linear's bf16 path and w8a8_linear on AMX tiles against their paths without.
target_verify times a whole verify forward of the packaged target (fp32 and bf16) with its
attention through block_attention against the SDPA path it replaced (alternating calls), and
prefill_attention one served prefill attention layer through block_attention against SGLang's SDPA.

    python -m bench.bench_ops [--quick] [--out bench/results/cpu_ops.json]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing
import os
import platform
import statistics
import time

import torch
from tqdm import tqdm

from bench.provenance import run_info
from sglang_dflash import ops
from sglang_dflash.drafters import SHIPPED_DRAFTER, resolve_draft  # noqa: E402
from sglang_dflash.engine.packaged import model_dir  # noqa: E402
from sglang_dflash.models.skinny import quantize_rows  # noqa: E402
from sglang_dflash.ops import reference  # noqa: E402
from sglang_dflash.ops.testing import make_attention_inputs as make_inputs  # noqa: E402
from sglang_dflash.ops.testing import make_tree  # noqa: E402

# (bs, B, Hq, Hkv, D, ctx, dtype); the first row is the foundation issue's goal shape.
ATTENTION_SHAPES = [
    (4, 16, 16, 4, 128, 2048, torch.float32),
    (1, 16, 32, 8, 128, 4096, torch.float32),
    (8, 16, 16, 4, 128, 1024, torch.bfloat16),
    (4, 8, 16, 4, 64, 512, torch.float32),
    # the shipped SmolLM2 drafter at B 4 (12 query rows per kv head)
    (1, 4, 9, 3, 64, 150, torch.bfloat16),
    (1, 4, 9, 3, 64, 600, torch.bfloat16),
    # served SmolLM2 target (SGLang's default dtype for it: fp16 pools): a B 4 verify at 1 and 8
    # requests, and plain decoding (B 1) at 8
    (1, 4, 9, 3, 64, 300, torch.float16),
    (8, 4, 9, 3, 64, 300, torch.float16),
    (8, 1, 9, 3, 64, 300, torch.float16),
    # ... verifying a 16-node draft tree (tree mode: each row sees its ancestors), against the
    # causal chain of as many rows
    (1, 16, 9, 3, 64, 300, torch.float16, "causal"),
    (1, 16, 9, 3, 64, 300, torch.float16, "tree"),
    (8, 16, 9, 3, 64, 300, torch.float16, "causal"),
    (8, 16, 9, 3, 64, 300, torch.float16, "tree"),
    (1, 4, 9, 3, 64, 300, torch.bfloat16),
]
# (bs, B, V, temperature, drafts); "agree": every draft matches, so every row is read (worst
# case); "random": drafts almost surely wrong, so only row 0 of each request is read.
VERIFY_SHAPES = [
    (8, 16, 151936, 0.0, "agree"),
    (8, 16, 151936, 0.0, "random"),
    (1, 16, 151936, 0.0, "agree"),
    (1, 16, 151936, 1.0, "agree"),
    (8, 16, 151936, 1.0, "agree"),
    (8, 16, 151936, 1.0, "random"),
]
# (rows, N, K, copies, dtype): SmolLM2-135M's LM head, and its 30 layers' MLP up projections.
LINEAR_SHAPES = [
    (1, 49152, 576, 1, torch.float32),
    (4, 49152, 576, 1, torch.float32),
    (8, 49152, 576, 1, torch.float32),
    (1, 1536, 576, 30, torch.float32),
    (4, 1536, 576, 30, torch.float32),
    (8, 1536, 576, 30, torch.float32),
    # the down projections (K = 1536) at verify blocks of 2, 3 and 4: 3 rows cost more than 4 here
    (2, 576, 1536, 30, torch.float32),
    (3, 576, 1536, 30, torch.float32),
    (4, 576, 1536, 30, torch.float32),
    (7, 49152, 576, 1, torch.bfloat16),
    # served SmolLM2 in fp16 (SGLang's default for it on CPU): decode (1 row), a B 4 verify, 8
    # requests' verify rows; torch's fp16 GEMM is the baseline a server without the plugin runs
    (1, 1536, 576, 30, torch.float16),
    (4, 1536, 576, 30, torch.float16),
    (32, 1536, 576, 30, torch.float16),
    (4, 49152, 576, 1, torch.float16),
    # the int8 drafter (bf16 activations): its MLP-sized projections at B 2 and 4, its 16k-row head
    (1, 1536, 576, 30, torch.int8),
    (2, 1536, 576, 30, torch.int8),
    (4, 1536, 576, 30, torch.int8),
    (1, 16384, 576, 4, torch.int8),
]


def median_time(fn, repeats: int) -> float:
    for _ in range(3):  # warm-up: thread pool, page faults, caches
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_median_times(fn, baseline, repeats: int) -> tuple[float, float]:
    """Median times of fn and baseline, called in turns, so a drift of the machine (its memory
    bandwidth moves by tens of % within minutes) falls on both alike."""
    for _ in range(3):
        fn()
        baseline()
    times, baseline_times = [], []
    for _ in range(repeats):
        for f, out in ((fn, times), (baseline, baseline_times)):
            start = time.perf_counter()
            f()
            out.append(time.perf_counter() - start)
    return statistics.median(times), statistics.median(baseline_times)


def bench_attention(shape, repeats):
    """shape: (bs, B, Hq, Hkv, D, ctx, dtype[, "causal" | "tree"]); non-causal without the mode."""
    bs, block, hq, hkv, d, ctx, dtype, *mode = shape
    args = make_inputs(bs, block, hq, hkv, d, [ctx] * bs, dtype, seed=0)
    if mode == ["tree"]:
        args["tree_parents"] = make_tree(bs, block, 100, torch.Generator().manual_seed(0), unused=0.0)[1]
    kwargs = dict(block_size=block, causal_block=mode == ["causal"])
    kernel = median_time(lambda: ops.block_attention(**args, **kwargs), repeats)
    ref = median_time(lambda: reference.block_attention(**args, **kwargs), max(2, repeats // 4))
    kv_bytes = 2 * bs * (ctx + block) * hkv * d * args["k_cache"].element_size()
    flops = 4 * bs * block * hq * (ctx + block) * d  # QK^T and PV; on CPU this op is compute-bound
    return dict(op="block_attention", bs=bs, B=block, Hq=hq, Hkv=hkv, D=d, ctx=ctx,
                dtype=str(dtype).removeprefix("torch."), **({"mode": mode[0]} if mode else {}), kernel_ms=kernel * 1e3,
                reference_ms=ref * 1e3, ratio=ref / kernel, kernel_GBps=kv_bytes / kernel / 1e9,
                kernel_GFLOPs=flops / kernel / 1e9)


# (prompt tokens, dtype): one served prefill attention layer of SmolLM2-135M (9 query, 3 KV heads of 64).
PREFILL_SHAPES = [(128, torch.float16), (512, torch.float16), (2000, torch.float16), (512, torch.float32)]


def bench_prefill_attention(shape, repeats):
    """One prefill attention layer of a prompt with nothing cached, as a CPU server with the plugin
    runs it (serving/attention.prefill_attention: block_attention in causal blocks of
    PREFILL_BLOCK_ROWS rows, each row the same bits as its decode), against the SDPA call SGLang's
    torch_native backend makes for it (is_causal, keys grouped by enable_gqa)."""
    from sglang_dflash.serving.attention import prefill_attention

    prompt, dtype = shape
    hq, hkv, d = 9, 3, 64
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(prompt, hq, d, generator=gen).to(dtype)
    k, v = (torch.randn(prompt, hkv, d, generator=gen).to(dtype) for _ in range(2))
    k_cache, v_cache = torch.cat([k[:1] * 0, k]), torch.cat([v[:1] * 0, v])  # slot 0 unused, as in SGLang
    table = torch.arange(1, prompt + 1, dtype=torch.int32)[None]

    def sdpa():
        torch.nn.functional.scaled_dot_product_attention(q.movedim(0, 1), k.movedim(0, 1), v.movedim(0, 1),
                                                         is_causal=True, scale=d ** -0.5, enable_gqa=True)

    kernel, baseline = paired_median_times(
        lambda: prefill_attention(q, k, v, k_cache, v_cache, table, torch.zeros(1, dtype=torch.int64), 0,
                                  sm_scale=d ** -0.5), sdpa, repeats)
    io_bytes = (2 * hq + 2 * hkv) * prompt * d * q.element_size()
    flops = 2 * hq * prompt * (prompt + 1) * d  # QK^T and PV over the causal half
    return dict(op="prefill_attention", prompt=prompt, Hq=hq, Hkv=hkv, D=d, dtype=str(dtype).removeprefix("torch."),
                baseline="SDPA (SGLang's torch_native)", kernel_ms=kernel * 1e3, reference_ms=baseline * 1e3,
                ratio=baseline / kernel, kernel_GBps=io_bytes / kernel / 1e9, kernel_GFLOPs=flops / kernel / 1e9)


def bench_verify(shape, repeats):
    bs, block, vocab, temperature, drafts = shape
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(bs * block, vocab, generator=gen)
    args = dict(temperature=torch.full((bs,), temperature), top_k=torch.zeros(bs, dtype=torch.int32),
                top_p=torch.ones(bs), seed=1, offsets=torch.arange(bs, dtype=torch.int64))
    cand = torch.randint(0, vocab, (bs, block), generator=gen)
    if drafts == "agree":
        target = reference.target_samples(logits, block_size=block, **args)
        cand[:, 1:] = target[:, :-1]
    # Copies of the logits cycled through, > 3x the L3 in all, so no call reads them from cache.
    copies = [logits.clone() for _ in range(-(-(96 << 20) // logits.nbytes))]
    kernel = median_time(lambda: [ops.verify_block(cand, c, **args) for c in copies], repeats) / len(copies)
    ref = median_time(lambda: reference.verify_block(cand, logits, **args), max(2, repeats // 4))
    accept = ops.verify_block(cand, logits, **args)[0]
    # The kernel reads a request's rows only up to its first rejection: accept_len + 1 rows.
    rows_read = int((accept.long() + 1).sum())
    return dict(op="verify_block", bs=bs, B=block, V=vocab, temperature=temperature, drafts=drafts,
                mean_accept=float(accept.float().mean()), kernel_ms=kernel * 1e3,
                reference_ms=ref * 1e3, ratio=ref / kernel,
                kernel_GBps=rows_read * vocab * logits.element_size() / kernel / 1e9)


def read_bandwidth() -> float:
    """Bytes per second torch's fastest full reductions (sum, dot) read from a 256 MiB tensor: the
    roofline of a kernel that reads its inputs once and writes little (a copy's read + write rate
    is lower, and kernels that only read beat it)."""
    src = torch.randn(64 << 20)
    return src.numel() * 4 / min(median_time(lambda: src.sum(), 5), median_time(lambda: torch.dot(src, src), 5))


def seeded_linear_inputs(rows, n, k, copies):
    """`copies` fp32 weights [n, k] and an fp32 x [rows, k], the same for the same arguments in
    every case and process."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for _ in range(copies)]
    return weights, torch.randn(rows, k, generator=gen)


def bench_skinny_linear(shape, repeats):
    rows, n, k, copies, dtype = shape
    weights, x = seeded_linear_inputs(rows, n, k, copies)
    x = x.to(torch.bfloat16 if dtype == torch.int8 else dtype)
    if dtype == torch.int8:  # against the same kernel on the bf16 weight
        quantized = [quantize_rows(w) for w in weights]
        bf16 = [w.bfloat16() for w in weights]
        kernel, base = paired_median_times(lambda: [ops.skinny_linear(x, q, None, s) for q, s in quantized],
                                           lambda: [ops.skinny_linear(x, w) for w in bf16], repeats)
        baseline, weight_bytes = "skinny_linear bf16", n * (k + 4)
    else:
        weights = [w.to(dtype) for w in weights]
        kernel, base = paired_median_times(lambda: [ops.skinny_linear(x, w) for w in weights],
                                           lambda: [torch.nn.functional.linear(x, w) for w in weights], repeats)
        baseline, weight_bytes = "F.linear", n * k * x.element_size()
    gbps = copies * (weight_bytes + rows * k * x.element_size()) / kernel / 1e9  # weights + x, read once per copy
    return dict(op="skinny_linear", rows=rows, N=n, K=k, copies=copies, dtype=str(dtype).removeprefix("torch."),
                isa=ops.float_dot_isa(), baseline=baseline, kernel_ms=kernel * 1e3, reference_ms=base * 1e3,
                ratio=base / kernel, kernel_GBps=gbps)


# Each op on its widest instruction path against the next narrower one, the narrower in a child
# process (the path is chosen once per process), the two timed in turns:
# - "fma" (SGLANG_DFLASH_NO_AVX512 in the child): skinny_linear fp32 on AVX-512 against AVX2
#   (float_dot_isa) at the target's MLP projections (K = 576 and 1536) and LM head, at the verify
#   rows of draft trees of 4, 8 and 15 nodes; block_attention's tile GEMMs on AVX-512 against AVX2
#   at the target's 30 layers' decode (1 row) and verify rows, 300 tokens of context.
# - "amx" (SGLANG_DFLASH_NO_AMX): skinny_linear bf16 on AMX tiles against the AVX-512 FMA path
#   (bf16_dot_isa; plus 1 row, plain decoding), and w8a8_linear on AMX-INT8 tiles against
#   AVX512-VNNI (int8_dot_isa) at the drafter's shapes (W8A8_SHAPES) from 3 rows (AMX's least)
#   to a block of 8.
# Cases: (op, shape); skinny_linear (rows, N, K, copies, dtype), block_attention (rows, context,
# dtype), w8a8_linear (rows, N, K, copies).
FMA_PATH_CASES = [("skinny_linear", s) for s in [
    (5, 1536, 576, 30, torch.float32), (9, 1536, 576, 30, torch.float32), (16, 1536, 576, 30, torch.float32),
    (9, 576, 1536, 30, torch.float32), (9, 49152, 576, 1, torch.float32)]]
FMA_PATH_CASES += [("block_attention", s) for s in [
    (1, 300, torch.bfloat16), (5, 300, torch.bfloat16), (9, 300, torch.bfloat16), (16, 300, torch.bfloat16),
    (9, 300, torch.float32)]]
AMX_PATH_CASES = [("skinny_linear", s) for s in [
    (1, 1536, 576, 30, torch.bfloat16), (5, 1536, 576, 30, torch.bfloat16), (9, 1536, 576, 30, torch.bfloat16),
    (16, 1536, 576, 30, torch.bfloat16), (24, 1536, 576, 30, torch.bfloat16), (32, 1536, 576, 30, torch.bfloat16),
    (9, 576, 1536, 30, torch.bfloat16), (9, 49152, 576, 1, torch.bfloat16)]]
AMX_PATH_CASES += [("w8a8_linear", s) for s in [
    (3, 1536, 576, 9), (5, 1536, 576, 9), (8, 1536, 576, 9), (3, 16384, 576, 1), (5, 16384, 576, 1),
    (8, 16384, 576, 1)]]
# What each comparison turns off in the child process, and which isa each op reports.
NARROWER_PATHS = {"fma": ("SGLANG_DFLASH_NO_AVX512", "avx2"), "amx": ("SGLANG_DFLASH_NO_AMX", "no AMX")}
PATH_ISA = {"skinny_linear": lambda shape: ops.bf16_dot_isa() if shape[4] == torch.bfloat16 else ops.float_dot_isa(),
            "block_attention": lambda shape: ops.float_dot_isa(), "w8a8_linear": lambda shape: ops.int8_dot_isa()}
ATTENTION_LAYERS = 30  # calls a round: the target's layers


# Each process waits this long before it times: the other one's OpenMP threads spin for some
# milliseconds after its last parallel loop, and on 2 cores that halves the speed of whoever runs.
QUIET_S = 0.05


def path_case(case):
    """One round of a case's calls, on seeded inputs (the same in every process), with the fields
    that name the case in the results and the bytes a round must read."""
    op, shape = case
    if op == "block_attention":
        rows, ctx, dtype = shape
        args = make_inputs(1, rows, 9, 3, 64, [ctx], dtype, seed=0)  # SmolLM2-135M's heads
        fields = dict(rows=rows, context=ctx, layers=ATTENTION_LAYERS, dtype=str(dtype).removeprefix("torch."))
        moved = ATTENTION_LAYERS * (ctx + rows) * 3 * 64 * 2 * dtype.itemsize  # K and V of 3 kv heads a layer
        return (lambda: [ops.block_attention(**args, block_size=rows, causal_block=True)
                         for _ in range(ATTENTION_LAYERS)]), fields, moved
    rows, n, k, copies = shape[:4]
    weights, x = seeded_linear_inputs(rows, n, k, copies)
    if op == "w8a8_linear":
        quantized, x = [quantize_rows(w) for w in weights], x.bfloat16()
        return ((lambda: [ops.w8a8_linear(x, q, scale) for q, scale in quantized]),
                dict(rows=rows, N=n, K=k, copies=copies), w8a8_bytes(rows, n, k, copies))
    dtype = shape[4]
    weights, x = [w.to(dtype) for w in weights], x.to(dtype)
    return ((lambda: [ops.skinny_linear(x, w) for w in weights]),
            dict(rows=rows, N=n, K=k, copies=copies, dtype=str(dtype).removeprefix("torch.")),
            copies * (n + rows) * k * dtype.itemsize)


def w8a8_bytes(rows, n, k, copies):
    """What w8a8_linear must read: the int8 weights with their fp32 scales and the bf16 x, a copy."""
    return copies * (n * (k + 4) + rows * k * 2)


def time_on_request(conn):
    """The child of bench_paths: per shape received, warm up, then time one round of calls per
    request; None ends it. It says "ready" first, once its imports are done."""
    conn.send("ready")
    calls, case = None, None
    while (request := conn.recv()) is not None:
        if request != case:
            case, calls = request, path_case(request)[0]
            for _ in range(3):
                calls()
        time.sleep(QUIET_S)
        calls()  # wakes this process's threads (and the core's clock) after the pause
        start = time.perf_counter()
        calls()
        conn.send(time.perf_counter() - start)


@contextlib.contextmanager
def narrower_path_process(switch: str):
    """A child process started with the environment switch `switch`=1 (its kernels on the narrower
    path), serving time_on_request."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    before = os.environ.get(switch)
    os.environ[switch] = "1"
    try:
        proc = ctx.Process(target=time_on_request, args=(child,), daemon=True)
        proc.start()
    finally:
        if before is None:
            os.environ.pop(switch)
        else:
            os.environ[switch] = before
    try:
        parent.recv()  # its start-up (imports) would otherwise slow the first cases timed here
        yield parent
    finally:
        parent.send(None)
        proc.join(timeout=60)


def bench_paths(case, repeats, child, baseline):
    """A case on this process's (widest) path against the child's (narrower) one, in turns."""
    op, shape = case
    calls, fields, moved = path_case(case)
    for _ in range(3):
        calls()
    times, child_times = [], []
    for _ in range(repeats):
        time.sleep(QUIET_S)
        calls()  # as the child does: wakes the threads after the pause
        start = time.perf_counter()
        calls()
        times.append(time.perf_counter() - start)
        child.send(case)
        child_times.append(child.recv())
    kernel, base = statistics.median(times), statistics.median(child_times)
    return dict(op=op, **fields, isa=PATH_ISA[op](shape), baseline=f"{op} {baseline}", kernel_ms=kernel * 1e3,
                reference_ms=base * 1e3, ratio=base / kernel, kernel_GBps=moved / kernel / 1e9)


# (rows, N, K, copies): the shipped drafter's int8 layers, an MLP projection (N x K as gate / up,
# copies for its 3 layers x 3 matrices) and its draft-vocabulary LM head, at 1 row, a block of 5
# (B = 4 plus the adaptive controller's extra draft) and 4 requests' blocks of 5.
W8A8_SHAPES = [(1, 1536, 576, 9), (5, 1536, 576, 9), (20, 1536, 576, 9),
               (1, 16384, 576, 1), (5, 16384, 576, 1), (20, 16384, 576, 1)]


def bench_w8a8_linear(shape, repeats):
    """w8a8_linear against skinny_linear on the same int8 weights (what the drafter ran before:
    activations in bf16, fp32 arithmetic); bandwidth over the int8 weights and scales."""
    rows, n, k, copies = shape
    weights, x = seeded_linear_inputs(rows, n, k, copies)
    quantized, x = [quantize_rows(w) for w in weights], x.bfloat16()
    kernel, base = paired_median_times(lambda: [ops.w8a8_linear(x, q, s) for q, s in quantized],
                                       lambda: [ops.skinny_linear(x, q, None, s) for q, s in quantized], repeats)
    return dict(op="w8a8_linear", rows=rows, N=n, K=k, copies=copies, isa=ops.int8_dot_isa(),
                baseline="skinny_linear int8", kernel_ms=kernel * 1e3, reference_ms=base * 1e3,
                ratio=base / kernel, kernel_GBps=w8a8_bytes(rows, n, k, copies) / kernel / 1e9)


# (rows, heads, D, rotary): the shipped drafter's q / k norm + RoPE at B 4 and 8, its hidden_norm
# rows (no RoPE), and a Qwen3-8B-sized q at B 16.
NORM_SHAPES = [(4, 9, 64, 64), (4, 3, 64, 64), (8, 9, 64, 64), (4, 1, 576, 0), (16, 32, 128, 128)]


@contextlib.contextmanager
def draft_model_torch_path():
    """The draft model's PyTorch path for what it otherwise runs through rms_norm_rope (the model
    takes it wherever the op does not run our kernel)."""
    saved = set(ops._REFERENCE_ON)
    ops._REFERENCE_ON.add(("rms_norm_rope", torch.device("cpu")))
    try:
        yield
    finally:
        ops._REFERENCE_ON.clear()
        ops._REFERENCE_ON.update(saved)


def bench_rms_norm_rope(shape, repeats):
    """Against what the draft model runs without the kernel: its RMSNorm module, then apply_rope
    with cos / sin rows (bf16, the drafter's dtype)."""
    from sglang_dflash.models.draft import RMSNorm, apply_rope

    rows, heads, d, rotary = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, heads, d, generator=gen).to(torch.bfloat16)
    norm = RMSNorm(d, 1e-6).to(torch.bfloat16)
    table = torch.randn(4096, d, generator=gen) if rotary else None
    pos = torch.randint(0, 4096, (rows,), generator=gen) if rotary else None
    cos = sin = torch.randn(rows, d, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        kernel = median_time(lambda: ops.rms_norm_rope(x, norm.weight, 1e-6, table, pos), repeats * 100)
        with draft_model_torch_path():
            torch_ops = median_time((lambda: apply_rope(norm(x), cos, sin)) if rotary else (lambda: norm(x)),
                                    repeats * 100)
    return dict(op="rms_norm_rope", rows=rows, heads=heads, D=d, rope=bool(rotary), dtype="bfloat16",
                baseline="torch ops", kernel_ms=kernel * 1e3, reference_ms=torch_ops * 1e3, ratio=torch_ops / kernel,
                kernel_GBps=2 * x.nbytes / kernel / 1e9)


# (rows, V, k, dtype): a draft tree's positions (an 8-deep tree: 7; two requests: 14), top 4 each,
# over the shipped drafter's 16384-token draft vocabulary as its head returns them; and over
# SmolLM2's whole vocabulary (a drafter without a draft vocabulary).
TOP_K_SHAPES = [(7, 16384, 4, torch.bfloat16), (14, 16384, 4, torch.bfloat16), (7, 49152, 4, torch.bfloat16),
                (7, 49152, 8, torch.float32)]


def bench_top_k_logprobs(shape, repeats):
    """Against what a tree step ran before the kernel: torch's log_softmax, then topk."""
    rows, vocab, k, dtype = shape
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    kernel, torch_ops = paired_median_times(lambda: ops.top_k_logprobs(logits, k),
                                            lambda: logits.float().log_softmax(-1).topk(k, dim=-1), repeats * 20)
    return dict(op="top_k_logprobs", rows=rows, V=vocab, k=k, dtype=str(dtype).removeprefix("torch."),
                baseline="log_softmax + topk", kernel_ms=kernel * 1e3, reference_ms=torch_ops * 1e3,
                ratio=torch_ops / kernel, kernel_GBps=logits.nbytes / kernel / 1e9)


# (layers, capacity, moves): a tree step's accepted path into place in SmolLM2's K and V caches (3
# kv heads x 64, bf16, one request's buffer of `capacity` columns), a few nodes moved per step.
MOVE_SHAPES = [(30, 512, 3), (30, 512, 7)]


def bench_move_slots(shape, repeats):
    """Against one indexed copy per buffer (the reference, what a step ran before the kernel)."""
    layers, capacity, moves = shape
    gen = torch.Generator().manual_seed(0)
    buffers = [torch.randn(capacity, 3, 64, generator=gen).bfloat16() for _ in range(2 * layers)]
    dst = torch.arange(300, 300 + moves)
    src = dst + torch.arange(1, moves + 1)  # each path node a few columns after its place
    kernel, indexed = paired_median_times(lambda: ops.move_slots(buffers, src, dst),
                                          lambda: reference.move_slots(buffers, src, dst), repeats * 20)
    moved = 2 * 2 * layers * moves * 3 * 64 * 2  # read and written, K and V
    return dict(op="move_slots", layers=layers, capacity=capacity, moves=moves, dtype="bfloat16",
                baseline="index copy per buffer", kernel_ms=kernel * 1e3, reference_ms=indexed * 1e3,
                ratio=indexed / kernel, kernel_GBps=moved / kernel / 1e9)


def bench_draft_forward(block_size, repeats):
    """One forward of the shipped drafter (bs 1, 300 context tokens) with its CPU kernels
    (rms_norm_rope) and with the PyTorch ops they replace; the matmuls run skinny_linear in both."""
    from sglang_dflash.models import load_draft

    draft = load_draft(resolve_draft(SHIPPED_DRAFTER), dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    draft.allocate_cache(400, 1, 400)
    with torch.no_grad():
        draft.append_context([draft.cache.add_request()], [300], torch.randn(300, draft.fc.in_features, generator=gen))
    embeds = torch.randn(block_size, draft.config.hidden_size, generator=gen)
    rows = torch.tensor([0])
    with torch.no_grad():
        kernel = median_time(lambda: draft(embeds, rows, block_size), repeats * 20)
        with draft_model_torch_path():
            torch_ops = median_time(lambda: draft(embeds, rows, block_size), repeats * 20)
    weights = sum(p.nbytes for p in draft.layers.parameters())
    return dict(op="draft_forward", B=block_size, layers=len(draft.layers), dtype="bfloat16", baseline="torch ops",
                kernel_ms=kernel * 1e3, reference_ms=torch_ops * 1e3, ratio=torch_ops / kernel,
                kernel_GBps=weights / kernel / 1e9)


TARGET = "smollm2-135m"  # the packaged target of the target_verify rows


@contextlib.contextmanager
def sdpa_attention_path():
    """The target's decode and verify attention as it was before it ran block_attention: SDPA with
    the mask prepared once per forward (grouped_attention without a kernel_step)."""
    from sglang_dflash.engine import grouped_attention

    saved = grouped_attention.kernel_step
    grouped_attention.kernel_step = lambda *args: contextlib.nullcontext()
    try:
        yield
    finally:
        grouped_attention.kernel_step = saved


def bench_target_verify(shape, repeats):
    """One verify forward of the packaged SmolLM2-135M target (bs 1, `context` tokens) over a block,
    rolled back after each call: its attention through block_attention (bit for bit what decoding
    computes), against the SDPA path it replaced. Both include the whole target forward."""
    from sglang_dflash.engine import HFTarget

    block_size, context, dtype = shape
    target = HFTarget.from_pretrained(model_dir(TARGET), dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    target.prefill([torch.randint(0, target.vocab_size, (context,), generator=gen).tolist()])
    tokens = torch.randint(0, target.vocab_size, (1, block_size), generator=gen)
    positions = torch.arange(context, context + block_size)[None]
    keep_none = torch.zeros(1, dtype=torch.int64)

    def step():
        target.verify(tokens, positions)
        target.commit(keep_none)

    def baseline_step():
        with sdpa_attention_path():
            step()

    kernel, baseline = paired_median_times(step, baseline_step, repeats * 4)
    weights = sum(p.nbytes for p in target.model.parameters())
    return dict(op="target_verify", B=block_size, ctx=context, dtype=str(dtype).removeprefix("torch."),
                baseline="SDPA attention", kernel_ms=kernel * 1e3, reference_ms=baseline * 1e3,
                ratio=baseline / kernel, kernel_GBps=weights / kernel / 1e9)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="first shape of each op, few repeats")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_ops.json"))
    opts = parser.parse_args()
    # The draft_forward and target_verify rows run the shipped drafter and the packaged target;
    # the other ops random inputs. Collected before the run loads the machine.
    info = run_info({"target": model_dir(TARGET), "draft": resolve_draft(SHIPPED_DRAFTER)})
    repeats = 3 if opts.quick else 10
    with contextlib.ExitStack() as stack:  # the narrower paths' child processes, where there are some
        jobs = [(bench_attention, s) for s in ATTENTION_SHAPES[: 1 if opts.quick else None]]
        jobs += [(bench_prefill_attention, s) for s in PREFILL_SHAPES[: 1 if opts.quick else None]]
        jobs += [(bench_verify, s) for s in VERIFY_SHAPES[: 1 if opts.quick else None]]
        jobs += [(bench_skinny_linear, s) for s in LINEAR_SHAPES[: 1 if opts.quick else None]]
        for name, cases, widest in (("fma", FMA_PATH_CASES, ops.float_dot_isa() == "avx512"),
                                    ("amx", AMX_PATH_CASES, ops.bf16_dot_isa() == "amx_bf16")):
            if widest:
                switch, baseline = NARROWER_PATHS[name]
                child = stack.enter_context(narrower_path_process(switch))
                paths = functools.partial(bench_paths, child=child, baseline=baseline)
                jobs += [(paths, c) for c in cases[: 1 if opts.quick else None]]
        jobs += [(bench_w8a8_linear, s) for s in W8A8_SHAPES[: 1 if opts.quick else None]]
        jobs += [(bench_rms_norm_rope, s) for s in NORM_SHAPES[: 1 if opts.quick else None]]
        jobs += [(bench_top_k_logprobs, s) for s in TOP_K_SHAPES[: 1 if opts.quick else None]]
        jobs += [(bench_move_slots, s) for s in MOVE_SHAPES[: 1 if opts.quick else None]]
        jobs += [(bench_draft_forward, b) for b in [2, 4, 8][: 1 if opts.quick else None]]
        verify_shapes = [(2, 300, torch.float32), (4, 300, torch.float32), (9, 300, torch.float32),
                         (4, 1500, torch.float32), (1, 300, torch.bfloat16), (9, 300, torch.bfloat16)]
        jobs += [(bench_target_verify, s) for s in verify_shapes[: 1 if opts.quick else None]]
        # This VM's memory bandwidth drifts (27-53 GB/s seen on one machine): the best of a probe
        # before and one after the cases.
        before = read_bandwidth()
        rows = [fn(shape, repeats) for fn, shape in tqdm(jobs, desc="benchmark", unit="shape")]
    bandwidth = max(before, read_bandwidth())
    for row in rows:
        row["roofline_pct"] = 100 * row["kernel_GBps"] * 1e9 / bandwidth

    print(f"\nCPU: {platform.processor() or platform.machine()}, torch threads: {torch.get_num_threads()}, "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    for row in rows:
        timing = ("kernel_ms", "reference_ms", "ratio", "kernel_GBps", "kernel_GFLOPs", "roofline_pct")
        shape = {k: v for k, v in row.items() if k != "op" and k not in timing}
        flops = f"   {row['kernel_GFLOPs']:6.1f} GFLOP/s" if "kernel_GFLOPs" in row else ""
        flops += f"   {row['roofline_pct']:5.1f}% of roofline"
        print(f"{row['op']:16s} {shape}\n    kernel {row['kernel_ms']:9.3f} ms   {row.get('baseline', 'reference')} "
              f"{row['reference_ms']:9.3f} ms   ratio {row['ratio']:6.1f}x   {row['kernel_GBps']:6.1f} GB/s{flops}")
    result = dict(provenance=info, read_GBps=bandwidth / 1e9, cases=rows)
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    with open(opts.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
