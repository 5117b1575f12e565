"""`sglang-dflash train`: load a target and data, build or resume a drafter, train, export."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from sglang_dflash.engine import HFTarget
from sglang_dflash.models import DFlashConfig, DFlashDraftModel, load_draft
from sglang_dflash.train.data import load_examples
from sglang_dflash.train.trainer import TrainConfig, Trainer, draft_config_for


@torch.no_grad()
def regenerate(model, tokenizer, conversation: list[dict], max_new_tokens: int, temperature: float,
               seed: int) -> list[dict]:
    """The conversation with its first assistant turn rewritten by the target itself (greedy at
    temperature 0), so the drafter learns the target's own distribution."""
    turn = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    prompt = tokenizer.apply_chat_template(conversation[:turn], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                         top_p=None, top_k=None, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return conversation[:turn] + [{"role": "assistant", "content": reply}]


def train_drafter(target: str, data: list[str], cfg: TrainConfig, *, max_len: int = 512,
                  limit: int | None = None, held_out: int = 16, regenerate_answers: bool = False,
                  regen_temperature: float = 0.0, feature_cache: str | None = None,
                  device: str = "cpu") -> list[dict]:
    """Train (or resume) the drafter in cfg.out for `target` (a model directory or a packaged
    model name such as "smollm2-135m") on `data` (jsonl files or source directories)."""
    hf = HFTarget.from_pretrained(target, dtype=torch.float32, device=device)
    if hf.tokenizer is None:
        raise ValueError(f"target {target} has no tokenizer files; training needs one to read the data")
    rewrite = None
    if regenerate_answers:
        def rewrite(messages, n):
            return regenerate(hf.model, hf.tokenizer, messages, max_new_tokens=max_len,
                              temperature=regen_temperature, seed=cfg.seed + n)
    examples = [e for source in data for e in load_examples(source, hf.tokenizer, max_len, limit, rewrite)]
    random.Random(cfg.seed).shuffle(examples)
    held, train = examples[:held_out], examples[held_out:]
    out = Path(cfg.out)
    if (out / "config.json").exists():
        draft = load_draft(out, device=device)
        if draft.config.block_size != cfg.block_size:
            raise ValueError(f"{out} holds a drafter with block_size {draft.config.block_size}, "
                             f"not {cfg.block_size}; use another --out")
    else:
        draft = DFlashDraftModel(draft_config_for(hf.model.config, hf.tokenizer, cfg)).to(device)
        # The draft's output feeds the target's LM head, so start from the scale the head expects.
        with torch.no_grad():
            draft.norm.weight.copy_(hf.final_norm.weight)
    _check_compatible(draft.config, hf.model.config)
    trainer = Trainer(hf.model, draft, train, held, cfg, feature_cache=feature_cache)
    trainer.resume()
    return trainer.run()


def _check_compatible(config: DFlashConfig, target_config) -> None:
    if config.hidden_size != target_config.hidden_size or config.vocab_size != target_config.vocab_size:
        raise ValueError(f"drafter (hidden {config.hidden_size}, vocab {config.vocab_size}) does not fit the "
                         f"target (hidden {target_config.hidden_size}, vocab {target_config.vocab_size})")

