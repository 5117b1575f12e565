"""The served drafter's context K/V through `materialize_context_kv`: one op call per step.

After every target pass, DFlashWorkerV2 turns the target's tapped hidden states of the committed
tokens into each draft layer's K/V (`_append_target_hidden_to_draft_kv_by_loc`): `fc` +
`hidden_norm`, then per layer a k/v projection, k-norm, RoPE and a pool write, about six torch
calls a layer on CPU (on GPU SGLang has a Triton path). `ContextKVWriter` keeps the `fc` +
`hidden_norm` step (SGLang's modules) and does the rest in one `materialize_context_kv` call over
views of the draft's own weights.

Used where the op computes exactly SGLang's per-layer path: unquantized fused qkv weights, plain
RMSNorm k-norms (not Gemma's), SGLang's base RotaryEmbedding, fp32/bf16/fp16 pools without fp8
scales, the drafter's `prepare_context_hidden_for_kv` the identity; on CPU, and on CUDA under the
same switch as the draft attention (`SGLANG_DFLASH_DRAFT_ATTENTION`). Anything else keeps SGLang's.
"""

from __future__ import annotations

import logging

import torch

from sglang_dflash._extension import has_cuda_kernels
from sglang_dflash.ops import materialize_context_kv
from sglang_dflash.ops.self_test import ContextKV
from sglang_dflash.serving.attention import gpu_choice

logger = logging.getLogger(__name__)

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class ContextKVWriter:
    def __init__(self, worker, layers: list):
        self._worker = worker
        attn = [layer.self_attn for layer in layers]
        first = attn[0]
        self._kv_weights = [a.qkv_proj.weight[a.q_size : a.q_size + 2 * a.kv_size] for a in attn]
        biases = [getattr(a.qkv_proj, "bias", None) for a in attn]
        self._kv_biases = None if biases[0] is None else [
            b[a.q_size : a.q_size + 2 * a.kv_size] for a, b in zip(attn, biases, strict=True)]
        self._k_norms = [a.k_norm.weight for a in attn]
        self._eps = float(first.k_norm.variance_epsilon)
        self._rotary = first.rotary_emb
        self._v_scale = 1.0 if first.v_scale is None else float(first.v_scale)
        self._radix = [a.attn for a in attn]

    @classmethod
    def for_worker(cls, worker) -> ContextKVWriter | None:
        """The writer for this worker's drafter, or None (with the reason logged) where SGLang's
        path must run."""
        problem = _problem(worker)
        if problem is not None:
            logger.info("sglang-dflash: draft context K/V through SGLang's per-layer path: %s", problem)
            return None
        return cls(worker, list(worker.draft_model.layers))

    def self_test_case(self):
        """This drafter's materialize_context_kv configuration, for the start-up self-test."""
        k_cache = self._worker.draft_model_runner.token_to_kv_pool.get_key_buffer(self._radix[0].layer_id)
        cos_sin = self._rotary.cos_sin_cache
        return ContextKV(
            hidden=self._kv_weights[0].shape[1], kv_heads=k_cache.shape[1], head_dim=k_cache.shape[2],
            rotary_dim=cos_sin.shape[1], dtype=self._kv_weights[0].dtype, pool_dtype=k_cache.dtype,
            cos_sin_dtype=cos_sin.dtype, bias=self._kv_biases is not None, is_neox=bool(self._rotary.is_neox_style),
        )

    def write(self, target_hidden, cache_loc, positions, cache_loc_2d=None, commit_lens=None) -> None:
        """What `_append_target_hidden_to_draft_kv_by_loc` does, with the per-layer work in one op.
        With `cache_loc_2d` [bs, B] and `commit_lens` [bs], only each row's first commit_lens
        tokens are written (the committed ones)."""
        worker = self._worker
        n = int(cache_loc.numel())
        if target_hidden.shape[0] > n:  # alignment padding rows (TP rounding), as SGLang trims them
            target_hidden = target_hidden[:n]
        if n == 0:
            return
        if cache_loc_2d is not None:
            block = cache_loc_2d.shape[1]
            cols = torch.arange(block, device=cache_loc_2d.device)
            kept = cols[None, :] < commit_lens.to(cache_loc_2d.device)[:, None]
            out_loc = torch.where(kept, cache_loc_2d, torch.full_like(cache_loc_2d, -1)).reshape(-1)
        else:
            out_loc = cache_loc
        pool = worker.draft_model_runner.token_to_kv_pool
        with torch.inference_mode():
            ctx = worker.draft_model.project_target_hidden(target_hidden)
            materialize_context_kv(
                ctx, self._kv_weights, self._kv_biases, self._k_norms, self._eps,
                self._rotary.cos_sin_cache, bool(self._rotary.is_neox_style), positions, out_loc,
                [pool.get_key_buffer(a.layer_id) for a in self._radix],
                [pool.get_value_buffer(a.layer_id) for a in self._radix], self._v_scale,
            )


def _problem(worker) -> str | None:
    """Why `materialize_context_kv` cannot stand in for this worker's per-layer path (None: it can)."""
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding
    from sglang.srt.models.dflash import DFlashDraftModel

    device = torch.device(worker.device)
    if device.type == "cuda":
        if not has_cuda_kernels():
            return "this build of sglang_dflash has no CUDA kernels"
        on, why = gpu_choice("materialize_context_kv", device)
        if not on:
            return f"our CUDA kernel is off here ({why}; SGLANG_DFLASH_DRAFT_ATTENTION=1 turns it on)"
    elif device.type != "cpu":
        return f"no kernel for device {device}"
    if getattr(worker, "use_compact_draft_cache", False):
        return "the compact draft window cache"
    model = worker.draft_model
    if type(model).prepare_context_hidden_for_kv is not DFlashDraftModel.prepare_context_hidden_for_kv:
        return f"{type(model).__name__} prepares context hidden states per layer"
    layers = list(getattr(model, "layers", ()))
    if not layers:
        return "the drafter has no layers"
    first = layers[0].self_attn
    for i, layer in enumerate(layers):
        a = layer.self_attn
        if not isinstance(getattr(a.qkv_proj, "quant_method", None), UnquantizedLinearMethod):
            return f"layer {i}'s qkv_proj is quantized"
        if type(a.k_norm) is not RMSNorm or getattr(a, "use_gemma_norm", False):
            return f"layer {i}'s k_norm is not a plain RMSNorm"
        if type(a.rotary_emb) is not RotaryEmbedding or not _same_rotary(a.rotary_emb, first.rotary_emb):
            return f"layer {i}'s rotary embedding is not SGLang's base RotaryEmbedding, the same in every layer"
        if a.v_scale != first.v_scale or a.k_norm.variance_epsilon != first.k_norm.variance_epsilon:
            return "the layers differ in v_scale or k-norm eps"
        if a.attn.k_scale is not None or a.attn.v_scale is not None:
            return "the draft KV cache is quantized (fp8 scales)"
        if a.qkv_proj.weight.dtype not in _FLOATS:
            return "the draft weights are not fp32/bf16/fp16"
    for flag in ("kv_cache_dtype", "speculative_draft_kv_cache_dtype"):
        value = getattr(worker.server_args, flag, None)
        if value not in (None, "auto"):
            return f"--{flag.replace('_', '-')} {value}"
    return None


def _same_rotary(a, b) -> bool:
    return a is b or (a.is_neox_style == b.is_neox_style and a.cos_sin_cache.shape == b.cos_sin_cache.shape
                      and torch.equal(a.cos_sin_cache, b.cos_sin_cache))
