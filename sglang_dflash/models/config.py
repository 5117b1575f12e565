"""DFlashConfig: the draft model's configuration, parsed from z-lab `config.json` files.

Both published schemas are accepted:
  - v1: `block_size` and `rope_theta` at top level, `num_target_layers` at top level;
  - v2: `dflash_config.block_size`, `rope_parameters.rope_theta`, `layer_types` + `sliding_window`,
    `dflash_config.causal`.
and the drafter variants SGLang's DFLASH model reads from the same files (field names as there):
  - DFlash-2 (`architectures` DFlash2DraftModel and its aliases): a grouped dynamic convolution
    over the block around each sublayer (`dflash_config.conv_kernel_size` taps,
    `dflash_config.conv_group_size` channels per group; it may also come without the selector)
    and a low-rank path selector over the `dflash_config.selector_top_k` best tokens per position
    (`dflash_config.selector_rank`);
  - `use_gemma_norm` (norms scale by 1 + weight), partial rotary (`partial_rotary_factor`, or
    `rope_scaling.rope_dim` / `rope_parameters.rope_dim`, which wins), interleaved rotary
    (`rope_is_neox_style` / `is_neox_style` false), `dflash_config.attention_value_scale`,
    `is_causal`, and the unary logit scaling `dflash_config.output_multiplier` /
    `dflash_config.final_logit_softcapping`.
Every field is either read, known to leave the draft's maths alone (Hugging Face bookkeeping), or
rejected: a file with a field outside those sets, or a variant this package does not run (Domino
projectors, attention sinks, Laguna gating, LiLiCorr heads, checkpoint-own embeddings), is refused
with a ConfigError that names the field, never loaded with the field ignored.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config field is missing, malformed, inconsistent or unsupported; the message names the field."""


# `architectures` entries SGLang's DFLASH model registers, by what they build here.
DFLASH1_ARCHITECTURES = ("DFlashDraftModel", "MuseGlimmerAssistantModel")
DFLASH2_ARCHITECTURES = ("DFlash2DraftModel", "DFlash2BeamDraftModel", "MiniMaxDFlash2DraftModel")

# Top-level fields from_dict reads.
_READ_FIELDS = frozenset({
    "architectures", "model_type", "hidden_act", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta",
    "rope_parameters", "rope_scaling", "max_position_embeddings", "attention_bias", "block_size",
    "num_target_layers", "target_layer_ids", "mask_token_id", "layer_types", "sliding_window",
    "output_multiplier", "final_logit_softcapping", "use_gemma_norm", "partial_rotary_factor",
    "rope_is_neox_style", "is_neox_style", "is_causal", "dflash_config",
})
# Top-level fields Hugging Face configs carry that do not change a draft's maths.
_INERT_FIELDS = frozenset({
    "_name_or_path", "auto_map", "torch_dtype", "dtype", "transformers_version", "initializer_range",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "attention_dropout",
    "use_sliding_window", "max_window_layers", "mask_token",
})
# Top-level fields of variants this package does not run, allowed only at their inert value.
_UNSUPPORTED_UNLESS = {
    "has_embed_tokens": False, "has_lm_head": False, "quantization_config": None, "mlp_bias": False,
    "gating": None, "emb_dim": None, "projector_type": None,
}
# dflash_config fields from_dict reads; every other one is refused.
_DFLASH_READ_FIELDS = frozenset({
    "block_size", "mask_token_id", "mask_token", "target_layer_ids", "num_target_layers", "causal",
    "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "output_multiplier",
    "final_logit_softcapping", "attention_value_scale", "attention_sink_bias", "projector_type",
})


def _check_fields(raw: dict[str, Any], dflash: dict[str, Any]) -> None:
    """One ConfigError naming every field this package would otherwise have to ignore."""
    unknown = sorted(k for k in raw if k not in _READ_FIELDS | _INERT_FIELDS | set(_UNSUPPORTED_UNLESS))
    unknown += sorted(f"dflash_config.{k}" for k in dflash if k not in _DFLASH_READ_FIELDS)
    if unknown:
        raise ConfigError(f"config.json has fields this drafter does not support: {', '.join(unknown)} "
                          "(refused rather than ignored)")
    for name, inert in _UNSUPPORTED_UNLESS.items():
        if raw.get(name, inert) not in (inert, None):
            raise ConfigError(f"config.json field {name}={raw[name]!r} is a drafter variant this package does "
                              f"not run (supported: {name} absent or {inert!r})")
    if dflash.get("attention_sink_bias", False) is not False:
        raise ConfigError(f"dflash_config.attention_sink_bias={dflash['attention_sink_bias']!r}: attention "
                          "sinks are not supported (block_attention has no sink term)")
    if dflash.get("projector_type") is not None:
        raise ConfigError(f"dflash_config.projector_type={dflash['projector_type']!r} is not supported "
                          "(only the plain fc projector: leave projector_type out)")
    architectures = raw.get("architectures") or list(DFLASH1_ARCHITECTURES[:1])
    known = DFLASH1_ARCHITECTURES + DFLASH2_ARCHITECTURES
    if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in known:
        raise ConfigError(f"architectures={architectures!r} is not a drafter this package runs "
                          f"(one of {', '.join(known)})")


def _non_negative_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """z-lab's rule: K ids evenly spaced over [1, L-3], rounded (K == 1: the middle layer)."""
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_taps - 1))) for i in range(num_taps)]


_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "rope_dim", "partial_rotary_factor"})
_ROPE_KEYS_SUPERSEDED_BY_ROPE_DIM = frozenset({"mrope_section", "mrope_interleaved"})


def _rope(raw: dict[str, Any], head_dim: int) -> tuple[float, Any]:
    """(rope_theta, rotary dim) from `rope_theta`, `rope_parameters` / `rope_scaling` and
    `partial_rotary_factor`. An explicit `rope_dim` is the trained rotary width and overrides the
    partial factor (and any M-RoPE fields copied from the target: drafts see 1-D positions)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters / rope_scaling must be a JSON object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope_parameters.rope_type {rope_type!r} is not supported (only 'default')")
    allowed = _ROPE_KEYS | (_ROPE_KEYS_SUPERSEDED_BY_ROPE_DIM if "rope_dim" in params else frozenset())
    extra = sorted(set(params) - allowed)
    if extra:
        raise ConfigError(f"rope_parameters fields {extra} are not supported")
    theta, nested_theta = raw.get("rope_theta"), params.get("rope_theta")
    if theta is not None and nested_theta is not None and theta != nested_theta:
        raise ConfigError(f"rope_theta is {theta} but rope_parameters.rope_theta is {nested_theta}")
    theta = nested_theta if nested_theta is not None else (theta or 10000.0)
    if "rope_dim" in params:
        return theta, params["rope_dim"]
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
    return theta, int(head_dim * factor)


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
    conv_kernel_size: int = 0  # DFlash-2 convolution taps (0: no convolution)
    conv_group_size: int = 0  # channels sharing one dynamic coefficient per tap
    selector_rank: int = 0  # DFlash-2 path selector's rank (0: no selector)
    selector_top_k: int = 0  # candidates per position the selector walks over
    use_gemma_norm: bool = False  # every RMSNorm scales by 1 + weight
    rotary_dim: int | None = None  # leading head dims RoPE rotates (None: all of head_dim)
    rope_is_neox_style: bool = True  # rotate-half pairs (i, i + r/2); False: interleaved (2i, 2i+1)
    attention_value_scale: float | None = None  # V (block and context) scaled by this

    def __post_init__(self) -> None:
        positive = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "block_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            _non_negative_int(getattr(self, name), f"dflash_config.{name}")
        if bool(self.conv_kernel_size) != bool(self.conv_group_size):
            raise ConfigError(f"dflash_config.conv_kernel_size ({self.conv_kernel_size}) and "
                              f"dflash_config.conv_group_size ({self.conv_group_size}) come together")
        if self.conv_group_size and self.hidden_size % self.conv_group_size:
            raise ConfigError(f"dflash_config.conv_group_size ({self.conv_group_size}) must divide "
                              f"hidden_size ({self.hidden_size})")
        if bool(self.selector_rank) != bool(self.selector_top_k):
            raise ConfigError(f"dflash_config.selector_rank ({self.selector_rank}) and "
                              f"dflash_config.selector_top_k ({self.selector_top_k}) come together")
        if self.selector_top_k > self.vocab_size:
            raise ConfigError(f"dflash_config.selector_top_k ({self.selector_top_k}) exceeds vocab_size "
                              f"({self.vocab_size})")
        if self.rotary_dim is not None and not (
                isinstance(self.rotary_dim, int) and 2 <= self.rotary_dim <= self.head_dim
                and self.rotary_dim % 2 == 0):
            raise ConfigError(f"rotary dimension (partial_rotary_factor or rope_dim) must be an even "
                              f"integer in [2, head_dim={self.head_dim}], got {self.rotary_dim!r}")
        if self.attention_value_scale is not None and (
                isinstance(self.attention_value_scale, bool)
                or not isinstance(self.attention_value_scale, (int, float))):
            raise ConfigError(f"dflash_config.attention_value_scale must be a number, "
                              f"got {self.attention_value_scale!r}")
        if self.output_multiplier is not None and not self.output_multiplier > 0:
            raise ConfigError(f"dflash_config.output_multiplier must be positive, got {self.output_multiplier!r}")
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

    @property
    def has_selector(self) -> bool:
        """Whether this is a DFlash-2 drafter with a path selector (built as DFlash2DraftModel)."""
        return self.selector_rank > 0

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

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
        _check_fields(raw, dflash)

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

        hidden = require("hidden_size")
        heads = require("num_attention_heads")
        head_dim = raw.get("head_dim") or hidden // heads
        rope_theta, rotary_dim = _rope(raw, head_dim)

        num_layers = require("num_hidden_layers")
        num_target_layers = pick("num_target_layers")
        layer_ids = pick("target_layer_ids")
        if layer_ids is None:
            if num_target_layers is None:
                raise ConfigError("config.json needs dflash_config.target_layer_ids or num_target_layers")
            layer_ids = default_target_layer_ids(num_target_layers, num_layers)

        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        causal = dflash.get("causal")
        if raw.get("is_causal") is not None:
            if causal is not None and bool(causal) != bool(raw["is_causal"]):
                raise ConfigError(f"is_causal is {raw['is_causal']!r} but dflash_config.causal is {causal!r}")
            causal = raw["is_causal"]
        layer_types = tuple(raw.get("layer_types") or ())
        if causal is None and "sliding_attention" in layer_types:
            # SGLang's default: sliding layers causal, full layers not; one flag covers all layers here.
            if set(layer_types) != {"sliding_attention"}:
                raise ConfigError("layer_types mixes sliding_attention and full_attention without is_causal "
                                  "(or dflash_config.causal): SGLang would run only the sliding layers causal")
            causal = True
        neox = raw.get("rope_is_neox_style", raw.get("is_neox_style", True))

        selector = {name: dflash.get(name, 0) for name in ("selector_rank", "selector_top_k")}
        dflash2 = (raw.get("architectures") or [""])[0] in DFLASH2_ARCHITECTURES
        if dflash2 and not selector["selector_rank"]:
            raise ConfigError(f"architectures {raw['architectures']} is DFlash-2 with a path selector, "
                              "which needs dflash_config.selector_rank and selector_top_k")
        if not dflash2 and any(selector.values()):
            raise ConfigError("dflash_config.selector_rank / selector_top_k need architectures "
                              f"{list(DFLASH2_ARCHITECTURES[:1])} (SGLang builds no selector otherwise)")
        return cls(
            hidden_size=hidden,
            intermediate_size=require("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            vocab_size=require("vocab_size"),
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=tuple(layer_ids),
            num_target_layers=num_target_layers,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            attention_bias=bool(raw.get("attention_bias", False)),
            layer_types=layer_types,
            sliding_window=raw.get("sliding_window"),
            causal=bool(causal),
            output_multiplier=pick("output_multiplier"),
            final_logit_softcapping=pick("final_logit_softcapping") or None,
            conv_kernel_size=dflash.get("conv_kernel_size", 0),
            conv_group_size=dflash.get("conv_group_size", 0),
            **selector,
            use_gemma_norm=bool(raw.get("use_gemma_norm", False)),
            rotary_dim=None if rotary_dim == head_dim else rotary_dim,
            rope_is_neox_style=bool(neox),
            attention_value_scale=dflash.get("attention_value_scale"),
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
        """The z-lab config.json, with each field where both schemas' readers and SGLang's DFLASH
        loader read it (block_size in both places; DFlash-2 fields in dflash_config)."""
        dflash: dict[str, Any] = {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "causal": self.causal,
        }
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(self, name):
                dflash[name] = getattr(self, name)
        for name in ("output_multiplier", "final_logit_softcapping", "attention_value_scale"):
            if getattr(self, name) is not None:
                dflash[name] = getattr(self, name)
        out: dict[str, Any] = {
            "architectures": [DFLASH2_ARCHITECTURES[0] if self.has_selector else DFLASH1_ARCHITECTURES[0]],
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
            "dflash_config": dflash,
        }
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.layer_types:
            out["layer_types"] = list(self.layer_types)
            out["sliding_window"] = self.sliding_window
            if "sliding_attention" in self.layer_types:
                out["use_sliding_window"] = True  # transformers' Qwen3Config drops sliding_window without it
        if self.causal:
            # SGLang reads causality from is_causal, and only for configs with layer_types.
            out["is_causal"] = True
            out.setdefault("layer_types", ["full_attention"] * self.num_hidden_layers)
        if self.use_gemma_norm:
            out["use_gemma_norm"] = True
        if self.rotary_dim is not None:
            out["rope_scaling"] = {"rope_type": "default", "rope_dim": self.rotary_dim}
        if not self.rope_is_neox_style:
            out["rope_is_neox_style"] = False
        return out
