"""Smoke test of every CUDA op, for the first minutes on a GPU: each op in its own process with
CUDA_LAUNCH_BLOCKING=1 (a faulting kernel is named at its launch and cannot take the other ops'
results with it), on small inputs, compared with the pure-PyTorch reference on the CPU.

    python -m bench.gpu.smoke [--out smoke.json] [--device cuda] [--timeout 60] [--ops verify_block ...]

The comparisons are the start-up self-test's (sglang_dflash/ops/self_test.py): the same inputs and
tolerances, for the configurations a GPU server runs (listed in CASES). Prints one line per case
with the largest difference from the reference; writes every result to --out. Exit status 0 when
every case of every op passed. `--device cpu` runs the same on the CPU kernels (to test this script).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.provenance import run_info
from sglang_dflash.ops import self_test
from sglang_dflash.ops.self_test import Attention, ContextKV

ROOT = Path(__file__).resolve().parents[2]  # the repository: where `-m bench.gpu.smoke` resolves

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# What a GPU server runs: Qwen3-8B's drafter (Hq 32, Hkv 8, D 128, B 16, bf16) and the other head
# sizes and dtypes the kernels have separate code paths for (tensor-core D 64/128/256, the SIMT
# kernel for fp32 and odd D, sliding-window causal blocks, B = 1 of the adaptive block size).
CASES = {
    "verify_block": [FP32, BF16, FP16],
    "verify_block_from_ids": [torch.int32, torch.int64],
    "verify_tree_from_ids": [torch.int32, torch.int64],
    "gumbel_argmax": [FP32, BF16, FP16],
    "block_attention": [
        Attention(32, 8, 128, BF16, 16), Attention(32, 8, 128, FP16, 16), Attention(32, 8, 128, BF16, 1),
        Attention(16, 2, 64, BF16, 8, window=64, causal_block=True), Attention(8, 8, 256, FP16, 16),
        Attention(32, 8, 128, FP32, 16), Attention(8, 2, 80, BF16, 4),
    ],
    "materialize_context_kv": [
        ContextKV(4096, 8, 128, 128, BF16, BF16, FP32, False, True),
        ContextKV(2048, 2, 64, 32, FP16, FP16, BF16, True, False),
        ContextKV(1024, 4, 128, 64, FP32, BF16, FP32, False, True),
    ],
}


def _differences(got, want) -> list[float]:
    """Largest |got - want| of each tensor pair (float outputs), or how many elements differ (ids)."""
    pairs = zip(got, want, strict=False) if isinstance(got, (list, tuple)) else [(got, want)]
    out = []
    for g, w in pairs:
        g = g.cpu()
        if g.shape != w.shape or g.numel() == 0:
            continue
        if g.is_floating_point():
            out.append(float((g.double() - w.double()).abs().nan_to_num(float("inf")).max()))
        else:
            out.append(float((g != w).sum()))
    return out


def run_op(op: str, device: str) -> dict:
    """Every case of `op` through self_test.check, recording how far each result is from the
    reference (the self-test itself only says pass or fail: its two comparisons are wrapped)."""
    seen: list[float] = []
    for name in ("_exact", "_close"):
        compare = getattr(self_test, name)

        def recording(got, want, *rest, _compare=compare):
            seen.extend(_differences(got, want))
            return _compare(got, want, *rest)

        setattr(self_test, name, recording)
    exact = op in ("verify_block", "verify_block_from_ids", "verify_tree_from_ids", "gumbel_argmax")
    cases = []
    for case in CASES[op]:
        seen.clear()
        start = time.perf_counter()
        problem = self_test.check(op, device, case)
        result = dict(case=str(case), passed=problem is None, problem=problem,
                      seconds=round(time.perf_counter() - start, 3))
        if seen:
            result["differing_elements" if exact else "max_abs_error"] = int(max(seen)) if exact else max(seen)
        cases.append(result)
        if not seen:
            measure = ""
        else:
            measure = f", {max(seen):.0f} elements differ" if exact else f", max |err| {max(seen):.3g}"
        print(f"{op} {case}: {'ok' if problem is None else 'FAILED: ' + problem}{measure}", flush=True)
    return dict(op=op, passed=all(c["passed"] for c in cases), cases=cases)


def run_child(op: str, device: str, timeout: float) -> dict:
    """`op` in its own process (a kernel fault or hang ends that process only)."""
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    command = [sys.executable, "-m", "bench.gpu.smoke", "--child", op, "--device", device]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:  # its output comes as bytes whatever `text` says
        output = (exc.stdout or b"").decode(errors="replace")
        return dict(op=op, passed=False, problem=f"timed out after {timeout:.0f} s", output=output[-4000:])
    lines = done.stdout.splitlines()
    result = next((json.loads(line.removeprefix("RESULT ")) for line in lines if line.startswith("RESULT ")), None)
    printed = "\n".join(line for line in lines if not line.startswith("RESULT "))
    if result is None or done.returncode != 0:
        tail = (printed + "\n" + done.stderr).strip()[-4000:]
        result = dict(op=op, passed=False, problem=f"process exited with status {done.returncode}", output=tail)
    result["process_seconds"] = round(time.perf_counter() - start, 2)
    result["printed"] = printed
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON file for the results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per op's process")
    parser.add_argument("--ops", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--child", choices=list(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            sys.exit("gpu_smoke: torch sees no CUDA GPU")
        print("RESULT " + json.dumps(run_op(args.child, args.device)), flush=True)
        return 0

    # The ops' processes run side by side: each spends most of its time importing torch.
    with concurrent.futures.ThreadPoolExecutor(len(args.ops)) as pool:
        results = list(pool.map(lambda op: run_child(op, args.device, args.timeout), args.ops))
    for r in results:
        if printed := r.pop("printed", ""):
            print(printed, flush=True)
        if "output" in r:  # the process died or hung: what it printed last
            print(f"{r['op']}: FAILED: {r['problem']}\n{r['output']}", flush=True)
    passed = all(r["passed"] for r in results)
    print(f"gpu_smoke: {sum(r['passed'] for r in results)} of {len(results)} ops passed on {args.device}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(provenance=run_info({}), device=args.device, passed=passed, ops=results), f, indent=1)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
