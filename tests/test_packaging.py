"""The package imports cheaply: no SGLang, no compiled extension until an op is called."""

import subprocess
import sys


def test_import_is_light():
    code = (
        "import sys, sglang_dflash, sglang_dflash.ops, sglang_dflash.ops.reference\n"
        "heavy = [m for m in ('sglang', 'sglang_dflash._C') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ops_are_registered_with_torch_library():
    import torch

    from sglang_dflash._extension import ops

    ops()
    for name in ("block_attention", "verify_block", "verify_block_from_ids", "gumbel_argmax", "skinny_linear"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"sglang_dflash::{name}", "CPU")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"sglang_dflash::{name}", "Meta")
