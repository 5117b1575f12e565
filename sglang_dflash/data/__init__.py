"""Data sets shipped inside the package (no PyPI package ships them): GSM8K, MIT licence."""

from __future__ import annotations

from pathlib import Path

GSM8K_DIR = Path(__file__).resolve().parent / "gsm8k"


def gsm8k_path(split: str) -> Path:
    """The GSM8K jsonl of `split` ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"GSM8K split must be 'train' or 'test', got {split!r}")
    return GSM8K_DIR / f"{split}.jsonl"
