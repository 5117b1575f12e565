"""DFlashKernelWorker: SGLang's DFLASH worker with sglang-dflash's verify kernels.

A subclass of SGLang's `DFlashWorkerV2` (sglang/srt/speculative/dflash_worker_v2.py) that keeps
everything of SGLang's DFLASH (argument handling, hidden-state capture, KV sizing, overlap
scheduling, TP, CUDA graphs). Its seams: `forward_batch_generation` (the adaptive block size,
adaptive.py), `_greedy_sample_from_vocab_parallel_head` (drafts among the drafter's draft
vocabulary), `_append_target_hidden_to_draft_kv_by_loc` (context K/V through
`materialize_context_kv`, context_kv.py), and `_accept_block`, with our `verify_block` kernels
(docs/design.md §3.2):

- greedy with the target's argmax ids (SGLang's deferred-argmax path): `verify_block_from_ids`;
- greedy with logits: `verify_block` at temperature 0, i.e. the argmax fused into the accept scan
  (with TP sync on, the argmax ids are computed and broadcast first, as SGLang does);
- sampling (temperature / top-k / top-p per request): `verify_block`'s Gumbel-max sampling, one
  pass over the logits with no dense probability tensor. Noise is keyed by (seed, offset + row, id):
  the seed is SGLang's resolved random seed; a request's offset is derived from its `sampling_seed`
  and current length under deterministic inference (so each sample is keyed by its position),
  otherwise from a step counter and the request's row, so that no key repeats.

Results go into SGLang's double-buffered outputs (`_next_accept_bonus_buffers`), and the decisions
are broadcast from TP rank 0 at the same `SpecTpSyncSite`s SGLang uses. The parent handles what
this class does not: sampled selector / LiLiCorr (DFlash-2) proposals on GPUs (on the CPU their walk
proposes greedily and our kernels verify), `SGLANG_SIMULATE_ACC_LEN`, non-default
acceptance thresholds, devices our extension has no kernels for, and any op of ours that failed its
start-up self-test on this device (sglang_dflash/ops/self_test.py).

Imported lazily by `plugin.py`, in the scheduler process only.
"""

from __future__ import annotations

import inspect
import logging
import os
from http import HTTPStatus

import torch
from sglang.srt import runtime_context as _runtime_context
from sglang.srt.speculative import dflash_worker_v2 as _sgl_worker
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite
from sglang.version import __version__ as SGLANG_VERSION

from sglang_dflash import _extension, ops, settings
from sglang_dflash.models.checkpoint import read_draft_vocab
from sglang_dflash.models.skinny import batch_invariant, linear, quantize_rows
from sglang_dflash.ops import self_test
from sglang_dflash.ops.error_watch import DeviceErrorWatch
from sglang_dflash.serving import adaptive, attention, draft_int8, draft_norms, trees
from sglang_dflash.serving.context_kv import ContextKVWriter

logger = logging.getLogger(__name__)

ACCEPT_BLOCK_KWARGS = (
    "candidates",
    "next_token_logits",
    "sampling_info",
    "draft_input",
    "prefix_lens",
    "bs",
    "target_predict",
)
_GREEDY_SITE = "DFLASH_ACCEPT_GREEDY"
_SAMPLE_SITE = "DFLASH_ACCEPT_SAMPLE"
# Odd 64-bit constant (golden ratio) that spreads sampling seeds over the offset space.
_SEED_MIX = 0x9E3779B97F4A7C15 - (1 << 64)
_ROW_BITS, _REQUEST_BITS, _STEP_PERIOD = 16, 20, 1 << 27
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CPU_KV_DTYPES = ("auto", "float32", "bfloat16", "float16")  # --kv-cache-dtype values our CPU kernels take


def unseeded_offsets(step: int, bs: int, device) -> torch.Tensor:
    """Sampling offsets of a batch without sampling seeds: request b of step s gets
    (s << 36) + (b << 16). Verify row i draws key offset + i, so rows (< 2^16), requests (< 2^20)
    and steps (mod 2^27) never share a key."""
    step_key = (step % _STEP_PERIOD) << (_ROW_BITS + _REQUEST_BITS)
    return (torch.arange(bs, dtype=torch.int64, device=device) << _ROW_BITS) + step_key


def compatibility_problems() -> list[str]:
    """What the installed SGLang lacks of the seams this worker relies on (empty: all there)."""
    problems = []
    accept = getattr(DFlashWorkerV2, "_accept_block", None)
    if accept is None:
        problems.append("DFlashWorkerV2._accept_block is missing")
    else:
        params = inspect.signature(accept).parameters
        missing = [
            n for n in ACCEPT_BLOCK_KWARGS
            if n not in params or params[n].kind is not inspect.Parameter.KEYWORD_ONLY
        ]
        if missing:
            problems.append(f"DFlashWorkerV2._accept_block lacks keyword-only arguments {missing}")
    for name in ("_next_accept_bonus_buffers", "_validate_phase1_sampling_support"):
        if not hasattr(DFlashWorkerV2, name):
            problems.append(f"DFlashWorkerV2.{name} is missing")
    for site in (_GREEDY_SITE, _SAMPLE_SITE):
        if not hasattr(SpecTpSyncSite, site):
            problems.append(f"SpecTpSyncSite.{site} is missing")
    for name in ("sync", "enabled"):
        if not callable(getattr(SpecTpSync, name, None)):
            problems.append(f"SpecTpSync.{name} is missing")
    for name in ("SIMULATE_ACC_LEN", "_is_all_greedy"):
        if not hasattr(_sgl_worker, name):
            problems.append(f"sglang.srt.speculative.dflash_worker_v2.{name} is missing")
    if not callable(getattr(_runtime_context, "get_spec", None)):
        problems.append("sglang.srt.runtime_context.get_spec is missing")
    try:
        for op in ("verify_block", "verify_block_from_ids"):
            if not hasattr(_extension.ops(), op):
                problems.append(f"the sglang_dflash extension has no op {op}")
    except Exception as exc:
        problems.append(f"the sglang_dflash extension cannot be loaded: {exc}")
    return problems


def runner_device(model_runner) -> torch.device:
    """The device a model runner computes on, with its index: SGLang keeps the type ("cuda") and
    the index (gpu_id, made current at start-up) apart."""
    device = torch.device(model_runner.device)
    if device.type == "cpu" or device.index is not None:
        return device
    return torch.device(device.type, int(model_runner.gpu_id))


def kernels_cover(device: torch.device) -> bool:
    """Whether our extension has verify kernels for tensors on `device`."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return _extension.has_cuda_kernels()
    return False


def commit_tokens(candidates: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """SGLang's committed-block layout: accepted drafts, the bonus, then zeros. int64 [bs, B]."""
    bs, block = candidates.shape
    cols = torch.arange(block, device=candidates.device)
    acc = accept_len.to(torch.int64)[:, None]
    drafts = torch.zeros_like(candidates, dtype=torch.int64)
    drafts[:, : block - 1] = candidates[:, 1:]
    out = torch.where(cols[None, :] < acc, drafts, torch.zeros_like(drafts))
    out.scatter_(1, acc, bonus.to(torch.int64)[:, None])
    return out


class DFlashKernelWorker(DFlashWorkerV2):
    """SGLang's DFlashWorkerV2 with `_accept_block` running sglang-dflash's verify kernels."""

    def __init__(self, *args, **kwargs):
        # On CPU the plugin's create_worker hook has registered the sgl-kernel ops SGLang's
        # speculative path calls, where this sgl-kernel lacks them (plugin.supply_cpu_ops).
        super().__init__(*args, **kwargs)
        self._check_draft_matches_target()
        device = runner_device(self.model_runner)
        if device.type == "cpu":
            from sglang_dflash.serving.cpu import install_torch_cpu_shims

            install_torch_cpu_shims()
            # DFlash-2 selector / LiLiCorr drafters: SGLang's sampled proposal feeds an accept step
            # that runs a Triton kernel (no CPU path). Their walk proposes greedily instead, and
            # verify_block samples from the target whatever was drafted: exact, only the draft differs.
            self._selector_sampling_enabled = False
            self._lilicorr_sampling_enabled = False
        self._dflash_device = device
        self._context_kv = None
        self._init_dflash_kernels(_runtime_context.get_spec(), ())  # SGLang's path until the self-test
        self._init_draft_vocab()
        self._init_trees()
        self._init_adaptive_block_size()
        if getattr(self.draft_model_runner, "token_to_kv_pool", None) is not None:
            self._start_dflash_kernels()

    def alloc_memory_pool(self, *args, **kwargs):
        # SGLang allocates the KV pools after building the worker; the self-test needs their dtypes.
        super().alloc_memory_pool(*args, **kwargs)
        if getattr(self, "_dflash_device", None) is not None and not self._dflash_ops:  # not inside __init__
            self._start_dflash_kernels()

    def _start_dflash_kernels(self) -> None:
        """Self-tests our kernels on this worker's device and switches on those that pass."""
        device = self._dflash_device
        self._init_dflash_kernels(_runtime_context.get_spec(), self._self_test_kernels(device))
        logger.info("sglang-dflash: speculative algorithm DFLASH runs worker %s.%s (SGLang %s) on %s; "
                    "sglang-dflash kernels run %s", type(self).__module__, type(self).__qualname__,
                    SGLANG_VERSION, device, ", ".join(sorted(self._dflash_ops)) or "nothing")
        if device.type == "cuda":
            from sglang_dflash.ops import gpu_defaults
            from sglang_dflash.serving.attention import gpu_choice

            for op in gpu_defaults.GATED_OPS:
                on, why = gpu_choice(op, device)
                state = "runs" if op in self._dflash_ops else "off" if not on else "failed its self-test"
                logger.info("sglang-dflash: %s on this GPU: %s (%s)", op, state, why)

    def _self_test_kernels(self, device: torch.device) -> set[str]:
        """Self-tests each op this worker would run on `device` (ops/self_test.py) and switches on
        those that pass; the rest keep SGLang's own path. Returns the ops that run ours."""
        plan = {}
        if kernels_cover(device):
            plan["verify_block"] = list(dict.fromkeys([torch.float32, self.model_runner.model_config.dtype]))
            plan["verify_block_from_ids"] = [torch.int64]
        attention_cases = attention.draft_attention_cases(self) if attention.draft_attention_wanted(device) else []
        if attention_cases:
            plan["block_attention"] = attention_cases
        context_kv = ContextKVWriter.for_worker(self)
        if context_kv is not None:
            plan["materialize_context_kv"] = [context_kv.self_test_case()]
        if device.type == "cpu":  # the draft head and, with SGLang's CPU engine, its linear layers; the draft norms
            plan["skinny_linear"] = [self.model_runner.model_config.dtype]
            plan["rms_norm_rope"] = [self.model_runner.model_config.dtype]
            plan["w8a8_linear"] = [self.model_runner.model_config.dtype]
            plan["verify_tree"] = [self.model_runner.model_config.dtype]  # a sampled tree step
            plan["move_slots"] = [self.model_runner.model_config.dtype]  # a tree step's KV moves
            plan["top_k_logprobs"] = [self.model_runner.model_config.dtype]  # a tree's draft choices
        ours = self_test.select(device, plan, fallback="SGLang's own path")
        if "rms_norm_rope" in ours:
            norms, attentions = draft_norms.install_draft_norms(self.draft_model, device)
            logger.info("sglang-dflash: %d draft RMSNorms and the q/k norm + RoPE of %d draft attentions run "
                        "rms_norm_rope", norms, attentions)
        if "block_attention" in ours:
            n_layers = attention.install_draft_attention(self)
            logger.info("sglang-dflash: %d draft attention layers run block_attention in TARGET_VERIFY", n_layers)
        if "skinny_linear" in ours and draft_int8.int8_wanted(device):
            try:
                converted = draft_int8.quantize_draft_linears(self.draft_model)
            except Exception as e:  # a drafter this does not know: its weights stay as they are
                logger.warning("sglang-dflash: the drafter keeps its weights' dtype (int8 failed: %r)", e)
            else:
                self._draft_int8 = True
                self._draft_head = None  # cut again, in int8
                activations = (f"int8 too (w8a8_linear, {ops.int8_dot_isa()})" if "w8a8_linear" in ours
                               and ops.int8_dot_isa() != "portable" else "in the model's dtype")
                logger.info("sglang-dflash: %d draft linear layers and the draft LM head run int8 weights, "
                            "activations %s (%s=0: the model's dtype)", converted, activations,
                            settings.DRAFT_INT8.name)
        self._context_kv = context_kv if "materialize_context_kv" in ours else None
        if self._context_kv is not None:
            logger.info("sglang-dflash: draft context K/V of %d layers through materialize_context_kv",
                        len(self.draft_model.layers))
        return ours

    def _init_draft_vocab(self) -> None:
        """The drafter's `draft_vocab.safetensors` (when its directory has one): drafts are picked
        among those ids only, so the draft LM head reads K rows instead of the whole vocabulary.
        Lossless: the target verifies every token."""
        path = self.server_args.speculative_draft_model_path
        vocab_size = int(self.model_runner.model_config.vocab_size)
        self._draft_vocab = read_draft_vocab(path, vocab_size, self.device) if path and os.path.isdir(path) else None
        self._draft_vocab_end = 0 if self._draft_vocab is None else int(self._draft_vocab.max()) + 1
        self._draft_head: tuple | None = None  # (key of the LM head weight it was cut from, rows, row scales)
        self._draft_int8 = False  # the draft head rows (and the draft layers) in int8: draft_int8.py
        if self._draft_vocab is not None and self._tp_size() > 1:  # _draft_head_rows says why
            logger.info("sglang-dflash: %s/draft_vocab.safetensors unused: under tensor parallelism the LM head "
                        "is sharded, and drafts take the whole vocabulary", path)
        elif self._draft_vocab is not None:
            logger.info("sglang-dflash: drafts take the %d ids of %s/draft_vocab.safetensors (vocabulary %d)",
                        self._draft_vocab.numel(), path, vocab_size)

    def _init_trees(self) -> None:
        """Draft trees (trees.py) where SGLANG_DFLASH_TREE_BUDGET asks for them (a bad value stops
        the start with an error naming the variable), and by default where the block size adapts;
        `init_attention_backends` then keeps them only where this worker can run them."""
        self._trees = self._tree_states = None
        self._max_block_size = int(self.block_size)
        options = trees.tree_options(self._max_block_size, int(self.model_runner.model_config.vocab_size),
                                     block_size_adapts=adaptive.adaptive_wanted())
        if options is not None:
            self._trees = trees.ServedTrees(self, *options)

    def init_attention_backends(self, *args, **kwargs):
        super().init_attention_backends(*args, **kwargs)
        if self._trees is None:
            return
        # Only now are the target's attention backend and SGLang's Mamba check known.
        problem = trees.tree_problem(self) or self._tree_head_problem()
        if problem is not None:
            if settings.is_set(settings.TREE_BUDGET):
                logger.warning("sglang-dflash: %s=%d ignored, every step verifies a chain: %s",
                               settings.TREE_BUDGET.name, self._trees.budget, problem)
            else:
                logger.info("sglang-dflash: draft trees off, every step verifies a chain: %s", problem)
            self._trees = None
            return
        if self._adaptive is None:  # else the adaptive block size switches the block sizes
            self._tree_states = adaptive.BlockSizeStates(self)
        logger.info("sglang-dflash: draft trees on: %s nodes (top %d per position; %s=0 turns them off)",
                    f"up to {self._trees.budget}" if self._adaptive is not None else self._trees.budget,
                    self._trees.topk, settings.TREE_BUDGET.name)

    def _tree_head_problem(self) -> str | None:
        weight = getattr(getattr(self.target_worker.model_runner.model, "lm_head", None), "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype not in _LOGIT_DTYPES:
            return "the target's LM head is not a plain weight (the tree's top-k reads it)"
        return None

    def _init_adaptive_block_size(self) -> None:
        self._adaptive = None
        if not adaptive.adaptive_wanted():
            return
        problem = adaptive.adaptive_problem(self)
        if problem is not None:
            logger.info("sglang-dflash: adaptive block size off: %s; every step runs B=%d", problem,
                        self.block_size)
            return
        self._adaptive = adaptive.AdaptiveBlockSize(self, int(self.block_size),
                                           self._trees.budget if self._trees is not None else 0)
        logger.info("sglang-dflash: adaptive block size on: each decode step runs B in 1..%d (%s=0 pins B)",
                    self.block_size, settings.ADAPTIVE.name)

    def _check_draft_matches_target(self) -> None:
        """Refuse, at startup and with one message naming the flag, a configuration that cannot
        work: a drafter whose hidden size or vocabulary is not the target's (the draft reads the
        target's embeddings and its outputs go through the target's LM head; SGLang itself only
        notices at the first request, or never), or on CPU a KV cache dtype our kernels refuse."""
        target_config = getattr(self.model_runner, "model_config", None)
        draft_config = getattr(self.draft_model, "config", None)
        draft_path = self.server_args.speculative_draft_model_path
        for field in ("hidden_size", "vocab_size"):
            ours, theirs = getattr(draft_config, field, None), getattr(target_config, field, None)
            if ours is not None and theirs is not None and int(ours) != int(theirs):
                raise ValueError(
                    f"--speculative-draft-model-path {draft_path}: the drafter's {field} {ours} does not match "
                    f"the target's {theirs}; the drafter must be trained for this target"
                )
        kv_dtype = str(getattr(self.server_args, "kv_cache_dtype", "auto"))
        if torch.device(self.device).type == "cpu" and kv_dtype not in _CPU_KV_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype {kv_dtype}: DFLASH on CPU runs sglang-dflash's attention kernels, which take "
                f"{', '.join(_CPU_KV_DTYPES)} KV caches"
            )

    def _init_dflash_kernels(self, spec, kernel_ops) -> None:
        """`spec`: SGLang's resolved speculative settings (get_spec()); `kernel_ops`: the ops that
        run ours on this worker's device."""
        # SGLang's resolved seed: the target worker's, drawn at start-up when --random-seed is not
        # given (server_args.random_seed stays None then) and the same on every TP rank.
        self._dflash_seed = int(self._target_worker.random_seed)
        self._dflash_step = 0
        self._dflash_thresholds = (float(spec.speculative_accept_threshold_single),
                                   float(spec.speculative_accept_threshold_acc))
        self._dflash_ops = frozenset(kernel_ops)
        self._dflash_logged = False
        self._device_errors = None
        if self._dflash_device.type == "cuda" and self._dflash_ops:  # else nothing of ours can record one
            # Overlap scheduling waits for step N's results after queueing step N + 1: read them then.
            lag = 0 if self.server_args.disable_overlap_schedule else 1
            self._device_errors = DeviceErrorWatch(ops.canonical_device(self._dflash_device), lag)

    # -- steps -----------------------------------------------------------------------------

    def forward_batch_generation(self, batch, *args, **kwargs):
        def run():
            return super(DFlashKernelWorker, self).forward_batch_generation(batch, *args, **kwargs)

        if (
            batch.forward_mode.is_extend()
            or batch.is_extend_in_batch
            or batch.forward_mode.is_idle()
            or _sgl_worker.SIMULATE_ACC_LEN > 0
        ):
            result = run()
        else:
            result = None
            step_trees = self._trees if self._tree_step_ok(batch) else None
            if step_trees is not None:
                step_trees.logits_in_path_order = bool(batch.return_logprob)
            try:
                # Our linear layers at every row count: a verify of many rows (a batch of blocks
                # or trees) then computes what decoding its tokens one at a time computes.
                with batch_invariant():
                    if self._adaptive is not None:
                        result = self._adaptive.run_step(batch.reqs, run, step_trees)
                    elif self._tree_states is not None:  # trees at a fixed budget; chains at the full block
                        self._tree_states.use(self._trees.budget + 1 if step_trees is not None
                                              else self._max_block_size)
                        if step_trees is not None:
                            step_trees.begin(step_trees.budget)
                        result = run()
                    else:
                        result = run()
            finally:
                if self._trees is not None:
                    self._trees.finish(batch.reqs, None if result is None else result.accept_lens.tolist())
        self._abort_on_device_errors(batch.reqs)
        return result

    def _tree_step_ok(self, batch) -> bool:
        """Whether this decode step may verify a tree (trees.py): trees on, a batch that needs
        nothing only chains give, and our verify kernels with the lossless acceptance rule."""
        return self._trees is not None and self._kernel_sampling_ok() and trees.batch_problem(batch) is None

    def _abort_on_device_errors(self, reqs: list) -> None:
        """On CUDA our kernels do not trap on an out-of-range index (a trap would end the server's
        CUDA context): they skip it and record it, and that step's outputs are then not valid. The
        record is snapshotted after every step and read where the scheduler waits for the step's
        results anyway (ops/error_watch.py), so the host never waits on the GPU for us. A step with an
        error ends each of its requests still running with an error response (HTTP 500) naming the op
        and the index, instead of an answer built on those outputs, and the server serves on."""
        if self._device_errors is None:
            return
        message = "sglang-dflash: a decoding step's outputs are not valid: {}"
        for error in self._device_errors.after_step(list(reqs)):
            for req in error.tag:
                if not req.finished():
                    req.set_finish_with_abort(message.format(error.message), HTTPStatus.INTERNAL_SERVER_ERROR,
                                              "InternalServerError")

    def _write_draft_context(self, *, target_hidden, cache_loc, positions, cache_loc_2d, commit_lens, extend_lens):
        if self._context_kv is None or target_hidden is None or getattr(self, "lilicorr", None) is not None:
            return super()._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=target_hidden, cache_loc=cache_loc, positions=positions, cache_loc_2d=cache_loc_2d,
                commit_lens=commit_lens, extend_lens=extend_lens,
            )
        self._context_kv.write(target_hidden, cache_loc, positions, cache_loc_2d, commit_lens)

    def _append_target_hidden_to_draft_kv_by_loc(self, *, target_hidden, cache_loc, positions, cache_loc_2d=None,
                                                 commit_lens=None, extend_lens=None):
        if self._trees is not None and self._trees.path is not None and target_hidden is not None:
            # A tree step: the drafter's context continues along the accepted path only.
            target_hidden, positions = self._trees.path_context(target_hidden, positions)
        self._write_draft_context(target_hidden=target_hidden, cache_loc=cache_loc, positions=positions,
                                  cache_loc_2d=cache_loc_2d, commit_lens=commit_lens, extend_lens=extend_lens)

    def _greedy_sample_from_vocab_parallel_head(self, *, hidden_states, lm_head, chunk_size: int = 256):
        if self._trees is not None and self._trees.drafting:
            return self._trees.draft(hidden_states, lambda hidden: self._draft_logits(hidden, lm_head))
        head = self._draft_head_rows(lm_head)
        if head is None or hidden_states.numel() == 0:
            return super()._greedy_sample_from_vocab_parallel_head(
                hidden_states=hidden_states, lm_head=lm_head, chunk_size=chunk_size
            )
        return self._draft_vocab[self._draft_head_logits(hidden_states, *head).max(-1).indices]

    def _draft_logits(self, hidden_states, lm_head) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft head's logits for `hidden_states` and the target id of each column (None:
        the column is the id): over the draft vocabulary where there is one, else the whole head."""
        head = self._draft_head_rows(lm_head)
        if head is not None:
            return self._draft_head_logits(hidden_states, *head), self._draft_vocab
        weight = lm_head.weight[: int(self.model_runner.model_config.vocab_size)]
        return linear(hidden_states.to(weight.dtype), weight), None

    @staticmethod
    def _draft_head_logits(hidden_states, rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """Logits over the draft vocabulary's head rows (`_draft_head_rows`): float rows take the
        hidden states in their dtype, int8 rows (with their scales) in the hidden states' own."""
        return linear(hidden_states if scale is not None else hidden_states.to(rows.dtype), rows, None, scale)

    def _draft_head_rows(self, lm_head) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The target LM head's rows of the draft vocabulary (a contiguous copy, re-cut when the
        weight changes; int8 with its row scales when the drafter runs int8 weights, else scales
        None), or None where the whole head must be used: no draft vocabulary, or a head that is
        sharded (TP), quantized or too small for the ids."""
        weight = getattr(lm_head, "weight", None)
        if (
            self._draft_vocab is None
            or not isinstance(weight, torch.Tensor)
            or weight.dim() != 2
            or weight.dtype not in _LOGIT_DTYPES
            or self._tp_size() > 1
            or self._draft_vocab_end > weight.shape[0]
        ):
            return None
        key = (weight.data_ptr(), weight._version, weight.dtype)
        if self._draft_head is None or self._draft_head[0] != key:
            rows = weight.detach()[self._draft_vocab].contiguous()
            self._draft_head = (key, *(quantize_rows(rows) if self._draft_int8 else (rows, None)))
        return self._draft_head[1:]

    def _tp_size(self) -> int:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_group.world_size)

    # -- decisions -------------------------------------------------------------------------

    def _kernel_sampling_ok(self) -> bool:
        """Whether sampled verification runs on our kernels: no sampled selector proposal to accept
        against its own q (SGLang's; not made on the CPU), the lossless rule (any other acceptance
        threshold is SGLang's), and a verify_block that passed its self-test. Our sampled verify
        is exact whatever drafted the block, a selector's or LiLiCorr's greedy walk included."""
        return (
            getattr(self, "_selector_sample", None) is None
            and self._dflash_thresholds == (1.0, 1.0)
            and "verify_block" in self._dflash_ops
        )

    def _validate_phase1_sampling_support(self, batch) -> None:
        # SGLang warns that sampled verification falls back to greedy where its sampling op is
        # missing (CPU); ours samples there, so only defer to it for what we do not cover.
        if self._kernel_sampling_ok():
            return
        super()._validate_phase1_sampling_support(batch)

    def _accept_block(
        self,
        *,
        candidates: torch.Tensor,
        next_token_logits: torch.Tensor | None,
        sampling_info,
        draft_input,
        prefix_lens: torch.Tensor,
        bs: int,
        target_predict: torch.Tensor | None = None,
    ):
        def parent():
            return super(DFlashKernelWorker, self)._accept_block(
                candidates=candidates,
                next_token_logits=next_token_logits,
                sampling_info=sampling_info,
                draft_input=draft_input,
                prefix_lens=prefix_lens,
                bs=bs,
                target_predict=target_predict,
            )

        if self._trees is not None and self._trees.trees is not None:
            return self._accept_tree(next_token_logits, sampling_info, prefix_lens, bs, target_predict)
        if getattr(self, "_selector_sample", None) is not None or _sgl_worker.SIMULATE_ACC_LEN > 0:
            return parent()


        block = int(self.block_size)
        greedy_site = getattr(SpecTpSyncSite, _GREEDY_SITE)
        sample_site = getattr(SpecTpSyncSite, _SAMPLE_SITE)
        greedy = target_predict is not None or _sgl_worker._is_all_greedy(sampling_info)
        # Greedy with TP sync keeps SGLang's convention: rank 0's argmax ids are what every rank accepts.
        from_ids = greedy and (target_predict is not None or self._tp_sync.enabled(greedy_site))
        if from_ids:
            ours = "verify_block_from_ids" in self._dflash_ops
        else:
            ours = next_token_logits.dtype in _LOGIT_DTYPES and (
                "verify_block" in self._dflash_ops if greedy else self._kernel_sampling_ok())
        if not ours:  # decided before any TP sync: SGLang's path then makes all of them
            return parent()

        cands = candidates.to(torch.int64).contiguous()
        if from_ids:
            if target_predict is None:
                target_predict = torch.argmax(next_token_logits, dim=-1)
            target_predict = target_predict.view(bs, block)
            self._tp_sync.sync(greedy_site, target_predict)
            accept_len, bonus, out = ops.verify_block_from_ids(cands, target_predict)
        elif greedy:
            dev = next_token_logits.device
            accept_len, bonus, out = ops.verify_block(
                cands,
                next_token_logits.contiguous(),
                torch.zeros(bs, dtype=torch.float32, device=dev),
                torch.zeros(bs, dtype=torch.int32, device=dev),
                torch.ones(bs, dtype=torch.float32, device=dev),
                0,
                torch.zeros(bs, dtype=torch.int64, device=dev),
            )
        else:
            temperature, top_k, top_p, offsets = self._sampling_args(sampling_info, prefix_lens, bs)
            accept_len, bonus, out = ops.verify_block(
                cands, next_token_logits.contiguous(), temperature, top_k, top_p, self._dflash_seed, offsets
            )
            if self._tp_sync.enabled(sample_site):
                self._tp_sync.sync(sample_site, accept_len)
                self._tp_sync.sync(sample_site, bonus)
                out = None  # rank 0's decisions may differ from this rank's: rebuild the tokens

        if not self._dflash_logged:
            self._dflash_logged = True
            logger.info("sglang-dflash: first verify on %s ran sglang_dflash kernels", cands.device)
        return self._store_accept(cands, accept_len, bonus, out, prefix_lens, bs)

    def _accept_tree(self, next_token_logits, sampling_info, prefix_lens, bs: int, target_predict):
        """`_accept_block` of a tree step: verify_tree with the target's argmax ids, its greedy
        argmax or its Gumbel-max samples (keyed as a chain's rows are), then the accepted path's
        K/V into place (trees.py)."""
        sampling = None
        if target_predict is None and not _sgl_worker._is_all_greedy(sampling_info):
            temperature, top_k, top_p, offsets = self._sampling_args(sampling_info, prefix_lens, bs)
            sampling = (temperature, top_k, top_p, self._dflash_seed, offsets)
        accept_len, bonus, out = self._trees.accept(next_token_logits, target_predict, sampling)
        return self._store_accept(self._trees.trees.tokens, accept_len, bonus, out, prefix_lens, bs)

    # -- helpers ---------------------------------------------------------------------------

    def _sampling_args(self, sampling_info, prefix_lens: torch.Tensor, bs: int):
        """verify_block's per-request temperature, top_k, top_p and offsets from SGLang's batch."""
        dev = prefix_lens.device
        top_k = sampling_info.top_ks.reshape(-1).to(device=dev, dtype=torch.int32)
        temperature = sampling_info.temperatures.reshape(-1).to(device=dev, dtype=torch.float32)
        # SGLang marks greedy requests as temperature 1, top_k 1: make them exact argmax rows
        # (lowest id on ties) instead of a sample over a tied top-1 set.
        temperature = torch.where(top_k == 1, torch.zeros_like(temperature), temperature)
        top_p = sampling_info.top_ps.reshape(-1).to(device=dev, dtype=torch.float32)
        seeds = getattr(sampling_info, "sampling_seed", None)
        if seeds is not None:
            # Deterministic inference: reproducible per request, each sample keyed by its position.
            offsets = seeds.reshape(-1).to(device=dev, dtype=torch.int64) * _SEED_MIX
            offsets = offsets + prefix_lens.to(torch.int64)
        else:
            offsets = unseeded_offsets(self._dflash_step, bs, dev)
        self._dflash_step += 1
        return temperature, top_k, top_p, offsets

    def _store_accept(self, cands, accept_len, bonus, out, prefix_lens, bs):
        """Write the decisions into SGLang's (overlap-safe) accept buffers and return them."""
        acc_buf, commit_buf, bonus_buf, out_buf, seq_buf = self._next_accept_bonus_buffers(bs)
        acc_buf.copy_(accept_len)
        torch.add(acc_buf, 1, out=commit_buf)
        bonus_buf.copy_(bonus)
        if out is None:
            out_buf.copy_(commit_tokens(cands, accept_len, bonus))
        else:  # ours ends with -1 after the bonus; SGLang's with 0
            torch.clamp(out, min=0, out=out_buf)
        torch.add(prefix_lens.to(seq_buf.dtype), commit_buf.to(seq_buf.dtype), out=seq_buf)
        return acc_buf, commit_buf, bonus_buf, out_buf, seq_buf

