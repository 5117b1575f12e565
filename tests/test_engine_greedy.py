"""Greedy DFlash generation is lossless: its ids equal Hugging Face's own greedy `generate`,
token for token, for bs 1 and bs 4 ragged, several block sizes, low and high acceptance."""

from __future__ import annotations

import pytest

from sglang_dflash.engine import DFlashDrafter, Generator, OracleDrafter, SamplingParams
from tests.dflash_testlib import STOP_TOKEN, hf_greedy, random_draft, smollm2, tiny_target

PROMPTS = [[3, 4, 5], list(range(10, 30)), [50, 60, 70, 80, 90, 11, 12], [5]]
MAX_NEW = 24


def check_steps(result, block_size):
    """Every step commits 1..B tokens and the steps rebuild the output after the prefill token."""
    assert all(1 <= len(s) <= block_size for s in result.steps)
    assert [t for s in result.steps for t in s] == result.output_ids[1:]
    assert sum(result.stats.accept_hist) == result.stats.steps == len(result.steps)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request):
    target = tiny_target(request.param)
    refs = [hf_greedy(target, p, MAX_NEW, STOP_TOKEN) for p in PROMPTS]
    return target, refs


@pytest.mark.parametrize("block_size", [1, 3, 8])
@pytest.mark.parametrize("batch", ["bs1", "bs4"])
def test_tiny_target_random_drafter(tiny, block_size, batch):
    target, refs = tiny
    prompts, refs = (PROMPTS[1:2], refs[1:2]) if batch == "bs1" else (PROMPTS, refs)
    gen = Generator(target, DFlashDrafter(random_draft(target), target), block_size)
    results = gen.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(STOP_TOKEN,)))
    for result, ref in zip(results, refs, strict=True):
        assert result.output_ids == ref
        check_steps(result, block_size)


@pytest.mark.parametrize("block_size", [2, 5, 8])
def test_tiny_target_copying_drafter_high_acceptance(tiny, block_size):
    """The drafter copies the target's own continuation, with 20% of drafts corrupted, so steps
    accept everything, nothing, and all lengths between; requests finish at different steps."""
    target, refs = tiny
    references = [p + r for p, r in zip(PROMPTS, refs, strict=True)]
    drafter = OracleDrafter(references, target.vocab_size, corrupt=0.2, seed=block_size)
    results = Generator(target, drafter, block_size).generate(
        PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(STOP_TOKEN,)))
    hist = [sum(h) for h in zip(*(r.stats.accept_hist for r in results), strict=True)]
    assert hist[0] > 0 and hist[-1] > 0, hist  # both full rejection and full acceptance happened
    for result, ref in zip(results, refs, strict=True):
        assert result.output_ids == ref
        check_steps(result, block_size)


def test_max_new_tokens_cuts_inside_a_step():
    target = tiny_target("llama")
    ref = hf_greedy(target, PROMPTS[1], 11, None)
    drafter = OracleDrafter([PROMPTS[1] + ref], target.vocab_size)
    params = SamplingParams(max_new_tokens=11, stop_token_ids=())
    (result,) = Generator(target, drafter, 8).generate([PROMPTS[1]], params)
    assert result.output_ids == ref and len(ref) == 11
    assert [len(s) for s in result.steps] == [8, 2]  # the second step accepted 8 but had room for 2


def test_smollm2_real_target():
    target = smollm2()
    tok = target.tokenizer
    texts = ["What is the capital of France?", "Count from one to ten in French, please:", "Hi!",
             "Say hello in Spanish, then explain why greetings matter so much in every culture."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=True)["input_ids"] for t in texts]
    assert len({len(p) for p in prompts}) == 4  # ragged
    stop = target.eos_token_ids[0]
    refs = [hf_greedy(target, p, 8, stop) for p in prompts]
    draft = random_draft(target, layers=1, block_size=4, target_layer_ids=(1, 15, 27), num_target_layers=30)
    for block_size, batch in [(4, slice(0, 1)), (3, slice(0, 4))]:
        gen = Generator(target, DFlashDrafter(draft, target), block_size)
        results = gen.generate(prompts[batch], SamplingParams(max_new_tokens=8))
        assert [r.output_ids for r in results] == refs[batch]
    # High acceptance on the real model: drafts copied from its own greedy continuation.
    drafter = OracleDrafter([p + r for p, r in zip(prompts, refs, strict=True)], target.vocab_size, corrupt=0.3, seed=1)
    results = Generator(target, drafter, 4).generate(prompts, SamplingParams(max_new_tokens=8))
    assert [r.output_ids for r in results] == refs
    assert max(r.stats.tau for r in results) > 1.5
