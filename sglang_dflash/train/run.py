"""`sglang-dflash train`: load a target and data, build or resume a drafter, train, export."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from sglang_dflash.engine import HFTarget
from sglang_dflash.models import DFlashConfig, DFlashDraftModel, load_draft, save_draft_vocab
from sglang_dflash.train.data import Example, load_examples
from sglang_dflash.train.regenerate import generate_examples, is_feature_dataset, read_feature_dataset, source_prompts
from sglang_dflash.train.trainer import TrainConfig, Trainer, draft_arch, draft_config_for


def train_drafter(target: str, data: list[str], cfg: TrainConfig, *, max_len: int = 512,
                  limit: int | None = None, held_out: int = 16, regenerate_answers: bool = False,
                  regen_temperature: float = 0.0, feature_cache: str | None = None,
                  device: str = "cpu", draft_vocab_size: int = 0,
                  held_out_data: list[str] | None = None) -> list[dict]:
    """Train (or resume) the drafter in cfg.out for `target` (a model directory or a packaged
    model name such as "smollm2-135m") on `data`: jsonl files, source directories, or feature
    datasets written by `sglang-dflash regenerate`. With `regenerate_answers` the target first
    answers the sources' prompts itself (max_len new tokens each). With `draft_vocab_size` > 0
    the checkpoint also gets a draft vocabulary of that many ids (`frequent_tokens`; a resumed or
    fine-tuned drafter's own vocabulary fills what the data leaves). The tau
    estimate runs on `held_out` shuffled examples of `data`, or on all of `held_out_data` (read
    the same way) when given: a fixed set that stays unseen when more training data is added."""
    hf = HFTarget.from_pretrained(target, dtype=torch.float32, device=device)
    if hf.tokenizer is None:
        raise ValueError(f"target {target} has no tokenizer files; training needs one to read the data")
    out = Path(cfg.out)
    if (out / "config.json").exists():
        draft = load_draft(out, device=device)
        if draft.config.block_size != cfg.block_size:
            raise ValueError(f"{out} holds a drafter with block_size {draft.config.block_size}, "
                             f"not {cfg.block_size}; use another --out")
        if cfg.arch is not None and draft_arch(draft.config) != cfg.arch:
            raise ValueError(f"{out} holds a {draft_arch(draft.config)} drafter, not {cfg.arch}; use another --out")
    else:
        draft = DFlashDraftModel(draft_config_for(hf.model.config, hf.tokenizer, cfg)).to(device)
        # The draft's output feeds the target's LM head, so start from the scale the head expects.
        with torch.no_grad():
            draft.norm.weight.copy_(hf.final_norm.weight)
    _check_compatible(draft.config, hf.model.config)
    layer_ids = tuple(draft.config.target_layer_ids)

    def read(sources: list[str]) -> list[Example]:
        examples: list[Example] = []
        for source in sources:
            if is_feature_dataset(source):
                examples += read_feature_dataset(source, layer_ids)[:limit]
            elif regenerate_answers:
                prompts = source_prompts(hf, source, limit)
                examples += generate_examples(hf, prompts, layer_ids, max_len, regen_temperature, cfg.seed)
            else:
                examples += load_examples(source, hf.tokenizer, max_len, limit)
        return examples

    examples = read(data)
    random.Random(cfg.seed).shuffle(examples)
    if held_out_data:
        held, train = read(held_out_data), examples
    else:
        held, train = examples[:held_out], examples[held_out:]
    if draft_vocab_size > 0:
        vocab = draft.config.vocab_size
        draft.draft_vocab = frequent_tokens(train, draft_vocab_size, vocab, keep=draft.draft_vocab)
        print(f"wrote {save_draft_vocab(out, draft.draft_vocab, vocab)}")  # and with every checkpoint
    trainer = Trainer(hf.model, draft, train, held, cfg, feature_cache=feature_cache)
    trainer.resume()
    return trainer.run()


def frequent_tokens(examples: list[Example], size: int, vocab_size: int,
                    keep: torch.Tensor | None = None) -> torch.Tensor:
    """The `size` token ids drafts should be able to take: those the loss covers, most frequent
    first; then (if fewer occur) the ids of `keep`, the vocabulary of the drafter being fine-tuned,
    so tokens it learned on earlier data stay draftable when the new data never uses them; then
    the lowest remaining ids, which BPE vocabularies give to their most common merges."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for e in examples:
        counts += torch.bincount(e.input_ids[e.loss_mask.bool()].long(), minlength=vocab_size)
    # Counts doubled, so a kept id the data never uses (-1) ranks after every used id (<= -2) and
    # before the other unused ids (0).
    rank = -counts * 2
    if keep is not None:
        kept = keep.long().cpu()
        rank[kept[counts[kept] == 0]] = -1
    # Stable sort keeps ties (and all unused ids) in ascending id order.
    return torch.sort(rank, stable=True).indices[:size]


def _check_compatible(config: DFlashConfig, target_config) -> None:
    if config.hidden_size != target_config.hidden_size or config.vocab_size != target_config.vocab_size:
        raise ValueError(f"drafter (hidden {config.hidden_size}, vocab {config.vocab_size}) does not fit the "
                         f"target (hidden {target_config.hidden_size}, vocab {target_config.vocab_size})")
