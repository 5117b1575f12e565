"""The target adapter's tapped hidden states are Hugging Face's `hidden_states[id + 1]`, for the
prefill and for verify blocks after a rollback, in a ragged batch."""

from __future__ import annotations

import pytest
import torch

from sglang_dflash.ops.reference import tree_ancestors
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


def _decode(target, prompt, tokens):
    """Logits [len(tokens), V] of decoding `tokens` one at a time after `prompt` (batch of one)."""
    target.prefill([prompt])
    rows = []
    for i, token in enumerate(tokens):
        logits, _ = target.verify(torch.tensor([[token]]), torch.tensor([[len(prompt) + i]]))
        target.commit(torch.tensor([1]))
        rows.append(logits[0])
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verified_rows_are_bitwise_what_decoding_them_one_at_a_time_computes(dtype):
    """Decode and verify steps run attention through block_attention (grouped_attention.kernel_step):
    a verified block's rows, in a ragged batch, and a draft tree's nodes, before and after the
    rejected nodes become holes in the cache, give bit for bit the logits of decoding the same
    tokens one at a time. (SDPA, which the steps ran before, is off by ~1e-5 in fp32 and by whole
    bf16 ulps: its GEMMs block the query rows.) Blocks of 9 put 18 rows through each linear layer,
    more than skinny.MAX_ROWS, where torch's BLAS would block the rows (fp32: off by ~1e-7)."""
    target = tiny_target()
    target.model.to(dtype)
    target.set_taps(())
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    for width in (4, 9):
        block = [list(range(30, 30 + width)), list(range(40, 40 + width))]
        target.prefill(prompts)
        starts = torch.tensor([[len(p)] for p in prompts])
        logits, _ = target.verify(torch.tensor(block), starts + torch.arange(width))
        for b in range(2):
            assert torch.equal(logits.view(2, width, -1)[b], _decode(target, prompts[b], block[b])), (width, b)

    # Root, a chain of 3 and siblings; the accepted path 0 -> 2 -> 5 leaves nodes 1, 3, 4, 6 as holes.
    tokens = torch.tensor([[50, 51, 52, 53, 54, 55, 56]])
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2, 5]])
    depths = torch.tensor([[0, 1, 1, 2, 2, 2, 3]])
    prompt = prompts[0]
    target.prefill([prompt])
    nodes, _ = target.verify_tree(tokens, len(prompt) + depths, tree_ancestors(parents), parents)
    target.commit_nodes(torch.tensor([[0, 2, 5, 5, 5, 5, 5]]), torch.tensor([2]))
    after_holes, _ = target.verify(torch.tensor([[60, 61, 62]]), len(prompt) + 3 + torch.arange(3)[None])
    path = [50, 52, 55, 60, 61, 62]
    decoded = _decode(target, prompt, path)
    assert torch.equal(nodes[[0, 2, 5]], decoded[:3])
    assert torch.equal(after_holes, decoded[3:])
    for node, node_path in ((1, [50, 51]), (3, [50, 51, 53]), (4, [50, 52, 54]), (6, [50, 52, 55, 56])):
        assert torch.equal(nodes[node], _decode(target, prompt, node_path)[-1]), node
