"""Target adapter for Hugging Face causal LMs (Llama, Qwen2, Qwen3 families and alike).

It keeps one batched KV cache for the active requests. Requests have different lengths, so each
row of the cache is right-aligned and a 2-D attention mask marks its valid columns; after every
verify the rejected columns are dropped and the rows re-aligned (`commit`). Tapped hidden states
(HF `hidden_states[id + 1]`, the output of layer `id`) are captured with forward hooks, so only
the tapped layers' outputs are kept. The cache appends in place (`kv_cache.GrowingCache`), so a
rollback is a shorter view and a step copies only its new tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM, AutoTokenizer

from sglang_dflash.engine import grouped_attention
from sglang_dflash.engine.kv_cache import GrowingCache, slots_per_row
from sglang_dflash.engine.packaged import PACKAGED_MODELS, model_dir
from sglang_dflash.models.skinny import batch_invariant, use_skinny_linear
from sglang_dflash.ops import move_slots, self_test

# Rejected tokens left in a batch's cache as masked-out columns before it is compacted (`commit`,
# where rows roll back different tails): one compaction per ~20 steps of a few rejected tokens, and
# at most this many more columns for each attention to skip meanwhile.
MAX_DEAD_COLUMNS = 64
# What a target may run in: its linear layers are batch invariant in both (models/skinny.py), so
# verifying a block computes what decoding it token by token computes. bfloat16 halves the bytes a
# step reads, and on a CPU with AMX its verified rows cost little more than one (`bf16_dot_isa`).
TARGET_DTYPES = ("float32", "bfloat16")
# transformers 5.24 renamed the forward's `past_key_values=` to `cache=` (old name deprecated).
_CACHE_KWARG = "cache" if Version(transformers.__version__) >= Version("5.24.0") else "past_key_values"


class HFTarget:
    def __init__(self, model: transformers.PreTrainedModel, tokenizer=None):
        model.set_attn_implementation(grouped_attention.NAME)
        use_skinny_linear(model)
        self.model = model.eval()
        self.tokenizer = tokenizer
        decoder = model.get_decoder()
        self.layers = decoder.layers
        self.final_norm = decoder.norm
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head_weight = model.get_output_embeddings().weight
        self.num_layers = len(self.layers)
        self.hidden_size = self.embed_tokens.weight.shape[1]
        self.vocab_size = self.lm_head_weight.shape[0]
        self.device = self.lm_head_weight.device
        self.tap_layer_ids: tuple[int, ...] = ()
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list = []
        self._cache: GrowingCache | None = None
        self._valid: torch.Tensor | None = None  # bool [bs, T]: which cache columns are real tokens
        self._block = 0  # width of the last verified block
        # Before our kernels serve on this device: any that fails its self-test runs PyTorch here.
        config = model.config.get_text_config()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or self.hidden_size // heads
        plan = self_test.engine_plan(heads, getattr(config, "num_key_value_heads", None) or heads, head_dim,
                                     self.lm_head_weight.dtype, self.device)
        self_test.select(self.device, plan, fallback="PyTorch")

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", cache_dir: str | Path | None = None) -> HFTarget:
        """Load a Hugging Face model directory, or a packaged model by name (e.g. "smollm2-135m",
        converted once into `cache_dir`)."""
        path = model_dir(path, cache_dir)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"target model directory {path} has no config.json (nor is it a packaged "
                                    f"model: {', '.join(sorted(PACKAGED_MODELS))})")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        has_tokenizer = any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
        return cls(model, AutoTokenizer.from_pretrained(path) if has_tokenizer else None)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def set_taps(self, layer_ids: tuple[int, ...] | list[int]) -> None:
        """Capture the outputs of these layers on every forward (HF hidden_states[id + 1])."""
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range for a target with {self.num_layers} layers")
        for h in self._hooks:
            h.remove()
        self.tap_layer_ids = tuple(layer_ids)
        self._hooks = [self.layers[i].register_forward_hook(self._make_hook(i)) for i in set(layer_ids)]

    def _make_hook(self, layer_id: int):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if layer_id == self.num_layers - 1:  # HF reports the last layer after the final norm
                out = self.final_norm(out)
            self._captured[layer_id] = out
        return hook

    def take_taps(self) -> torch.Tensor | None:
        """The tapped layers' outputs of the last forward, concatenated [..., K*H] (None: no taps)."""
        if not self.tap_layer_ids:
            return None
        taps = torch.cat([self._captured[i] for i in self.tap_layer_ids], dim=-1)
        self._captured.clear()
        return taps

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def _forward(self, ids, positions, mask, cache, logits_to_keep=0):
        return self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                          use_cache=True, logits_to_keep=logits_to_keep, **{_CACHE_KWARG: cache})

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Run the prompts (equal-length ones batched together, so no padding is ever attended),
        then merge their caches into the batch, replacing any previous batch.

        Returns the last-position logits [n, V] and, per prompt, the taps [P, K*H] (or None).
        """
        n = len(prompts)
        last_logits: list = [None] * n
        taps: list = [None] * n
        rows: list = [None] * n  # (group cache, row in it)
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(len(p), []).append(i)
        for length, members in groups.items():
            ids = torch.tensor([prompts[i] for i in members], device=self.device)
            positions = torch.arange(length, device=self.device).expand(len(members), -1)
            cache = GrowingCache()
            out = self._forward(ids, positions, None, cache, logits_to_keep=1)
            t = self.take_taps()
            for j, i in enumerate(members):
                last_logits[i] = out.logits[j, -1]
                taps[i] = None if t is None else t[j]
                rows[i] = (cache, j)
        self._merge(rows, [len(p) for p in prompts])
        return torch.stack(last_logits), taps

    def _merge(self, rows: list[tuple[GrowingCache, int]], lengths: list[int]) -> None:
        width = max(lengths)
        merged = GrowingCache()
        for layer in range(self.num_layers):
            ks, vs = [], []
            for (cache, j), n in zip(rows, lengths, strict=True):
                pad = (0, 0, width - n, 0)
                ks.append(torch.nn.functional.pad(cache.layers[layer].keys[j], pad))
                vs.append(torch.nn.functional.pad(cache.layers[layer].values[j], pad))
            merged.update(torch.stack(ks), torch.stack(vs), layer)
        self._cache = merged
        lengths_t = torch.tensor(lengths, device=self.device)
        self._valid = torch.arange(width, device=self.device)[None] >= (width - lengths_t)[:, None]

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append a block of tokens [bs, B] at absolute positions [bs, B] for every active row.

        Returns logits [bs*B, V] and taps [bs, B, K*H] (or None). Call `commit` next.
        """
        bs, block = tokens.shape
        mask = torch.cat([self._valid, self._valid.new_ones(bs, block)], dim=1)
        with grouped_attention.kernel_step(self._valid, block), batch_invariant():
            out = self._forward(tokens, positions, mask.long(), self._cache)
        self._valid, self._block = mask, block
        return out.logits.reshape(bs * block, -1), self.take_taps()

    @torch.no_grad()
    def verify_tree(self, tokens: torch.Tensor, positions: torch.Tensor, ancestors: torch.Tensor,
                    parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append the N nodes of a draft tree per row, tokens and absolute positions [bs, N]: node i
        attends to the row's cache and to the nodes j with ancestors[b, i, j] (itself and its
        ancestors, `DraftTrees.ancestors`; `parents` [bs, N]: the same tree as parent indices).
        Returns logits [bs*N, V] and taps [bs, N, K*H] (or None). Call `commit_nodes` next."""
        bs, n = tokens.shape
        width = self._valid.shape[1]
        mask = torch.cat([self._valid[:, None, None, :].expand(bs, 1, n, width), ancestors[:, None]], dim=-1)
        with grouped_attention.kernel_step(self._valid, n, parents), batch_invariant():
            out = self._forward(tokens, positions, mask, self._cache)  # a 4-D mask is used as given
        self._valid, self._block = torch.cat([self._valid, self._valid.new_ones(bs, n)], dim=1), n
        return out.logits.reshape(bs * n, -1), self.take_taps()

    def commit_nodes(self, path: torch.Tensor, accept_len: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Keep, of the last verified tree, the nodes path[b, :accept_len[b] + 1] of row b (the root and
        the accepted nodes, in increasing node order); then keep only the batch rows `rows` (all when
        None), as `commit` does.

        The kept nodes' K/V move to the first columns of their row's block, in every layer with one
        `move_slots` call: where decoding the path would have put them. Node path[b, j] sits at depth
        j, so its K already carries the RoPE of that column's position. The rest is `commit` of
        accept_len + 1 tokens a row (at batch size 1 a shorter view: no copy, no masked columns)."""
        width, n = self._valid.shape[1], self._block
        counts = (accept_len.to(torch.int64) + 1).tolist()
        per_row = slots_per_row(self._cache.layers[0].keys)
        src, dst = [], []
        for b, (nodes, count) in enumerate(zip(path.tolist(), counts, strict=True)):
            block_slot = b * per_row + width - n
            moved = [j for j in range(1, count) if nodes[j] != j]  # the root stays where it is
            src += [block_slot + nodes[j] for j in moved]
            dst += [block_slot + j for j in moved]
        if src:
            views = [view for layer in self._cache.layers for view in layer.slots]
            move_slots(views, torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))
        self.commit(torch.tensor(counts, device=self._valid.device), rows)

    def commit(self, keep: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Keep the first keep[b] tokens of the last verified block in row b (rolling back the
        rest), then keep only the batch rows `rows` (all when None).

        Where every row rolls back the same tail (always so at batch size 1), the cache becomes a
        shorter view. Otherwise the rejected columns stay where they are, masked out of every later
        attention (their columns are invalid), until MAX_DEAD_COLUMNS pile up or rows are dropped:
        then one compaction re-aligns the rows and removes them all (a gather per layer and K/V
        tensor, too dear for every step)."""
        width = self._valid.shape[1]
        drop = self._block - keep
        if rows is None and bool((drop == drop[0]).all()):
            kept = width - int(drop[0])
            if kept < width:
                for layer in self._cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, :kept], layer.values[:, :, :kept]
                self._valid = self._valid[:, :kept]
            return
        col = torch.arange(width, device=self._valid.device)[None]
        rejected = col >= width - self._block + keep.to(col.device)[:, None]
        valid = self._valid & ~rejected
        if rows is not None:
            valid = valid[rows]
        if rows is not None or width - int(valid.sum(1).max()) >= MAX_DEAD_COLUMNS:
            self._compact(valid, rows)
        else:
            self._valid = valid

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows`, in that order."""
        self._compact(self._valid[rows], rows)

    def _compact(self, valid: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Gather each row's valid columns, right-aligned, into a cache of the minimal width."""
        counts = valid.sum(1)
        width = int(counts.max()) if counts.numel() else 0
        dest = (width - counts)[:, None] + valid.cumsum(1) - 1
        r, c = valid.nonzero(as_tuple=True)
        src = torch.zeros(valid.shape[0], width, dtype=torch.int64, device=valid.device)
        src[r, dest[r, c]] = c
        compacted = GrowingCache()
        for i, layer in enumerate(self._cache.layers):
            k, v = layer.keys, layer.values
            if rows is not None:
                k, v = k[rows], v[rows]
            index = src[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            compacted.update(k.gather(2, index), v.gather(2, index), i)
        self._cache = compacted
        self._valid = torch.arange(width, device=valid.device)[None] >= (width - counts)[:, None]
