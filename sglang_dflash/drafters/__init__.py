"""Drafters that ship inside the package (z-lab format, each with a model card README.md),
addressable by name wherever a draft checkpoint directory is accepted."""

from __future__ import annotations

from pathlib import Path

SHIPPED_DRAFTER = "smollm2-135m-dflash-b8"  # for the packaged smollm2-135m target: code and math
SHIPPED_DRAFTERS = {name: Path(__file__).parent / name for name in (SHIPPED_DRAFTER,)}
# What a drafter's weights may run in (engine.load_drafter): int8 is weight-only (bf16 activations);
# auto is int8 on the CPU and bfloat16 elsewhere.
DRAFT_DTYPES = ("auto", "bfloat16", "float32", "int8")


def resolve_draft(name_or_dir: str | Path) -> Path:
    """The directory of a shipped drafter by name, else the path itself."""
    return SHIPPED_DRAFTERS.get(str(name_or_dir), Path(name_or_dir))
