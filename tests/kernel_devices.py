"""The devices the kernel tests run on: the CPU always, CUDA where a GPU and the extension's CUDA
kernels are present (those cases are marked `cuda`, and skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch


def cuda_ready() -> bool:
    """Whether a CUDA GPU and the extension's CUDA kernels are both here."""
    if not torch.cuda.is_available():
        return False
    from sglang_dflash._extension import has_cuda_kernels

    try:
        return has_cuda_kernels()
    except ImportError:
        return False


# For @pytest.mark.parametrize("device", DEVICES).
DEVICES = [
    pytest.param(torch.device("cpu"), id="cpu"),
    pytest.param(torch.device("cuda"), id="cuda", marks=[
        pytest.mark.cuda, pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA GPU and the CUDA kernels")]),
]
