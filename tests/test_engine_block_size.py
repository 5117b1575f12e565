"""The adaptive block size: the controller's estimates and choices on synthetic steps, and
generation with it stays lossless while the block size changes from step to step."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from sglang_dflash.control.block_size import (
    AFTER_PLAIN,
    ALL_ACCEPTED,
    FIRST_STEP,
    NONE_ACCEPTED,
    SOME_ACCEPTED,
    BlockSizeController,
    StepTimeModel,
    next_state,
)
from sglang_dflash.control.chain_or_tree import ChainOrTreeController
from sglang_dflash.engine import DFlashDrafter, Generator, OracleDrafter, SamplingParams
from tests.dflash_testlib import STOP_TOKEN, hf_greedy, random_draft, tiny_target


def accepted_run(rates: list[float], block_size: int, rng: random.Random) -> int:
    """Drafts accepted in one step: draft k is accepted with rates[k - 1] once drafts < k were."""
    a = 0
    while a < block_size - 1 and rng.random() < rates[a]:
        a += 1
    return a


def step_seconds(block_size: int) -> float:
    return 1.0 + 0.15 * (block_size - 1)  # a longer block costs more


def drive(controller: BlockSizeController, rates: list[float], steps: int, seed: int = 0) -> list[int]:
    """Run `steps` synthetic steps at batch size 1; returns the block sizes chosen."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(steps):
        b = controller.choose(1)
        controller.observe(b, [accepted_run(rates, b, rng)], step_seconds(b))
        chosen.append(b)
    return chosen


def test_times_the_largest_size_two_and_one_first_and_not_again_at_a_new_batch_size():
    """Two timed steps each, in turns, after an untimed first one: the first step at a new shape
    pays one-off costs and is not timed (a controller that saw those steps 3x slower predicts
    exactly what one that did not predicts). A new batch size plays plain steps until one is timed
    and starts from the nearest one's model, its draft and row costs times the batch sizes' ratio,
    rescaled to that plain step."""
    slow_first, plain = BlockSizeController(4), BlockSizeController(4)
    for b in (4, 4, 2, 2, 1, 1, 4, 2, 1):
        for c in (slow_first, plain):
            assert c.choose(1) == b and c.last_decision["why"] == "first try"
        first = (1, b) not in slow_first._seen
        slow_first.observe(b, [0], step_seconds(b) * (3.0 if first else 1.0))
        plain.observe(b, [0], step_seconds(b))
    assert [slow_first.step_seconds(1, b) for b in range(1, 5)] == [plain.step_seconds(1, b) for b in range(1, 5)]
    c = slow_first
    assert c.choose(1) in (1, 2, 3, 4) and c.last_decision["why"] == "best"
    assert c.step_seconds(3, 2) is None
    for _ in range(2):  # plain steps, the first not timed; no new round of the other first tries
        assert c.choose(3) == 1 and c.last_decision["why"] == "first try"
        c.observe(1, [0, 0, 0], 9.0 if (3, 1) not in c._seen else 2.0 * c.step_seconds(1, 1))
    one = [c.step_seconds(1, k) for k in range(1, 5)]
    # Batch size 1's plain step at batch size 3's scale, and its draft and row costs 3x that.
    want = [2.0 * (one[0] + 3.0 * (t - one[0])) for t in one]
    assert [c.step_seconds(3, k) for k in range(1, 5)] == pytest.approx(want)
    assert c.choose(3) in (1, 2, 3, 4) and c.last_decision["why"] != "first try"


def test_step_time_model_tracks_noisy_times_and_drift():
    """Steps jitter +-15 % (lognormal) with 3 % outliers at 2x; the model's predictions follow the
    truth for every size, also after the machine gets 30 % slower while only one size is played
    (every size's prediction follows)."""
    rng = random.Random(3)
    true = {b: 0.036 + 0.0065 * (b > 1) + 0.0025 * max(b - 2, 0) for b in range(1, 9)}
    model = StepTimeModel(8, 8, true[8])

    def play(sizes, slow, steps):
        for _ in range(steps):
            b = rng.choice(sizes)
            model.observe(b, true[b] * slow * rng.lognormvariate(0.0, 0.15) * (2.0 if rng.random() < 0.03 else 1.0))

    def check(slow, ratio_tolerance):
        # The filter tracks mean step times (the jitter and outliers add ~4 % to the median's, and a
        # recent stretch of slow steps a few % more); the ratios between sizes, which the choice
        # depends on, it gets within 3 % (5 % after 300 steps that contrast no sizes).
        predicted = [model.predict(b) for b in true]
        assert all(p == pytest.approx(slow * true[b], rel=0.12)
                   for b, p in zip(true, predicted, strict=True)), predicted
        assert all(p / predicted[0] == pytest.approx(true[b] / true[1], rel=ratio_tolerance)
                   for b, p in zip(true, predicted, strict=True)), predicted

    play([1, 2, 3, 4, 8], 1.0, 400)
    check(1.0, 0.03)
    play([3], 1.3, 300)
    check(1.3, 0.05)


# Measured on this CPU (SmolLM2-135M + the shipped drafter, bs 1): medians of steps at sizes 1-8
# played in shuffled turns over HumanEval and GSM8K prompts, ms over a 40 ms plain step. The fifth
# row costs ~3x each of rows 2-4: no line through the sizes fits it.
STAIR_MS = (0.0, 2.1, 3.6, 5.8, 13.4, 16.1, 18.5, 22.3)


def stair_sim_seconds(block_size: int, batch_size: int) -> float:
    """The measured staircase at batch size 1; more requests cost more (rows a little less each)."""
    rows = 0.001 * STAIR_MS[block_size - 1] * (1 + 0.6 * (batch_size - 1))
    return 0.040 * (1 + 0.15 * (batch_size - 1)) + rows


def test_step_time_model_learns_a_size_off_the_line():
    """On the measured staircase with 15 % step jitter, after 400 steps at random sizes the worst
    size's predicted time relative to a plain step is off by at most 4.5 % (mean over 10 runs; 4.0 %
    measured), and by at most 0.75x what the line alone gets wrong (5.7 %: the model's first
    version, which is this model with no residuals, i.e. a largest size of 2)."""
    def worst_error(max_block_size, seed):
        rng = random.Random(seed)
        model = StepTimeModel(max_block_size, 8, stair_sim_seconds(8, 1))
        for _ in range(400):
            b = rng.randint(1, 8)
            model.observe(b, stair_sim_seconds(b, 1) * rng.lognormvariate(0.0, 0.15))
        true_plain = stair_sim_seconds(1, 1)
        return max(abs(model.predict(b) / model.predict(1) / (stair_sim_seconds(b, 1) / true_plain) - 1)
                   for b in range(2, 9))

    with_residuals = sum(worst_error(8, seed) for seed in range(10)) / 10
    line_only = sum(worst_error(2, seed) for seed in range(10)) / 10
    assert with_residuals <= 0.045 and with_residuals <= 0.75 * line_only, (with_residuals, line_only)


def test_acceptance_estimates_follow_the_rates():
    rates = [0.8, 0.6, 0.4, 0.3, 0.2, 0.2, 0.1]
    c = BlockSizeController(8, decay=0.999)
    rng = random.Random(1)
    for _ in range(3000):
        c.observe(8, [accepted_run(rates, 8, rng)], 1.0)
    estimates = c.acceptance()
    assert all(abs(e - r) < 0.06 for e, r in zip(estimates[:4], rates[:4], strict=True)), estimates
    expected = c.expected_tokens()
    assert expected[0] == 1.0 and expected == sorted(expected) and len(expected) == 8


def test_a_requests_state_is_what_its_last_drafting_step_accepted():
    assert next_state(FIRST_STEP, 4, 0) == NONE_ACCEPTED
    assert next_state(FIRST_STEP, 4, 2) == SOME_ACCEPTED
    assert next_state(NONE_ACCEPTED, 4, 3) == ALL_ACCEPTED
    assert next_state(ALL_ACCEPTED, 2, 0) == NONE_ACCEPTED
    assert next_state(SOME_ACCEPTED, 1, 0) == AFTER_PLAIN  # a plain step tests no draft
    assert next_state(FIRST_STEP, 1, 0) == AFTER_PLAIN
    assert next_state(AFTER_PLAIN, 3, 1) == SOME_ACCEPTED
    # A tree of 4 nodes from a block of 8 is at most 4 deep: the chain of 5.
    assert next_state(FIRST_STEP, 8, 4, tree_budget=4) == ALL_ACCEPTED
    assert next_state(FIRST_STEP, 8, 3, tree_budget=4) == SOME_ACCEPTED


def test_acceptance_per_request_state():
    """Two requests in one batch, one in an easy stretch (its last step accepted all its drafts)
    and one in a hard one: each state's estimate follows its own request's rates, the pooled one
    lies between, a state never seen takes the pooled estimate, and a step's expected tokens are
    the mean of its requests'."""
    easy, hard = [0.9] * 7, [0.2] * 7
    c = BlockSizeController(8, decay=0.999)
    rng = random.Random(2)
    for _ in range(2000):
        c.observe(8, [accepted_run(easy, 8, rng), accepted_run(hard, 8, rng)], 1.0, [ALL_ACCEPTED, NONE_ACCEPTED])
    assert c.acceptance(ALL_ACCEPTED)[:4] == pytest.approx(easy[:4], abs=0.04)
    assert c.acceptance(NONE_ACCEPTED)[:2] == pytest.approx(hard[:2], abs=0.04)
    assert 0.5 < c.acceptance()[0] < 0.6
    assert c.acceptance(FIRST_STEP) == c.acceptance()
    both = c.expected_tokens([ALL_ACCEPTED, NONE_ACCEPTED])
    alone = [c.expected_tokens([state]) for state in (ALL_ACCEPTED, NONE_ACCEPTED)]
    assert both == pytest.approx([(x + y) / 2 for x, y in zip(*alone, strict=True)])
    assert alone[0][3] > 3.0 and alone[1][3] < 1.3


# The shipped drafter's accept lengths at B = 8, greedy, on the first 64 HumanEval prompts (128 new
# tokens, int8 drafter): bench/record_accept_lengths.py. Each prompt's steps in order.
HUMANEVAL_ACCEPT_LENGTHS = Path(__file__).parent / "data" / "accept_lengths_humaneval_t0_b8.json"
# This CPU, the same run's engine: median step ms at B = 1..8 (sizes drawn at random each step,
# 1,300 steps of HumanEval and GSM8K), and the step-to-step noise of those steps around the
# medians: log-sd 0.05, lag-1 autocorrelation 0.3.
MEASURED_STEP_MS = (28.7, 31.6, 33.7, 33.6, 36.6, 37.4, 40.7, 45.5)


DRAFT_ROW_MS = 0.2  # this CPU: a draft row more (B = 2 -> 8: 2.0 -> 3.4 ms a draft forward)


def replay(policy, prompts: list[list[int]], seed: int, steps: int = 330, with_states: bool = True,
           confidences: list[list[list[int]]] | None = None) -> float:
    """Tokens per second of `policy` (a controller, or a fixed block size) over `steps` steps of the
    recorded prompts, in turns from a seeded one: a step at block size b accepts min(a, b - 1) of
    the recorded a; the step times are MEASURED_STEP_MS with the measured noise (as many steps as
    a bench_e2e cell of 8 prompts plays). With the recorded draft `confidences` (%), a controller
    drafts draft_size(b) positions and verifies verify_length of them, as the generator does, a
    draft row beyond the verified ones costing DRAFT_ROW_MS."""
    rng = random.Random(seed)
    prompt, i, state = rng.randrange(len(prompts)), 0, FIRST_STEP
    tokens = seconds = log_noise = 0.0
    for _ in range(steps):
        if i == len(prompts[prompt]):
            prompt, i, state = (prompt + 1) % len(prompts), 0, FIRST_STEP
        states = [state] if with_states else None
        b = drafted = policy if isinstance(policy, int) else policy.choose(1, states)
        step_confidences = None
        if confidences is not None and not isinstance(policy, int) and policy.draft_size(b) > 2:
            drafted = policy.draft_size(b)
            step_confidences = [[q / 100 for q in confidences[prompt][i][:drafted - 1]]]
            b = policy.verify_length(1, step_confidences, states)
        accepted = min(prompts[prompt][i], b - 1)
        i += 1
        log_noise = 0.3 * log_noise + 0.954 * rng.gauss(0.0, 0.05)
        t = 1e-3 * (MEASURED_STEP_MS[b - 1] + DRAFT_ROW_MS * (drafted - b)) * math.exp(log_noise)
        if not isinstance(policy, int):
            policy.observe(b, [accepted], t, states, step_confidences)
        state = next_state(state, b, accepted)
        tokens += accepted + 1
        seconds += t
    return tokens / seconds


def test_request_states_lift_the_rate_on_measured_humaneval_steps():
    """Replaying the shipped drafter's HumanEval steps: the request states (a first step, which
    often repeats the prompt's code, accepts 6.7 of 7 drafts here where other steps accept ~1)
    lift the adaptive block size from 0.976 to 0.988 of the best fixed size's rate (means over 12
    seeds, paired noise)."""
    prompts = json.loads(HUMANEVAL_ACCEPT_LENGTHS.read_text())["accept_lengths"]
    pooled, states = [], []
    for seed in range(12):
        best = max(replay(b, prompts, seed) for b in range(1, 9))
        pooled.append(replay(BlockSizeController(8), prompts, seed, with_states=False) / best)
        states.append(replay(BlockSizeController(8), prompts, seed) / best)
    assert sum(states) / 12 >= 0.98 and sum(states) >= sum(pooled) + 12 * 0.008, (pooled, states)


def test_verifying_what_the_drafts_confidences_pay_for_lifts_the_rate_on_measured_humaneval_steps():
    """Replaying the same steps with the drafter's recorded confidence in each draft: drafting one
    position more and verifying only the rows the calibrated confidences pay for lifts the
    adaptive block size from 0.989 to 1.011 of the best fixed size's rate (means over 12 seeds,
    paired noise; bench_e2e, HumanEval greedy, side by side: 0.998 against 0.975)."""
    recorded = json.loads(HUMANEVAL_ACCEPT_LENGTHS.read_text())
    prompts, confidences = recorded["accept_lengths"], recorded["draft_confidence_percent"]
    without, with_confidences = [], []
    for seed in range(12):
        best = max(replay(b, prompts, seed) for b in range(1, 9))
        without.append(replay(BlockSizeController(8), prompts, seed) / best)
        with_confidences.append(replay(BlockSizeController(8), prompts, seed, confidences=confidences) / best)
    assert sum(with_confidences) >= sum(without) + 12 * 0.01, (without, with_confidences)


@pytest.mark.parametrize("rate,best", [(0.95, 8), (0.02, 1)])
def test_picks_long_blocks_when_drafts_pay_and_plain_steps_when_they_do_not(rate, best):
    chosen = drive(BlockSizeController(8), [rate] * 7, 300)
    tail = chosen[100:]
    assert tail.count(best) > 0.8 * len(tail), tail


def test_comes_back_to_longer_blocks_when_acceptance_returns():
    c = BlockSizeController(4)
    drive(c, [0.0] * 3, 100)
    chosen = drive(c, [1.0] * 3, 150, seed=1)
    assert chosen[-50:].count(4) > 40, chosen


def test_explores_a_neighbour_of_the_best_size_periodically():
    """Every explore_every-th step plays b* + 1 (which tests the first draft position the chosen
    blocks leave untested), every 4th time b* // 2 and every 4th time after that a plain step (so
    the step-time model keeps contrasts between sizes, and the plain step's own time); at b* = 1
    only upwards, at b* = max downwards every 2nd time."""
    first_tries = 9

    def explorations(c, rates, turns):
        chosen = drive(c, rates, first_tries + c.explore_every * turns)[first_tries:]
        slots = [i for i in range(len(chosen)) if (i + first_tries) % c.explore_every == c.explore_every - 1]
        return chosen, [chosen[i] for i in slots]

    chosen, explored = explorations(BlockSizeController(4, explore_every=8), [0.02] * 3, 12)
    assert explored == [2] * 12 and chosen.count(1) >= len(chosen) - 12, chosen
    chosen, explored = explorations(BlockSizeController(4, explore_every=8), [0.97] * 3, 12)
    assert explored.count(2) == 3 and explored.count(1) == 3 and chosen.count(4) >= len(chosen) - 6 - 2, chosen
    chosen, explored = explorations(BlockSizeController(8, explore_every=8), [0.55] * 7, 40)
    best = max(set(chosen), key=chosen.count)
    assert 1 < best < 8 and explored.count(best + 1) >= 15 and explored.count(best // 2) >= 5, (best, explored)
    assert explored.count(1) >= 5, explored


def test_plays_a_neighbour_within_three_percent_four_times_as_often():
    """B = 2 with first drafts accepted evenly at p_1 = 0.16 makes 1.16 tokens for 1.15x a
    plain step's time: 0.9 % apart, so which one the estimates call best is noise; the other is
    played every 4th step (why: "close"). With first drafts accepted at p_1 = 0.02 the two sizes
    are 11 % apart: nothing is "close", and B = 2 is only explored (every 16th step)."""
    def run(p_1):
        c, tested, late, whys = BlockSizeController(4), 0, [], []
        for i in range(600):
            b = c.choose(1)
            accepted = 0
            if b > 1:
                accepted, tested = int((tested + 1) * p_1) - int(tested * p_1), tested + 1
            c.observe(b, [accepted], step_seconds(b))
            if i >= 400:
                late.append(b)
                whys.append(c.last_decision["why"])
        return late, whys

    late, whys = run(0.16)
    # every 4th step but the exploration steps (every 16th): 50 - 12.5
    assert whys.count("close") >= 35 and late.count(1) >= 35 and late.count(2) >= 35, (late, whys)
    late, whys = run(0.02)
    assert "close" not in whys and late.count(1) >= 180, (late, whys)


def test_recovers_from_slow_first_steps_at_small_sizes():
    """Plain and two-row steps timed during a slow spell (2x) made the model take rows for nearly
    free; exploring only upwards it then played the largest size for good (6 of these 8 runs;
    HumanEval at T = 1: 0.90x plain, here 80 % of the best size's rate). Now every run comes back to
    the best fixed size or its neighbour, within 5 % of its rate (sizes 3 and 4 are 3.5 % apart)."""
    rates = [0.39, 0.37, 0.2, 0.3, 0.3, 0.3, 0.3]

    def expected_rate(b):  # expected tokens per second of fixed size b
        run, expected = 1.0, 1.0
        for p in rates[:b - 1]:
            run *= p
            expected += run
        return expected / sim_seconds(b, 1)

    best = max(range(1, 9), key=expected_rate)
    for seed in range(8):
        rng, c, chosen = random.Random(seed), BlockSizeController(8), []
        for i in range(600):
            b = c.choose(1)
            c.observe(b, [accepted_run(rates, b, rng)], sim_seconds(b, 1) * (2.0 if i < 9 and b < 8 else 1.0))
            chosen.append(b)
        late = chosen[-200:]
        assert abs(max(set(late), key=late.count) - best) <= 1, (seed, late)
        assert sum(expected_rate(b) for b in late) / len(late) >= 0.95 * expected_rate(best), (seed, late)


def sim_seconds(block_size: int, batch_size: int) -> float:
    """A step of this CPU (SmolLM2-135M + the shipped drafter, bench_e2e): a plain step 36 ms, the
    draft forward and the second row +6.5 ms, each further row +2.5 ms; more requests cost more."""
    return (0.036 * (1 + 0.15 * (batch_size - 1)) + 0.0065 * (block_size > 1)
            + 0.0025 * max(block_size - 2, 0) * batch_size)


def convex_sim_seconds(block_size: int, batch_size: int) -> float:
    """As sim_seconds, but rows cost what bench_e2e's block sweep measured on this CPU at batch size
    1: rows 3 and 4 +2.1 ms each, each row past 4 +2.9 ms (skinny_linear then tiled 4 rows)."""
    rows = 0.0021 * min(max(block_size - 2, 0), 2) + 0.0029 * max(block_size - 4, 0)
    return 0.036 * (1 + 0.15 * (batch_size - 1)) + 0.0065 * (block_size > 1) + rows * batch_size


def simulate(policy, phases: list[list[float]], batch_size: int, seed: int, steps_per_phase: int = 1500,
             seconds_of=sim_seconds, warmup: tuple[int, int] | None = None) -> float:
    """Tokens per second of `policy` (a controller, or a fixed block size) over the phases' acceptance
    rates, with this CPU's step-time noise: +-15 % lognormal jitter that persists over ~10 steps,
    3 % of steps 1.8x, the first step at each size 1.5x, and the machine 1.3x slower for the middle
    third of the first phase. The noise of step i is the same for every policy given one seed.
    `warmup` (batch size, steps): a controller first plays that many steps at that batch size,
    not counted (a server whose first requests came alone)."""
    accept_rng, noise_rng = random.Random(seed), random.Random(seed + 1)
    tokens = seconds = log_noise = 0.0
    first = set()
    if warmup is not None and not isinstance(policy, int):
        warm_rng = random.Random(seed + 2)
        for _ in range(warmup[1]):
            b = policy.choose(warmup[0])
            accepted = [accepted_run(phases[0], b, warm_rng) for _ in range(warmup[0])]
            policy.observe(b, accepted, seconds_of(b, warmup[0]) * math.exp(warm_rng.gauss(0.0, 0.1)))
    for phase, rates in enumerate(phases):
        for i in range(steps_per_phase):
            b = policy if isinstance(policy, int) else policy.choose(batch_size)
            accepted = [accepted_run(rates, b, accept_rng) for _ in range(batch_size)]
            log_noise = 0.9 * log_noise + 0.436 * noise_rng.gauss(0.0, 0.15)  # sd 0.15, autocorrelation 0.9
            outlier = 1.8 if noise_rng.random() < 0.03 else 1.0
            slow = 1.3 if phase == 0 and steps_per_phase // 3 <= i < 2 * steps_per_phase // 3 else 1.0
            t = seconds_of(b, batch_size) * slow * math.exp(log_noise) * outlier * (1.5 if b not in first else 1.0)
            first.add(b)
            if not isinstance(policy, int):
                policy.observe(b, accepted, t)
            tokens += sum(a + 1 for a in accepted)
            seconds += t
    return tokens / seconds


LOW, CHAT, HIGH = [0.14] * 7, [0.2, 0.15, 0.15, 0.2, 0.2, 0.2, 0.2], [0.92] * 7
CODE = [0.55, 0.4, 0.5, 0.45, 0.45, 0.5, 0.5]
DEEP = [0.25, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95]  # long blocks pay, two-token blocks do not


@pytest.mark.parametrize("phases", [[LOW], [CHAT], [CODE], [HIGH], [DEEP], [LOW, HIGH], [HIGH, LOW],
                                    [CODE, LOW, CODE]],
                         ids=["low", "chat", "code", "high", "deep", "low-high", "high-low", "code-low-code"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_never_slower_than_the_best_fixed_block_size(phases, batch_size):
    """The adaptive block size makes at least 97 % of the tokens per second of the best fixed block
    size (plain steps included), each run through the same simulated phases and step-time noise
    (mean over three seeds). Its first version, which kept noisy median step times per size, made
    96-97 % in 4 of these 16 cases, and 1-7 % less than this one in 14."""
    ratios = []
    for seed in (7, 8, 9):
        adaptive = simulate(BlockSizeController(8), phases, batch_size, seed)
        ratios.append(adaptive / max(simulate(b, phases, batch_size, seed) for b in range(1, 9)))
    assert sum(ratios) / len(ratios) >= 0.97, ratios


@pytest.mark.parametrize("seconds_of,batch_size,least_mean,least_run",
                         [(convex_sim_seconds, 1, 0.97, 0.95), (stair_sim_seconds, 1, 0.97, 0.95),
                          (stair_sim_seconds, 4, 0.95, 0.92)], ids=["convex", "stair", "stair-bs4"])
def test_no_lock_in_when_rows_past_four_cost_more(seconds_of, batch_size, least_mean, least_run):
    """Long blocks that pay (DEEP) where rows past four cost more: the linear step-time model once
    locked some runs onto a too-large size (convex: one of these five made 79 % of the best fixed
    size's rate; mean 94.5 %). A plain step among the explorations at b* >= 4 keeps the plain step's
    time, and so the split between a step's base and its rows, known. On the measured staircase at
    batch size 4 (B = 4 best, B = 5 12 % worse), the line alone made a mean 89.3 % (worst 86.7 %);
    each size's residual off the line makes 95.8 % (worst 92.6 %): the persistent step-time noise
    still leaves the model some runs 5-10 % wrong about B = 4, and its neighbours get played."""
    ratios = []
    for seed in range(7, 12):
        adaptive = simulate(BlockSizeController(8), [DEEP], batch_size, seed, 800, seconds_of)
        ratios.append(adaptive / max(simulate(b, [DEEP], batch_size, seed, 800, seconds_of) for b in range(1, 9)))
    assert min(ratios) >= least_run and sum(ratios) / len(ratios) >= least_mean, ratios


def served_sim_seconds(block_size: int, batch_size: int) -> float:
    """A served SmolLM2 decode step (fp16 target, bench_serving's server logs): plain 37 ms at 1
    request, 42 ms at 4; the draft forward ~2 ms a request; of the rows a step verifies, those up
    to 8 cost ~0.8 ms each (reading the weights still dominates), each past 8 ~2.3 ms (compute
    bound). So B = 8 costs ~45 ms at 1 request and ~110 ms at 4."""
    rows = block_size * batch_size
    return (0.037 + 0.0017 * (batch_size - 1) + 0.002 * batch_size * (block_size > 1)
            + 0.0008 * max(min(rows, 8) - batch_size, 0) + 0.0023 * max(rows - 8, 0))


@pytest.mark.parametrize("rates", [CODE, CHAT, LOW], ids=["code", "chat", "low"])
def test_a_new_batch_size_learns_its_own_row_costs(rates):
    """A server that served one request at a time, then four: at 4 requests a row costs ~3x what it
    did at 1 (compute, not weight reads, bounds them), so the sizes that won alone lose. A new batch
    size's model took the nearest one's shape, all of it rescaled to its first timed step: with
    that step a long block (rows looked nearly free), the plain step looked 2.5x dearer than it
    was, and served runs played B = 8 at 4 requests (113 ms a step, plain 42 ms). Now a new batch
    size times plain steps first and scales the nearest model's row costs by the batch ratio."""
    ratios = []
    for seed in (7, 8, 9):
        adaptive = simulate(BlockSizeController(8), [rates], 4, seed, 600, served_sim_seconds, warmup=(1, 300))
        ratios.append(adaptive / max(simulate(b, [rates], 4, seed, 600, served_sim_seconds) for b in range(1, 9)))
    assert sum(ratios) / len(ratios) >= 0.95, ratios


@pytest.mark.parametrize("rates", [CHAT, LOW], ids=["chat", "low"])
def test_explores_rarely_where_drafting_is_far_behind_plain_steps(rates):
    """Sixteen served requests (served_sim_seconds): every verified row costs compute, so a
    two-token block takes 1.8x a plain step and plain steps win by far. An exploration every 16th
    step then costs about 4 % of the rate (0.96 of plain steps alone); a quarter as many where
    drafting's best predicted rate is below 85 % of plain's leave at least 98 %."""
    ratios = []
    for seed in (7, 8, 9):
        adaptive = simulate(BlockSizeController(8), [rates], 16, seed, 1500, served_sim_seconds, warmup=(1, 300))
        ratios.append(adaptive / simulate(1, [rates], 16, seed, 1500, served_sim_seconds))
    assert min(ratios) >= 0.98, ratios


def chat_sim_seconds(block_size: int, batch_size: int) -> float:
    """bench_e2e's MT-Bench T = 0.7 cell on this CPU: a plain step 37.8 ms, B = 2 41.5, B = 3 43.1."""
    return (0.0378 * (1 + 0.15 * (batch_size - 1)) + 0.0037 * (block_size > 1)
            + 0.0018 * max(block_size - 2, 0) * batch_size)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_chat_where_plain_and_two_token_blocks_are_close(batch_size):
    """Chat acceptance (p_1 = 0.16) at chat step costs: B = 2 makes ~6 % more than plain steps, B = 3
    ~3 % less. Without playing a close neighbour more often, the worst of 8 runs made 94.4 % (bs 1)
    and 94.9 % (bs 4) of the best fixed size's rate; now every run makes >= 96 %."""
    rates = [0.16, 0.12, 0.1, 0.1, 0.1, 0.1, 0.1]
    ratios = []
    for seed in range(8):
        adaptive = simulate(BlockSizeController(8), [rates], batch_size, seed, 800, chat_sim_seconds)
        best = max(simulate(b, [rates], batch_size, seed, 800, chat_sim_seconds) for b in range(1, 9))
        ratios.append(adaptive / best)
    assert min(ratios) >= 0.96 and sum(ratios) / len(ratios) >= 0.975, ratios


def test_rarely_tested_positions_keep_what_they_learned():
    """A run of plain steps (no draft tested) must not drift the acceptance back to the prior."""
    c = BlockSizeController(4)
    for _ in range(50):
        c.observe(4, [0], 1.0)
    before = c.acceptance()
    for _ in range(500):
        c.observe(1, [0], 1.0)
    assert c.acceptance() == before and before[0] < 0.05


def test_the_decision_says_why():
    c = BlockSizeController(2, explore_every=1000)
    c.choose(1)
    assert c.last_decision == {"block_size": 2, "why": "first try"}
    for b in (2, 2, 1, 1) + (2, 1) * 20:
        c.observe(b, [0], 0.01 * b)
    assert c.choose(1) == 1
    assert c.last_decision["why"] == "best" and len(c.last_decision["expected_tokens"]) == 2
    assert c.last_decision["step_ms"] == pytest.approx([10.0, 20.0], rel=0.1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_block_size"):
        BlockSizeController(0)
    with pytest.raises(ValueError, match="decay"):
        BlockSizeController(4, decay=0.0)
    with pytest.raises(ValueError, match="outside"):
        BlockSizeController(4).observe(5, [0], 1.0)
    with pytest.raises(ValueError, match="2 request states for a batch of 1"):
        BlockSizeController(4).choose(1, [FIRST_STEP, FIRST_STEP])
    with pytest.raises(ValueError, match="1 request states for 2 accept lengths"):
        BlockSizeController(4).observe(4, [0, 1], 1.0, [FIRST_STEP])


class ModelledStepTimes(BlockSizeController):
    """A controller fed modelled step times (10 ms + 1 ms per block row) in place of the wall clock:
    which sizes it plays then follows acceptance only, not the load of the machine running the test
    (with real timings a loaded CI machine played only {1, 2, 8} of the oracle case's sizes)."""

    def observe(self, block_size: int, accept_lens: list[int], seconds: float, states=None, confidences=None) -> None:
        super().observe(block_size, accept_lens, 0.010 + 0.001 * block_size * len(accept_lens), states, confidences)


PROMPTS = [[3, 4, 5], list(range(10, 30)), [50, 60, 70, 80, 90, 11, 12], [5]]
MAX_NEW = 40


@pytest.mark.parametrize("drafter_kind", ["dflash", "oracle"])
def test_adaptive_generation_equals_plain_greedy(drafter_kind):
    """The block size changes from step to step (8, 2 and 1 are tried first, others as the controller
    explores), with the real DFlash drafter (whose context must follow plain steps too) and with
    an oracle that is right 70% of the time; the ids equal Hugging Face's greedy generate for bs 1
    and bs 4."""
    target = tiny_target("qwen3")
    refs = [hf_greedy(target, p, MAX_NEW, STOP_TOKEN) for p in PROMPTS]
    if drafter_kind == "dflash":
        drafter = DFlashDrafter(random_draft(target), target)
    else:
        drafter = OracleDrafter([p + r for p, r in zip(PROMPTS, refs, strict=True)], target.vocab_size, corrupt=0.3)
    gen = Generator(target, drafter, 8, adaptive=True)
    gen.controller = ChainOrTreeController(ModelledStepTimes(8, explore_every=4))
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(STOP_TOKEN,))
    result_sets = []
    for prompts, expected in ((PROMPTS[1:2], refs[1:2]), (PROMPTS, refs)):
        result_sets.append(gen.generate(prompts, params))
        for result, ref in zip(result_sets[-1], expected, strict=True):
            assert result.output_ids == ref
            assert [t for s in result.steps for t in s] == result.output_ids[1:]
            assert 1 <= result.stats.mean_block_size <= 8
    sizes = {b for (_, b) in gen.controller.chains._seen}
    assert {1, 2, 8} <= sizes and (drafter_kind == "dflash" or len(sizes) >= 4), sizes  # a random draft never pays
    # The oracle's drafts pay, so it plays blocks of 3+, which draft one position more and verify
    # fewer rows when its confidences say so (verify_length); a random draft plays 1 and 2.
    decisions = [d for results in result_sets for result in results for d in result.decisions]
    assert drafter_kind == "dflash" or any(d.get("verified", 9) < d.get("drafted", 0) for d in decisions)
    # The generator tells the controller each request's state: first steps were learned apart.
    assert gen.controller.chains.acceptance(FIRST_STEP) != gen.controller.chains.acceptance()


def test_adaptive_sampling_runs():
    target = tiny_target("llama")
    gen = Generator(target, DFlashDrafter(random_draft(target), target), 4, adaptive=True)
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=20, stop_token_ids=())
    first = gen.generate(PROMPTS, params)
    assert all(len(r.output_ids) == 20 for r in first)
    assert all(0 <= t < target.vocab_size for r in first for t in r.output_ids)
