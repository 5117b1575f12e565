"""DFlashDraftModel: the block drafter of docs/design.md §1, with z-lab's state-dict names.

The model owns no embedding and no LM head (the target's are used). Context tokens enter once,
through `append_context` (fc -> hidden_norm -> per-layer k_proj/k_norm/RoPE and v_proj, written
to a paged `ContextCache`); `forward` runs one block per request with `block_attention` over
that cache plus the block's own K/V.

DFlash-2 drafters add a `BlockConv` around each layer's attention and MLP (conv.py) and, with a
path selector (selector.py), choose each block's drafts jointly over the LM head's top-k per
position (`draft_path`). Config variants (Gemma norms, partial or interleaved rotary, a value
scale) are config.py's.

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
from sglang_dflash.models.conv import BlockConv
from sglang_dflash.models.selector import PathSelector
from sglang_dflash.models.skinny import Int8Linear, SkinnyLinear, linear
from sglang_dflash.ops import block_attention, cpu_kernel_applies, materialize_context_kv, rms_norm_rope


def _kernel_applies(op: str, x: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether the CPU inference kernel `op` may stand in for the PyTorch math on x (with these
    parameters): `cpu_kernel_applies`, and nothing that needs autograd (training runs this model)."""
    return (not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)))
            and cpu_kernel_applies(op, x, *params))


class RMSNorm(nn.Module):
    """RMSNorm scaling by `weight`, or by 1 + weight for Gemma-style checkpoints (`gemma`)."""

    def __init__(self, dim: int, eps: float, gemma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self.eps, self.gemma = eps, gemma

    @property
    def scale(self) -> torch.Tensor:
        return self.weight + 1 if self.gemma else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale
        if _kernel_applies("rms_norm_rope", x, scale):
            return rms_norm_rope(x, scale, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return scale * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool = True) -> torch.Tensor:
    """RoPE of the first 2 * R dims of x [n, heads, D] by angles with cos / sin [n, R]: pairs
    (i, i + R) when `neox` (rotate-half), else (2i, 2i + 1); the other dims pass through."""
    half = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    head, tail = x[..., : 2 * half], x[..., 2 * half :]
    if neox:
        x1, x2 = head.chunk(2, dim=-1)
        head = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = head[..., 0::2], head[..., 1::2]
        head = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([head, tail], dim=-1)


class Rotary:
    """RoPE at `positions` [n] for rows of one dtype: `norm_rope(norm, x)` is apply_rope(norm(x))
    for x [n, heads, D], through `rms_norm_rope` over the model's cos/sin table where that kernel
    applies, else in PyTorch with cos / sin rows [n, rotary_dim / 2] in `dtype`."""

    def __init__(self, model: DFlashDraftModel, positions: torch.Tensor, dtype: torch.dtype):
        self.model, self.positions, self.dtype = model, positions, dtype

    @functools.cached_property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = self.positions.float()[:, None] * self.model.inv_freq[None, :]
        return freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)

    @functools.cached_property
    def table(self) -> torch.Tensor:
        """The model's fp32 cos/sin table, covering these positions."""
        return self.model.cos_sin_table(int(self.positions.max()) + 1 if self.positions.numel() else 0)

    def norm_rope(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        scale, neox = norm.scale, self.model.config.rope_is_neox_style
        if _kernel_applies("rms_norm_rope", x, scale):
            return rms_norm_rope(x, scale, norm.eps, self.table, self.positions, neox)
        return apply_rope(norm(x), *self.cos_sin, neox)


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, d)
        self.q_proj = SkinnyLinear(h, self.num_heads * d, bias=bias)
        self.k_proj = SkinnyLinear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = SkinnyLinear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = SkinnyLinear(self.num_heads * d, h, bias=bias)  # as Qwen3's and SGLang's DFLASH o_proj
        self.q_norm = RMSNorm(d, config.rms_norm_eps, config.use_gemma_norm)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, config.use_gemma_norm)
        self.v_scale = config.attention_value_scale

    def key_value(self, x: torch.Tensor, rotary: Rotary):
        k = rotary.norm_rope(self.k_norm, self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        return k, v if self.v_scale is None else v * self.v_scale


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
        self.config = config
        h, eps, gemma = config.hidden_size, config.rms_norm_eps, config.use_gemma_norm
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(h, eps, gemma)
        self.post_attention_layernorm = RMSNorm(h, eps, gemma)
        taps, group = config.conv_kernel_size, config.conv_group_size
        self.attention_conv = BlockConv(h, taps, group) if taps else None
        self.mlp_conv = BlockConv(h, taps, group) if taps else None

    def forward(self, h: torch.Tensor, rotary: Rotary, attend, block_size: int | None = None) -> torch.Tensor:
        """One pre-norm residual layer over block rows h [n, H] at the positions of `rotary`.
        `attend(q, k, v)` -> [n, Hq, D] supplies the attention over the context plus the block:
        `block_attention` over the paged cache at inference, a masked SDPA over a whole sequence in
        training. h holds whole blocks of `block_size` rows (default: the config's), which a DFlash-2
        layer's convolutions run along."""
        block_size = block_size or self.config.block_size
        attn = self.self_attn
        x = self.input_layernorm(h)
        if self.attention_conv is not None:
            x, out_delta = self.attention_conv.prepare(x, block_size)
        q = rotary.norm_rope(attn.q_norm, attn.q_proj(x).view(-1, attn.num_heads, attn.head_dim))
        k, v = attn.key_value(x, rotary)
        o = attend(q, k, v)
        o = attn.o_proj(o.reshape(o.shape[0], -1))
        if self.attention_conv is not None:
            o = self.attention_conv.finish(o, out_delta, block_size)
        h = h + o
        x = self.post_attention_layernorm(h)
        if self.mlp_conv is None:
            return h + self.mlp(x)
        x, out_delta = self.mlp_conv.prepare(x, block_size)
        return h + self.mlp_conv.finish(self.mlp(x), out_delta, block_size)


class DFlashDraftModel(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        h, eps, gemma = config.hidden_size, config.rms_norm_eps, config.use_gemma_norm
        self.fc = SkinnyLinear(config.num_taps * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps, gemma)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, eps, gemma)
        self.candidate_selector = (
            PathSelector(h, config.vocab_size, config.selector_rank, config.selector_top_k)
            if config.has_selector else None)
        r = config.rope_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
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
        """fp32 [P, R] with P >= positions (R: the rotary dim): row p holds cos, then sin, of the R / 2 angles of
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
                                   [a.k_norm.scale for a in attns], attns[0].k_norm.eps, rotary.table,
                                   self.config.rope_is_neox_style, positions, slots, list(self.cache.k),
                                   list(self.cache.v), attns[0].v_scale or 1.0)
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

            h = layer(h, rotary, attend, block_size)
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

    def draft_path(self, hidden: torch.Tensor, anchors: torch.Tensor, lm_head_weight: torch.Tensor,
                   lm_head_scale: torch.Tensor | None = None, vocab: torch.Tensor | None = None,
                   greedy: torch.Tensor | None = None, temperatures: torch.Tensor | None = None,
                   uniforms: torch.Tensor | None = None):
        """A DFlash-2 drafter's drafts for blocks with final hidden states hidden [b, E, H] of the
        positions after their anchors [b]: the LM head's `selector_top_k` best tokens per position
        (`logits`; `vocab` maps a restricted head's rows to token ids), the selector's lattice over
        them and one walk (greedy [b] bool, default all greedy; see selector.py). Returns tokens
        [b, E], q [b, E, K] and the candidates [b, E, K] (token ids, best first)."""
        selector = self.candidate_selector
        if selector is None:
            raise ValueError("draft_path: this drafter has no path selector (dflash_config.selector_rank)")
        unary, picks = self.logits(hidden, lm_head_weight, lm_head_scale).float().topk(selector.top_k, dim=-1)
        candidates = picks if vocab is None else vocab[picks]
        scores = selector.lattice(candidates, unary, hidden, anchors)
        if greedy is None:
            greedy = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        tokens, q = selector.walk(candidates, scores, greedy, temperatures, uniforms)
        return tokens, q, candidates
