"""How likely a draft is to be accepted, from the drafter's own confidence in it.

DFlash drafts every block position in one forward pass, so a step's drafts and their draft
probabilities are all known before the target verifies anything. A draft the drafter was sure of
is accepted far more often than one it was not (the shipped drafter's recorded HumanEval steps,
with each draft's probability: tests/data/accept_lengths_humaneval_t0_b8.json), so the adaptive
block size drafts one position more than its chosen block and verifies only the drafts whose
acceptance pays for their verify rows (block_size.py, `verify_length`).

The drafter's probability is not the acceptance probability: they agree closely on code and math
where the drafter was trained, chat makes it overconfident, and temperature changes both. So it is
calibrated online: `ConfidenceCalibration` keeps, per bin of confidence, the fraction of drafts
accepted among those tested (a draft is tested when every draft before it was accepted), each
bin starting from its own mid-point with the weight of `_PRIOR_WEIGHT` tests and forgetting by
`_DECAY` per test, so it follows a change of text or temperature.
"""

from __future__ import annotations

_BINS = 10  # equal bins of the draft probability in [0, 1]
_PRIOR_WEIGHT = 2.0  # tests a bin's prior (its mid-point) weighs
_DECAY = 0.995  # each bin forgets by this per test of that bin


class ConfidenceCalibration:
    """P(draft accepted | the drafts before it were, its draft probability q)."""

    def __init__(self):
        self._tested = [_PRIOR_WEIGHT] * _BINS
        self._accepted = [_PRIOR_WEIGHT * (i + 0.5) / _BINS for i in range(_BINS)]

    @staticmethod
    def _bin(q: float) -> int:
        if not 0.0 <= q <= 1.0:  # also refuses NaN
            raise ValueError(f"a draft confidence is a probability in [0, 1], got {q}")
        return min(int(q * _BINS), _BINS - 1)

    def acceptance(self, q: float) -> float:
        i = self._bin(q)
        return self._accepted[i] / self._tested[i]

    def observe(self, q: float, accepted: bool) -> None:
        """A tested draft of confidence q was (or was not) accepted."""
        i = self._bin(q)
        self._tested[i] = self._tested[i] * _DECAY + 1.0
        self._accepted[i] = self._accepted[i] * _DECAY + float(accepted)

    def expected_tokens(self, confidences: list[float]) -> list[float]:
        """[L - 1] for L = 1..len(confidences) + 1: expected tokens a verify of the anchor and the
        first L - 1 of these drafts commits (the bonus token included)."""
        expected, run = [1.0], 1.0
        for q in confidences:
            run *= self.acceptance(q)
            expected.append(expected[-1] + run)
        return expected
