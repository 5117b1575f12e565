"""The target's side of training: tapped hidden states (the drafter's context features) and,
for distillation, its logits. Computed without gradients, optionally cached on disk by example."""

from __future__ import annotations

from pathlib import Path

import torch


class TargetFeatures:
    def __init__(self, model, layer_ids: tuple[int, ...], cache_dir: str | Path | None = None):
        self.model = model.eval().requires_grad_(False)
        self.layer_ids = tuple(layer_ids)
        num_layers = model.config.num_hidden_layers
        bad = [i for i in self.layer_ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range for a target with {num_layers} layers")
        self.cache_dir = Path(cache_dir) if cache_dir else None
        if self.cache_dir:
            self.cache_dir.mkdir(parents=True, exist_ok=True)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @torch.no_grad()
    def __call__(self, key: int, input_ids: torch.Tensor, with_logits: bool = False):
        """(features [L, K*H] = concat of HF hidden_states[id + 1], logits [L, V] or None).

        Features of example `key` are read from / written to the cache when there is one;
        logits are never cached (L x V is too large), so distillation recomputes them.
        """
        path = self.cache_dir / f"{key}.pt" if self.cache_dir else None
        if path is not None and path.exists() and not with_logits:
            cached = torch.load(path)
            if torch.equal(cached["input_ids"], input_ids.cpu()):
                return cached["features"].to(self.device), None
        out = self.model(input_ids[None].to(self.device), output_hidden_states=True, use_cache=False)
        features = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
        if path is not None:
            torch.save({"input_ids": input_ids.cpu(), "features": features.cpu()}, path)
        return features, (out.logits[0].float() if with_logits else None)
