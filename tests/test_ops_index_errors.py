"""A bad index value gets one error naming the op, the tensor element and its value, with the same
text on every device: the CPU kernels raise it at the call (ValueError); the CUDA kernels record it,
skip what the index would address and go on, and `ops.check_device_errors()` raises it
(RuntimeError), after which the device keeps serving. (A debug build traps instead:
tests/test_cuda_ops.py.)"""

from __future__ import annotations

import re

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash.ops import reference
from tests.kernel_devices import DEVICES


def _attention(device, dtype=torch.bfloat16, table=(0, 1, 2), pool=0, ctx=3, tree=None):
    """A call of block_attention: one request, block 4, the context in req_to_token row `pool` of 2,
    a KV cache of 10 slots; a tree of those 4 nodes when `tree` (its parents) is given."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 2, 64, generator=gen).to(device, dtype)
    kv = torch.randn(4, 1, 64, generator=gen).to(device, dtype)
    cache = torch.randn(10, 1, 64, generator=gen).to(device, dtype)
    req_to_token = torch.tensor([table, table], device=device)
    return lambda: ops.block_attention(q, kv, kv, cache, cache, req_to_token, torch.tensor([pool], device=device),
                                       torch.tensor([ctx], device=device), 4,
                                       tree_parents=None if tree is None else torch.tensor([tree], device=device))


def _verify(device, candidates):
    cand = torch.tensor(candidates, device=device)
    bs, block = cand.shape
    logits = torch.randn(bs * block, 10, device=device)
    return lambda: ops.verify_block(cand, logits, torch.zeros(bs, device=device),
                                    torch.zeros(bs, dtype=torch.int32, device=device), torch.ones(bs, device=device),
                                    0, torch.zeros(bs, dtype=torch.int64, device=device))


def _gumbel(device, ids, rows):
    # Equal scores: every column can win, so the CUDA kernel draws (and checks) every id.
    scores = torch.zeros(len(rows), len(ids), device=device)
    offsets = torch.zeros(len(rows), dtype=torch.int64, device=device)
    return lambda: ops.gumbel_argmax(scores, torch.tensor(ids, device=device), 0, offsets,
                                     torch.tensor(rows, device=device))


def _context_kv(device, positions, out_loc):
    """Two rows into 2 layers of 5-slot pools (Hkv 1, D 64), a cos_sin_cache of 8 positions."""
    dev = dict(device=device)
    n = len(positions)
    return lambda: ops.materialize_context_kv(
        torch.randn(n, 32, **dev), [torch.randn(128, 32, **dev)] * 2, None, [torch.ones(64, **dev)] * 2, 1e-6,
        torch.ones(8, 64, **dev), True, torch.tensor(positions, **dev), torch.tensor(out_loc, **dev),
        [torch.zeros(5, 1, 64, **dev) for _ in range(2)], [torch.zeros(5, 1, 64, **dev) for _ in range(2)])


def _tree(device, parents, depths, dtype=torch.int64):
    """A call of verify_tree_from_ids: two requests of 4 nodes; valid are parents [[-1, 0, 1, 0],
    [-1, 0, -1, 1]] with depths [[0, 1, 2, 1], [0, 1, 0, 2]]."""
    tokens = torch.tensor([[4, 5, 6, 7], [8, 9, 3, 2]], device=device)
    return lambda: ops.verify_tree_from_ids(tokens, torch.tensor(parents, dtype=dtype, device=device),
                                            torch.tensor(depths, device=device), tokens.roll(1, dims=1))


_DEPTHS = [[0, 1, 2, 1], [0, 1, 0, 2]]

# name: (a call with one bad index on a device, the error text on every device)
CASES = {
    "attention_slot": (lambda d: _attention(d, table=(0, 1, 99)),
                       "sglang_dflash.block_attention: req_to_token[0, 2] = 99 is outside the KV cache's slots "
                       "[0, 10)"),
    "attention_slot_fp32": (lambda d: _attention(d, torch.float32, table=(0, -1, 2)),  # the CUDA SIMT kernel
                            "sglang_dflash.block_attention: req_to_token[0, 1] = -1 is outside the KV cache's slots "
                            "[0, 10)"),
    "attention_pool": (lambda d: _attention(d, pool=2),
                       "sglang_dflash.block_attention: req_pool_indices[0] = 2 is out of range for req_to_token "
                       "with 2 rows"),
    "attention_ctx_len": (lambda d: _attention(d, ctx=4),
                          "sglang_dflash.block_attention: ctx_lens[0] = 4 is out of range [0, 3] (req_to_token width)"),
    "attention_tree_parent": (lambda d: _attention(d, tree=[-1, 0, 2, 1]),
                              "sglang_dflash.block_attention: tree_parents[0, 2] = 2 is not a node before 2 (or -1)"),
    "attention_tree_parent_fp32": (lambda d: _attention(d, torch.float32, tree=[-1, 0, -3, 1]),
                                   "sglang_dflash.block_attention: tree_parents[0, 2] = -3 is not a node before 2 "
                                   "(or -1)"),
    "verify_candidate": (lambda d: _verify(d, [[1, 2, 3], [4, 5, 500]]),
                         "sglang_dflash.verify_block: candidates[1, 2] = 500 is outside the vocabulary [0, 10) of "
                         "logits"),
    "gumbel_id": (lambda d: _gumbel(d, [0, 1, 2, 3, -4], [0, 1]),
                  "sglang_dflash.gumbel_argmax: ids[4] = -4 is outside the token ids [0, 2^34) the noise is defined "
                  "for"),
    "gumbel_row": (lambda d: _gumbel(d, [0, 1, 2], [0, 1 << 32]),
                   "sglang_dflash.gumbel_argmax: rows[1] = 4294967296 is outside the verify rows [0, 2^32)"),
    "context_position": (lambda d: _context_kv(d, [0, 8], [1, 2]),
                         "sglang_dflash.materialize_context_kv: positions[1] = 8 is outside the rows [0, 8) of "
                         "cos_sin_cache"),
    "context_out_loc": (lambda d: _context_kv(d, [0, 1], [-1, 5]),
                        "sglang_dflash.materialize_context_kv: out_loc[1] = 5 is outside [-1, 5) (-1: row not "
                        "written; else a slot of the KV pools)"),
    "tree_root": (lambda d: _tree(d, [[-1, 0, 1, 0], [2, 0, -1, 1]], _DEPTHS),
                  "sglang_dflash.verify_tree_from_ids: parents[1, 0] = 2 must be -1 (node 0 is the root)"),
    "tree_parent": (lambda d: _tree(d, [[-1, 0, 1, 0], [-1, 0, -1, 5]], _DEPTHS, torch.int32),
                    "sglang_dflash.verify_tree_from_ids: parents[1, 3] = 5 is not a node before 3 (or -1)"),
    "tree_parent_negative": (lambda d: _tree(d, [[-1, 0, -2, 0], [-1, 0, -1, 1]], _DEPTHS),
                             "sglang_dflash.verify_tree_from_ids: parents[0, 2] = -2 is not a node before 2 (or -1)"),
    "tree_orphan": (lambda d: _tree(d, [[-1, 0, 1, 0], [-1, 0, -1, 2]], [[0, 1, 2, 1], [0, 1, 0, 1]]),
                    "sglang_dflash.verify_tree_from_ids: parents[1, 3] = 2 is an unused node (its own parent is -1)"),
    "tree_depth": (lambda d: _tree(d, [[-1, 0, 1, 0], [-1, 0, -1, 1]], [[0, 1, 3, 1], [0, 1, 0, 2]]),
                   "sglang_dflash.verify_tree_from_ids: depths[0, 2] = 3 is not its parent's depth + 1 = 2"),
    "tree_unused_depth": (lambda d: _tree(d, [[-1, 0, 1, 0], [-1, 0, -1, 1]], [[0, 1, 2, 1], [0, 1, 4, 2]]),
                          "sglang_dflash.verify_tree_from_ids: depths[1, 2] = 4 must be 0 (the root's and the unused "
                          "nodes' depth)"),
    "tree_root_depth": (lambda d: _tree(d, [[-1, 0, 1, 0], [-1, 0, -1, 1]], [[0, 1, 2, 1], [1, 2, 0, 3]]),
                        "sglang_dflash.verify_tree_from_ids: depths[1, 0] = 1 must be 0 (the root's and the unused "
                        "nodes' depth)"),
}


def _still_serves(device):
    """A valid call on the device after the error: it runs and agrees with the reference."""
    gen = torch.Generator().manual_seed(1)
    cand = torch.randint(0, 50, (3, 4), generator=gen)
    logits = torch.randn(12, 50, generator=gen)
    got = ops.verify_block_from_ids(cand.to(device), logits.to(device).argmax(-1))
    want = reference.verify_block_from_ids(cand, logits.argmax(-1))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_bad_index_raises_the_same_text_on_every_device(name, device):
    make_call, text = CASES[name]
    call = make_call(device)
    if device.type == "cpu":
        with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
            call()
    else:
        call()  # recorded on the device; nothing raises yet
        with pytest.raises(RuntimeError, match=f"{re.escape(text)} \\(found on cuda:\\d+ by a kernel"):
            ops.check_device_errors(device)
    ops.check_device_errors(device)  # the record was cleared (a no-op on the CPU)
    ops.check_device_errors()
    _still_serves(device)
