"""DFlash-2's grouped dynamic convolution: a short depthwise filter along the rows of each draft
block, wrapped around a sublayer (attention or MLP) of every draft layer.

For a sublayer with normed input x [n, H] (n rows, whole blocks of `block_size` rows each) one
projection of x gives per-row coefficients for both sides of the sublayer:

    delta = kernel_projection(x).view(n, 2, taps, H / group_size)     side 0: input, side 1: output
    w[side, t, j, c] = base_kernel[side, j, c] + delta[t, side, j, c // group_size]
    conv(y, side)[t, c] = sum over j < taps with j <= t's index in its block of  w[side, t, j, c] * y[t - j, c]

The sublayer then runs on conv(x, 0) and its output o is replaced by conv(o, 1); a filter never
reaches across a block boundary. `base_kernel` starts as the identity filter (tap 0 = 1), so a
fresh module changes nothing. Parameter names are those of z-lab / SGLang checkpoints
(`layers.N.attention_conv.*`, `layers.N.mlp_conv.*`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dflash.models.skinny import SkinnyLinear


class BlockConv(nn.Module):
    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        if taps < 1 or group_size < 1 or hidden_size % group_size:
            raise ValueError(f"BlockConv needs taps >= 1 and a group size dividing hidden_size {hidden_size}, "
                             f"got taps={taps}, group_size={group_size}")
        self.taps, self.group_size, self.num_groups = taps, group_size, hidden_size // group_size
        identity = torch.zeros(2, taps, hidden_size)
        identity[:, 0] = 1.0
        self.base_kernel = nn.Parameter(identity)  # [side, tap, channel]
        self.kernel_projection = SkinnyLinear(hidden_size, 2 * taps * self.num_groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)  # no coefficient offsets yet: the identity filter

    def prepare(self, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sublayer's convolved input, the output side's coefficients [n, taps, groups])."""
        delta = self.kernel_projection(x).view(x.shape[0], 2, self.taps, self.num_groups)
        return self._convolve(x, delta[:, 0], 0, block_size), delta[:, 1]

    def finish(self, out: torch.Tensor, delta: torch.Tensor, block_size: int) -> torch.Tensor:
        return self._convolve(out, delta, 1, block_size)

    def _convolve(self, y: torch.Tensor, delta: torch.Tensor, side: int, block_size: int) -> torch.Tensor:
        n, hidden = y.shape
        if n % block_size:
            raise ValueError(f"BlockConv: {n} rows are not whole blocks of {block_size}")
        blocks = y.view(n // block_size, block_size, self.num_groups, self.group_size)
        weights = (self.base_kernel[side].view(self.taps, self.num_groups, self.group_size)
                   + delta.reshape(n // block_size, block_size, self.taps, self.num_groups, 1))
        out = weights[:, :, 0] * blocks
        for j in range(1, min(self.taps, block_size)):
            # Row t reads row t - j of its own block; the first j rows of a block read zeros.
            earlier = F.pad(blocks[:, :-j], (0, 0, 0, 0, j, 0))
            out = out + weights[:, :, j] * earlier
        return out.reshape(n, hidden)
