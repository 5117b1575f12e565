"""The served drafter's norms through rms_norm_rope (sglang_dflash/serving/draft_norms.py), against
SGLang's own modules on the CPU: its RMSNorm (with and without a residual) and its q / k norm +
RoPE (`apply_qk_norm`, then the base `RotaryEmbedding`). The attention's projections and attention
call are stand-ins recording what SGLang's forward would hand them (a real DFlashAttention needs
SGLang's tensor-parallel state); the norms, rotary module and cos/sin table are SGLang's.

Skipped when SGLang is not installed."""

from __future__ import annotations

import importlib.util
import os
import types

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install_sglang_cpu.sh VENV installs it beside the package)",
                allow_module_level=True)

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's CPU platform (its RoPE, not vllm's)

from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm  # noqa: E402
from sglang.srt.layers.rotary_embedding import get_rope  # noqa: E402
from sglang.srt.models.utils import apply_qk_norm  # noqa: E402

from sglang_dflash import _extension, ops  # noqa: E402
from sglang_dflash.serving.draft_norms import _ORIGINAL, install_draft_norms  # noqa: E402

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 64, 96


def _norm(cls, dim, dtype, gen):
    norm = cls(dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=gen))
    return norm


class Attention(torch.nn.Module):
    """The attributes SGLang's DFlashAttention.forward reads, with linear stand-ins for its
    projections and an attention that records q, k, v."""

    def __init__(self, dtype, gen, q_norm_cls=RMSNorm):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = HEADS, KV_HEADS, HEAD_DIM
        self.q_size, self.kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        self.q_norm, self.k_norm = _norm(q_norm_cls, HEAD_DIM, dtype, gen), _norm(RMSNorm, HEAD_DIM, dtype, gen)
        self.rotary_emb = get_rope(HEAD_DIM, rotary_dim=HEAD_DIM, max_position=256, base=10000, is_neox_style=True)
        self.v_scale, self.attention_sink_bias = 0.5, None
        self.w_qkv = (0.1 * torch.randn(self.q_size + 2 * self.kv_size, HIDDEN, generator=gen)).to(dtype)
        self.seen = []

    def qkv_proj(self, x):
        return x @ self.w_qkv.T, None

    def attn(self, q, k, v, forward_batch):
        self.seen.append((q.clone(), k.clone(), v.clone()))
        return q

    def apply_attention_output(self, out, hidden_states):
        return out

    def o_proj(self, out):
        return out * 2, None

    def forward(self, positions, hidden_states, forward_batch):
        """SGLang's path on the CPU (no AMX): split, apply_qk_norm, rotary, v scale."""
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = apply_qk_norm(q, k, self.q_norm, self.k_norm, self.head_dim, allow_inplace=False)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v * self.v_scale, forward_batch))[0]


class Drafter(torch.nn.Module):
    def __init__(self, dtype, gen, q_norm_cls=RMSNorm):
        super().__init__()
        layer = torch.nn.Module()
        layer.self_attn = Attention(dtype, gen, q_norm_cls)
        layer.input_layernorm = _norm(RMSNorm, HIDDEN, dtype, gen)
        self.layers = torch.nn.ModuleList([layer])
        self.norm = _norm(RMSNorm, HIDDEN, dtype, gen)
        self.gemma_norm = _norm(GemmaRMSNorm, HIDDEN, dtype, gen)  # not a plain RMSNorm: left alone


def _close(got, want, dtype, roundings=1):
    """Within the dtype's tolerance per rounding SGLang's path makes that ours does not."""
    tol = roundings * TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.fixture
def fresh_ops(monkeypatch):
    monkeypatch.setattr(ops, "_REFERENCE_ON", set())


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_draft_norms_match_sglangs_modules(fresh_ops, dtype):
    gen = torch.Generator().manual_seed(0)
    drafter = Drafter(dtype, gen)
    attn, norm = drafter.layers[0].self_attn, drafter.norm
    x = torch.randn(5, HIDDEN, generator=gen).to(dtype)
    residual = torch.randn(5, HIDDEN, generator=gen).to(dtype)
    positions = torch.tensor([0, 7, 8, 100, 255])
    want_plain, (want_normed, want_residual) = norm(x), norm(x, residual)
    want_out = attn(positions=positions, hidden_states=x, forward_batch=None)

    assert install_draft_norms(drafter, CPU) == (2, 1)  # input_layernorm and norm; the attention
    assert getattr(drafter.gemma_norm, _ORIGINAL, None) is None
    assert getattr(attn.q_norm, _ORIGINAL, None) is None  # inside the wrapped attention's op
    _close(norm(x), want_plain, dtype)
    normed, new_residual = norm(x, residual)
    _close(normed, want_normed, dtype)
    assert torch.equal(new_residual, want_residual)  # the sum, rounded once to the activations' dtype
    out = attn(positions=positions, hidden_states=x, forward_batch=None)
    # SGLang rounds q / k to the dtype after the norm and again in the RoPE: two roundings.
    _close(out, want_out, dtype, roundings=2)
    (q, k, v), (want_q, want_k, want_v) = attn.seen[-1], attn.seen[0]
    _close(q, want_q, dtype, roundings=2)
    _close(k, want_k, dtype, roundings=2)
    assert torch.equal(v, want_v)
    assert install_draft_norms(drafter, CPU) == (2, 1) and attn.seen  # a second install wraps nothing twice


def test_uncovered_calls_and_devices_stay_with_sglang(fresh_ops, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    drafter = Drafter(torch.float32, gen, q_norm_cls=GemmaRMSNorm)
    assert install_draft_norms(drafter, torch.device("cuda", 0)) == (0, 0)
    assert install_draft_norms(types.SimpleNamespace(layers=[]), CPU) == (0, 0)  # not a module
    assert install_draft_norms(drafter, CPU) == (3, 0)  # a Gemma q_norm: SGLang's attention (its k_norm wrapped)
    norm, x = drafter.norm, torch.randn(3, HIDDEN, generator=gen)
    original = getattr(norm, _ORIGINAL)
    # A post-residual addition is SGLang's; so is everything once the op failed its self-test.
    calls = []
    kernel = _extension.ops().rms_norm_rope
    monkeypatch.setattr(_extension.ops(), "rms_norm_rope", lambda *a: calls.append(a) or kernel(*a))
    norm(x)
    assert len(calls) == 1
    for got, want in zip(norm(x, x, x), original(x, x, x), strict=True):
        assert torch.equal(got, want)
    ops._REFERENCE_ON.add(("rms_norm_rope", CPU))
    assert torch.equal(norm(x), original(x))
    assert len(calls) == 1
