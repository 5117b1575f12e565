"""Sampled DFlash generation is lossless: the joint law of the first emitted tokens matches the
target's own sampling distribution (computed exactly here), by a deterministic chi-square test;
also when the drafts are picked with the verify step's own noise (`DraftSampling`). And at one
seed, speculative sampling emits exactly the tokens plain sampling emits."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from sglang_dflash.engine import DFlashDrafter, DraftSampling, Generator, OracleDrafter, SamplingParams
from sglang_dflash.ops import gumbel_argmax
from tests.dflash_testlib import hf_greedy, random_draft, tiny_target

VOCAB, PROMPT, N_TOKENS, N_SAMPLES = 12, [3, 9, 4], 3, 4000


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The target's sampling distribution, from the spec: softmax(logits / T) restricted to the
    top-k ids, then to the ids whose strictly-more-likely mass is below top_p, renormalised."""
    x = logits.double() / temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if top_k > 0:
        keep &= x >= x.sort(descending=True).values[top_k - 1]
    p = torch.softmax(x.masked_fill(~keep, float("-inf")), 0)
    above = torch.stack([p[p > p[v]].sum() for v in range(len(p))])
    keep &= above < top_p
    p = p * keep
    return p / p.sum()


def exact_joint(target, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first N_TOKENS emitted tokens) by enumerating every prefix through the target."""
    probs = {(): 1.0}
    for _ in range(N_TOKENS):
        nxt = {}
        for prefix, p in probs.items():
            if p < 1e-12:
                continue
            with torch.no_grad():
                logits = target.model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
            q = filtered_probs(logits, params.temperature, params.top_k, params.top_p)
            for v in range(VOCAB):
                nxt[prefix + (v,)] = p * float(q[v])
        probs = nxt
    return probs


def chi_square_pvalue(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    assert all(exact.get(s, 0.0) > 0 for s in counts), "sampled a sequence the target cannot produce"
    big = [c for c, p in exact.items() if p * n >= 5]
    small = [c for c, p in exact.items() if 0 < p * n < 5]  # pooled into one cell
    observed = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in small)]
    expected = [exact[c] * n for c in big] + [sum(exact[c] for c in small) * n]
    if not small:
        observed, expected = observed[:-1], expected[:-1]
    expected = [e * sum(observed) / sum(expected) for e in expected]  # fp rounding of the total
    return chisquare(observed, expected).pvalue


class TargetNoiseDrafter:
    """Drafts with the target itself and the coming verify's noise: draft k is gumbel_argmax of the
    target's logits after the anchor and drafts 1..k-1, in verify row k - 1. Each draft is then the
    target's own sample (up to float rounding between a full forward and the cached verify), so
    all are accepted when the generator passes the right noise keys, and the output must still
    follow the target's law although every draft depends on the noise that samples it."""

    layer_ids: tuple[int, ...] = ()
    max_block_size = None

    def __init__(self, target, prompts: list[list[int]]):
        self.target = target
        self.seqs = {r: list(p) for r, p in enumerate(prompts)}  # tokens the target has committed
        self.drafts: dict[int, list[int]] = {}
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}  # requests share most prefixes

    def _last_logits(self, seq: list[int]) -> torch.Tensor:
        if tuple(seq) not in self._logits:
            self._logits[tuple(seq)] = self.target.model(torch.tensor([seq])).logits[0, -1:]
        return self._logits[tuple(seq)]

    def start(self, taps, capacities) -> None:
        pass

    @torch.no_grad()
    def propose(self, reqs, anchors, starts, block_size, sampling: DraftSampling | None = None):
        out = torch.zeros(len(reqs), block_size - 1, dtype=torch.int64)
        for b, r in enumerate(reqs):
            seq = self.seqs[r][:int(starts[b])] + [int(anchors[b])]
            self.seqs[r], drafts = seq, []
            for k in range(1, block_size):
                logits = self._last_logits(seq + drafts)
                drafts.append(int(gumbel_argmax(logits / sampling.temperature, None, sampling.seed,
                                                sampling.offsets[b:b + 1], torch.tensor([k - 1]))))
            self.drafts[r] = drafts
            out[b] = torch.tensor(drafts)
        return out

    def commit(self, reqs, counts, taps) -> None:
        for r, n in zip(reqs, counts, strict=True):
            self.seqs[r] = self.seqs[r] + self.drafts[r][:n - 1]

    def append_pending(self) -> None:
        pass

    def finish(self, req: int) -> None:
        pass


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", vocab=VOCAB, seed=5, scale=0.4)


@pytest.mark.parametrize("drafter_kind,block_size,params", [
    ("copy", 3, SamplingParams(temperature=1.0, seed=11, max_new_tokens=N_TOKENS, stop_token_ids=())),
    ("copy", 2, SamplingParams(temperature=0.7, top_k=5, top_p=0.85, seed=12, max_new_tokens=N_TOKENS,
                               stop_token_ids=())),
    ("dflash", 4, SamplingParams(temperature=1.3, top_k=0, top_p=0.9, seed=13, max_new_tokens=N_TOKENS,
                                 stop_token_ids=())),
    ("target-noise", 3, SamplingParams(temperature=1.0, seed=14, max_new_tokens=N_TOKENS, stop_token_ids=())),
    ("dflash-tree", 4, SamplingParams(temperature=0.9, top_k=6, seed=15, max_new_tokens=N_TOKENS,
                                      stop_token_ids=())),
])
def test_sampled_first_tokens_follow_the_target(target, drafter_kind, block_size, params):
    if drafter_kind == "copy":  # proposes the target's greedy continuation: often accepted
        greedy = hf_greedy(target, PROMPT, N_TOKENS + block_size, None)
        drafter = OracleDrafter([PROMPT + greedy] * N_SAMPLES, VOCAB)
    elif drafter_kind.startswith("dflash"):
        drafter = DFlashDrafter(random_draft(target, block_size=4), target)
    else:
        drafter = TargetNoiseDrafter(target, [PROMPT] * N_SAMPLES)
    tree = dict(tree_budget=8, tree_topk=4) if drafter_kind == "dflash-tree" else {}  # VOCAB 12: wide trees
    results = Generator(target, drafter, block_size, **tree).generate([PROMPT] * N_SAMPLES, params)
    samples = [tuple(r.output_ids) for r in results]
    accepted = sum(sum(n * c for n, c in enumerate(r.stats.accept_hist)) for r in results)
    if drafter_kind == "copy":
        assert accepted > N_SAMPLES // 2  # the speculative accept path carried many tokens
    if drafter_kind == "target-noise":  # one step per request after the first token, 2 drafts each
        assert accepted >= 0.98 * 2 * N_SAMPLES
    pvalue = chi_square_pvalue(samples, exact_joint(target, params))
    assert pvalue > 1e-3, pvalue


def test_wrong_acceptance_rule_is_detected(target):
    """Sanity check of the test's power: committing every draft (no verification) fails it."""
    params = SamplingParams(temperature=1.0, seed=11, max_new_tokens=N_TOKENS, stop_token_ids=())
    greedy = hf_greedy(target, PROMPT, N_TOKENS, None)
    results = Generator(target, OracleDrafter([PROMPT + greedy] * N_SAMPLES, VOCAB), 1).generate(
        [PROMPT] * N_SAMPLES, params)
    biased = [tuple([r.output_ids[0]] + greedy[1:N_TOKENS]) for r in results]
    assert chi_square_pvalue(biased, exact_joint(target, params)) < 1e-6


def test_same_seed_same_samples_and_requests_independent(target):
    params = SamplingParams(temperature=1.0, seed=21, max_new_tokens=6, stop_token_ids=())
    gen = Generator(target, OracleDrafter([PROMPT + [0] * 16] * 8, VOCAB), 3)
    first = [r.output_ids for r in gen.generate([PROMPT] * 8, params)]
    again = [r.output_ids for r in gen.generate([PROMPT] * 8, params)]
    assert first == again
    assert len({tuple(o) for o in first}) > 1  # same prompt, different requests: fresh noise
    other = [r.output_ids for r in gen.generate([PROMPT] * 8, SamplingParams(
        temperature=1.0, seed=22, max_new_tokens=6, stop_token_ids=()))]
    assert other != first


@pytest.mark.parametrize("drafter_kind", ["copy", "dflash"])
def test_seeded_speculative_output_equals_seeded_plain_output(target, drafter_kind):
    """Every sample is keyed by the position it fills, so at one seed the tokens are those of plain
    sampling, at any block size, fixed or adaptive, accepted drafts or not (greedy-style equality,
    far stronger than the law above; ties in the noisy scores aside, which fp32 makes negligible)."""
    prompts = [PROMPT, [7, 1, 2, 2, 8], [4]]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=31, max_new_tokens=24, stop_token_ids=())
    plain = [r.output_ids for r in Generator(target, OracleDrafter([], VOCAB), 1).generate(prompts, params)]
    if drafter_kind == "copy":  # the plain output itself, 30% corrupted: long and short acceptances
        drafter = OracleDrafter([p + o for p, o in zip(prompts, plain, strict=True)], VOCAB, corrupt=0.3)
    else:
        drafter = DFlashDrafter(random_draft(target, block_size=8), target)
    for block_size, adaptive in ((2, False), (5, False), (8, True)):
        spec = Generator(target, drafter, block_size, adaptive=adaptive).generate(prompts, params)
        assert [r.output_ids for r in spec] == plain, (block_size, adaptive)


def test_seeded_request_samples_the_same_alone_and_in_any_batch(target):
    """A request's noise is keyed by its seed, prompt and output position, not by its row in the
    batch: each prompt alone gives the tokens it gives in a batch (in another order, beside copies
    of itself), plain or speculative. Copies of one prompt are independent samples, the first copy
    being the one the prompt alone gives; explicit per-request seeds replace that rule."""
    prompts = [[7, 1, 2, 2, 8], PROMPT, [4], PROMPT]
    params = SamplingParams(temperature=1.0, seed=41, max_new_tokens=16, stop_token_ids=())
    plain_gen = Generator(target, OracleDrafter([], VOCAB), 1)
    spec_gen = Generator(target, DFlashDrafter(random_draft(target, block_size=8), target), 5)
    for gen in (plain_gen, spec_gen):
        batched = [r.output_ids for r in gen.generate(prompts, params)]
        alone = [gen.generate([p], params)[0].output_ids for p in prompts[:3]]
        assert batched[:3] == alone
        assert batched[3] != batched[1]  # the second copy of PROMPT is a fresh sample
        reordered = [r.output_ids for r in gen.generate(prompts[2::-1], params)]
        assert reordered == alone[::-1]
        same = [r.output_ids for r in gen.generate([PROMPT, PROMPT], params, seeds=[9, 9])]
        assert same[0] == same[1] != batched[1]
    with pytest.raises(ValueError, match="seeds has 1 entries for 2 prompts"):
        plain_gen.generate([PROMPT, PROMPT], params, seeds=[1])
