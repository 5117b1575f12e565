"""A Hugging Face attention implementation ("sdpa_grouped") for grouped-query attention that
never copies the KV cache.

HF's "sdpa" path repeats every KV head `group` times (`repeat_kv`) before calling SDPA whenever an
attention mask is present, i.e. on every padded or cached step: on CPU that copy is most of a
decode step at large batches. Here the `group` query heads that share a KV head are folded into
the query-row dimension instead, [bs, Hkv, group * q, D], and the mask is repeated over those
rows, so SDPA reads each KV head once. Same math, same results.

HF builds one boolean mask per forward and hands that same tensor to every layer. Repeating it over
the group (a copy) and SDPA's own bool-to-additive conversion (a `where`) then ran once per layer:
small ops every speculative step paid and plain decoding, which needs no mask, did not. The
prepared additive mask is kept for the next layer and reused while it is the same mask tensor,
unchanged, for the same group, length and dtype.

Decode and verify steps (`kernel_step`, set by the target adapter around its forward) run our
`block_attention` kernel instead, reading the cache where it lies: SDPA's result for a query row
depends on how many rows it multiplies at once (its GEMMs block them), ~1e-5 in a fp32 logit and
~0.3 in a bf16 one, so a verify pass did not compute what decoding token by token computes. The
kernel streams keys in tiles of absolute positions, the same for a row of a block as for the same
token decoded alone (a tree node at its depth's position): bit for bit what plain decoding
computes. Prefill (the same on both sides) keeps SDPA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from sglang_dflash._extension import has_cuda_kernels
from sglang_dflash.engine.kv_cache import slot_view, slots_per_row
from sglang_dflash.ops import block_attention, runs_ours

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


@dataclasses.dataclass
class KernelStep:
    """The next forward's new tokens, `block` per batch row, against the cache's valid columns."""

    context: torch.Tensor  # int64 [bs, C]: row b's valid cache columns before the block, in order (then padding)
    ctx_lens: torch.Tensor  # int64 [bs]: how many of them
    width: int  # cache columns before the block
    block: int
    tree_parents: torch.Tensor | None  # int64 [bs, block]: a draft tree's parents; None: a causal block
    rows: torch.Tensor  # arange(bs): req_pool_indices
    tables: dict = dataclasses.field(default_factory=dict)  # slots per batch row -> req_to_token


_step = threading.local()  # .current: the KernelStep of the forward running on this thread


@contextlib.contextmanager
def kernel_step(valid: torch.Tensor, block: int, tree_parents: torch.Tensor | None = None):
    """Within it, the attention of a forward of `block` new tokens per row over a cache whose
    columns `valid` [bs, width] holds (left padding and rejected tree nodes are not) runs
    `block_attention`: causal over the block, or over a draft tree's ancestors (`tree_parents`)."""
    counts = valid.sum(1)
    # Valid columns first, each row's in increasing order (a stable sort of "not valid").
    order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices
    context = order[:, :max(int(counts.max()), 1) if counts.numel() else 1]
    rows = torch.arange(valid.shape[0], device=valid.device)
    _step.current = KernelStep(context, counts, valid.shape[1], block, tree_parents, rows)
    try:
        yield
    finally:
        _step.current = None


def _kernel_attention(step: KernelStep, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float | None) -> torch.Tensor | None:
    """block_attention over the cache buffer behind key / value [bs, Hkv, width + block, D] (views of
    [bs, Hkv, capacity, D] buffers, `GrowingLayer`): row b's token t sits in slot b * Hkv *
    capacity + t of a [slots, Hkv, D] view of it. None where the cache is laid out otherwise."""
    bs, heads, q, dim = query.shape
    kv_heads, columns = key.shape[1], key.shape[2]
    k_cache, v_cache = slot_view(key), slot_view(value)
    if k_cache is None or v_cache is None or key.stride() != value.stride() or columns != step.width + q:
        return None
    per_row = slots_per_row(key)
    table = step.tables.get(per_row)
    if table is None:
        table = step.tables[per_row] = step.context + step.rows[:, None] * per_row

    def block_rows(t):  # the block's K or V [bs, Hkv, q, D] -> [bs * q, Hkv, D] (a view at batch size 1)
        return t[:, :, step.width:].transpose(1, 2).reshape(bs * q, kv_heads, dim)

    out = block_attention(query.transpose(1, 2).reshape(bs * q, heads, dim), block_rows(key), block_rows(value),
                          k_cache, v_cache, table, step.rows, step.ctx_lens, q, scaling,
                          causal_block=step.tree_parents is None, tree_parents=step.tree_parents)
    return out.view(bs, q, heads, dim)


def _kernel_on(device: torch.device) -> bool:
    """Whether our block_attention kernel (not its reference) serves tensors on `device`: the CPU
    kernels always ship; the CUDA ones when the extension was built with them."""
    if device.type == "cuda" and not has_cuda_kernels():
        return False
    return device.type in ("cpu", "cuda") and runs_ours("block_attention", device)


def grouped_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [bs, H, q, D], key/value [bs, Hkv, kv, D], mask [bs | 1, 1, q, >= kv] (bool or additive)
    -> (output [bs, q, H, D], None)."""
    bs, heads, q, dim = query.shape
    step = getattr(_step, "current", None)
    if (step is not None and q == step.block and getattr(module, "sliding_window", None) is None
            and key.dtype == query.dtype and _kernel_on(query.device)):
        out = _kernel_attention(step, query, key, value, scaling)
        if out is not None:
            return out, None
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
