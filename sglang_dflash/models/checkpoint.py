"""Load and save DFlash drafters in z-lab's format: `config.json` + `model.safetensors`
(or shards listed in `model.safetensors.index.json`), tensor names as in DESIGN.md section 1."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sglang_dflash.models.config import DFlashConfig
from sglang_dflash.models.draft import DFlashDraftModel

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A draft checkpoint's files are missing, corrupt or do not match its config."""


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e!r})") from None
        files = sorted(set(weight_map.values()))
    elif (directory / WEIGHTS_NAME).exists():
        files = [WEIGHTS_NAME]
    else:
        raise FileNotFoundError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in draft checkpoint {directory}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = directory / name
        if not path.exists():
            raise FileNotFoundError(f"draft checkpoint shard missing: {path}")
        try:
            tensors.update(load_file(path))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {path}: corrupt or not a safetensors file ({e})") from None
    return tensors


def load_draft(directory: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> DFlashDraftModel:
    """Build a `DFlashDraftModel` from a z-lab checkpoint directory (either config schema)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"draft checkpoint directory not found: {directory}")
    config = DFlashConfig.from_file(directory / CONFIG_NAME)
    tensors = _read_weights(directory)
    model = DFlashDraftModel(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"draft checkpoint {directory} does not match its config: "
                              f"missing {missing[:8]}, unexpected {unexpected[:8]}")
    for name, param in expected.items():
        if tensors[name].shape != param.shape:
            hint = ""
            if name == "fc.weight":
                hint = (f" (fc maps K*H -> H with K = len(dflash_config.target_layer_ids) = "
                        f"{config.num_taps}, H = hidden_size = {config.hidden_size})")
            raise CheckpointError(f"{name} has shape {list(tensors[name].shape)}, expected "
                                  f"{list(param.shape)}{hint}")
    model.load_state_dict(tensors)
    return model.to(device=device, dtype=dtype).eval()


def save_draft(model: DFlashDraftModel, directory: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write `config.json` and a single `model.safetensors` (z-lab names)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    state = {k: (v.to(dtype) if dtype else v).contiguous() for k, v in model.state_dict().items()}
    save_file(state, directory / WEIGHTS_NAME, metadata={"format": "pt"})
