"""Draft trees in the served DFLASH worker: a decode step that verifies a tree instead of a chain.

With `SGLANG_DFLASH_TREE_BUDGET=n` a decode step may verify a tree of n drafted nodes
(control/tree.py: the drafter's `SGLANG_DFLASH_TREE_TOPK` best tokens per block position, grown
best first) instead of a chain; unset, trees of up to `control.tree.DEFAULT_TREE_BUDGET` nodes cut to
the block's B - 1 where the block size adapts (on CPU), none where it is pinned; 0 turns them off.
It runs inside SGLang's own chain step at block size n + 1, so SGLang's buffers, KV slot
reservation and commit stay as they are; what changes:

1. the draft head (`draft`, from the worker's `_greedy_sample_from_vocab_parallel_head`) takes the
   top-k per position and builds the trees; the block's tokens become the trees' nodes, their
   positions the request's length + each node's depth (written into the step's position buffer,
   which the verify forward batch reads);
2. the target's TARGET_VERIFY attention runs `block_attention` in tree mode (attention.py reads the
   parents published here): a node sees the context and its ancestors only. On CPU its output is
   bitwise the decode of its path, so greedy output stays the plain server's token for token;
3. `verify_tree` replaces `verify_block` in `_accept_block` (`accept`), and the accepted path's K/V
   move in every target layer from their nodes' slots into the slots of output positions 1..a
   (`move_path_kv`), where SGLang's chain commit expects them; where the step returns logprobs,
   the verify's logits rows move into path order too (`rows_in_path_order`);
4. the drafter's context K/V are written from the target hidden states of the accepted path
   (`path_context`), at its positions.

Every tree step is a lossless verify: greedy output equals plain decoding, seeded sampling equals
seeded plain sampling (verify_tree keys a node's sample by its output position). A step whose
batch needs what a tree does not provide (grammar, sampling masks) runs a chain. With the
adaptive block size on (adaptive.py) each step is a chain or a tree of n, n/2 or n/4 nodes,
whichever `control.chain_or_tree.ChainOrTreeController` expects to commit most per second; without
it every eligible step is a tree of n. CPU only: where the target's attention is not our kernel, a tree
would be verified with a chain's mask, so the worker refuses the setting there (`tree_problem`)
and `accept` checks that every target layer applied the tree.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from sglang_dflash import ops, settings
from sglang_dflash.control.tree import (
    MAX_TREE_BUDGET,
    DraftTrees,
    TreeOptionNames,
    build_trees,
    chain_accept_lens,
    chain_depths,
    check_tree_options,
    default_tree_budget,
)
from sglang_dflash.ops import move_slots, top_k_logprobs
from sglang_dflash.serving import adaptive, attention

logger = logging.getLogger(__name__)

META_INFO_KEY = "dflash_tree_nodes"  # meta_info: per output token, the drafted nodes of its step's tree (0: a chain)
# The server sets the trees through its environment; it has no least path probability (its trees
# fill their budget).
SETTING_NAMES = TreeOptionNames(settings.TREE_BUDGET.name, settings.TREE_TOPK.name, "")


def tree_options(max_block_size: int, vocab_size: int, block_size_adapts: bool = False) -> tuple[int, int] | None:
    """(budget, top-k) from the settings, or None when trees are off. With the budget unset:
    `control.tree.default_tree_budget` where the block size adapts, else off. Bad values raise one
    ValueError naming the variable (`control.tree.check_tree_options`, as the CLI's flags)."""
    budget = settings.get(settings.TREE_BUDGET)
    if budget is None:
        budget = default_tree_budget(max_block_size - 1) if block_size_adapts else 0
    if budget == 0:
        return None
    topk = settings.get(settings.TREE_TOPK)
    check_tree_options(budget, topk, names=SETTING_NAMES, most_nodes=min(MAX_TREE_BUDGET, max_block_size - 1),
                       why_most=f" (a tree and its root fill the request's block of --speculative-num-draft-tokens "
                                f"{max_block_size} rows; 0 turns trees off)", vocab_size=vocab_size)
    return budget, topk


def tree_problem(worker) -> str | None:
    """Why this worker cannot run tree steps (None: it can)."""
    if worker._tp_size() > 1:
        return "tensor parallelism (the tree's draft head and verify run on one rank)"
    problem = adaptive.adaptive_problem(worker)  # a tree step runs at another block size than the worker's
    if problem is not None:
        return problem
    if getattr(worker, "_need_mamba_verify_commit", False):
        return "the target's Mamba state commits a chain"
    backend = type(getattr(worker.target_worker.model_runner, "attn_backend", None)).__name__
    if backend != "TorchNativeAttnBackend":
        return f"the target's attention backend {backend} has no tree mask (CPU's torch_native runs ours)"
    from sglang.srt.layers.radix_attention import RadixAttention

    from sglang_dflash.serving.cpu import hooks_registered  # CPU serving only: GPU processes never import it

    layers = [m for m in worker.target_worker.model_runner.model.modules() if isinstance(m, RadixAttention)]
    if any(attention.layer_window(layer) >= 0 for layer in layers):
        return "the target has sliding-window attention layers (block_attention's tree mode has no window)"
    if not hooks_registered():
        return "the TARGET_VERIFY attention hook is not registered (SGLANG_USE_CPU_ENGINE=1 registers it)"
    return None


def batch_problem(batch) -> str | None:
    """Why this decode batch runs a chain instead of a tree (None: a tree may run)."""
    if getattr(batch, "has_grammar", False):
        return "grammar"
    if getattr(batch.sampling_info, "sampling_mask_batch_indices", None) is not None:
        return "sampling masks"
    return None


def rows_in_path_order(rows: torch.Tensor, path: torch.Tensor) -> None:
    """In place: row b * N + j of `rows` [bs * N, ...] becomes node path[b, j]'s (rows past the
    path: the root's), so that row j holds what a chain's row j would, the target's prediction
    for output position j (SGLang's logprobs read a verify's logits in chain order)."""
    bs, nodes = path.shape
    blocks = rows.unflatten(0, (bs, nodes))
    index = path.clamp(min=0).to(rows.device).view(bs, nodes, *([1] * (blocks.dim() - 2))).expand(blocks.shape)
    blocks.copy_(blocks.gather(1, index))


def move_path_kv(pool, loc: torch.Tensor, path: torch.Tensor, accept_len: torch.Tensor) -> int:
    """Move each request's accepted path into consecutive slots, in every layer of `pool`: the
    K/V of node path[b, j] go from slot loc[b, path[b, j]] to loc[b, j] for j <= accept_len[b].
    loc int [bs, N] (the block's slots), path int64 [bs, N] (verify_tree's: 0, the accepted nodes,
    then -1). One `move_slots` call for every layer's K and V: every source is read before any slot
    is written, so no copy overwrites another's source. Returns the moved rows per layer."""
    cols = torch.arange(path.shape[1], device=path.device)
    moved = (cols[None, :] <= accept_len.to(path.device, torch.int64)[:, None]) & (path != cols[None, :])
    if not bool(moved.any()):
        return 0
    loc = loc.to(torch.int64)
    src = loc.gather(1, path.clamp(min=0))[moved]
    dst = loc[moved]
    layers = range(pool.start_layer, pool.start_layer + pool.layer_num)
    move_slots([buffer for layer_id in layers for buffer in (pool.get_key_buffer(layer_id),
                                                             pool.get_value_buffer(layer_id))], src, dst)
    return int(dst.numel())


class ServedTrees:
    """The tree steps of one DFlashKernelWorker: `begin(n)` before a step makes it a tree of n
    nodes (the worker at block size n + 1), the worker's seams call `draft`, `accept`,
    `path_context`; `finish` ends every step, tree or chain."""

    def __init__(self, worker, budget: int, topk: int, log_every_s: float = 30.0):
        self._worker = worker
        self.budget, self.topk = budget, topk
        self._pending = 0  # nodes of the step about to run (0: a chain)
        self.trees: DraftTrees | None = None
        self.logits_in_path_order = False  # set per step: the step's logprobs read its verify logits
        self.path: torch.Tensor | None = None  # verify_tree's accepted path of the step in flight
        self.log_every_s = log_every_s
        self._counts: dict[int, list[int]] = {}  # nodes -> [request-steps, tokens] since the last log
        self._last_log = -math.inf  # the first tree step reports

    @property
    def drafting(self) -> bool:
        return self._pending > 0

    def begin(self, budget: int) -> None:
        if budget < 1 or budget + 1 != int(self._worker.block_size):
            raise RuntimeError(f"a tree of {budget} nodes needs the worker at block size {budget + 1}, "
                               f"not {self._worker.block_size}")
        self._pending = budget

    def draft(self, hidden_states: torch.Tensor, logits_of) -> torch.Tensor:
        """The block's drafted tokens [bs * n] for the draft head's `hidden_states` [bs * n, H]
        (positions 1..n of every request's block): the trees' nodes 1..n. `logits_of(hidden)`
        gives the draft logits and the target id of each of their columns."""
        worker, n = self._worker, self._pending
        bs = hidden_states.shape[0] // n
        logits, ids = logits_of(hidden_states)
        scores, picks = top_k_logprobs(logits, min(self.topk, logits.shape[-1]))
        picks = picks if ids is None else ids[picks]
        anchors = worker._draft_block_ids_buf[:bs, 0]
        trees = build_trees(anchors.to(torch.int64), picks.view(bs, n, -1), scores.view(bs, n, -1), [n] * bs)
        if trees.tokens.shape[1] != n + 1:  # n positions x >= 1 choices always hold n nodes
            raise RuntimeError(f"draft trees of {trees.tokens.shape[1]} nodes for a block of {n + 1}")
        positions = worker._draft_block_positions_buf[:bs]  # the verify's positions: length + depth
        positions.copy_(positions[:, :1] + trees.depths.to(positions.dtype))
        self.trees = trees
        attention.publish_verify_tree(trees.parents)
        return trees.tokens[:, 1:].reshape(-1)

    def accept(self, logits: torch.Tensor | None, target_ids: torch.Tensor | None, sampling) -> tuple:
        """verify_tree over the step's trees: target_ids [bs * (n + 1)] (the target's argmax),
        else `logits` with `sampling` = (temperature, top_k, top_p, seed, offsets) or None for
        greedy. Moves the accepted paths' K/V into place; returns (accept_len, bonus, out_tokens)."""
        trees, worker = self.trees, self._worker
        layers = int(worker.target_worker.model_runner.model_config.num_attention_layers)
        applied = attention.tree_layers_applied()
        if applied != layers:
            raise RuntimeError(f"sglang-dflash: {applied} of the target's {layers} attention layers applied "
                               "the draft tree's mask; this step's verify is not a tree verify")
        bs, nodes = trees.tokens.shape
        if target_ids is not None:
            accept_len, path, out = ops.verify_tree_from_ids(trees.tokens, trees.parents, trees.depths,
                                                             target_ids.view(bs, nodes))
        else:
            if sampling is None:  # greedy: temperature 0 is the argmax
                dev = logits.device
                sampling = (torch.zeros(bs, dtype=torch.float32, device=dev),
                            torch.zeros(bs, dtype=torch.int32, device=dev),
                            torch.ones(bs, dtype=torch.float32, device=dev), 0,
                            torch.zeros(bs, dtype=torch.int64, device=dev))
            accept_len, path, out = ops.verify_tree(trees.tokens, trees.parents, trees.depths, logits.contiguous(),
                                                    *sampling)
        loc = worker._draft_verify_out_cache_loc_buf[:bs]
        move_path_kv(worker.target_worker.model_runner.token_to_kv_pool, loc, path, accept_len)
        if self.logits_in_path_order and logits is not None:
            rows_in_path_order(logits, path)
        self.path = path
        bonus = out.gather(1, accept_len.to(torch.int64)[:, None])[:, 0]
        return accept_len, bonus, out

    def chains_in_trees(self, accepted: list[int]) -> tuple[list[int], list[int]] | None:
        """After `accept`: per request, how many drafts the chain of first choices inside its tree
        had accepted (`tree.chain_accept_lens`), of the `accepted` the trees had, and that chain's
        depth (`tree.chain_depths`); the adaptive controller's measure of what a tree adds to its
        chain, and of the chain's acceptance while trees play. None where this step verified no
        trees of that batch (the controller then measures the tree against the chain's expected
        tokens): a measurement never stops a decode step."""
        if self.trees is None or self.path is None or self.path.shape[0] != len(accepted):
            return None
        return chain_accept_lens(self.trees, self.path, accepted), chain_depths(self.trees)

    def path_context(self, target_hidden: torch.Tensor, positions: torch.Tensor) -> tuple:
        """The target hidden states [bs * N, H] and positions [bs * N] of each request's accepted
        path first (rows past it repeat the root; the commit reads only the accepted ones)."""
        bs, nodes = self.path.shape
        rows = self.path.clamp(min=0)
        index = rows[:, :, None].expand(-1, -1, target_hidden.shape[-1])
        hidden = target_hidden.view(bs, nodes, -1).gather(1, index).reshape(bs * nodes, -1)
        return hidden, positions.view(bs, nodes).gather(1, rows.to(positions.device)).reshape(-1)

    def finish(self, reqs: list, commit_lens: list[int] | None) -> None:
        """End of a decode step: report it (per-token meta info, a periodic log line) and clear the
        tree state, whatever happened."""
        nodes = self._pending if self.path is not None else 0
        self._pending, self.trees, self.path, self.logits_in_path_order = 0, None, None, False
        attention.publish_verify_tree(None)
        if commit_lens is None:
            return
        for req, n in zip(reqs, commit_lens, strict=True):
            # As adaptive.py's block sizes: one entry per output token, 0 for the prefill's.
            info = req.customized_info if req.customized_info is not None else {}
            info.setdefault(META_INFO_KEY, [0] * len(req.output_ids)).extend([nodes] * n)
            req.customized_info = info
        steps_tokens = self._counts.setdefault(nodes, [0, 0])
        steps_tokens[0] += len(commit_lens)
        steps_tokens[1] += sum(commit_lens)
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s:
            self._last_log = now
            report = ", ".join(f"{'chain' if n == 0 else f'tree of {n}'} x{s} ({t / max(s, 1):.2f} tokens a step)"
                               for n, (s, t) in sorted(self._counts.items()))
            logger.info("sglang-dflash: draft trees, steps since the last report: %s", report)
            self._counts.clear()
