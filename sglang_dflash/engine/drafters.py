"""Drafters the generator can run: the DFlash block drafter, and an oracle that proposes a known
continuation (benchmarks and tests of the accept path).

A drafter has `layer_ids` (target layers whose outputs it consumes) and five calls, all indexed
by the generator's request index: `start` after prefill, `propose` per drafting step, `commit`
with the tapped states of the rows the target kept, `append_pending` (work `commit` may defer to
the next `propose`, which the generator times apart), and `finish`.
"""

from __future__ import annotations

import dataclasses

import torch

from sglang_dflash.drafters import DRAFT_DTYPES
from sglang_dflash.engine.target import HFTarget
from sglang_dflash.models import DFlashDraftModel, load_draft
from sglang_dflash.models.skinny import quantize_rows
from sglang_dflash.ops import gumbel_argmax, top_k_logprobs


@dataclasses.dataclass(frozen=True)
class DraftSampling:
    """How the coming verify step samples (temperature > 0): its temperature, and the seed and
    per-request offsets [bs] that key its noise, so drafts can be picked with that same noise."""

    temperature: float
    seed: int
    offsets: torch.Tensor


class DFlashDrafter:
    """`head_dtype`: the dtype of the drafter's copy of the target's LM head (torch.int8: int8
    with one scale per row, `quantize_rows`), restricted to the checkpoint's draft vocabulary when
    it has one (`model.draft_vocab`). Drafts only propose (the target's verify decides every
    token), so neither can change the output; both shrink the widest matmul of a draft step
    (SmolLM2: 49152 x 576 in fp32)."""

    def __init__(self, model: DFlashDraftModel, target: HFTarget, head_dtype: torch.dtype = torch.bfloat16):
        c = model.config
        if c.hidden_size != target.hidden_size:
            raise ValueError(f"draft hidden_size {c.hidden_size} != target hidden size {target.hidden_size}")
        if c.vocab_size != target.vocab_size:
            raise ValueError(f"draft vocab_size {c.vocab_size} != target vocab size {target.vocab_size}")
        if max(c.target_layer_ids) >= target.num_layers:
            raise ValueError(f"draft dflash_config.target_layer_ids {list(c.target_layer_ids)} out of range "
                             f"for a target with {target.num_layers} layers")
        if c.num_target_layers is not None and c.num_target_layers != target.num_layers:
            raise ValueError(f"draft num_target_layers {c.num_target_layers} != target's {target.num_layers} layers")
        self.model, self.target = model, target
        self.vocab = model.draft_vocab
        head = target.lm_head_weight.detach()
        head = head if self.vocab is None else head[self.vocab]
        self.lm_head_scale: torch.Tensor | None = None
        if head_dtype == torch.int8:
            self.lm_head_weight, self.lm_head_scale = quantize_rows(head)
        else:
            self.lm_head_weight = head.to(head_dtype).contiguous()
        self.layer_ids = c.target_layer_ids
        self.max_block_size = c.block_size
        self._rows: dict[int, int] = {}
        self._pending: dict[int, list[torch.Tensor]] = {}  # request -> tapped states not appended yet

    def start(self, taps: list[torch.Tensor], capacities: list[int]) -> None:
        cache = self.model.allocate_cache(sum(capacities), len(taps), max(capacities))
        self._rows = {i: cache.add_request() for i in range(len(taps))}
        # The prompts' context waits for the first propose too: where the adaptive block size plays
        # only plain steps (large batches, text the drafter misses), it is never computed.
        self._pending = {i: [t] for i, t in enumerate(taps)}

    @property
    def vocab_size(self) -> int:
        """How many token ids a draft may take (the draft vocabulary, else the target's)."""
        return self.lm_head_weight.shape[0]

    def _draft_logits(self, reqs: list[int], anchors: torch.Tensor, block_size: int) -> torch.Tensor:
        """One draft forward of [anchor, MASK x (block_size - 1)] per request: logits of block
        positions 1.. [bs, block_size - 1, draft vocabulary]."""
        self.append_pending()
        rows = torch.tensor([self._rows[r] for r in reqs], device=anchors.device)
        block = torch.full((len(reqs), block_size), self.model.config.mask_token_id, device=anchors.device)
        block[:, 0] = anchors
        hidden = self.model(self.target.embed(block).reshape(-1, self.target.hidden_size), rows, block_size)
        hidden = hidden.view(len(reqs), block_size, -1)[:, 1:]
        return self.model.logits(hidden, self.lm_head_weight, self.lm_head_scale)

    def propose(self, reqs: list[int], anchors: torch.Tensor, starts: torch.Tensor, block_size: int,
                sampling: DraftSampling | None = None, confidence: bool = False):
        """The drafts of block positions 1..block_size - 1 per request, int64 [bs, block_size - 1];
        with `confidence`, also each draft's probability under the drafter's distribution at the
        verify's temperature (greedy: at 1), float32 of the same shape (control/draft_confidence.py)."""
        logits = self._draft_logits(reqs, anchors, block_size)
        sampled = sampling is not None and sampling.temperature > 0
        if not sampled:
            # max(-1).indices: torch's CPU argmax over bf16 rows is the slower of the two.
            drafts = logits.max(-1).indices
        else:
            # Draft k is checked against the target's sample in verify row k - 1: pick it with that
            # row's noise, so it is the target's own pick wherever the two distributions agree
            # (an argmax draft only matches with the target's probability of that token). Top-k /
            # top-p are not mirrored: they only change which drafts are proposed, never the output.
            bs, k = logits.shape[:2]
            scores = logits.reshape(bs * k, -1).float() / sampling.temperature
            verify_rows = torch.arange(k, device=logits.device).repeat(bs)
            drafts = gumbel_argmax(scores, self.vocab, sampling.seed, sampling.offsets.repeat_interleave(k),
                                   verify_rows).view(bs, k)
        ids = drafts if self.vocab is None else self.vocab[drafts]
        if not confidence:
            return ids
        # The sampled drafts' scores are already the logits at the temperature, in float32.
        scores = scores.view(logits.shape) if sampled else logits.float()
        return ids, (scores.gather(-1, drafts[..., None]).squeeze(-1) - scores.logsumexp(-1)).exp()

    def propose_candidates(self, reqs: list[int], anchors: torch.Tensor, starts: torch.Tensor, depth: int, topk: int,
                           sampling: DraftSampling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per block position 1..depth, the drafter's `topk` best tokens (target ids) and their
        log-probabilities, best first: int64 [bs, depth, topk], float [bs, depth, topk] (the input
        of `tree.build_trees`). Greedy: the most likely tokens. Sampled: ranked with the noise the
        verify samples position d with (as `propose` picks its drafts), so choice 0 is the chain's
        draft; a choice's score is its draft log-probability at the temperature, capped by the
        choice before it so that scores never increase along the choices."""
        logits = self._draft_logits(reqs, anchors, depth + 1)
        if sampling is None or sampling.temperature <= 0:
            scores, picks = top_k_logprobs(logits, topk)
        else:
            logits = logits.float()
            bs = logits.shape[0]
            scaled = logits.reshape(bs * depth, -1) / sampling.temperature
            verify_rows = torch.arange(depth, device=logits.device).repeat(bs)
            offsets = sampling.offsets.repeat_interleave(depth)
            ranked = []
            for _ in range(topk):  # the next best under the noise, the ones before it masked out
                pick = gumbel_argmax(scaled, self.vocab, sampling.seed, offsets, verify_rows)
                ranked.append(pick)
                scaled = scaled.scatter(1, pick[:, None], float("-inf"))
            picks = torch.stack(ranked, dim=1)
            logprobs = (logits.reshape(bs * depth, -1) / sampling.temperature).log_softmax(-1)
            scores = logprobs.gather(1, picks).cummin(dim=1).values
            picks, scores = picks.view(bs, depth, topk), scores.view(bs, depth, topk)
        return (picks if self.vocab is None else self.vocab[picks]), scores

    def commit(self, reqs: list[int], counts: list[int], taps: torch.Tensor) -> None:
        # Deferred to the next propose: a run of plain (block size 1) steps then costs one context
        # append for all its tokens instead of one per step.
        for b, (r, n) in enumerate(zip(reqs, counts, strict=True)):
            self._pending.setdefault(r, []).append(taps[b, :n])

    def append_pending(self) -> None:
        """Append the context of every committed token not appended yet (propose does it first)."""
        if self._pending:
            reqs, taps = list(self._pending), [torch.cat(t) for t in self._pending.values()]
            self.model.append_context([self._rows[r] for r in reqs], [t.shape[0] for t in taps], torch.cat(taps))
            self._pending.clear()

    def finish(self, req: int) -> None:
        self._pending.pop(req, None)
        self.model.cache.release(self._rows.pop(req))


def resolve_draft_dtype(draft_dtype: str, device: torch.device | str) -> str:
    """`draft_dtype` (DRAFT_DTYPES) with "auto" resolved: int8 on the CPU, where a draft step is
    bound by the bytes it reads and int8 weights halve them (drafts only propose: the output
    cannot change), bfloat16 elsewhere (int8 weights run only in the CPU kernel)."""
    if draft_dtype not in DRAFT_DTYPES:
        raise ValueError(f"draft dtype {draft_dtype!r}: expected one of {', '.join(DRAFT_DTYPES)}")
    if draft_dtype == "auto":
        return "int8" if torch.device(device).type == "cpu" else "bfloat16"
    return draft_dtype


def load_drafter(directory, target: HFTarget, draft_dtype: str = "auto",
                 device: torch.device | str = "cpu") -> DFlashDrafter:
    """The DFlash drafter of checkpoint `directory` for `target`, its weights and its copy of the
    LM head in `draft_dtype` (DRAFT_DTYPES, `resolve_draft_dtype`): bfloat16, float32, or int8
    (weight-only: int8 with a scale per row for fc, the LM head and every projection but k_proj /
    v_proj, bf16 activations; a CPU draft step reads about half the bytes of bf16). Drafts never
    change the output."""
    draft_dtype = resolve_draft_dtype(draft_dtype, device)
    quantized = draft_dtype == "int8"
    model = load_draft(directory, dtype=torch.bfloat16 if quantized else getattr(torch, draft_dtype), device=device)
    if quantized:
        model.quantize_weights()
    return DFlashDrafter(model, target, head_dtype=torch.int8 if quantized else torch.bfloat16)


class NoDrafter:
    """Plain autoregressive decoding through the same engine (block size 1)."""

    layer_ids: tuple[int, ...] = ()
    max_block_size: int | None = 1

    def start(self, taps, capacities) -> None:
        pass

    def commit(self, reqs, counts, taps) -> None:
        pass

    def append_pending(self) -> None:
        pass

    def finish(self, req: int) -> None:
        pass


class OracleDrafter(NoDrafter):
    """Proposes `references[i][p + 1 : p + B]` for request i whose anchor sits at position p (the
    reference holds prompt + continuation). With `corrupt` > 0, each draft is replaced by another
    token with that probability (seeded), so acceptance lengths vary."""

    max_block_size = None

    def __init__(self, references: list[list[int]], vocab_size: int, corrupt: float = 0.0, seed: int = 0):
        self.references = references
        self.vocab_size = vocab_size
        self.corrupt = corrupt
        self._gen = torch.Generator().manual_seed(seed)

    def propose(self, reqs: list[int], anchors: torch.Tensor, starts: torch.Tensor, block_size: int,
                sampling: DraftSampling | None = None, confidence: bool = False):
        """With `confidence`, also each draft's chance to be right, 1 - corrupt."""
        drafts = torch.zeros(len(reqs), block_size - 1, dtype=torch.int64)
        for b, (r, p) in enumerate(zip(reqs, starts.tolist(), strict=True)):
            ref = self.references[r][p + 1:p + block_size]
            drafts[b, :len(ref)] = torch.tensor(ref, dtype=torch.int64)
        if self.corrupt > 0:
            flip = torch.rand(drafts.shape, generator=self._gen) < self.corrupt
            drafts = torch.where(flip, (drafts + 1) % self.vocab_size, drafts)
        drafts = drafts.to(anchors.device)
        return (drafts, torch.full(drafts.shape, 1.0 - self.corrupt, device=anchors.device)) if confidence else drafts
