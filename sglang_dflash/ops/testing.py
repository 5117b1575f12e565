"""Random inputs for the ops in the layouts SGLang hands them over, shared by tests and benchmarks."""

from __future__ import annotations

import torch


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
