"""DFlashDraftModel: the block drafter of DESIGN.md section 1, with z-lab's state-dict names.

The model owns no embedding and no LM head (the target's are used). Context tokens enter once,
through `append_context` (fc -> hidden_norm -> per-layer k_proj/k_norm/RoPE and v_proj, written
to a paged `ContextCache`); `forward` runs one block per request with `block_attention` over
that cache plus the block's own K/V.

A draft step on the CPU is a few rows through small matrices, so its time goes to the number of
ops more than to arithmetic: at inference on the CPU the norms (and the q / k norm + RoPE) run as
one `rms_norm_rope` call each and the context K/V of all layers as one `materialize_context_kv`
call, instead of ~8 and ~14 elementwise ops and a per-layer loop. Training (autograd) and other
devices run the same math in PyTorch.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dflash.models.config import DFlashConfig
from sglang_dflash.models.context_cache import ContextCache
from sglang_dflash.models.skinny import Int8Linear, SkinnyLinear, linear
from sglang_dflash.ops import block_attention, cpu_kernel_applies, materialize_context_kv, rms_norm_rope


def _kernel_applies(op: str, x: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether the CPU inference kernel `op` may stand in for the PyTorch math on x (with these
    parameters): `cpu_kernel_applies`, and nothing that needs autograd (training runs this model)."""
    return (not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)))
            and cpu_kernel_applies(op, x, *params))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _kernel_applies("rms_norm_rope", x, self.weight):
            return rms_norm_rope(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; x [n, heads, D], cos/sin [n, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Rotary:
    """Rotate-half RoPE at `positions` [n] for rows of one dtype: `norm_rope(norm, x)` is
    apply_rope(norm(x)) for x [n, heads, D], through `rms_norm_rope` over the model's cos/sin table
    where that kernel applies, else in PyTorch with cos / sin rows [n, D] in `dtype`."""

    def __init__(self, model: DFlashDraftModel, positions: torch.Tensor, dtype: torch.dtype):
        self.model, self.positions, self.dtype = model, positions, dtype

    @functools.cached_property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = self.positions.float()[:, None] * self.model.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @functools.cached_property
    def table(self) -> torch.Tensor:
        """The model's fp32 cos/sin table, covering these positions."""
        return self.model.cos_sin_table(int(self.positions.max()) + 1 if self.positions.numel() else 0)

    def norm_rope(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        if _kernel_applies("rms_norm_rope", x, norm.weight):
            return rms_norm_rope(x, norm.weight, norm.eps, self.table, self.positions)
        return apply_rope(norm(x), *self.cos_sin)


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

    def key_value(self, x: torch.Tensor, rotary: Rotary):
        k = rotary.norm_rope(self.k_norm, self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim))
        return k, self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)


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

    def forward(self, h: torch.Tensor, rotary: Rotary, attend) -> torch.Tensor:
        """One pre-norm residual layer over block rows h [n, H] at the positions of `rotary`.
        `attend(q, k, v)` -> [n, Hq, D] supplies the attention over the context plus the block:
        `block_attention` over the paged cache at inference, a masked SDPA over a whole sequence in
        training."""
        attn = self.self_attn
        x = self.input_layernorm(h)
        q = rotary.norm_rope(attn.q_norm, attn.q_proj(x).view(-1, attn.num_heads, attn.head_dim))
        k, v = attn.key_value(x, rotary)
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
        self._cos_sin_table: torch.Tensor | None = None  # cos_sin_table()'s, built on first use
        self._kv_projections: dict[int, tuple] = {}  # _kv_projection()'s, per attention module
        self.draft_vocab: torch.Tensor | None = None  # token ids drafts may take (None: all); see checkpoint.py

    @property
    def dtype(self) -> torch.dtype:
        """The dtype activations, the context cache and the float weights have (an int8 model's
        quantized weights are int8)."""
        return self.norm.weight.dtype

    def quantize_weights(self) -> int:
        """Weight-only int8 (`Int8Linear`, one scale per row) for fc and every projection except
        k_proj / v_proj, which `materialize_context_kv` reads in the model's dtype (1.3 MB in bf16
        for SmolLM2's drafter, of 24); inference only. Returns how many layers it converted."""
        converted = 0
        for parent in list(self.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and name not in ("k_proj", "v_proj"):
                    setattr(parent, name, Int8Linear(child))
                    converted += 1
        return converted

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        return Rotary(self, positions, dtype)

    def cos_sin_table(self, positions: int) -> torch.Tensor:
        """fp32 [P, D] with P >= positions: row p holds cos, then sin, of the D / 2 angles of
        position p (SGLang's cos_sin_cache layout, for `rms_norm_rope` / `materialize_context_kv`);
        computed as `Rotary.cos_sin` computes them, grown by doubling when a longer context comes."""
        table = self._cos_sin_table
        if table is None or table.shape[0] < positions or table.device != self.inv_freq.device:
            rows = max(positions, 2 * (0 if table is None else table.shape[0]), 1024)
            freqs = torch.arange(rows, device=self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
            table = self._cos_sin_table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        return table

    def allocate_cache(self, num_slots: int, max_requests: int, max_context: int) -> ContextCache:
        """Create (replacing any previous one) the paged context cache this model attends over."""
        c = self.config
        self.cache = ContextCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, num_slots,
                                  max_requests, max_context, self.dtype, self.norm.weight.device)
        return self.cache

    @torch.no_grad()
    def append_context(self, reqs: list[int], counts: list[int], target_hidden: torch.Tensor) -> None:
        """Commit `counts[i]` context tokens of request `reqs[i]`; target_hidden [sum(counts), K*H]
        holds the concatenated tapped target hidden states, request-major, in position order."""
        if target_hidden.shape != (sum(counts), self.fc.in_features):
            raise ValueError(f"target_hidden has shape {tuple(target_hidden.shape)}, expected "
                             f"({sum(counts)}, {self.fc.in_features})")
        slots, positions = self.cache.extend(reqs, counts)
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.dtype)))
        attns = [layer.self_attn for layer in self.layers]
        rotary = self.rotary(positions, ctx.dtype)
        if _kernel_applies("materialize_context_kv", ctx):
            weights, biases = zip(*(self._kv_projection(a) for a in attns), strict=True)
            materialize_context_kv(ctx, weights, None if biases[0] is None else biases,
                                   [a.k_norm.weight for a in attns], attns[0].k_norm.eps, rotary.table, True,
                                   positions, slots, list(self.cache.k), list(self.cache.v))
            return
        for i, attn in enumerate(attns):
            k, v = attn.key_value(ctx, rotary)
            self.cache.k[i, slots] = k
            self.cache.v[i, slots] = v

    def _kv_projection(self, attn: DFlashAttention) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k_proj and v_proj stacked (weight [2 * Hkv * D, H], bias or None), as materialize_context_kv
        takes them; kept while neither changes (an optimizer step or a load bumps their versions)."""
        params = [p for p in (attn.k_proj.weight, attn.v_proj.weight, attn.k_proj.bias, attn.v_proj.bias)
                  if p is not None]
        key = tuple((p.data_ptr(), p._version) for p in params)
        cached = self._kv_projections.get(id(attn))
        if cached is None or cached[0] != key:
            bias = None if attn.k_proj.bias is None else torch.cat([attn.k_proj.bias, attn.v_proj.bias])
            cached = self._kv_projections[id(attn)] = (key, torch.cat([attn.k_proj.weight, attn.v_proj.weight]), bias)
        return cached[1], cached[2]

    @torch.no_grad()
    def forward(self, block_embeds: torch.Tensor, reqs: torch.Tensor, block_size: int) -> torch.Tensor:
        """One draft step. block_embeds [bs*B, H]: target embeddings of [anchor, MASK x (B-1)] per
        request; reqs [bs]: cache rows. Returns the final-normed hidden states [bs*B, H]; the block
        of request b sits at absolute positions ctx_len_b .. ctx_len_b + B - 1."""
        cache = self.cache
        ctx_lens = cache.ctx_lens[reqs]
        positions = (ctx_lens[:, None] + torch.arange(block_size, device=reqs.device)).reshape(-1)
        h = block_embeds.to(self.dtype)
        rotary = self.rotary(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            def attend(q, k, v, i=i):
                return block_attention(q, k, v, cache.k[i], cache.v[i], cache.req_to_token, reqs, ctx_lens,
                                       block_size, window=self.config.layer_window(i),
                                       causal_block=self.config.causal)

            h = layer(h, rotary, attend)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor,
               lm_head_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Draft logits through the target's LM head (int8 with its row scales when lm_head_scale
        is given), with the checkpoint's output scaling."""
        dtype = self.dtype if lm_head_scale is not None else lm_head_weight.dtype
        logits = linear(hidden.to(dtype), lm_head_weight, None, lm_head_scale)
        if self.config.output_multiplier is not None:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = cap * torch.tanh(logits / cap)
        return logits
