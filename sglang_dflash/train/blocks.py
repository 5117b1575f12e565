"""Packing of draft-training blocks: anchors, block inputs, labels, loss weights, attention mask.

A training sequence of L tokens x_0..x_{L-1} yields n blocks. Block j starts at an anchor a_j and
reproduces one inference draft step: its input is [x_{a_j}, MASK x (B-1)] at absolute positions
a_j .. a_j+B-1, its context is the target's features of tokens 0..a_j-1 (the tokens the target
has processed when x_{a_j} is the bonus), and row k >= 1 learns x_{a_j+k}.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def sample_anchors(loss_mask: torch.Tensor, block_size: int, num_anchors: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to `num_anchors` distinct sorted anchors, uniformly among the valid ones.

    Anchor a is valid when it has context (a >= 1), its whole block fits in the sequence
    (a + B - 1 <= L - 1, no block reaches past the end) and the first token it predicts, x_{a+1},
    is trained on (loss_mask[a + 1]).
    """
    seq_len = loss_mask.numel()
    last = seq_len - block_size  # largest anchor whose block fits
    if last < 1 or block_size < 2:
        return torch.empty(0, dtype=torch.int64)
    candidates = torch.arange(1, last + 1)
    candidates = candidates[loss_mask[candidates + 1].bool().cpu()]
    if candidates.numel() > num_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
        candidates = candidates[pick]
    return candidates.sort().values


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Weight of block row k (k = 1..B-1; row 0, the anchor, has none): exp(-(k-1)/gamma).
    Early rows matter most: a draft is only useful up to its first wrong token."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def default_gamma(block_size: int) -> float:
    """gamma 7 for B 16 and 4 for B 8 (the DFlash recipe), interpolated in log2(B) elsewhere."""
    return max(1.0, 4.0 + 3.0 * (math.log2(block_size) - 3.0))


@dataclass
class PackedBlocks:
    input_ids: torch.Tensor  # [n*B] anchor token, then mask_token_id
    positions: torch.Tensor  # [n*B] absolute positions a_j + k
    labels: torch.Tensor  # [n*B] x_{a_j + k}; row 0 of each block repeats the anchor (weight 0)
    weights: torch.Tensor  # [n*B] loss weight: decay(k) * loss_mask[a_j + k]
    anchors: torch.Tensor  # [n]


def pack_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int,
                mask_token_id: int, gamma: float) -> PackedBlocks:
    """Inputs, positions, labels and weights of the blocks at `anchors` of one sequence."""
    k = torch.arange(block_size, device=input_ids.device)
    pos = (anchors.to(input_ids.device)[:, None] + k[None, :]).reshape(-1)
    block_ids = torch.full_like(pos, mask_token_id)
    block_ids[::block_size] = input_ids[anchors]
    decay = loss_weights(block_size, gamma).to(input_ids.device).repeat(anchors.numel())
    return PackedBlocks(input_ids=block_ids, positions=pos, labels=input_ids[pos],
                        weights=decay * loss_mask[pos].float(), anchors=anchors)


def block_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Boolean mask [n*B, context_len + n*B] (True = may attend) over keys [context; blocks].

    Block j's rows see context tokens strictly before a_j and all rows of block j, nothing else:
    exactly what `block_attention` lets them see at inference.
    """
    n = anchors.numel()
    block_of_row = torch.arange(n * block_size, device=anchors.device) // block_size
    sees_context = torch.arange(context_len, device=anchors.device)[None, :] < anchors[block_of_row][:, None]
    sees_block = block_of_row[:, None] == block_of_row[None, :]
    return torch.cat([sees_context, sees_block], dim=1)
