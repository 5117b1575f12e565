"""DFLASH on CPU: the hooks that let SGLang 0.5.23 run DFLASH with `--device cpu`.

Stock SGLang refuses it in three places; each hook changes only the CPU case and leaves every
other device to SGLang:

1. `speculative_hook._handle_dflash` rejects `device == "cpu"`: during that call the module's
   `current_platform` is seen through a view that declares DFLASH supported (the path SGLang
   offers out-of-tree platforms); everything else about the platform is unchanged.
2. `speculative_hook._resolve_dflash_draft_attention_backend` (argument resolution) and
   `draft_worker_common.resolve_draft_worker_attention_backend` (the scheduler) only accept GPU
   backends for the draft and fall back to flashinfer: on CPU the draft gets `torch_native`.
3. `TorchNativeAttnBackend.forward_extend` has no TARGET_VERIFY path: on CPU DFLASH's (the
   target's verify, causal among the block rows; the draft's block forward, non-causal, when its
   layers are not already swapped by `attention.install_draft_attention`) run our
   `block_attention` kernel over the paged KV pool plus the block's own K/V.

4. `ModelRunner._extend_forward_kwargs` hands a model its `input_embeds` cast to bfloat16 (the
   draft gets the target's embeddings that way): on CPU they keep the model's dtype (fp32 here).
5. DFlashWorkerV2 calls `Tensor.record_stream` on its CPU tensors: a no-op there
   (`install_torch_cpu_shims`, installed by the worker on CPU).
6. Batch-invariant decoding, on every CPU server with the plugin installed, plain decoding
   included (`SGLANG_DFLASH_BATCH_INVARIANT=0` turns it off):
   - linear layers and the LM head fed with few rows (every decode and verify step) run our
     `skinny_linear` instead of `F.linear` / `torch.matmul` (the drafter's layers over their int8
     copies, `draft_int8.py`, where they have them, through `w8a8_linear` on VNNI CPUs): each
     weight read once, fp32 (or exact int32) accumulation, and each row's result bitwise
     independent of the other rows. fp32 and bf16
     inputs of more than 16 rows (prefill) keep torch's GEMM (bf16 in a bounded set of row
     counts, so oneDNN's per-shape memory stays bounded); fp16 ones always take the kernel,
     since torch's fp16 GEMM is slower on these CPUs at every row count (`models/skinny.py`);
   - decode attention (`TorchNativeAttnBackend.forward_decode`) runs `block_attention` with a
     block of one row, whose CPU kernel tiles keys by absolute position: a verify row's attention
     is bitwise the decode of that token;
   - prefill attention (`forward_extend` in EXTEND or MIXED mode) runs it too, each request's new
     tokens a causal block over its cached prefix: a prompt's K/V and first token are then the same
     bits whether the prefix cache held part of it or none (SGLang's SDPA blocks its keys by the
     query length, so a cached prefix changed the rounding, and a near-tie could flip the first
     token).
   So a verify pass computes, for every token, exactly the numbers plain decoding computes one
   token at a time: greedy DFLASH output equals the plain server's (with the plugin) token for
   token, by construction, at any batch size or block size.

The `*_cpu` index / KV-copy ops SGLang's speculative path calls through `torch.ops.sgl_kernel` are
registered from our extension, where this sgl-kernel lacks them, by the worker on CPU
(`sgl_kernel_ops.py`).

Registered by `plugin.register()` only when SGLANG_USE_CPU_ENGINE=1 (SGLang's switch for CPU
serving), so GPU processes never import this module.
"""

from __future__ import annotations

import contextlib
import logging

from sglang_dflash import settings
from sglang_dflash.serving import attention

logger = logging.getLogger(__name__)

HANDLE_DFLASH = "sglang.srt.arg_groups.speculative_hook._handle_dflash"
RESOLVE_DRAFT_BACKEND = "sglang.srt.arg_groups.speculative_hook._resolve_dflash_draft_attention_backend"
DRAFT_WORKER_BACKEND = "sglang.srt.speculative.draft_worker_common.resolve_draft_worker_attention_backend"
EXTEND_KWARGS = "sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs"
TORCH_NATIVE_EXTEND = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"
TORCH_NATIVE_DECODE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_decode"
UNQUANTIZED_LINEAR = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
LM_HEAD = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"
CPU_DRAFT_BACKEND = "torch_native"

HOOKS = ()  # filled below: (target, hook) pairs, all AROUND


def _device(server_args) -> str | None:
    from sglang.srt.arg_groups.overrides import resolving_view

    return resolving_view(server_args).device


class _DFlashCapablePlatform:
    """The current platform, but answering that it supports DFLASH (used only during the gate)."""

    def __init__(self, platform):
        self._platform = platform

    def __getattr__(self, name):
        return getattr(self._platform, name)

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm == "DFLASH" or self._platform.supports_speculative_algorithm(algorithm)


@contextlib.contextmanager
def _platform_supports_dflash(module):
    saved = module.current_platform
    module.current_platform = _DFlashCapablePlatform(saved)
    try:
        yield
    finally:
        module.current_platform = saved


def _handle_dflash_around(original, server_args, *args, **kwargs):
    if _device(server_args) != "cpu":
        return original(server_args, *args, **kwargs)
    import sglang.srt.arg_groups.speculative_hook as hook_module

    # The draft-backend resolution that _handle_dflash calls is hooked separately (below), so
    # the platform view only decides the device gate.
    with _platform_supports_dflash(hook_module):
        result = original(server_args, *args, **kwargs)
    # As SGLang does for its other speculative algorithms on CPU.
    disable_overlap = getattr(hook_module, "_disable_overlap_schedule_for_cpu", None)
    if disable_overlap is not None:
        disable_overlap(server_args)
    logger.info("sglang-dflash: DFLASH enabled on device cpu (sglang_dflash CPU kernels)")
    return result


def _resolve_draft_backend_around(original, server_args, *args, **kwargs):
    if _device(server_args) != "cpu":
        return original(server_args, *args, **kwargs)
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    asked = resolving_view(server_args).speculative_draft_attention_backend
    if asked not in (None, CPU_DRAFT_BACKEND):
        logger.warning(
            "sglang-dflash: DFLASH draft attention backend %r does not run on CPU; using %r",
            asked,
            CPU_DRAFT_BACKEND,
        )
    declare_resolution(
        server_args,
        "_resolve_dflash_draft_attention_backend",
        speculative_draft_attention_backend=CPU_DRAFT_BACKEND,
    )
    return None


def _draft_worker_backend_around(original, *args, **kwargs):
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.utils import is_cpu

    # Only for the DFLASH draft whose backend our argument hook resolved to torch_native.
    if (
        is_cpu()
        and kwargs.get("algo_label") in (None, "DFLASH")
        and get_spec().speculative_draft_attention_backend == CPU_DRAFT_BACKEND
    ):
        return CPU_DRAFT_BACKEND
    return original(*args, **kwargs)


def _extend_kwargs_around(original, runner, forward_batch, *args, **kwargs):
    result = original(runner, forward_batch, *args, **kwargs)
    embeds = result.get("input_embeds") if isinstance(result, dict) else None
    given = getattr(forward_batch, "input_embeds", None)
    dtype = getattr(runner, "dtype", None)
    if (
        embeds is not None
        and given is not None
        and given.device.type == "cpu"
        and dtype is not None
        and embeds.dtype != dtype
        and getattr(forward_batch, "replace_embeds", None) is None
    ):
        result["input_embeds"] = given.to(dtype)
    return result


def _torch_native_extend_around(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
    pool = backend.token_to_kv_pool
    k_cache = pool.get_key_buffer(layer.layer_id)
    where = dict(kv_pool=pool, req_to_token=backend.req_to_token_pool.req_to_token,
                 swa_loc=backend.swa_out_cache_loc, save_kv_cache=save_kv_cache)
    if not kw and attention.covers(layer, forward_batch, q, k_cache):
        return attention.paged_block_attention(q, k, v, layer, forward_batch, **where)
    if (not kw and k is not None and v is not None and batch_invariant_enabled()
            and attention.covers_prefill(layer, forward_batch, q, k_cache)):
        return attention.paged_prefill_attention(q, k, v, layer, forward_batch, **where)
    # Neither (e.g. an EAGLE/NGRAM tree with a custom mask, cross attention): SGLang's own path.
    return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kw)


def _dense_weight(layer):
    """The plain weight tensor of an unquantized layer (None for AMX-packed or wrapped weights)."""
    import torch

    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor) or getattr(layer, "use_intel_amx_backend", False):
        return None
    return weight


def _unquantized_linear_around(original, method, layer, x, bias=None, *args, **kwargs):
    from sglang_dflash.models.skinny import bounded_rows_linear, gemm_rows_bounded, linear, skinny, skinny_applies
    from sglang_dflash.serving.draft_int8 import int8_weight

    if not args and not kwargs:
        quantized = int8_weight(layer)  # the drafter's layers, in int8 (draft_int8.py)
        if quantized is not None and skinny_applies(x, quantized[0], bias, quantized[1]):
            return linear(x, quantized[0], bias, quantized[1])  # w8a8_linear where the CPU has VNNI
        weight = _dense_weight(layer)
        if weight is not None and skinny_applies(x, weight, bias):
            return skinny(x, weight, bias)
        if weight is not None and gemm_rows_bounded(x) and weight.dtype == x.dtype:
            return bounded_rows_linear(x, weight, bias)  # prefill: SGLang's F.linear, in bounded row counts
    return original(method, layer, x, bias, *args, **kwargs)


# SGLang's unquantized LM head methods, less the AMX-packed one (PackWeightMethod).
_PLAIN_HEAD_METHODS = ("NoneType", "UnquantizedEmbeddingMethod", "UnquantizedLinearMethod")


def _lm_head_around(original, processor, hidden_states, lm_head, embedding_bias=None, *args, **kwargs):
    from sglang_dflash.models.skinny import skinny, skinny_applies

    weight = _dense_weight(lm_head)
    # LoRA heads, fp32-head options and quantized heads keep SGLang's path.
    if (
        not args
        and embedding_bias is None
        and kwargs.keys() <= {"out"}
        and weight is not None
        and not hasattr(lm_head, "apply_lora")
        and not getattr(processor, "use_fp32_lm_head", False)
        and getattr(processor, "rl_on_policy_target", None) is None
        and type(getattr(lm_head, "quant_method", None)).__name__ in _PLAIN_HEAD_METHODS
        and skinny_applies(hidden_states, weight)
    ):
        return skinny(hidden_states, weight)
    return original(processor, hidden_states, lm_head, embedding_bias, *args, **kwargs)


def _torch_native_decode_around(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
    pool = backend.token_to_kv_pool
    if kw or k is None or v is None or not attention.covers_decode(layer, forward_batch, q,
                                                                     pool.get_key_buffer(layer.layer_id)):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kw)
    return attention.paged_block_attention(
        q, k, v, layer, forward_batch, kv_pool=pool, req_to_token=backend.req_to_token_pool.req_to_token,
        swa_loc=backend.swa_out_cache_loc, save_kv_cache=save_kv_cache, decode=True,
    )


HOOKS = (
    (HANDLE_DFLASH, _handle_dflash_around),
    (RESOLVE_DRAFT_BACKEND, _resolve_draft_backend_around),
    (DRAFT_WORKER_BACKEND, _draft_worker_backend_around),
    (EXTEND_KWARGS, _extend_kwargs_around),
    (TORCH_NATIVE_EXTEND, _torch_native_extend_around),
)


_torch_shims_installed = False


def install_torch_cpu_shims() -> None:
    """`Tensor.record_stream` on a CPU tensor: a no-op (CPU memory is not stream-ordered).

    DFlashWorkerV2 calls `batch.seq_lens.record_stream(current_stream())` on every decode step;
    with CPU tensors and torch's CPU stream torch raises "unknown parameter type". Installed by
    the worker, in the scheduler process, on CPU only; other tensors keep torch's method.
    """
    global _torch_shims_installed
    if _torch_shims_installed:
        return
    import torch

    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        if self.device.type == "cpu":
            return None
        return original(self, stream)

    record_stream.__wrapped__ = original
    torch.Tensor.record_stream = record_stream
    _torch_shims_installed = True


# Batch-invariant decoding (item 6 of the module docstring): few-row linear layers and decode
# attention through our kernels.
BATCH_INVARIANT_HOOKS = (
    (UNQUANTIZED_LINEAR, _unquantized_linear_around),
    (LM_HEAD, _lm_head_around),
    (TORCH_NATIVE_DECODE, _torch_native_decode_around),
)


def batch_invariant_enabled() -> bool:
    return settings.get(settings.BATCH_INVARIANT)


_hooks_registered = False


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    global _hooks_registered
    for target, hook in HOOKS + (BATCH_INVARIANT_HOOKS if batch_invariant_enabled() else ()):
        HookRegistry.register(target, hook, HookType.AROUND)
    _hooks_registered = True


def hooks_registered() -> bool:
    """Whether this process registered the CPU hooks (so TARGET_VERIFY attention runs ours)."""
    return _hooks_registered
