"""sgl-kernel's CPU index / KV-copy ops, for SGLang installs whose sgl-kernel lacks them.

SGLang 0.5.23's speculative path on CPU calls three ops through `torch.ops.sgl_kernel` (its
`sgl_kernel` Python wrappers forward to them): only a CPU build of sgl-kernel registers them, and
the PyPI wheel is a CUDA build. Without them a DFLASH CPU server dies at its first decode
("'_OpNamespace' 'sgl_kernel' object has no attribute 'copy_all_layer_kv_cache_cpu'").

`register_missing()` defines each op SGLang calls under its own name, with a CPU kernel from our
extension (csrc/cpu/sgl_kernel_compat.cpp), when and only when `torch.ops.sgl_kernel` lacks it: a
real sgl-kernel CPU build keeps its own. Called by the DFLASH worker on CPU, in the scheduler
process (the only one that runs the speculative path), before SGLang's worker is built.
"""

from __future__ import annotations

import logging

from sglang_dflash._extension import ops

logger = logging.getLogger(__name__)

# SGLang's op name -> its schema (the argument lists SGLang's wrappers pass).
SCHEMAS = {
    "copy_all_layer_kv_cache_cpu": "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
    "assign_req_to_token_pool_cpu": (
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor out_cache_loc, int pool_len) -> ()"
    ),
    "assign_extend_cache_locs_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor(a!) out_cache_loc, int pool_len) -> ()"
    ),
}

_library = None  # the torch.library fragment holding what we registered (kept alive)


def _has_op(name: str) -> bool:
    import torch

    try:
        getattr(torch.ops.sgl_kernel, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register_missing() -> list[str]:
    """Registers each op of SCHEMAS that torch.ops.sgl_kernel lacks; returns their names."""
    global _library
    import torch

    try:  # sgl-kernel registers its own ops when imported: let it go first
        import sgl_kernel  # noqa: F401
    except Exception:  # a CUDA build without a driver, or no sgl-kernel: nothing of it to keep
        pass
    missing = [name for name in SCHEMAS if not _has_op(name)]
    if not missing:
        return []
    if _library is None:
        _library = torch.library.Library("sgl_kernel", "FRAGMENT")
    ours = ops()
    for name in missing:
        _library.define(name + SCHEMAS[name])
        _library.impl(name, getattr(ours, "sgl_kernel_" + name), "CPU")
    return missing
