"""DFlashDraftModel: the block drafter of DESIGN.md section 1, with z-lab's state-dict names.

The model owns no embedding and no LM head (the target's are used). Context tokens enter once,
through `append_context` (fc -> hidden_norm -> per-layer k_proj/k_norm/RoPE and v_proj, written
to a paged `ContextCache`); `forward` runs one block per request with `block_attention` over
that cache plus the block's own K/V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dflash.models.config import DFlashConfig
from sglang_dflash.models.context_cache import ContextCache
from sglang_dflash.models.skinny import SkinnyLinear, linear
from sglang_dflash.ops import block_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; x [n, heads, D], cos/sin [n, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, d)
        self.q_proj = SkinnyLinear(h, self.num_heads * d, bias=bias)
        self.k_proj = SkinnyLinear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = SkinnyLinear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = SkinnyLinear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        k = self.k_norm(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = SkinnyLinear(h, i, bias=False)
        self.up_proj = SkinnyLinear(h, i, bias=False)
        self.down_proj = SkinnyLinear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """One pre-norm residual layer over block rows h [n, H]. `attend(q, k, v)` -> [n, Hq, D]
        supplies the attention over the context plus the block: `block_attention` over the paged
        cache at inference, a masked SDPA over a whole sequence in training."""
        attn = self.self_attn
        x = self.input_layernorm(h)
        q = apply_rope(attn.q_norm(attn.q_proj(x).view(-1, attn.num_heads, attn.head_dim)), cos, sin)
        k, v = attn.key_value(x, cos, sin)
        o = attend(q, k, v)
        h = h + attn.o_proj(o.reshape(o.shape[0], -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = SkinnyLinear(config.num_taps * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.cache: ContextCache | None = None
        self.draft_vocab: torch.Tensor | None = None  # token ids drafts may take (None: all); see checkpoint.py

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def allocate_cache(self, num_slots: int, max_requests: int, max_context: int) -> ContextCache:
        """Create (replacing any previous one) the paged context cache this model attends over."""
        c = self.config
        p = self.fc.weight
        self.cache = ContextCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, num_slots,
                                  max_requests, max_context, p.dtype, p.device)
        return self.cache

    @torch.no_grad()
    def append_context(self, reqs: list[int], counts: list[int], target_hidden: torch.Tensor) -> None:
        """Commit `counts[i]` context tokens of request `reqs[i]`; target_hidden [sum(counts), K*H]
        holds the concatenated tapped target hidden states, request-major, in position order."""
        if target_hidden.shape != (sum(counts), self.fc.in_features):
            raise ValueError(f"target_hidden has shape {tuple(target_hidden.shape)}, expected "
                             f"({sum(counts)}, {self.fc.in_features})")
        slots, positions = self.cache.extend(reqs, counts)
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = self._rope(positions, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_value(ctx, cos, sin)
            self.cache.k[i, slots] = k
            self.cache.v[i, slots] = v

    @torch.no_grad()
    def forward(self, block_embeds: torch.Tensor, reqs: torch.Tensor, block_size: int) -> torch.Tensor:
        """One draft step. block_embeds [bs*B, H]: target embeddings of [anchor, MASK x (B-1)] per
        request; reqs [bs]: cache rows. Returns the final-normed hidden states [bs*B, H]; the block
        of request b sits at absolute positions ctx_len_b .. ctx_len_b + B - 1."""
        cache = self.cache
        ctx_lens = cache.ctx_lens[reqs]
        positions = (ctx_lens[:, None] + torch.arange(block_size, device=reqs.device)).reshape(-1)
        h = block_embeds.to(self.fc.weight.dtype)
        cos, sin = self._rope(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            def attend(q, k, v, i=i):
                return block_attention(q, k, v, cache.k[i], cache.v[i], cache.req_to_token, reqs, ctx_lens,
                                       block_size, window=self.config.layer_window(i),
                                       causal_block=self.config.causal)

            h = layer(h, cos, sin, attend)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Draft logits through the target's LM head, with the checkpoint's output scaling."""
        logits = linear(hidden.to(lm_head_weight.dtype), lm_head_weight)
        if self.config.output_multiplier is not None:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = cap * torch.tanh(logits / cap)
        return logits
