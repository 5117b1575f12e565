"""The adaptive controller's state kept between processes (engine/controller_state.py): a generator
of the same configuration starts from what the last one learned, another configuration does not,
an unreadable file is ignored and replaced, and the output stays plain greedy decoding's."""

from __future__ import annotations

import pickle

import pytest
import torch

from sglang_dflash.engine import DFlashDrafter, Generator, SamplingParams, controller_state
from tests.dflash_testlib import STOP_TOKEN, hf_greedy, random_draft, tiny_target

PROMPTS = [[3, 4, 5], list(range(10, 30)), [50, 60, 70, 80, 90, 11, 12]]
PARAMS = SamplingParams(max_new_tokens=24, stop_token_ids=(STOP_TOKEN,))


@pytest.fixture(scope="module")
def models():
    target = tiny_target("qwen3")
    return target, DFlashDrafter(random_draft(target), target)


def steps_learned(gen: Generator) -> int:
    return gen.controller.chains._steps


def test_a_new_generator_starts_from_the_saved_state_and_stays_lossless(models, tmp_path):
    target, drafter = models
    refs = [hf_greedy(target, p, PARAMS.max_new_tokens, STOP_TOKEN) for p in PROMPTS]
    first = Generator(target, drafter, 8, adaptive=True, tree_budget=3, adaptive_state_dir=tmp_path)
    assert steps_learned(first) == 0
    assert [r.output_ids for r in first.generate(PROMPTS, PARAMS)] == refs
    learned = steps_learned(first)
    assert learned > 0 and len(list((tmp_path / "adaptive").glob("*.pkl"))) == 1

    second = Generator(target, drafter, 8, adaptive=True, tree_budget=3, adaptive_state_dir=tmp_path)
    assert steps_learned(second) == learned  # the saved state, not a fresh controller
    assert second.controller.chains.acceptance() == first.controller.chains.acceptance()
    assert [r.output_ids for r in second.generate(PROMPTS, PARAMS)] == refs
    assert steps_learned(second) > learned
    third = Generator(target, drafter, 8, adaptive=True, tree_budget=3, adaptive_state_dir=tmp_path)
    assert steps_learned(third) == steps_learned(second)  # each run saves what it learned on top

    # Without a state directory nothing is read or written.
    fresh = Generator(target, drafter, 8, adaptive=True, tree_budget=3)
    assert steps_learned(fresh) == 0


def test_another_configuration_does_not_share_the_state(models, tmp_path):
    target, drafter = models
    Generator(target, drafter, 8, adaptive=True, adaptive_state_dir=tmp_path).generate(PROMPTS[:1], PARAMS)
    for other in (dict(block_size=4), dict(tree_budget=3)):
        kwargs = dict(dict(block_size=8, tree_budget=0), **other)
        gen = Generator(target, drafter, kwargs["block_size"], adaptive=True, tree_budget=kwargs["tree_budget"],
                        adaptive_state_dir=tmp_path)
        assert steps_learned(gen) == 0, other
    # A retrained drafter (other weights, same config) accepts other drafts: a state of its own.
    retrained = DFlashDrafter(random_draft(target), target)
    with torch.no_grad():
        next(retrained.model.parameters()).add_(1.0)
    assert steps_learned(Generator(target, retrained, 8, adaptive=True, adaptive_state_dir=tmp_path)) == 0
    assert steps_learned(Generator(target, drafter, 8, adaptive=True, adaptive_state_dir=tmp_path)) > 0


@pytest.mark.parametrize("content", [b"", b"not a pickle", pickle.dumps({"config": {}, "controller": None}),
                                     pickle.dumps(["a list"])], ids=["empty", "garbage", "other-config", "list"])
def test_an_unusable_file_is_ignored_and_replaced(models, tmp_path, content):
    target, drafter = models
    config = controller_state.configuration(target, drafter, 8, 0, 1, 0.0)
    path = controller_state.state_path(config, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    gen = Generator(target, drafter, 8, adaptive=True, adaptive_state_dir=tmp_path)
    assert steps_learned(gen) == 0
    gen.generate(PROMPTS[:1], PARAMS)
    assert controller_state.load(path, config) is not None
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
