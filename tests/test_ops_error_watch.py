"""DeviceErrorWatch reads the CUDA kernels' error record a step late and never waits for the step just
queued (with overlap scheduling), reports each recorded error once with the tag of the step it was
found after, and queues nothing where no kernel of ours has run.

No GPU here: the extension's two snapshot ops are replaced by `StandInStream`, a model of one CUDA
stream whose snapshots complete one host step after they are queued. The real ops run in the
cuda-marked test at the end (bench/gpu_check.sh)."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash.ops.error_watch import DeviceErrorWatch
from tests.kernel_devices import cuda_ready


class StandInStream:
    """snapshot_device_errors / read_device_error_snapshot over a simulated stream. A snapshot taken
    after host step i holds `errors_after_step[i]` (the record is reset by each snapshot) and is done
    once `run_one_step` has been called after it, or when the host waits for it. It counts the host's
    waits on the newest snapshot: with lag 1, a wait there would stall the overlap scheduler."""

    SLOTS = 8

    def __init__(self, errors_after_step=None, kernels_ran=True):
        self.errors_after_step = dict(errors_after_step or {})
        self.kernels_ran = kernels_ran
        self.step = 0
        self.queued = []  # [slot, step, done]
        self.unread = set()
        self.snapshots = self.reads = self.waits_on_newest = 0

    def snapshot_device_errors(self, device):
        assert device == 0
        if not self.kernels_ran:
            return -1
        slot = self.snapshots % self.SLOTS
        assert slot not in self.unread, "a slot reused before it was read"
        self.unread.add(slot)
        self.queued.append([slot, self.step, False])
        self.snapshots += 1
        return slot

    def read_device_error_snapshot(self, device, slot, wait):
        self.reads += 1
        entry = next(e for e in self.queued if e[0] == slot and slot in self.unread)
        if wait and entry is self.queued[-1] and not entry[2]:
            self.waits_on_newest += 1
        if not (entry[2] or wait):
            return False, ""
        self.unread.discard(slot)
        self.queued.remove(entry)
        return True, self.errors_after_step.get(entry[1], "")

    def run_one_step(self):
        for entry in self.queued:
            entry[2] = True
        self.step += 1


@pytest.mark.parametrize("seed", range(5))
def test_lag_one_reports_each_error_once_and_never_waits_for_the_newest_step(seed):
    rng = random.Random(seed)
    steps = 60
    errors = {i: f"error after step {i}" for i in range(steps) if rng.random() < 0.2}
    stream = StandInStream(errors)
    watch = DeviceErrorWatch(torch.device("cuda", 0), lag=1, backend=stream)
    reported = {}
    for i in range(steps):
        for error in watch.after_step(tag=i):
            assert error.tag not in reported, "an error reported twice"
            assert error.tag < i, "with lag 1, a step's error is read after the next step is queued"
            reported[error.tag] = error.message
        stream.run_one_step()
    for error in watch.drain():
        reported[error.tag] = error.message
    assert reported == errors
    assert stream.snapshots == steps and stream.waits_on_newest == 0 and not stream.unread


def test_lag_zero_reads_the_steps_own_snapshot_as_it_returns():
    stream = StandInStream({3: "bad slot"})
    watch = DeviceErrorWatch(torch.device("cuda", 0), lag=0, backend=stream)
    for i in range(6):
        found = watch.after_step(tag=i)
        assert [(e.tag, e.message) for e in found] == ([(3, "bad slot")] if i == 3 else [])
        stream.run_one_step()
    assert not stream.unread


def test_a_host_far_ahead_of_the_stream_waits_before_the_ring_overflows():
    stream = StandInStream()
    watch = DeviceErrorWatch(torch.device("cuda", 0), lag=1, backend=stream)
    for i in range(3 * StandInStream.SLOTS):  # the stream never runs on its own
        assert watch.after_step(tag=i) == []
        assert len(stream.unread) <= 2


def test_nothing_is_queued_where_no_kernel_of_ours_has_run():
    stream = StandInStream(kernels_ran=False)
    watch = DeviceErrorWatch(torch.device("cuda", 0), lag=1, backend=stream)
    for i in range(4):
        assert watch.after_step(tag=i) == []
    assert stream.snapshots == 0 and stream.reads == 0


@pytest.mark.parametrize(("device", "lag", "match"), [
    (torch.device("cpu"), 1, "needs an indexed CUDA device"),
    (torch.device("cuda"), 1, "needs an indexed CUDA device"),
    (torch.device("cuda", 0), 2, "lag must be 0 or 1"),
])
def test_bad_arguments_are_refused(device, lag, match):
    with pytest.raises(ValueError, match=match):
        DeviceErrorWatch(device, lag, backend=StandInStream())


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA GPU and the CUDA kernels")
def test_the_extension_snapshot_reports_a_kernels_bad_index_with_the_synchronous_text():
    device = ops.canonical_device("cuda")
    cand = torch.tensor([[1, 2, 99999, 3]], device=device)
    logits = torch.randn(4, 10, device=device)

    def bad_call():
        ops.verify_block(cand, logits, torch.zeros(1, device=device), torch.zeros(1, dtype=torch.int32, device=device),
                         torch.ones(1, device=device), 0, torch.zeros(1, dtype=torch.int64, device=device))

    bad_call()
    with pytest.raises(RuntimeError) as synchronous:
        ops.check_device_errors(device)
    text = str(synchronous.value).split(" (found on")[0]
    watch = DeviceErrorWatch(device, lag=1)
    bad_call()
    found = watch.after_step(tag="bad")  # read only if the stream is done already (no wait)
    found += watch.after_step(tag="clean") + watch.drain()
    assert [e.tag for e in found] == ["bad"] and found[0].message.startswith(text)
    ops.check_device_errors(device)  # the snapshot reset the record
