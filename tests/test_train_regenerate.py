"""Regenerated training data: the target's own batched answers and the features captured with
them, the on-disk feature dataset, prompts of each source, and training straight from it."""

import ast
import itertools
import json

import pytest
import torch
from transformers import AutoTokenizer

from sglang_dflash.engine.packaged import packaged_model_dir
from sglang_dflash.models import DFlashDraftModel, load_draft
from sglang_dflash.train.code_prompts import (
    INSTALLED_FUNCTIONS,
    STDLIB_FUNCTIONS,
    complete_function_prompt,
    installed_function_prompts,
    stdlib_function_prompts,
)
from sglang_dflash.train.data import Example, iter_records, to_prompt
from sglang_dflash.train.regenerate import (
    generate_batch,
    generate_examples,
    plan_batches,
    read_feature_dataset,
    regenerate_dataset,
    write_feature_dataset,
)
from sglang_dflash.train.trainer import TrainConfig, Trainer, draft_config_for
from tests.dflash_testlib import hf_greedy, tiny_target

TAPS = (0, 2, 3)


def prompts_of(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(8, 96, (n,), generator=gen).tolist() for n in lengths]


def full_forward_taps(target, ids: torch.Tensor) -> torch.Tensor:
    target.set_taps(TAPS)
    with torch.no_grad():
        target.model(ids[None])
    return target.take_taps()[0]


def test_batched_answers_equal_greedy_decoding_and_features_equal_a_full_forward():
    """Prompts of different lengths share a left-padded batch; each answer must be exactly the
    target's own greedy continuation of its prompt alone, and the captured features those of one
    forward over prompt + answer."""
    target = tiny_target(seed=4)
    prompts = prompts_of([3, 11, 6, 17, 9])
    target.set_taps(TAPS)
    unstopped = generate_batch(target, prompts, max_new_tokens=24, stop_ids=[])
    # A stop token that some answers reach early and others never emit.
    answers = [e.input_ids[len(p):].tolist() for p, e in zip(prompts, unstopped, strict=True)]
    stop = next(t for t in answers[0][2:] if sum(t in a for a in answers) < len(answers))
    examples = generate_batch(target, prompts, max_new_tokens=24, stop_ids=[stop])
    stopped = 0
    for prompt, example in zip(prompts, examples, strict=True):
        answer = example.input_ids[len(prompt):].tolist()
        assert example.input_ids[:len(prompt)].tolist() == prompt
        assert answer == hf_greedy(target, prompt, 24, stop)
        assert example.loss_mask.tolist() == [False] * len(prompt) + [True] * len(answer)
        stopped += answer[-1] == stop and len(answer) < 24
        assert example.features.dtype == torch.bfloat16
        expected = full_forward_taps(target, example.input_ids)
        torch.testing.assert_close(example.features.float(), expected, rtol=1e-2, atol=1e-2)
    assert 0 < stopped < len(prompts), "the test needs rows that stop early and rows that run to the limit"


def test_kept_teacher_is_the_top_k_of_a_full_forward_at_each_answer_token():
    """teacher row j: the target's top-k next-token distribution (T = 1) that answer token j was
    chosen from, i.e. the full forward's log-softmax at the position before it."""
    target = tiny_target(seed=4)
    prompts = prompts_of([3, 11, 6])
    target.set_taps(TAPS)
    for example, prompt in zip(generate_batch(target, prompts, 20, stop_ids=[], teacher_topk=5), prompts,
                               strict=True):
        answer = example.input_ids[len(prompt):]
        assert example.teacher_ids.shape == example.teacher_logprobs.shape == (len(answer), 5)
        assert example.teacher_ids.dtype == torch.int32
        assert example.teacher_ids[:, 0].tolist() == answer.tolist()  # greedy: the top token was chosen
        with torch.no_grad():
            logits = target.model(example.input_ids[None]).logits[0].float()
        full = logits[len(prompt) - 1:-1].log_softmax(-1).topk(5, dim=-1)
        assert torch.equal(example.teacher_ids.long(), full.indices)
        torch.testing.assert_close(example.teacher_logprobs, full.values, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"teacher_topk must be in \[0, 96\].*got 129"):
        regenerate_dataset(target, ["unused"], "unused", TAPS, teacher_topk=129)


def test_sampled_answers_follow_the_seed():
    target = tiny_target(seed=4)
    prompts = prompts_of([5, 7, 4])

    def answers(seed):
        return [e.input_ids.tolist() for e in generate_examples(target, prompts, TAPS, 16, temperature=1.0,
                                                                seed=seed, batch_size=2)]
    assert answers(1) == answers(1)
    assert answers(1) != answers(2)
    assert target.tap_layer_ids == (), "generation must restore the target's taps"


def test_batches_respect_rows_and_the_token_budget():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 3000, (300,), generator=g).tolist()
    batches = plan_batches(lengths, batch_size=32, max_new_tokens=100, max_batch_tokens=20000)
    assert sorted(i for b in batches for i in b) == list(range(300))  # every prompt exactly once
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat)  # similar lengths together: shortest first
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert len(b) <= 32
        assert len(b) == 1 or len(b) * (longest + 100) <= 20000
    assert max(len(b) for b in batches) == 32  # short prompts still fill whole batches
    assert plan_batches([50000, 10], 8, 10, 1000) == [[1], [0]]  # over budget alone: a batch of its own


def test_feature_dataset_round_trip_and_layer_check(tmp_path):
    target = tiny_target(seed=4)
    examples = list(generate_examples(target, prompts_of([4, 9, 6, 12, 5]), TAPS, 12, batch_size=2, teacher_topk=3))
    assert write_feature_dataset(tmp_path / "ds", examples, {"layer_ids": list(TAPS)}, shard_size=2) == 5
    assert len(list((tmp_path / "ds").glob("shard_*.pt"))) == 3
    loaded = read_feature_dataset(tmp_path / "ds", TAPS)
    assert len(loaded) == 5
    for a, b in zip(examples, loaded, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.features, b.features)
        assert torch.equal(a.teacher_ids, b.teacher_ids) and torch.equal(a.teacher_logprobs, b.teacher_logprobs)
    with pytest.raises(ValueError, match=r"holds target layers \[0, 2, 3\].*--target-layer-ids 1,2"):
        read_feature_dataset(tmp_path / "ds", (1, 2))
    with pytest.raises(FileNotFoundError, match="not a feature dataset"):
        read_feature_dataset(tmp_path)


def test_training_on_captured_features_matches_training_on_recomputed_ones():
    """The trainer uses an example's captured features instead of running the target again; the
    loss must be the same as with features recomputed by a full forward (up to bf16 rounding)."""
    target = tiny_target(seed=4)
    examples = list(generate_examples(target, prompts_of([6, 8, 7]), TAPS, 30, batch_size=3))
    cfg = TrainConfig(out="unused", block_size=4, layers=2, num_anchors=8, mask_token_id=5, target_layer_ids=TAPS)
    torch.manual_seed(0)
    draft = DFlashDraftModel(draft_config_for(target.model.config, None, cfg))
    trainer = Trainer(target.model, draft, examples, examples, cfg)
    without = [Example(e.input_ids, e.loss_mask) for e in examples]
    for i, (with_features, plain) in enumerate(zip(examples, without, strict=True)):
        anchors = torch.tensor([2, 5, 9])
        a = trainer.sequence_loss(i, with_features, anchors)
        b = trainer.sequence_loss(i, plain, anchors)
        torch.testing.assert_close(a[0], b[0], rtol=2e-2, atol=1e-3)


def test_prompts_of_each_record_kind():
    assert to_prompt({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]
    assert to_prompt({"question": "q", "answer": "a"}) == [{"role": "user", "content": "q"}]
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                         {"role": "assistant", "content": "a"}, {"role": "user", "content": "u2"}]}
    assert to_prompt(chat) == chat["messages"][:2]
    with pytest.raises(ValueError, match="plain-text record has no prompt"):
        to_prompt({"text": "x"})
    with pytest.raises(ValueError, match="starts with an assistant turn"):
        to_prompt({"messages": [{"role": "assistant", "content": "a"}]})


@pytest.mark.parametrize("source, build", [(STDLIB_FUNCTIONS, stdlib_function_prompts),
                                           (INSTALLED_FUNCTIONS, installed_function_prompts)])
def test_function_prompts_are_humaneval_style_stubs(source, build):
    prompts = list(itertools.islice(build(), 600))  # the stdlib alone, or torch + transformers, hold thousands
    assert len(prompts) == 600 and len(set(prompts)) > 0.95 * len(prompts)
    assert prompts == [r["prompt"] for r in itertools.islice(iter_records(source), 600)]
    for prompt in prompts:
        code = prompt.removeprefix(complete_function_prompt("")[:-3]).removesuffix("```")
        (function,) = ast.parse(code).body  # the docstring alone is a valid body
        assert isinstance(function, ast.FunctionDef), prompt
        assert len(ast.get_docstring(function, clean=False).strip()) >= 40, prompt
        assert len(function.body) == 1, prompt  # the implementation is left out


def test_regenerate_command_writes_a_dataset_train_reads(tmp_path, monkeypatch):
    """`sglang-dflash regenerate` on the real SmolLM2 target and GSM8K prompts, then `train` on
    the written feature dataset (held-out examples from --held-out or --held-out-data)."""
    import sglang_dflash.train.run as run
    from sglang_dflash.cli import main
    from tests.test_train_data import GSM8K

    sizes = []

    class SizeRecordingTrainer(Trainer):
        def __init__(self, target, draft, train, held, *args, **kwargs):
            sizes.append((len(train), len(held)))
            super().__init__(target, draft, train, held, *args, **kwargs)

    monkeypatch.setattr(run, "Trainer", SizeRecordingTrainer)

    data = tmp_path / "regen"
    assert main(["regenerate", "--target", "smollm2-135m", "--data", str(GSM8K), "--skip", "4", "--limit", "3",
                 "--out", str(data), "--target-layer-ids", "2,20", "--max-new-tokens", "12", "--batch-size", "2",
                 "--threads", "2"]) == 0
    meta = json.loads((data / "meta.json").read_text())
    assert meta["examples"] == 3 and meta["layer_ids"] == [2, 20] and meta["skip"] == 4
    tokenizer = AutoTokenizer.from_pretrained(packaged_model_dir("smollm2-135m"))
    texts = [tokenizer.decode(e.input_ids) for e in read_feature_dataset(data)]
    questions = [r["question"] for r in iter_records(GSM8K)]
    assert sorted(q for q in questions[:8] if any(q in t for t in texts)) == sorted(questions[4:7])
    out = tmp_path / "draft"
    base = ["train", "--target", "smollm2-135m", "--data", str(data), "--out", str(out), "--held-out", "1",
            "--num-anchors", "2", "--layers", "1", "--block-size", "4", "--steps", "2", "--threads", "2"]
    assert main(base) == 2, "a drafter tapping other layers than the dataset must be refused"
    assert main(base + ["--target-layer-ids", "2,20", "--draft-vocab", "50"]) == 0
    assert (out / "model.safetensors").exists()
    assert main(base + ["--target-layer-ids", "2,20", "--steps", "3", "--held-out-data", str(data)]) == 0
    assert sizes == [(2, 1), (3, 3)]  # --held-out 1 of the 3 examples; then all 3 train, and all 3 are held out
    vocab = load_draft(out).draft_vocab
    assert vocab.shape == (50,) and bool((vocab[1:] > vocab[:-1]).all())
