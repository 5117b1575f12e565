"""GPU benchmark of our CUDA kernels against fair baselines, each checked before it is timed.

block_attention (bf16, Qwen3-8B draft shapes: Hq 32, Hkv 8, D 128, block 16; non-causal, no window, as
DFlash drafts; context slots a random permutation of the cache, the hard case for a paged gather):
  sdpa_pregathered  torch SDPA on K/V already gathered into contiguous [bs, S, Hkv, D] tensors: the gather
                    is not timed, so this is a dense lower bound. The queries of a GQA group are packed
                    into one head's query rows ([bs, Hkv, B*G, D]), exact for a mask-free block and K/V
                    read once; the first backend that runs of FLASH / EFFICIENT / CUDNN / MATH is used and
                    recorded.
  triton_split_kv   a flash-decoding Triton kernel on the paged cache: phase 1 splits each request's
                    context into chunks (split count from shapes, like ours), one program per (request, kv
                    head, chunk) keeps (max, sum, acc) for all B*G query rows; phase 2 merges the chunks.
verify_block (V 151936, block 16, fp32 logits; greedy, temperature 1, and T 0.7 / top-k 20 / top-p 0.95):
  torch_argmax_accept  greedy: argmax, then the longest agreeing prefix + bonus, in plain torch ops.
  torch_sampled        SGLang's production-style path in plain torch: softmax(logits / T), top-k by
                       torch.topk and top-p renormalised within those candidates (no full-vocabulary
                       sort), multinomial, then the same accept rule.
block_attention in tree mode (issue 17: the target verifying a draft tree of 15 nodes and its root, each
node seeing the context and its ancestors; the same shapes, bf16):
  sdpa_pregathered  SDPA on pre-gathered K/V as above, with the tree as a boolean mask over the block (the
                    packed query rows of a kv head repeat their node's mask row); FLASH takes no mask, so
                    the first of EFFICIENT / CUDNN / MATH that runs.
verify_tree (the same tree, V 151936, fp32 logits; greedy and T 0.7 / top-k 20 / top-p 0.95):
  torch_walk        greedy: argmax of every node, then the walk from the root in plain torch ops (one
                    step a depth: the lowest-index child holding its parent's target token).
  torch_sampled_walk  every node sampled SGLang's way (torch_sampled above), then the same walk.
Every implementation runs once on the first input set and is compared with sglang_dflash.ops.reference
(attention: max over (row, head) of the relative L2 error <= 2e-2; verify: exact, with ours checked on
up to 2 requests of the Python-loop spec when sampling, and the sampled baseline unchecked as it draws
other samples by design). One that fails or raises is not timed; its failure goes into the case and
the exit status.

Timing: CUDA events around each call, each call queued behind a ~1 ms sleep kernel so the events see
device time, not Python overhead (SGLang replays these ops in CUDA graphs; a call whose host time
exceeds the sleep is flagged host_bound). Calls rotate over enough input sets that >= 4x the L2
cache's bytes are read before a set comes back (at least 2 sets), so no case runs from L2. Reported:
median, p10, p90 of the per-call times. hbm_fraction = the bytes the op must move once (counted per op
below) / our median time / the device-to-device copy bandwidth measured at the start of the same run;
hbm_fraction_spec uses the data-sheet bandwidth instead (H200: 4.8 TB/s).

Writes one JSON (default bench/results/bench_kernels_<device>.json), rewritten after every case so a run
cut short keeps what it measured, and prints the issue's goals as a table at the end. Needs a CUDA GPU
and the extension built with its CUDA kernels; exits 1 when any check failed or an implementation
raised.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from bench.provenance import run_info
from sglang_dflash import ops
from sglang_dflash._extension import has_cuda_kernels
from sglang_dflash.ops import reference, variants
from sglang_dflash.ops.testing import make_tree

ATTN_SHAPE = dict(hq=32, hkv=8, head_dim=128, block=16)  # Qwen3-8B's draft
VERIFY_BLOCK = 16
VOCAB = 151_936  # Qwen3
VERIFY_MODES = {  # (temperature, top_k, top_p)
    "greedy": (0.0, 0, 1.0),
    "temperature": (1.0, 0, 1.0),
    "top_k_top_p": (0.7, 20, 0.95),
}
SEED = 7
TREE_NODES = 16  # a 15-node draft tree and its root: the rows a target verifies per request
TREE_VERIFY_MODES = ("greedy", "top_k_top_p")
ATTN_TOL = 2e-2  # max per-(row, head) relative error vs the fp32 reference, bf16 inputs
L2_MULTIPLE = 4  # bytes read between two uses of one input set, in L2 sizes
L2_FALLBACK_BYTES = 128 << 20  # when torch does not report the L2 size: more than any GPU has today
SPEC_HBM_BYTES_PER_S = {"H200": 4.8e12}  # data sheet, matched against the device name
SLEEP_CYCLES = 2_000_000  # ~1 ms at 2 GHz: longer than any benchmarked call's host time
LOG2E = 1.4426950408889634
GOALS = (  # issue 16: (name, which cases, value read off, target)
    ("block_attention HBM fraction, ctx >= 8k",
     lambda c: c["op"] == "block_attention" and not c.get("tree") and c["ctx"] >= 8192,
     lambda c: c.get("hbm_fraction"), 0.70),
    ("block_attention speedup vs sdpa_pregathered, bs <= 8",
     lambda c: c["op"] == "block_attention" and not c.get("tree") and c["bs"] <= 8,
     lambda c: c.get("speedup", {}).get("sdpa_pregathered"), 1.5),
    ("sampled verify speedup vs torch_sampled, bs 32, V 151936",
     lambda c: c["op"] == "verify_block" and c["mode"] != "greedy" and c["bs"] == 32 and c["vocab"] == 151_936,
     lambda c: c.get("speedup", {}).get("torch_sampled"), 5.0),
)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Pure parts: cases, byte counts, rotation, statistics, records, goals (unit-tested on the CPU).


def attention_cases(quick: bool) -> list[tuple[int, int]]:
    """(batch, context length) pairs; --quick keeps one case per attention goal."""
    if quick:
        return [(1, 8192), (8, 16384)]
    return [(bs, ctx) for bs in (1, 4, 8, 32, 64) for ctx in (1024, 4096, 8192, 16384, 32768)]


def verify_cases(quick: bool) -> list[tuple[int, str]]:
    """(batch, mode) pairs; --quick keeps the goal's batch of 32."""
    return [(bs, mode) for bs in ((32,) if quick else (1, 8, 32, 128)) for mode in VERIFY_MODES]


def tree_attention_cases(quick: bool) -> list[tuple[int, int]]:
    """(batch, context length) pairs of the tree-mode attention cases."""
    return [(8, 8192)] if quick else [(bs, ctx) for bs in (1, 8, 32) for ctx in (1024, 8192, 32768)]


def tree_verify_cases(quick: bool) -> list[tuple[int, str]]:
    """(batch, mode) pairs of the verify_tree cases."""
    return [(bs, mode) for bs in ((32,) if quick else (1, 8, 32, 128)) for mode in TREE_VERIFY_MODES]


def block_attention_bytes(bs: int, ctx: int, block: int, hq: int, hkv: int, head_dim: int, elem_bytes: int,
                          index_bytes: int = 4) -> int:
    """Bytes block_attention must move at least once, each request having `ctx` context tokens: read the
    context K and V (bs * ctx tokens x Hkv x D each), their slot ids (the first ctx entries of each
    req_to_token row), q [N, Hq, D], the block's K and V [N, Hkv, D], ctx_lens and req_pool_indices;
    write out [N, Hq, D]. N = bs * block. The split-KV workspace is not counted: it is the kernel's
    choice, not the op's cost."""
    n = bs * block
    context_kv = 2 * bs * ctx * hkv * head_dim * elem_bytes
    slot_ids = bs * ctx * index_bytes
    queries_and_block_kv = n * (hq + 2 * hkv) * head_dim * elem_bytes
    per_request = 2 * bs * index_bytes
    out = n * hq * head_dim * elem_bytes
    return context_kv + slot_ids + queries_and_block_kv + per_request + out


def block_attention_flops(bs: int, ctx: int, block: int, hq: int, head_dim: int) -> int:
    """Multiply-adds x 2 of QK^T and PV: every query row against ctx + block keys."""
    return 2 * 2 * bs * block * hq * (ctx + block) * head_dim


def verify_bytes(bs: int, block: int, vocab: int, logit_bytes: int) -> int:
    """Bytes verify_block must move at least once: read logits [bs * block, V], candidates int64
    [bs, block] and per request temperature f32, top_k i32, top_p f32, offsets i64; write accept_len
    i32 [bs], bonus i64 [bs] and out_tokens i64 [bs, block]. Sampling modes that need a second pass over
    the logits pay for it in their fraction."""
    rows = bs * block
    return rows * vocab * logit_bytes + rows * 8 + bs * (4 + 4 + 4 + 8) + bs * (4 + 8) + rows * 8


def rotation_sets(case_bytes: int, l2_bytes: int, multiple: int = L2_MULTIPLE) -> int:
    """Input sets to rotate over so that `multiple` L2 sizes of other inputs are read between two uses
    of one set; at least 2, so consecutive calls never share inputs even when one set outgrows L2."""
    return max(2, math.ceil(multiple * l2_bytes / case_bytes))


def timing_summary(times_ms: Sequence[float]) -> dict:
    """Median, p10 and p90 (inclusive deciles, linear interpolation) of >= 2 per-call times."""
    deciles = statistics.quantiles(times_ms, n=10, method="inclusive")
    return dict(median_ms=statistics.median(times_ms), p10_ms=deciles[0], p90_ms=deciles[-1], reps=len(times_ms))


def triton_num_splits(bs: int, hkv: int, ctx: int, sm_count: int, min_keys: int = 256, max_splits: int = 32) -> int:
    """Chunks per request for the Triton split-KV kernel: about two (request, kv head, chunk) programs
    per SM, each chunk at least `min_keys` keys, at most `max_splits`. Our kernel's rule with its
    constants (csrc/cuda/NOTES.md, one row tile here), so both get the same parallelism."""
    return max(1, min(2 * sm_count // (bs * hkv), math.ceil(ctx / min_keys), max_splits))


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def filter_k(top_k: Sequence[int], top_p: Sequence[float], vocab: int) -> int | None:
    """How many candidates per row the sampled baseline must take with torch.topk: None when no row
    filters (sample the full softmax), the largest top-k when every row has one, else the whole
    vocabulary (a row without top-k but with top-p needs all its probabilities sorted)."""
    if all(k <= 0 for k in top_k) and all(p >= 1.0 for p in top_p):
        return None
    if all(k > 0 for k in top_k):
        return min(max(top_k), vocab)
    return vocab


def device_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200', for result file names."""
    return re.sub(r"[^a-z0-9]+", "_", re.sub(r"^nvidia\s+", "", name.lower())).strip("_")


def default_out(device_name: str, quick: bool) -> str:
    name = f"bench_kernels_{device_slug(device_name)}{'_quick' if quick else ''}.json"
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)


def spec_bandwidth(device_name: str) -> float | None:
    return next((bw for key, bw in SPEC_HBM_BYTES_PER_S.items() if key in device_name), None)


def case_record(shape: dict, nbytes: int, ours: dict, baselines: dict[str, dict], bw: float,
                spec_bw: float | None, **extra) -> dict:
    """One case's JSON record. `ours` and each baseline hold a timing (timing_summary's keys) or an
    "error"; speedups are baseline median / our median; hbm_fraction = nbytes / our median / the measured
    copy bandwidth (hbm_fraction_spec: / the data-sheet bandwidth); floor_ms = nbytes at that bandwidth."""
    record = {**shape, "bytes": nbytes, **extra, "ours": ours, "baselines": baselines}
    record["failures"] = [f"{name}: {r['error']}" for name, r in {"ours": ours, **baselines}.items() if "error" in r]
    record["floor_ms"] = nbytes / bw * 1e3
    if "median_ms" in ours:
        seconds = ours["median_ms"] * 1e-3
        record["hbm_fraction"] = nbytes / seconds / bw
        record["hbm_fraction_spec"] = nbytes / seconds / spec_bw if spec_bw else None
        record["speedup"] = {name: r["median_ms"] / ours["median_ms"] for name, r in baselines.items()
                             if "median_ms" in r}  # fmt: skip
    swept = ours.get("variants", {})
    record["failures"] += [f"variant {name}: {r['error']}" for name, r in swept.items() if "error" in r]
    timed = {name: r["median_ms"] for name, r in swept.items() if "median_ms" in r}
    if timed:
        record["best_variant"] = min(timed, key=timed.get)
        record["variant_hbm_fraction"] = {name: nbytes / (ms * 1e-3) / bw for name, ms in timed.items()}
    return record


def case_label(case: dict) -> str:
    if case["op"] == "block_attention":
        return f"bs {case['bs']} ctx {case['ctx']}{' tree' if case.get('tree') else ''}"
    return f"bs {case['bs']} {case['mode']}"


def goal_rows(cases: Sequence[dict]) -> list[dict]:
    """One row per (goal, case it applies to): the value read off (None: not measured) and whether it
    meets the target."""
    rows = []
    for name, applies, value_of, target in GOALS:
        for case in cases:
            if applies(case):
                value = value_of(case)
                rows.append(dict(goal=name, case=case_label(case), value=value, target=target,
                                 met=value is not None and value >= target))  # fmt: skip
    return rows


def goal_table(rows: Sequence[dict]) -> str:
    """One line per goal: target, cases that meet it out of those it applies to, the worst value."""
    lines = [f"{'goal':58s} {'target':>6s} {'met':>7s}  worst"]
    for name, *_, target in GOALS:
        mine = [r for r in rows if r["goal"] == name]
        measured = [r for r in mine if r["value"] is not None]
        worst = min(measured, key=lambda r: r["value"], default=None)
        worst_text = f"{worst['value']:.2f} ({worst['case']})" if worst else "-"
        met = f"{sum(r['met'] for r in mine)}/{len(mine)}"
        lines.append(f"{name:58s} {target:6.2f} {met:>7s}  {worst_text}")
    return "\n".join(lines)


def max_rel_err_per_row_head(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max over (row, head) of |out - ref| / |ref| (L2 over head_dim): one norm over the whole output
    would hide a wrong head or row. NaN when out holds a NaN."""
    diff = (out.float() - ref.float()).norm(dim=-1)
    return float((diff / ref.float().norm(dim=-1).clamp_min(1e-6)).max())


def attention_check(ref: torch.Tensor, packed_block: int | None = None) -> Callable:
    """check(out) -> (detail, passed) against the reference output; packed_block: out is in
    pack_queries' layout with that block size."""

    def check(out: torch.Tensor) -> tuple[str, bool]:
        err = max_rel_err_per_row_head(out if packed_block is None else unpack_out(out, packed_block), ref)
        return f"max per-(row, head) relative error {err:.2e} (tolerance {ATTN_TOL:.0e})", err <= ATTN_TOL

    return check


# ------------------------------------------------------------------------------------------------
# Baselines in plain torch (they run on the CPU too, which is how the tests check them).


def pack_queries(q: torch.Tensor, block: int, hkv: int) -> torch.Tensor:
    """q [bs * block, Hq, D] -> [bs, Hkv, block * G, D]: the G query heads that share a kv head become
    that head's query rows (GQA as multi-head attention; exact when no mask depends on the row)."""
    n, hq, d = q.shape
    return q.view(n // block, block, hkv, hq // hkv, d).permute(0, 2, 1, 3, 4).reshape(n // block, hkv, -1, d)


def unpack_out(out: torch.Tensor, block: int) -> torch.Tensor:
    """pack_queries' layout back to [bs * block, Hq, D]."""
    bs, hkv, rows, d = out.shape
    g = rows // block
    return out.view(bs, hkv, block, g, d).permute(0, 2, 1, 3, 4).reshape(bs * block, hkv * g, d)


def gather_kv(cache: torch.Tensor, block_kv: torch.Tensor, req_to_token: torch.Tensor,
              req_pool_indices: torch.Tensor, ctx: int, block: int) -> torch.Tensor:
    """Each request's ctx context tokens then its block, contiguous: [bs, Hkv, ctx + block, D] (a view
    of [bs, ctx + block, Hkv, D], the layout FlashAttention reads natively)."""
    slots = req_to_token[req_pool_indices.long(), :ctx].long()
    bs = slots.shape[0]
    kv = torch.cat([cache[slots], block_kv.view(bs, block, *block_kv.shape[1:])], dim=1)
    return kv.transpose(1, 2)


def packed_tree_mask(parents: torch.Tensor, ctx: int, groups: int) -> torch.Tensor:
    """The tree as SDPA's boolean mask over pack_queries' rows and gather_kv's keys: [bs, 1, N * G,
    ctx + N], every row seeing the context and its node's ancestors (itself included); row n * G + g
    is node n's query head g of the kv head."""
    tree = reference.tree_ancestors(parents)  # [bs, N, N]
    bs, n, _ = tree.shape
    context = torch.ones(bs, n, ctx, dtype=torch.bool, device=parents.device)
    return torch.cat([context, tree], dim=-1).repeat_interleave(groups, dim=1)[:, None]


def torch_tree_walk(tokens: torch.Tensor, parents: torch.Tensor, targets: torch.Tensor):
    """verify_tree_from_ids in plain torch ops, one step a depth for every request at once: move to
    the lowest-index child of the current node that holds the current node's target token. Returns
    (accept_len i32 [bs], path i64 [bs, N], out_tokens i64 [bs, N]) in its layout."""
    bs, n = tokens.shape
    current = torch.zeros(bs, 1, dtype=torch.int64, device=tokens.device)
    accept = torch.zeros(bs, 1, dtype=torch.int64, device=tokens.device)
    steps = []
    for _ in range(n - 1):
        match = (parents == current) & (tokens == targets.gather(1, current))
        found = match.any(dim=1, keepdim=True)
        current = torch.where(found, match.int().argmax(dim=1, keepdim=True), current)
        accept += found
        steps.append(torch.where(found, current, -1))
    path = torch.cat([torch.zeros_like(current), *steps], dim=1)
    bonus = targets.gather(1, current)
    pos = torch.arange(n, device=tokens.device)
    nodes = path.roll(-1, dims=1).clamp_min(0)  # position i holds the (i + 1)-th node of the path
    out = torch.where(pos < accept, tokens.gather(1, nodes), -1).scatter(1, accept, bonus)
    return accept[:, 0].int(), path, out


SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def sdpa_call(backend: str, scale: float) -> Callable:
    """F.scaled_dot_product_attention restricted to one backend (raises when it cannot run the inputs);
    attn_mask: bool, True where a query may attend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(q, k, v, attn_mask=None):
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)

    return call


def pick_sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      attn_mask: torch.Tensor | None = None) -> str:
    """The first of SDPA_BACKENDS that runs these inputs."""
    reasons = []
    for backend in SDPA_BACKENDS:
        try:
            with warnings.catch_warnings():  # each refusing backend warns why; the reasons are kept below
                warnings.simplefilter("ignore")
                sdpa_call(backend, scale)(q, k, v, attn_mask)
            return backend
        except RuntimeError as exc:
            reasons.append(f"{backend}: {exc}")
    raise RuntimeError("no SDPA backend runs these inputs: " + "; ".join(reasons))


def accept_from_targets(candidates: torch.Tensor, targets: torch.Tensor):
    """verify_block's accept rule, vectorised: the longest draft prefix equal to the target's tokens,
    then the bonus. candidates, targets int64 [bs, B]; returns (accept_len i32, bonus i64, out_tokens
    i64 [bs, B]: accepted drafts, the bonus, then -1)."""
    block = candidates.shape[1]
    accept = (candidates[:, 1:] == targets[:, :-1]).int().cumprod(dim=1).sum(dim=1, keepdim=True)
    bonus = targets.gather(1, accept.long())
    pos = torch.arange(block, device=candidates.device)
    out = torch.where(pos < accept, candidates.roll(-1, dims=1), -1).scatter(1, accept.long(), bonus)
    return accept[:, 0].int(), bonus[:, 0], out


def greedy_verify(candidates: torch.Tensor, logits: torch.Tensor):
    return accept_from_targets(candidates, logits.argmax(dim=-1).view(candidates.shape))


def sampled_targets(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    k_max: int | None) -> torch.Tensor:
    """One sample per row, SGLang's way without a full sort: softmax(logits / T), then (k_max not None)
    the k_max most likely ids by torch.topk, those past each row's top_k dropped, top-p applied to what
    is left (an id stays while the mass strictly above it < top_p of the kept mass), multinomial over
    the kept probabilities (it renormalises them). Per request parameters over bs * B rows; temperature
    > 0 (SGLang gives greedy requests of a sampled batch top_k = 1). k_max: filter_k's value."""
    block = logits.shape[0] // temperature.numel()
    probs = torch.softmax(logits.float() / temperature.repeat_interleave(block)[:, None], dim=-1)
    if k_max is None:
        return torch.multinomial(probs, 1)[:, 0]
    vals, ids = probs.topk(k_max, dim=-1)
    k_rows = top_k.repeat_interleave(block)[:, None]
    vals = vals.masked_fill((k_rows > 0) & (torch.arange(k_max, device=vals.device) >= k_rows), 0.0)
    mass_above = vals.cumsum(dim=-1) - vals
    vals = vals.masked_fill(mass_above >= top_p.repeat_interleave(block)[:, None] * vals.sum(-1, keepdim=True), 0.0)
    return ids.gather(1, torch.multinomial(vals, 1))[:, 0]


def sampled_verify(candidates, logits, temperature, top_k, top_p, k_max):
    targets = sampled_targets(logits, temperature, top_k, top_p, k_max).view(candidates.shape)
    return accept_from_targets(candidates, targets)


# ------------------------------------------------------------------------------------------------
# Triton split-KV paged attention


@functools.cache
def _triton_kernels():
    """Both phases' kernels, defined on first use: Triton is imported only here (the rest of this file
    imports without it), and TRITON_INTERPRET=1, read when a kernel is defined, runs them on a CPU."""
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(
        Q, KB, VB, KC, VC, TABLE, POOLS, CTX, M, L, ACC, qk_scale, n_splits,
        s_qn, s_qh, s_bn, s_bh, s_cs, s_ch, s_tr,
        HKV: tl.constexpr, B: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, BP: tl.constexpr,
        D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # Program (request b, kv head h, chunk split): all B * G query rows of b that read kv head h,
        # against keys [start, end) of b's context; split 0 also takes the block's own B keys. Scores
        # are in log2 units (qk_scale = sm_scale * log2 e).
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // HKV
        h = pid % HKV
        rows = tl.arange(0, ROWS)  # row r: block row r // G, query head h * G + r % G
        row_ok = rows < B * G
        dims = tl.arange(0, D)
        q = tl.load(Q + (b * B + rows // G)[:, None] * s_qn + (h * G + rows % G)[:, None] * s_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)  # fmt: skip
        ctx = tl.load(CTX + b)
        table = TABLE + tl.load(POOLS + b).to(tl.int64) * s_tr
        chunk = tl.cdiv(tl.cdiv(ctx, n_splits), BLOCK_N) * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, ctx)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        for first in range(start, end, BLOCK_N):
            keys = first + tl.arange(0, BLOCK_N)
            valid = keys < end
            slots = tl.load(table + keys, mask=valid, other=0).to(tl.int64)
            k = tl.load(KC + slots[None, :] * s_cs + h * s_ch + dims[:, None], mask=valid[None, :], other=0.0)
            s = tl.where(valid[None, :], tl.dot(q, k) * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            v = tl.load(VC + slots[:, None] * s_cs + h * s_ch + dims[None, :], mask=valid[:, None], other=0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if split == 0:  # every block row sees every block key (the draft block is bidirectional)
            keys = tl.arange(0, BP)
            valid = keys < B
            k = tl.load(KB + (b * B + keys)[None, :] * s_bn + h * s_bh + dims[:, None], mask=valid[None, :],
                        other=0.0)  # fmt: skip
            s = tl.where(valid[None, :], tl.dot(q, k) * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            v = tl.load(VB + (b * B + keys)[:, None] * s_bn + h * s_bh + dims[None, :], mask=valid[:, None],
                        other=0.0)  # fmt: skip
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        # An empty chunk stores (-inf, 0, 0): weight 0 in the merge.
        part = (pid * n_splits + split) * ROWS + rows
        tl.store(M + part, m_i)
        tl.store(L + part, l_i)
        tl.store(ACC + part[:, None] * D + dims[None, :], acc)

    @triton.jit
    def merge_kernel(
        M, L, ACC, OUT, n_splits, s_on, s_oh,
        HKV: tl.constexpr, B: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
        SPLITS: tl.constexpr,
    ):  # fmt: skip
        # Program (request, kv head, query row): weights 2^(m_s - max m) over the chunks. Split 0 holds
        # the block's keys, so the max is finite and the sum positive.
        pid = tl.program_id(0)
        row = tl.program_id(1)
        b = pid // HKV
        h = pid % HKV
        splits = tl.arange(0, SPLITS)
        ok = splits < n_splits
        part = (pid * n_splits + splits) * ROWS + row
        m = tl.load(M + part, mask=ok, other=float("-inf"))
        w = tl.exp2(m - tl.max(m, 0))
        denom = tl.sum(w * tl.load(L + part, mask=ok, other=0.0), 0)
        dims = tl.arange(0, D)
        acc = tl.load(ACC + part[:, None] * D + dims[None, :], mask=ok[:, None], other=0.0)
        out = tl.sum(w[:, None] * acc, 0) / denom
        tl.store(OUT + (b * B + row // G) * s_on + (h * G + row % G) * s_oh + dims, out.to(OUT.dtype.element_ty))

    return split_kernel, merge_kernel


def triton_block_attention(q, k_block, v_block, k_cache, v_cache, req_to_token, req_pool_indices, ctx_lens,
                           block_size: int, sm_scale: float, n_splits: int, block_n: int = 64) -> torch.Tensor:
    """block_attention (window -1, causal_block False) by the Triton split-KV kernels; same arguments
    and layout. head_dim a power of 2 >= 16, last dims contiguous, K and V sharing strides."""
    split_kernel, merge_kernel = _triton_kernels()
    n, hq, d = q.shape
    hkv = k_block.shape[1]
    g = hq // hkv
    bs = n // block_size
    if d != next_pow2(d) or d < 16:
        raise ValueError(f"triton_block_attention: head_dim {d} is not a power of 2 >= 16")
    if k_cache.stride() != v_cache.stride() or k_block.stride() != v_block.stride():
        raise ValueError("triton_block_attention: K and V must share strides")
    if any(t.stride(-1) != 1 for t in (q, k_block, k_cache)):
        raise ValueError("triton_block_attention: last dims must be contiguous")
    rows = max(16, next_pow2(block_size * g))  # tl.dot needs >= 16 rows and power-of-2 tiles
    parts = bs * hkv * n_splits
    m = torch.empty(parts, rows, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty(parts, rows, d, dtype=torch.float32, device=q.device)
    split_kernel[(bs * hkv, n_splits)](
        q, k_block, v_block, k_cache, v_cache, req_to_token, req_pool_indices, ctx_lens, m, l_sum, acc,
        sm_scale * LOG2E, n_splits, q.stride(0), q.stride(1), k_block.stride(0), k_block.stride(1),
        k_cache.stride(0), k_cache.stride(1), req_to_token.stride(0),
        HKV=hkv, B=block_size, G=g, ROWS=rows, BP=max(16, next_pow2(block_size)), D=d, BLOCK_N=block_n,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    out = torch.empty_like(q)
    merge_kernel[(bs * hkv, block_size * g)](
        m, l_sum, acc, out, n_splits, out.stride(0), out.stride(1),
        HKV=hkv, B=block_size, G=g, ROWS=rows, D=d, SPLITS=max(2, next_pow2(n_splits)), num_warps=4,
    )  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------
# On the GPU: timing, device facts, the benchmarks.

NO_CUDA = ("bench_kernels.py: no CUDA device (torch.cuda.is_available() is False; torch {torch}, CUDA {cuda}). "
           "It times the CUDA kernels and runs only on a GPU machine (see bench/gpu_check.sh).")  # fmt: skip
SMI_FIELDS = ("clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem", "power.draw", "power.limit",
              "temperature.gpu")  # fmt: skip


def nvidia_smi(props) -> dict:
    """Clocks (MHz), power (W) and temperature (C) of this GPU as nvidia-smi reports them, or why not."""
    uuid = str(getattr(props, "uuid", ""))
    select = ["-i", uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"] if uuid else []
    try:
        line = subprocess.run(["nvidia-smi", *select, f"--query-gpu={','.join(SMI_FIELDS)}",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20,
                              check=True).stdout.strip().splitlines()[0]  # fmt: skip
        return dict(zip(SMI_FIELDS, (v.strip() for v in line.split(",")), strict=True))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError) as exc:
        return {"error": repr(exc)[:200]}


def device_info(props) -> dict:
    info = dict(name=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                total_memory_bytes=props.total_memory, l2_bytes=getattr(props, "L2_cache_size", None))  # fmt: skip
    for key, attr in (("sm_clock_khz", "clock_rate"), ("memory_clock_khz", "memory_clock_rate"),
                      ("memory_bus_width_bits", "memory_bus_width")):  # fmt: skip
        info[key] = getattr(props, attr, None)  # not in every torch version
    info["torch"], info["cuda"] = torch.__version__, torch.version.cuda
    return info


def time_calls(fn: Callable, sets: Sequence[tuple], sleep_ms: float, *, warmup: int = 3, min_reps: int = 10,
               max_reps: int = 200, budget_s: float = 0.3) -> dict:
    """timing_summary of fn(*sets[i % len(sets)]) over calls i = warmup, warmup + 1, ... (one counter
    through warm-up and timing, so consecutive calls never share a set), plus host_bound."""
    call = 0
    for call in range(warmup):
        fn(*sets[call % len(sets)])
    torch.cuda.synchronize()
    times, host_s = [], []
    deadline = time.perf_counter() + budget_s
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < deadline):
        call += 1
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)  # the GPU is busy while the host queues the call
        start.record()
        t0 = time.perf_counter()
        fn(*sets[call % len(sets)])
        host_s.append(time.perf_counter() - t0)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    summary = timing_summary(times)
    # The GPU may have waited for the host inside the timed span: the time is then partly host time.
    summary["host_bound"] = statistics.quantiles(host_s, n=10, method="inclusive")[-1] * 1e3 > sleep_ms
    return summary


def measure_copy_bandwidth(sleep_ms: float) -> float:
    """Device-to-device copy of 1 GiB (far past L2), bytes read + written per second: the achievable
    HBM bandwidth the fractions are relative to."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_calls(lambda: dst.copy_(src), [()], sleep_ms)["median_ms"]
    return 2 * src.numel() / (ms * 1e-3)


def measure_sleep_ms() -> float:
    torch.cuda._sleep(SLEEP_CYCLES)  # the first launch loads the kernel
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


@dataclasses.dataclass
class Bench:
    """One run's device facts, timing settings and growing JSON result. `device` and `timer` are
    parameters so that the tests can run the benchmarks' plumbing on the CPU."""

    out: str
    props: object
    l2_bytes: int
    sleep_ms: float
    bw: float
    spec_bw: float | None
    result: dict
    device: torch.device = torch.device("cuda")
    timer: Callable = time_calls
    sweep_variants: bool = False

    def measure_ours(self, op: str, fn: Callable, sets: Sequence[tuple], check: Callable | None) -> dict:
        """Our op measured as shipped; with `sweep_variants`, also under each compiled kernel variant of
        `op` (variants.using_variant), each checked like the shipped one, in "variants"."""
        entry = self.measure(fn, sets, check)
        if self.sweep_variants:
            swept = {}
            for name in variants.kernel_variants(op):
                with variants.using_variant(op, name):
                    swept[name] = self.measure(fn, sets, check)
            entry["variants"] = swept
        return entry

    def measure(self, fn: Callable, sets: Sequence[tuple], check: Callable | None = None, **info) -> dict:
        """fn checked on sets[0] (check(output) -> (detail, passed)) and then timed; or, when the check
        fails or anything raises, {"error": ...} and no timing. `info` is recorded with the result."""
        entry = dict(info)
        try:
            if check is not None:
                entry["check"], passed = check(fn(*sets[0]))
                if not passed:
                    return {**entry, "error": f"check failed: {entry['check']}"}
            return {**entry, **self.timer(fn, sets, self.sleep_ms)}
        except Exception as exc:  # noqa: BLE001  (one implementation failing must not end the run)
            return {**entry, "error": f"{type(exc).__name__}: {exc}"[:500]}

    def add(self, record: dict) -> None:
        """Keeps a case, rewrites the JSON, prints one line (and its failures, loudly)."""
        self.result["cases"].append(record)
        self.write()
        parts = [f"{record['op']:15s} {case_label(record):22s}"]
        for name, r in {"ours": record["ours"], **record["baselines"]}.items():
            if "median_ms" in r:
                speedup = record.get("speedup", {}).get(name)
                ratio = f" (x{speedup:.2f})" if speedup else ""
                backend = f" [{r['backend']}]" if "backend" in r else ""
                parts.append(f"{name}{backend} {r['median_ms']:.4f} ms{ratio}")
        if "hbm_fraction" in record:
            parts.append(f"hbm {record['hbm_fraction']:.2f}")
        print("  ".join(parts), flush=True)
        for failure in record["failures"]:
            print(f"  FAILED {failure}", flush=True)

    def write(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.out)), exist_ok=True)
        with open(self.out + ".tmp", "w") as f:
            json.dump(self.result, f, indent=1)
        os.replace(self.out + ".tmp", self.out)


def after_device_errors(check: Callable) -> Callable:
    """`check`, after ops.check_device_errors() found no index error recorded by our kernels (one voids
    the output it was recorded for)."""

    def run(out):
        ops.check_device_errors()
        return check(out)

    return run


def verify_check(expected: tuple, rows: int, names: str = "accept_len, bonus, out_tokens") -> Callable:
    """check(out) -> (detail, passed): the first `rows` requests of a verify output equal `expected`
    exactly (`names`: its tensors)."""

    def check(out: tuple) -> tuple[str, bool]:
        same = all(torch.equal(o[:rows].cpu(), e.cpu()) for o, e in zip(out, expected, strict=True))
        return f"{names} {'equal' if same else 'DIFFER'} (reference, {rows} requests)", same

    return check


def verify_params(mode: str, bs: int, dev: torch.device) -> tuple[tuple[float, int, float], dict]:
    """A verify mode's (temperature, top_k, top_p) and, per request, the tensors the ops take."""
    t, k, p = VERIFY_MODES[mode]
    return (t, k, p), dict(temperature=torch.full((bs,), t, device=dev),
                           top_k=torch.full((bs,), k, dtype=torch.int32, device=dev),
                           top_p=torch.full((bs,), p, device=dev))  # fmt: skip


def add_verify_case(bench: Bench, shape: dict, nbytes: int, sets: list, ours: Callable, ours_check: Callable,
                    baselines: dict[str, tuple[Callable, Callable | None]]) -> None:
    """Ours (checked after the device's error record) and each (baseline, check) measured on `sets`,
    kept as one case."""
    ours_entry = bench.measure_ours("verify_block", ours, sets, after_device_errors(ours_check))
    measured = {name: bench.measure(fn, sets, check) for name, (fn, check) in baselines.items()}
    bench.add(case_record(shape, nbytes, ours_entry, measured, bench.bw, bench.spec_bw,
                          rotation_sets=len(sets)))


def bench_verify(bench: Bench, cases: Sequence[tuple[int, str]], vocab: int = VOCAB, block: int = VERIFY_BLOCK) -> None:
    logit_bytes = 4  # fp32 logits
    dev = bench.device
    g = torch.Generator(device=dev).manual_seed(1)
    for bs in dict.fromkeys(bs for bs, _ in cases):
        nbytes = verify_bytes(bs, block, vocab, logit_bytes)
        n_sets = rotation_sets(nbytes, bench.l2_bytes)
        sets = []
        for _ in range(n_sets):
            logits = torch.randn(bs * block, vocab, device=dev, generator=g) * 4
            candidates = torch.empty(bs, block, dtype=torch.int64, device=dev)
            candidates[:, 0] = torch.randint(0, vocab, (bs,), device=dev, generator=g)
            candidates[:, 1:] = logits.argmax(-1).view(bs, block)[:, :-1]  # greedy accepts the whole block
            sets.append((candidates, logits))
        offsets = torch.arange(bs, dtype=torch.int64, device=dev) << 32
        for mode in (m for b, m in cases if b == bs):
            (t, k, p), params = verify_params(mode, bs, dev)
            if mode == "greedy":
                check_rows = bs
                expected = reference.verify_block_from_ids(sets[0][0], sets[0][1].argmax(-1))
                baselines = {"torch_argmax_accept": (greedy_verify, verify_check(expected, bs))}
            else:  # the Python-loop spec costs ~ms per row: ours is checked on its first requests
                check_rows = min(bs, 2)
                expected = reference.verify_block(
                    sets[0][0][:check_rows], sets[0][1][: check_rows * block],
                    *(v[:check_rows] for v in params.values()), SEED, offsets[:check_rows],
                )  # fmt: skip
                k_max = filter_k([k] * bs, [p] * bs, vocab)
                baselines = {"torch_sampled": (functools.partial(sampled_verify, **params, k_max=k_max), None)}
            shape = dict(op="verify_block", mode=mode, bs=bs, block=block, vocab=vocab, dtype="float32",
                         temperature=t, top_k=k, top_p=p)
            add_verify_case(bench, shape, nbytes, sets, functools.partial(ops.verify_block, **params, seed=SEED,
                                                                          offsets=offsets),
                            verify_check(expected, check_rows), baselines)  # fmt: skip
        del sets
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def bench_verify_tree(bench: Bench, cases: Sequence[tuple[int, str]], vocab: int = VOCAB,
                      nodes: int = TREE_NODES) -> None:
    dev = bench.device
    g = torch.Generator(device=dev).manual_seed(2)
    trees = torch.Generator().manual_seed(3)  # make_tree draws on the CPU
    for bs in dict.fromkeys(bs for bs, _ in cases):
        nbytes = verify_bytes(bs, nodes, vocab, 4) + 2 * bs * nodes * 8  # + parents and depths
        n_sets = rotation_sets(nbytes, bench.l2_bytes)
        sets = []
        for _ in range(n_sets):
            logits = torch.randn(bs * nodes, vocab, device=dev, generator=g) * 4
            tokens, parents, depths = (t.to(dev) for t in make_tree(bs, nodes, vocab, trees, unused=0.0))
            # Most nodes hold their parent's greedy target, so greedy walks run several nodes deep.
            hit = (parents >= 0) & (torch.rand(bs, nodes, device=dev, generator=g) < 0.7)
            targets = logits.argmax(-1).view(bs, nodes)
            tokens = torch.where(hit, targets.gather(1, parents.clamp_min(0)), tokens)
            sets.append((tokens, parents, depths, logits))
        offsets = torch.arange(bs, dtype=torch.int64, device=dev) << 32
        names = "accept_len, path, out_tokens"
        for mode in (m for b, m in cases if b == bs):
            (t, k, p), params = verify_params(mode, bs, dev)
            tokens, parents, depths, logits = sets[0]
            if mode == "greedy":
                check_rows = bs
                expected = reference.verify_tree_from_ids(tokens, parents, depths, logits.argmax(-1).view(bs, nodes))

                def walk(tokens, parents, depths, logits):
                    return torch_tree_walk(tokens, parents, logits.argmax(-1).view(tokens.shape))

                baselines = {"torch_walk": (walk, verify_check(expected, bs, names))}
            else:  # the Python-loop spec costs ~ms per row: ours is checked on its first requests
                check_rows = min(bs, 2)
                expected = reference.verify_tree(
                    tokens[:check_rows], parents[:check_rows], depths[:check_rows], logits[: check_rows * nodes],
                    *(v[:check_rows] for v in params.values()), SEED, offsets[:check_rows],
                )  # fmt: skip
                k_max = filter_k([k] * bs, [p] * bs, vocab)

                def walk(tokens, parents, depths, logits, k_max=k_max, params=params):
                    return torch_tree_walk(tokens, parents,
                                           sampled_targets(logits, **params, k_max=k_max).view(tokens.shape))

                baselines = {"torch_sampled_walk": (walk, None)}
            shape = dict(op="verify_tree", mode=mode, bs=bs, nodes=nodes, vocab=vocab, dtype="float32",
                         temperature=t, top_k=k, top_p=p)
            add_verify_case(bench, shape, nbytes, sets, functools.partial(ops.verify_tree, **params, seed=SEED,
                                                                          offsets=offsets),
                            verify_check(expected, check_rows, names), baselines)  # fmt: skip
        del sets
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def bench_attention(bench: Bench, cases: Sequence[tuple[int, int]], shape: dict = ATTN_SHAPE,
                    tree: bool = False) -> None:
    """block_attention against its baselines; `tree`: in tree mode, each request's block a random
    draft tree (make_tree) of shape["block"] nodes, against masked SDPA only (the Triton kernel has no
    tree mode)."""
    hq, hkv, d, block = shape["hq"], shape["hkv"], shape["head_dim"], shape["block"]
    scale = d**-0.5
    dtype = torch.bfloat16
    dev = bench.device
    g = torch.Generator(device=dev).manual_seed(0)
    tree_gen = torch.Generator().manual_seed(4)  # make_tree draws on the CPU

    def case_bytes(bs, ctx):  # a tree's parents add bs * block int64
        return block_attention_bytes(bs, ctx, block, hq, hkv, d, dtype.itemsize) + (bs * block * 8 if tree else 0)

    # One cache for all cases, big enough for the largest case's rotation: each input set reads its own
    # (random) slots of it.
    n_slots = max(rotation_sets(case_bytes(bs, ctx), bench.l2_bytes) * bs * ctx for bs, ctx in cases)
    k_cache = torch.randn(n_slots, hkv, d, device=dev, dtype=dtype, generator=g)
    v_cache = torch.randn(n_slots, hkv, d, device=dev, dtype=dtype, generator=g)
    for bs, ctx in cases:
        nbytes = case_bytes(bs, ctx)
        n_sets = rotation_sets(nbytes, bench.l2_bytes)
        slots = torch.randperm(n_slots, device=dev, generator=g)[: n_sets * bs * ctx].view(n_sets, bs, ctx)
        sets, dense_sets = [], []  # sets: block_attention's arguments up to ctx_lens
        for r in range(n_sets):
            q = torch.randn(bs * block, hq, d, device=dev, dtype=dtype, generator=g)
            kb = torch.randn(bs * block, hkv, d, device=dev, dtype=dtype, generator=g)
            vb = torch.randn(bs * block, hkv, d, device=dev, dtype=dtype, generator=g)
            table = torch.zeros(bs, ctx + block, dtype=torch.int32, device=dev)  # SGLang's rows have room
            pools = torch.randperm(bs, device=dev, generator=g).int()  # request b reads table row pools[b]
            table[pools.long(), :ctx] = slots[r].int()
            lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
            sets.append((q, kb, vb, k_cache, v_cache, table, pools, lens))
            # The dense baseline's inputs, gathered here, outside the timing.
            dense_sets.append((pack_queries(q, block, hkv), gather_kv(k_cache, kb, table, pools, ctx, block),
                               gather_kv(v_cache, vb, table, pools, ctx, block)))  # fmt: skip
            if tree:  # the tree goes last in both: block_attention's tree_parents, SDPA's attn_mask
                parents = make_tree(bs, block, 100, tree_gen, unused=0.0)[1].to(dev)
                sets[-1] += (parents,)
                dense_sets[-1] += (packed_tree_mask(parents, ctx, hq // hkv),)
        del slots

        def ours(*args):
            return ops.block_attention(*args[:8], block, scale, tree_parents=args[8] if tree else None)

        ref = reference.block_attention(*sets[0][:8], block, scale, tree_parents=sets[0][8] if tree else None)
        ours_entry = bench.measure_ours("block_attention", ours, sets, after_device_errors(attention_check(ref)))
        baselines = {}
        try:
            backend = pick_sdpa_backend(*dense_sets[0][:3], scale, *dense_sets[0][3:])
            baselines["sdpa_pregathered"] = bench.measure(sdpa_call(backend, scale), dense_sets,
                                                          attention_check(ref, block), backend=backend)  # fmt: skip
        except RuntimeError as exc:
            baselines["sdpa_pregathered"] = {"error": str(exc)[:500]}
        if not tree:
            splits = triton_num_splits(bs, hkv, ctx, bench.props.multi_processor_count)
            triton = functools.partial(triton_block_attention, block_size=block, sm_scale=scale, n_splits=splits)
            baselines["triton_split_kv"] = bench.measure(triton, sets, attention_check(ref), splits=splits)
        record = case_record(
            dict(op="block_attention", bs=bs, ctx=ctx, **shape, dtype="bfloat16", causal_block=False, window=-1,
                 tree=tree),
            nbytes, ours_entry, baselines, bench.bw, bench.spec_bw,
            flops=block_attention_flops(bs, ctx, block, hq, d), rotation_sets=n_sets,
        )  # fmt: skip
        bench.add(record)
        del sets, dense_sets, ref
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def start(args) -> Bench:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = getattr(props, "L2_cache_size", 0) or L2_FALLBACK_BYTES
    try:
        provenance = run_info({})
    except OSError as exc:  # no git on the GPU machine
        provenance = {"error": repr(exc)}
    result = dict(
        benchmark="bench/bench_kernels.py", quick=args.quick, variants=args.variants, provenance=provenance,
        # gpu_check.sh passes the commit: the GPU machine's copy of the tree may have no .git.
        commit=os.environ.get("SGLANG_DFLASH_COMMIT") or provenance.get("git", {}).get("commit"),
        device={**device_info(props), "nvidia_smi_start": nvidia_smi(props)},
        method=dict(
            timing="CUDA events per call, each call queued behind a sleep kernel (device time, host overhead "
                   "hidden; host_bound flags calls whose host time exceeded the sleep); median, p10, p90",
            l2=f"inputs rotated over >= 2 sets, >= {L2_MULTIPLE}x L2 ({l2} bytes) read between two uses of one set",
            hbm="hbm_fraction: bytes the op must move once / our median time / the measured copy bandwidth; "
                "hbm_fraction_spec: / the data-sheet bandwidth",
            checks=f"before timing, each implementation vs sglang_dflash.ops.reference on the first set: attention "
                   f"max per-(row, head) relative error <= {ATTN_TOL}; verify exact",
            attention_slots="each request's context slots a random permutation of the cache (page size 1)",
        ),
        cases=[], goals=[], failures=[], complete=False,
    )  # fmt: skip
    sleep_ms = measure_sleep_ms()
    bench = Bench(args.out or default_out(props.name, args.quick), props, l2, sleep_ms,
                  measure_copy_bandwidth(sleep_ms), spec_bandwidth(props.name), result)  # fmt: skip
    result["method"]["sleep_ms"] = sleep_ms
    result["hbm"] = dict(measured_copy_bytes_per_s=bench.bw, spec_bytes_per_s=bench.spec_bw)
    spec = f", data sheet {bench.spec_bw / 1e12:.2f} TB/s" if bench.spec_bw else ""
    print(f"{props.name}: copy bandwidth {bench.bw / 1e12:.2f} TB/s measured{spec}; L2 {l2 >> 20} MiB", flush=True)
    return bench


def variant_table(cases: Sequence[dict]) -> str:
    """Per swept case: each variant's median time and fraction of HBM bandwidth, the best marked, and
    the shape class its choice goes to in sglang_dflash/ops/variants.py's TUNED table."""
    lines = []
    for case in cases:
        swept = case["ours"].get("variants")
        if not swept:
            continue
        batch = case["bs"] if case["op"] == "block_attention" else case["bs"] * case.get("block", VERIFY_BLOCK)
        lines.append(f"{case['op']} {case_label(case)} (shape class {variants.shape_class(case['op'], batch=batch)}):")
        for name, r in swept.items():
            mark = " <- best" if name == case.get("best_variant") else ""
            if "median_ms" in r:
                lines.append(f"  {name:24s} {r['median_ms']:9.4f} ms  hbm "
                             f"{case['variant_hbm_fraction'][name]:.2f}{mark}")
            else:
                lines.append(f"  {name:24s} {r['error'][:80]}")
    return "\n".join(lines)


def finish(bench: Bench) -> int:
    """Goals, failures and the end clocks into the JSON; the goal table; exit status 1 on any failure."""
    result = bench.result
    result["goals"] = goal_rows(result["cases"])
    result["failures"] = [f"{case_label(c)} {c['op']}: {f}" for c in result["cases"] for f in c["failures"]]
    result["device"]["nvidia_smi_end"] = nvidia_smi(bench.props)
    result["complete"] = True
    bench.write()
    print("\n" + goal_table(result["goals"]))
    if bench.sweep_variants:
        print("\nKernel variants:\n" + variant_table(result["cases"]))
    print(f"\n{len(result['failures'])} failures; wrote {bench.out}")
    return 1 if result["failures"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="JSON result (default bench/results/bench_kernels_<device>[_quick].json)")
    parser.add_argument("--quick", action="store_true", help="one case per goal (about a minute)")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--skip-verify", action="store_true")
    parser.add_argument("--skip-trees", action="store_true", help="no tree-mode attention or verify_tree cases")
    parser.add_argument("--variants", action="store_true",
                        help="also time our ops under every compiled kernel variant (sglang_dflash.ops.variants)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(NO_CUDA.format(torch=torch.__version__, cuda=torch.version.cuda))
    if not has_cuda_kernels():
        sys.exit("bench_kernels.py: sglang_dflash was built without its CUDA kernels (rebuild with nvcc on PATH, "
                 "or SGLANG_DFLASH_CUDA=1)")  # fmt: skip

    bench = start(args)
    bench.sweep_variants = args.variants
    # Verify first: it is the shorter half, and the attention grid's largest cases come last.
    if not args.skip_verify:
        bench_verify(bench, verify_cases(args.quick))
        if not args.skip_trees:
            bench_verify_tree(bench, tree_verify_cases(args.quick))
    if not args.skip_attention:
        bench_attention(bench, attention_cases(args.quick))
        if not args.skip_trees:
            bench_attention(bench, tree_attention_cases(args.quick), tree=True)

    return finish(bench)


if __name__ == "__main__":
    sys.exit(main())
