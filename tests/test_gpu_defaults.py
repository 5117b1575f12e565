"""The GPU-default table (sglang_dflash/ops/gpu_defaults.py) says exactly what the committed kernel
benchmarks say: an op is on for a GPU class only where that class's bench_kernels result has ours
faster than the paged baseline in every case, and off where no result exists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_dflash.ops import gpu_defaults

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def committed_verdicts() -> dict[tuple[str, str], tuple[bool, str]]:
    verdicts = {}
    for path in sorted(RESULTS.glob("bench_kernels_*.json")):
        result = json.loads(path.read_text())
        if result.get("quick") or result.get("variants"):
            continue  # a quick run or a sweep is not the benchmark of record
        gpu = "sm" + result["device"]["capability"].replace(".", "")
        for op, baseline in gpu_defaults.GATED_OPS.items():
            cases = [c for c in result["cases"] if c["op"] == op and not c.get("tree")]
            if cases and baseline is not None:
                wins = all(c.get("speedup", {}).get(baseline, 0.0) > 1.0 for c in cases)
                verdicts[(gpu, op)] = (wins, f"bench/results/{path.name}")
    return verdicts


def test_the_table_equals_the_committed_benchmarks():
    assert gpu_defaults.BENCHMARKED_WINS == committed_verdicts()


def test_default_on_says_why():
    on, why = gpu_defaults.default_on("block_attention", "sm90")
    assert not on and "slower than triton_split_kv" in why and "bench_kernels_h200.json" in why
    on, why = gpu_defaults.default_on("materialize_context_kv", "sm90")
    assert not on and why == "no committed kernel benchmark of materialize_context_kv on sm90"
    with pytest.raises(ValueError, match="'verify_block' is not a gated GPU op"):
        gpu_defaults.default_on("verify_block", "sm90")
