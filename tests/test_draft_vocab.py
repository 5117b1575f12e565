"""Draft vocabularies: drafts restricted to a subset of the target's ids (checkpoint file,
drafter, and the trained-on token counts that choose it). Output must stay lossless."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from sglang_dflash.engine import DFlashDrafter, Generator, SamplingParams
from sglang_dflash.engine.drafters import NoDrafter
from sglang_dflash.models import CheckpointError, load_draft, save_draft, save_draft_vocab
from sglang_dflash.models.checkpoint import DRAFT_VOCAB_NAME
from sglang_dflash.train.data import Example
from sglang_dflash.train.run import frequent_tokens
from tests.dflash_testlib import random_draft, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=4)


def test_checkpoint_round_trip(target, tmp_path):
    draft = random_draft(target)
    save_draft(draft, tmp_path / "plain")
    assert load_draft(tmp_path / "plain").draft_vocab is None
    draft.draft_vocab = torch.tensor([9, 3, 40, 7])
    save_draft(draft, tmp_path / "restricted")
    assert load_draft(tmp_path / "restricted").draft_vocab.tolist() == [3, 7, 9, 40]  # stored sorted


@pytest.mark.parametrize("ids,match", [
    (torch.tensor([1, 2, 10_000]), r"must lie in \[0, "),
    (torch.tensor([1, 2, 2]), "token ids repeat"),
    (torch.tensor([[1, 2]]), "non-empty 1-D integer tensor"),
    (torch.tensor([1.0, 2.0]), "non-empty 1-D integer tensor"),
])
def test_bad_vocabulary_file_is_one_clear_error(target, tmp_path, ids, match):
    save_draft(random_draft(target), tmp_path)
    save_file({"token_ids": ids}, tmp_path / DRAFT_VOCAB_NAME)
    with pytest.raises(CheckpointError, match=match) as err:
        load_draft(tmp_path)
    assert DRAFT_VOCAB_NAME in str(err.value)
    with pytest.raises(CheckpointError, match=match):
        save_draft_vocab(tmp_path, ids, target.vocab_size)


def test_drafts_stay_in_the_vocabulary_and_output_is_unchanged(target):
    prompts = [[3, 9, 14, 22, 5], [5, 6, 40, 41]]
    params = SamplingParams(max_new_tokens=24)
    plain = Generator(target, NoDrafter(), 1).generate(prompts, params, chat=False)
    draft = random_draft(target)
    full = DFlashDrafter(draft, target)
    draft.draft_vocab = torch.arange(target.vocab_size)
    everything = DFlashDrafter(draft, target)
    draft.draft_vocab = torch.arange(0, target.vocab_size, 3)
    restricted = DFlashDrafter(draft, target)

    target.set_taps(draft.config.target_layer_ids)
    _, taps = target.prefill(prompts)
    anchors, starts = torch.tensor([22, 41]), torch.tensor([5, 4])
    proposals = []
    for d in (full, everything, restricted):  # one after the other: the three share one draft model and its cache
        d.start(taps, [64, 64])
        proposals.append(d.propose([0, 1], anchors, starts, 8))
    assert torch.equal(proposals[0], proposals[1]), "the whole vocabulary must draft as no vocabulary does"
    assert bool((proposals[2] % 3 == 0).all()), "drafts outside the draft vocabulary"
    for drafter in (full, restricted):
        spec = Generator(target, drafter, 8).generate(prompts, params, chat=False)
        assert [r.output_ids for r in spec] == [r.output_ids for r in plain]


def test_frequent_tokens_counts_only_trained_on_positions():
    examples = [Example(torch.tensor([5, 5, 5, 7, 7, 2]), torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.bool)),
                Example(torch.tensor([2, 9, 9]), torch.tensor([1, 1, 1], dtype=torch.bool))]
    # counted: 5 once, 7 twice, 2 twice, 9 twice -> 2, 7, 9 (ties by id), 5, then unseen ids 0, 1, 3
    assert frequent_tokens(examples, 7, 12).tolist() == [2, 7, 9, 5, 0, 1, 3]
    # fine-tuning a drafter with vocabulary {3, 7, 11}: its unused ids 3 and 11 come before 0, 1
    assert frequent_tokens(examples, 7, 12, keep=torch.tensor([11, 7, 3])).tolist() == [2, 7, 9, 5, 3, 11, 0]
    assert frequent_tokens(examples, 3, 12, keep=torch.tensor([11, 0])).tolist() == [2, 7, 9]
    with pytest.raises(ValueError, match=r"draft vocabulary size must be in \[1, 12\]"):
        frequent_tokens(examples, 13, 12)
