"""One block_attention call to profile with Nsight Compute (gpu_check's profile stage).

The first GPU run measured our CUDA block_attention at <= 0.28 of HBM bandwidth and 0.51-0.81x a
plain Triton split-KV kernel (bench/results/bench_kernels_h200.json); timings alone do not say
why. This runs the benchmark's shape (Hq 32, Hkv 8, D 128, block 16, bf16, context slots scattered
over a shared pool) `--calls` times, so that

    ncu --kernel-name regex:block_attention_mma --launch-skip 2 --launch-count 1 \\
        python bench/profile_block_attention.py

reads the counters of one warm call: DRAM throughput, achieved occupancy, what limits it, and the
warps' stall reasons.
"""

from __future__ import annotations

import argparse

import torch

from bench.bench_kernels import ATTN_SHAPE
from sglang_dflash import ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bs", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=16384)
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_block_attention: no CUDA device")
    hq, hkv, d, block = (ATTN_SHAPE[k] for k in ("hq", "hkv", "head_dim", "block"))
    dtype, dev = torch.bfloat16, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n_slots = 2 * args.bs * args.ctx
    k_cache = torch.randn(n_slots, hkv, d, device=dev, dtype=dtype, generator=g)
    v_cache = torch.randn(n_slots, hkv, d, device=dev, dtype=dtype, generator=g)
    q = torch.randn(args.bs * block, hq, d, device=dev, dtype=dtype, generator=g)
    k_block = torch.randn(args.bs * block, hkv, d, device=dev, dtype=dtype, generator=g)
    v_block = torch.randn(args.bs * block, hkv, d, device=dev, dtype=dtype, generator=g)
    table = torch.zeros(args.bs, args.ctx + block, dtype=torch.int32, device=dev)
    table[:, : args.ctx] = torch.randperm(n_slots, device=dev, generator=g)[: args.bs * args.ctx].view(
        args.bs, args.ctx).int()
    pools = torch.arange(args.bs, dtype=torch.int32, device=dev)
    lens = torch.full((args.bs,), args.ctx, dtype=torch.int32, device=dev)
    for _ in range(args.calls):
        out = ops.block_attention(q, k_block, v_block, k_cache, v_cache, table, pools, lens, block)
    torch.cuda.synchronize()
    ops.check_device_errors(dev)
    print(f"profile_block_attention: {args.calls} calls, bs {args.bs}, ctx {args.ctx}, out {tuple(out.shape)}")


if __name__ == "__main__":
    main()
