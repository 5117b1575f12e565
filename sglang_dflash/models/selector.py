"""DFlash-2's path selector: picks one token per draft position from the `top_k` candidates the
LM head ranks best there, scoring each transition between adjacent positions with a low-rank
bilinear term, so a draft's tokens are chosen jointly rather than position by position.

For a block with anchor token a, draft hidden states h[e] and candidates c[e, 0..K-1] with unary
logits u[e, :] (positions e = 0..E-1 after the anchor):

    pred[e, p] = a                        for e = 0 (every p)
               = c[e - 1, p]              for e >= 1
    score[e, p, k] = u[e, k] + < predecessor_codebook[pred[e, p]] * hidden_projection(h[e]),
                                 successor_codebook[c[e, k]] >                   (rank-r vectors)

A path takes index i0 from row score[0, 0, :], then i_e from row score[e, i_{e-1}, :]: the argmax
when greedy, else a draw from softmax(row / temperature) with one uniform per position (the first
index whose cumulative probability exceeds it). The walk also returns each step's distribution
over the K candidates (a point mass on greedy rows), the q a rejection-sampling verify needs.
Parameter names are those of z-lab / SGLang checkpoints (`candidate_selector.*`).
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_dflash.models.skinny import SkinnyLinear


class PathSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = SkinnyLinear(hidden_size, rank, bias=False)

    def lattice(self, candidate_ids: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor,
                anchors: torch.Tensor) -> torch.Tensor:
        """float32 scores [b, E, K, K] (position, predecessor index, candidate index) from
        candidate_ids / unary [b, E, K], hidden [b, E, H] and the anchor tokens [b]."""
        b, positions, k = candidate_ids.shape
        predecessors = torch.cat([anchors.view(b, 1, 1).expand(b, 1, k), candidate_ids[:, :-1]], dim=1)
        query = self.hidden_projection(hidden).float()
        left = self.predecessor_codebook[predecessors].float() * query[:, :, None]
        right = self.successor_codebook[candidate_ids].float()
        return unary.float()[:, :, None, :] + left @ right.transpose(-1, -2)

    def teacher_scores(self, predecessor_ids: torch.Tensor, candidate_ids: torch.Tensor, unary: torch.Tensor,
                       hidden: torch.Tensor) -> torch.Tensor:
        """float32 scores [..., K] of each position's candidates [..., K] after a given predecessor
        token [...] (the true one in training): the lattice's row for that predecessor, whether or
        not it is among the previous position's candidates. unary [..., K], hidden [..., H]."""
        query = self.hidden_projection(hidden).float()
        left = self.predecessor_codebook[predecessor_ids].float() * query
        right = self.successor_codebook[candidate_ids].float()
        return unary.float() + (left.unsqueeze(-2) * right).sum(-1)

    @staticmethod
    def walk(candidate_ids: torch.Tensor, scores: torch.Tensor, greedy: torch.Tensor,
             temperatures: torch.Tensor | None = None, uniforms: torch.Tensor | None = None):
        """One path per block: (tokens int64 [b, E], q float32 [b, E, K]). greedy [b] bool picks
        the argmax for its rows; the others need temperatures [b] and uniforms [b, E] in [0, 1)."""
        b, positions, k = candidate_ids.shape
        rows = torch.arange(b, device=scores.device)
        index = torch.zeros(b, dtype=torch.long, device=scores.device)  # every predecessor row of e = 0 is alike
        tokens, q = [], []
        for e in range(positions):
            row = scores[rows, e, index].float()
            pick = row.argmax(-1)
            dist = torch.nn.functional.one_hot(pick, k).float()
            if not bool(greedy.all()):
                probs = (row / temperatures.float()[:, None]).softmax(-1)
                drawn = (uniforms[:, e, None] >= probs.cumsum(-1)).sum(-1).clamp_max(k - 1)
                pick = torch.where(greedy, pick, drawn)
                dist = torch.where(greedy[:, None], dist, probs)
            index = pick
            tokens.append(candidate_ids[rows, e, pick])
            q.append(dist)
        return torch.stack(tokens, 1), torch.stack(q, 1)
