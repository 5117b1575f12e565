"""A Hugging Face attention implementation ("sdpa_grouped") for grouped-query attention that
never copies the KV cache.

HF's "sdpa" path repeats every KV head `group` times (`repeat_kv`) before calling SDPA whenever an
attention mask is present, i.e. on every padded or cached step: on CPU that copy is most of a
decode step (SmolLM2 at batch 128: ~70% of the time). Here the `group` query heads that share a
KV head are folded into the query-row dimension instead, [bs, Hkv, group * q, D], and the mask is
repeated over those rows, so SDPA reads each KV head once. Same math, same results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

NAME = "sdpa_grouped"


def grouped_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [bs, H, q, D], key/value [bs, Hkv, kv, D], mask [bs | 1, 1, q, >= kv] (bool or additive)
    -> (output [bs, q, H, D], None)."""
    bs, heads, q, dim = query.shape
    kv_heads, kv = key.shape[1], key.shape[2]
    group = heads // kv_heads
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and q > 1 and causal:
        # Folding heads into rows breaks SDPA's own is_causal, so spell the causal mask out.
        attention_mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril(kv - q)[None, None]
    if attention_mask is not None:
        mask = attention_mask[..., :kv]
        mask = mask[:, :, None].expand(mask.shape[0], mask.shape[1], group, q, kv)
        attention_mask = mask.reshape(mask.shape[0], mask.shape[1], group * q, kv)
    out = F.scaled_dot_product_attention(query.reshape(bs, kv_heads, group * q, dim), key, value,
                                         attn_mask=attention_mask, dropout_p=dropout if module.training else 0.0,
                                         scale=scaling)
    return out.view(bs, heads, q, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
