"""Random inputs for the ops in the layouts SGLang hands them over, and the error bounds they are
checked against; shared by tests, benchmarks and the start-up self-test."""

from __future__ import annotations

import torch

from sglang_dflash.ops import reference


def skinny_linear_error_ratio(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """|out - exact| per element over what skinny_linear's arithmetic allows (<= 1: within it). It
    converts x, weight and bias to fp32 (exactly) and sums the k products in fp32, in some order,
    then multiplies by an int8 weight's row scale and adds the bias: an error of at most
    ~(k + 2) * 2^-24 * (scale * sum |x||w| + |b|), doubled here to cover the second-order terms;
    then it rounds once to out's dtype: half an ulp, eps / 2 * |value|, or half the subnormal
    spacing."""
    xd, wd, bd, sd = (None if t is None else t.double() for t in (x, weight, bias, weight_scale))
    exact = reference.skinny_linear(xd, wd, bd, sd)  # float64: exact products, sums to ~2^-53
    mass = (xd.abs() @ wd.abs().T) * (1 if sd is None else sd) + (0 if bias is None else bd.abs())
    fin = torch.finfo(out.dtype)
    bound = fin.eps / 2 * (exact.abs() + fin.smallest_normal) + 2 * (x.shape[-1] + 2) * 2.0**-24 * mass
    return (out.double() - exact).abs() / bound


def make_attention_inputs(bs, block, hq, hkv, head_dim, ctx_lens, dtype, *, seed, table_dtype=torch.int32,
                          width=None, unaligned=False):
    """A paged KV pool shared by the batch, slots shuffled, table rows padded with junk ids.

    q is a strided view into a packed qkv tensor (as attention layers produce it), the requests
    sit in shuffled rows of a larger req_to_token table (`width` columns, default max ctx + 3),
    and table entries past each context point outside the pool, so reading them would fail the
    comparison or the bounds check. The dtypes of req_pool_indices / ctx_lens (int32 or int64)
    alternate with the seed's parity. `unaligned`: every head vector starts off a 16-byte
    boundary (one element of padding in front), as a kernel's slow path must handle.
    """
    gen = torch.Generator().manual_seed(seed)
    n_rows = bs * block
    total_ctx = int(sum(ctx_lens))
    n_slots = total_ctx + 7
    pad = 1 if unaligned else 0
    qkv = torch.randn(n_rows, pad + (hq + 2 * hkv) * head_dim, generator=gen).to(dtype)[:, pad:]
    q = qkv[:, : hq * head_dim].view(n_rows, hq, head_dim)
    k_block = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(n_rows, hkv, head_dim)
    v_block = qkv[:, (hq + hkv) * head_dim :].view(n_rows, hkv, head_dim)
    k_cache = torch.randn(n_slots, hkv, pad + head_dim, generator=gen).to(dtype)[..., pad:]
    v_cache = torch.randn(n_slots, hkv, pad + head_dim, generator=gen).to(dtype)[..., pad:]

    width = width or max(ctx_lens) + 3
    n_table_rows = bs + 2
    table = torch.full((n_table_rows, width), n_slots + 1000, dtype=torch.int64)
    slots = torch.randperm(n_slots, generator=gen)
    pool_rows = torch.randperm(n_table_rows, generator=gen)[:bs]
    used = 0
    for b, ctx in enumerate(ctx_lens):
        table[pool_rows[b], :ctx] = slots[used : used + ctx]
        used += ctx
    return dict(
        q=q,
        k_block=k_block,
        v_block=v_block,
        k_cache=k_cache,
        v_cache=v_cache,
        req_to_token=table.to(table_dtype),
        req_pool_indices=pool_rows.to(torch.int64 if seed % 2 else torch.int32),
        ctx_lens=torch.tensor(ctx_lens, dtype=torch.int32 if seed % 2 else torch.int64),
    )


def on_device(args: dict, device) -> dict:
    """The same inputs on `device` with the same layouts: views of one base tensor (q, k_block,
    v_block of the packed qkv; padded caches) stay views of one moved base."""
    out, bases = {}, {}
    for name, t in args.items():
        base = t._base
        if base is None:
            out[name] = t.to(device)
            continue
        if id(base) not in bases:
            bases[id(base)] = base.to(device)
        out[name] = bases[id(base)].as_strided(t.shape, t.stride(), t.storage_offset())
    return out


def sglang_cos_sin_cache(rotary_dim, max_positions, base=10000.0, dtype=torch.float32):
    """RotaryEmbedding.cos_sin_cache as SGLang computes it: row p = cat(cos(p * f), sin(p * f)) with
    f = 1 / base ** (arange(0, rotary_dim, 2) / rotary_dim)."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def make_context_kv_inputs(n, hidden, layers, kv_heads, head_dim, rotary_dim, dtype, pool_dtype=None, *, seed,
                           bias=False, is_neox=True, index_dtype=torch.int64, skip=0, pad=0, poison="nan",
                           cos_sin_dtype=torch.float32, eps=1e-6):
    """Arguments of materialize_context_kv in the layouts SGLang hands them over.

    Each layer's kv weight is the k/v row range of a fused qkv weight (2 * kv_heads q heads first),
    scaled so projections are O(1). cos_sin_cache is SGLang's with P = n + 5 rows; positions are
    random with the last row P - 1 used. out_loc: distinct shuffled slots of S = 2n + 7, `skip`
    random rows -1. Pools are filled with `poison` ("nan", or random sentinel values otherwise) and
    are views into bases with `pad` elements in front of every head vector (strided, unaligned).
    """
    gen = torch.Generator().manual_seed(seed)
    pool_dtype = pool_dtype or dtype
    kv_rows = 2 * kv_heads * head_dim
    q_rows = 2 * kv_heads * head_dim  # two q heads per kv head
    scale = hidden**-0.5
    kv_weights = [(torch.randn(q_rows + kv_rows, hidden, generator=gen) * scale).to(dtype)[q_rows:]
                  for _ in range(layers)]
    kv_biases = [(torch.randn(kv_rows, generator=gen) * 0.5).to(dtype) for _ in range(layers)] if bias else None
    k_norm_weights = [(1 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in range(layers)]
    max_positions = n + 5
    positions = torch.randint(0, max_positions, (n,), generator=gen)
    if n:
        positions[torch.randint(0, n, (1,), generator=gen)] = max_positions - 1
    slots = 2 * n + 7
    out_loc = torch.randperm(slots, generator=gen)[:n]
    out_loc[torch.randperm(n, generator=gen)[:skip]] = -1

    def pool():
        shape = (slots, kv_heads, pad + head_dim)
        base = torch.full(shape, float("nan")) if poison == "nan" else torch.randn(shape, generator=gen)
        return base.to(pool_dtype)[..., pad:]

    return dict(
        ctx=torch.randn(n, hidden, generator=gen).to(dtype),
        kv_weights=kv_weights,
        kv_biases=kv_biases,
        k_norm_weights=k_norm_weights,
        eps=eps,
        cos_sin_cache=sglang_cos_sin_cache(rotary_dim, max_positions, dtype=cos_sin_dtype),
        is_neox=is_neox,
        positions=positions.to(index_dtype),
        out_loc=out_loc.to(index_dtype),
        k_caches=[pool() for _ in range(layers)],
        v_caches=[pool() for _ in range(layers)],
        v_scale=0.5 + torch.rand((), generator=gen).item(),
    )


def make_tree(bs, nodes, vocab, gen, unused=0.15):
    """Random draft trees in verify_tree_from_ids' layout: (tokens, parents, depths), int64 [bs, N].

    Each request has a random budget of nodes (the rest is padding: parent -1, depth 0) and, within
    it, a fraction `unused` of padding nodes too. A used node hangs under the previous used node
    half of the time (deep chains), else under a random earlier used one (branches). A third of
    the tokens repeat an earlier node's, across branches too, so a walk that took a node of another
    parent, or not the lowest-index child, would go elsewhere.
    """
    def pick(n):
        return int(torch.randint(0, n, (), generator=gen))

    parents = torch.full((bs, nodes), -1, dtype=torch.int64)
    depths = torch.zeros(bs, nodes, dtype=torch.int64)
    tokens = torch.randint(0, vocab, (bs, nodes), generator=gen)
    for b in range(bs):
        used = [0]
        budget = 1 + pick(nodes)
        for i in range(1, budget):
            if torch.rand((), generator=gen) < unused:
                continue
            p = used[-1] if torch.rand((), generator=gen) < 0.5 else used[pick(len(used))]
            parents[b, i], depths[b, i] = p, depths[b, p] + 1
            if torch.rand((), generator=gen) < 1 / 3:
                tokens[b, i] = tokens[b, used[pick(len(used))]]
            used.append(i)
    return tokens, parents, depths


def follow_targets(tokens, parents, target, gen, follow=0.7):
    """tokens with each used node's token replaced, with probability `follow`, by the target's token
    after its parent (target [bs, N]): the draft guessed right, so walks go deep."""
    tokens = tokens.clone()
    hit = (parents >= 0) & (torch.rand(tokens.shape, generator=gen) < follow)
    tokens[hit] = target.gather(1, parents.clamp(min=0))[hit]
    return tokens
