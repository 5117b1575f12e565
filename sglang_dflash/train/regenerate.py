"""Training data in the target's own words: the target answers the prompts itself (greedy or
sampled), in large batches, and the drafter's context features (the tapped layers' outputs) are
captured by the same forward passes, so no second pass over the sequences is needed.

A drafter is only useful where it guesses what the target will say; training on the target's
own answers instead of a dataset's human answers is what makes held-out tau track real tau.

Batches are left-padded into a static KV cache (one allocation, no per-step concatenation);
positions come from the padding mask, so every row sees exactly its own tokens. A finished row
idles (its input is ignored) until the whole batch is done.

On disk a feature dataset is a directory: `meta.json` (target, tapped layer ids, counts) and
`shard_NNNNN.pt` files, each a list of {input_ids, loss_mask, features (bf16 [L, K*H]: fp16 would overflow on
some targets' massive activations)}, plus {teacher_ids, teacher_logprobs} when the target's top-k next-token
distribution was kept for distillation (`teacher_topk`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import StaticCache

from sglang_dflash.engine import HFTarget
from sglang_dflash.train.data import Example, iter_records, to_prompt

META_NAME = "meta.json"


@torch.no_grad()
def generate_batch(target: HFTarget, prompts: list[list[int]], max_new_tokens: int, stop_ids: Iterable[int],
                   temperature: float = 0.0, generator: torch.Generator | None = None,
                   teacher_topk: int = 0) -> list[Example]:
    """One batch: every prompt answered by the target, up to max_new_tokens or a stop token
    (kept). Features hold the taps set on `target` (`set_taps`) for every token, prompt included.
    With `teacher_topk` = k > 0 each answer token also keeps the target's k most likely tokens and
    their log-probabilities at T = 1 (the distribution it was drawn from, before temperature)."""
    device, bs = target.device, len(prompts)
    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    ids = torch.tensor([[0] * n + p for n, p in zip(pad, prompts, strict=True)], device=device)
    mask = torch.zeros(bs, width + max_new_tokens, dtype=torch.long, device=device)
    for row, n in enumerate(pad):
        mask[row, n:width] = 1
    cache = StaticCache(config=target.model.config, max_cache_len=width + max_new_tokens)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    positions = (mask[:, :width].cumsum(1) - 1).clamp(min=0)

    out = target.model(input_ids=ids, attention_mask=mask[:, :width], position_ids=positions,
                       past_key_values=cache, cache_position=torch.arange(width, device=device),
                       use_cache=True, logits_to_keep=1)
    features = [target.take_taps()]  # [bs, width, K*H], then [bs, 1, K*H] per step
    tokens, teacher = [], []
    finished = torch.zeros(bs, dtype=torch.bool, device=device)
    lengths = torch.full((bs,), max_new_tokens, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        if teacher_topk > 0:
            teacher.append(logits.log_softmax(-1).topk(teacher_topk, dim=-1))
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            token = logits.argmax(-1)
        tokens.append(token)
        now_stopped = ~finished & torch.isin(token, stops)
        lengths[now_stopped] = step + 1
        finished |= now_stopped
        # The last token of every row must go through the target once more for its features.
        mask[:, width + step] = 1
        positions = positions[:, -1:] + 1
        out = target.model(input_ids=token[:, None], attention_mask=mask[:, :width + step + 1],
                           position_ids=positions, past_key_values=cache,
                           cache_position=torch.tensor([width + step], device=device), use_cache=True)
        features.append(target.take_taps())
        if bool(finished.all()):
            break
    answers = torch.stack(tokens, dim=1)
    features = torch.cat(features, dim=1)
    if teacher:
        teacher_logprobs = torch.stack([t.values for t in teacher], dim=1)  # [bs, steps, k]
        teacher_ids = torch.stack([t.indices for t in teacher], dim=1).int()
    examples = []
    for row in range(bs):
        n, answer = int(lengths[row]), answers[row, : int(lengths[row])]
        prompt = ids[row, pad[row]:]
        examples.append(Example(
            input_ids=torch.cat([prompt, answer]).cpu(),
            loss_mask=torch.cat([torch.zeros(len(prompt), dtype=torch.bool), torch.ones(n, dtype=torch.bool)]),
            features=features[row, pad[row]: width + n].to(torch.bfloat16).cpu(),
            teacher_ids=teacher_ids[row, :n].cpu() if teacher else None,
            teacher_logprobs=teacher_logprobs[row, :n].cpu() if teacher else None))
    return examples


MAX_BATCH_TOKENS = 49152  # padded sequence tokens per batch; GSM8K-sized prompts still fill 128 rows


def plan_batches(lengths: list[int], batch_size: int, max_new_tokens: int,
                 max_batch_tokens: int = MAX_BATCH_TOKENS) -> list[list[int]]:
    """Prompt indices grouped into batches of similar length (shortest first, so little padding),
    each of at most `batch_size` rows and `max_batch_tokens` padded tokens (rows x (longest prompt
    + max_new_tokens)); a prompt over the budget alone still gets a batch of its own. Without the
    token budget, a batch of long prompts (package docstrings of thousands of tokens) needs tens of
    GiB for the prefill's attention."""
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        # Sorted ascending, so the newest prompt is the batch's longest.
        if batches and len(batches[-1]) < batch_size and \
                (len(batches[-1]) + 1) * (lengths[i] + max_new_tokens) <= max_batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def generate_examples(target: HFTarget, prompts: list[list[int]], layer_ids: tuple[int, ...], max_new_tokens: int,
                      temperature: float = 0.0, seed: int = 0, batch_size: int = 64,
                      max_batch_tokens: int = MAX_BATCH_TOKENS, teacher_topk: int = 0) -> Iterator[Example]:
    """All prompts answered by the target, in batches of similar prompt length (`plan_batches`);
    yields the examples in batch order with their tapped-layer features."""
    previous_taps = target.tap_layer_ids
    target.set_taps(layer_ids)
    generator = torch.Generator(device=target.device).manual_seed(seed)
    try:
        with tqdm(total=len(prompts), desc="regenerate", unit="answer") as bar:
            for rows in plan_batches([len(p) for p in prompts], batch_size, max_new_tokens, max_batch_tokens):
                batch = [prompts[i] for i in rows]
                yield from generate_batch(target, batch, max_new_tokens, target.eos_token_ids, temperature, generator,
                                          teacher_topk)
                bar.update(len(batch))
    finally:
        target.set_taps(previous_taps)


def write_feature_dataset(out: str | Path, examples: Iterable[Example], meta: dict, shard_size: int = 256) -> int:
    """Stream examples into shards under `out` (meta.json written last, so a directory with one
    is complete); returns the number written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shard, shards, count = [], 0, 0
    for example in examples:
        record = {"input_ids": example.input_ids, "loss_mask": example.loss_mask, "features": example.features}
        if example.teacher_ids is not None:
            record.update(teacher_ids=example.teacher_ids, teacher_logprobs=example.teacher_logprobs)
        shard.append(record)
        count += 1
        if len(shard) == shard_size:
            torch.save(shard, out / f"shard_{shards:05d}.pt")
            shard, shards = [], shards + 1
    if shard:
        torch.save(shard, out / f"shard_{shards:05d}.pt")
    (out / META_NAME).write_text(json.dumps({**meta, "examples": count}, indent=1))
    return count


def is_feature_dataset(path: str | Path) -> bool:
    return (Path(path) / META_NAME).is_file()


def read_feature_dataset(path: str | Path, layer_ids: tuple[int, ...] | None = None) -> list[Example]:
    """Examples (with features) of a feature dataset; ValueError if it was captured at other
    tapped layers than `layer_ids`."""
    path = Path(path)
    if not is_feature_dataset(path):
        raise FileNotFoundError(f"{path} is not a feature dataset (no {META_NAME}; is regeneration finished?)")
    meta = json.loads((path / META_NAME).read_text())
    if layer_ids is not None and tuple(meta["layer_ids"]) != tuple(layer_ids):
        raise ValueError(f"feature dataset {path} holds target layers {meta['layer_ids']}, but the drafter taps "
                         f"{list(layer_ids)}; regenerate with --target-layer-ids {','.join(map(str, layer_ids))}")
    examples = []
    for shard in sorted(path.glob("shard_*.pt")):
        examples += [Example(**record) for record in torch.load(shard)]
    return examples


def regenerate_dataset(target: HFTarget, sources: list[str], out: str | Path, layer_ids: tuple[int, ...],
                       max_new_tokens: int = 256, limit: int | None = None, temperature: float = 0.0,
                       seed: int = 0, batch_size: int = 64, skip: int = 0,
                       max_batch_tokens: int = MAX_BATCH_TOKENS, teacher_topk: int = 0) -> int:
    """Prompts of every source (`limit` records each, after its first `skip`) answered by `target`
    into the feature dataset `out` (with the target's top-`teacher_topk` distribution per answer
    token when > 0); returns the number of examples."""
    vocab = target.model.config.vocab_size
    if not 0 <= teacher_topk <= vocab:
        raise ValueError(f"teacher_topk must be in [0, {vocab}] (the target's vocabulary), got {teacher_topk}")
    prompts = [p for source in sources for p in source_prompts(target, source, limit, skip)]
    examples = generate_examples(target, prompts, layer_ids, max_new_tokens, temperature, seed, batch_size,
                                 max_batch_tokens, teacher_topk)
    meta = {"target": str(getattr(target.model.config, "_name_or_path", "")), "layer_ids": list(layer_ids),
            "sources": [str(s) for s in sources], "skip": skip, "limit": limit, "max_new_tokens": max_new_tokens,
            "temperature": temperature, "seed": seed, "teacher_topk": teacher_topk}
    return write_feature_dataset(out, examples, meta)


def source_prompts(target: HFTarget, source: str | Path, limit: int | None = None, skip: int = 0) -> list[list[int]]:
    """Token ids of the prompts of a data source's `limit` records after its first `skip`
    (answers dropped): `skip` continues a dataset where an earlier regeneration stopped."""
    if target.tokenizer is None:
        raise ValueError("the target has no tokenizer; regeneration needs its chat template")
    records = itertools.islice(iter_records(source), skip, None if limit is None else skip + limit)
    prompts = [prompt_ids(target.tokenizer, to_prompt(r)) for r in records]
    if not prompts:
        raise ValueError(f"no prompts in {source}" + (f" after its first {skip} records" if skip else ""))
    return prompts


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the messages rendered for generation, exactly as training data renders them."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
