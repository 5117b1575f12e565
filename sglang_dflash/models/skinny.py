"""Linear layers on the CPU through the `skinny_linear` kernel when few rows go through them.

A decode step feeds 1 row per request through every projection and a verify step B rows; there
the kernel reads each weight once instead of BLAS packing it, and it is batch invariant, so a
verify pass computes in its linear layers bit for bit what plain decoding computes token by
token. Larger inputs (prefill, training), other devices and autograd keep torch's own linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dflash.ops import skinny_linear

MAX_ROWS = 16  # above this the weight is reused enough for BLAS to win


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through skinny_linear where that is faster and allowed."""
    few_rows = x.numel() <= MAX_ROWS * x.shape[-1]
    if (few_rows and x.device.type == "cpu" and x.dtype == weight.dtype and weight.stride(-1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class SkinnyLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_skinny_linear(model: nn.Module) -> int:
    """Turn every plain nn.Linear of `model` into a SkinnyLinear; returns how many.

    The modules change class in place rather than being replaced, so parameters (the LM head
    tied to the embedding included), hooks and every reference to them stay as they were."""
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SkinnyLinear
            swapped += 1
    return swapped
