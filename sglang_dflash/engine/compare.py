"""Speculative against plain decoding of the same prompts in the same engine, side by side: the
numbers the demo prints and the end-to-end benchmark records.

Each prompt runs alone (batch size 1): plain decoding once and speculative decoding at every
block size (fixed, adaptive up to a maximum, and trees of given budgets), all in lock-step: each
configuration has its own target and drafter, and they take one step each in turns (which goes
first rotates from prompt to prompt), every run timed by its own steps only. So a slow spell of
the machine falls on all of them alike: a small shared machine's speed drifts for seconds to
minutes, and configurations run one after the other would be timed on different machines, in
effect, enough to reorder block sizes whose step times differ by a few milliseconds.
Speed is decode tokens per second (prefill excluded: it is the same work in both).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from sglang_dflash.control.tree import DEFAULT_TREE_MIN_PROB
from sglang_dflash.engine.drafters import NoDrafter
from sglang_dflash.engine.generator import GenerationResult, Generator, SamplingParams
from sglang_dflash.engine.target import HFTarget


def decode_seconds(results: list[GenerationResult]) -> float:
    """Wall time after prefill, summed over the results."""
    return sum(r.stats.wall_s - r.stats.prefill_s for r in results)


def decode_rate(results: list[GenerationResult]) -> float:
    """Decode tokens per second: tokens after the prefill token over the time after prefill."""
    tokens = sum(len(r.output_ids) - 1 for r in results)
    return tokens / max(decode_seconds(results), 1e-9)


@dataclasses.dataclass
class Comparison:
    block_size: int  # the block size, or the largest one when adaptive
    params: SamplingParams
    spec: list[GenerationResult]
    plain: list[GenerationResult]
    adaptive: bool = False
    tree_budget: int = 0  # > 0: trees of up to this many drafted nodes, at most block_size - 1 deep
    tree_topk: int = 0
    tree_min_prob: float = 0.0  # the trees' least path probability (control/tree.py)

    def summary(self) -> dict:
        """tau (token-weighted: committed tokens over verify steps; and the mean over prompts),
        speedup of decode tokens/s, the mean time of a speculative step (and its drafting part)
        and of a plain step (speedup = tau * plain step / spec step), the accepted-drafts
        histogram, the mean block size verified, each prompt's decode tokens and seconds, and
        whether every speculative output equals the plain one (expected at every temperature:
        both sample each position with the same noise)."""
        tokens = sum(r.stats.tokens - 1 for r in self.spec)
        steps = sum(r.stats.steps for r in self.spec)
        spec_rate, plain_rate = decode_rate(self.spec), decode_rate(self.plain)
        return dict(
            block_size=self.block_size, adaptive=self.adaptive, temperature=self.params.temperature,
            tree_budget=self.tree_budget, tree_topk=self.tree_topk, tree_min_prob=self.tree_min_prob,
            samples=len(self.spec),
            mean_block_size=sum(r.stats.verified_tokens for r in self.spec) / max(steps, 1),
            tau_token_weighted=tokens / max(steps, 1),
            tau_per_sample_mean=sum(r.stats.tau for r in self.spec) / max(len(self.spec), 1),
            speedup=spec_rate / plain_rate, spec_tok_s=spec_rate, plain_tok_s=plain_rate,
            spec_step_ms=1e3 * decode_seconds(self.spec) / max(steps, 1),
            draft_ms_per_step=1e3 * sum(r.stats.draft_s for r in self.spec) / max(steps, 1),
            plain_step_ms=1e3 * decode_seconds(self.plain) / max(sum(r.stats.steps for r in self.plain), 1),
            accept_histogram=[sum(r.stats.accept_hist[k] for r in self.spec) for k in range(self.block_size)],
            # Per prompt: [decode tokens, decode seconds] of each run, for intervals over prompts.
            per_prompt={name: [[len(r.output_ids) - 1, r.stats.wall_s - r.stats.prefill_s] for r in results]
                        for name, results in (("spec", self.spec), ("plain", self.plain))},
            identical_to_plain=all(a.output_ids == b.output_ids for a, b in zip(self.spec, self.plain, strict=True)))


def compare(new_target: Callable[[], HFTarget], new_drafter: Callable[[HFTarget], object], prompts: list,
            block_sizes: list[int], params: SamplingParams, chat: bool = True, progress=None,
            adaptive_block_sizes: list[int] = (), tree_budgets: list[int] = (), tree_topk: int = 4,
            adaptive_tree_budgets: list[int] = (),
            tree_min_probs: list[float] = (DEFAULT_TREE_MIN_PROB,)) -> list[Comparison]:
    """Plain and speculative decoding of every prompt; one Comparison per fixed block size, then
    one per adaptive maximum (each adaptive generator carries what it learns from prompt to
    prompt, as a server would), then one per tree budget and least path probability (trees of
    `tree_topk` choices a position, as deep as the drafter's block allows), then one per adaptive
    tree budget (each step a chain of up to the drafter's block or a tree of up to that many nodes:
    ChainOrTreeController; with the first of `tree_min_probs`).
    `new_target()` makes a target and `new_drafter(target)` a drafter for it, one of each per
    configuration (each run keeps its requests' state in them); all must compute alike.
    `progress` (optional) is called once per prompt."""
    plain_gen = Generator(new_target(), NoDrafter(), 1)
    least = tree_min_probs[0]
    configs = ([(b, False, 0, 0.0) for b in block_sizes] + [(b, True, 0, 0.0) for b in adaptive_block_sizes]
               + [(None, False, n, p) for n in tree_budgets for p in tree_min_probs]
               + [(None, True, n, least) for n in adaptive_tree_budgets])
    generators = []
    for b, adaptive, n, p in configs:
        target = new_target()
        drafter = new_drafter(target)
        generators.append(Generator(target, drafter, b or drafter.max_block_size, adaptive=adaptive,
                                    tree_budget=n, tree_topk=tree_topk, tree_min_prob=p))
    plain: list[GenerationResult] = []
    spec: list[list[GenerationResult]] = [[] for _ in configs]
    runs = [(plain, plain_gen)] + list(zip(spec, generators, strict=True))
    for i, prompt in enumerate(prompts):
        # Each prompt starts with the next run in turn, so no configuration always steps first.
        order = runs[i % len(runs):] + runs[:i % len(runs)]
        started = [(results, generator.start([prompt], params, chat=chat)) for results, generator in order]
        pending = [run for _, run in started]
        while pending:
            pending = [run for run in pending if run.step()]
        for results, run in started:
            results += run.results
        if progress:
            progress()
    return [Comparison(g.block_size, params, results, plain, adaptive=a, tree_budget=n,
                       tree_topk=tree_topk if n else 0, tree_min_prob=p)
            for g, (_, a, n, p), results in zip(generators, configs, spec, strict=True)]
