"""A Hugging Face KV cache that appends in place instead of concatenating.

HF's DynamicCache grows every layer with `torch.cat` on each forward, i.e. it copies the whole
cache once per decode or verify step, a cost that grows with the context (more so after a
rollback, which leaves non-contiguous views to copy). Here every layer keeps a buffer with spare capacity; an update
writes the new tokens after the current ones and exposes the first `length` columns as a view,
which is what attention reads. Rolling back (`layer.keys = layer.keys[:, :, :kept]`, as the
target adapter does) just shortens that view; the next update writes over the rejected columns.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_SPARE_COLUMNS = 64  # spare capacity per growth: at least this many tokens, or a quarter more


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are views [bs, heads, length, dim] of a larger buffer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        # The buffers' [slots, heads, D] views (`slot_view`), made once per buffer: a tree step
        # moves its accepted path through them in every layer.
        self.slots: tuple[torch.Tensor, torch.Tensor] | None = None

    def _is_prefix_of_buffer(self) -> bool:
        """Whether keys/values are still the leading columns of our buffers (anything else, e.g. a
        batch gather or a tensor assigned from outside, is copied into a fresh buffer)."""
        buf = self._key_buffer
        return (buf is not None and self.keys.data_ptr() == buf.data_ptr() and self.keys.stride() == buf.stride()
                and self.values.data_ptr() == self._value_buffer.data_ptr()
                and self.keys.shape[:2] == buf.shape[:2] and self.keys.shape[3] == buf.shape[3])

    def _regrow(self, length: int, needed: int, like: torch.Tensor) -> None:
        """New buffers for `needed` columns plus spare, holding the current first `length`."""
        capacity = needed + max(MIN_SPARE_COLUMNS, needed // 4)
        bs, heads, _, dim = like.shape
        buffers = []
        for old in (self.keys, self.values):
            buf = like.new_empty(bs, heads, capacity, dim)
            if length:
                buf[:, :, :length] = old
            buffers.append(buf)
        self._key_buffer, self._value_buffer = buffers
        self.keys, self.values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]
        self.slots = (slot_view(self._key_buffer), slot_view(self._value_buffer))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.numel() else 0
        end = length + key_states.shape[-2]
        if length and self.keys.shape[0] != key_states.shape[0]:
            raise ValueError(f"KV cache update for batch {key_states.shape[0]} "
                             f"on a cache of batch {self.keys.shape[0]}")
        if not (length and self._is_prefix_of_buffer() and end <= self._key_buffer.shape[2]):
            self._regrow(length, end, key_states)
        self._key_buffer[:, :, length:end] = key_states
        self._value_buffer[:, :, length:end] = value_states
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
        return self.keys, self.values


class GrowingCache(DynamicCache):
    """DynamicCache whose lazily created layers are GrowingLayers."""

    def __init__(self):
        super().__init__()
        self.layer_class_to_replicate = GrowingLayer


def slots_per_row(t: torch.Tensor) -> int:
    """How many slots of `slot_view(t)` one batch row spans (heads * capacity): row b's column c is
    slot b * slots_per_row(t) + c."""
    return t.stride(0) // t.shape[3]


def slot_view(t: torch.Tensor) -> torch.Tensor | None:
    """keys or values [bs, heads, length, D], the leading columns of a [bs, heads, capacity, D]
    buffer (GrowingLayer's), as a [slots, heads, D] view of that buffer: row b's column c is slot
    b * heads * capacity + c, the layout our kernels address a KV pool in (block_attention's
    k_cache, move_slots' buffers). Slots past a row's columns alias other heads' memory: address a
    row's columns only. None for any other layout."""
    bs, heads, _, dim = t.shape
    capacity = t.stride(1) // dim if dim else 0
    if capacity == 0 or t.stride() != (heads * capacity * dim, capacity * dim, dim, 1):
        return None
    return t.as_strided(((bs - 1) * heads * capacity + capacity, heads, dim), (dim, capacity * dim, 1))
