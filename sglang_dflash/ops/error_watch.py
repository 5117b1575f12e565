"""Reads the CUDA kernels' device error record without making the host wait for them.

Our CUDA kernels record an out-of-range index on the device instead of trapping (a trap would end
the CUDA context, and with it every request of a server). `ops.check_device_errors` reads that
record with a stream sync, which a served step must not pay: SGLang's overlap scheduler queues step
N + 1 while step N still runs. A `DeviceErrorWatch` instead takes a snapshot per step (the record
copied into pinned memory and reset, then an event, all queued on the stream) and reads it later:

- `lag=1` (overlap scheduling): after step N + 1 is queued, step N's snapshot is read. The scheduler
  waits for step N's results right after that anyway, and the GPU has step N + 1's work, so the read
  never idles the GPU and still comes before step N's tokens are sent.
- `lag=0` (no overlap): the step's own snapshot is read as the step returns, where the scheduler
  waits for its results next.

A snapshot is read with a wait only when it is at least `lag` steps old; snapshots younger than
that are looked at without waiting, so no call here ever waits for the step just queued.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class SnapshotBackend(Protocol):
    """The two extension ops a watch needs (a seam: the CPU tests count the calls through it)."""

    def snapshot_device_errors(self, device: int) -> int: ...

    def read_device_error_snapshot(self, device: int, slot: int, wait: bool) -> tuple[bool, str]: ...


@dataclass(frozen=True)
class DeviceError:
    """An index error a kernel of ours recorded before the snapshot taken with `tag`."""

    tag: Any
    message: str


class DeviceErrorWatch:
    """Per-step snapshots of one CUDA device's error record, read `lag` steps later."""

    # Snapshots the extension keeps per device (kSnapshotSlots in csrc/cuda/device_errors.cu).
    MAX_UNREAD = 8

    def __init__(self, device: torch.device, lag: int, backend: SnapshotBackend | None = None):
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"DeviceErrorWatch needs an indexed CUDA device, got {device}")
        if lag not in (0, 1):
            raise ValueError(f"DeviceErrorWatch lag must be 0 or 1 (steps), got {lag}")
        if backend is None:
            from sglang_dflash._extension import ops

            backend = ops()
        self.device, self.lag, self._backend = device.index, lag, backend
        self._unread: deque[tuple[int, Any]] = deque()  # (slot, tag), oldest first

    def after_step(self, tag: Any) -> list[DeviceError]:
        """Snapshots the record after the step tagged `tag` (queued, not waited for), then reads
        every snapshot at least `lag` steps old (waiting for those) and any younger one that is
        already done. Returns the errors found, each with the tag of the step it was found after."""
        slot = self._backend.snapshot_device_errors(self.device)
        if slot >= 0:  # -1: no kernel of ours has run on the device, so nothing can be recorded
            self._unread.append((slot, tag))
        return self._read(keep=self.lag)

    def drain(self) -> list[DeviceError]:
        """Reads every unread snapshot, waiting for each (at shutdown, or where the caller syncs)."""
        return self._read(keep=0)

    def _read(self, keep: int) -> list[DeviceError]:
        found = []
        while self._unread:
            slot, tag = self._unread[0]
            # Wait for snapshots older than the `keep` newest, or when the ring would overflow.
            wait = len(self._unread) > keep or len(self._unread) >= self.MAX_UNREAD
            ready, message = self._backend.read_device_error_snapshot(self.device, slot, wait)
            if not ready:
                break  # later snapshots were queued after this one on the same stream
            self._unread.popleft()
            if message:
                found.append(DeviceError(tag, message))
        return found

