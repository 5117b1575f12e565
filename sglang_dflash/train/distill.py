"""The distillation term of the drafter's loss: KL(target || draft) per trained block row.

Cross-entropy on one answer teaches a drafter the token the target happened to say; sampled
decoding accepts a draft when the draft's noise-coupled sample equals the target's, which needs
the whole next-token distribution to match. Two teachers:

- full: the target's logits from a forward over the sequence (exact, one target pass a sequence);
- top-k: the target's k most likely tokens and log-probabilities kept at regeneration
  (`regenerate --teacher-topk`), no target pass. Its KL is the exact KL between both
  distributions coarsened to k + 1 outcomes (the k tokens, and "any other token"), a lower bound
  of the full KL that is 0 only where the draft puts the target's mass on each of the k tokens and
  the rest on the others together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def full_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """KL(target || draft) per row of [R, V] logits (T = 1)."""
    return F.kl_div(draft_logits.log_softmax(-1), target_logits.log_softmax(-1), log_target=True,
                    reduction="none").sum(-1)


def topk_kl(draft_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(target || draft) per row over the k + 1 outcomes {teacher_ids[r, 0..k-1], anything else}.

    draft_logits [R, V]; teacher_ids [R, k] (distinct ids per row); teacher_logprobs [R, k], the
    target's log-probabilities of those ids over its whole vocabulary.
    """
    if teacher_ids.shape != teacher_logprobs.shape or teacher_ids.shape[0] != draft_logits.shape[0]:
        raise ValueError(f"teacher ids {tuple(teacher_ids.shape)} and log-probabilities "
                         f"{tuple(teacher_logprobs.shape)} must both be [rows={draft_logits.shape[0]}, k]")
    ids = teacher_ids.long()
    total = draft_logits.logsumexp(-1)
    draft_top = draft_logits.gather(1, ids) - total[:, None]  # log q(id)
    # log q(other): logsumexp over the tokens outside the top-k, not log(1 - sum q(top)), which
    # cancels catastrophically when the draft is confident in the top-k.
    draft_rest = draft_logits.scatter(1, ids, float("-inf")).logsumexp(-1) - total
    target_top = teacher_logprobs.float()
    # 1 - sum of k float32 probabilities is only known to ~k * 6e-8: below 1e-6 the rest is empty
    # (k = V leaves nothing, and the draft's rest is then a logsumexp over no token, -inf).
    target_rest_mass = 1 - target_top.exp().sum(-1)
    has_rest = target_rest_mass > 1e-6
    kl_top = (target_top.exp() * (target_top - draft_top)).sum(-1)
    kl_rest = torch.where(has_rest, target_rest_mass * (target_rest_mass.clamp(min=1e-6).log()
                                                        - draft_rest.clamp(min=-69.0)),  # q >= 1e-30
                          torch.zeros_like(target_rest_mass))
    return kl_top + kl_rest
