"""Loads the compiled extension `sglang_dflash._C`, which registers the torch.ops.sglang_dflash ops."""

from __future__ import annotations

import functools


@functools.cache
def ops():
    """torch.ops.sglang_dflash, with the extension loaded; one clear error when it was not built."""
    import torch

    try:
        from sglang_dflash import _C  # noqa: F401  (importing registers the ops)
    except ImportError as exc:
        raise ImportError(
            "sglang_dflash._C, the compiled kernels, could not be loaded "
            f"({exc}). Build it with `pip install --no-build-isolation -e .` from the repository "
            "root, against the torch that is installed now."
        ) from exc
    return torch.ops.sglang_dflash


@functools.cache
def has_cuda_kernels() -> bool:
    """Whether the loaded extension was built with its CUDA kernels."""
    import torch

    ops()
    return torch._C._dispatch_has_kernel_for_dispatch_key("sglang_dflash::verify_block", "CUDA")
