"""The config variants models/config.py reads (DFlash-2 and the rest of SGLang's DFLASH schema):
what each field becomes, what a save writes back, and one ConfigError naming the field for every
field or variant this package does not run (never a silent ignore)."""

from __future__ import annotations

import copy

import pytest
import torch

from sglang_dflash.models import ConfigError, DFlashConfig, DFlashDraftModel

BASE = {
    "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512, "torch_dtype": "bfloat16",
    "transformers_version": "4.57.0", "use_cache": True, "tie_word_embeddings": False,
    "dflash_config": {"block_size": 8, "mask_token_id": 99, "target_layer_ids": [1, 5],
                      "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4,
                      "output_multiplier": 0.5, "final_logit_softcapping": 30.0, "mask_token": "<|MASK|>"},
}


def _with(edit):
    raw = copy.deepcopy(BASE)
    edit(raw)
    return raw


def test_dflash2_fields():
    c = DFlashConfig.from_dict(BASE)
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (2, 16, 8, 4)
    assert (c.output_multiplier, c.final_logit_softcapping, c.has_selector) == (0.5, 30.0, True)
    model = DFlashDraftModel(c)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["layers.1.attention_conv.base_kernel"] == (2, 2, 64)
    assert shapes["layers.0.mlp_conv.kernel_projection.weight"] == (2 * 2 * 4, 64)
    assert shapes["candidate_selector.predecessor_codebook"] == (100, 8)
    assert shapes["candidate_selector.hidden_projection.weight"] == (8, 64)
    assert DFlashConfig.from_dict(c.to_dict()) == c


def test_other_variants():
    raw = _with(lambda r: r.update(
        architectures=["DFlashDraftModel"], use_gemma_norm=True, partial_rotary_factor=0.5, rope_is_neox_style=False,
        is_causal=True, layer_types=["sliding_attention"] * 2, sliding_window=16,
        dflash_config={"block_size": 8, "mask_token_id": 99, "target_layer_ids": [1, 5], "attention_value_scale": 0.5}))
    c = DFlashConfig.from_dict(raw)
    assert (c.use_gemma_norm, c.rotary_dim, c.rope_dim, c.rope_is_neox_style) == (True, 8, 8, False)
    assert (c.causal, c.layer_window(0), c.attention_value_scale, c.has_selector) == (True, 16, 0.5, False)
    model = DFlashDraftModel(c)
    assert torch.equal(model.norm.weight, torch.zeros(64)) and model.inv_freq.shape == (4,)
    assert DFlashConfig.from_dict(c.to_dict()) == c
    assert DFlashConfig.from_dict(_with(lambda r: r.update(rope_scaling={"rope_dim": 12, "mrope_section": [2]}))
                                  ).rotary_dim == 12
    # SGLang's default: sliding-only drafts are causal
    assert DFlashConfig.from_dict(_with(lambda r: r.update(layer_types=["sliding_attention"] * 2,
                                                           sliding_window=4))).causal


BAD = {
    "unknown field": (lambda r: r.update(my_new_trick=1), "my_new_trick"),
    "unknown dflash field": (lambda r: r["dflash_config"].update(lilicorr_hidden_size=8), "dflash_config.lilicorr"),
    "attention sinks": (lambda r: r["dflash_config"].update(attention_sink_bias=True), "attention_sink_bias"),
    "domino": (lambda r: r["dflash_config"].update(projector_type="domino"), "projector_type"),
    "laguna": (lambda r: r.update(architectures=["DFlashLagunaForCausalLM"]), "architectures"),
    "gating": (lambda r: r.update(gating="per-head"), "gating"),
    "own embedding": (lambda r: r.update(has_embed_tokens=True), "has_embed_tokens"),
    "quantized": (lambda r: r.update(quantization_config={"quant_algo": "W4A16_NVFP4"}), "quantization_config"),
    "conv without group": (lambda r: r["dflash_config"].pop("conv_group_size"), "conv_group_size"),
    "group not dividing": (lambda r: r["dflash_config"].update(conv_group_size=24), "conv_group_size"),
    "selector without top_k": (lambda r: r["dflash_config"].pop("selector_top_k"), "selector_top_k"),
    "dflash2 without selector": (
        lambda r: (r["dflash_config"].pop("selector_rank"), r["dflash_config"].pop("selector_top_k")), "selector_rank"),
    "selector on dflash1": (lambda r: r.update(architectures=["DFlashDraftModel"]), "selector_rank"),
    "negative taps": (lambda r: r["dflash_config"].update(conv_kernel_size=-1), "conv_kernel_size"),
    "odd rotary": (lambda r: r.update(partial_rotary_factor=0.1), "rotary"),
    "mrope without rope_dim": (lambda r: r.update(rope_scaling={"mrope_section": [2, 2]}), "mrope_section"),
    "causal flags disagree": (lambda r: (r.update(is_causal=True), r["dflash_config"].update(causal=False)),
                              "is_causal"),
    "mixed layers, no causality": (
        lambda r: r.update(layer_types=["sliding_attention", "full_attention"], sliding_window=4), "is_causal"),
    "multiplier disagrees": (lambda r: r.update(output_multiplier=2.0), "output_multiplier"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_unsupported_field_names_itself(case):
    edit, field = BAD[case]
    with pytest.raises(ConfigError, match=field):
        DFlashConfig.from_dict(_with(edit))
