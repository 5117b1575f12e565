"""Prompts that would kill SGLang 0.5.23's scheduler get one clear error for that request instead.

An empty prompt (`{"text": ""}` with a tokenizer that adds no BOS, or `{"input_ids": []}`) or a
token id outside the vocabulary in `input_ids` passes SGLang's tokenizer-side checks and then
crashes the scheduler process, taking the whole server down (stock SGLang on CPU too, with or
without speculation). A BEFORE hook on the tokenizer manager's per-request validation refuses
them there, where SGLang answers a ValueError with HTTP 400 and keeps serving. Registered by the
plugin in every SGLang process; only the tokenizer manager's process ever calls it.
"""

from __future__ import annotations

HOOK_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"


def check_prompt_ids(input_ids: list[int], vocab_size: int) -> None:
    """Raises ValueError naming the problem when the prompt cannot be served."""
    if len(input_ids) == 0:
        raise ValueError("the prompt is empty: it must have at least one token")
    low, high = min(input_ids), max(input_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")


def _before_validate(manager, obj, input_ids, *args, **kwargs):
    # input_ids is None for input_embeds requests; multimodal prompts carry placeholder ids.
    multimodal = any(getattr(obj, f, None) is not None for f in ("image_data", "video_data", "audio_data"))
    if input_ids is not None and not multimodal:
        check_prompt_ids(input_ids, int(manager.model_config.vocab_size))


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, _before_validate, HookType.BEFORE)
