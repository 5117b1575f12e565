"""Drafter training end to end on a tiny random target: it learns, resumes exactly, exports."""

import pytest
import torch

from sglang_dflash.models import DFlashDraftModel, load_draft
from sglang_dflash.train.blocks import pack_blocks
from sglang_dflash.train.data import Example
from sglang_dflash.train.forward import training_hidden
from sglang_dflash.train.trainer import DFLASH2_SHAPE, TrainConfig, Trainer, draft_arch, draft_config_for, selector_loss
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


def test_dflash2_training_learns_its_convolutions_and_selector_and_reloads(setup, tmp_path):
    trainer = make_trainer(setup, tmp_path / "d2", steps=30, arch="dflash2")
    draft = trainer.draft
    assert draft_arch(draft.config) == "dflash2" and draft.config.selector_top_k == DFLASH2_SHAPE["selector_top_k"]
    assert draft.layers[0].attention_conv is not None and draft.candidate_selector is not None
    codebook = draft.candidate_selector.successor_codebook.detach().clone()
    kernels = draft.layers[0].mlp_conv.base_kernel.detach().clone()
    assert codebook.abs().max() > 0  # a fresh selector starts off zero, where it has no gradient
    before = trainer.evaluate()
    history = trainer.run()
    after = history[-1]
    assert after["held_out_loss"] < 0.9 * before["held_out_loss"] and after["tau"] > before["tau"] + 0.15
    # the trained selector's picks do no worse than the LM head's argmax (what a zero codebook picks;
    # on this tiny target 30 steps leave them tied)
    trained_selector = trainer.evaluate()["tau"]
    with torch.no_grad():
        draft.candidate_selector.successor_codebook.zero_()
    assert trained_selector >= trainer.evaluate()["tau"]
    loaded = load_draft(tmp_path / "d2")
    assert not torch.equal(loaded.candidate_selector.successor_codebook, codebook)
    assert not torch.equal(loaded.layers[0].mlp_conv.base_kernel, kernels)
    assert draft_arch(loaded.config) == "dflash2"


def test_the_selector_loss_scores_candidates_after_the_true_token_as_the_lattice_does():
    torch.manual_seed(0)
    target = tiny_target("qwen3", vocab=32, seed=3).model
    cfg = TrainConfig(out="unused", block_size=BLOCK, arch="dflash2", mask_token_id=5)
    selector = DFlashDraftModel(draft_config_for(target.config, None, cfg)).candidate_selector
    with torch.no_grad():
        for p in selector.parameters():
            p.normal_()
    e, k, hidden_size = 3, selector.top_k, target.config.hidden_size
    candidates = torch.stack([torch.randperm(32)[:k] for _ in range(e)])[None]  # [1, E, K]
    unary, hidden, anchor = torch.randn(1, e, k), torch.randn(1, e, hidden_size), torch.tensor([7])
    lattice = selector.lattice(candidates, unary, hidden, anchor)  # [1, E, K, K]
    for pos in range(e):
        for i in range(k):
            before = anchor[0] if pos == 0 else candidates[0, pos - 1, i]
            torch.testing.assert_close(selector.teacher_scores(before.view(1), candidates[:, pos], unary[:, pos],
                                                               hidden[:, pos]), lattice[:, pos, i],
                                       rtol=1e-5, atol=1e-4)  # summed in another order
    # the loss: a row whose true token is a candidate is that candidate's class; others have none
    logits = torch.randn(4, 32, requires_grad=True)
    hidden_rows = torch.randn(4, hidden_size, requires_grad=True)
    top = logits.detach().topk(k)
    labels = torch.stack([top.indices[0, 2], top.indices[1, 0], logits[2].detach().argmin(), top.indices[3, k - 1]])
    predecessors, weights = torch.tensor([1, 2, 3, 4]), torch.tensor([1.0, 0.5, 1.0, 0.0])
    loss, choice = selector_loss(selector, hidden_rows, logits, labels, predecessors, weights)
    scores = selector.teacher_scores(predecessors, top.indices, top.values, hidden_rows.detach())
    expected = (torch.nn.functional.cross_entropy(scores[0], torch.tensor(2))
                + 0.5 * torch.nn.functional.cross_entropy(scores[1], torch.tensor(0)))  # row 2: no class, row 3: 0
    torch.testing.assert_close(loss, expected)
    assert torch.equal(choice, top.indices.gather(1, scores.argmax(1, keepdim=True)).squeeze(1))
    loss.backward()
    assert logits.grad is None and hidden_rows.grad is None  # the draft's own loss trains those
    assert selector.successor_codebook.grad is not None


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
