"""The draft model's paged context K/V cache: a token-slot pool plus a request -> slots table.

Same layout as SGLang's pools (docs/design.md §3.1): every committed context token owns one slot, and
`req_to_token[r, j]` is the slot of request r's context token j. All draft layers share the slot
ids; layer l's keys live in `k[l]` ([num_slots, kv_heads, head_dim]).
"""

from __future__ import annotations

import torch


class ContextCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int,
                 max_requests: int, max_context: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.req_to_token = torch.zeros(max_requests, max_context, dtype=torch.int64, device=device)
        self.ctx_lens = torch.zeros(max_requests, dtype=torch.int64, device=device)
        self._free_slots = torch.arange(num_slots, device=device)
        self._num_free = num_slots
        self._free_reqs = list(range(max_requests - 1, -1, -1))

    @property
    def max_context(self) -> int:
        return self.req_to_token.shape[1]

    def add_request(self) -> int:
        if not self._free_reqs:
            raise RuntimeError(f"context cache is full: all {self.req_to_token.shape[0]} request rows in use")
        req = self._free_reqs.pop()
        self.ctx_lens[req] = 0
        return req

    def release(self, req: int) -> None:
        n = int(self.ctx_lens[req])
        self._free_slots[self._num_free:self._num_free + n] = self.req_to_token[req, :n]
        self._num_free += n
        self.ctx_lens[req] = 0
        self._free_reqs.append(req)

    def extend(self, reqs: list[int], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate `counts[i]` new context tokens for request `reqs[i]`.

        Returns (slots, positions), each int64 [sum(counts)], request-major: the slots to write and
        the tokens' absolute positions (= their index in the request's context).
        """
        total = sum(counts)
        if total > self._num_free:
            raise RuntimeError(f"context cache is out of slots: need {total}, {self._num_free} free")
        slots = self._free_slots[self._num_free - total:self._num_free].clone()
        self._num_free -= total
        positions = []
        start = 0
        for req, n in zip(reqs, counts, strict=True):
            old = int(self.ctx_lens[req])
            if old + n > self.max_context:
                raise RuntimeError(f"request context of {old + n} tokens exceeds max_context={self.max_context}")
            self.req_to_token[req, old:old + n] = slots[start:start + n]
            self.ctx_lens[req] = old + n
            positions.append(torch.arange(old, old + n, device=slots.device))
            start += n
        return slots, torch.cat(positions)
