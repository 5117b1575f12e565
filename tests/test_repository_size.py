"""The repository travels: a GPU machine accepts a working tree of at most 64 MiB, and we keep the
tracked tree well under that (40 MiB) so a checkout with build outputs ignored still fits."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 40 * 2**20


def tracked_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    return [ROOT / name for name in listed.stdout.split("\0") if name]


def test_tracked_tree_is_at_most_40_mib():
    sizes = {path: path.stat().st_size for path in tracked_files() if path.is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda item: -item[1])[:5]
    assert total <= LIMIT_BYTES, (
        f"tracked tree is {total / 2**20:.1f} MiB, over the {LIMIT_BYTES // 2**20} MiB limit; largest: "
        + ", ".join(f"{p.relative_to(ROOT)} ({s / 2**20:.1f} MiB)" for p, s in largest))
