"""The engine end to end on each kernel device (tests/kernel_devices.py: the CPU here and in CI,
CUDA where a GPU and our CUDA kernels are; bench/gpu_check.sh runs the `cuda` cases): greedy chains,
trees and the adaptive choice among them must equal plain greedy decoding through the same target,
and seeded sampled trees seeded plain sampling, token for token.

The CPU cases repeat in small what test_engine_tree.py, test_engine_greedy.py and
test_engine_sampled.py test widely. The CUDA cases are the engine's only run on a GPU: there a tree
step runs `block_attention`'s CUDA tree mode and `verify_tree_by_nodes` (`verify_block`'s CUDA
kernel per node), and `move_slots` and `top_k_logprobs` run their PyTorch references (they are CPU
kernels). The tiny targets' wide logit margins keep greedy argmaxes clear of the rounding by which a
GPU's N-row matmuls may differ from its 1-row ones.
"""

from __future__ import annotations

import pytest

from sglang_dflash.control.tree import DEFAULT_TREE_BUDGET
from sglang_dflash.engine import DFlashDrafter, Generator, SamplingParams
from sglang_dflash.engine.drafters import NoDrafter
from sglang_dflash.engine.target import HFTarget
from tests.dflash_testlib import STOP_TOKEN, CandidateOracle, random_draft, tiny_target
from tests.kernel_devices import DEVICES

PROMPTS = [[3, 4, 5], list(range(10, 30)), [50, 60, 70, 80, 90, 11, 12], [5]]
MAX_NEW = 24


def on_device(device) -> HFTarget:
    """A tiny Qwen3 target on `device`."""
    return HFTarget(tiny_target("qwen3").model.to(device))


def drafters(target: HFTarget, plain) -> dict:
    """A random DFlash drafter of block 8 (it drafts what the real one does, but its drafts are
    rarely right) and an oracle whose choices hold the known continuation at random ranks, so
    that accepted paths run several nodes deep and skip nodes (what a wrong tree mask or a wrong
    K/V move would break)."""
    references = [p + r.output_ids for p, r in zip(PROMPTS, plain, strict=True)]
    return {"random": DFlashDrafter(random_draft(target).to(target.device), target),
            "oracle": CandidateOracle(random_draft(target).to(target.device), target, references, seed=5)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size,mode", [
    (4, dict()),
    (8, dict(tree_budget=6, tree_topk=3, tree_min_prob=0.0)),
    (8, dict(tree_budget=12, tree_topk=4)),
    (8, dict(adaptive=True, tree_budget=DEFAULT_TREE_BUDGET)),
], ids=["chain", "tree6", "tree12-bounded", "adaptive"])
def test_greedy_output_equals_plain_greedy_decoding(device, block_size, mode):
    target = on_device(device)
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(STOP_TOKEN,))
    plain = Generator(target, NoDrafter(), 1).generate(PROMPTS, params)
    assert all(len(r.output_ids) > 1 for r in plain)  # else there was nothing to verify
    for name, drafter in drafters(target, plain).items():
        spec = Generator(target, drafter, block_size, **mode).generate(PROMPTS, params)
        assert [r.output_ids for r in spec] == [r.output_ids for r in plain], name
        if mode.get("tree_budget") and not mode.get("adaptive"):
            assert all(r.trees for r in spec), "every request verified trees"
            if name == "oracle":
                paths = [t["path"] for r in spec for t in r.trees]
                assert max(len(p) for p in paths) >= 3 and any(p != list(range(len(p))) for p in paths)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampled_trees_equal_seeded_plain_sampling(device):
    target = on_device(device)
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.95, seed=11, max_new_tokens=MAX_NEW,
                            stop_token_ids=(STOP_TOKEN,))
    plain = Generator(target, NoDrafter(), 1).generate(PROMPTS, params)
    assert sum(len(r.output_ids) for r in plain) > 2 * len(PROMPTS)  # else there was little to verify
    for name, drafter in drafters(target, plain).items():
        trees = Generator(target, drafter, 8, tree_budget=6, tree_topk=3).generate(PROMPTS, params)
        assert [r.output_ids for r in trees] == [r.output_ids for r in plain], name
        assert all(r.trees for r in trees if len(r.output_ids) > 1), "every request that decoded verified trees"
