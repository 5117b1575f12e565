"""Linear layers of CPU models through the `skinny_linear` kernel when few rows go through them.

A decode step feeds 1 row per request through every projection and a verify step B rows; there
the kernel reads each weight once instead of BLAS packing it, and it is batch invariant, so the
target's verify pass computes bit for bit what plain decoding computes token by token. Larger
inputs (prefill, training) and autograd keep using torch's own linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dflash.ops import skinny_linear

MAX_ROWS = 16  # above this the weight is reused enough for BLAS to win


class SkinnyLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        few_rows = x.numel() <= MAX_ROWS * x.shape[-1]
        if (few_rows and x.device.type == "cpu" and x.dtype == self.weight.dtype
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return skinny_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


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
