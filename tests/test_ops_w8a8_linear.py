"""w8a8_linear (int8 weight, activations quantized per row) against its reference bit for bit, on
the AMX path where the CPU has AMX-INT8, the VNNI path (where AMX is absent or SGLANG_DFLASH_NO_AMX
is set, in a subprocess) and the portable path (a subprocess with SGLANG_DFLASH_NO_VNNI), its
rounding, special rows, batch invariance, layouts and argument errors."""

from __future__ import annotations

import platform

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash.models.skinny import quantize_rows
from sglang_dflash.ops import reference
from tests.dflash_testlib import cpu_flags, run_fresh_python

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1, 1), (1, 64, 576), (3, 33, 8), (4, 96, 100), (5, 7, 1536), (6, 65, 200), (7, 31, 576),
          (8, 257, 576), (9, 12, 33), (11, 40, 2880), (2, 5, 63), (20, 130, 64), (4, 16384, 576),
          # AMX tile edges (16 weight rows x 16 x rows x 64 bytes of K a tile)
          (16, 17, 64), (17, 48, 128), (33, 16, 640), (3, 15, 1536)]


def _inputs(rows, n, k, dtype, seed, bias=True, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * scale).to(dtype)
    w, s = quantize_rows(torch.randn(n, k, generator=g))
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, s, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", SHAPES)
def test_matches_reference_bit_for_bit(dtype, rows, n, k):
    for seed, bias, scale in ((rows * 131 + n, True, 3.0), (k, False, 1e-3), (n + 7, True, 200.0)):
        x, w, s, b = _inputs(rows, n, k, dtype, seed, bias, scale)
        out = ops.w8a8_linear(x, w, s, b)
        assert out.shape == (rows, n) and out.dtype == dtype
        torch.testing.assert_close(out, reference.w8a8_linear(x, w, s, b), rtol=0, atol=0)


def test_reference_rounds_half_to_even_and_scales_by_the_row_maximum():
    """The spec itself, by hand: a row whose maximum is 127 has inverse scale 1, so q = round(x)."""
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -3.7]])
    q, scale = reference.quantize_activations(x)
    assert q.tolist() == [[127.0, 0.0, 2.0, 2.0, -0.0, -4.0]] and scale.tolist() == [1.0]
    w = torch.tensor([[1, 2, 3, 4, 5, 6], [-127, 0, 0, 0, 0, 1]], dtype=torch.int8)
    s = torch.tensor([0.5, 2.0])
    want = [[(127 + 6 + 8 - 24) * 0.5, (-127 * 127 - 4) * 2.0]]
    assert reference.w8a8_linear(x, w, s).tolist() == want
    assert ops.w8a8_linear(x, w, s).tolist() == want


def test_zero_and_non_finite_rows_and_batch_invariance():
    """An all-zero row gives the bias; a row with NaN or inf gives NaN; the other rows, and every row
    computed alone, are what they are in the batch."""
    x, w, s, b = _inputs(6, 70, 300, torch.float32, seed=3)
    x[1] = 0
    x[3, 17] = float("nan")
    x[4, 5] = float("inf")
    out = ops.w8a8_linear(x, w, s, b)
    assert torch.equal(out[1], b)
    assert out[3].isnan().all() and out[4].isnan().all()
    for m in (0, 2, 5):
        assert torch.equal(out[m], ops.w8a8_linear(x[m:m + 1], w, s, b)[0])
    torch.testing.assert_close(out, reference.w8a8_linear(x, w, s, b), rtol=0, atol=0, equal_nan=True)


def test_layouts_leading_dims_strided_weight_and_non_contiguous_x():
    x, w, s, b = _inputs(6, 50, 130, torch.bfloat16, seed=5)
    wide = torch.randint(-127, 128, (50, 200), dtype=torch.int8)
    wide[:, :130] = w
    strided = wide[:, :130]  # rows 200 bytes apart
    assert strided.stride(0) == 200
    want = reference.w8a8_linear(x, w, s, b)
    assert torch.equal(ops.w8a8_linear(x, strided, s, b), want)
    assert torch.equal(ops.w8a8_linear(x.view(2, 3, 130), w, s, b), want.view(2, 3, 50))
    xt = x.t().contiguous().t()  # same values, column-major
    assert not xt.is_contiguous() and torch.equal(ops.w8a8_linear(xt, w, s, b), want)
    assert ops.w8a8_linear(x[:0], w, s, b).shape == (0, 50)


def test_quantized_error_is_small_against_the_float_product():
    """Activation quantization costs little: within 2 % of the largest output of the float product
    with the same int8 weight (a drafter's proposals, never the output, depend on it)."""
    x, w, s, b = _inputs(8, 512, 576, torch.float32, seed=9)
    exact = x.double() @ (w.double() * s.double()[:, None]).T + b.double()
    err = (ops.w8a8_linear(x, w, s, b).double() - exact).abs().max()
    assert err <= 0.02 * exact.abs().max(), float(err)


def test_meta_infers_the_shape_and_checks_the_arguments():
    x = torch.empty(2, 3, 64, dtype=torch.bfloat16, device="meta")
    w = torch.empty(10, 64, dtype=torch.int8, device="meta")
    s = torch.empty(10, device="meta")
    assert ops.w8a8_linear(x, w, s).shape == (2, 3, 10)
    huge = torch.empty(1, 131073, dtype=torch.int8, device="meta")
    with pytest.raises(ValueError, match="K = weight.shape.1. must be <= 131072"):
        ops.w8a8_linear(torch.empty(1, 131073, device="meta"), huge, torch.empty(1, device="meta"))


@pytest.mark.parametrize("args,match", [
    (lambda x, w, s, b: (x, w.float(), s, b), "weight must be int8"),
    (lambda x, w, s, b: (x, w, s.double(), b), "weight_scale must be Float"),
    (lambda x, w, s, b: (x, w, s[:-1], b), "weight_scale"),
    (lambda x, w, s, b: (x, w, s, b.float()), "bias"),
    (lambda x, w, s, b: (x[:, :-1], w, s, b), r"x.shape\[-1\] must be K"),
    (lambda x, w, s, b: (x.long(), w, s, b), "x must be float32, bfloat16 or float16"),
    (lambda x, w, s, b: (x, w.t().contiguous().t(), s, b), "contiguous last dimension"),
])
def test_bad_arguments_get_one_clear_error(args, match):
    x, w, s, b = _inputs(3, 8, 16, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match=match):
        ops.w8a8_linear(*args(x, w, s, b))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA tensor")
def test_refuses_other_devices_by_name():
    x, w, s, b = _inputs(1, 4, 8, torch.float32, seed=2)
    with pytest.raises(ValueError, match="is a CPU kernel"):
        ops.w8a8_linear(x.cuda(), w.cuda(), s.cuda(), b.cuda())


def test_portable_path_matches_the_reference_too():
    """The loops CPUs without AVX512-VNNI run (forced by SGLANG_DFLASH_NO_VNNI=1 in a fresh
    process, since the choice is made once per process)."""
    code = """
        import torch
        from sglang_dflash import ops
        from sglang_dflash.models.skinny import quantize_rows
        from sglang_dflash.ops import reference
        assert ops.int8_dot_isa() == "portable", ops.int8_dot_isa()
        g = torch.Generator().manual_seed(0)
        for rows, n, k in [(1, 5, 1), (3, 33, 100), (5, 64, 576), (9, 7, 1536)]:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
                w, s = quantize_rows(torch.randn(n, k, generator=g))
                b = torch.randn(n, generator=g).to(dtype)
                assert torch.equal(ops.w8a8_linear(x, w, s, b), reference.w8a8_linear(x, w, s, b)), (rows, n, k)
        print("ok")
    """
    assert run_fresh_python(code, SGLANG_DFLASH_NO_VNNI="1").endswith("ok")


def test_int8_runs_on_amx_tiles_where_the_cpu_has_them():
    """On a CPU with AMX-INT8 (and Linux's grant of the tile state) w8a8_linear multiplies in AMX
    tiles where x has 3 rows or more and K is a multiple of 64, else with AVX512-VNNI, else
    portably."""
    flags = cpu_flags()
    vnni = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags and platform.machine() == "x86_64"
    amx = vnni and {"amx_tile", "amx_int8"} <= flags
    assert ops.int8_dot_isa() == ("amx_int8" if amx else "avx512_vnni" if vnni else "portable")


def test_vnni_path_matches_the_reference_too():
    """VNNI where the CPU has AMX too (forced by SGLANG_DFLASH_NO_AMX=1 in a fresh process): each
    row alone and the batch give the reference's bits, at the shapes the AMX path takes."""
    if ops.int8_dot_isa() != "amx_int8":
        pytest.skip("no AMX path here: the tests above already run VNNI or the portable loops")
    code = """
        import torch
        from sglang_dflash import ops
        from sglang_dflash.models.skinny import quantize_rows
        from sglang_dflash.ops import reference
        assert ops.int8_dot_isa() == "avx512_vnni", ops.int8_dot_isa()
        g = torch.Generator().manual_seed(0)
        for rows, n, k in [(1, 64, 576), (5, 33, 1536), (17, 48, 128), (8, 257, 576)]:
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
                w, s = quantize_rows(torch.randn(n, k, generator=g))
                b = torch.randn(n, generator=g).to(dtype)
                full = ops.w8a8_linear(x, w, s, b)
                assert torch.equal(full, reference.w8a8_linear(x, w, s, b)), (rows, n, k)
                assert all(torch.equal(ops.w8a8_linear(x[m:m + 1], w, s, b), full[m:m + 1]) for m in range(rows))
        print("ok")
    """
    assert run_fresh_python(code, SGLANG_DFLASH_NO_AMX="1").endswith("ok")
