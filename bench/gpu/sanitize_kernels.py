"""Small calls that reach every CUDA kernel path, for compute-sanitizer (memcheck / racecheck).

Run: compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m bench.gpu.sanitize_kernels
Shapes are tiny because the sanitizer slows kernels down by orders of magnitude.
"""

from __future__ import annotations

import sys

import torch

from sglang_dflash import ops
from sglang_dflash.ops.testing import follow_targets, make_context_kv_inputs, make_tree

DEV = "cuda"


def attention(dtype, d, ctx_lens, window=-1, causal=False, hq=8, hkv=2, block=16, width=None,
              unaligned=False):  # fmt: skip
    bs = len(ctx_lens)
    n = bs * block
    n_slots = sum(ctx_lens) + 8
    width = width or max(ctx_lens) + 2

    def rnd(*shape):
        return torch.randn(*shape, device=DEV).to(dtype)

    q = rnd(n, hq, d + 1)[..., 1:] if unaligned else rnd(n, hq, d)
    kb, vb = rnd(n, hkv, d), rnd(n, hkv, d)
    kc, vc = rnd(n_slots, hkv, d), rnd(n_slots, hkv, d)
    table = torch.randint(0, n_slots, (bs, width), device=DEV, dtype=torch.int32)
    pools = torch.arange(bs, device=DEV)
    lens = torch.tensor(ctx_lens, device=DEV)
    out = ops.block_attention(q, kb, vb, kc, vc, table, pools, lens, block, window=window,
                              causal_block=causal)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


def verify(dtype, vocab, temperature, top_k, top_p, bs=2, block=4, scale=3.0, offset=0):
    full = torch.randn(bs * block, vocab + offset, device=DEV) * scale
    logits = full[:, offset:].to(dtype) if offset else full.to(dtype)
    cand = torch.randint(0, vocab, (bs, block), device=DEV)
    out = ops.verify_block(
        cand, logits, torch.full((bs,), temperature, device=DEV),
        torch.full((bs,), top_k, dtype=torch.int32, device=DEV),
        torch.full((bs,), top_p, device=DEV), 3, torch.arange(bs, device=DEV),
    )  # fmt: skip
    torch.cuda.synchronize()
    assert int(out[0].min()) >= 0


def gumbel(dtype, rows, n, with_ids):
    scores = torch.randn(rows, n, device=DEV).to(dtype)
    ids = torch.randperm(3 * n, device=DEV)[:n] if with_ids else None
    offsets = torch.randint(0, 1 << 40, (rows,), device=DEV)
    out = ops.gumbel_argmax(scores, ids, 5, offsets, torch.randint(0, 16, (rows,), device=DEV))
    torch.cuda.synchronize()
    assert int(out.min()) >= 0 and int(out.max()) < n


def context_kv(dtype, pool_dtype, head_dim, rotary_dim, is_neox=True, pad=0):
    """Two layers; two rows skipped (out_loc -1), pools strided when pad > 0."""
    args = make_context_kv_inputs(9, 64, 2, 2, head_dim, rotary_dim, dtype, pool_dtype, seed=0, skip=2,
                                  is_neox=is_neox, pad=pad)

    def move(v):  # pools keep their padded layout: views of a moved base
        if isinstance(v, list):
            return [move(t) for t in v]
        if not isinstance(v, torch.Tensor):
            return v
        base = v._base if v._base is not None else v
        return base.to(DEV).as_strided(v.shape, v.stride(), v.storage_offset())

    ops.materialize_context_kv(**{name: move(v) for name, v in args.items()})
    torch.cuda.synchronize()


def main() -> None:
    small = "--small" in sys.argv
    # block attention: tensor-core path (with and without split), generic path, masks.
    attention(torch.bfloat16, 128, [300])  # split + merge
    attention(torch.float16, 64, [0, 40], window=5, causal=True)
    attention(torch.bfloat16, 256, [70, 3], hq=4, hkv=4)
    attention(torch.float32, 80, [50, 9], window=20)  # generic kernel
    attention(torch.bfloat16, 128, [33], unaligned=True)  # generic kernel, unaligned rows
    if not small:
        attention(torch.bfloat16, 128, [40] * 40, hq=32, hkv=8)  # no split
    # verify: greedy, temperature, shared-memory top-k/top-p, global fallback, unaligned rows.
    verify(torch.float32, 1000, 0.0, 0, 1.0)
    verify(torch.bfloat16, 5000, 1.0, 0, 1.0)
    verify(torch.float32, 20000, 0.7, 20, 0.9)
    verify(torch.float16, 20000, 1.0, 0, 0.99, scale=0.1)  # top-p over the whole row
    verify(torch.bfloat16, 3001, 0.9, 10, 1.0, offset=1)
    if not small:
        verify(torch.float32, 12000, 0.9, 5000, 1.0)  # top-k above the shared capacity
    ids = torch.randint(0, 9, (3, 5), device=DEV, dtype=torch.int32)
    ops.verify_block_from_ids(torch.randint(0, 9, (3, 5), device=DEV), ids)
    # verify_tree_from_ids: padded trees whose drafts often follow the target (deep walks).
    gen = torch.Generator().manual_seed(0)
    tokens, parents, depths = make_tree(6, 30, 12, gen)
    target = torch.randint(0, 12, (6, 30), generator=gen)
    tokens = follow_targets(tokens, parents, target, gen)
    ops.verify_tree_from_ids(*(t.to(DEV) for t in (tokens, parents, depths, target)))
    torch.cuda.synchronize()
    # gumbel_argmax: with and without ids, a row longer than one block's pass.
    gumbel(torch.float32, 3, 1000, True)
    gumbel(torch.bfloat16, 2, 40000, False)
    # materialize_context_kv: neox and interleaved RoPE, partial rotary, strided pools. Not under
    # racecheck (--small): its projection is a cuBLAS call, and on the H200 (driver 580.159.04,
    # CUDA 13.0) racecheck fails with a hardware exception on a bare bf16 F.linear of these shapes
    # with no kernel of ours in the process (2026-12-04); memcheck covers these calls.
    if not small:
        context_kv(torch.bfloat16, torch.bfloat16, 128, 128)
        context_kv(torch.float32, torch.float16, 64, 32, is_neox=False, pad=3)
    print("sanitize_kernels: all calls completed")


if __name__ == "__main__":
    main()
