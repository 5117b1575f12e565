"""The target adapter's tapped hidden states are Hugging Face's `hidden_states[id + 1]`, for the
prefill and for verify blocks after a rollback, in a ragged batch."""

from __future__ import annotations

import pytest
import torch

from tests.dflash_testlib import tiny_target


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_taps_match_hf_hidden_states(arch):
    target = tiny_target(arch)
    layer_ids = (3, 0, 2)  # unsorted, and the last layer (which HF reports after the final norm)
    target.set_taps(layer_ids)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24]]
    last_logits, taps = target.prefill(prompts)
    block = torch.tensor([[30, 31, 32], [40, 41, 42], [50, 51, 52]])
    lengths = torch.tensor([len(p) for p in prompts])
    target.verify(block, lengths[:, None] + torch.arange(3))
    target.commit(torch.tensor([1, 3, 2]))  # roll back to prompt + 1 / + 3 / + 2 block tokens
    kept = [[30], [40, 41, 42], [50, 51]]
    block2 = torch.tensor([[60, 61], [70, 71], [80, 81]])
    starts = torch.tensor([len(p) + len(k) for p, k in zip(prompts, kept, strict=True)])
    logits2, taps2 = target.verify(block2, starts[:, None] + torch.arange(2))
    for b, prompt in enumerate(prompts):
        full = prompt + kept[b] + block2[b].tolist()
        with torch.no_grad():
            out = target.model(torch.tensor([full]), output_hidden_states=True)
        want = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
        torch.testing.assert_close(taps[b], want[:len(prompt)], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(taps2[b], want[-2:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(last_logits[b], out.logits[0, len(prompt) - 1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits2.view(3, 2, -1)[b], out.logits[0, -2:], rtol=1e-4, atol=1e-4)
