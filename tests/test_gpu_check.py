"""The GPU-window scripts, exercised where there is no GPU (or no time): bench/gpu_check.sh must end
at once with a summary saying what ran and why the rest did not, and bench/gpu/smoke.py must drive
the self-test's comparisons (here on the CPU kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["env", "build", "packaging", "index-errors", "smoke", "tests", "engine", "memcheck", "sweep", "profile",
          "racecheck", "bench"]


def test_gpu_check_out_of_budget_writes_its_summary(tmp_path):
    """20 s of budget: the environment is recorded, the build is cut (so the extension in this tree is
    left alone), and the GPU stages say why they did not run."""
    out = tmp_path / "out"
    env = dict(os.environ, GPU_CHECK_BUDGET_S="20", PYTHON=sys.executable, TMPDIR=str(tmp_path))
    proc = subprocess.run(["bash", "bench/gpu_check.sh", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # nothing was checked
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] and [s["name"] for s in summary["stages"]] == STAGES
    assert summary["passed"][0] == "env" and summary["cut"][0] == "build"
    assert summary["environment"]["cuda_available"] == torch.cuda.is_available()
    # The build was cut, so the extension already in this tree decides whether "built" stages may run.
    from sglang_dflash._extension import has_cuda_kernels

    packaging = summary["stages"][2]
    if has_cuda_kernels():
        assert packaging["status"] in ("passed", "cut"), packaging
    else:
        assert packaging["status"] == "skipped" and packaging["note"] == "the extension has no CUDA kernels (see build)"
    if not torch.cuda.is_available():
        assert all(s["status"] == "skipped" and s["note"] == "no GPU (see environment)" for s in summary["stages"][3:])
    with tarfile.open(out / "logs.tar.gz") as logs:
        assert {"./env.log", "./env.json", "./stages.tsv"} <= set(logs.getnames())
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "summary.json"]


def test_gpu_smoke_compares_each_op_with_the_reference(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu.smoke", "--device", "cpu", "--out", str(out), "--ops",
                           "verify_block_from_ids", "block_attention"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["passed"] and [op["op"] for op in result["ops"]] == ["verify_block_from_ids", "block_attention"]
    ids, attention = result["ops"]
    assert all(case["differing_elements"] == 0 for case in ids["cases"])
    assert all(case["passed"] and case["max_abs_error"] < 0.05 for case in attention["cases"])
    assert "verify_block_from_ids torch.int32: ok, 0 elements differ" in proc.stdout
