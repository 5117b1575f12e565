"""What an adaptive generator learned, kept on disk between processes of one machine.

The adaptive controller (control/) learns step times and draft acceptance online, and a fresh one
must first try sizes and trees it may not want: a short call (one CLI run of a hundred tokens)
spends most of its steps learning, and ends slower than a well-chosen fixed block size. What it
learns holds for the next run with the same target, drafter, options and machine, so
`sglang-dflash generate --adaptive` saves the controller after each run and the next run starts
from it (it keeps learning: step times drift and acceptance follows the text).

A state belongs to one configuration: the machine (CPU model or GPU name, torch threads), the
target (its config, weight dtype and device), the drafter (its config, weight dtypes and a
fingerprint of its weights), the block size and the tree options, and this package's version.
Each configuration has its own file under the package cache (engine/packaged.py), named by a hash
of all of that; a file that cannot be read, or was written by another version of the controller,
is ignored and replaced. Writes go to a temporary file renamed into place, so concurrent runs never
read a torn file (the last one to finish wins).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import pickle
import platform
import tempfile
from pathlib import Path

import torch

from sglang_dflash import __version__
from sglang_dflash.control.chain_or_tree import ChainOrTreeController

# Bump when the controllers' attributes change meaning: older files are then ignored.
STATE_VERSION = 1


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"


def _weights_fingerprint(module: torch.nn.Module) -> list[float]:
    """A cheap fingerprint of a module's weights (a retrained drafter accepts other drafts): the
    sums of its first 64 parameters."""
    with torch.no_grad():
        return [round(float(p.detach().float().sum()), 3) for p in itertools.islice(module.parameters(), 64)]


def configuration(target, drafter, block_size: int, tree_budget: int, tree_topk: int,
                  tree_min_prob: float) -> dict:
    """Everything a learned state depends on, as plain JSON values (what a saved file holds, so
    the two compare equal)."""
    draft_model = drafter.model
    config = {
        "state_version": STATE_VERSION,
        "package": __version__,
        "machine": _machine(target.device),
        "target": {"config": target.model.config.to_dict(), "dtype": str(target.lm_head_weight.dtype),
                   "device": target.device.type},
        "drafter": {"config": draft_model.config.to_dict(),
                    "dtypes": sorted({str(p.dtype) for p in draft_model.parameters()}),
                    "head_dtype": str(drafter.lm_head_weight.dtype),
                    "weights": _weights_fingerprint(draft_model)},
        "block_size": block_size,
        "trees": {"budget": tree_budget, "topk": tree_topk, "min_prob": tree_min_prob} if tree_budget else None,
    }
    return json.loads(json.dumps(config, default=str))  # e.g. a config's torch dtype, as its name


def state_path(config: dict, cache_dir: str | Path) -> Path:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir) / "adaptive" / f"{digest}.pkl"


def load(path: Path, config: dict) -> ChainOrTreeController | None:
    """The controller saved at `path` for `config`; None when there is none (or it is unusable)."""
    try:
        with open(path, "rb") as f:
            saved = pickle.load(f)
    except Exception:  # noqa: BLE001 - a missing, torn, foreign or stale file is ignored (and replaced)
        return None
    if (not isinstance(saved, dict) or saved.get("config") != config
            or not isinstance(saved.get("controller"), ChainOrTreeController)):
        return None
    return saved["controller"]


def save(path: Path, config: dict, controller: ChainOrTreeController) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": config, "controller": controller}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(payload, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
