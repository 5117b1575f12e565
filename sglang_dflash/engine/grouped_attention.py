"""A Hugging Face attention implementation ("sdpa_grouped") for grouped-query attention that
never copies the KV cache.

HF's "sdpa" path repeats every KV head `group` times (`repeat_kv`) before calling SDPA whenever an
attention mask is present, i.e. on every padded or cached step: on CPU that copy is most of a
decode step (SmolLM2 at batch 128: ~70% of the time). Here the `group` query heads that share a
KV head are folded into the query-row dimension instead, [bs, Hkv, group * q, D], and the mask is
repeated over those rows, so SDPA reads each KV head once. Same math, same results.

HF builds one boolean mask per forward and hands that same tensor to every layer. Repeating it over
the group (a copy) and SDPA's own bool-to-additive conversion (a `where`) then ran once per layer:
~60 small ops a verify step, ~1.5 ms of SmolLM2's ~45 ms on CPU, paid by every speculative step and
not by plain decoding, which needs no mask. The prepared additive mask is kept for the next layer
and reused while it is the same mask tensor, unchanged, for the same group, length and dtype.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

NAME = "sdpa_grouped"

def repeat_over_group(mask: torch.Tensor, group: int) -> torch.Tensor:
    """mask [bs | 1, 1, q, kv] -> [bs | 1, 1, group * q, kv]: the rows of each of the `group` query
    heads folded into the rows (head-major, as `query.reshape` folds them)."""
    bs, heads, q, kv = mask.shape
    return mask[:, :, None].expand(bs, heads, group, q, kv).reshape(bs, heads, group * q, kv)


_last = threading.local()  # .entry: (weakref to the source mask, (version, group, kv, dtype), prepared)


def grouped_additive_mask(attention_mask: torch.Tensor, group: int, kv: int, dtype: torch.dtype) -> torch.Tensor:
    """mask [bs | 1, 1, q, >= kv] (bool: True attends; or additive) -> additive [bs | 1, 1, group * q, kv]
    of `dtype` (0 where attended, -inf elsewhere for a bool mask), the same for each of the `group`
    query heads folded into the rows. Kept for the next call while the source mask is alive and
    unchanged; it is dropped with the source mask (HF frees it after the forward), so nothing outlives
    the forward that made it."""
    key = (attention_mask._version, group, kv, dtype)
    entry = getattr(_last, "entry", None)
    if entry is not None and entry[0]() is attention_mask and entry[1] == key:
        return entry[2]
    mask = attention_mask[..., :kv]
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    else:
        mask = mask.to(dtype)
    prepared = repeat_over_group(mask, group)
    holder = _last.__dict__  # this thread's; the callback may run on another thread

    def drop(ref: weakref.ref) -> None:
        if holder.get("entry", (None,))[0] is ref:
            holder.pop("entry", None)

    _last.entry = (weakref.ref(attention_mask, drop), key, prepared)
    return prepared


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
        attention_mask = grouped_additive_mask(attention_mask, group, kv, query.dtype)
    out = F.scaled_dot_product_attention(query.reshape(bs, kv_heads, group * q, dim), key, value,
                                         attn_mask=attention_mask, dropout_p=dropout if module.training else 0.0,
                                         scale=scaling)
    return out.view(bs, heads, q, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
