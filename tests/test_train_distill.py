"""Distillation: KL(target || draft) from the target's full logits or from the top-k it kept at
regeneration, and the trainer's use of the kept top-k without a target pass."""

import pytest
import torch

from sglang_dflash.models import DFlashDraftModel
from sglang_dflash.train.data import Example
from sglang_dflash.train.distill import full_kl, topk_kl
from sglang_dflash.train.regenerate import generate_examples
from sglang_dflash.train.trainer import TrainConfig, Trainer, draft_config_for
from tests.dflash_testlib import tiny_target

SHAPES = [(1, 5), (3, 17), (7, 300), (4, 1000)]


def random_logits(rows, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(rows, 1, generator=g) * 6 + 0.5  # from flat to peaked distributions
    return torch.randn(rows, vocab, generator=g) * scale, torch.randn(rows, vocab, generator=g) * scale


def teacher_topk(target_logits, k):
    logprobs = target_logits.log_softmax(-1)
    top = logprobs.topk(k, dim=-1)
    return top.indices.int(), top.values


@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_topk_kl_over_the_whole_vocabulary_is_the_full_kl(rows, vocab):
    draft, target = random_logits(rows, vocab, seed=rows * vocab)
    ids, logprobs = teacher_topk(target, vocab)
    torch.testing.assert_close(topk_kl(draft, ids, logprobs), full_kl(draft, target), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows,vocab", SHAPES[1:])
@pytest.mark.parametrize("k", [1, 4, 16])
def test_topk_kl_is_the_kl_of_the_distributions_coarsened_to_k_plus_one_outcomes(rows, vocab, k):
    draft, target = random_logits(rows, vocab, seed=k + rows * vocab)
    ids, logprobs = teacher_topk(target, k)
    got = topk_kl(draft, ids, logprobs)
    p, q = target.double().softmax(-1), draft.double().softmax(-1)
    expected = []
    for r in range(rows):
        top = ids[r].long()
        p_coarse = torch.cat([p[r, top], (1 - p[r, top].sum())[None]])
        q_coarse = torch.cat([q[r, top], (1 - q[r, top].sum())[None]])
        expected.append(float((p_coarse * (p_coarse / q_coarse).log()).sum()))
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-4, atol=1e-5)
    assert bool((got <= full_kl(draft, target) + 1e-5).all()), "coarsening can only lose information"
    assert float(topk_kl(target, ids, logprobs).abs().max()) < 1e-5, "a draft equal to the target has KL 0"


def test_topk_kl_names_mismatched_teacher_shapes():
    draft, target = random_logits(3, 20, seed=0)
    ids, logprobs = teacher_topk(target, 4)
    with pytest.raises(ValueError, match=r"teacher ids \(3, 4\) and log-probabilities \(3, 3\)"):
        topk_kl(draft, ids, logprobs[:, :3])
    with pytest.raises(ValueError, match=r"\[rows=2, k\]"):
        topk_kl(draft[:2], ids, logprobs)


def test_the_trainer_distils_from_the_kept_top_k_without_running_the_target():
    """With the whole vocabulary kept, the loss from the kept teacher equals the loss from the
    target's recomputed logits (up to the bf16 features), and no target pass happens. (Anchors
    are drawn per example index, so every call of one example trains the same blocks.)"""
    target = tiny_target(seed=4)
    taps, vocab = (0, 2, 3), target.vocab_size
    prompts = [torch.randint(8, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (6, 9, 7, 5, 8, 4)]
    kept = list(generate_examples(target, prompts, taps, 30, temperature=1.0, seed=3, batch_size=3,
                                  teacher_topk=vocab))
    assert all(e.teacher_ids.shape == (int(e.loss_mask.sum()), vocab) for e in kept)
    kept = [e for e in kept if e.loss_mask.sum() >= 8]  # answers that stopped early have no block to train
    assert len(kept) >= 3
    cfg = TrainConfig(out="unused", block_size=4, layers=2, num_anchors=8, mask_token_id=5, target_layer_ids=taps,
                      kl_weight=0.5)
    torch.manual_seed(0)
    draft = DFlashDraftModel(draft_config_for(target.model.config, None, cfg))
    trainer = Trainer(target.model, draft, kept, kept, cfg)
    recompute = trainer.features
    with_teacher = []
    trainer.features = lambda *a, **k: pytest.fail("a kept teacher must not run the target")
    for i, example in enumerate(kept):
        with_teacher.append(trainer.sequence_loss(i, example)[0])
    trainer.features = recompute
    cfg_ce = TrainConfig(**{**cfg.__dict__, "kl_weight": 0.0})
    for i, example in enumerate(kept):
        plain = Example(example.input_ids, example.loss_mask)  # no features, no teacher: a target pass
        distilled = trainer.sequence_loss(i, plain)[0]
        torch.testing.assert_close(with_teacher[i], distilled, rtol=2e-2, atol=1e-3)
        trainer.cfg = cfg_ce
        ce_only = trainer.sequence_loss(i, plain)[0]
        trainer.cfg = cfg
        assert float((distilled - ce_only).detach()) > 1e-3, "the KL term must add to the loss of a random drafter"
