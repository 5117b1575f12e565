"""Start-up self-test: every kernel about to serve runs once on small random inputs on its device and
is compared with the pure-PyTorch reference (`reference.py`).

A kernel can be wrong or missing on one device only (no image for its compute capability, a code
path no earlier GPU took), and it must then neither stop a server nor change its output. So the
SGLang worker (at init) and the engine (`HFTarget`) call `select(device, plan, fallback)` with the
configurations they will run (dtypes, head layouts, block sizes); each op that raises or disagrees
gets one warning naming it and the device, and from then on runs the reference in
`sglang_dflash.ops` on that device; the caller routes it to its own fallback where it has a better
one (SGLang's path in the server). With SGLANG_DFLASH_STRICT=1 a failure raises SelfTestError.

Exact ops (verify, verify_tree_from_ids, gumbel_argmax) must agree bit for bit; block_attention
materialize_context_kv and rms_norm_rope within the per-dtype tolerances of tests/test_ops_*.py, skinny_linear
within its rounding bound (tests/test_ops_skinny_linear.py), w8a8_linear bit for bit; on CUDA no index check may fire on
these valid inputs (`ops.check_device_errors`). Inputs are small (well under a second
on a GPU, a few tens of milliseconds on a CPU) and each result is kept for the process's lifetime.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from sglang_dflash import _extension, ops, settings
from sglang_dflash.ops import reference
from sglang_dflash.ops.testing import (
    follow_targets,
    make_attention_inputs,
    make_context_kv_inputs,
    make_tree,
    on_device,
    sglang_cos_sin_cache,
    skinny_linear_error_ratio,
)

logger = logging.getLogger(__name__)

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}  # as tests/test_ops_*.py


class SelfTestError(RuntimeError):
    """A kernel failed its self-test and SGLANG_DFLASH_STRICT=1 forbids the fallback."""


@dataclasses.dataclass(frozen=True)
class Attention:
    """One block_attention configuration as a caller runs it."""

    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    window: int = -1
    causal_block: bool = False


@dataclasses.dataclass(frozen=True)
class ContextKV:
    """One materialize_context_kv configuration (the shapes and dtypes of the drafter's layers)."""

    hidden: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    dtype: torch.dtype
    pool_dtype: torch.dtype
    cos_sin_dtype: torch.dtype
    bias: bool
    is_neox: bool


def _kernel(op: str) -> Callable:
    # The compiled op itself, never the ops layer, which may already run the reference.
    return getattr(_extension.ops(), op)


def _layout(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"returned {got.dtype} {tuple(got.shape)}, the reference {want.dtype} {tuple(want.shape)}"
    return None


def _exact(got, want) -> str | None:
    for g, w in zip(got, want, strict=True):
        g = g.cpu()
        problem = _layout(g, w)
        if problem is None and not torch.equal(g, w):
            problem = f"{int((g != w).sum())} of {w.numel()} values differ from the reference"
        if problem is not None:
            return problem
    return None


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> str | None:
    """Every element within tol * (1 + |reference|) (assert_close with atol = rtol = tol)."""
    got = got.cpu()
    if (problem := _layout(got, want)) is not None:
        return problem
    err = (got.double() - want.double()).abs() / (tol * (1 + want.double().abs()))
    if not bool((err <= 1).all()):  # NaN fails too
        return f"error up to {float(err.nan_to_num(float('inf')).max()):.3g}x the tolerance {tol}"
    return None


def _verify_block(device: torch.device, logits_dtype: torch.dtype) -> str | None:
    """Greedy, plain sampling, top-k, top-p and both in one batch; top-k 4097 needs more candidates
    than the CUDA kernel keeps in shared memory (its slower whole-row path)."""
    gen = torch.Generator().manual_seed(0)
    bs, block, vocab, seed = 6, 4, 4099, 1234
    logits = (torch.randn(bs * block, vocab, generator=gen) * 3).to(logits_dtype)
    temperature = torch.tensor([0.0, 0.8, 1.0, 0.7, 1.3, 1.0])
    top_k = torch.tensor([0, 0, 20, 0, 50, 4097], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.8, 0.95])
    offsets = torch.randint(0, 1 << 40, (bs,), generator=gen)
    target = reference.target_samples(logits, temperature, top_k, top_p, seed, offsets, block)
    candidates = torch.randint(0, vocab, (bs, block), generator=gen)
    for b in range(bs):  # drafts that follow the target for b % block tokens: every accept length
        candidates[b, 1 : b % block + 1] = target[b, : b % block]
    want = reference.verify_block_from_ids(candidates, target)
    args = [t.to(device) for t in (candidates, logits, temperature, top_k, top_p)]
    return _exact(_kernel("verify_block")(*args, seed, offsets.to(device)), want)


def _verify_block_from_ids(device: torch.device, ids_dtype: torch.dtype) -> str | None:
    gen = torch.Generator().manual_seed(1)
    bs, block, vocab = 5, 8, 50
    target = torch.randint(0, vocab, (bs, block), generator=gen)
    candidates = torch.randint(0, vocab, (bs, block), generator=gen)
    for b in range(bs):  # accept lengths 0, 2, 4, 6 and all 7
        n = min(2 * b, block - 1)
        candidates[b, 1 : n + 1] = target[b, :n]
    want = reference.verify_block_from_ids(candidates, target)
    ids = target.to(device=device, dtype=ids_dtype).reshape(-1)  # flat, as SGLang's argmax hands them over
    return _exact(_kernel("verify_block_from_ids")(candidates.to(device), ids), want)


def _verify_tree_from_ids(device: torch.device, index_dtype: torch.dtype) -> str | None:
    """Padded trees with repeated tokens across branches, drafts that often follow the target."""
    gen = torch.Generator().manual_seed(5)
    bs, nodes, vocab = 5, 24, 40
    target = torch.randint(0, vocab, (bs, nodes), generator=gen)
    tokens, parents, depths = make_tree(bs, nodes, vocab, gen)
    tokens = follow_targets(tokens, parents, target, gen)
    want = reference.verify_tree_from_ids(tokens, parents, depths, target)
    args = [tokens, parents.to(index_dtype), depths, target.to(index_dtype).reshape(-1)]
    return _exact(_kernel("verify_tree_from_ids")(*(t.to(device) for t in args)), want)


def _verify_tree(device: torch.device, logits_dtype: torch.dtype) -> str | None:
    """Trees whose drafts often follow the target's samples, greedy, sampled, top-k and top-p in
    one batch (a CPU kernel: elsewhere verify_block samples every node)."""
    gen = torch.Generator().manual_seed(8)
    bs, nodes, vocab, seed = 4, 12, 500, 99
    tokens, parents, depths = make_tree(bs, nodes, vocab, gen)
    logits = (torch.randn(bs * nodes, vocab, generator=gen) * 3).to(logits_dtype)
    sampling = (torch.tensor([0.0, 1.0, 0.7, 1.2]), torch.tensor([0, 0, 30, 0], dtype=torch.int32),
                torch.tensor([1.0, 1.0, 1.0, 0.8]))
    offsets = torch.randint(0, 1 << 40, (bs,), generator=gen)
    target = reference.target_samples(logits, *(t.repeat_interleave(nodes) for t in sampling), seed,
                                      offsets.repeat_interleave(nodes) + depths.reshape(-1), 1).reshape(bs, nodes)
    tokens = follow_targets(tokens, parents, target, gen)
    want = reference.verify_tree(tokens, parents, depths, logits, *sampling, seed, offsets)
    args = [t.to(device) for t in (tokens, parents, depths, logits, *sampling)]
    return _exact(_kernel("verify_tree")(*args, seed, offsets.to(device)), want)


def _gumbel_argmax(device: torch.device, dtype: torch.dtype) -> str | None:
    gen = torch.Generator().manual_seed(2)
    rows, n, seed = 6, 1000, 77
    scores = (torch.randn(rows, n, generator=gen) * 2).to(dtype)
    offsets = torch.randint(0, 1 << 50, (rows,), generator=gen)
    verify_rows = torch.randint(0, 16, (rows,), generator=gen)
    for ids in (None, torch.randperm(3 * n, generator=gen)[:n]):
        want = reference.gumbel_argmax(scores, ids, seed, offsets, verify_rows)
        got = _kernel("gumbel_argmax")(scores.to(device), None if ids is None else ids.to(device), seed,
                                       offsets.to(device), verify_rows.to(device))
        problem = _exact([got], [want])
        if problem:
            return f"{'with' if ids is not None else 'without'} ids: {problem}"
    return None


def _block_attention(device: torch.device, case: Attention) -> str | None:
    """Three requests: no context, one partial tile, several tiles (split over the context on CUDA)."""
    args = make_attention_inputs(3, case.block_size, case.q_heads, case.kv_heads, case.head_dim, [0, 37, 300],
                                 case.dtype, seed=1)
    kw = dict(block_size=case.block_size, sm_scale=case.head_dim**-0.5, window=case.window,
              causal_block=case.causal_block)
    want = reference.block_attention(**args, **kw)
    got = _kernel("block_attention")(*on_device(args, device).values(), *kw.values())  # the op's argument order
    return _close(got, want, TOLERANCE[case.dtype])


def _materialize_context_kv(device: torch.device, case: ContextKV) -> str | None:
    """Two layers of the drafter's shapes; the hidden size is capped at 256, as it only reaches the
    projection (at::linear on CUDA), not our kernel, and large weights take long to generate."""
    args = make_context_kv_inputs(6, min(case.hidden, 256), 2, case.kv_heads, case.head_dim, case.rotary_dim,
                                  case.dtype, case.pool_dtype, seed=3, bias=case.bias, is_neox=case.is_neox, skip=1,
                                  poison="random", cos_sin_dtype=case.cos_sin_dtype)
    def copy(v):  # a copy on the device (also on the CPU: the reference writes the originals)
        if isinstance(v, list):
            return [copy(t) for t in v]
        return v.to(device, copy=True) if isinstance(v, torch.Tensor) else v

    moved = {name: copy(v) for name, v in args.items()}
    reference.materialize_context_kv(**args)
    _kernel("materialize_context_kv")(*moved.values())  # the op's argument order
    # Unwritten slots keep their random contents: compared like the rest (exactly equal passes).
    tol = max(TOLERANCE[case.dtype], TOLERANCE[case.pool_dtype])
    for name in ("k_caches", "v_caches"):
        for layer, (got, want) in enumerate(zip(moved[name], args[name], strict=True)):
            problem = _close(got, want, tol)
            if problem:
                return f"{name}[{layer}]: {problem}"
    return None


def _skinny_linear(device: torch.device, dtype: torch.dtype) -> str | None:
    """Within the kernel's rounding bound (ops/testing.py, as tests/test_ops_skinny_linear.py), with
    a weight of x's dtype and with an int8 weight and its row scales (the CPU drafter's)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 300, generator=gen).to(dtype)
    weight = torch.randn(129, 300, generator=gen).to(dtype)
    bias = torch.randn(129, generator=gen).to(dtype)
    int8 = torch.randint(-127, 128, (129, 300), generator=gen, dtype=torch.int8)
    scale = torch.rand(129, generator=gen) / 64
    for name, w, s in (("", weight, None), ("int8 weight: ", int8, scale)):
        got = _kernel("skinny_linear")(x.to(device), w.to(device), bias.to(device),
                                       None if s is None else s.to(device)).cpu()
        if (problem := _layout(got, reference.skinny_linear(x, w, bias, s))) is not None:
            return name + problem
        ratio = skinny_linear_error_ratio(got, x, w, bias, s)
        if not bool((ratio <= 1).all()):
            return f"{name}error up to {float(ratio.nan_to_num(float('inf')).max()):.3g}x the rounding bound"
    return None


def _w8a8_linear(device: torch.device, dtype: torch.dtype) -> str | None:
    """Bit for bit the reference (tests/test_ops_w8a8_linear.py), K past a whole vector, with bias."""
    gen = torch.Generator().manual_seed(6)
    x = (3 * torch.randn(5, 300, generator=gen)).to(dtype)
    weight = torch.randint(-127, 128, (131, 300), generator=gen, dtype=torch.int8)
    scale = torch.rand(131, generator=gen) / 64
    bias = torch.randn(131, generator=gen).to(dtype)
    got = _kernel("w8a8_linear")(x.to(device), weight.to(device), scale.to(device), bias.to(device)).cpu()
    want = reference.w8a8_linear(x, weight, scale, bias)
    if (problem := _layout(got, want)) is not None:
        return problem
    if torch.equal(got, want):
        return None
    return f"differs from the reference by up to {float((got - want).abs().max()):.3g}"


def _rms_norm_rope(device: torch.device, dtype: torch.dtype) -> str | None:
    """q / k of a fused projection (strided head views) with RoPE, and plain rows without."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(5, 7, 64, generator=gen).to(dtype)
    weight = (1 + 0.3 * torch.randn(64, generator=gen)).to(dtype)
    cos_sin = sglang_cos_sin_cache(64, 40)
    positions = torch.randint(0, 40, (5,), generator=gen)
    k = qkv[:, 4:6]
    got = _kernel("rms_norm_rope")(k.to(device), weight.to(device), 1e-6, cos_sin.to(device), positions.to(device),
                                   True)
    problem = _close(got, reference.rms_norm_rope(k, weight, 1e-6, cos_sin, positions), TOLERANCE[dtype])
    if problem is not None:
        return problem
    rows = qkv.reshape(35, 64)
    got = _kernel("rms_norm_rope")(rows.to(device), weight.to(device), 1e-6, None, None, True)
    return _close(got, reference.rms_norm_rope(rows, weight, 1e-6), TOLERANCE[dtype])


def _move_slots(device: torch.device, dtype: torch.dtype) -> str | None:
    """A [slots, heads, D] pool and the slot view of a [bs, heads, capacity, D] cache (strided), moves
    that read slots other moves write."""
    gen = torch.Generator().manual_seed(6)
    pool = torch.randn(40, 3, 64, generator=gen).to(dtype)
    cache = torch.randn(2, 3, 16, 64, generator=gen).to(dtype)
    src, dst = torch.tensor([5, 9, 2, 7]), torch.tensor([2, 5, 9, 1])

    def buffers(pool, cache):  # the pool, and the cache's slot b * 3 * 16 + column as [slots, 3, 64]
        return [pool, cache.as_strided((3 * 16 + 16, 3, 64), (64, 16 * 64, 1))]

    want = [pool.clone(), cache.clone()]
    reference.move_slots(buffers(*want), src, dst)
    got = [pool.to(device), cache.to(device)]
    _kernel("move_slots")(buffers(*got), src.to(device), dst.to(device))
    return _exact(got, want)


def _top_k_logprobs(device: torch.device, dtype: torch.dtype) -> str | None:
    """Rows of a draft vocabulary's size with equal logits (lower index first)."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(5, 4099, generator=gen) * 3).to(dtype)
    logits[2, 100:110] = logits[2].max()
    want_values, want_ids = reference.top_k_logprobs(logits, 8)
    values, ids = _kernel("top_k_logprobs")(logits.to(device), 8)
    return _exact([ids], [want_ids]) or _close(values, want_values, 1e-5)


CHECKS: dict[str, Callable[[torch.device, Any], str | None]] = {
    "verify_block": _verify_block,  # cases: logits dtypes
    "verify_block_from_ids": _verify_block_from_ids,  # cases: id dtypes
    "verify_tree_from_ids": _verify_tree_from_ids,  # cases: parents / id dtypes
    "verify_tree": _verify_tree,  # cases: logits dtypes (a CPU kernel)
    "gumbel_argmax": _gumbel_argmax,  # cases: score dtypes
    "block_attention": _block_attention,  # cases: Attention
    "materialize_context_kv": _materialize_context_kv,  # cases: ContextKV
    "skinny_linear": _skinny_linear,  # cases: dtypes (a CPU kernel)
    "rms_norm_rope": _rms_norm_rope,  # cases: dtypes (a CPU kernel)
    "w8a8_linear": _w8a8_linear,  # cases: dtypes (a CPU kernel)
    "move_slots": _move_slots,  # cases: dtypes (a CPU kernel)
    "top_k_logprobs": _top_k_logprobs,  # cases: dtypes (a CPU kernel)
}
_RESULTS: dict[tuple[str, torch.device, Any], str | None] = {}


def check(op: str, device: torch.device | str, case: Any) -> str | None:
    """Runs `op`'s kernel on `device` for `case`: None when it agrees with the reference, else what
    went wrong (an exception counts). Cached per (op, device, case)."""
    device = ops.canonical_device(device)
    key = (op, device, case)
    if key not in _RESULTS:
        try:
            with torch.inference_mode():
                problem = CHECKS[op](device, case)
            ops.check_device_errors(device)  # a kernel whose index checks reject valid inputs fails
            _RESULTS[key] = problem
        except Exception as exc:  # a kernel error, no kernel image for this device, no kernel at all
            first_line = str(exc).strip().split("\n", 1)[0]
            _RESULTS[key] = f"raised {type(exc).__name__}: {first_line}"
    return _RESULTS[key]


def select(device: torch.device | str, plan: Mapping[str, Iterable[Any]], fallback: str) -> set[str]:
    """Self-tests every case of every op in `plan` ({op: its cases}) on `device`; returns the ops
    that passed. Each failed op gets one warning (naming `fallback`, what runs instead) and the
    reference in `sglang_dflash.ops` on this device from then on; with SGLANG_DFLASH_STRICT=1 any
    failure raises SelfTestError instead."""
    device = ops.canonical_device(device)
    failed = {}
    for op, cases in plan.items():
        for case in cases:
            problem = check(op, device, case)
            if problem is not None:
                failed[op] = f"{case}: {problem}"
                break
    if failed and settings.get(settings.STRICT):
        raise SelfTestError(
            f"sglang-dflash: kernel self-test failed on {device}: "
            + "; ".join(f"{op} ({problem})" for op, problem in failed.items())
            + f". Unset {settings.STRICT.name} to fall back to {fallback} for these ops."
        )
    for op, problem in failed.items():
        if ops.runs_ours(op, device):  # warn once per process and device
            logger.warning("sglang-dflash: self-test of %s on %s failed (%s); %s runs %s there", op, device,
                           problem, op, fallback)
            ops.use_reference(op, device)
    return set(plan) - set(failed)


def engine_plan(q_heads: int, kv_heads: int, head_dim: int, logits_dtype: torch.dtype,
                device: torch.device) -> dict[str, list]:
    """What the standalone engine runs on `device` with a target of this head layout and dtype:
    verify_block on its logits, a draft tree's walk (on the CPU verify_tree on its logits, which walks
    itself; elsewhere verify_tree_from_ids on int64 trees, after verify_block sampled each node),
    gumbel_argmax on fp32 draft scores, block_attention for a drafter
    (built after the target; DFlash drafters share the target's head layout, not always its dtype,
    so every float dtype) over full blocks and causal windowed small ones, and on the CPU the
    drafter's context K/V through materialize_context_kv and skinny_linear and rms_norm_rope in
    every float dtype, and a tree step's move_slots (the target's dtype) and top_k_logprobs."""
    attention = [Attention(q_heads, kv_heads, head_dim, dtype, 16) for dtype in FLOATS]
    attention += [Attention(q_heads, kv_heads, head_dim, dtype, 4, window=64, causal_block=True) for dtype in FLOATS]
    plan = {
        "verify_block": list(dict.fromkeys([torch.float32, logits_dtype])),
        "gumbel_argmax": [torch.float32],
        "block_attention": attention,
    }
    if device.type != "cpu":
        plan["verify_tree_from_ids"] = [torch.int64]
    else:
        plan["materialize_context_kv"] = [ContextKV(q_heads * head_dim, kv_heads, head_dim, head_dim, dtype, dtype,
                                                    torch.float32, False, True) for dtype in FLOATS]
        plan["skinny_linear"] = list(FLOATS)
        plan["rms_norm_rope"] = list(FLOATS)
        plan["w8a8_linear"] = list(FLOATS)
        plan["verify_tree"] = [logits_dtype]
        plan["move_slots"] = [logits_dtype]  # the target's cache (trees)
        plan["top_k_logprobs"] = list(FLOATS)  # the draft logits (trees)
    return plan
