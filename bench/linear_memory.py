"""Resident memory and time of the CPU's bf16 linear layers when prefills come in every length:
torch's F.linear against `models.skinny.bounded_rows_linear` (the same GEMM in a bounded set of
row counts, what the plugin's served linear layers run).

Memory: one fresh process per variant runs SmolLM2-135M's linear shapes (q/k/v/o, gate/up, down)
at --lengths distinct row counts (17 up to --max-rows, shuffled; a prefill of each length), one
torch thread, and samples its resident memory (VmRSS) along the way.

Time: both variants in lock-step rounds at a few prefill lengths (median ms per call of all the
shapes; the padded rows are the cost of bounding).

Writes bench/results/linear_memory_cpu.json (provenance: bench/provenance.py).

    python -m bench.linear_memory [--lengths 600] [--max-rows 2048] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bench.provenance import run_info
from sglang_dflash.models.skinny import GEMM_MIN_ROWS, bounded_rows_linear, gemm_rows

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M's linear layers as (out features, in features): q/o, k/v, gate/up, down.
SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))
VARIANTS = {"F.linear": F.linear, "bounded_rows_linear": bounded_rows_linear}
TIMED_ROWS = (17, 40, 100, 300, 700, 2000)


def resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def grow(variant: str, lengths: int, max_rows: int, samples: int = 12) -> dict:
    """In this process: every shape at `lengths` distinct row counts; resident MB growth sampled
    `samples` times, from the state after one warm-up call per shape."""
    torch.set_num_threads(1)
    linear = VARIANTS[variant]
    weights = [torch.randn(n, k).bfloat16() for n, k in SHAPES]
    for w in weights:
        linear(torch.randn(17, w.shape[1]).bfloat16(), w)
    rows = random.Random(0).sample(range(17, max_rows + 1), lengths)
    start, marks = resident_mb(), []
    for i, m in enumerate(rows, 1):
        for w in weights:
            linear(torch.randn(m, w.shape[1]).bfloat16(), w)
        if i % max(1, lengths // samples) == 0 or i == lengths:
            marks.append({"lengths": i, "growth_mb": round(resident_mb() - start, 1)})
    return {"start_mb": round(start, 1), "samples": marks}


def grow_in_fresh_process(variant: str, lengths: int, max_rows: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.linear_memory", "--child", variant, "--lengths", str(lengths),
                          "--max-rows", str(max_rows)], capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def timings(rounds: int) -> list[dict]:
    """Median ms per call over all SHAPES, both variants alternating within each round."""
    weights = [torch.randn(n, k).bfloat16() for n, k in SHAPES]
    cases = []
    for m in tqdm(TIMED_ROWS, desc="time", unit="length"):
        xs = [torch.randn(m, w.shape[1]).bfloat16() for w in weights]
        per = {name: [] for name in VARIANTS}
        for _ in range(rounds):
            for name, linear in VARIANTS.items():
                for x, w in zip(xs, weights, strict=True):
                    linear(x, w)  # warm: each variant's GEMM shapes are built before timing
                t0 = time.perf_counter()
                for _ in range(3):
                    for x, w in zip(xs, weights, strict=True):
                        linear(x, w)
                per[name].append((time.perf_counter() - t0) / 3 * 1e3)
        ms = {name: round(statistics.median(v), 3) for name, v in per.items()}
        ratios = [a / b for a, b in zip(per["F.linear"], per["bounded_rows_linear"], strict=True)]
        cases.append({"rows": m, "ms": ms, "f_linear_over_bounded": round(statistics.median(ratios), 3)})
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, default=600, help="distinct prefill lengths per variant")
    parser.add_argument("--max-rows", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "linear_memory_cpu.json")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(grow(args.child, args.lengths, args.max_rows)))
        return
    info = run_info({})
    memory = {name: grow_in_fresh_process(name, args.lengths, args.max_rows)
              for name in tqdm(VARIANTS, desc="memory", unit="variant")}
    counts = sorted({gemm_rows(m) for m in range(GEMM_MIN_ROWS, args.max_rows + 1)})
    result = {"provenance": info,
              "setup": {"shapes": SHAPES, "lengths": args.lengths, "max_rows": args.max_rows, "rounds": args.rounds,
                        "dtype": "bfloat16", "memory_threads": 1, "gemm_row_counts": counts},
              "memory": memory, "time": timings(args.rounds)}
    args.out.write_text(json.dumps(result, indent=1))
    for name, m in memory.items():
        print(f"{name}: +{m['samples'][-1]['growth_mb']} MB over {args.lengths} lengths")
    for case in result["time"]:
        print(f"{case['rows']:5d} rows: F.linear / bounded_rows_linear {case['f_linear_over_bounded']:.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
