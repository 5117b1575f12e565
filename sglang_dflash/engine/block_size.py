"""Adaptive block size: each verify step drafts as many tokens as are expected to pay.

A longer block commits more tokens when the drafts are right and costs more target (and draft)
compute either way, and how often drafts are right changes with the text: a drafter that is right
on math can be wrong on chat, where speculation at a fixed B runs slower than plain decoding. The
controller keeps, for each draft position k, the rate at which it is accepted once the positions
before it were (exponentially weighted, so it follows the text), and the measured seconds of a
step at each (batch size, block size). It picks the block size b (1 = plain decoding) that
maximises expected tokens per second:

    E[tokens](b) = 1 + sum_{k < b} p_1 * ... * p_k,      b* = argmax E[tokens](b) / seconds(b).

Every block size is tried once per batch size before that (largest first, which measures every
position's rate), and every `explore_every` steps the size measured longest ago is re-timed, so
one slow first measurement cannot rule a size out for good. Positions a small b does not test
decay toward their prior (the rate of the position before; 0.5 for the first), so after a run of
short blocks a longer one is tried again. The block size never changes the output: every step is
a lossless verify.
"""

from __future__ import annotations


class BlockSizeController:
    def __init__(self, max_block_size: int, decay: float = 0.95, prior_weight: float = 1.0,
                 explore_every: int = 32):
        if max_block_size < 1:
            raise ValueError(f"max_block_size must be >= 1, got {max_block_size}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.max_block_size = max_block_size
        self.decay, self.prior_weight, self.explore_every = decay, prior_weight, explore_every
        self._tested = [0.0] * (max_block_size - 1)  # [k - 1]: weighted count of drafts k checked
        self._accepted = [0.0] * (max_block_size - 1)  # ... and of those accepted
        self._seconds: dict[tuple[int, int], float] = {}  # (batch size, b) -> weighted mean step time
        self._timed_at: dict[tuple[int, int], int] = {}  # (batch size, b) -> step of its last timing
        self._steps = 0

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

    def choose(self, batch_size: int) -> int:
        sizes = range(self.max_block_size, 0, -1)
        untried = [b for b in sizes if (batch_size, b) not in self._seconds]
        if untried:
            return untried[0]
        if self._steps % self.explore_every == self.explore_every - 1:
            return min(sizes, key=lambda b: self._timed_at[batch_size, b])
        expected = self.expected_tokens()
        return max(range(1, self.max_block_size + 1),
                   key=lambda b: expected[b - 1] / self._seconds[batch_size, b])

    def observe(self, block_size: int, accept_lens: list[int], seconds: float) -> None:
        """One verify step of `len(accept_lens)` requests at `block_size`, taking `seconds`;
        accept_lens[i] drafts of request i were accepted."""
        if not 1 <= block_size <= self.max_block_size:
            raise ValueError(f"block_size {block_size} is outside [1, {self.max_block_size}]")
        for k in range(self.max_block_size - 1):
            self._tested[k] *= self.decay
            self._accepted[k] *= self.decay
        for a in accept_lens:
            for k in range(min(a + 1, block_size - 1)):  # drafts 1..a accepted, draft a + 1 rejected
                self._tested[k] += 1.0
                self._accepted[k] += float(k < a)
        key = (len(accept_lens), block_size)
        old = self._seconds.get(key)
        # Step times drift less than acceptance but are noisy: half old, half new.
        self._seconds[key] = seconds if old is None else 0.5 * (old + seconds)
        self._timed_at[key] = self._steps
        self._steps += 1
