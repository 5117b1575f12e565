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


def test_the_served_drafter_follows_the_table_unless_the_switch_forces_it(monkeypatch):
    """serving.attention.gpu_choice on a CUDA device (named only: no GPU here, the device's class is
    given): the committed verdict by default, SGLANG_DFLASH_DRAFT_ATTENTION=0/1 forcing both ops."""
    import torch

    from sglang_dflash.ops import variants
    from sglang_dflash.serving import attention

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(variants, "gpu_class", lambda device: "sm90")
    monkeypatch.delenv("SGLANG_DFLASH_DRAFT_ATTENTION", raising=False)
    assert attention.gpu_choice("block_attention", cuda) == gpu_defaults.default_on("block_attention", "sm90")
    assert not attention.draft_attention_wanted(cuda) and attention.draft_attention_wanted(torch.device("cpu"))
    monkeypatch.setitem(gpu_defaults.BENCHMARKED_WINS, ("sm90", "block_attention"), (True, "a result"))
    assert attention.draft_attention_wanted(cuda)
    monkeypatch.setenv("SGLANG_DFLASH_DRAFT_ATTENTION", "0")
    assert attention.gpu_choice("block_attention", cuda) == (False, "SGLANG_DFLASH_DRAFT_ATTENTION=0")
    monkeypatch.setenv("SGLANG_DFLASH_DRAFT_ATTENTION", "1")
    assert attention.gpu_choice("materialize_context_kv", cuda) == (True, "SGLANG_DFLASH_DRAFT_ATTENTION=1")
