"""Chain or tree, step by step: the adaptive choice when draft trees are allowed (docs/design.md §6.5).

A tree of n drafted nodes (tree.py) verifies up to n + 1 rows a request (fewer where a greedy
tree stops at its least path probability: the budget's measured time ratio below takes that in)
and commits at least what the chain of its depth would (the drafter's argmax chain is in it).
Whether it pays depends on what a verified row costs next to the whole step: where steps are bound
by reading the weights (GPUs, larger models) extra rows are nearly free and trees win; on a small
CPU target a large tree can cost more than it commits, more so in fp32 than in bf16
(bench/results/e2e_smollm2-135m_trees.json and e2e_smollm2-135m_trees_bf16.json). So the
controller estimates, per step:

- the chains' best rate, from `BlockSizeController` (which keeps choosing the chain, 1 = plain);
- each tree budget n's rate = tokens(n) / seconds(n). tokens(n) = the expected tokens of the chain
  of the tree's depth times the tree's gain over it: the gain changes slowly while the chain's
  acceptance follows the text, so every budget follows the text between its own plays. Where the
  caller says how many drafts the chain inside each tree had accepted (`tree.chain_accept_lens`:
  the engine and the served worker), the gain is the decayed tokens the trees committed over the
  decayed tokens their chains would have: paired on the same text, so a few tries on hard text do
  not bury a budget, and never below 1. Without them, a decayed mean of tokens committed over the
  chain's expected tokens, from 1 (the chain is in the tree). The chain inside each tree also
  updates the chains' per-position acceptance (with its depth, `tree.chain_depths`), so the
  chains' expected tokens, and every budget's, stay current while trees play instead of holding
  the estimate of the text before.
  seconds(n) = the chains' modelled time at n + 1 rows (at most the largest chain: the model is not
  extrapolated past the sizes the chains play) times the budget's measured ratio to it (a tree
  of n drafts a block of min(n + 1, B), takes the top-k and verifies under a 4-D mask). A budget
  not played yet takes the gain and the ratio of the nearest smaller one that was.

It plays the chains' choice while no tree is predicted faster, the best budget while one is.
First tries: the chains' own, then every budget `_TREE_TRIES` times, smallest first, a larger one
only while its prediction from the smaller ones may be near the best rate (the first step of a new
shape is not timed). Every `_EXPLORE_EVERY`-th step another arm plays, in turns: the chains' choice
while a tree wins, and the budgets that may be near the best rate; budgets far below it (under
`_WORTH_EXPLORING` of it, counting a budget played p times 1 + 0.5 / sqrt(p) times faster, so a few
unlucky first tries do not bury it) at every `_FAR_TURNS`-th of those turns only. What the tries
and explorations cost where chains win, and how close it comes to the best tree where one wins, is
simulated in tests/test_engine_chain_or_tree.py. Every step is a lossless verify, chain or tree, so
the mix never changes the output, greedy or seeded sampling.
"""

from __future__ import annotations

from sglang_dflash.control.block_size import BlockSizeController

_GAIN_DECAY = 0.99  # per request-step of that budget
_RATIO_DECAY = 0.9  # per timed step at that (batch size, budget)
_TOKENS_PRIOR = 1.0  # tokens (or request-steps, unpaired) the prior gain (1: the chain's tokens) is worth
_TREE_TRIES = 4  # steps of each budget before the model chooses (the first one untimed)
_EXPLORE_EVERY = 32
_WORTH_EXPLORING = 0.8  # trees predicted below this fraction of the best rate are explored less ...
_FAR_TURNS = 8  # ... at every this many-th exploration


def tree_budgets_up_to(budget: int) -> list[int]:
    """The budgets an adaptive run with `--tree-budget N` chooses from: N, N / 2, N / 4 (>= 2)."""
    return sorted({n for n in (budget, budget // 2, budget // 4) if n >= 2} or {budget})


class ChainOrTreeController:
    """`chains`: the block-size controller of the chain steps (its max_block_size is the drafter's
    block: trees are at most max_block_size - 1 deep); `tree_budgets`: the tree sizes it may play
    (none: it plays the chains' choice every step)."""

    def __init__(self, chains: BlockSizeController, tree_budgets: list[int] = ()):
        if any(n < 1 for n in tree_budgets):
            raise ValueError(f"tree budgets must be >= 1, got {list(tree_budgets)}")
        if tree_budgets and chains.max_block_size < 2:
            raise ValueError("trees need a block size >= 2 (their depth is block_size - 1)")
        self.chains = chains
        self.tree_budgets = sorted(set(tree_budgets))
        self._tokens = {n: [0.0, 0.0] for n in self.tree_budgets}  # decayed (sum, weight) of the gain
        # (batch size, n) -> decayed (sum, weight) of the tree's time over its reference chain's modelled one
        self._ratio: dict[tuple[int, int], list[float]] = {}
        self._plays = dict.fromkeys(self.tree_budgets, 0)
        self._seen: set[tuple[int, int]] = set()  # (batch size, n) of timed tree steps' shapes
        self._steps = 0
        self.last_decision: dict = {}

    def choose(self, batch_size: int, states: list[int] | None = None) -> tuple[int, int]:
        """(block size, tree budget) of the next step: (b, 0) a chain of b (1: plain), (B, n) a
        tree of n drafted nodes from the drafter's block B. `states` (optional): the requests'
        acceptance states (block_size.next_state)."""
        chain = self.chains.choose(batch_size, states)
        if not self.tree_budgets or self.chains.last_decision["why"] == "first try":
            return self._chain(chain)
        expected, seconds = self.chains.predictions(batch_size, states)
        chain_rate = max(e / max(t, 1e-12) for e, t in zip(expected, seconds, strict=True))
        rates = {n: self.tree_tokens(n, states) / max(self.tree_seconds(batch_size, n), 1e-12)
                 for n in self.tree_budgets}
        best = max(self.tree_budgets, key=rates.__getitem__)
        tree_wins = rates[best] > chain_rate
        untried = next((n for n in self.tree_budgets if self._plays[n] < _TREE_TRIES), None)
        if untried is not None and (untried == self.tree_budgets[0] or self._optimistic(rates[untried], untried)
                                    >= _WORTH_EXPLORING * max(chain_rate, rates[best])):
            # Smallest first; a larger budget, predicted from the smaller ones' gain and time, only
            # while it may be near: a large tree that is far behind is not worth its tries.
            return self._tree(untried, "first try", rates)
        if self._steps % _EXPLORE_EVERY == _EXPLORE_EVERY - 1:
            # The arms other than the chosen one, in turns: the chains' choice (while a tree wins)
            # and the trees that may be near the best rate at every exploration, the others at
            # every `_FAR_TURNS`-th. "May be": the rate of a budget played p times counts
            # 1 + 0.5 / sqrt(p) times higher here (a budget's tokens per step vary widely), so four
            # unlucky first tries do not make a budget that wins look far.
            top = max(chain_rate, rates[best])
            others = [n for n in self.tree_budgets if not (tree_wins and n == best)]
            may_be_near = {n: self._optimistic(rates[n], n) >= _WORTH_EXPLORING * top for n in others}
            near = [0] * tree_wins + [n for n in others if may_be_near[n]]
            far = [n for n in others if not may_be_near[n]]
            turn = self._steps // _EXPLORE_EVERY
            if far and turn % _FAR_TURNS == _FAR_TURNS - 1:
                return self._tree(far[(turn // _FAR_TURNS) % len(far)], "explore", rates)
            if near:
                pick = near[turn % len(near)]
                return self._chain(chain, explored=True) if pick == 0 else self._tree(pick, "explore", rates)
        return self._tree(best, "best", rates) if tree_wins else self._chain(chain)

    def _optimistic(self, rate: float, budget: int) -> float:
        return rate * (1.0 + 0.5 * max(self._plays[budget], 1) ** -0.5)

    def _reference_rows(self, budget: int) -> int:
        """The chain whose modelled time a tree's is measured against: as many rows, or the largest
        chain (no extrapolation past the sizes the chains play)."""
        return min(budget + 1, self.chains.max_block_size)

    def _nearest_played(self, budget: int, played) -> int | None:
        """`budget` if played, else the largest smaller budget that was (None: none)."""
        return next((n for n in reversed(self.tree_budgets) if n <= budget and played(n)), None)

    def tree_tokens(self, budget: int, states: list[int] | None = None) -> float:
        """Expected tokens a request (of requests in `states`, if given) commits in a tree step of
        `budget` drafted nodes: the chain of
        the tree's depth's, times the tree's measured gain over it (prior 1: the chain is in the
        tree). The gain, not the tokens, is what the tree steps teach: it changes slowly while the
        chain's acceptance follows the text, and every tree budget keeps following it between its
        own plays."""
        source = self._nearest_played(budget, lambda n: self._tokens[n][1] > 0)  # untried: a smaller one's gain
        total, weight = self._tokens[budget if source is None else source]
        return self._chain_tokens(budget, states) * (total + _TOKENS_PRIOR) / (weight + _TOKENS_PRIOR)

    def _chain_tokens(self, budget: int, states: list[int] | None = None) -> float:
        return self.chains.expected_tokens(states)[min(budget, self.chains.max_block_size - 1)]

    def tree_seconds(self, batch_size: int, budget: int) -> float:
        """Predicted seconds of a tree step of `budget` drafted nodes at `batch_size`: the chains'
        modelled time at budget + 1 rows, corrected by how the budget's measured time compares with
        the model at its `_reference_rows` (the model's own ratio as prior, worth one step); a
        budget with no timed step takes the correction of the nearest smaller one that has one."""
        def model(rows: int) -> float:
            return self.chains.model_seconds(batch_size, rows)

        def measured(n: int) -> list[float] | None:
            keys = [k for k in self._ratio if k[1] == n]
            return self._ratio[min(keys, key=lambda k: (abs(k[0] - batch_size), k[0]))] if keys else None

        source = self._nearest_played(budget, lambda n: measured(n) is not None)
        if source is None:
            return model(budget + 1)
        total, weight = measured(source)
        modelled = model(source + 1) / max(model(self._reference_rows(source)), 1e-12)
        return (total + modelled) / (weight + 1.0) / max(modelled, 1e-12) * model(budget + 1)

    def observe(self, block_size: int, tree_budget: int, accept_lens: list[int], seconds: float,
                chain_accept_lens: list[int] | None = None, chain_depths: list[int] | None = None,
                states: list[int] | None = None, confidences: list[list[float]] | None = None) -> None:
        """One verify step of `len(accept_lens)` requests as chosen (tree_budget 0: a chain of
        `block_size`), taking `seconds`; accept_lens[i] drafts of request i (in states[i], if given)
        were accepted, and of a tree step chain_accept_lens[i] of the chain_depths[i] drafts of the
        chain inside its tree (None: unknown). `confidences`: a chain step's draft probabilities
        (BlockSizeController.observe)."""
        self._steps += 1
        if not tree_budget:
            self.chains.observe(block_size, accept_lens, seconds, states, confidences)
            return
        if tree_budget not in self._tokens:
            raise ValueError(f"tree budget {tree_budget} is not one of {self.tree_budgets}")
        self._plays[tree_budget] += 1
        if states is not None and len(states) != len(accept_lens):
            raise ValueError(f"{len(states)} request states for {len(accept_lens)} accept lengths")
        gain = self._tokens[tree_budget]
        if chain_accept_lens is not None and len(chain_accept_lens) != len(accept_lens):
            raise ValueError(f"{len(chain_accept_lens)} chain accept lengths for {len(accept_lens)} requests")
        if chain_accept_lens is not None and chain_depths is not None:
            if len(chain_depths) != len(accept_lens):
                raise ValueError(f"{len(chain_depths)} chain depths for {len(accept_lens)} requests")
            # The chain inside a tree is the one a chain step of its depth + 1 drafts (the same
            # first choices): what it would have had accepted keeps the chains' per-position
            # acceptance current while trees play, and so every budget's expected tokens.
            for i, (a, depth) in enumerate(zip(chain_accept_lens, chain_depths, strict=True)):
                self.chains.observe_acceptance(depth + 1, [a], None if states is None else [states[i]])
        for i, a in enumerate(accept_lens):
            # Tokens the tree committed against what its chain would have (paired), or against the
            # chain's expected tokens.
            if chain_accept_lens is not None:
                tree_tokens, against = a + 1.0, chain_accept_lens[i] + 1.0
            else:
                # (Nothing taught the chains' acceptance this step: no chain_accept_lens.)
                chain_tokens = self._chain_tokens(tree_budget, None if states is None else [states[i]])
                tree_tokens, against = (a + 1) / chain_tokens, 1.0
            gain[0], gain[1] = gain[0] * _GAIN_DECAY + tree_tokens, gain[1] * _GAIN_DECAY + against
        key = (len(accept_lens), tree_budget)
        if key not in self._seen:  # the first step at a new shape pays one-off costs: not timed
            self._seen.add(key)
            return
        ratio = self._ratio.setdefault(key, [0.0, 0.0])
        reference = max(self.chains.model_seconds(len(accept_lens), self._reference_rows(tree_budget)), 1e-12)
        ratio[0] = ratio[0] * _RATIO_DECAY + seconds / reference
        ratio[1] = ratio[1] * _RATIO_DECAY + 1.0

    def _chain(self, block_size: int, explored: bool = False) -> tuple[int, int]:
        self.last_decision = dict(self.chains.last_decision, tree_budget=0)
        if explored:
            self.last_decision["why"] = "explore"
        return block_size, 0

    def _tree(self, budget: int, why: str, rates: dict | None = None) -> tuple[int, int]:
        self.last_decision = {"block_size": self.chains.max_block_size, "tree_budget": budget, "why": why}
        if rates is not None:
            self.last_decision["tree_rates"] = {n: round(r, 3) for n, r in rates.items()}
        return self.chains.max_block_size, budget
