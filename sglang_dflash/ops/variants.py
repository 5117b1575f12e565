"""Kernel variants: the compiled configurations of an op's CUDA kernel, listed and selected here.

One build holds several configurations of `block_attention`'s tensor-core kernel (keys per tile,
cp.async stages, warps per CTA, split-KV policy; csrc/cuda/NOTES.md) and of `verify_block`'s
sampling kernel, so one GPU run can time and test every one of them. "default" is each op's
first kernel. A CUDA call runs the variant its thread selected with `using_variant`; outside such
a scope, the one `TUNED` names for the GPU's class and the call's shape class (`chosen_variant`);
CPU calls ignore both (the CPU kernels have one configuration). Every variant computes the op's
spec (`reference.py`): tests/test_cuda_ops.py runs each against it.

    >>> kernel_variants("block_attention")
    ['default', 'k64s3w4', ...]
    >>> with using_variant("block_attention", "k64s3w4"):
    ...     out = ops.block_attention(...)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from sglang_dflash._extension import has_cuda_kernels
from sglang_dflash._extension import ops as _ops

__all__ = [
    "OPS",
    "TUNED",
    "chosen_variant",
    "for_call",
    "gpu_class",
    "kernel_variants",
    "selected_variant",
    "shape_class",
    "using_variant",
]

OPS = ("block_attention", "verify_block")

# The shape classes a tuned choice is made per; the host knows these without reading device data.
SHAPE_CLASSES = {
    "block_attention": ("bs1-8", "bs9-32", "bs33+"),  # requests per call
    "verify_block": ("rows1-64", "rows65+"),  # logits rows per call
}

# (GPU class, shape class) -> variant, per op: what calls outside a `using_variant` scope run. Each
# entry names a variant chosen from a committed GPU sweep (bench/results/); "default" until one has.
TUNED: dict[str, dict[tuple[str, str], str]] = {
    op: {(gpu, shape): "default" for gpu in ("sm80", "sm89", "sm90", "sm100") for shape in SHAPE_CLASSES[op]}
    for op in OPS
}


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"sglang_dflash.ops.variants: no op named {op!r} has kernel variants; ops with variants: "
                         f"{', '.join(OPS)}")


def kernel_variants(op: str) -> list[str]:
    """The variants of `op` this build holds, "default" first (["default"] alone without the CUDA
    kernels)."""
    _check_op(op)
    return list(_ops().kernel_variants(op))


def selected_variant(op: str) -> str:
    """The variant this thread's CUDA calls of `op` run ("default" unless `using_variant` chose one)."""
    _check_op(op)
    return _ops().selected_kernel_variant(op)


@contextlib.contextmanager
def using_variant(op: str, name: str) -> Iterator[None]:
    """Within the block, this thread's CUDA calls of `op` run variant `name` (CUDA graphs captured
    inside keep it). An unknown name raises ValueError listing the variants of this build."""
    _check_op(op)
    previous = _ops().select_kernel_variant(op, name)
    try:
        yield
    finally:
        _ops().select_kernel_variant(op, previous)


def gpu_class(device: torch.device | str) -> str:
    """"sm" and the compute capability of a CUDA device, e.g. "sm90" for an H100 or H200."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def shape_class(op: str, *, batch: int) -> str:
    """The shape class of a call: `batch` is the requests (block_attention) or logits rows
    (verify_block) of the call."""
    _check_op(op)
    if op == "block_attention":
        return "bs1-8" if batch <= 8 else "bs9-32" if batch <= 32 else "bs33+"
    return "rows1-64" if batch <= 64 else "rows65+"


def chosen_variant(op: str, device: torch.device | str, *, batch: int) -> str:
    """The variant `TUNED` names for a call of `op` on CUDA `device` with this shape ("default" for
    GPU classes it does not list)."""
    return TUNED[op].get((gpu_class(device), shape_class(op, batch=batch)), "default")


_ANY_TUNED = {op: any(name != "default" for name in TUNED[op].values()) for op in OPS}


def for_call(op: str, device: torch.device, batch: int) -> contextlib.AbstractContextManager:
    """The scope a call of `op` runs in: its tuned variant (`chosen_variant`) on CUDA, unless the
    thread selected one itself. A no-op scope while `TUNED` names "default" everywhere for `op`."""
    if not _ANY_TUNED[op] or device.type != "cuda" or not has_cuda_kernels() or selected_variant(op) != "default":
        return contextlib.nullcontext()
    name = chosen_variant(op, device, batch=batch)
    return contextlib.nullcontext() if name == "default" else using_variant(op, name)
