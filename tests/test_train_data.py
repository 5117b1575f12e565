"""Training data: schemas, chat loss masks on the real SmolLM2 tokenizer, GSM8K and stdlib sources."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sglang_dflash.data import gsm8k_path
from sglang_dflash.engine.packaged import packaged_model_dir
from sglang_dflash.train.data import iter_records, load_examples, to_conversation, tokenize

GSM8K = gsm8k_path("train")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(packaged_model_dir("smollm2-135m"))


def test_schemas_normalize_to_messages():
    qa = to_conversation({"question": "q?", "answer": "a."})
    assert qa == [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "a."}]
    share = to_conversation({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
    assert [m["role"] for m in share] == ["user", "assistant"]
    alpaca = to_conversation({"instruction": "do", "input": "this", "output": "done"})
    assert alpaca[0]["content"] == "do\n\nthis" and alpaca[1]["content"] == "done"
    assert to_conversation({"text": "plain"}) == "plain"
    with pytest.raises(ValueError, match="unknown training record schema with keys"):
        to_conversation({"foo": 1})


def test_chat_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    messages = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "It is 5."},
                {"role": "user", "content": "And 4 + 4?"},
                {"role": "assistant", "content": "It is 8."}]
    ex = tokenize(tokenizer, messages, max_len=512)
    assert ex.input_ids.shape == ex.loss_mask.shape
    trained = tokenizer.decode(ex.input_ids[ex.loss_mask])
    assert "It is 5." in trained and "It is 8." in trained
    assert "What is 2 + 3?" not in trained and "And 4 + 4?" not in trained
    # The untrained tokens are the template's prompt parts, and the whole rendering is intact.
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(ex.input_ids) == full
    truncated = tokenize(tokenizer, messages, max_len=10)
    assert truncated.input_ids.numel() == 10 and truncated.loss_mask.numel() == 10


def test_gsm8k_examples(tokenizer):
    examples = load_examples(GSM8K, tokenizer, max_len=256, limit=20)
    assert 15 <= len(examples) <= 20
    for ex in examples:
        assert ex.input_ids.numel() <= 256
        assert ex.loss_mask.any() and not ex.loss_mask[:5].any()  # the question is not trained on


def test_python_source_tree_is_chunked(tokenizer, tmp_path):
    import json as stdlib_json

    examples = load_examples(Path(stdlib_json.__file__).parent, tokenizer, max_len=128)
    assert len(examples) > 10
    assert all(ex.input_ids.numel() <= 128 and ex.loss_mask.all() for ex in examples)


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(iter_records(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid JSON"):
        list(iter_records(tmp_path / "bad.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no .py files"):
        list(iter_records(tmp_path / "empty"))
    (tmp_path / "list.json").write_text(json.dumps([{"text": "a"}, {"text": "b"}]))
    assert len(list(iter_records(tmp_path / "list.json"))) == 2


def test_train_command_trains_exports_and_resumes(tmp_path, capsys):
    """`sglang-dflash train` on the real SmolLM2 target and GSM8K: a z-lab checkpoint comes out,
    reloads, and a second call with more steps resumes from it."""
    import json as stdlib_json

    from sglang_dflash.cli import main
    from sglang_dflash.models import load_draft

    out = tmp_path / "draft"
    args = ["train", "--target", "smollm2-135m", "--data", str(GSM8K), "--out", str(out), "--limit", "8",
            "--held-out", "2", "--num-anchors", "4", "--max-len", "128", "--layers", "1", "--block-size", "8",
            "--eval-every", "2", "--save-every", "2", "--threads", "2"]
    assert main(args + ["--steps", "2"]) == 0
    draft = load_draft(out)
    assert draft.config.block_size == 8 and draft.config.num_taps == 1
    assert main(args + ["--steps", "3"]) == 0
    history = stdlib_json.loads((out / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3]
    assert "tau" in history[1] and (out / "training.png").exists()
