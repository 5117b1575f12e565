"""Drafts verified by their confidence: the drafter's probability of each draft, the calibration of
draft probabilities to acceptance, the verify length the adaptive block size picks from them, and
the per-position acceptance it keeps unbiased although the low-confidence drafts go unverified."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sglang_dflash.control.block_size import BlockSizeController
from sglang_dflash.control.draft_confidence import ConfidenceCalibration
from sglang_dflash.engine import DFlashDrafter
from sglang_dflash.engine.drafters import DraftSampling
from tests.dflash_testlib import random_draft, tiny_target


def test_calibration_starts_at_the_draft_probability_and_learns_the_acceptance():
    calibration = ConfidenceCalibration()
    assert calibration.acceptance(0.93) == pytest.approx(0.95)  # its bin's mid-point, before any test
    assert calibration.acceptance(1.0) == pytest.approx(0.95)
    rng = random.Random(0)
    for _ in range(20000):  # an overconfident drafter: accepted with q ** 2, not q
        q = rng.random()
        calibration.observe(q, rng.random() < q * q)
    for q in (0.15, 0.45, 0.75, 0.95):
        assert calibration.acceptance(q) == pytest.approx(q * q, abs=0.05), q
    expected = calibration.expected_tokens([0.95, 0.45])
    p1, p2 = calibration.acceptance(0.95), calibration.acceptance(0.45)
    assert expected == pytest.approx([1.0, 1.0 + p1, 1.0 + p1 + p1 * p2])


@pytest.mark.parametrize("q", [-0.1, 1.5, math.nan])
def test_calibration_refuses_a_confidence_that_is_no_probability(q):
    with pytest.raises(ValueError, match="draft confidence is a probability in \\[0, 1\\]"):
        ConfidenceCalibration().acceptance(q)


def warm_controller(max_block_size: int = 8) -> BlockSizeController:
    """Past its first tries, step times 10 ms + 1 ms a row, drafts accepted half the time."""
    c = BlockSizeController(max_block_size)
    rng = random.Random(1)
    for _ in range(40):
        b = c.choose(1)
        a = 0
        while a < b - 1 and rng.random() < 0.5:
            a += 1
        c.observe(b, [a], 0.010 + 0.001 * b)
    assert c.last_decision["why"] != "first try"
    return c


def test_verifies_the_drafts_whose_acceptance_pays_for_their_rows():
    c = warm_controller()
    rng = random.Random(2)
    for _ in range(3000):  # sure drafts are accepted, unsure ones are not
        q = rng.choice([0.05, 0.97])
        c.confidence.observe(q, rng.random() < (0.97 if q > 0.5 else 0.02))
    c.choose(1)
    assert c.draft_size(4) == 5 and c.draft_size(8) == 8 and c.draft_size(2) == 2 and c.draft_size(1) == 1
    assert c.verify_length(1, [[0.97, 0.97, 0.97, 0.97]]) == 5
    assert c.verify_length(1, [[0.97, 0.97, 0.05, 0.97]]) == 3  # nothing after a draft likely wrong
    assert c.verify_length(1, [[0.05, 0.97, 0.97, 0.97]]) == 2  # at least one draft: it was drafted
    # A batch verifies one length: the rows its requests' expected tokens pay for together.
    assert c.verify_length(2, [[0.97, 0.97, 0.97, 0.97], [0.97, 0.97, 0.05, 0.05]]) in (3, 4, 5)
    assert c.verify_length(2, [[0.05] * 4, [0.05] * 4]) == 2


def test_first_tries_draft_and_verify_their_own_size():
    c = BlockSizeController(8)
    assert c.choose(1) == 8 and c.last_decision["why"] == "first try"
    assert c.draft_size(8) == 8
    assert c.verify_length(1, [[0.01] * 7]) == 8
    c.observe(8, [0], 0.02, confidences=[[0.01] * 7])
    assert c.choose(1) == 8 and c.draft_size(8) == 8


def test_verify_length_and_observe_refuse_mismatched_confidences():
    c = warm_controller(4)
    c.choose(2)
    with pytest.raises(ValueError, match="1 requests' draft confidences for a batch of 2"):
        c.verify_length(2, [[0.5, 0.5]])
    with pytest.raises(ValueError, match="unequal lengths"):
        c.verify_length(2, [[0.5, 0.5], [0.5]])
    with pytest.raises(ValueError, match="block must be in \\[2, 4\\]"):
        c.verify_length(1, [[0.5] * 4])
    with pytest.raises(ValueError, match="2 draft confidences for a verified block of 4"):
        c.observe(4, [0], 0.01, confidences=[[0.5, 0.5]])
    with pytest.raises(ValueError, match="1 requests' draft confidences for 2 accept lengths"):
        c.observe(2, [0, 0], 0.01, confidences=[[0.5]])


def run_truncated_steps(count_unverified: bool, seed: int) -> tuple[list[float], float]:
    """600 steps whose drafts have confidence q uniform and are accepted with probability q (every
    position's acceptance is 0.5), verified as verify_length says; the controller's per-position
    acceptance after them and the mean size it drafted."""
    c = warm_controller()
    rng = random.Random(seed)
    sizes = []
    for _ in range(600):
        drafted = c.draft_size(c.choose(1))
        q = [rng.random() for _ in range(drafted - 1)]
        verified = c.verify_length(1, [q]) if drafted > 2 else drafted
        a = 0
        while a < verified - 1 and rng.random() < q[a]:
            a += 1
        confident = drafted > 2 and count_unverified
        c.observe(verified, [a], 0.010 + 0.001 * verified, confidences=[q] if confident else None)
        if drafted > 2 and not count_unverified:  # the calibration still learns from the verified drafts
            for k in range(min(a + 1, verified - 1)):
                c.confidence.observe(q[k], k < a)
        sizes.append(drafted)
    return c.acceptance(), sum(sizes) / len(sizes)


def test_unverified_drafts_keep_the_per_position_acceptance_unbiased():
    """The steps verify only the drafts that pay, mostly confident ones. Counted with their
    calibrated acceptance, the unverified drafts keep the estimate of positions 2-4 at 0.5;
    counting only the verified ones puts it well above, and the controller drafts longer blocks
    than pay (means over 5 seeds)."""
    counted = [run_truncated_steps(True, seed) for seed in range(5)]
    verified_only = [run_truncated_steps(False, seed) for seed in range(5)]

    def deep_mean(runs):
        return sum(sum(acceptance[1:4]) / 3 for acceptance, _ in runs) / len(runs)

    def mean_size(runs):
        return sum(size for _, size in runs) / len(runs)

    assert deep_mean(counted) == pytest.approx(0.5, abs=0.06)
    assert deep_mean(verified_only) > deep_mean(counted) + 0.08
    assert mean_size(verified_only) > mean_size(counted) + 0.5


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("restricted_vocab", [False, True])
def test_propose_reports_each_drafts_probability_at_the_verify_temperature(temperature, restricted_vocab):
    """The drafts are the same with or without confidences, and each confidence is the softmax of
    the draft logits at the temperature (greedy: at 1) at that draft, within the draft vocabulary."""
    target = tiny_target("qwen3")
    draft = random_draft(target)
    if restricted_vocab:
        draft.draft_vocab = torch.arange(0, target.vocab_size, 3)
    drafter = DFlashDrafter(draft, target)
    prompts = [[3, 9, 14, 22, 5], [5, 6, 40, 41]]
    target.set_taps(draft.config.target_layer_ids)
    _, taps = target.prefill(prompts)
    drafter.start(taps, [64, 64])
    anchors, starts = torch.tensor([22, 41]), torch.tensor([5, 4])
    sampling = DraftSampling(temperature, 7, torch.tensor([11 << 32, 12 << 32])) if temperature else None
    with torch.no_grad():
        alone = drafter.propose([0, 1], anchors, starts, 6, sampling)
        drafts, confidence = drafter.propose([0, 1], anchors, starts, 6, sampling, confidence=True)
        logits = drafter._draft_logits([0, 1], anchors, 6).float()
    assert torch.equal(drafts, alone)
    probabilities = (logits / (temperature or 1.0)).softmax(-1)
    index = drafts if drafter.vocab is None else torch.searchsorted(drafter.vocab, drafts)
    expected = probabilities.gather(-1, index[..., None]).squeeze(-1)
    assert confidence.shape == drafts.shape and confidence.dtype == torch.float32
    torch.testing.assert_close(confidence, expected, rtol=1e-5, atol=1e-6)
    assert float(confidence.min()) > 0.0 and float(confidence.max()) <= 1.0
