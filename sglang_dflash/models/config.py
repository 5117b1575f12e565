"""DFlashConfig: the draft model's configuration, parsed from z-lab `config.json` files.

Both published schemas are accepted (DESIGN.md section 1, dflash-reference.md 1.2):
  - v1: `block_size` and `rope_theta` at top level, `num_target_layers` at top level;
  - v2: `dflash_config.block_size`, `rope_parameters.rope_theta`, `layer_types` + `sliding_window`,
    `dflash_config.causal`.
Inconsistent files are rejected with a ValueError that names the offending field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config field is missing, malformed or inconsistent; the message names the field."""


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """z-lab's rule: K ids evenly spaced over [1, L-3], rounded (K == 1: the middle layer)."""
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_taps - 1))) for i in range(num_taps)]


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    causal: bool = False
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        positive = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "block_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"dflash_config.mask_token_id ({self.mask_token_id}) must be in [0, vocab_size="
                f"{self.vocab_size})")
        if not self.target_layer_ids or any(i < 0 for i in self.target_layer_ids):
            raise ConfigError(f"dflash_config.target_layer_ids must be non-negative layer ids, "
                              f"got {list(self.target_layer_ids)}")
        if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
            raise ConfigError(
                f"dflash_config.target_layer_ids {list(self.target_layer_ids)} out of range for "
                f"num_target_layers={self.num_target_layers}")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError(f"layer_types has {len(self.layer_types)} entries, expected "
                                  f"num_hidden_layers={self.num_hidden_layers}")
            unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
            if unknown:
                raise ConfigError(f"layer_types has unknown entries {sorted(unknown)}")
            if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) >= 1:
                raise ConfigError("sliding_window must be >= 1 when layer_types has sliding_attention")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def layer_window(self, layer: int) -> int:
        """Sliding window of draft layer `layer` for `block_attention` (-1: full attention)."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return int(self.sliding_window)
        return -1

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DFlashConfig:
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ConfigError("dflash_config must be a JSON object")

        def pick(name: str, default: Any = None) -> Any:
            """A field that may live at top level or in dflash_config; both must agree."""
            top, nested = raw.get(name), dflash.get(name)
            if top is not None and nested is not None and top != nested:
                raise ConfigError(f"{name} is {top!r} at top level but {nested!r} in dflash_config")
            return nested if nested is not None else (top if top is not None else default)

        def require(name: str) -> Any:
            if raw.get(name) is None:
                raise ConfigError(f"config.json is missing the field {name!r}")
            return raw[name]

        block_size = pick("block_size")
        if block_size is None:
            raise ConfigError("config.json has no block_size (top level or dflash_config.block_size)")
        mask_token_id = pick("mask_token_id")
        if mask_token_id is None:
            raise ConfigError("config.json has no dflash_config.mask_token_id")

        rope_theta = raw.get("rope_theta")
        rope_parameters = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_parameters.rope_type {rope_type!r} is not supported (only 'default')")
        nested_theta = rope_parameters.get("rope_theta")
        if rope_theta is not None and nested_theta is not None and rope_theta != nested_theta:
            raise ConfigError(f"rope_theta is {rope_theta} but rope_parameters.rope_theta is {nested_theta}")
        rope_theta = nested_theta if nested_theta is not None else (rope_theta or 10000.0)

        num_layers = require("num_hidden_layers")
        num_target_layers = pick("num_target_layers")
        layer_ids = pick("target_layer_ids")
        if layer_ids is None:
            if num_target_layers is None:
                raise ConfigError("config.json needs dflash_config.target_layer_ids or num_target_layers")
            layer_ids = default_target_layer_ids(num_target_layers, num_layers)

        hidden = require("hidden_size")
        heads = require("num_attention_heads")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        return cls(
            hidden_size=hidden,
            intermediate_size=require("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            vocab_size=require("vocab_size"),
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=tuple(layer_ids),
            num_target_layers=num_target_layers,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            attention_bias=bool(raw.get("attention_bias", False)),
            layer_types=tuple(raw.get("layer_types") or ()),
            sliding_window=raw.get("sliding_window"),
            causal=bool(dflash.get("causal", False)),
            output_multiplier=raw.get("output_multiplier"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> DFlashConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"draft checkpoint config not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """The z-lab config.json, readable by both schemas' readers (block_size in both places)."""
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "block_size": self.block_size,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "causal": self.causal,
            },
        }
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.layer_types:
            out["layer_types"] = list(self.layer_types)
            out["sliding_window"] = self.sliding_window
        for name in ("output_multiplier", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out
