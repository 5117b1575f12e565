"""The kernels' public API. Semantics: docs/design.md §3; executable spec: `reference.py`.

Every op validates its arguments in the extension (shapes, dtypes, devices, and on CPU the index
values) and raises one ValueError naming the bad argument. On CUDA the index values are checked by
the kernels themselves (on the host that would cost a device sync per call): a kernel that finds one
out of range records it, skips what it would address and goes on, and `check_device_errors()` raises
it, with the text the CPU raises, as a RuntimeError (call it where the caller synchronizes anyway).
A server step reads the record without a host sync through `error_watch.DeviceErrorWatch`.

An op whose kernel failed the start-up self-test on a device (`self_test.py`) runs the
pure-PyTorch reference there instead: slower, same result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sglang_dflash._extension import has_cuda_kernels
from sglang_dflash._extension import ops as _ops
from sglang_dflash.ops import reference, variants

__all__ = [
    "bf16_dot_isa",
    "block_attention",
    "canonical_device",
    "check_device_errors",
    "cpu_kernel_applies",
    "float_dot_isa",
    "gumbel_argmax",
    "int8_dot_isa",
    "materialize_context_kv",
    "move_slots",
    "rms_norm_rope",
    "runs_ours",
    "skinny_linear",
    "top_k_logprobs",
    "use_reference",
    "verify_block",
    "verify_block_from_ids",
    "verify_tree",
    "verify_tree_from_ids",
    "w8a8_linear",
]

_REFERENCE_ON: set[tuple[str, torch.device]] = set()  # (op, device) pairs that run the reference


def canonical_device(device: torch.device | str) -> torch.device:
    """`device` as tensors on it report it: "cuda" becomes the current "cuda:N"."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def use_reference(op: str, device: torch.device | str) -> None:
    """From now on `op` runs the pure-PyTorch reference for tensors on `device`."""
    _REFERENCE_ON.add((op, canonical_device(device)))


def runs_ours(op: str, device: torch.device | str) -> bool:
    """Whether `op` runs our kernel (not the reference) for tensors on `device`."""
    return not _REFERENCE_ON or (op, canonical_device(device)) not in _REFERENCE_ON


def cpu_kernel_applies(op: str, x: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether the CPU kernel `op` (rms_norm_rope, materialize_context_kv) may take x with these
    parameters: on the CPU, a float dtype shared by x and the parameters, and the kernel passed its
    self-test. (These kernels have no backward: a caller that may train checks autograd too.)"""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(p.dtype == x.dtype for p in params) and runs_ours(op, x.device))


def _impl(op: str, device: torch.device) -> Callable:
    """The kernel of `op`, or its reference where its self-test failed on `device` (tensors report
    canonical devices; one truth test when nothing failed)."""
    return getattr(reference if _REFERENCE_ON and (op, device) in _REFERENCE_ON else _ops(), op)


def check_device_errors(device: torch.device | str | None = None) -> None:
    """Raises RuntimeError naming the op, the index tensor element and its value, when a CUDA kernel
    of ours has found an index out of range on `device` (None: on any device) since the last check,
    and clears the record; that call's outputs are not valid. Reads each device's record on its
    current stream, so it sees the kernels queued there: one small copy and a sync of that stream, so
    call it where the caller waits for the stream anyway (reading a step's results), not inside a
    CUDA-graph capture. No-op for CPU devices (the CPU kernels raise at the call) and builds without
    CUDA kernels."""
    if device is not None and torch.device(device).type != "cuda":
        return
    if not has_cuda_kernels():
        return
    _ops().check_device_errors(-1 if device is None else canonical_device(device).index)


def block_attention(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    ctx_lens: torch.Tensor,
    block_size: int,
    sm_scale: float | None = None,
    window: int = -1,
    causal_block: bool = False,
    tree_parents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every draft-block query over its request's paged context plus its own block.

    q [N, Hq, D], k_block / v_block [N, Hkv, D] with N = bs * block_size (rows b*B .. b*B+B-1
    are request b's block); k_cache / v_cache [S, Hkv, D], one slot per token; request b's
    context token j lives in slot req_to_token[req_pool_indices[b], j] for j < ctx_lens[b].
    Block rows see every block row (only rows <= themselves when `causal_block`); `window` >= 1
    keeps the keys within that many positions. sm_scale defaults to D ** -0.5.

    Tree mode (verifying a draft tree, docs/design.md §3.3): `tree_parents` int32 / int64 [bs, B], the
    block's rows being the tree's nodes in an order where parents come first (tree_parents[b, i] < i;
    -1 for the root and for unused nodes), and block row i sees the context, itself and its
    ancestors only. Neither `window` nor `causal_block` goes with it. On CPU a node's output is
    bitwise what decoding its path computes (its keys stream at its depth's position); on CUDA it
    agrees to fp32 rounding.
    Returns out [N, Hq, D] in q's dtype.
    """
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    with variants.for_call("block_attention", q.device, q.shape[0] // max(int(block_size), 1)):
        return _impl("block_attention", q.device)(
            q, k_block, v_block, k_cache, v_cache, req_to_token, req_pool_indices, ctx_lens,
            int(block_size), float(sm_scale), int(window), bool(causal_block), tree_parents,
        )


def verify_block(
    candidates: torch.Tensor,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: int,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify a block of drafts per request against the target's logits, losslessly.

    candidates int64 [bs, B]: the committed anchor then B-1 drafts; logits [bs*B, V]: row b*B+i
    predicts the token after candidates[b, i]. Per request: temperature f32 (<= 0: greedy),
    top_k i32 (<= 0: off), top_p f32 (>= 1: off) and offsets i64, which with `seed` key the
    sampling noise: row i of request b draws the noise of key offsets[b] + i, so with offsets =
    the position of each request's row-0 token (plus a per-request salt), every sample is keyed
    by the position it fills and the output does not depend on how the tokens were blocked.
    Returns accept_len i32 [bs], bonus i64 [bs], out_tokens i64 [bs, B] (accepted drafts, the
    bonus, then -1).
    """
    with variants.for_call("verify_block", logits.device, logits.shape[0]):
        return _impl("verify_block", logits.device)(candidates, logits, temperature, top_k, top_p, int(seed), offsets)


def verify_block_from_ids(
    candidates: torch.Tensor, target_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify_block` given the target's tokens (e.g. a precomputed argmax) instead of logits.

    target_ids int [bs, B] or [bs * B]: the target's token after each candidate.
    """
    return _impl("verify_block_from_ids", candidates.device)(candidates, target_ids)


def verify_tree_from_ids(
    tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, target_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify a draft tree per request against the target's token after each node (docs/design.md §3.3).

    tokens int64 [bs, N]: node 0 is the root (the last committed token), nodes 1.. the drafts.
    parents int32/int64 [bs, N]: parents[b, 0] = -1; for i >= 1 a node before i, or -1 for an
    unused (padding) node, whose children must be unused too. depths int64 [bs, N]: 0 for the root
    and unused nodes, else the parent's depth + 1. target_ids int32/int64 [bs, N] or [bs * N]: the
    target's token after the path root..node. From the root, the walk moves to the lowest-index
    child whose token is the target's token after the current node, until none is; that token is
    then the bonus. Returns accept_len int32 [bs] (accepted nodes), path int64 [bs, N] (0, the
    accepted nodes, then -1) and out_tokens int64 [bs, N] (the accepted tokens, the bonus, then -1):
    the bonus is out_tokens[b, accept_len[b]]. A tree that breaks the rules raises a ValueError
    naming the element (on CUDA: `check_device_errors()`, and the outputs are not valid).
    """
    return _impl("verify_tree_from_ids", tokens.device)(tokens, parents, depths, target_ids)


def verify_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: int,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify_tree_from_ids` with the target's tokens sampled from its logits, losslessly.

    logits [bs * N, V]: row b*N + i is the target's prediction after the path root..node i of
    request b (one forward over the nodes with a tree mask). Node i's token is sampled as
    `verify_block` samples a chain row, keyed by the node's depth: noise key offsets[b] +
    depths[b, i], greedy (argmax, lowest id on ties) where temperature <= 0. The token after a node
    of depth d is the step's output token d in any tree (as after row d of a block), so every path
    draws the samples plain decoding draws at its positions and seeded output does not depend on the
    tree. Every token, padding included, must be a vocabulary id. On CPU one kernel walks each tree
    and samples only the nodes it reaches (the root and the accepted path: their logits alone are
    read); elsewhere `verify_block` samples every node (its errors name a node b*N + i as
    candidates[b*N + i, 0]), then `verify_tree_from_ids` walks.
    """
    _check_tree_shapes(tokens, parents, depths, logits, temperature=temperature, top_k=top_k, top_p=top_p,
                       offsets=offsets)
    if tokens.device.type == "cpu":  # one kernel that samples only the nodes the walk reaches
        return _impl("verify_tree", tokens.device)(tokens, parents, depths, logits, temperature, top_k, top_p,
                                                    int(seed), offsets)
    return verify_tree_by_nodes(tokens, parents, depths, logits, temperature, top_k, top_p, seed, offsets)


def verify_tree_by_nodes(tokens, parents, depths, logits, temperature, top_k, top_p, seed, offsets):
    """`verify_tree` on any device: every node sampled by `verify_block` as a one-row block, then
    `verify_tree_from_ids` (what GPUs run; the CPU kernel gives the same results)."""
    n = tokens.shape[1]
    # Each node as a one-row block: its bonus is the target's token after the node.
    _, node_targets, _ = verify_block(
        tokens.reshape(-1, 1), logits, temperature.repeat_interleave(n), top_k.repeat_interleave(n),
        top_p.repeat_interleave(n), seed, offsets.repeat_interleave(n) + depths.reshape(-1),
    )
    return verify_tree_from_ids(tokens, parents, depths, node_targets)


def _check_tree_shapes(tokens, parents, depths, logits, **per_request) -> None:
    """What verify_tree's per-node view would otherwise misname: [bs, N] trees (int64 tokens and
    depths), logits of bs * N rows, [bs] sampling arguments."""
    def fail(what):
        raise ValueError(f"sglang_dflash.verify_tree: {what}")

    if tokens.dim() != 2:
        fail(f"tokens must be 2-D [bs, N], got shape {list(tokens.shape)}")
    bs, n = tokens.shape
    for name, t in (("parents", parents), ("depths", depths)):
        if t.shape != tokens.shape:
            fail(f"{name} must have tokens' shape [bs, N] = {list(tokens.shape)}, got shape {list(t.shape)}")
    for name, t in (("tokens", tokens), ("depths", depths)):
        if t.dtype != torch.int64:
            fail(f"{name} must be torch.int64, got {t.dtype}")
    if logits.dim() != 2 or logits.shape[0] != bs * n:
        fail(f"logits must be [bs * N, V] with bs, N = {bs}, {n} from tokens, got shape {list(logits.shape)}")
    for name, t in per_request.items():
        if t.shape != (bs,):
            fail(f"{name} must be [bs] with bs = {bs} from tokens, got shape {list(t.shape)}")


def gumbel_argmax(scores: torch.Tensor, ids: torch.Tensor | None, seed: int, offsets: torch.Tensor,
                  rows: torch.Tensor) -> torch.Tensor:
    """Per row r, argmax_j of scores[r, j] + the Gumbel noise `verify_block` draws for token id
    ids[j] (j when ids is None) in verify row rows[r] of the request with sampling offset
    offsets[r] (and `seed`); the lowest j on ties, NaN never chosen.

    scores float [R, n] (e.g. draft logits / temperature), ids int64 [n] in [0, 2^34), offsets and
    rows int64 [R] (rows in [0, 2^32)). Returns int64 [R] column indices. A drafter that picks
    draft k this way with row k - 1 proposes the token the target's sampler will pick whenever the
    two distributions agree on it under the shared noise: at temperature > 0 that matches far more
    often than the draft's argmax, and the target's sample (hence the output) does not change.
    """
    return _impl("gumbel_argmax", scores.device)(scores, ids, int(seed), offsets, rows)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` on the CPU for inputs of few rows (decode and verify steps), reading
    the weight once; fp32 accumulation, output in x's dtype.

    x [..., K], weight [N, K] (last dim contiguous), bias [N] or None, all of one float dtype; or
    an int8 weight (weight-only quantization, `quantize_rows`) with weight_scale float32 [N]: then
    output column n is weight_scale[n] * (x @ weight[n]) + bias[n], reading a quarter of the fp32
    bytes. Each output row is bitwise independent of the other rows of x (batch invariant), so
    verifying B tokens computes exactly what decoding them one at a time computes. Returns [..., N].
    """
    if x.device.type not in ("cpu", "meta"):  # no kernel is registered for other devices
        raise ValueError(f"sglang_dflash.skinny_linear: is a CPU kernel; x is on {x.device} "
                         "(use torch.nn.functional.linear there)")
    return _impl("skinny_linear", x.device)(x, weight, bias, weight_scale)


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """A linear layer with an int8 weight and int8 activations, on the CPU (the drafter's layers).

    Each row of x [..., K] (a float dtype) is quantized symmetrically on the fly, q = round(x * 127 /
    max |row|); out[m, n] = float32(sum_k q[m, k] * weight[n, k]) * (max |row m| / 127) *
    weight_scale[n] + bias[n], the sum exact, the rest in float32 in that order (`reference.
    w8a8_linear` is the spec; kernel and reference agree bit for bit). weight int8 [N, K] with K <=
    131072 (`quantize_rows`), weight_scale float32 [N], bias [N] of x's dtype or None; returns
    [..., N] in x's dtype. A row with a non-finite value gives NaN. Each output row depends only on
    its own x row (batch invariant). With AVX512-VNNI (`int8_dot_isa()`) one instruction does 32
    byte products, and no weight is converted to float: skinny_linear's int8 path is bound by those
    conversions and its FMAs. Quantized activations change a drafter's proposals slightly, never
    the verified output.
    """
    if x.device.type not in ("cpu", "meta"):  # no kernel is registered for other devices
        raise ValueError(f"sglang_dflash.w8a8_linear: is a CPU kernel; x is on {x.device}")
    return _impl("w8a8_linear", x.device)(x, weight, weight_scale, bias)


def float_dot_isa() -> str:
    """The fp32 FMA path skinny_linear runs on this CPU: "avx512" (16 lanes, 4 x 6 tiles), "avx2"
    (8 lanes, 3 x 4 tiles; also with SGLANG_DFLASH_NO_AVX512=1 set before the first call), or
    "portable". Chosen once per process: each path is batch invariant, and the two differ in the
    last bits."""
    return _ops().float_dot_isa()


def bf16_dot_isa() -> str:
    """The path skinny_linear runs bf16 x with a bf16 weight on: "amx_bf16" (AMX tiles, 16 weight
    rows x 16 x rows x 32 k an instruction: a verify of up to 16 rows costs about what one row
    costs), else `float_dot_isa()`'s. AMX needs the CPU's AMX-BF16 and Linux's grant of the tile
    state; SGLANG_DFLASH_NO_AMX=1 set before the first call keeps the FMA path. Chosen once per
    process (the two sum in different orders)."""
    return _ops().bf16_dot_isa()


def int8_dot_isa() -> str:
    """The int8 dot product w8a8_linear runs on this CPU: "amx_int8" (AMX tiles, 16 weight rows x
    16 x rows x 64 k an instruction, for 3 rows or more and K a multiple of 64; AVX512-VNNI else;
    SGLANG_DFLASH_NO_AMX=1 keeps VNNI), "avx512_vnni", or "portable" (scalar loops; also with
    SGLANG_DFLASH_NO_VNNI=1). All give the same bits (exact integer sums); chosen at the first call."""
    return _ops().int8_dot_isa()


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None, is_neox: bool = True) -> torch.Tensor:
    """RMSNorm of every vector along x's last dimension, then, with `cos_sin_cache`, its RoPE: the
    q_norm / k_norm + rotary step of a Qwen3-style attention (and, without RoPE, any RMSNorm), in
    one CPU pass instead of ~14 elementwise ops. Per vector, in fp32:

        y = x * rsqrt(mean(x**2) + eps) * weight
        y[:rotary_dim] = RoPE of y[:rotary_dim] at positions[row]   (with cos_sin_cache)

    rounded once to x's dtype. x [..., D] (fp32, bf16 or fp16; last dimension contiguous, other
    strides free: q / k can be views into a fused projection); weight [D] of x's dtype. With RoPE x
    is [N, heads, D], cos_sin_cache [P, rotary_dim] of any float dtype in SGLang's layout (row p:
    cos of the rotary_dim / 2 angles of position p, then their sin; rotary_dim even, in [2, D]),
    positions [N] int32 / int64 in [0, P); is_neox: rotate-half pairs (j, j + rotary_dim / 2),
    else interleaved (2j, 2j + 1). Returns a new contiguous tensor of x's shape and dtype. Bad
    arguments raise a ValueError naming them. A CPU kernel (on GPUs torch's own ops serve).
    """
    if x.device.type not in ("cpu", "meta"):  # no kernel is registered for other devices
        raise ValueError(f"sglang_dflash.rms_norm_rope: is a CPU kernel; x is on {x.device}")
    return _impl("rms_norm_rope", x.device)(x, weight, float(eps), cos_sin_cache, positions, bool(is_neox))


def materialize_context_kv(
    ctx: torch.Tensor,
    kv_weights: Sequence[torch.Tensor],
    kv_biases: Sequence[torch.Tensor] | None,
    k_norm_weights: Sequence[torch.Tensor],
    eps: float,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    v_scale: float = 1.0,
) -> None:
    """Writes the draft context K/V of N committed tokens into every draft layer's KV pool, in one
    call (docs/design.md §3.4): for layer l and row i with out_loc[i] >= 0,

        kv = ctx[i] @ kv_weights[l].T (+ kv_biases[l])   fp32 accumulation, rounded to ctx's dtype
        k, v = kv[:Hkv*D], kv[Hkv*D:] as [Hkv, D]
        k = k * rsqrt(mean(k**2 over D) + eps) * k_norm_weights[l]   per head, fp32 from here
        k[:, :rotary_dim] = RoPE at positions[i]
        k_caches[l][out_loc[i]] = k;  v_caches[l][out_loc[i]] = v * v_scale   (pool dtype)

    ctx [N, H] (the caller has applied fc and hidden_norm); per layer kv_weights [2*Hkv*D, H] (that
    layer's k_proj then v_proj rows, last dim contiguous: a row slice of SGLang's fused qkv_proj
    weight), kv_biases [2*Hkv*D] or None, k_norm_weights [D]; these share ctx's float dtype (fp32,
    bf16 or fp16). cos_sin_cache [P, rotary_dim] of any float dtype, SGLang's layout: row p holds
    cos of the rotary_dim / 2 angles of position p, then their sin; rotary_dim even, in [2, D]. is_neox:
    rotate-half pairs (j, j + rotary_dim/2), else interleaved pairs (2j, 2j + 1). positions [N] in
    [0, P) and out_loc [N] in [-1, S), int32 or int64; out_loc -1 skips the row, and no slot may
    appear twice (rejected on CPU; on CUDA the slot's contents are then undefined). k_caches /
    v_caches: L pools [S, Hkv, D] of one float dtype (may differ from ctx's; Hkv, D, S are read from
    them), written in place; nothing else in them changes. v_scale multiplies v (SGLang's
    set_kv_buffer divides by its v_scale: pass 1 / that).

    Bad arguments raise a ValueError naming them; on CUDA, out-of-range positions / out_loc are
    raised by `check_device_errors()` instead (no host sync here), and their rows are not written.
    """
    _impl("materialize_context_kv", ctx.device)(
        ctx, list(kv_weights), None if kv_biases is None else list(kv_biases), list(k_norm_weights), float(eps),
        cos_sin_cache, bool(is_neox), positions, out_loc, list(k_caches), list(v_caches), float(v_scale),
    )


def move_slots(buffers: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """In every buffer, slot dst[i] takes what slot src[i] held (buffer[dst[i]] = old buffer[src[i]]
    along the first dimension), every source read before any slot is written, in one call: a tree
    step moves its accepted path's K/V into consecutive cache slots of every layer with it.

    buffers: tensors [S, ...] of any dtype with a contiguous last dimension (other strides free, so
    a [slots, heads, D] view of a [bs, heads, capacity, D] cache works), on one device, changed in
    place; src, dst [n] int32 or int64 within every buffer's slots, no slot twice in dst (each would
    take either source). Slots not in dst do not change. Bad arguments raise a ValueError naming
    them. A CPU kernel; elsewhere one indexed copy per buffer (the reference) serves.
    """
    buffers = list(buffers)
    if buffers and buffers[0].device.type not in ("cpu", "meta"):  # no kernel is registered there
        reference.move_slots(buffers, src, dst)
        return
    _impl("move_slots", src.device)(buffers, src, dst)


def top_k_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of logits [..., V] (fp32, bf16 or fp16): its k largest logits, best first, as
    (log-probabilities float32 [..., k], indices int64 [..., k]), i.e.
    `logits.float().log_softmax(-1).topk(k)` with equal logits ordered lower index first. The k
    choices a draft tree takes at each position, in one pass over the row instead of torch's
    log_softmax then topk. k in [1, V]; a row holding NaN raises a ValueError, as do bad arguments.
    A CPU kernel; elsewhere the reference serves."""
    if logits.device.type not in ("cpu", "meta"):  # no kernel is registered there
        return reference.top_k_logprobs(logits, k)
    return _impl("top_k_logprobs", logits.device)(logits, int(k))
