"""The engine runs DFlash-2 drafters (grouped convolutions around every sublayer, a path selector,
and the config variants models/ reads) losslessly: greedy output equals Hugging Face's greedy
decoding, and seeded sampling equals seeded plain sampling, with chains, trees and the adaptive
block size. The engine drafts each position's best token (trees: each position's top-k, the
selector's own candidate set); the selector's joint walk is `DFlashDraftModel.draft_path`."""

from __future__ import annotations

import pytest

from sglang_dflash.engine import DFlashDrafter, Generator, OracleDrafter, SamplingParams
from tests.dflash_testlib import STOP_TOKEN, hf_greedy, random_draft, tiny_target

PROMPTS = [[3, 4, 5], list(range(10, 30)), [50, 60, 70, 80, 90, 11, 12]]
MAX_NEW = 20
DRAFTERS = {
    "dflash2": dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4),
    "dflash2-variants": dict(conv_kernel_size=3, conv_group_size=8, selector_rank=4, selector_top_k=6,
                             use_gemma_norm=True, rotary_dim=8, attention_value_scale=0.8, causal=True,
                             layer_types=("sliding_attention", "full_attention"), sliding_window=12),
}
MODES = {"chain": {}, "tree": dict(tree_budget=8, tree_topk=3), "adaptive": dict(adaptive=True)}


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_equals_plain(target, drafter, mode):
    refs = [hf_greedy(target, p, MAX_NEW, STOP_TOKEN) for p in PROMPTS]
    draft = random_draft(target, block_size=8, **DRAFTERS[drafter])
    gen = Generator(target, DFlashDrafter(draft, target), 6, **MODES[mode])
    results = gen.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(STOP_TOKEN,)))
    assert [r.output_ids for r in results] == refs


@pytest.mark.parametrize("mode", list(MODES))
def test_seeded_sampling_equals_plain(target, mode):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=MAX_NEW, stop_token_ids=())
    plain = [r.output_ids for r in Generator(target, OracleDrafter([], target.vocab_size), 1).generate(PROMPTS, params)]
    draft = random_draft(target, block_size=8, **DRAFTERS["dflash2"])
    spec = Generator(target, DFlashDrafter(draft, target), 5, **MODES[mode]).generate(PROMPTS, params)
    assert [r.output_ids for r in spec] == plain
