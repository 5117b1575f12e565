"""The served drafter's norms on the CPU through `rms_norm_rope`: one op where SGLang runs ~12-30.

A DFLASH draft step on the CPU pushes a few rows through 3-5 small layers, so its time goes to the
number of torch ops more than to arithmetic. On a CPU without AMX, SGLang's draft layers run each
RMSNorm as ~12 torch ops (`RMSNorm.forward_native`: fp32 cast, residual add, pow, mean, rsqrt,
weight, casts) and each attention's q / k norm + RoPE as ~30 (`apply_qk_norm`, then
`RotaryEmbedding.forward_native`).

`install_draft_norms(worker)` wraps, per instance and only in the drafter (the target keeps
SGLang's modules, so plain and verify numerics are untouched), on the CPU:

- every plain `RMSNorm` of the draft model: `rms_norm_rope(x [+ residual], weight, eps)`; with a
  residual, the sum is formed in the activations' dtype (what SGLang returns as the new residual),
  and normalized from there;
- every draft attention whose q / k norms are plain RMSNorms and whose RoPE is SGLang's base
  `RotaryEmbedding` over the whole head (neox): q and k normalized and rotated by one
  `rms_norm_rope` call each, straight from their views into the fused qkv projection, with the
  rotary module's own cos_sin_cache; the rest of the forward (projections, v scale, attention,
  output) is SGLang's.

Drafts only propose, so neither can change the served output; they change the draft numbers by
fp32 rounding at most (one rounding instead of SGLang's per-op ones). A call the wrapper does not
cover (another device or dtype, autograd, arguments it does not know) goes to SGLang's forward.
"""

from __future__ import annotations

import logging

import torch

from sglang_dflash.ops import cpu_kernel_applies, rms_norm_rope

logger = logging.getLogger(__name__)

_ORIGINAL = "_sglang_dflash_original_forward"


def _plain_rms_norm(norm) -> bool:
    from sglang.srt.layers.layernorm import RMSNorm

    return (type(norm) is RMSNorm and norm.has_weight and norm.variance_size_override is None
            and not norm.fp32_residual and norm.override_orig_dtype is None
            and getattr(norm, "_quant_linear", None) is None)


def _wrap_norm(norm) -> None:
    original = norm.forward

    def forward(x, residual=None, *args, _norm=norm, _original=original, **kwargs):
        extra = any(a is not None for a in (*args, *kwargs.values()))  # a post-residual addition, a fused quant
        if extra or not cpu_kernel_applies("rms_norm_rope", x, _norm.weight):
            return _original(x, residual, *args, **kwargs)
        if residual is not None:
            x = residual = x + residual
        out = rms_norm_rope(x, _norm.weight, _norm.variance_epsilon)
        return out if residual is None else (out, residual)

    setattr(norm, _ORIGINAL, original)
    norm.forward = forward


def _covered_attention(attn) -> bool:
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    rotary = getattr(attn, "rotary_emb", None)
    return (_plain_rms_norm(attn.q_norm) and _plain_rms_norm(attn.k_norm) and not getattr(attn, "use_gemma_norm", False)
            and type(rotary) is RotaryEmbedding and rotary.rotary_dim == attn.head_dim and rotary.is_neox_style
            and getattr(attn, "attention_sink_bias", None) is None)


def _wrap_attention(attn) -> None:
    original = attn.forward

    def forward(positions, hidden_states, forward_batch, _a=attn, _original=original):
        if not cpu_kernel_applies("rms_norm_rope", hidden_states, _a.q_norm.weight, _a.k_norm.weight):
            return _original(positions=positions, hidden_states=hidden_states, forward_batch=forward_batch)
        qkv, _ = _a.qkv_proj(hidden_states)
        q, k, v = qkv.split([_a.q_size, _a.kv_size, _a.kv_size], dim=-1)
        cos_sin = _a.rotary_emb.cos_sin_cache
        q = rms_norm_rope(q.view(-1, _a.num_heads, _a.head_dim), _a.q_norm.weight, _a.q_norm.variance_epsilon,
                          cos_sin, positions).view(-1, _a.q_size)
        k = rms_norm_rope(k.view(-1, _a.num_kv_heads, _a.head_dim), _a.k_norm.weight, _a.k_norm.variance_epsilon,
                          cos_sin, positions).view(-1, _a.kv_size)
        if _a.v_scale is not None:
            v = v * _a.v_scale
        out = _a.apply_attention_output(_a.attn(q, k, v, forward_batch), hidden_states)
        return _a.o_proj(out)[0]

    setattr(attn, _ORIGINAL, original)
    attn.forward = forward


def install_draft_norms(model, device: torch.device) -> tuple[int, int]:
    """Wrap the draft model's plain RMSNorms and covered attentions (see the module docstring);
    returns how many of each. Call once rms_norm_rope has passed its self-test on the CPU."""
    if device.type != "cpu" or not isinstance(model, torch.nn.Module):
        return 0, 0
    attentions = [layer.self_attn for layer in getattr(model, "layers", ())
                  if getattr(layer, "self_attn", None) is not None and _covered_attention(layer.self_attn)]
    inner = {id(a.q_norm) for a in attentions} | {id(a.k_norm) for a in attentions}
    norms = [m for m in model.modules() if _plain_rms_norm(m) and id(m) not in inner]
    for module in norms:
        if getattr(module, _ORIGINAL, None) is None:
            _wrap_norm(module)
    for attn in attentions:
        if getattr(attn, _ORIGINAL, None) is None:
            _wrap_attention(attn)
    return len(norms), len(attentions)
