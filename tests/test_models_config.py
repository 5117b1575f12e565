"""DFlashConfig parsing of both z-lab schemas, the default tapped layers, and one clear error per
inconsistent field; checkpoint files that are missing, corrupt or mismatched."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from sglang_dflash.models import CheckpointError, ConfigError, DFlashConfig, default_target_layer_ids, load_draft

V1 = {  # Qwen3-4B-DFlash-b16 shape, original schema
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000, "max_position_embeddings": 40960, "block_size": 16,
    "num_target_layers": 36,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
}
V2 = {  # newer schema: block_size / rope in nested objects, sliding layers, causal flag
    "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 6,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 248320,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000},
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "sliding_window": 4096,
    "dflash_config": {"block_size": 16, "mask_token_id": 248077, "causal": True,
                      "target_layer_ids": [1, 6, 11, 16, 22, 27, 32, 37]},
}


def test_v1_schema():
    c = DFlashConfig.from_dict(V1)
    assert (c.block_size, c.mask_token_id, c.rope_theta) == (16, 151669, 1e6)
    assert c.target_layer_ids == (1, 9, 17, 25, 33) and c.num_taps == 5
    assert [c.layer_window(i) for i in range(5)] == [-1] * 5 and not c.causal


def test_v2_schema():
    c = DFlashConfig.from_dict(V2)
    assert (c.block_size, c.mask_token_id, c.rope_theta, c.causal) == (16, 248077, 1e7, True)
    assert [c.layer_window(i) for i in range(6)] == [4096] * 5 + [-1]
    assert c.num_taps == 8


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # docs/design.md §1.6
    assert default_target_layer_ids(30, 1) == [15]
    raw = copy.deepcopy(V1)
    del raw["dflash_config"]["target_layer_ids"]
    assert DFlashConfig.from_dict(raw).target_layer_ids == (1, 9, 17, 25, 33)


def _bad(edit):
    raw = copy.deepcopy(V1)
    edit(raw)
    return raw


BAD = {
    "no block_size": (lambda r: r.pop("block_size"), "block_size"),
    "block_size disagrees": (lambda r: r["dflash_config"].update(block_size=8), "block_size"),
    "no mask id": (lambda r: r["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    "mask id out of vocab": (lambda r: r["dflash_config"].update(mask_token_id=151936), "mask_token_id"),
    "heads not dividing": (lambda r: r.update(num_key_value_heads=7), "num_key_value_heads"),
    "layer id beyond target": (lambda r: r["dflash_config"].update(target_layer_ids=[1, 36]), "target_layer_ids"),
    "no layer ids, no target depth": (
        lambda r: (r["dflash_config"].pop("target_layer_ids"), r.pop("num_target_layers")), "num_target_layers"),
    "layer_types length": (lambda r: r.update(layer_types=["full_attention"] * 4), "layer_types"),
    "sliding without window": (lambda r: r.update(layer_types=["sliding_attention"] * 5), "sliding_window"),
    "rope theta disagrees": (lambda r: r.update(rope_parameters={"rope_theta": 5.0}), "rope_theta"),
    "unsupported rope": (lambda r: r.update(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
    "missing hidden size": (lambda r: r.pop("hidden_size"), "hidden_size"),
    "non-silu activation": (lambda r: r.update(hidden_act="gelu"), "hidden_act"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_names_the_field(case):
    edit, field = BAD[case]
    with pytest.raises(ConfigError, match=field):
        DFlashConfig.from_dict(_bad(edit))


SMALL = dict(V1, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, vocab_size=100, block_size=4,
             dflash_config={"mask_token_id": 99, "target_layer_ids": [1, 2]})


def _small_checkpoint(path, **replace):
    from sglang_dflash.models import DFlashDraftModel

    path.mkdir()
    (path / "config.json").write_text(json.dumps(SMALL))
    torch.manual_seed(0)
    state = {k: torch.randn_like(v) for k, v in DFlashDraftModel(DFlashConfig.from_dict(SMALL)).state_dict().items()}
    state.update(replace)
    save_file(state, path / "model.safetensors")
    return path


def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="directory not found"):
        load_draft(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config"):
        load_draft(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(SMALL))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_draft(tmp_path / "empty")
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_draft(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{broken")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_draft(tmp_path / "empty")
    # fc width must be K*H = 2*32
    with pytest.raises(CheckpointError, match=r"fc.weight has shape \[32, 96\].*target_layer_ids"):
        load_draft(_small_checkpoint(tmp_path / "wide", **{"fc.weight": torch.randn(32, 96)}))
    # a tensor missing / an unknown tensor
    ckpt = _small_checkpoint(tmp_path / "extra", **{"layers.0.mlp.extra.weight": torch.randn(3)})
    with pytest.raises(CheckpointError, match="unexpected.*layers.0.mlp.extra.weight"):
        load_draft(ckpt)
    # a shard listed in the index but absent
    ckpt = _small_checkpoint(tmp_path / "sharded")
    (ckpt / "model.safetensors").rename(ckpt / "model-1.safetensors")
    weight_map = {"fc.weight": "model-1.safetensors", "norm.weight": "model-2.safetensors"}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FileNotFoundError, match="model-2.safetensors"):
        load_draft(ckpt)
