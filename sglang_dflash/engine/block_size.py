"""Adaptive block size: each verify step drafts as many tokens as are expected to pay.

A longer block commits more tokens when the drafts are right and costs more target (and draft)
compute either way, and how often drafts are right changes with the text and the temperature: a
drafter that is right on code can be wrong on chat, where speculation at a fixed B runs slower than
plain decoding. The controller picks the block size b (1 = a plain step) that maximises expected
tokens per second:

    E[tokens](b) = 1 + sum_{k < b} p_1 * ... * p_k,      b* = argmax E[tokens](b) / seconds(b).

Acceptance: p_k = P(draft k accepted | drafts before it were), estimated from the steps that
tested draft k (pooled over requests: the Kaplan-Meier estimate, a step at block b censors the
positions >= b). Each position forgets by `decay` per test of that position, not per step, so a
position the chosen blocks rarely reach keeps what it last learned instead of drifting back to
an optimistic prior (which made a low-acceptance run keep re-trying drafts). A position with
little data leans on the estimate of the position before it.

Step time: the median of the last `window` steps at each (batch size, b), robust to one-off slow
steps; the first step at each (batch size, b) is replaced by the next (one-off costs of a new
shape). Sizes not timed yet at a batch size are interpolated between the nearest timed ones.

Exploration: at each new batch size the largest size (which tests every draft position), 2 and 1
are timed first (twice each); then every `explore_every`-th step re-times a size: usually the
least measured, then stalest, neighbour of the best one (cheap, since neighbours are nearly as
good, and what moves the choice), every fourth time any other size, so a far-away size can win
again after the text changes. The block size never changes the output: every step is a lossless verify.
"""

from __future__ import annotations

import statistics
from collections import deque


class BlockSizeController:
    def __init__(self, max_block_size: int, decay: float = 0.95, prior_weight: float = 1.0,
                 explore_every: int = 16, window: int = 5):
        if max_block_size < 1:
            raise ValueError(f"max_block_size must be >= 1, got {max_block_size}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if explore_every < 2 or window < 1:
            raise ValueError(f"explore_every must be >= 2 and window >= 1, got {explore_every}, {window}")
        self.max_block_size = max_block_size
        self.decay, self.prior_weight = decay, prior_weight
        self.explore_every, self.window = explore_every, window
        self._tested = [0.0] * (max_block_size - 1)  # [k - 1]: weighted count of drafts k checked
        self._accepted = [0.0] * (max_block_size - 1)  # ... and of those accepted
        self._times: dict[tuple[int, int], deque[float]] = {}  # (batch size, b) -> recent step seconds
        self._timed_at: dict[tuple[int, int], int] = {}  # (batch size, b) -> step of its last timing
        self._warming_up: set[tuple[int, int]] = set()  # sizes timed once: that first step is not kept
        self._steps = 0
        self._explorations = 0
        self.last_decision: dict = {}  # why the last choose() chose what it chose (for --json / logs)

    def acceptance(self) -> list[float]:
        """Estimated p_k, k = 1..max_block_size - 1: P(draft k accepted | drafts before it were)."""
        rates, prior = [], 0.5
        for tested, accepted in zip(self._tested, self._accepted, strict=True):
            prior = (accepted + self.prior_weight * prior) / (tested + self.prior_weight)
            rates.append(prior)
        return rates

    def expected_tokens(self) -> list[float]:
        """[b - 1]: expected tokens a step of block size b commits."""
        expected, run = [1.0], 1.0
        for p in self.acceptance():
            run *= p
            expected.append(expected[-1] + run)
        return expected

    def step_seconds(self, batch_size: int, block_size: int) -> float | None:
        """Recent step seconds at (batch_size, block_size): the median of its last steps, or
        interpolated from the nearest timed sizes when it has none; None before any was timed."""
        times = self._times.get((batch_size, block_size))
        if times:
            return statistics.median(times)
        timed = [b for b in range(1, self.max_block_size + 1) if (batch_size, b) in self._times]
        if not timed:
            return None
        below = [b for b in timed if b < block_size and (b > 1 or block_size == 2)]  # b = 1 has no draft
        above = [b for b in timed if b > block_size]
        if not below or not above:
            return self.step_seconds(batch_size, (below or above)[-1 if below else 0])
        lo, hi = below[-1], above[0]
        t_lo, t_hi = self.step_seconds(batch_size, lo), self.step_seconds(batch_size, hi)
        return t_lo + (t_hi - t_lo) * (block_size - lo) / (hi - lo)

    def choose(self, batch_size: int) -> int:
        sizes = range(self.max_block_size, 0, -1)
        anchors = dict.fromkeys((self.max_block_size, min(2, self.max_block_size), 1))
        untried = [b for b in anchors if (batch_size, b) not in self._times or (batch_size, b) in self._warming_up]
        if untried:
            return self._decide(untried[0], "first try at this batch size")
        expected = self.expected_tokens()
        seconds = [self.step_seconds(batch_size, b) for b in range(1, self.max_block_size + 1)]
        rate = {b: expected[b - 1] / seconds[b - 1] for b in sizes}
        best = max(sorted(rate), key=rate.__getitem__)  # smallest b on ties
        if self._steps % self.explore_every == self.explore_every - 1:
            self._explorations += 1
            pool = [b for b in (best - 1, best + 1) if 1 <= b <= self.max_block_size]
            if self._explorations % 4 == 0 or not pool:
                pool = [b for b in sizes if b != best] or [best]

            def staleness(b):
                times = self._times.get((batch_size, b), ())
                return len(times), self._timed_at.get((batch_size, b), -1)

            return self._decide(min(pool, key=staleness), "re-time", expected, seconds)
        return self._decide(best, "best", expected, seconds)

    def _decide(self, block_size: int, why: str, expected: list[float] | None = None,
                seconds: list[float] | None = None) -> int:
        """Records why (with the estimates per block size 1..max, when there are any) and returns
        `block_size`."""
        self.last_decision = {"block_size": block_size, "why": why}
        if expected is not None:
            self.last_decision.update(expected_tokens=[round(e, 4) for e in expected],
                                      step_ms=[round(1e3 * t, 3) for t in seconds])
        return block_size

    def observe(self, block_size: int, accept_lens: list[int], seconds: float) -> None:
        """One verify step of `len(accept_lens)` requests at `block_size`, taking `seconds`;
        accept_lens[i] drafts of request i were accepted."""
        if not 1 <= block_size <= self.max_block_size:
            raise ValueError(f"block_size {block_size} is outside [1, {self.max_block_size}]")
        for a in accept_lens:
            for k in range(min(a + 1, block_size - 1)):  # drafts 1..a accepted, draft a + 1 rejected
                self._tested[k] = self._tested[k] * self.decay + 1.0
                self._accepted[k] = self._accepted[k] * self.decay + float(k < a)
        key = (len(accept_lens), block_size)
        if key in self._warming_up:  # the first step at a new shape pays one-off costs: replace it
            self._warming_up.discard(key)
            self._times[key].clear()
        elif key not in self._times:
            self._warming_up.add(key)
        self._times.setdefault(key, deque(maxlen=self.window)).append(seconds)
        self._timed_at[key] = self._steps
        self._steps += 1
