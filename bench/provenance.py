"""How a benchmark result was made, for its JSON: command line, code version, weights, software,
machine, load. `run_info(weights)` collects it; call it when the run starts (the load average
is the machine's state before the benchmark loads it)."""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "transformers", "sglang", "sglang-dflash")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def weights_sha256(path: Path) -> dict[str, str]:
    """sha256 of a weights file, or of each *.safetensors file of a model directory (by name)."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    return {f.name: sha256_file(f) for f in files}


def git_state() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout

    # Not stripped: a porcelain line is "XY path", and X is a space for a file changed but not staged.
    changed = [line[3:] for line in git("status", "--porcelain").splitlines() if line]
    return {"commit": git("rev-parse", "HEAD").strip() or None, "dirty": bool(changed), "changed_files": changed}


def versions() -> dict[str, str | None]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def threads() -> dict:
    import torch

    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "torch_num_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count()}


def run_info(weights: dict[str, Path]) -> dict:
    """Provenance of a run; `weights` names the weight files (or model directories) it used."""
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "git": git_state(),
        "weights_sha256": {name: weights_sha256(path) for name, path in weights.items()},
        "versions": {"python": platform.python_version(), **versions()},
        "cpu": cpu_model(),
        "threads": threads(),
        "load_average": os.getloadavg(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
