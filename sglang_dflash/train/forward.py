"""The drafter's training forward: all blocks of one sequence in a single pass.

Keys of every layer are [context of the whole sequence; all blocks], and the block-sparse mask
(`blocks.block_attention_mask`, plus the layer's sliding window and the causal option) gives each
block exactly the view `block_attention` gives it at inference, at the same absolute positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_dflash.models import DFlashDraftModel
from sglang_dflash.train.blocks import block_attention_mask


def layer_mask(base: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, causal: bool,
               context_len: int) -> torch.Tensor:
    """`base` narrowed by the sliding window (|q - k| < window) and, if causal, block rows that
    come later in their own block."""
    mask = base
    if window >= 1:
        mask = mask & ((q_pos[:, None] - k_pos[None, :]).abs() < window)
    if causal:
        later = torch.zeros_like(mask)
        later[:, context_len:] = k_pos[None, context_len:] > q_pos[:, None]
        mask = mask & ~later
    return mask


def training_hidden(draft: DFlashDraftModel, features: torch.Tensor, block_embeds: torch.Tensor,
                    positions: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Final-normed draft hidden states [n*B, H] of the blocks at `anchors`.

    features [L, K*H]: the target's tapped hidden states of the sequence; block_embeds [n*B, H]:
    target embeddings of [anchor, MASK x (B-1)] per block; positions [n*B]: absolute positions.
    """
    dtype = draft.fc.weight.dtype
    context_len = features.shape[0]
    ctx = draft.hidden_norm(draft.fc(features.to(dtype)))
    ctx_pos = torch.arange(context_len, device=features.device)
    ctx_rotary = draft.rotary(ctx_pos, dtype)
    rotary = draft.rotary(positions, dtype)
    base = block_attention_mask(anchors, context_len, block_size)
    k_pos = torch.cat([ctx_pos, positions])
    h = block_embeds.to(dtype)
    for i, layer in enumerate(draft.layers):
        mask = layer_mask(base, positions, k_pos, draft.config.layer_window(i), draft.config.causal, context_len)

        def attend(q, k_block, v_block, attn=layer.self_attn, mask=mask):
            k_ctx, v_ctx = attn.key_value(ctx, ctx_rotary)
            group = attn.num_heads // attn.num_kv_heads
            k = torch.cat([k_ctx, k_block]).repeat_interleave(group, dim=1)
            v = torch.cat([v_ctx, v_block]).repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 attn_mask=mask)
            return out.transpose(0, 1)

        h = layer(h, rotary, attend)
    return draft.norm(h)
