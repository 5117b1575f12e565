"""The package imports cheaply: no SGLang, no compiled extension until an op is called."""

import shutil
import subprocess
import sys

import pytest


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


def test_extension_links_the_shared_libstdcxx():
    """_C needs libstdc++.so (torch's), never a private static copy: a copy's iostreams run on the
    locale data of the process's libstdc++.so, and on the H200 image, whose $CXX has only
    libstdc++.a, the first error message holding a number segfaulted the process (setup.py,
    _shared_libstdcxx). Here: the ELF's NEEDED entries, and such a message raised in a fresh
    process (a crash there shows as a signal, not as a Python error)."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    from sglang_dflash import _C

    dynamic = subprocess.run([readelf, "-dW", _C.__file__], capture_output=True, text=True, check=True).stdout
    assert "[libstdc++.so" in dynamic, f"{_C.__file__} does not link libstdc++.so:\n{dynamic}"

    code = (
        "import torch\n"
        "from sglang_dflash import ops\n"
        "try:\n"
        "    ops.verify_block_from_ids(torch.zeros(3, 5, dtype=torch.int64), torch.zeros(7, dtype=torch.int64))\n"
        "except ValueError as exc:\n"
        "    assert 'got shape [7]' in str(exc), exc\n"
        "else:\n"
        "    raise SystemExit('no error raised')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.stderr[-2000:]}"
