"""TARGET_VERIFY attention on `block_attention`, and the swap of the DFLASH draft layers onto it.

In a DFLASH step every request has a block of B rows: the draft's block (anchor + B-1 masks,
non-causal: ENCODER_ONLY layers) and the target's verify (causal among the B rows). Both attend to
the request's context in SGLang's token-slot KV pool (`seq_lens[b]` tokens, slots through
`req_to_token`) plus the block's own K/V, which is exactly `block_attention` (docs/design.md §3.1). In a
tree step (trees.py) the target's verify block is a draft tree: its causal layers run the tree mode.

`install_draft_attention(worker)` wraps each draft layer's `RadixAttention.forward` (per instance,
before any CUDA graph is captured) so that DFLASH TARGET_VERIFY calls run `paged_block_attention`
over the draft runner's pool; every other call, and every case it does not cover, goes to SGLang.
"""

from __future__ import annotations

import logging

import torch

from sglang_dflash import settings
from sglang_dflash.ops import gpu_defaults, variants

logger = logging.getLogger(__name__)

_ORIGINAL = "_sglang_dflash_original_forward"

# The draft tree of the step in flight, which the target's TARGET_VERIFY layers apply as their
# mask: published by trees.ServedTrees after the draft forward, cleared when the step ends (SGLang's
# scheduler runs one step at a time per process), with the count of layers that applied it.
_tree_parents = None
_tree_layers = 0


def publish_verify_tree(parents) -> None:
    """Make `parents` [bs, n + 1] the tree the next TARGET_VERIFY checks (None: a chain), and
    restart the count of layers that applied it."""
    global _tree_parents, _tree_layers
    _tree_parents, _tree_layers = parents, 0


def verify_tree_parents():
    """The parents of the tree the running verify checks (None: a chain)."""
    return _tree_parents


def tree_layers_applied() -> int:
    """How many target attention layers applied the published tree since it was published."""
    return _tree_layers


def covers(layer, forward_batch, q, k_cache) -> bool:
    """Whether `paged_block_attention` computes what SGLang's backend would for this TARGET_VERIFY
    call: DFLASH's (a chain, or our published draft tree), or NGRAM's (its draft trees)."""
    mode = getattr(forward_batch, "forward_mode", None)
    algo = getattr(forward_batch, "spec_algorithm", None)
    if mode is None or not mode.is_target_verify() or algo is None:
        return False
    if algo.is_dflash():
        if getattr(getattr(forward_batch, "spec_info", None), "custom_mask", None) is not None:
            return False
    elif not algo.is_ngram() or ngram_tree_parents(forward_batch) is None:
        return False
    return _layer_covered(layer, q, k_cache)


_NGRAM_PARENTS = "_sglang_dflash_tree_parents"


def ngram_tree_parents(forward_batch):
    """The parents [bs, n] of each request's NGRAM draft tree, read from its verify's tree mask
    ([bs, n, n]: node j is node i or an ancestor of it; SGLang's CPU form), or None when the mask
    is not such a tree. Computed once per step (kept on the step's spec_info)."""
    from sglang_dflash.ops.reference import tree_ancestors

    spec = getattr(forward_batch, "spec_info", None)
    if spec is None:
        return None
    if not hasattr(spec, _NGRAM_PARENTS):
        mask, n = getattr(spec, "custom_mask", None), getattr(spec, "draft_token_num", None)
        bs = int(forward_batch.req_pool_indices.shape[0])
        parents = None
        if mask is not None and n and mask.numel() == bs * n * n:
            mask = mask.reshape(bs, n, n).bool()
            node = torch.arange(n, device=mask.device)
            nearest = torch.where(mask & (node[None, :] < node[:, None]), node, -1).amax(-1)
            if torch.equal(tree_ancestors(nearest), mask):
                parents = nearest
        setattr(spec, _NGRAM_PARENTS, parents)
    return getattr(spec, _NGRAM_PARENTS)


def covers_decode(layer, forward_batch, q, k_cache) -> bool:
    """Whether `paged_block_attention(..., decode=True)` computes this decode call (one new token
    per request, attending to the request's earlier tokens in the pool)."""
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or not mode.is_decode() or getattr(forward_batch, "encoder_lens", None) is not None:
        return False
    return _layer_covered(layer, q, k_cache)


def covers_prefill(layer, forward_batch, q, k_cache) -> bool:
    """Whether `paged_prefill_attention` computes this call: a prefill (EXTEND, or MIXED: prefills
    and decodes in one batch), each request's new tokens attending causally to its cached prefix and
    to each other."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    mode = getattr(forward_batch, "forward_mode", None)
    if mode not in (ForwardMode.EXTEND, ForwardMode.MIXED) or getattr(forward_batch, "encoder_lens", None) is not None:
        return False
    return _causal(layer) and _layer_covered(layer, q, k_cache)


def _layer_covered(layer, q, k_cache) -> bool:
    import torch

    from sglang_dflash.ops import runs_ours

    if layer.is_cross_attention or getattr(layer, "logit_cap", 0.0) or layer.qk_head_dim != layer.v_head_dim:
        return False
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype:
        return False
    if not runs_ours("block_attention", q.device):  # it failed its self-test there
        return False
    if q.device.type == "cpu":
        return True
    if q.device.type == "cuda":
        from sglang_dflash._extension import has_cuda_kernels

        return has_cuda_kernels()
    return False


def layer_window(layer) -> int:
    """The window block_attention takes for `layer` (-1: no sliding window)."""
    sws = getattr(layer, "sliding_window_size", -1)
    return sws + 1 if sws is not None and sws > -1 else -1  # SGLang: |q - k| <= sws


def _causal(layer) -> bool:
    from sglang.srt.layers.radix_attention import AttentionType

    return layer.attn_type != AttentionType.ENCODER_ONLY


def _verify_tree(forward_batch):
    """The draft trees a target verify checks: NGRAM's own, or DFLASH's published one (None: chains)."""
    algo = getattr(forward_batch, "spec_algorithm", None)
    if algo is not None and algo.is_ngram():
        return ngram_tree_parents(forward_batch)
    return _tree_parents


def _store_new_kv(layer, forward_batch, kv_pool, k, v, swa_loc, save_kv_cache):
    """The new tokens' K/V as [rows, Hkv, D] (None stays None: already in the pool), written to
    their slots when `save_kv_cache`, as SGLang's backends do."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if k is None or v is None:
        return k, v
    k, v = k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim), v.reshape(-1, layer.tp_k_head_num, layer.v_head_dim)
    if save_kv_cache:
        kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, swa_loc), k, v)
    return k, v


def paged_block_attention(q, k, v, layer, forward_batch, *, kv_pool, req_to_token, swa_loc=None,
                          save_kv_cache=True, decode=False):
    """One TARGET_VERIFY attention layer (or, with `decode`, one decode layer: a causal block of
    one row over the tokens before it): writes the block's K/V to the pool (as SGLang's backends
    do), then `block_attention` over context + block; returns [rows, Hq * D]."""
    from sglang_dflash.ops import block_attention

    global _tree_layers
    hq, dim = layer.tp_q_head_num, layer.qk_head_dim
    k, v = _store_new_kv(layer, forward_batch, kv_pool, k, v, swa_loc, save_kv_cache)
    q3 = q.reshape(-1, hq, dim)
    n_rows = q3.shape[0]
    bs = int(forward_batch.req_pool_indices.shape[0])
    if bs == 0 or n_rows % bs:
        raise RuntimeError(f"attention batch of {n_rows} rows does not split into {bs} equal blocks")
    k_cache = kv_pool.get_key_buffer(layer.layer_id)
    v_cache = kv_pool.get_value_buffer(layer.layer_id)
    if k is None or v is None:  # K/V already in the pool: read the block rows back
        loc = forward_batch.out_cache_loc.long()
        k3, v3 = k_cache[loc], v_cache[loc]
    else:
        k3, v3 = k, v
    # A decode step's seq_lens count the new token, which is the block; TARGET_VERIFY's do not.
    ctx_lens = forward_batch.seq_lens - 1 if decode else forward_batch.seq_lens
    causal = decode or _causal(layer)
    tree = None if decode or not causal else _verify_tree(forward_batch)
    if tree is not None:
        if tuple(tree.shape) != (bs, n_rows // bs):
            raise RuntimeError(f"the draft tree's parents {tuple(tree.shape)} do not describe this verify's "
                               f"{bs} blocks of {n_rows // bs} rows")
        if tree is _tree_parents:
            _tree_layers += 1
    out = block_attention(
        q3,
        k3.to(q3.dtype),
        v3.to(q3.dtype),
        k_cache,
        v_cache,
        req_to_token,
        forward_batch.req_pool_indices,
        ctx_lens,
        n_rows // bs,
        sm_scale=layer.scaling,
        window=layer_window(layer),
        causal_block=causal and tree is None,
        tree_parents=tree,
    )
    return out.reshape(n_rows, hq * layer.v_head_dim)


# Rows of a prefill per block_attention block: a block computes all its rows against all its keys, the
# causal mask discarding half, so a long prompt goes in many short blocks (as one block it lost to
# SDPA on long prompts; bench_ops' prefill_attention times it), which also gives the kernel more tasks.
PREFILL_BLOCK_ROWS = 32


def prefill_attention(q, k, v, k_cache, v_cache, req_to_token, req_pool_index, prefix_len: int, *, sm_scale: float,
                      window: int = -1):
    """Causal attention of one request's new tokens (q [n, Hq, D], k / v [n, Hkv, D], already in the
    pool after its `prefix_len` cached ones) over the prefix and each other, by block_attention in
    blocks of PREFILL_BLOCK_ROWS rows, each over the pool's tokens before it. The kernel tiles keys by
    absolute position, so every row is the same bits as decoding its token alone."""
    import torch

    from sglang_dflash.ops import block_attention

    n, rows = q.shape[0], PREFILL_BLOCK_ROWS
    full, rest = divmod(n, rows)
    parts = []
    for count, block, first in ((full, rows, 0), (1 if rest else 0, rest, full * rows)):
        if not count:
            continue
        picked = slice(first, first + count * block)
        starts = prefix_len + first + block * torch.arange(count, dtype=torch.int64)
        parts.append(block_attention(q[picked], k[picked], v[picked], k_cache, v_cache, req_to_token,
                                     req_pool_index.expand(count), starts, block, sm_scale=sm_scale, window=window,
                                     causal_block=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def paged_prefill_attention(q, k, v, layer, forward_batch, *, kv_pool, req_to_token, swa_loc=None,
                            save_kv_cache=True):
    """One prefill attention layer: writes the new tokens' K/V to the pool, then `prefill_attention`
    per request. Every row then computes, bit for bit, what decoding its token would, so a prompt's
    K/V and first token do not depend on how much of it the prefix cache held (SGLang's SDPA rounds
    by the shape of the call). Returns [rows, Hq * D]."""
    hq, dim = layer.tp_q_head_num, layer.qk_head_dim
    k, v = _store_new_kv(layer, forward_batch, kv_pool, k, v, swa_loc, save_kv_cache)
    q3 = q.reshape(-1, hq, dim)
    k_cache, v_cache = kv_pool.get_key_buffer(layer.layer_id), kv_pool.get_value_buffer(layer.layer_id)
    new_tokens, prefixes = forward_batch.extend_seq_lens_cpu, forward_batch.extend_prefix_lens.tolist()
    if sum(new_tokens) != q3.shape[0]:
        raise RuntimeError(f"prefill of {q3.shape[0]} rows for new token counts {list(new_tokens)}")
    out = q3.new_empty(q3.shape[0], hq, layer.v_head_dim)
    start, window = 0, layer_window(layer)
    for i, (n, prefix) in enumerate(zip(new_tokens, prefixes, strict=True)):
        rows = slice(start, start + n)
        if n:
            out[rows] = prefill_attention(q3[rows], k[rows].to(q3.dtype), v[rows].to(q3.dtype), k_cache, v_cache,
                                          req_to_token, forward_batch.req_pool_indices[i:i + 1], prefix,
                                          sm_scale=layer.scaling, window=window)
        start += n
    return out.reshape(q3.shape[0], hq * layer.v_head_dim)


def gpu_choice(op: str, device) -> tuple[bool, str]:
    """Whether our `op` (block_attention: the draft attention; materialize_context_kv: the context K/V)
    serves the drafter on CUDA `device`, and why: `SGLANG_DFLASH_DRAFT_ATTENTION` forces both on or off;
    unset, each runs where the committed kernel benchmark for the GPU's class shows it faster than
    SGLang's path (ops/gpu_defaults.py)."""
    forced = settings.get(settings.DRAFT_ATTENTION)
    if forced is not None:
        return forced, f"{settings.DRAFT_ATTENTION.name}={int(forced)}"
    return gpu_defaults.default_on(op, variants.gpu_class(device))


def draft_attention_wanted(device) -> bool:
    """On CPU by default (`SGLANG_DFLASH_DRAFT_ATTENTION=0` turns it off); on CUDA as `gpu_choice`
    decides."""
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_choice("block_attention", device)[0]
    wanted = settings.get(settings.DRAFT_ATTENTION)
    return device.type == "cpu" if wanted is None else wanted


def _draft_layers(worker) -> list:
    """The RadixAttention layers of a DFlashWorkerV2's drafter that `install_draft_attention` wraps."""
    if getattr(worker, "use_compact_draft_cache", False):
        return []  # the compact window cache numbers positions differently: SGLang's path
    layers = (getattr(getattr(layer, "self_attn", None), "attn", None)
              for layer in getattr(worker.draft_model, "layers", ()))
    return [attn for attn in layers if attn is not None and hasattr(attn, "attn_type")]


def draft_attention_cases(worker) -> list:
    """The block_attention configurations the wrapped draft layers run (for the self-test): each
    layer's head layout, pool dtype, window and mask, at the worker's block size and at 1 (the
    adaptive block size goes down to it)."""
    from sglang_dflash.ops.self_test import Attention

    pool = worker.draft_model_runner.token_to_kv_pool
    cases = {}
    for attn in _draft_layers(worker):
        for block in (int(worker.block_size), 1):
            case = Attention(attn.tp_q_head_num, attn.tp_k_head_num, attn.qk_head_dim,
                             pool.get_key_buffer(attn.layer_id).dtype, block, layer_window(attn), _causal(attn))
            cases[case] = None
    return list(cases)


def install_draft_attention(worker) -> int:
    """Wrap the draft layers' attention of a DFlashWorkerV2; returns how many layers it wrapped."""
    runner = worker.draft_model_runner
    wrapped = 0
    for attn in _draft_layers(worker):
        if getattr(attn, _ORIGINAL, None) is not None:
            continue
        original = attn.forward

        def forward(q, k, v, forward_batch, save_kv_cache=True, *args, _attn=attn, _original=original,
                    **kwargs):
            if not args and not kwargs:
                pool = runner.token_to_kv_pool
                k_cache = pool.get_key_buffer(_attn.layer_id)
                if covers(_attn, forward_batch, q, k_cache):
                    return paged_block_attention(
                        q, k, v, _attn, forward_batch, kv_pool=pool,
                        req_to_token=runner.req_to_token_pool.req_to_token, save_kv_cache=save_kv_cache,
                    )
            return _original(q, k, v, forward_batch, save_kv_cache, *args, **kwargs)

        setattr(attn, _ORIGINAL, original)
        attn.forward = forward
        wrapped += 1
    return wrapped
