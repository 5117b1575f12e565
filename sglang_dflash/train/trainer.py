"""Drafter training loop: AdamW with warmup + cosine decay, gradient clipping and accumulation,
z-lab checkpoints, exact resume, a held-out acceptance estimate, and loss / tau curves as a PNG.

`arch="dflash2"` trains a DFlash-2 drafter (DFLASH2_SHAPE): the grouped convolutions train with the
layers, and the path selector on its own loss (`selector_loss`): at every trained-on block row,
cross-entropy of its scores over the LM head's top-k candidates after the true previous token, the
row's true token being the class (rows whose true token is not a candidate have none). A greedy
walk follows its own choices, which are the true tokens for as long as its drafts are accepted, so
this is the choice the accepted part of a walk makes. The selector reads the draft's hidden states
and logits without passing gradients back: the draft's own loss trains those. Its loss is part of
the held-out loss, which is therefore not comparable between the two architectures (tau is).

Launched by `torchrun` (WORLD_SIZE > 1), each process trains on its shard of the examples and
the gradients are averaged across processes before every optimizer step (data parallelism).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from sglang_dflash.models import DFlashConfig, DFlashDraftModel, default_target_layer_ids, save_draft
from sglang_dflash.train.blocks import default_gamma, pack_blocks, sample_anchors
from sglang_dflash.train.data import Example
from sglang_dflash.train.distill import full_kl, topk_kl
from sglang_dflash.train.features import TargetFeatures
from sglang_dflash.train.forward import training_hidden

STATE_NAME = "trainer_state.pt"
HISTORY_NAME = "history.json"
ARCHS = ("dflash", "dflash2")
# A DFlash-2 drafter's convolution and selector (config fields): two taps per side as published
# DFlash-2 drafters use, one coefficient per 16 channels, a rank-32 selector over 8 candidates.
DFLASH2_SHAPE = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=32, selector_top_k=8)


@dataclasses.dataclass
class TrainConfig:
    out: str
    arch: str | None = None  # "dflash" or "dflash2" (DFLASH2_SHAPE); None: a resumed drafter's, else "dflash"
    block_size: int = 16
    layers: int = 2
    steps: int = 1000
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of steps
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    accumulation: int = 1  # sequences per optimizer step (per process)
    num_anchors: int = 32
    gamma: float | None = None  # loss decay; default by block size (7 for B 16, 4 for B 8)
    kl_weight: float = 0.0  # weight of KL(target || draft) added to the cross-entropy (train/distill.py)
    dtype: str = "float32"  # or "bfloat16": autocast mixed precision (fast on GPUs and bf16-capable CPUs)
    eval_every: int = 100
    save_every: int = 100
    seed: int = 0
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.arch is not None and self.arch not in ARCHS:
            raise ValueError(f"TrainConfig.arch must be one of {ARCHS}, got {self.arch!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"TrainConfig.dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.block_size < 2:
            raise ValueError(f"TrainConfig.block_size must be >= 2 (one anchor and a token to draft), "
                             f"got {self.block_size}")

    @property
    def loss_gamma(self) -> float:
        return self.gamma if self.gamma is not None else default_gamma(self.block_size)


def draft_config_for(target_config, tokenizer, cfg: TrainConfig) -> DFlashConfig:
    """A Qwen3-style drafter shaped like the target's layers, tapping K = cfg.layers target layers;
    DFlash-2's convolutions and selector (DFLASH2_SHAPE) with cfg.arch "dflash2"."""
    t = target_config
    heads = t.num_attention_heads
    mask_id = cfg.mask_token_id
    if mask_id is None and tokenizer is not None:
        mask_id = next((i for i in (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.eos_token_id)
                        if i is not None), None)
    if mask_id is None:
        raise ValueError("no mask token: pass mask_token_id (the target has no pad / unk / eos token)")
    layer_ids = cfg.target_layer_ids or default_target_layer_ids(t.num_hidden_layers, cfg.layers)
    return DFlashConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=cfg.layers,
        num_attention_heads=heads, num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads, vocab_size=t.vocab_size,
        block_size=cfg.block_size, mask_token_id=int(mask_id), target_layer_ids=tuple(layer_ids),
        num_target_layers=t.num_hidden_layers, rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
        rope_theta=float(getattr(t, "rope_theta", None) or (getattr(t, "rope_parameters", None) or {}).get(
            "rope_theta", 10000.0)),
        max_position_embeddings=getattr(t, "max_position_embeddings", 32768),
        **(DFLASH2_SHAPE if cfg.arch == "dflash2" else {}))


def draft_arch(config: DFlashConfig) -> str:
    """"dflash2" for a drafter with DFlash-2's convolutions or selector, else "dflash"."""
    return "dflash2" if config.conv_kernel_size or config.has_selector else "dflash"


def selector_loss(selector, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                  predecessors: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted cross-entropy sum, the selector's choice per row) of block rows: hidden [N, H],
    logits [N, V], their true tokens labels [N] and previous tokens predecessors [N], weights [N]
    (see the module docstring). Gradients reach the selector only."""
    unary, candidates = logits.detach().float().topk(selector.top_k, dim=-1)
    hidden = hidden.detach().to(selector.hidden_projection.weight.dtype)  # autocast may have made it bf16
    scores = selector.teacher_scores(predecessors, candidates, unary, hidden)
    choice = candidates.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
    hit = candidates == labels[:, None]
    inside = hit.any(-1)
    loss = F.cross_entropy(scores[inside], hit[inside].float().argmax(-1), reduction="none")
    return (loss * weights[inside]).sum(), choice


def lr_factor(step: int, total: int, warmup: float) -> float:
    """Linear warmup over the first `warmup` fraction of steps, then cosine decay to 10%."""
    warm = max(1, int(total * warmup))
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class Trainer:
    """Trains `draft` against `target` (an HF causal LM whose embedding and LM head stay frozen)."""

    def __init__(self, target, draft: DFlashDraftModel, train: list[Example], held_out: list[Example],
                 cfg: TrainConfig, feature_cache: str | Path | None = None):
        if not train:
            raise ValueError("no training examples (all were empty or shorter than a block)")
        self.cfg, self.draft = cfg, draft
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.train, self.held_out = train[self.rank :: self.world], held_out
        selector = draft.candidate_selector
        if selector is not None and not (selector.predecessor_codebook.any() or selector.successor_codebook.any()):
            # A fresh selector's codebooks are zero, where their product has no gradient.
            with torch.no_grad():
                generator = torch.Generator().manual_seed(cfg.seed)
                for codebook in (selector.predecessor_codebook, selector.successor_codebook):
                    codebook.copy_(torch.randn(codebook.shape, generator=generator) * 0.02)
        self.features = TargetFeatures(target, draft.config.target_layer_ids, feature_cache)
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings().weight.detach()
        if cfg.dtype == "bfloat16":  # frozen: cast once rather than in every autocast matmul
            self.lm_head = self.lm_head.to(torch.bfloat16)
        if self.world > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        self.optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           betas=(0.9, 0.95))
        self.step = 0
        self.position = 0  # index into this process's shuffled order of training examples
        self.order = self._shuffled_order(epoch=0)
        self.epoch = 0
        self.history: list[dict] = []

    def _shuffled_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.train)))
        random.Random(self.cfg.seed * 1000003 + epoch).shuffle(order)
        return order

    def _next_example(self) -> tuple[int, Example]:
        if self.position >= len(self.order):
            self.epoch += 1
            self.order, self.position = self._shuffled_order(self.epoch), 0
        index = self.order[self.position]
        self.position += 1
        return index, self.train[index]

    def _generator(self, index: int) -> torch.Generator:
        # Anchors depend on (seed, epoch, example, rank) only, so a resumed run draws the same ones.
        return torch.Generator().manual_seed(hash((self.cfg.seed, self.epoch, index, self.rank)) & (2**63 - 1))

    def sequence_loss(self, index: int, example: Example, anchors: torch.Tensor | None = None):
        """(weighted loss, weight sum, draft per block row, labels, weights) of one sequence; the
        draft is the argmax, or with a selector its choice after the true previous token."""
        cfg = self.cfg
        if anchors is None:
            anchors = sample_anchors(example.loss_mask, cfg.block_size, cfg.num_anchors, self._generator(index))
        if anchors.numel() == 0:
            return None
        device = self.lm_head.device
        ids = example.input_ids.to(device)
        packed = pack_blocks(ids, example.loss_mask.to(device), anchors.to(device), cfg.block_size,
                             self.draft.config.mask_token_id, cfg.loss_gamma)
        kept_teacher = example.teacher_ids is not None
        if example.features is not None and (cfg.kl_weight == 0 or kept_teacher):
            features, target_logits = example.features.to(device), None  # captured at regeneration
        else:
            features, target_logits = self.features(index, ids, with_logits=cfg.kl_weight > 0)
        with torch.no_grad():
            block_embeds = self.embed(packed.input_ids)
        rows = packed.weights > 0
        # bfloat16: mixed precision (fp32 weights and optimizer state, bf16 matmuls, fp32 loss).
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
            hidden = training_hidden(self.draft, features, block_embeds, packed.positions, packed.anchors,
                                     cfg.block_size)
            logits = self.draft.logits(hidden[rows], self.lm_head).float()
        weights, labels = packed.weights[rows], packed.labels[rows]
        loss = (F.cross_entropy(logits, labels, reduction="none") * weights).sum()
        choice = logits.argmax(-1)
        if self.draft.candidate_selector is not None:
            chosen_loss, choice = selector_loss(self.draft.candidate_selector, hidden[rows], logits, labels,
                                                ids[packed.positions[rows] - 1], weights)
            loss = loss + chosen_loss
        if cfg.kl_weight > 0:
            positions = packed.positions[rows]
            if kept_teacher:  # rows are trained-on tokens, so each has a teacher row (loss_mask order)
                teacher_row = (example.loss_mask.to(device).long().cumsum(0) - 1)[positions]
                kl = topk_kl(logits, example.teacher_ids.to(device)[teacher_row],
                             example.teacher_logprobs.to(device)[teacher_row])
            else:
                kl = full_kl(logits, target_logits[positions - 1])
            loss = loss + cfg.kl_weight * (kl * weights).sum()
        return loss, weights.sum(), choice, labels, rows

    def train_step(self) -> float:
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr * lr_factor(self.step, cfg.steps, cfg.warmup)
        self.draft.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, total_weight = 0.0, 0.0
        for _ in range(cfg.accumulation):
            index, example = self._next_example()
            result = self.sequence_loss(index, example)
            if result is None:
                continue
            loss, weight = result[0], result[1]
            # Normalise by the expected weight of a full sequence so accumulation averages.
            (loss / (weight.detach() * cfg.accumulation)).backward()
            total_loss += float(loss.detach())
            total_weight += float(weight)
        if self.world > 1:
            for p in self.draft.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                torch.distributed.all_reduce(p.grad)
                p.grad /= self.world
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.step += 1
        return total_loss / max(total_weight, 1e-9)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Teacher-forced acceptance on held-out data: at every valid anchor, how many draft rows
        agree with the real continuation before the first miss. tau = 1 + that mean, the tokens a
        verify step commits if the target would produce the data's tokens (exact when the data
        was generated by the target greedily); with a path selector, of the selector's drafts (what
        SGLang serves). Also the held-out loss, and `tau@b` for every
        smaller block size b >= 2 (the same drafts cut to b - 1): a drafter trained at B is
        often served at a smaller one, and these say which."""
        self.draft.eval()
        blocks, loss, weight = 0, 0.0, 0.0
        block = self.cfg.block_size
        accepted = torch.zeros(block - 1, dtype=torch.long)  # anchors whose run reaches row k
        for n, example in enumerate(self.held_out):
            anchors = sample_anchors(example.loss_mask, block, 64, torch.Generator().manual_seed(n))
            result = self.sequence_loss(-1 - n, example, anchors)
            if result is None:
                continue
            seq_loss, seq_weight, pred, labels, rows = result
            loss, weight = loss + float(seq_loss), weight + float(seq_weight)
            hit = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)
            hit[rows] = pred == labels
            hit = hit.view(-1, block)[:, 1:]
            accepted += hit.long().cumprod(dim=1).sum(0).cpu()
            blocks += hit.shape[0]
        tau_at = (1.0 + accepted.cumsum(0).double() / max(blocks, 1)).tolist()  # [k]: block size k + 2
        return {"tau": tau_at[-1] if tau_at else 1.0, "held_out_loss": loss / max(weight, 1e-9),
                **{f"tau@{b}": tau_at[b - 2] for b in range(2, block)}}

    # -- checkpoints -------------------------------------------------------------------------
    def save(self) -> None:
        if self.rank != 0:
            return
        out = Path(self.cfg.out)
        save_draft(self.draft, out)
        torch.save({"step": self.step, "epoch": self.epoch, "position": self.position,
                    "optimizer": self.optimizer.state_dict(), "config": dataclasses.asdict(self.cfg)},
                   out / STATE_NAME)
        (out / HISTORY_NAME).write_text(json.dumps(self.history, indent=1))
        plot_history(self.history, out / "training.png")

    def resume(self) -> bool:
        """Continue from the checkpoint in cfg.out, if there is one: weights, optimizer, step and
        data position, so the next step is the one an uninterrupted run would have taken."""
        out = Path(self.cfg.out)
        if not (out / STATE_NAME).exists():
            return False
        from safetensors.torch import load_file

        self.draft.load_state_dict(load_file(out / "model.safetensors"))
        state = torch.load(out / STATE_NAME, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.epoch, self.position = state["step"], state["epoch"], state["position"]
        self.order = self._shuffled_order(self.epoch)
        if (out / HISTORY_NAME).exists():
            self.history = json.loads((out / HISTORY_NAME).read_text())
        return True

    def run(self) -> list[dict]:
        cfg = self.cfg
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", disable=self.rank != 0)
        while self.step < cfg.steps:
            loss = self.train_step()
            entry = {"step": self.step, "loss": loss}
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                entry.update(self.evaluate())
            self.history.append(entry)
            bar.set_postfix({k: round(v, 3) for k, v in entry.items() if k in ("loss", "tau", "held_out_loss")})
            bar.update(1)
            if self.step % cfg.save_every == 0 or self.step == cfg.steps:
                self.save()
        bar.close()
        return self.history


def plot_history(history: list[dict], path: Path) -> None:
    """Training loss and held-out tau against steps, one PNG. Evaluations tagged with different
    "held_out_set" names (runs resumed on another held-out set) get a line each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(10, 4))
    trained = [h for h in history if "loss" in h]
    ax_loss.plot([h["step"] for h in trained], [h["loss"] for h in trained], lw=0.8, label="train")
    evals = [h for h in history if "tau" in h]
    for i, name in enumerate(dict.fromkeys(h.get("held_out_set", "") for h in evals)):
        points = [h for h in evals if h.get("held_out_set", "") == name]
        style = dict(marker="o", color=f"C{i + 1}", label=f"held-out {name}".strip())  # C0: the train loss
        ax_loss.plot([h["step"] for h in points], [h["held_out_loss"] for h in points], **style)
        ax_tau.plot([h["step"] for h in points], [h["tau"] for h in points], **style)
    ax_loss.set(xlabel="step", ylabel="weighted CE", title="loss", yscale="log")  # early loss dwarfs the rest
    ax_loss.legend()
    ax_tau.set(xlabel="step", ylabel="tokens per verify step", title="held-out tau (teacher-forced)")
    if evals:
        ax_tau.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
