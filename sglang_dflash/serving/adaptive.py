"""Adaptive block size in the served DFLASH worker: each decode step picks its block size.

The choice is the one the engine makes too (`control.block_size.BlockSizeController`): per batch
size, the block size b (1 = a plain target step) with the most expected tokens per second, from
live per-position acceptance and measured step times; with draft trees on (trees.py), chain or
tree as `control.chain_or_tree.ChainOrTreeController` chooses (a tree of n nodes runs at block
size n + 1). This module only makes SGLang's worker run a step at a size other than the one it was
built for.

`DFlashWorkerV2` sizes its draft-block buffers, block position offsets, the draft forward's spec
info and its accept buffers by `block_size` once; every step then reads them through `self`.
`BlockSizeStates` keeps one such set per block size and swaps the step's set in (a few attribute
assignments). The scheduler reads the step's block size from the result
(`speculative_num_draft_tokens`), and KV slots are reserved for the largest size, so smaller
blocks need nothing else. The output never depends on the block size: every step is a lossless
verify.

Used only where nothing in SGLang bakes the block size in: on CPU (on GPUs the CUDA graphs are
captured per size), without overlap scheduling, no selector / LiLiCorr / Domino / convolution drafters, no compact draft
window cache (`adaptive_problem` says which applies).
"""

from __future__ import annotations

import collections
import logging
import math
import time
import types
import weakref

import torch

from sglang_dflash import settings
from sglang_dflash.control.block_size import FIRST_STEP, BlockSizeController, next_state
from sglang_dflash.control.chain_or_tree import ChainOrTreeController, tree_budgets_up_to

logger = logging.getLogger(__name__)

META_INFO_KEY = "dflash_block_size"  # meta_info: per output token, the block size of its step

# DFlashWorkerV2 attributes that depend on the block size (sglang 0.5.23, dflash_worker_v2.py).
PER_BLOCK_SIZE_STATE = (
    "block_size",
    "speculative_num_draft_tokens",
    "_block_pos_offsets",
    "_draft_block_spec_info",
    "_draft_block_ids_buf",
    "_draft_block_positions_buf",
    "_draft_block_tokens_buf",
    "_draft_verify_out_cache_loc_buf",
    "_draft_block_end_buf",
    "_draft_seq_lens_cpu_buf",
    "_accept_bonus_buffer_cap",
    "_accept_len_buf",
    "_commit_lens_bufs",
    "_bonus_id_bufs",
    "_out_tokens_bufs",
    "_new_seq_lens_bufs",
)


def adaptive_wanted() -> bool:
    """On unless `SGLANG_DFLASH_ADAPTIVE=0` pins the block size (`adaptive_problem` still has the
    last word)."""
    return settings.get(settings.ADAPTIVE)


def adaptive_problem(worker) -> str | None:
    """Why this worker cannot change its block size per step (None: it can)."""
    missing = [name for name in PER_BLOCK_SIZE_STATE if not hasattr(worker, name)]
    if missing:
        return f"this SGLang's DFLASH worker lacks {missing}"
    if torch.device(worker.device).type != "cpu":
        return "on GPUs the draft and verify CUDA graphs are captured for one block size"
    if worker._tp_size() > 1:
        # Every rank must run the same block size, and each would choose from its own step times.
        return "tensor parallelism (the ranks would choose their block sizes apart)"
    if not _overlap_disabled():
        return "overlap scheduling prepares the next step before this one's block size is known"
    for name in ("selector", "lilicorr"):
        if getattr(worker, name, None) is not None:
            return f"the drafter has a {name}"
    if getattr(worker, "_is_domino", False):
        return "Domino drafters roll out a fixed block"
    if getattr(worker, "use_compact_draft_cache", False):
        return "the compact draft window cache is sized per block"
    for layer in getattr(worker.draft_model, "layers", ()):
        if getattr(layer, "attention_conv", None) is not None or getattr(layer, "mlp_conv", None) is not None:
            return "the drafter's convolutions are built for one block size"
    return None


def _overlap_disabled() -> bool:
    from sglang.srt.runtime_context import get_schedule

    return bool(get_schedule().disable_overlap_schedule)


class BlockSizeStates:
    """One set of the worker's block-size-dependent attributes per block size."""

    def __init__(self, worker):
        self._worker = worker
        self._saved: dict[int, dict] = {}

    def use(self, block_size: int) -> None:
        """Make `block_size` the worker's current block size."""
        worker = self._worker
        current = int(worker.block_size)
        if block_size == current:
            return
        self._saved[current] = {name: getattr(worker, name) for name in PER_BLOCK_SIZE_STATE}
        state = self._saved.get(block_size) or self._fresh(block_size)
        for name, value in state.items():
            setattr(worker, name, value)

    def _fresh(self, block_size: int) -> dict:
        from sglang.srt.speculative.draft_worker_common import build_block_pos_offsets, make_draft_block_spec_info

        device = self._worker.device
        state = dict.fromkeys(PER_BLOCK_SIZE_STATE)  # buffers: allocated by the worker on first use
        state.update(
            block_size=block_size,
            speculative_num_draft_tokens=block_size,
            _block_pos_offsets=build_block_pos_offsets(length=block_size, device=device),
            _draft_block_spec_info=make_draft_block_spec_info(draft_token_num=block_size, device=device),
            _accept_bonus_buffer_cap=0,
            _commit_lens_bufs=[],
            _bonus_id_bufs=[],
            _out_tokens_bufs=[],
            _new_seq_lens_bufs=[],
        )
        return state


def skip_draft_forward_at_block_size_one(worker) -> None:
    """A step of block size 1 drafts nothing (the block is the anchor alone): its draft forward,
    whose only output would be the block's hidden states, is replaced by an empty result of that
    shape. The draft pool needs nothing from it either: the anchor's context K/V are written after
    the verify, as for every committed token."""
    runner = worker.draft_model_runner
    original = runner.forward

    def forward(forward_batch, *args, **kwargs):
        if int(worker.block_size) == 1 and forward_batch.forward_mode.is_target_verify():
            hidden = torch.empty((int(forward_batch.batch_size), int(worker.draft_model.config.hidden_size)),
                                 dtype=runner.dtype, device=forward_batch.input_ids.device)
            return types.SimpleNamespace(logits_output=types.SimpleNamespace(hidden_states=hidden),
                                         can_run_graph=False)
        return original(forward_batch, *args, **kwargs)

    runner.forward = forward


class AdaptiveBlockSize:
    """Chooses each decode step's block size (and, with `tree_budget`, chain or draft tree:
    trees.py), runs the step at it, and learns from the result."""

    def __init__(self, worker, max_block_size: int, tree_budget: int = 0, log_every_s: float = 30.0):
        budgets = tree_budgets_up_to(tree_budget) if tree_budget else []
        self.controller = ChainOrTreeController(BlockSizeController(max_block_size), budgets)
        self.states = BlockSizeStates(worker)
        skip_draft_forward_at_block_size_one(worker)
        self.log_every_s = log_every_s
        # (batch size, block size, tree nodes) -> [steps, seconds] since the last log line
        self._chosen: dict[tuple[int, int, int], list] = collections.defaultdict(lambda: [0, 0.0])
        self._last_log = -math.inf
        # Each request's acceptance state (block_size.next_state), dropped with the request.
        self._request_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def run_step(self, reqs: list, step, trees=None):
        """`step()` runs one decode step of `reqs` at the chosen block size; returns its result.
        `trees`: the worker's ServedTrees where this step may be a tree, else None (a chain)."""
        batch_size = len(reqs)
        acceptance_states = [self._request_states.get(req, FIRST_STEP) for req in reqs]
        if trees is not None:
            block_size, budget = self.controller.choose(batch_size, acceptance_states)
        else:
            block_size, budget = self.controller.chains.choose(batch_size, acceptance_states), 0
        rows = budget + 1 if budget else block_size
        self.states.use(rows)
        if budget:
            trees.begin(budget)
        start = time.perf_counter()
        result = step()
        seconds = time.perf_counter() - start
        commits = result.accept_lens.to("cpu", torch.int64).tolist()
        accepted = [n - 1 for n in commits]
        if trees is not None:
            chains = trees.chains_in_trees(accepted) if budget else None
            self.controller.observe(block_size, budget, accepted, seconds, *(chains or (None, None)), acceptance_states)
        else:
            self.controller.chains.observe(block_size, accepted, seconds, acceptance_states)
        for req, state, a in zip(reqs, acceptance_states, accepted, strict=True):
            self._request_states[req] = next_state(state, block_size, a, budget)
        self._report(reqs, commits, rows, budget, seconds)
        return result

    def _report(self, reqs: list, commits: list[int], block_size: int, tree_nodes: int, seconds: float) -> None:
        for req, n in zip(reqs, commits, strict=True):
            # One entry per output token, as SGLang slices customized_info by token (streaming too):
            # 0 for tokens that came from the prefill, else the block size of the step that
            # committed it. The tokens of this step are not in req.output_ids yet.
            info = req.customized_info if req.customized_info is not None else {}
            info.setdefault(META_INFO_KEY, [0] * len(req.output_ids)).extend([block_size] * n)
            req.customized_info = info
        played = self._chosen[len(reqs), block_size, tree_nodes]
        played[0] += 1
        played[1] += seconds
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s:
            self._last_log = now
            # The mean time of each choice's steps: what the controller weighs, as the server saw it.
            chosen = ", ".join(f"batch {bs}: {f'tree of {t}' if t else f'B={b}'} x{n} {1e3 * sec / n:.1f} ms"
                               for (bs, b, t), (n, sec) in sorted(self._chosen.items()))
            chains = self.controller.chains
            expected = " ".join(f"{e:.2f}" for e in chains.expected_tokens())
            logger.info("sglang-dflash: adaptive block size, steps since the last report: %s (expected tokens "
                        "per step at B=1..%d: %s)", chosen, chains.max_block_size, expected)
            self._chosen.clear()
