"""Pure-PyTorch references of the kernels: the executable spec (docs/design.md §3).

These favour being obviously right over being fast. The C++ and CUDA kernels are tested against
them; any disagreement is a kernel bug unless this file contradicts docs/design.md §3.
"""

from __future__ import annotations

import torch

# Philox4x32-10 constants (Salmon et al., SC'11), the same ones ATen's philox_engine uses.
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


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
    """Attention of each draft block over its request's paged context plus the block itself; with
    `tree_parents` [bs, B], block row i sees only itself and its ancestors among the block rows."""
    n_rows, hq, head_dim = q.shape
    group = hq // k_block.shape[1]
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    out = torch.empty_like(q)
    block_pos = torch.arange(block_size, device=q.device)
    for b in range(n_rows // block_size):
        rows = slice(b * block_size, (b + 1) * block_size)
        ctx = int(ctx_lens[b])
        slots = req_to_token[int(req_pool_indices[b]), :ctx].long()
        k = torch.cat([k_cache[slots], k_block[rows]]).float().repeat_interleave(group, dim=1)
        v = torch.cat([v_cache[slots], v_block[rows]]).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("ihd,jhd->hij", q[rows].float(), k) * sm_scale

        q_pos = ctx + block_pos
        k_pos = torch.cat([torch.arange(ctx, device=q.device), ctx + block_pos])
        visible = torch.ones(block_size, ctx + block_size, dtype=torch.bool, device=q.device)
        if causal_block:
            visible[:, ctx:] = k_pos[None, ctx:] <= q_pos[:, None]
        if tree_parents is not None:
            visible[:, ctx:] = tree_ancestors(tree_parents[b : b + 1])[0]
        if window >= 1:
            visible &= (q_pos[:, None] - k_pos[None, :]).abs() < window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[rows] = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v).to(q.dtype)
    return out


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """parents [bs, N] (parents[b, i] < i; -1: a root or an unused node) -> bool [bs, N, N]:
    [b, i, j] = node j is node i or one of its ancestors (the block rows node i attends to)."""
    bs, n = parents.shape
    seen = torch.eye(n, dtype=torch.bool, device=parents.device).repeat(bs, 1, 1)
    rows = torch.arange(bs, device=parents.device)
    for i in range(1, n):  # parents come first, so their rows are final when a child copies them
        parent = parents[:, i].long()
        used = parent >= 0
        seen[rows[used], i] |= seen[rows[used], parent[used]]
    return seen


def philox4x32_10(counter: list[torch.Tensor], key: tuple[int, int]) -> list[torch.Tensor]:
    """Philox4x32 with 10 rounds on int64 tensors holding uint32 values; returns 4 output lanes."""
    c0, c1, c2, c3 = (c.to(torch.int64) & _U32 for c in counter)
    k0, k1 = key[0] & _U32, key[1] & _U32
    for round_ in range(10):
        if round_:
            k0, k1 = (k0 + _PHILOX_W0) & _U32, (k1 + _PHILOX_W1) & _U32
        p0, p1 = c0 * _PHILOX_M0, c2 * _PHILOX_M1  # wraps mod 2^64; both halves stay exact
        hi0, lo0 = (p0 >> 32) & _U32, p0 & _U32
        hi1, lo1 = (p1 >> 32) & _U32, p1 & _U32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


def gumbel_noise(seed: int, offset: int, row: int, vocab_size: int, device=None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gumbel(0, 1) noise for one verify row: fp32 [vocab_size] (float64: before that rounding, to
    tell a near-tie of two noisy scores from a wrong pick).

    Vocab id v reads lane v % 4 of the Philox block at counter (v // 4, 0, key lo, key hi) under
    key seed, with key = offset + row (mod 2^64): row r at offset o draws the noise of row 0 at
    offset o + r, so offsets that give row 0's position key every sample by its position. The 23
    high bits of the lane give u = (2m + 1) / 2^24 in (0, 1), exactly; the
    noise -log(-log(u)) is evaluated in float64 and rounded once to fp32 so every backend agrees.
    """
    key = (offset + row) & ((1 << 64) - 1)
    seed &= (1 << 64) - 1
    group = torch.arange((vocab_size + 3) // 4, dtype=torch.int64, device=device)
    full = torch.full_like(group, 0)
    lanes = philox4x32_10([group, full, full + (key & _U32), full + (key >> 32)], (seed & _U32, seed >> 32))
    bits = torch.stack(lanes, dim=1).reshape(-1)[:vocab_size]
    u = ((bits >> 9) * 2 + 1).double() / 2.0**24
    return (-torch.log(-torch.log(u))).to(dtype)


def sampling_mask(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Which vocab ids the top-k / top-p filters keep for one row of scaled logits x (fp32 [V]).

    Ties are kept together, so the rule does not depend on any sort order: top-k keeps every id
    whose logit is >= the k-th largest; top-p then keeps an id when the probability mass (within
    the top-k set) of ids strictly more likely than it is < top_p. The most likely ids always stay.
    """
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.numel():
        keep &= x >= torch.topk(x, top_k).values[-1]
    if top_p < 1.0:
        probs = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=0)
        sorted_p, order = probs.sort(descending=True)
        exclusive = torch.cumsum(sorted_p, 0) - sorted_p
        # Mass strictly above an id = exclusive cumsum at the first member of its tie group.
        first_of_tie = torch.searchsorted(-sorted_p, -sorted_p, side="left")
        mass_above = torch.empty_like(probs)
        mass_above[order] = exclusive[first_of_tie]
        keep &= (mass_above < top_p) | (x == x.max())
    return keep


def target_samples(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: int,
    offsets: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """The target's token for every verify row: int64 [bs, B].

    Greedy (temperature <= 0): argmax, lowest id on ties. Otherwise the Gumbel-max sample
    argmax(logit / T + g) over the ids `sampling_mask` keeps.
    """
    bs = temperature.numel()
    y = torch.empty(bs, block_size, dtype=torch.int64, device=logits.device)
    for b in range(bs):
        for i in range(block_size):
            row = logits[b * block_size + i].float()
            t = float(temperature[b])
            if t <= 0:
                y[b, i] = torch.argmax(row)
                continue
            x = row / t
            noise = gumbel_noise(seed, int(offsets[b]), i, row.numel(), row.device)
            keep = sampling_mask(x, int(top_k[b]), float(top_p[b]))
            y[b, i] = torch.argmax((x + noise).masked_fill(~keep, float("-inf")))
    return y


def verify_block_from_ids(candidates: torch.Tensor, target_ids: torch.Tensor):
    """Accept the longest draft prefix that agrees with the target's tokens.

    Returns (accept_len int32 [bs], bonus int64 [bs], out_tokens int64 [bs, B]): out_tokens holds
    the accepted drafts, then the bonus (the target's token after them), then -1.
    """
    bs, block_size = candidates.shape
    target_ids = target_ids.reshape(bs, block_size).long()
    agree = candidates[:, 1:].long() == target_ids[:, :-1]
    accept_len = agree.long().cumprod(dim=1).sum(dim=1)
    bonus = target_ids.gather(1, accept_len[:, None])[:, 0]
    out_tokens = torch.full((bs, block_size), -1, dtype=torch.int64, device=candidates.device)
    for b in range(bs):
        a = int(accept_len[b])
        out_tokens[b, :a] = candidates[b, 1 : a + 1]
        out_tokens[b, a] = bonus[b]
    return accept_len.int(), bonus, out_tokens


def verify_block(
    candidates: torch.Tensor,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: int,
    offsets: torch.Tensor,
):
    """Sample the target's token for every row, then accept as `verify_block_from_ids` does."""
    y = target_samples(logits, temperature, top_k, top_p, seed, offsets, candidates.shape[1])
    return verify_block_from_ids(candidates, y)


def verify_tree_from_ids(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                         target_ids: torch.Tensor):
    """Walk each request's draft tree from the root (node 0): while some child of the current node
    holds the target's token after it, move to the lowest-index such child; the target's token
    after the last node reached is the bonus. depths are not read (they key verify_tree's noise).

    Returns (accept_len int32 [bs], path int64 [bs, N], out_tokens int64 [bs, N]): path holds 0,
    the accepted nodes, then -1; out_tokens the accepted tokens, the bonus, then -1.
    """
    bs, n = tokens.shape
    tok, par = tokens.tolist(), parents.tolist()
    target = target_ids.reshape(bs, n).tolist()
    accept_len = torch.zeros(bs, dtype=torch.int32)
    path = torch.full((bs, n), -1, dtype=torch.int64)
    out_tokens = torch.full((bs, n), -1, dtype=torch.int64)
    for b in range(bs):
        cur, accepted = 0, 0
        path[b, 0] = 0
        while True:
            t = target[b][cur]
            out_tokens[b, accepted] = t
            children = [c for c in range(cur + 1, n) if par[b][c] == cur and tok[b][c] == t]
            if not children:
                break
            cur = children[0]
            accepted += 1
            path[b, accepted] = cur
        accept_len[b] = accepted
    device = tokens.device
    return accept_len.to(device), path.to(device), out_tokens.to(device)


def verify_tree(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, logits: torch.Tensor,
                temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seed: int,
                offsets: torch.Tensor):
    """The target's token after every node, sampled as `target_samples` samples a chain row at the
    node's depth (noise key offsets[b] + depths[b, i]), then the walk of `verify_tree_from_ids`."""
    bs, n = tokens.shape
    y = target_samples(logits, temperature.repeat_interleave(n), top_k.repeat_interleave(n),
                       top_p.repeat_interleave(n), seed, offsets.repeat_interleave(n) + depths.reshape(-1), 1)
    return verify_tree_from_ids(tokens, parents, depths, y.reshape(bs, n))


def gumbel_argmax(scores: torch.Tensor, ids: torch.Tensor | None, seed: int, offsets: torch.Tensor,
                  rows: torch.Tensor) -> torch.Tensor:
    """Per row r, the column j maximizing scores[r, j] + gumbel_noise(seed, offsets[r], rows[r])
    at token id ids[j] (j when ids is None); the lowest j on ties. int64 [R]."""
    out = torch.empty(scores.shape[0], dtype=torch.int64, device=scores.device)
    id_of = torch.arange(scores.shape[1], device=scores.device) if ids is None else ids
    for r in range(scores.shape[0]):
        noise = gumbel_noise(seed, int(offsets[r]), int(rows[r]), int(id_of.max()) + 1, scores.device)[id_of]
        out[r] = torch.argmax(scores[r].float() + noise)
    return out


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (times weight_scale per output column for an int8 weight) + bias, computed in
    float64 and rounded once to x's dtype (the kernel accumulates in fp32, so it agrees to fp32
    rounding of a K-term sum)."""
    out = x.double() @ weight.double().T
    if weight_scale is not None:
        out = out * weight_scale.double()
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [M, K] as symmetric int8, in float32: q = round(x * (127 / max |row|)) (half to
    even) and the row's scale max |row| / 127; an all-zero row has q = 0 and scale 0, a row with a
    non-finite value q = 0 and scale NaN (its outputs come out NaN, as a float product's would)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    finite = torch.isfinite(xf).all(dim=-1)
    # torch.full_like(amax, 127) / amax, a true division (127 / tensor multiplies by a reciprocal).
    inv = torch.where(finite & (amax > 0), torch.full_like(amax, 127) / torch.where(amax > 0, amax, 1.0), 0.0)
    q = (xf * inv[:, None]).round().clamp(-127, 127)
    q = torch.where(finite[:, None], q, 0.0)
    return q, torch.where(finite, amax / 127, float("nan"))


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x quantized per row (`quantize_activations`) times the int8 weight: the integer sums exactly
    (float64), rounded once to float32, then times the row's scale, times weight_scale, plus bias, in
    float32 and in that order; out in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    q, x_scale = quantize_activations(rows)
    out = (q.double() @ weight.double().T).float() * x_scale[:, None] * weight_scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotates x [..., rotary_dim] by angles with cos / sin [..., rotary_dim / 2]: pairs
    (i, i + rotary_dim / 2) when is_neox (rotate-half), else (2i, 2i + 1) (interleaved)."""
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None, is_neox: bool = True) -> torch.Tensor:
    """In fp32: y = x * rsqrt(mean(x^2 over the last dim) + eps) * weight; with cos_sin_cache, the
    first rotary_dim dims of y [N, heads, D] rotated by the angles in row positions[i] (cos half,
    then sin half); rounded once to x's dtype."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if cos_sin_cache is not None:
        half = cos_sin_cache.shape[1] // 2
        cos_sin = cos_sin_cache[positions.long()].float()[:, None]  # [N, 1, rotary_dim]
        y = torch.cat([rope(y[..., : 2 * half], cos_sin[..., :half], cos_sin[..., half:], is_neox),
                       y[..., 2 * half :]], dim=-1)
    return y.to(x.dtype).contiguous()


def materialize_context_kv(
    ctx: torch.Tensor,
    kv_weights: list[torch.Tensor],
    kv_biases: list[torch.Tensor] | None,
    k_norm_weights: list[torch.Tensor],
    eps: float,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    v_scale: float = 1.0,
) -> None:
    """Writes every layer's context K/V of the rows with out_loc >= 0 into k_caches / v_caches.

    Layer l: kv = ctx @ kv_weights[l].T (+ kv_biases[l]), accumulated in fp32 and rounded to ctx's
    dtype (what a linear layer in that dtype returns); k, v = its two halves as [N, Hkv, D]. Then in
    fp32: k = k * rsqrt(mean(k^2 over D) + eps) * k_norm_weights[l]; the first rotary_dim dims of k
    rotated by the angles in row positions[i] of cos_sin_cache (cos half, then sin half);
    v = v * v_scale. Row i goes to slot out_loc[i], converted to the pools' dtype.
    """
    heads, head_dim = k_caches[0].shape[1:]
    half = cos_sin_cache.shape[1] // 2
    write = out_loc >= 0
    slots = out_loc[write].long()
    cos_sin = cos_sin_cache[positions[write].long()].float()[:, None]  # [n, 1, rotary_dim]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    x = ctx[write].float()
    for layer, weight in enumerate(kv_weights):
        bias = None if kv_biases is None else kv_biases[layer].float()
        kv = torch.nn.functional.linear(x, weight.float(), bias).to(ctx.dtype).float()
        k, v = kv.view(-1, 2, heads, head_dim).unbind(1)
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * k_norm_weights[layer].float()
        k = torch.cat([rope(k[..., : 2 * half], cos, sin, is_neox), k[..., 2 * half :]], dim=-1)
        k_caches[layer][slots] = k.to(k_caches[layer].dtype)
        v_caches[layer][slots] = (v * v_scale).to(v_caches[layer].dtype)


def move_slots(buffers: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """buffer[dst[i]] = buffer[src[i]] along the first dimension of every buffer, all sources read
    first (`buffer[src]` is a copy)."""
    for buffer in buffers:
        buffer[dst.long()] = buffer[src.long()]


def top_k_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest of each row's log-softmax, best first, equal values in
    index order (a stable descending sort)."""
    logprobs = logits.float().log_softmax(-1)
    values, indices = logprobs.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]
