"""The shipped drafters on the real SmolLM2-135M target, in a batch of four ragged prompts: greedy
output equals plain batch-1 decoding and seeded sampled output equals seeded plain batch-1
sampling, token for token, at B=4 and at B=8 (32 verify rows a step, past the few-row path), and
the code-and-math drafter earns its keep (tau >= 1.5 at B=4 on real GSM8K and code prompts), in
bf16 and with int8 weights."""

from __future__ import annotations

import json

import pytest

from sglang_dflash.data import gsm8k_path
from sglang_dflash.demo import DEMO_PROMPTS
from sglang_dflash.drafters import SHIPPED_DRAFTER, resolve_draft
from sglang_dflash.engine import Generator, SamplingParams, load_drafter
from sglang_dflash.engine.drafters import NoDrafter
from sglang_dflash.engine.generator import encode_prompt
from tests.dflash_testlib import smollm2

MAX_NEW = 40
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=())  # never stop early: 40 tokens each
SAMPLED = SamplingParams(temperature=0.7, top_p=0.95, seed=7, max_new_tokens=MAX_NEW, stop_token_ids=())
# (drafter, weight dtype, block size): the fixture loads each (drafter, dtype) once.
CASES = [(SHIPPED_DRAFTER, "bfloat16", 4), (SHIPPED_DRAFTER, "bfloat16", 8), (SHIPPED_DRAFTER, "int8", 4)]


@pytest.fixture(scope="module")
def setup():
    target = smollm2()
    drafters = {(name, dtype): load_drafter(resolve_draft(name), target, dtype)
                for name, dtype in dict.fromkeys((name, dtype) for name, dtype, _ in CASES)}
    with open(gsm8k_path("test")) as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(2), f, strict=False)]
    prompts = [questions[0], DEMO_PROMPTS[1], questions[1], DEMO_PROMPTS[3]]
    plain = Generator(target, NoDrafter(), 1)
    refs = {params: [plain.generate([p], params)[0].output_ids for p in prompts] for params in (GREEDY, SAMPLED)}
    return target, drafters, prompts, refs


@pytest.mark.parametrize("name,dtype,block_size", CASES)
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded-T0.7"])
def test_batched_speculative_equals_plain_batch_one(setup, name, dtype, block_size, params):
    target, drafters, prompts, refs = setup
    drafter = drafters[name, dtype]
    assert len({len(encode_prompt(target.tokenizer, p)) for p in prompts}) == 4  # ragged
    results = Generator(target, drafter, block_size).generate(prompts, params)
    assert [r.output_ids for r in results] == refs[params]
    assert all(len(r.output_ids) == MAX_NEW for r in results)
    steps = sum(r.stats.steps for r in results)
    tau = sum(r.stats.tokens - 1 for r in results) / steps
    assert 1.0 <= tau <= block_size
    if params is GREEDY and block_size == 4 and name == SHIPPED_DRAFTER:
        assert tau >= 1.5, tau
