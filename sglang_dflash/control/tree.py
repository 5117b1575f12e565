"""Draft trees from one DFlash draft forward (tree verification, DDTree-style).

A DFlash drafter drafts every block position at once from MASK inputs, so what one draft forward
gives is, per position d = 1..D, a distribution over the token at d that does not depend on the
tokens drafted before it: per-position marginals, not conditionals. Its second and third choices
at a position hold much of what its first choice misses, so instead of one chain of first choices
the target can verify a tree of them in one pass (each node sees the context and its ancestors
only) and commit the longest path it agrees with.

The tree is grown best first under a node budget: a node's score is the sum of the draft
log-probabilities of the tokens on its path (the product of their probabilities, as DDTree ranks
them), and nodes are added in descending score, so every node's parent is added before it. Since
the marginals do not depend on the parent, the best node at depth d is the chain of first choices
to d: a tree holding any node at depth d holds the chain to d (ties go to the lower sum of ranks),
so it never commits fewer tokens than the chain of its depth would. Node 0 is the root: the
request's last committed token (the chain's row 0); nodes come in the order they were added.

Growth also stops at the first node whose path probability is below `min_prob` (every node left
is less likely): a node adds its path probability to the tokens a step is expected to commit and
costs the step a verified row, so it pays only while that probability is above (tokens a step
commits) x (a row's share of the step's time). DEFAULT_TREE_MIN_PROB is that break-even for the
shipped SmolLM2 drafter and target in bf16 on a small CPU. Where the draft is sure the tree runs
deep and narrow, where it is not the step verifies a few rows instead of the budget. The tree's
first node stays (the chain of 2), so every step still drafts. Greedy only: there a node's draft
probability, given its parent accepted, is about the rate the target accepts it at. Sampled trees
rank their choices with the verify's own noise, which the target then accepts far more often than
their probability says, so a bound would cut the nodes that pay. Bounded and unbounded trees,
greedy and sampled: bench/results/e2e_smollm2-135m_trees_bf16.json.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import torch

from sglang_dflash import settings
from sglang_dflash.ops.reference import tree_ancestors

MAX_TREE_BUDGET = 256  # drafted nodes per request: the target verifies up to budget + 1 rows a step
MAX_TREE_TOPK = 64  # choices per position
DEFAULT_TREE_TOPK = settings.TREE_TOPK.default  # where none is asked: the CLI's --tree-topk, the server's setting
# Trees of up to this many nodes beside the chains where the block size adapts and no budget is
# asked (`generate --adaptive`; the served worker on CPU, whose block holds at most B - 1): the
# adaptive choice then plays trees of 15, 7 and 3 nodes, and keeps the ones that commit more per
# second than the best chain. Fixed trees of 4, 8 and 15 nodes against chains:
# bench/results/e2e_smollm2-135m_trees.json (fp32) and e2e_smollm2-135m_trees_bf16.json.
DEFAULT_TREE_BUDGET = 15
# Nodes less likely than this (the product of the draft probabilities on their path) are left out
# of a greedy tree: the break-even of the module docstring; against 0 (every tree grown to its
# budget) in bench/results/e2e_smollm2-135m_trees_bf16.json.
DEFAULT_TREE_MIN_PROB = 0.03


def default_tree_budget(most_nodes: int) -> int:
    """The tree budget of an adaptive run that asks for none: DEFAULT_TREE_BUDGET cut to the most
    nodes the caller's trees can hold (`most_tree_nodes` in the engine; the served worker's B - 1
    block rows); 0 (chains only) under 2 nodes, where a tree of one node is the chain of 2."""
    budget = min(DEFAULT_TREE_BUDGET, most_nodes)
    return budget if budget >= 2 else 0


def most_tree_nodes(max_block_size: int, topk: int) -> int:
    """The drafted nodes a tree can hold at most: every node at depths 1..B - 1 has up to `topk`
    children (each position's choices), so topk + topk^2 + ... + topk^(B - 1)."""
    return sum(topk ** depth for depth in range(1, max_block_size))


@dataclasses.dataclass
class DraftTrees:
    """A batch of trees, padded to N = the largest tree's nodes."""

    tokens: torch.Tensor  # int64 [bs, N]: node 0 the root (anchor), then the drafted tokens
    parents: torch.Tensor  # int64 [bs, N]: parent node index (< own index); -1 for the root and unused nodes
    depths: torch.Tensor  # int64 [bs, N]: 0 for the root and unused nodes
    sizes: list[int]  # nodes in use per request, root included
    # bool [bs, N, N] where the builder knows it (build_trees), else computed from the parents
    known_ancestors: torch.Tensor | None = None

    def ancestors(self) -> torch.Tensor:
        """bool [bs, N, N]: [b, i, j] = node j is node i or one of its ancestors (what node i may
        attend to in the block; unused nodes see only themselves)."""
        return tree_ancestors(self.parents) if self.known_ancestors is None else self.known_ancestors


@dataclasses.dataclass(frozen=True)
class TreeOptionNames:
    """How the user sets each tree option, as the errors name it."""

    budget: str
    topk: str
    min_prob: str


CLI_NAMES = TreeOptionNames("--tree-budget", "--tree-topk", "--tree-min-prob")


def check_tree_options(budget: int, topk: int, min_prob: float = 0.0, *, names: TreeOptionNames = CLI_NAMES,
                       most_nodes: int = MAX_TREE_BUDGET, why_most: str = "", vocab_size: int | None = None) -> None:
    """One ValueError naming the option for a tree option out of range, for every front door (the
    CLI before any model loads, the generator with the drafter's vocabulary, the server's
    settings): `budget` in [1, most_nodes] drafted nodes (`why_most`: what bounds it, where that
    is less than MAX_TREE_BUDGET), `topk` in [1, MAX_TREE_TOPK] and at most `vocab_size` (the draft
    vocabulary's, when known), `min_prob` in [0, 1)."""
    if not 0.0 <= min_prob < 1.0:  # also NaN
        raise ValueError(f"{names.min_prob} must be in [0, 1) (a path probability), got {min_prob}")
    if not 1 <= budget <= most_nodes:
        raise ValueError(f"{names.budget} must be in [1, {most_nodes}] drafted nodes{why_most}, got {budget}")
    if not 1 <= topk <= MAX_TREE_TOPK:
        raise ValueError(f"{names.topk} must be in [1, {MAX_TREE_TOPK}] choices per position, got {topk}")
    if vocab_size is not None and topk > vocab_size:
        raise ValueError(f"{names.topk} {topk} exceeds the draft vocabulary ({vocab_size} tokens)")


def build_trees(anchors: torch.Tensor, candidates: torch.Tensor, scores: torch.Tensor,
                budgets: list[int], min_prob: float = 0.0) -> DraftTrees:
    """Best-first trees over per-position candidates.

    anchors int64 [bs]: each request's root token; candidates int64 [bs, D, K]: the drafter's K
    choices at positions 1..D, best first; scores float [bs, D, K]: their log-probabilities,
    non-increasing along K. budgets[b]: drafted nodes of request b (the tree has up to
    budgets[b] + 1 nodes; fewer when D * K-limited or where the nodes left have a path
    probability below `min_prob`, the first node excepted).
    """
    bs, depth_limit, k = candidates.shape
    if anchors.shape != (bs,) or scores.shape != candidates.shape or len(budgets) != bs:
        raise ValueError(f"build_trees: anchors {tuple(anchors.shape)}, candidates {tuple(candidates.shape)}, "
                         f"scores {tuple(scores.shape)} and {len(budgets)} budgets do not describe one batch")
    n = max(budgets) + 1
    least = math.log(min_prob) if min_prob > 0 else -math.inf  # the lowest path score grown
    # Built as lists, one tensor each at the end: a tree step builds them on its critical path.
    tokens = [[root] + [0] * (n - 1) for root in anchors.tolist()]
    parents = [[-1] * n for _ in range(bs)]
    depths = [[0] * n for _ in range(bs)]
    cand, score = candidates.cpu().tolist(), scores.float().cpu().tolist()
    sizes = []
    # Per request and node, the bitmask of the node and its ancestors (unused nodes: only
    # themselves), built while growing: tree_ancestors' tensor loop afterwards would cost a
    # tree step more than the growth itself.
    seen = [[1 << i for i in range(n)] for _ in range(bs)]
    for b in range(bs):
        # Heap entries: (-path score, sum of ranks on the path, depth, rank, parent node).
        frontier = [(-score[b][0][0], 0, 1, 0, 0)] if depth_limit and budgets[b] else []
        path_score = [0.0]  # per node added
        while frontier and len(path_score) <= budgets[b] and (len(path_score) == 1 or -frontier[0][0] >= least):
            neg, rank_sum, depth, rank, parent = heapq.heappop(frontier)
            node = len(path_score)
            path_score.append(-neg)
            tokens[b][node], parents[b][node], depths[b][node] = cand[b][depth - 1][rank], parent, depth
            seen[b][node] |= seen[b][parent]
            if rank + 1 < k:  # the next sibling: same parent, the next choice at this depth
                sibling = path_score[parent] + score[b][depth - 1][rank + 1]
                heapq.heappush(frontier, (-sibling, rank_sum + 1, depth, rank + 1, parent))
            if depth < depth_limit:  # the first child: this path, then the best choice one deeper
                heapq.heappush(frontier, (neg - score[b][depth][0], rank_sum, depth + 1, 0, node))
        sizes.append(len(path_score))
    n = max(sizes)  # the rows a verify needs: fewer than the budget where no tree filled it
    tokens, parents, depths, seen = ([row[:n] for row in rows] for rows in (tokens, parents, depths, seen))
    ancestors = [[[bool(mask >> j & 1) for j in range(n)] for mask in row] for row in seen]
    device = candidates.device
    return DraftTrees(*(torch.tensor(t, dtype=torch.int64, device=device) for t in (tokens, parents, depths)), sizes,
                      torch.tensor(ancestors, device=device))


def chain_accept_lens(trees: DraftTrees, path: torch.Tensor, accepted: list[int]) -> list[int]:
    """Per request, how many drafts the chain of first choices inside its tree had accepted, of the
    `accepted` its tree had: the length of the committed path's prefix that runs along that chain.
    The chain's node at depth d is the first node added at depth d (it has the best path score
    there); where the committed path leaves the chain, the target's token differed from the
    chain's draft, so the chain alone would have stopped there."""
    depths, path = trees.depths.tolist(), path.tolist()
    lens = []
    for b, a in enumerate(accepted):
        chain: dict[int, int] = {}
        for node in range(1, trees.sizes[b]):
            chain.setdefault(depths[b][node], node)
        c = 0
        while c < a and path[b][c + 1] == chain.get(c + 1):
            c += 1
        lens.append(c)
    return lens


def chain_depths(trees: DraftTrees) -> list[int]:
    """Per request, the depth of its tree, which is the depth of the chain of first choices inside
    it: a node's path score is at most its parent's, so best-first growth adds the chain's node at
    a depth before any other there."""
    return [max(row[1:size], default=0) for row, size in zip(trees.depths.tolist(), trees.sizes, strict=True)]


def path_rows(path: torch.Tensor, accept_len: torch.Tensor) -> torch.Tensor:
    """Node indices of each request's committed path (root, accepted nodes) as [bs, max_len],
    padded by repeating the last node (callers read only the first accept_len + 1)."""
    width = int(accept_len.max()) + 1
    cols = torch.arange(width, device=path.device)[None]
    return path.gather(1, torch.minimum(cols, accept_len.to(path.device).long()[:, None]))
