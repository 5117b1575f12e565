"""Load and save DFlash drafters in z-lab's format: `config.json` + `model.safetensors`
(or shards listed in `model.safetensors.index.json`), tensor names as in docs/design.md §1.6.

An optional `draft_vocab.safetensors` (tensor `token_ids`: the target token ids drafts may take,
e.g. the most frequent ones in the training data) restricts the drafter's LM head to those rows,
which makes a draft step cheaper on memory-bound hardware; other readers of the format ignore it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sglang_dflash.models.config import DFlashConfig
from sglang_dflash.models.draft import DFlashDraftModel
from sglang_dflash.models.skinny import Int8Linear

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DRAFT_VOCAB_NAME = "draft_vocab.safetensors"


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
    model = model.to(device=device, dtype=dtype).eval()
    model.draft_vocab = read_draft_vocab(directory, config.vocab_size, device)
    return model


def read_draft_vocab(directory: Path, vocab_size: int, device) -> torch.Tensor | None:
    """The draft vocabulary beside a checkpoint (int64 ids), None when it has none."""
    path = Path(directory) / DRAFT_VOCAB_NAME
    if not path.exists():
        return None
    try:
        ids = load_file(path).get("token_ids")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {path}: corrupt or not a safetensors file ({e})") from None
    check_draft_vocab(ids, vocab_size, str(path))
    return ids.long().to(device)


def check_draft_vocab(ids: torch.Tensor | None, vocab_size: int, where: str) -> None:
    """A draft vocabulary is a non-empty 1-D integer tensor of distinct ids in [0, vocab_size)."""
    if ids is None or ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
        raise CheckpointError(f"{where}: token_ids must be a non-empty 1-D integer tensor, got "
                              f"{None if ids is None else (ids.dtype, tuple(ids.shape))}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise CheckpointError(f"{where}: token ids must lie in [0, {vocab_size}), got [{low}, {high}]")
    if ids.unique().numel() != ids.numel():
        raise CheckpointError(f"{where}: token ids repeat")


def save_draft_vocab(directory: str | Path, token_ids: torch.Tensor, vocab_size: int) -> Path:
    """Write the draft vocabulary (sorted) beside a checkpoint; returns its path."""
    path = Path(directory) / DRAFT_VOCAB_NAME
    check_draft_vocab(token_ids, vocab_size, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"token_ids": token_ids.long().sort().values.contiguous()}, path, metadata={"format": "pt"})
    return path


def save_draft(model: DFlashDraftModel, directory: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write `config.json` and a single `model.safetensors` (z-lab names)."""
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        raise ValueError("save_draft: this model has int8 weights (quantize_weights, for inference only); "
                         "save the float model it was quantized from")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    state = {k: (v.to(dtype) if dtype else v).contiguous() for k, v in model.state_dict().items()}
    save_file(state, directory / WEIGHTS_NAME, metadata={"format": "pt"})
    if model.draft_vocab is not None:
        save_draft_vocab(directory, model.draft_vocab.cpu(), model.config.vocab_size)
