"""Adaptive block size: each verify step drafts as many tokens as are expected to pay.

A longer block commits more tokens when the drafts are right and costs more target and draft
compute either way, and how often drafts are right changes with the text and the temperature. The
controller picks the block size b (1 = a plain step) that maximises expected tokens per second
(docs/design.md §6):

    E[tokens](b) = 1 + sum_{k < b} p_1 * ... * p_k,      b* = argmax E[tokens](b) / seconds(b).

Acceptance: p_k = P(draft k accepted | the drafts before it were), from the steps that tested
draft k, pooled over requests (a step at block b censors the positions >= b). Each position forgets
by `decay` per test of that position, not per step, so a position the chosen blocks rarely reach
keeps what it last learned instead of drifting back to an optimistic prior; a position with little
data leans on the one before it. Acceptance comes in stretches, so it is also kept per request
state (`next_state`: the first step, the last drafting step accepted none, some or all of its
drafts, the last step was plain), each state's estimate shrunk towards the pooled one by
`_STATE_PRIOR_WEIGHT` tests; a step's expected tokens are the mean over its requests' states. A
plain step tests no draft, so an estimate that noise put too low would stay low while plain steps
play: plain wins only by `_PLAIN_MARGIN`, and after a plain step a request is in a state of its
own.

Verify length: DFlash drafts all of a block's positions in one pass, so every draft's probability
is known before the target verifies any, and a sure draft is accepted far more often than an unsure
one (draft_confidence.py). A step at a chosen b >= 3 drafts b + 1 positions (`draft_size`), and
`verify_length` verifies the rows whose expected tokens, from the calibrated confidences, pay for
their time at the best chain's predicted rate. The drafts left unverified still count towards the
per-position acceptance with their calibrated acceptance, so it stays the acceptance of every draft
rather than of the confident ones. Blocks of 2 verify both their rows anyway and draft no third.

Step time: `StepTimeModel`, one per batch size, updated by every step whatever its size, because
a CPU step's time is noisy and drifts with the machine and the context length: separate medians
per size went stale for the sizes not played. The first step at each (batch size, b) is not timed
(one-off costs of a new shape); a new batch size plays plain steps until one is timed and starts
from the nearest known batch size's model, its draft and row costs scaled by the batch sizes'
ratio.

Exploration: the first batch size times the largest size (which tests every draft position), 2
and 1 first, `_ANCHOR_TIMINGS` steps each, in turns. Then every `explore_every`-th step plays
another size near b*: b* + 1, which tests the first position the chosen blocks leave untested, so
the choice can grow again when drafts start to pay; every 4th exploration (every 2nd at the
largest size) b* // 2, and at b* >= 4 every 4th after that a plain step, so the time model keeps
seeing sizes rows apart (steps of one size alone cannot tell a row's cost from a plain step's, and
a model that never sees plain steps lets its base and jump drift apart). A neighbour of b*
predicted within `_CLOSE` of its rate is played every 4th step, because which of two close sizes
wins rests on small differences of noisy estimates. Where plain steps win by far (drafting's best
rate under `_FAR_FROM_PLAIN` of theirs: many requests on a CPU, where every verified row costs
compute), an exploration costs more than it can find: each one that confirms it doubles the wait
for the next, up to `_FAR_EXPLORE_FACTOR` times explore_every.

The constants were chosen on replays of the shipped drafter's measured accept lengths and step
costs (tests/test_engine_block_size.py, tests/data/accept_lengths_humaneval_t0_b8.json) and
end to end against fixed block sizes (bench/results/e2e_smollm2-135m.json). The block size never
changes the output: every step is a lossless verify.
"""

from __future__ import annotations

from sglang_dflash.control.draft_confidence import ConfidenceCalibration

# Kalman filter noise: step-to-step jitter of one step (R, relative to its time), and how far per
# step the parameters may drift (Q): all of them together by a common factor (a slower machine
# slows every part of a step), and each on its own a little (relative to the base time).
_STEP_JITTER = 0.15
_SCALE_DRIFT = 0.01
_SHAPE_DRIFT = (0.002, 0.002, 0.0005)
_RESIDUAL_DRIFT = 0.0005  # per step, of each size's own residual (kernel shapes change slowly)
_CLOSE = 0.03  # a neighbouring size whose predicted rate is this close to the best's is played more
_ANCHOR_TIMINGS = 2  # timed steps of each first-try size (largest, 2, 1) before the model chooses
_OUTLIER_SIGMAS = 2.5  # a step further than this from the prediction counts as if at this distance
_PRIOR = (1.0, 0.2, 0.05)  # base, jump, slope relative to base before any contrast
_PRIOR_SD = (0.5, 0.3, 0.1)  # ... and how unsure of them (relative to base)
_RESIDUAL_PRIOR_SD = 0.035  # how far a size's time may sit off the line (relative to base)
_PLAIN_MARGIN = 0.03  # a plain step is chosen only when predicted this much faster than drafting
_FAR_FROM_PLAIN = 0.85  # drafting predicted below this fraction of plain steps' rate ...
_FAR_EXPLORE_FACTOR = 4  # ... is explored up to this many times less often
_STATE_PRIOR_WEIGHT = 6.0  # tests of the pooled acceptance a request state's own estimate starts from

# A request's acceptance state: what its last step says of its next one.
FIRST_STEP, NONE_ACCEPTED, SOME_ACCEPTED, ALL_ACCEPTED, AFTER_PLAIN = range(5)


def next_state(state: int, block_size: int, accepted: int, tree_budget: int = 0) -> int:
    """A request's acceptance state after a step in which `accepted` drafts were accepted: a chain of
    `block_size`, or with `tree_budget` a tree of that many nodes from a block of `block_size`,
    which counts as the chain of its depth + 1. After a plain step (block size 1), which tests no
    draft: AFTER_PLAIN. Were the state kept instead, a request whose drafts were all rejected
    once, in a state where plain steps win, would stay in it step after step, its estimate never
    corrected by a draft."""
    drafted = min(block_size - 1, tree_budget) + 1 if tree_budget else block_size
    if drafted <= 1:
        return AFTER_PLAIN
    return NONE_ACCEPTED if accepted == 0 else ALL_ACCEPTED if accepted >= drafted - 1 else SOME_ACCEPTED


class StepTimeModel:
    """seconds(b) = base + jump * [b > 1] + slope * max(b - 2, 0) + residual_b at one batch size,
    from noisy step times: a Kalman filter over (base, jump, slope, residual_3..residual_max),
    innovations clipped at `_OUTLIER_SIGMAS`. `base` drifts fastest, so a slower machine or a
    longer context moves every size's time at once, while the draft and row costs keep what the
    contrasts between sizes taught them. The line is the prior shape of a step; residual_b (prior
    0) is where size b's own kernels leave it: rows do not all cost alike, which one slope cannot
    say, so a size off the line is learned from its own plays. Plain floats, not numpy: it runs
    every step, and numpy's per-call overhead would dominate such small matrices."""

    def __init__(self, max_block_size: int, first_b: int, first_seconds: float,
                 template: StepTimeModel | None = None, rows_scale: float = 1.0):
        """The model of a batch size from its first timed step (`first_b`, `first_seconds`): the
        prior shape, or `template`'s (another batch size's) with its draft and row costs times
        `rows_scale` (the batch sizes' ratio: a step of n requests drafts and verifies n rows a
        block position), rescaled to that step."""
        self.max_block_size = max_block_size
        if template is None:
            prior, sds = list(_PRIOR), list(_PRIOR_SD)
            prior += [0.0] * (max_block_size - 2 if max_block_size > 2 else 0)
            sds += [_RESIDUAL_PRIOR_SD] * (len(prior) - len(sds))
            self.x = prior
            self.cov = [[sd * sd if i == j else 0.0 for j, _ in enumerate(sds)] for i, sd in enumerate(sds)]
            inflate = 1.0
        else:  # another batch size's shape, its rows scaled, all rescaled below; less sure of it
            factor = [1.0] + [rows_scale] * (len(template.x) - 1)
            self.x = [v * f for v, f in zip(template.x, factor, strict=True)]
            self.cov = [[v * fi * fj for v, fj in zip(row, factor, strict=True)]
                        for row, fi in zip(template.cov, factor, strict=True)]
            inflate = 4.0
        scale = first_seconds / max(self.predict(first_b), 1e-12)
        self.x = [v * scale for v in self.x]
        self.cov = [[v * scale * scale * inflate for v in row] for row in self.cov]

    def _features(self, b: int) -> list[float]:
        # More rows than the largest size (a tree's, in chain_or_tree) extend the slope from the
        # largest size's own time: they keep its residual.
        last = min(b, self.max_block_size)
        return [1.0, float(b > 1), float(max(b - 2, 0))] + [float(last == k) for k in range(3, self.max_block_size + 1)]

    def predict(self, b: int) -> float:
        return sum(h * v for h, v in zip(self._features(b), self.x, strict=True))

    def observe(self, b: int, seconds: float) -> None:
        base = max(self.x[0], 1e-12)
        drift = list(_SHAPE_DRIFT) + [_RESIDUAL_DRIFT] * (len(self.x) - len(_SHAPE_DRIFT))
        cov = [[v + _SCALE_DRIFT ** 2 * self.x[i] * self.x[j] + ((d * base) ** 2 if i == j else 0.0)
                for j, v in enumerate(row)] for i, (row, d) in enumerate(zip(self.cov, drift, strict=True))]
        h = self._features(b)
        # cov @ h over the nonzero features only (at most one residual is; cov is symmetric).
        active = [(k, hk) for k, hk in enumerate(h) if hk]
        ch = [sum(row[k] * hk for k, hk in active) for row in cov]
        predicted = self.predict(b)
        var = sum(ch[k] * hk for k, hk in active) + (_STEP_JITTER * max(predicted, 1e-12)) ** 2
        limit = _OUTLIER_SIGMAS * var ** 0.5
        innovation = min(max(seconds - predicted, -limit), limit)
        gain = [c / var for c in ch]
        self.x = [v + g * innovation for v, g in zip(self.x, gain, strict=True)]
        n = len(self.x)
        self.cov = [[cov[i][j] - gain[i] * ch[j] for j in range(n)] for i in range(n)]


class BlockSizeController:
    def __init__(self, max_block_size: int, decay: float = 0.97, prior_weight: float = 1.0,
                 explore_every: int = 16):
        if max_block_size < 1:
            raise ValueError(f"max_block_size must be >= 1, got {max_block_size}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2, got {explore_every}")
        self.max_block_size = max_block_size
        self.decay, self.prior_weight = decay, prior_weight
        self.explore_every = explore_every
        self._tested = [0.0] * (max_block_size - 1)  # [k - 1]: weighted count of drafts k checked
        self._accepted = [0.0] * (max_block_size - 1)  # ... and of those accepted
        self._by_state: dict[int, tuple[list[float], list[float]]] = {}  # the same per request state
        self._models: dict[int, StepTimeModel] = {}  # batch size -> its step times
        self._seen: set[tuple[int, int]] = set()  # (batch size, b) played at least once
        self._first_batch_size: int | None = None  # the batch size of the first timed step
        self._timings: dict[int, int] = {}  # block size -> steps timed at that batch size
        self._steps = 0
        self._far_explorations = 0  # explorations in a row that found drafting far behind plain steps
        self.last_decision: dict = {}  # why the last choose() chose what it chose (for --json / logs)
        self.confidence = ConfidenceCalibration()  # acceptance by draft probability (verify_length)

    def acceptance(self, state: int | None = None) -> list[float]:
        """Estimated p_k, k = 1..max_block_size - 1: P(draft k accepted | drafts before it were),
        pooled over requests, or of requests in `state` (next_state)."""
        rates, prior = [], 0.5
        for tested, accepted in zip(self._tested, self._accepted, strict=True):
            prior = (accepted + self.prior_weight * prior) / (tested + self.prior_weight)
            rates.append(prior)
        if state is None or state not in self._by_state:
            return rates
        return [(accepted + _STATE_PRIOR_WEIGHT * pooled) / (tested + _STATE_PRIOR_WEIGHT)
                for tested, accepted, pooled in zip(*self._by_state[state], rates, strict=True)]

    def expected_tokens(self, states: list[int] | None = None) -> list[float]:
        """[b - 1]: expected tokens a step of block size b commits per request: pooled, or the mean
        over requests in `states`."""
        if not states:
            return self._expected_tokens(self.acceptance())
        of_state = {state: self._expected_tokens(self.acceptance(state)) for state in set(states)}
        return [sum(of_state[state][i] for state in states) / len(states) for i in range(self.max_block_size)]

    @staticmethod
    def _expected_tokens(acceptance: list[float]) -> list[float]:
        expected, run = [1.0], 1.0
        for p in acceptance:
            run *= p
            expected.append(expected[-1] + run)
        return expected

    def step_seconds(self, batch_size: int, block_size: int) -> float | None:
        """Predicted seconds of a step at (batch_size, block_size); None before a step at that
        batch size was timed."""
        model = self._models.get(batch_size)
        return None if model is None else model.predict(block_size)

    def model_seconds(self, batch_size: int, rows: int) -> float:
        """The step-time model's seconds of a step verifying `rows` rows per request (a chain of
        block size `rows`, or beyond the largest one), from the nearest timed batch size's model.
        Needs one timed step."""
        return (self._models.get(batch_size) or self._nearest_model(batch_size)).predict(rows)

    def predictions(self, batch_size: int, states: list[int] | None = None) -> tuple[list[float], list[float]]:
        """[b - 1] for b = 1..max_block_size: expected tokens (per request, of requests in `states`
        if given) and predicted seconds of a step."""
        seconds = [self.model_seconds(batch_size, b) for b in range(1, self.max_block_size + 1)]
        return self.expected_tokens(states), seconds

    def choose(self, batch_size: int, states: list[int] | None = None) -> int:
        """The block size of the next step of `batch_size` requests; `states` (optional): each
        one's acceptance state (next_state)."""
        if states is not None and len(states) != batch_size:
            raise ValueError(f"{len(states)} request states for a batch of {batch_size}")
        untimed = [b for b in self._anchors() if self._timings.get(b, 0) < _ANCHOR_TIMINGS]
        if untimed and (not self._models or batch_size == self._first_batch_size):
            # The least timed anchor first: the sizes take turns, so a slow spell of the machine
            # falls on all of them rather than on one.
            return self._decide(min(untimed, key=lambda b: self._timings.get(b, 0)), "first try")
        if batch_size not in self._models:
            # A new batch size plays plain steps until one is timed (the first is not), so its
            # model starts from its own plain step and the nearest batch size's row costs scaled
            # by the ratio (observe). Rescaling all of that model to a first timed long block
            # instead would take rows to cost at n requests what they cost at 1, so the plain
            # step would look far dearer than it is and long blocks would win for no reason.
            return self._decide(1, "first try")
        expected, seconds = self.predictions(batch_size, states)
        rate = [e / max(t, 1e-12) for e, t in zip(expected, seconds, strict=True)]
        best = 1 + max(range(self.max_block_size), key=rate.__getitem__)  # smallest b on ties
        explore_every, far = self.explore_every, False
        if best == 1 and self.max_block_size > 1:
            # A plain step tests no draft, so an estimate of acceptance that noise put too low
            # is never corrected while plain steps play, where one too high is by the next
            # draft: plain must win by _PLAIN_MARGIN.
            drafting = 2 + max(range(self.max_block_size - 1), key=lambda i: rate[i + 1])
            if rate[drafting - 1] >= (1.0 - _PLAIN_MARGIN) * rate[0]:
                best = drafting
            elif rate[drafting - 1] < _FAR_FROM_PLAIN * rate[0]:
                # Drafting far behind plain steps (many requests on a CPU: every verified row
                # costs compute): each exploration costs more than it can find, so while they keep
                # confirming it, every one waits twice as long as the last, up to _FAR_EXPLORE_FACTOR.
                explore_every *= min(2 ** self._far_explorations, _FAR_EXPLORE_FACTOR)
                far = True
        if self._steps % explore_every == explore_every - 1:
            self._far_explorations = self._far_explorations + 1 if far else 0
            # b* + 1, except: b* // 2 every 4th turn (every 2nd at the largest size, where there is
            # no b* + 1), and a plain step two turns later when b* // 2 is none.
            turn = self._steps // self.explore_every
            if best >= 4 and turn % 4 == 3:
                return self._decide(1, "explore", expected, seconds)
            if best > 1 and turn % (2 if best == self.max_block_size else 4) == 1:
                return self._decide(best // 2, "explore", expected, seconds)
            if best < self.max_block_size:
                return self._decide(best + 1, "explore", expected, seconds)
        close = [b for b in (best - 1, best + 1) if 1 <= b <= self.max_block_size
                 and rate[b - 1] >= (1.0 - _CLOSE) * rate[best - 1]]
        every = max(self.explore_every // 4, 2)
        if close and self._steps % every == every - 1:
            # A neighbour within _CLOSE of the best: which of the two wins rests on small
            # differences of noisy estimates, so it is played four times as often as an exploration.
            return self._decide(close[(self._steps // every) % len(close)], "close", expected, seconds)
        return self._decide(best, "best", expected, seconds)

    def draft_size(self, block_size: int) -> int:
        """How many block positions a step at the chosen `block_size` drafts: one more (at most
        max_block_size), of which `verify_length` keeps the ones worth verifying; `block_size`
        itself while the first tries time their sizes, and for blocks of 1 or 2 (see the module
        docstring)."""
        if block_size <= 2 or self.last_decision.get("why") == "first try":
            return block_size
        return min(block_size + 1, self.max_block_size)

    def verify_length(self, batch_size: int, confidences: list[list[float]],
                      states: list[int] | None = None) -> int:
        """The rows L of a drafted block to verify: the anchor and the first L - 1 drafts, where
        confidences[i] holds the draft probabilities of request i's drafts (D - 1 each, a block of
        D drafted). L in [2, D] maximises the expected tokens the step commits (calibrated from the
        confidences) less what its seconds are worth at the best chain's predicted rate: a row is
        verified when its expected tokens pay for its time. While the first tries time their sizes:
        D."""
        if len(confidences) != batch_size:
            raise ValueError(f"{len(confidences)} requests' draft confidences for a batch of {batch_size}")
        drafted = len(confidences[0]) + 1
        if any(len(q) != drafted - 1 for q in confidences):
            raise ValueError(f"draft confidences of unequal lengths {sorted({len(q) for q in confidences})}")
        if not 2 <= drafted <= self.max_block_size:
            raise ValueError(f"{drafted - 1} draft confidences per request: the block must be in "
                             f"[2, {self.max_block_size}]")
        if drafted == 2 or self.last_decision.get("why") == "first try":
            return drafted
        expected, seconds = self.predictions(batch_size, states)
        rate = max(e / max(t, 1e-12) for e, t in zip(expected, seconds, strict=True))
        per_request = [self.confidence.expected_tokens(q) for q in confidences]
        value = [sum(e[rows - 1] for e in per_request) / batch_size - rate * seconds[rows - 1]
                 for rows in range(1, drafted + 1)]
        return max(range(2, drafted + 1), key=lambda rows: value[rows - 1])  # the fewest rows on ties

    def _anchors(self) -> list[int]:
        return list(dict.fromkeys((self.max_block_size, min(2, self.max_block_size), 1)))

    def _nearest_batch_size(self, batch_size: int) -> int:
        return min(self._models, key=lambda n: (abs(n - batch_size), n))

    def _nearest_model(self, batch_size: int) -> StepTimeModel:
        return self._models[self._nearest_batch_size(batch_size)]

    def _decide(self, block_size: int, why: str, expected: list[float] | None = None,
                seconds: list[float] | None = None) -> int:
        """Records why (with the estimates per block size 1..max, when there are any) and returns
        `block_size`."""
        self.last_decision = {"block_size": block_size, "why": why}
        if expected is not None:
            self.last_decision.update(expected_tokens=[round(e, 4) for e in expected],
                                      step_ms=[round(1e3 * t, 3) for t in seconds])
        return block_size

    def observe_acceptance(self, block_size: int, accept_lens: list[int], states: list[int] | None = None) -> None:
        """Drafts 1..a of a chain of block size `block_size` accepted and draft a + 1 rejected (none
        past the block), for each a in `accept_lens` (of a request in states[i], if given): the
        per-position acceptance, untimed (a tree step's inner chain, chain_or_tree.py)."""
        if not 1 <= block_size <= self.max_block_size:
            raise ValueError(f"block_size {block_size} is outside [1, {self.max_block_size}]")
        if states is not None and len(states) != len(accept_lens):
            raise ValueError(f"{len(states)} request states for {len(accept_lens)} accept lengths")
        for i, a in enumerate(accept_lens):
            for k in range(min(a + 1, block_size - 1)):
                self._count(k, 1.0, float(k < a), None if states is None else states[i])

    def _count(self, k: int, tests: float, accepted: float, state: int | None) -> None:
        """`tests` tests of draft k + 1 (a weight: 1 for a verified draft), `accepted` of them
        accepted, pooled and in the request's `state`."""
        blank = self.max_block_size - 1
        counts = [(self._tested, self._accepted)]
        if state is not None:
            counts.append(self._by_state.setdefault(state, ([0.0] * blank, [0.0] * blank)))
        forget = self.decay ** tests
        for tested, accepted_counts in counts:
            tested[k] = tested[k] * forget + tests
            accepted_counts[k] = accepted_counts[k] * forget + accepted

    def _observe_confidences(self, block_size: int, accept_lens: list[int], confidences: list[list[float]],
                             states: list[int] | None) -> None:
        """The verified drafts teach the calibration; the drafted but unverified ones of a request
        whose verified drafts were all accepted count as tests with their calibrated acceptance.
        Without them the per-position acceptance would be learned only from the drafts
        `verify_length` kept, those of high confidence, and overestimated."""
        if len(confidences) != len(accept_lens):
            raise ValueError(f"{len(confidences)} requests' draft confidences for {len(accept_lens)} accept lengths")
        for i, (a, q) in enumerate(zip(accept_lens, confidences, strict=True)):
            if len(q) < block_size - 1 or len(q) > self.max_block_size - 1:
                raise ValueError(f"{len(q)} draft confidences for a verified block of {block_size}")
            for k in range(min(a + 1, block_size - 1)):
                self.confidence.observe(q[k], k < a)
            if a < block_size - 1:
                continue
            reached = 1.0  # the chance the drafts before position k would all have been accepted
            for k in range(block_size - 1, len(q)):
                p = self.confidence.acceptance(q[k])
                self._count(k, reached, reached * p, None if states is None else states[i])
                reached *= p

    def observe(self, block_size: int, accept_lens: list[int], seconds: float,
                states: list[int] | None = None, confidences: list[list[float]] | None = None) -> None:
        """One verify step of `len(accept_lens)` requests at `block_size`, taking `seconds`;
        accept_lens[i] drafts of request i (in states[i], if given) were accepted. `confidences`
        (a step that drafted more than it verified, verify_length): each request's draft
        probabilities of all its drafts."""
        self.observe_acceptance(block_size, accept_lens, states)
        if confidences is not None:
            self._observe_confidences(block_size, accept_lens, confidences, states)
        self._steps += 1
        key = (len(accept_lens), block_size)
        if key not in self._seen:  # the first step at a new shape pays one-off costs: not timed
            self._seen.add(key)
            return
        batch_size = len(accept_lens)
        model = self._models.get(batch_size)
        if model is None:
            template, rows_scale = None, 1.0
            if self._models:
                nearest = self._nearest_batch_size(batch_size)
                template, rows_scale = self._models[nearest], batch_size / nearest
            self._models[batch_size] = StepTimeModel(self.max_block_size, block_size, seconds, template, rows_scale)
            if self._first_batch_size is None:
                self._first_batch_size = batch_size
        else:
            model.observe(block_size, seconds)
        if batch_size == self._first_batch_size:
            self._timings[block_size] = self._timings.get(block_size, 0) + 1
