"""Drafter training end to end on a tiny random target: it learns, resumes exactly, exports."""

import pytest
import torch

from sglang_dflash.models import DFlashDraftModel, load_draft
from sglang_dflash.train.blocks import pack_blocks
from sglang_dflash.train.data import Example
from sglang_dflash.train.forward import training_hidden
from sglang_dflash.train.trainer import TrainConfig, Trainer, draft_config_for
from tests.dflash_testlib import tiny_target

BLOCK = 4


def target_generated(model, n: int, seed: int, prompt_len: int = 6, new_tokens: int = 40) -> list[Example]:
    """Sequences the target wrote itself (greedy), trained on the generated part: the drafter can
    learn them, and teacher-forced tau on them is the greedy tau."""
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(n):
        prompt = torch.randint(8, model.config.vocab_size, (1, prompt_len), generator=gen)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0]
        mask = torch.zeros(out.numel(), dtype=torch.bool)
        mask[prompt_len:] = True
        examples.append(Example(out, mask))
    return examples


@pytest.fixture(scope="module")
def setup():
    """A small-vocabulary target with tied embeddings: its greedy text has structure (repeats)
    that a drafter can pick up within a few dozen steps."""
    target = tiny_target("qwen3", vocab=32, seed=3).model
    target.lm_head.weight = target.model.embed_tokens.weight
    return target, target_generated(target, 32, seed=0), target_generated(target, 6, seed=1)


def make_trainer(setup, out, steps=30, **overrides):
    target, train, held_out = setup
    cfg = TrainConfig(out=str(out), block_size=BLOCK, layers=2, steps=steps, lr=3e-3, num_anchors=32,
                      eval_every=steps, save_every=steps, mask_token_id=5, **overrides)
    torch.manual_seed(0)
    draft = DFlashDraftModel(draft_config_for(target.config, None, cfg))
    return Trainer(target, draft, train, held_out, cfg)


def test_training_lowers_loss_and_raises_tau(setup, tmp_path):
    trainer = make_trainer(setup, tmp_path / "run", steps=30)
    before = trainer.evaluate()
    history = trainer.run()
    after = history[-1]
    assert after["held_out_loss"] < 0.9 * before["held_out_loss"], (before, after)
    assert after["tau"] > before["tau"] + 0.15, (before, after)
    # tau at smaller block sizes: the same runs cut shorter, so never more, and at most b tokens
    taus = [after[f"tau@{b}"] for b in range(2, BLOCK)] + [after["tau"]]
    assert all(1.0 <= t <= b for t, b in zip(taus, range(2, BLOCK + 1), strict=True))
    assert taus == sorted(taus) and taus[0] < taus[-1], taus
    first = sum(h["loss"] for h in history[:5]) / 5
    last = sum(h["loss"] for h in history[-5:]) / 5
    assert last < first
    assert (tmp_path / "run" / "training.png").stat().st_size > 1000


def test_resume_continues_exactly(setup, tmp_path):
    straight = make_trainer(setup, tmp_path / "a", steps=4)
    for _ in range(4):
        straight.train_step()

    first = make_trainer(setup, tmp_path / "b", steps=4)
    for _ in range(2):
        first.train_step()
    first.save()
    resumed = make_trainer(setup, tmp_path / "b", steps=4)
    assert resumed.resume() and resumed.step == 2
    for _ in range(2):
        resumed.train_step()
    for (name, a), b in zip(straight.draft.state_dict().items(), resumed.draft.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_exported_checkpoint_reloads_with_the_same_outputs(setup, tmp_path):
    trainer = make_trainer(setup, tmp_path / "c", steps=2)
    trainer.run()
    loaded = load_draft(tmp_path / "c")
    example = setup[2][0]
    anchors = torch.tensor([8, 20])
    packed = pack_blocks(example.input_ids, example.loss_mask, anchors, BLOCK, 5, 4.0)
    features, _ = trainer.features(0, example.input_ids)
    embeds = trainer.embed(packed.input_ids)
    with torch.no_grad():
        a = training_hidden(trainer.draft.eval(), features, embeds, packed.positions, anchors, BLOCK)
        b = training_hidden(loaded, features, embeds, packed.positions, anchors, BLOCK)
    torch.testing.assert_close(a, b)


def test_training_plot_draws_each_held_out_set(tmp_path, monkeypatch):
    """A history resumed on another held-out set (evaluations tagged "held_out_set", one of them
    an evaluation-only entry) plots without mixing the two sets into one line."""
    import matplotlib.pyplot as plt

    from sglang_dflash.train.trainer import plot_history

    history = [{"step": s, "loss": 5.0 / s} for s in range(1, 7)]
    history[2].update(tau=1.5, held_out_loss=4.0, held_out_set="first")
    history.append({"step": 6, "tau": 1.4, "held_out_loss": 4.2, "held_out_set": "second"})
    history[5].update(tau=1.6, held_out_loss=3.9, held_out_set="second")
    lines = []
    real_savefig = plt.Figure.savefig

    def recording_savefig(fig, *args, **kwargs):
        lines.extend(line.get_label() for line in fig.axes[1].get_lines())
        real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", recording_savefig)
    plot_history(history, tmp_path / "training.png")
    assert lines == ["held-out first", "held-out second"]
    assert (tmp_path / "training.png").stat().st_size > 1000
