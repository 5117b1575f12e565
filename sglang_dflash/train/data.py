"""Training data for drafters: records from jsonl files or source trees, tokenized with a loss mask.

Chat records are rendered with the target's chat template and trained only on the assistant
turns; plain text (and source code) is trained on every token. Known record schemas:
  {"messages": [{"role", "content"}, ...]}           OpenAI-style chat
  {"conversations": [{"from", "value"}, ...]}        ShareGPT
  {"question", "answer"}                             GSM8K
  {"prompt", "response" | "completion" | "output"}   single turn
  {"instruction", "output"} (+ optional "input")     Alpaca
  {"text"}                                           plain text
  {"prompt"} alone                                   a prompt to regenerate an answer for
A source may also be `python-stdlib-functions` or `python-installed-functions`: HumanEval-style
prompts built from this Python's standard library or its installed packages (train/code_prompts.py).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_dflash.train.code_prompts import (
    INSTALLED_FUNCTIONS,
    STDLIB_FUNCTIONS,
    installed_function_prompts,
    stdlib_function_prompts,
)

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}


@dataclass
class Example:
    input_ids: torch.Tensor  # int64 [L]
    loss_mask: torch.Tensor  # bool [L]: the tokens the drafter learns to predict
    features: torch.Tensor | None = None  # [L, K*H] target taps captured at generation (train/regenerate.py)
    # The target's own next-token distribution at every trained-on token (loss_mask order), as its
    # top-k ids and log-probabilities at T = 1, captured at generation for distillation (train/distill.py).
    teacher_ids: torch.Tensor | None = None  # int32 [loss_mask.sum(), k]
    teacher_logprobs: torch.Tensor | None = None  # float32 [loss_mask.sum(), k]


def iter_records(path: str | Path) -> Iterator[dict]:
    """Records of a .jsonl / .json file, or {"text": source} for each .py file under a directory."""
    named_sources = {STDLIB_FUNCTIONS: stdlib_function_prompts, INSTALLED_FUNCTIONS: installed_function_prompts}
    if str(path) in named_sources:
        yield from ({"prompt": p} for p in named_sources[str(path)]())  # lazily: --limit parses only what it reads
        return
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"training data {path} does not exist")
    if path.is_dir():
        files = sorted(path.rglob("*.py"))
        if not files:
            raise ValueError(f"training data directory {path} holds no .py files")
        for file in files:
            text = file.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                yield {"text": text}
        return
    if path.suffix == ".json":
        records = json.loads(path.read_text(encoding="utf-8"))
        yield from (records if isinstance(records, list) else [records])
        return
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{line_no} is not valid JSON: {exc}") from exc


def to_conversation(record: dict) -> list[dict] | str:
    """The record as chat messages, or as plain text; ValueError for an unknown schema."""
    if "messages" in record:
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    if "conversations" in record:
        return [{"role": _SHAREGPT_ROLES.get(m["from"], "user"), "content": m["value"]}
                for m in record["conversations"]]
    if "question" in record and "answer" in record:
        return [{"role": "user", "content": record["question"]}, {"role": "assistant", "content": record["answer"]}]
    for answer_key in ("response", "completion", "output"):
        if answer_key in record:
            prompt = record.get("prompt") or record.get("instruction", "")
            if record.get("input"):
                prompt = f"{prompt}\n\n{record['input']}"
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record[answer_key]}]
    if "text" in record:
        return record["text"]
    raise ValueError(f"unknown training record schema with keys {sorted(record)}; expected one of: messages, "
                     "conversations, question/answer, prompt/response, instruction/output, text")


def to_prompt(record: dict) -> list[dict]:
    """The messages a target answers when its answer is regenerated: everything before the first
    assistant turn (or the record's lone prompt)."""
    answer_keys = {"response", "completion", "output", "answer"}
    if "prompt" in record and not answer_keys & record.keys():
        return [{"role": "user", "content": record["prompt"]}]
    item = to_conversation(record)
    if isinstance(item, str):
        raise ValueError("a plain-text record has no prompt to regenerate an answer for")
    turn = next((i for i, m in enumerate(item) if m["role"] == "assistant"), len(item))
    if turn == 0:
        raise ValueError("conversation starts with an assistant turn; nothing to prompt the target with")
    return item[:turn]


def chat_segments(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, is_assistant_output) pieces.

    Each assistant turn's piece is the difference between the template applied through that
    turn and the template applied to the turns before it with the generation prompt, so the
    trained tokens are exactly what the model would generate for that turn.
    """
    def render(msgs, generation_prompt):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

    segments, done = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:i], True)
        full = render(messages[: i + 1], False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise ValueError("the chat template does not render conversations incrementally (turn "
                             f"{i} changes earlier text), so assistant tokens cannot be located")
        segments += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    if not segments:
        raise ValueError("conversation has no assistant turn to train on")
    return segments


def tokenize(tokenizer, item: list[dict] | str, max_len: int) -> Example:
    """Token ids and loss mask of one conversation or text, truncated to max_len tokens."""
    if isinstance(item, str):
        ids = tokenizer(item, add_special_tokens=False)["input_ids"][:max_len]
        return Example(torch.tensor(ids, dtype=torch.int64), torch.ones(len(ids), dtype=torch.bool))
    ids, mask = [], []
    for text, trained in chat_segments(tokenizer, item):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [trained] * len(piece)
    return Example(torch.tensor(ids[:max_len], dtype=torch.int64), torch.tensor(mask[:max_len], dtype=torch.bool))


def chunk_text(example: Example, max_len: int) -> list[Example]:
    """Long plain-text examples (whole source files) as consecutive windows of max_len tokens."""
    return [Example(example.input_ids[s:s + max_len], example.loss_mask[s:s + max_len])
            for s in range(0, example.input_ids.numel(), max_len)]


def load_examples(path: str | Path, tokenizer, max_len: int, limit: int | None = None,
                  min_len: int = 8) -> list[Example]:
    """Tokenized examples of a data source (its first `limit` records); plain texts are cut into
    windows of max_len tokens, conversations truncated. Shorter examples are dropped."""
    records = list(itertools.islice(iter_records(path), limit))
    examples = []
    for record in tqdm(records, desc=f"tokenize {Path(path).name}", unit="record"):
        item = to_conversation(record)
        if isinstance(item, str):
            examples += chunk_text(tokenize(tokenizer, item, max_len=1 << 62), max_len)
        else:
            examples.append(tokenize(tokenizer, item, max_len))
    return [e for e in examples if e.input_ids.numel() >= min_len and bool(e.loss_mask.any())]
