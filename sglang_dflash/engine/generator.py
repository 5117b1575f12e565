"""Batched, lossless DFlash speculative generation on a Hugging Face target (docs/design.md §1).

Each step: the drafter proposes B-1 tokens after every request's anchor (its last committed
token); the target verifies the B-token block; `verify_block` samples the target's token for every
row (argmax at temperature 0, else the Gumbel-max sample) and accepts the longest matching draft
prefix plus one bonus token. At temperature > 0 the drafter gets the noise keys of the coming
verify (`DraftSampling`), so it can draft with the noise the target will sample with. Requests
finish independently (stop token or max_new_tokens). With `adaptive=True`, B is a maximum and each
step's block size is chosen by a `BlockSizeController` (control/block_size.py). With a
`tree_budget`, each step verifies a tree of drafts instead of a chain (control/tree.py): the
drafter's `tree_topk` best tokens at each of the first min(B - 1, tree_budget) positions (a tree
of n nodes is at most n deep, so it drafts a block of at most n + 1, as the served worker does),
grown best first to `tree_budget` nodes or, greedy, to the first less likely than
`tree_min_prob` (the served worker's trees always fill their budget: SGLang's step buffers hold a
block of budget + 1), all checked in one target pass by `verify_tree`, which commits the longest
path the target agrees with. With both, each step is a chain of the chosen size or a tree of
budget tree_budget, / 2 or / 4, whichever is expected to commit the most tokens per second
(`ChainOrTreeController`, control/chain_or_tree.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from sglang_dflash.control.block_size import FIRST_STEP, BlockSizeController, next_state
from sglang_dflash.control.chain_or_tree import ChainOrTreeController, tree_budgets_up_to
from sglang_dflash.control.tree import (
    DEFAULT_TREE_MIN_PROB,
    DEFAULT_TREE_TOPK,
    build_trees,
    chain_accept_lens,
    chain_depths,
    check_tree_options,
    path_rows,
)
from sglang_dflash.engine import controller_state
from sglang_dflash.engine.drafters import DraftSampling
from sglang_dflash.engine.target import HFTarget
from sglang_dflash.ops import check_device_errors, verify_block, verify_tree


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0  # >= 1: off
    seed: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] | None = None  # None: the target's EOS ids

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be finite and >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:  # also refuses NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass
class RequestStats:
    block_size: int
    steps: int = 0
    accept_hist: list[int] = dataclasses.field(default_factory=list)  # [B]: steps with n accepted drafts
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    tokens: int = 0
    verified_tokens: int = 0  # block tokens the target verified, summed over steps

    @property
    def tau(self) -> float:
        """Mean tokens committed per target verify pass, bonus included (prefill token excluded)."""
        return (self.tokens - 1) / self.steps if self.steps else 0.0

    @property
    def mean_block_size(self) -> float:
        return self.verified_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(tau=self.tau, tokens_per_s=self.tokens_per_s, mean_block_size=self.mean_block_size)
        return d


@dataclasses.dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]  # first (prefill) token, then every step's commits, stop token included
    steps: list[list[int]]  # tokens committed by each verify step, bonus included
    stats: RequestStats
    text: str | None = None
    # With an adaptive block size, one entry per verify step: the block size and why the controller
    # chose it (its expected tokens and step times per size, control/block_size.py); for a drafting
    # chain step also the positions drafted and the rows verified (verify_length).
    decisions: list[dict] = dataclasses.field(default_factory=list)
    # With a tree budget, one entry per verify step: the tree's nodes and the accepted path (node
    # indices, root first).
    trees: list[dict] = dataclasses.field(default_factory=list)


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of a text prompt, through the tokenizer's chat template when it has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # BatchEncoding in transformers 5
    return tokenizer.encode(prompt)


def request_keys(prompts: list[list[int]], seed: int, seeds: list[int] | None = None) -> list[int]:
    """Each request's 31-bit noise key: a hash of its seed (`seeds[i]`, else the run's `seed`), its
    prompt ids and, without `seeds`, how many identical prompts come before it in the call. So a
    seeded request samples the same tokens alone or in any batch, and copies of one prompt in one
    call are independent samples (the first copy is the one a call with that prompt alone makes)."""
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"seeds has {len(seeds)} entries for {len(prompts)} prompts")
    seen: dict[tuple[int, ...], int] = {}
    keys = []
    for i, prompt in enumerate(prompts):
        copy = 0 if seeds is not None else seen.get(tuple(prompt), 0)
        seen[tuple(prompt)] = copy + 1
        h = hashlib.blake2b(digest_size=4)
        for value in (seed if seeds is None else seeds[i], copy, *prompt):
            h.update(int(value).to_bytes(8, "little", signed=True))
        keys.append(int.from_bytes(h.digest(), "little") >> 1)
    return keys


class RunClock:
    """Seconds a run has been running, not counting the time it spent paused (while other runs
    took their turns)."""

    def __init__(self):
        self._spent, self._since = 0.0, time.perf_counter()

    def seconds(self) -> float:
        return self._spent + time.perf_counter() - self._since

    @contextlib.contextmanager
    def paused(self):
        self._spent = self.seconds()
        try:
            yield
        finally:
            self._since = time.perf_counter()


class GenerationRun:
    """A `Generator.start` call: `step()` runs the prefill on its first call, then one verify step
    per call, and returns False once every request has finished. Times in `results` count only this
    run's own steps, so runs stepped in turns are each timed as if alone."""

    def __init__(self, steps: Iterator[None], results: list[GenerationResult], tokenizer):
        self._steps, self.results, self._tokenizer = steps, results, tokenizer
        self.done = False

    def step(self) -> bool:
        if not self.done and next(self._steps, StopIteration) is StopIteration:
            self.done = True
            if self._tokenizer is not None:
                for r in self.results:
                    r.text = self._tokenizer.decode(r.output_ids, skip_special_tokens=True)
        return not self.done


class Generator:
    """`block_size`: the block of every step, or with `adaptive` the largest one a step may use.
    An adaptive generator keeps what it learned about step times and acceptance across calls.
    `tree_budget` > 0: verify trees of up to that many drafted nodes, `tree_topk` choices per
    position, at most block_size - 1 deep, greedy ones without the nodes of a path probability
    below `tree_min_prob` (control/tree.py), instead of chains; with `adaptive`, such trees of at
    most that many nodes or chains, step by step. `adaptive_state_dir`: an adaptive generator
    starts from what the last one of the same configuration learned, saved there after each
    `generate` (engine/controller_state.py; the CLI's default: the package cache), instead of
    from nothing."""

    def __init__(self, target: HFTarget, drafter, block_size: int, adaptive: bool = False, tree_budget: int = 0,
                 tree_topk: int = DEFAULT_TREE_TOPK, tree_min_prob: float = DEFAULT_TREE_MIN_PROB,
                 adaptive_state_dir: str | Path | None = None):
        max_b = getattr(drafter, "max_block_size", None)
        if block_size < 1 or (max_b is not None and block_size > max_b):
            raise ValueError(f"block_size must be in [1, {max_b or 'inf'}] for this drafter, got {block_size}")
        if tree_budget:
            if not hasattr(drafter, "propose_candidates"):
                raise ValueError("a tree budget needs a DFlash drafter (this drafter proposes no candidates)")
            if block_size < 2:
                raise ValueError(f"a tree needs block_size >= 2 (its depth is block_size - 1), got {block_size}")
            check_tree_options(tree_budget, tree_topk, tree_min_prob, vocab_size=drafter.vocab_size)
        self.target, self.drafter, self.block_size = target, drafter, block_size
        self.tree_budget, self.tree_topk, self.tree_min_prob = tree_budget, tree_topk, tree_min_prob
        self.controller = None
        self._state_file = None  # (path, configuration) of the adaptive state kept between processes
        if adaptive:
            if adaptive_state_dir is not None:
                config = controller_state.configuration(target, drafter, block_size, tree_budget, tree_topk,
                                                        tree_min_prob)
                self._state_file = (controller_state.state_path(config, adaptive_state_dir), config)
                self.controller = controller_state.load(*self._state_file)
            if self.controller is None:
                budgets = tree_budgets_up_to(tree_budget) if tree_budget else []
                self.controller = ChainOrTreeController(BlockSizeController(block_size), budgets)

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams = SamplingParams(),
                 chat: bool = True, seeds: list[int] | None = None) -> list[GenerationResult]:
        """`seeds` (optional): one seed per request instead of `params.seed` (see request_keys)."""
        run = self.start(prompts, params, chat, seeds)
        while run.step():
            pass
        if self._state_file is not None:
            controller_state.save(self._state_file[0], self._state_file[1], self.controller)
        return run.results

    def start(self, prompts: list[str] | list[list[int]], params: SamplingParams = SamplingParams(),
              chat: bool = True, seeds: list[int] | None = None) -> GenerationRun:
        """`generate`, one step at a time: the returned run does nothing until stepped (the prefill
        is its first step, then one verify step per call). Several runs on separate targets can
        so advance in turns, which `compare` does to time them side by side."""
        tok = self.target.tokenizer
        if not prompts:
            raise ValueError("prompts is empty")
        if tok is None and any(isinstance(p, str) for p in prompts):
            raise ValueError("the target has no tokenizer: pass prompts as token ids")
        ids = [encode_prompt(tok, p, chat) if isinstance(p, str) else list(p) for p in prompts]
        vocab = self.target.vocab_size
        for i, p in enumerate(ids):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside the target vocabulary [0, {vocab})")
        B = self.block_size
        results = [GenerationResult(p, [], [], RequestStats(B, accept_hist=[0] * B)) for p in ids]
        return GenerationRun(self._steps(ids, params, request_keys(ids, params.seed, seeds), results), results, tok)

    @torch.no_grad()  # entered around every step of the generator
    def _steps(self, prompts: list[list[int]], params: SamplingParams, keys: list[int],
               results: list[GenerationResult]) -> Iterator[None]:
        """Fills `results`, yielding after the prefill and after every verify step."""
        target, drafter, B = self.target, self.drafter, self.block_size
        target.set_taps(drafter.layer_ids)
        dev = target.device
        n = len(prompts)
        stop = set(target.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids)
        # Verify row i draws the noise keyed (seed, offset + i). offset = the request's key << 32 | the
        # output position row 0 fills: every sample is keyed by its request and position, so the
        # tokens depend neither on the block sizes nor on the batch (seeded speculative output =
        # seeded plain output, alone or batched).
        def next_offsets(reqs):
            return torch.tensor([(keys[r] << 32) | len(results[r].output_ids) for r in reqs], dtype=torch.int64,
                                device=dev)

        def sampling_args(bs):
            return (torch.full((bs,), params.temperature, dtype=torch.float32, device=dev),
                    torch.full((bs,), params.top_k, dtype=torch.int32, device=dev),
                    torch.full((bs,), params.top_p, dtype=torch.float32, device=dev), params.seed)

        def sample(candidates, logits, reqs, offsets):
            return verify_block(candidates, logits, *sampling_args(len(reqs)), offsets)

        clock = RunClock()
        last_logits, taps = target.prefill(prompts)
        last = torch.tensor([p[-1] for p in prompts], device=dev)[:, None]
        _, first, _ = sample(last, last_logits, list(range(n)), next_offsets(range(n)))
        drafter.start(taps, [len(p) + params.max_new_tokens + B for p in prompts])
        active = []
        for r, tok in enumerate(first.tolist()):
            results[r].output_ids.append(tok)
            results[r].stats.prefill_s = clock.seconds()
            if tok in stop or params.max_new_tokens == 1:
                self._finish(r, results[r], clock)
            else:
                active.append(r)
        if active and len(active) < n:
            target.select(torch.tensor(active, device=dev))
        # Tokens the target has processed per request; the next block's anchor sits there.
        starts = {r: len(prompts[r]) for r in active}
        states = dict.fromkeys(active, FIRST_STEP)  # acceptance states, for the adaptive controller
        with clock.paused():
            yield

        while active:
            anchors = torch.tensor([results[r].output_ids[-1] for r in active], device=dev)
            start_t = torch.tensor([starts[r] for r in active], device=dev)
            offsets = next_offsets(active)
            t0 = time.perf_counter()
            block, tree_budget = B, self.tree_budget
            step_states = [states[r] for r in active]
            if self.controller is not None:
                block, tree_budget = self.controller.choose(len(active), step_states)
                decision = self.controller.last_decision
            deferred_s = 0.0
            if block > 1 or tree_budget:
                # The context appends the drafter deferred through plain steps: their cost belongs
                # to those steps' tokens, not to this block size (else plain steps look cheaper
                # than they are and every draft step after them dearer).
                t_append = time.perf_counter()
                drafter.append_pending()
                deferred_s = time.perf_counter() - t_append
            sampling = DraftSampling(params.temperature, params.seed, offsets) if params.temperature > 0 else None
            if tree_budget:
                depth = min(B - 1, tree_budget)  # deeper positions cannot hold a node of the tree
                choices = drafter.propose_candidates(active, anchors, start_t, depth, self.tree_topk, sampling)
                trees = build_trees(anchors, *choices, [tree_budget] * len(active),
                                    self.tree_min_prob if sampling is None else 0.0)
                t1 = time.perf_counter()
                logits, step_taps = target.verify_tree(trees.tokens, start_t[:, None] + trees.depths,
                                                       trees.ancestors(), trees.parents)
                accept_len_t, path, out_tokens = verify_tree(trees.tokens, trees.parents, trees.depths, logits,
                                                             *sampling_args(len(active)), offsets)
                rows_verified = trees.tokens.shape[1]
            else:
                candidates, confidences = anchors[:, None], None
                drafted = block if self.controller is None else self.controller.chains.draft_size(block)
                if self.controller is not None and drafted > 2:
                    # Draft one position more than the chosen block, verify what the drafts'
                    # confidences say pays (control/block_size.py, draft_size and verify_length).
                    drafts, confidence = drafter.propose(active, anchors, start_t, drafted, sampling, confidence=True)
                    confidences = confidence.tolist()
                    block = self.controller.chains.verify_length(len(active), confidences, step_states)
                    decision = dict(decision, drafted=drafted, verified=block)
                    candidates = torch.cat([candidates, drafts[:, :block - 1]], dim=1)
                elif block > 1:
                    candidates = torch.cat([candidates, drafter.propose(active, anchors, start_t, block, sampling)],
                                           dim=1)
                t1 = time.perf_counter()
                logits, step_taps = target.verify(candidates, start_t[:, None] + torch.arange(block, device=dev))
                accept_len_t, _, out_tokens = sample(candidates, logits, active, offsets)
                rows_verified = block
            accept_len, out_tokens = accept_len_t.tolist(), out_tokens.tolist()
            if self.controller is not None:
                for r in active:
                    results[r].decisions.append(decision)
            check_device_errors(dev)  # a bad index a CUDA kernel met this step (the sync is done)

            still, keep_rows = [], []
            for b, r in enumerate(active):
                a = accept_len[b]
                if tree_budget:
                    results[r].trees.append({"nodes": trees.sizes[b], "path": path[b, :a + 1].tolist()})
                results[r].stats.accept_hist[a] += 1
                starts[r] += a + 1
                if self._commit(results[r], out_tokens[b][:a + 1], params.max_new_tokens, stop):
                    still.append(r)
                    keep_rows.append(b)
            if still:
                rows = None if len(still) == len(active) else torch.tensor(keep_rows, device=dev)
                if tree_budget:
                    target.commit_nodes(path, accept_len_t, rows)
                    # The drafter's context continues along the committed path only.
                    nodes = path_rows(path, accept_len_t)
                    step_taps = step_taps.gather(1, nodes[:, :, None].expand(-1, -1, step_taps.shape[2]))
                else:
                    target.commit(torch.tensor([a + 1 for a in accept_len], device=dev), rows)
            t2 = time.perf_counter()
            if still:
                drafter.commit(still, [accept_len[b] + 1 for b in keep_rows],
                               None if step_taps is None else step_taps[keep_rows])
            t3 = time.perf_counter()
            if self.controller is not None:
                chains = depths = None
                if tree_budget:
                    chains, depths = chain_accept_lens(trees, path, accept_len), chain_depths(trees)
                self.controller.observe(block, tree_budget, accept_len, t3 - t0 - deferred_s, chains, depths,
                                        step_states, None if tree_budget else confidences)
                for b, r in enumerate(active):
                    states[r] = next_state(states[r], block, accept_len[b], tree_budget)
            running = set(still)
            for r in active:
                results[r].stats.draft_s += (t1 - t0) + (t3 - t2)
                results[r].stats.verify_s += t2 - t1
                results[r].stats.verified_tokens += rows_verified
                if r not in running:
                    self._finish(r, results[r], clock)
            active = still
            with clock.paused():
                yield

    @staticmethod
    def _commit(res: GenerationResult, tokens: list[int], max_new_tokens: int, stop: set[int]) -> bool:
        """Append one step's tokens, cut at max_new_tokens and after a stop token; True while the
        request goes on."""
        tokens = tokens[:max_new_tokens - len(res.output_ids)]
        for j, tok in enumerate(tokens):
            if tok in stop:
                tokens = tokens[:j + 1]
                break
        res.output_ids.extend(tokens)
        res.steps.append(tokens)
        res.stats.steps += 1
        return tokens[-1] not in stop and len(res.output_ids) < max_new_tokens

    def _finish(self, r: int, res: GenerationResult, clock: RunClock) -> None:
        res.stats.tokens = len(res.output_ids)
        res.stats.wall_s = clock.seconds()
        self.drafter.finish(r)
