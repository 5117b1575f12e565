"""Warm calls of one of our CUDA kernels to profile with Nsight Compute (gpu_check's profile stage).

Timings alone do not say why a kernel is slow. This runs one op at the kernel benchmark's shapes
`--calls` times, so that

    ncu --kernel-name regex:block_attention --launch-skip 2 --launch-count 1 \\
        python -m bench.gpu.profile_kernels --op block_attention

reads the counters of one warm call: DRAM throughput, achieved occupancy, what limits it, and the
warps' stall reasons. Ops:
  block_attention     Hq 32, Hkv 8, D 128, block 16, bf16, context slots scattered over a shared pool
  verify_top_k_top_p  verify_block at T 0.7, top-k 20, top-p 0.95, V 151936, block 16, fp32 logits
"""

from __future__ import annotations

import argparse

import torch

from bench.bench_kernels import ATTN_SHAPE, VERIFY_BLOCK, VERIFY_MODES, VOCAB
from sglang_dflash import ops


def block_attention_call(bs: int, ctx: int, dev: torch.device):
    hq, hkv, d, block = (ATTN_SHAPE[k] for k in ("hq", "hkv", "head_dim", "block"))
    dtype = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    n_slots = 2 * bs * ctx
    k_cache = torch.randn(n_slots, hkv, d, device=dev, dtype=dtype, generator=g)
    v_cache = torch.randn(n_slots, hkv, d, device=dev, dtype=dtype, generator=g)
    q = torch.randn(bs * block, hq, d, device=dev, dtype=dtype, generator=g)
    k_block = torch.randn(bs * block, hkv, d, device=dev, dtype=dtype, generator=g)
    v_block = torch.randn(bs * block, hkv, d, device=dev, dtype=dtype, generator=g)
    table = torch.zeros(bs, ctx + block, dtype=torch.int32, device=dev)
    table[:, :ctx] = torch.randperm(n_slots, device=dev, generator=g)[: bs * ctx].view(bs, ctx).int()
    pools = torch.arange(bs, dtype=torch.int32, device=dev)
    lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
    return lambda: ops.block_attention(q, k_block, v_block, k_cache, v_cache, table, pools, lens, block)


def verify_top_k_top_p_call(bs: int, dev: torch.device):
    t, k, p = VERIFY_MODES["top_k_top_p"]
    g = torch.Generator(device=dev).manual_seed(1)
    logits = torch.randn(bs * VERIFY_BLOCK, VOCAB, device=dev, generator=g) * 4
    candidates = torch.randint(0, VOCAB, (bs, VERIFY_BLOCK), device=dev, generator=g)
    temperature = torch.full((bs,), t, device=dev)
    top_k = torch.full((bs,), k, dtype=torch.int32, device=dev)
    top_p = torch.full((bs,), p, device=dev)
    offsets = torch.arange(bs, dtype=torch.int64, device=dev)
    return lambda: ops.verify_block(candidates, logits, temperature, top_k, top_p, 7, offsets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=("block_attention", "verify_top_k_top_p"), default="block_attention")
    parser.add_argument("--bs", type=int, default=None, help="batch (default 8 for attention, 32 for verify)")
    parser.add_argument("--ctx", type=int, default=16384, help="context length (attention)")
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_kernels: no CUDA device")
    dev = torch.device("cuda")
    if args.op == "block_attention":
        call = block_attention_call(args.bs or 8, args.ctx, dev)
    else:
        call = verify_top_k_top_p_call(args.bs or 32, dev)
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    ops.check_device_errors(dev)
    print(f"profile_kernels: {args.calls} calls of {args.op}")


if __name__ == "__main__":
    main()
