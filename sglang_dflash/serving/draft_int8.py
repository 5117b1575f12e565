"""The served drafter's weights in int8 on the CPU: a draft step reads about half the bytes of fp16.

A CPU draft step pushes a few rows through the draft layers and the draft LM head, so it is bound
by reading their weights (`skinny_linear`); with one int8 value per weight and one fp32 scale per
row (`models.skinny.quantize_rows`) it reads about half of what fp16 or bf16 weights cost (the
engine's `--draft-dtype int8`, its default on the CPU, is the same change). On CPUs with
AVX512-VNNI the int8 layers quantize their activations per row too and run `w8a8_linear` (where
its self-test passed): with fp32 arithmetic the int8 weights' conversions and FMAs, not their
bytes, bound a draft step of several rows.

`quantize_draft_linears(worker)`, on the CPU with `SGLANG_DFLASH_DRAFT_INT8` not 0, after
skinny_linear passed its self-test:

- every unquantized linear layer of the draft layers (fused qkv, o, fused gate/up, down) gets an
  int8 copy of its weight, which the batch-invariant linear hook (`cpu.py`) runs instead of the
  float weight; the float weight stays (materialize_context_kv reads qkv's k/v rows from it, and
  any call the hook does not cover takes SGLang's path over it);
- a plain `nn.Linear` `fc` becomes an `Int8Linear`;
- the worker's draft LM head rows (the draft vocabulary's) are quantized the same way.

Drafts only propose: the target verifies every token, so the served output cannot change (greedy
DFLASH still equals plain decoding token for token).
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_dflash import settings
from sglang_dflash.models.skinny import Int8Linear, quantize_rows

ATTR = "sglang_dflash_int8"  # (int8 weight [N, K], fp32 scale [N]) on a linear layer of the drafter

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def int8_wanted(device: torch.device) -> bool:
    """On the CPU unless SGLANG_DFLASH_DRAFT_INT8=0 (int8 weights run only in the CPU kernel)."""
    return device.type == "cpu" and settings.get(settings.DRAFT_INT8)


def int8_weight(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The int8 weight and row scales `quantize_draft_linears` gave `layer`, or None."""
    return getattr(layer, ATTR, None)


def quantize_draft_linears(draft_model: nn.Module) -> int:
    """Gives every unquantized float linear layer of the draft layers an int8 copy of its weight and
    turns a plain `nn.Linear` fc into an `Int8Linear`; returns how many layers it converted."""
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    converted = 0
    layers = getattr(draft_model, "layers", None) or ()
    for module in (m for layer in layers if isinstance(layer, nn.Module) for m in layer.modules()):
        weight = getattr(module, "weight", None)
        if (isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod)
                and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype in _FLOATS
                and not getattr(module, "use_intel_amx_backend", False)):
            setattr(module, ATTR, quantize_rows(weight))
            converted += 1
    fc = getattr(draft_model, "fc", None)
    if type(fc) is nn.Linear and fc.weight.dtype in _FLOATS:
        draft_model.fc = Int8Linear(fc)
        converted += 1
    return converted
