"""DFlash-2 drafters (and the other config variants models/ reads) against SGLang's own DFLASH
draft model, in this process on the CPU, on one random checkpoint written by `save_draft`.

SGLang builds its `DFlash2DraftModel` / `DFlashDraftModel` from that checkpoint's config.json
(through transformers' AutoConfig, as its loader does) and reads the safetensors through its own
`load_weights`: every one of its parameters must be written (they are NaN-poisoned first), which
tests our config and tensor names against its loader. Its draft forward then runs as it is, layers,
norms, rotary, grouped convolutions, context projection and all, except for the attention kernel
(`RadixAttention` needs a serving batch and backend): each layer's is replaced by a stand-in that
does what SGLang's DFLASH attention does on the CPU-less path we cannot run -- softmax attention of
each block's rows over the context K/V (made with SGLang's own `kv_proj_only`, `apply_k_norm` and
`apply_k_rope`) plus the block, with the layer's causality and sliding window. Our forward runs
with its paged cache and block_attention. The path selector is SGLang's: `compute_candidates`
through a stand-in LM head, `build_lattice` and its CPU `sample_path`, fed the same hidden states as
ours. fp32 throughout; TorchDynamo is disabled so SGLang's compiled helpers run eagerly (the same
operations). Skipped when SGLang is not installed."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import load_file

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install_sglang_cpu.sh VENV installs it beside the package)",
                allow_module_level=True)

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's CPU platform

from sglang.srt.models import dflash as sgl_dflash  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from sglang_dflash.models import DFlashConfig, DFlashDraftModel, load_draft, save_draft  # noqa: E402

H, VOCAB, TARGET_LAYERS = 64, 160, 12
TOL = dict(rtol=2e-5, atol=2e-5)

BASE = dict(hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=VOCAB, block_size=8, mask_token_id=VOCAB - 1, target_layer_ids=(1, 5, 9),
            num_target_layers=TARGET_LAYERS, rope_theta=10000.0, max_position_embeddings=512)
CASES = {
    # DFlash-2: convolutions (two and three taps) and the selector
    "dflash2": dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4),
    "dflash2-3taps-causal": dict(conv_kernel_size=3, conv_group_size=8, selector_rank=4, selector_top_k=6,
                                 causal=True, output_multiplier=0.5, final_logit_softcapping=3.0),
    # the other variants, with a DFlash-2 convolution but no selector
    "variants": dict(conv_kernel_size=2, conv_group_size=32, use_gemma_norm=True, rotary_dim=8,
                     attention_value_scale=0.7, causal=True, layer_types=("sliding_attention", "full_attention"),
                     sliding_window=6),
    "interleaved-rope": dict(rope_is_neox_style=False, rotary_dim=12),
}


@pytest.fixture(autouse=True)
def _sglang_cpu():
    """SGLang's modules read the tensor-parallel width; its compiled helpers run eagerly."""
    with get_parallel().override(tp_size=1, tp_rank=0, tp_group=None), torch._dynamo.config.patch(disable=True):
        yield


def _random_draft(case: str, seed: int = 0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(DFlashConfig(**{**BASE, **CASES[case]}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.3, 0.3) if model.config.use_gemma_norm else p.uniform_(0.7, 1.3)
            else:
                p.normal_(0.0, 0.2)
    return model.eval()


def _sglang_model(directory):
    """SGLang's draft model built from our config.json, loaded from our safetensors."""
    config = AutoConfig.from_pretrained(directory)
    cls = getattr(sgl_dflash, config.architectures[0])
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.load_weights(load_file(directory / "model.safetensors").items())
    unloaded = [n for n, p in model.named_parameters() if p.isnan().any()]
    assert not unloaded, f"SGLang's loader left these unwritten: {unloaded}"
    return model


class _ContextAttention(torch.nn.Module):
    """Stand-in for a layer's RadixAttention: each block's rows attend over their request's context
    K/V (set per step) and the block's own K/V, with the layer's causality and sliding window in
    SGLang's conventions (window_left: keys at most that many positions back)."""

    def __init__(self, radix, block_size: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = radix.tp_q_head_num, radix.tp_k_head_num, radix.qk_head_dim
        self.scaling, self.window_left = radix.scaling, radix.sliding_window_size
        self.causal = radix.attn_type == sgl_dflash.AttentionType.DECODER
        self.block_size, self.contexts = block_size, []

    def forward(self, q, k, v, forward_batch, **kwargs):
        assert not kwargs, kwargs
        b, d, group = self.block_size, self.head_dim, self.heads // self.kv_heads
        out = []
        for i, (ctx_k, ctx_v) in enumerate(self.contexts):
            rows = slice(i * b, (i + 1) * b)
            keys = torch.cat([ctx_k, k[rows]]).view(-1, self.kv_heads, d).repeat_interleave(group, 1)
            values = torch.cat([ctx_v, v[rows]]).view(-1, self.kv_heads, d).repeat_interleave(group, 1)
            n_ctx = ctx_k.shape[0]
            q_pos = n_ctx + torch.arange(b)
            k_pos = torch.arange(n_ctx + b)
            visible = torch.ones(b, n_ctx + b, dtype=torch.bool)
            if self.causal:
                visible &= k_pos[None] <= q_pos[:, None]
            if self.window_left >= 0:
                visible &= q_pos[:, None] - k_pos[None] <= self.window_left
            scores = torch.einsum("ihd,jhd->hij", q[rows].view(b, self.heads, d), keys) * self.scaling
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out.append(torch.einsum("hij,jhd->ihd", probs, values).reshape(b, -1))
        return torch.cat(out)


def _sglang_block_hidden(model, target_hidden, counts, block_embeds, block_size):
    """SGLang's draft forward of one block per request over contexts of `counts` tokens."""
    ctx = model.project_target_hidden(target_hidden)
    for layer in model.layers:
        if not isinstance(layer.self_attn.attn, _ContextAttention):
            layer.self_attn.attn = _ContextAttention(layer.self_attn.attn, block_size)
        attn = layer.self_attn
        attn.attn.block_size, attn.attn.contexts = block_size, []
        for part in ctx.split(counts):
            k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(layer, part))
            k = attn.apply_k_rope(torch.arange(part.shape[0]), attn.apply_k_norm(k))
            attn.attn.contexts.append((k, v))
    model.set_block_size(block_size)
    positions = torch.cat([n + torch.arange(block_size) for n in counts])
    out = model(input_ids=None, positions=positions, forward_batch=None, input_embeds=block_embeds)
    return out.hidden_states


def _our_block_hidden(model, target_hidden, counts, block_embeds, block_size):
    cache = model.allocate_cache(sum(counts) + 8, len(counts), max(counts) + 8)
    reqs = [cache.add_request() for _ in counts]
    model.append_context(reqs, counts, target_hidden)
    return model(block_embeds, torch.tensor(reqs), block_size)


@pytest.mark.parametrize("case", list(CASES))
def test_draft_forward_matches_sglang(case, tmp_path):
    ours = _random_draft(case)
    save_draft(ours, tmp_path)
    theirs = _sglang_model(tmp_path)
    assert type(theirs).__name__ == ("DFlash2DraftModel" if ours.config.has_selector else "DFlashDraftModel")
    loaded = load_draft(tmp_path)
    gen = torch.Generator().manual_seed(1)
    counts = [5, 11]
    target_hidden = torch.randn(sum(counts), ours.config.num_taps * H, generator=gen)
    for block_size in (ours.config.block_size, 4):  # the checkpoint's, and an adaptive smaller block
        embeds = torch.randn(len(counts) * block_size, H, generator=gen)
        expected = _sglang_block_hidden(theirs, target_hidden, counts, embeds, block_size)
        torch.testing.assert_close(_our_block_hidden(ours, target_hidden, counts, embeds, block_size), expected, **TOL)
        torch.testing.assert_close(_our_block_hidden(loaded, target_hidden, counts, embeds, block_size),
                                   expected, **TOL)


class _Head(torch.nn.Module):
    """The attributes SGLang's candidate_topk reads from a target LM head (unquantized, one rank)."""

    def __init__(self, weight):
        super().__init__()
        self.weight, self.org_vocab_size, self.quant_method = weight, weight.shape[0], None


@pytest.mark.parametrize("case", ["dflash2", "dflash2-3taps-causal"])
def test_selector_matches_sglang(case, tmp_path):
    ours = _random_draft(case, seed=2)
    save_draft(ours, tmp_path)
    theirs = _sglang_model(tmp_path)
    gen = torch.Generator().manual_seed(3)
    bs, positions, top_k = 5, ours.config.block_size - 1, ours.config.selector_top_k
    head = torch.randn(VOCAB, H, generator=gen) * 0.3
    theirs.lm_head = _Head(head)
    hidden = torch.randn(bs, positions, H, generator=gen)
    anchors = torch.randint(0, VOCAB, (bs,), generator=gen)
    greedy = torch.tensor([True, False, False, True, False])
    temperatures = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.4])
    uniforms = torch.rand(bs, positions, generator=gen)

    ids, unary = theirs.compute_candidates(hidden.reshape(-1, H))
    ids, unary = ids.view(bs, positions, top_k), unary.view(bs, positions, top_k)
    scores = theirs.candidate_selector.build_lattice(candidate_ids=ids, unary_logits=unary, hidden_states=hidden,
                                                     anchor_token_ids=anchors)
    tokens, q = theirs.candidate_selector.sample_path(candidate_ids=ids, scores=scores, uniforms=uniforms,
                                                      temperatures=temperatures, greedy_mask=greedy)

    our_tokens, our_q, our_ids = ours.draft_path(hidden, anchors, head, greedy=greedy, temperatures=temperatures,
                                                 uniforms=uniforms)
    assert torch.equal(our_ids, ids)
    our_unary = ours.logits(hidden, head).float().topk(top_k, dim=-1).values
    torch.testing.assert_close(our_unary, unary, **TOL)
    torch.testing.assert_close(ours.candidate_selector.lattice(ids, unary, hidden, anchors), scores, **TOL)
    assert torch.equal(our_tokens, tokens)
    torch.testing.assert_close(our_q, q, **TOL)
    assert (q[~greedy].amax(-1) < 0.99).all() and torch.equal(q[greedy].amax(-1), torch.ones(2, positions))


def test_saved_config_is_sglangs_schema(tmp_path):
    """The fields SGLang's DFLASH parser reads from our DFlash-2 config.json are the ones we meant."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    ours = _random_draft("dflash2-3taps-causal")
    save_draft(ours, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    parsed = parse_dflash_draft_config(draft_hf_config=AutoConfig.from_pretrained(tmp_path))
    c = ours.config
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert (parsed.block_size, parsed.conv_kernel_size, parsed.conv_group_size) == (8, 3, 8)
    assert (parsed.selector_rank, parsed.selector_top_k) == (c.selector_rank, c.selector_top_k)
    assert (parsed.output_multiplier, parsed.final_logit_softcapping) == (0.5, 3.0)
    assert parsed.target_layer_ids == list(c.target_layer_ids) and parsed.mask_token_id == c.mask_token_id
    assert DFlashConfig.from_dict(raw) == DFlashConfig(**{**BASE, **CASES["dflash2-3taps-causal"],
                                                          "layer_types": ("full_attention",) * 2})
