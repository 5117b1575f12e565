"""move_slots (CPU kernel) against the pure-PyTorch reference: random moves in buffers of several
dtypes and layouts (contiguous [S, H, D] pools, the strided slot view of a [bs, H, capacity, D]
cache, 1-D), moves whose sources are other moves' destinations (a swap, a tree path), every byte of
every buffer compared; its argument errors."""

from __future__ import annotations

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash.engine.kv_cache import slot_view
from sglang_dflash.ops import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64]


def random_buffer(shape, dtype, gen):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-100, 100, shape, generator=gen).to(dtype)


def random_moves(slots, n, gen, index_dtype=torch.int64):
    """n moves between random slots: destinations distinct, sources anywhere (repeats allowed), and
    some destinations among the sources."""
    dst = torch.randperm(slots, generator=gen)[:n]
    src = torch.randint(0, slots, (n,), generator=gen)
    src[: n // 2] = dst.flip(0)[: n // 2]  # read slots that another move writes
    return src.to(index_dtype), dst.to(index_dtype)


def check_against_reference(buffers, src, dst):
    want = [b.clone() for b in buffers]
    reference.move_slots(want, src, dst)
    ops.move_slots(buffers, src, dst)
    for got, expected in zip(buffers, want, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(40, 3, 64), (33, 9, 7), (50, 5), (64,), (20, 2, 3, 8)])
@pytest.mark.parametrize("n", [1, 5, 17])
def test_matches_reference(dtype, shape, n):
    gen = torch.Generator().manual_seed(hash((str(dtype), shape, n)) % 10_000)
    buffers = [random_buffer(shape, dtype, gen) for _ in range(3)]
    src, dst = random_moves(shape[0], n, gen, torch.int32 if n % 2 else torch.int64)
    check_against_reference(buffers, src, dst)


@pytest.mark.parametrize("bs", [1, 3])
def test_slot_view_of_a_growing_cache(bs):
    """The engine's use: [bs, H, capacity, D] buffers seen as [slots, H, D] (slot b * H * capacity +
    column); a tree path's nodes move to the first columns of each row's block."""
    gen = torch.Generator().manual_seed(bs)
    heads, capacity, dim, width = 3, 24, 16, 20
    caches = [random_buffer((bs, heads, capacity, dim), torch.bfloat16, gen) for _ in range(4)]
    views = [slot_view(c[:, :, :width]) for c in caches]
    block_start, paths = 12, [[0, 2, 5, 7], [0, 1, 4], [0, 3]][:bs]
    src = [b * heads * capacity + block_start + node for b, p in enumerate(paths) for node in p]
    dst = [b * heads * capacity + block_start + j for b, p in enumerate(paths) for j in range(len(p))]
    want = [c.clone() for c in caches]
    for c in want:
        for b, p in enumerate(paths):
            c[b, :, block_start:block_start + len(p)] = c[b, :, [block_start + node for node in p]]
    ops.move_slots(views, torch.tensor(src), torch.tensor(dst))
    for got, expected in zip(caches, want, strict=True):
        assert torch.equal(got, expected)


def test_every_source_is_read_before_any_write():
    """A swap and a rotation: each destination is another move's source."""
    buffer = torch.arange(24.0).view(6, 4)
    ops.move_slots([buffer], torch.tensor([0, 1]), torch.tensor([1, 0]))
    assert buffer[:2].tolist() == [[4.0, 5.0, 6.0, 7.0], [0.0, 1.0, 2.0, 3.0]]
    check_against_reference([torch.randn(6, 4)], torch.tensor([2, 3, 4]), torch.tensor([3, 4, 2]))


def test_no_moves_and_meta():
    buffer = torch.randn(4, 2)
    before = buffer.clone()
    ops.move_slots([buffer], torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
    assert torch.equal(buffer, before)
    ops.move_slots([torch.empty(4, 2, device="meta")], torch.tensor([1], device="meta"),
                   torch.tensor([0], device="meta"))


def _buffers():
    return [torch.randn(8, 2, 4), torch.randn(6, 4)]


@pytest.mark.parametrize("args, message", [
    (lambda: ([], torch.tensor([0]), torch.tensor([1])), "buffers must hold at least one tensor"),
    (lambda: (_buffers(), torch.tensor([0, 1]), torch.tensor([1])), "src and dst must have one length"),
    (lambda: (_buffers(), torch.tensor([[0]]), torch.tensor([1])), "src must be 1-D"),
    (lambda: (_buffers(), torch.tensor([0.0]), torch.tensor([1])), "src must be int32 or int64"),
    (lambda: (_buffers(), torch.tensor([0]), torch.tensor([6])), r"dst\[0\] = 6 is outside the slots \[0, 6\)"),
    (lambda: (_buffers(), torch.tensor([0, -1]), torch.tensor([1, 2])), r"src\[1\] = -1 is outside"),
    (lambda: (_buffers(), torch.tensor([0, 1]), torch.tensor([2, 2])), "dst.0. and dst.1. are both slot 2"),
    (lambda: ([torch.randn(8, 4).t()], torch.tensor([0]), torch.tensor([1])), "buffers.0. must have a contiguous last"),
    (lambda: ([torch.tensor(1.0)], torch.tensor([0]), torch.tensor([1])), "buffers.0. must have a slot dimension"),
    (lambda: ([torch.randn(8, 4), torch.randn(8, 4, device="meta")], torch.tensor([0]), torch.tensor([1])),
     "buffers.1. is on meta"),
])
def test_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        ops.move_slots(*args())
