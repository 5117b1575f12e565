"""skinny_linear (the CPU few-row linear kernel) against its float64 reference, its batch
invariance, its argument errors, and the SkinnyLinear modules the engine swaps into CPU models."""

from __future__ import annotations

import math
import platform

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sglang_dflash import ops
from sglang_dflash.models import skinny
from sglang_dflash.models.skinny import (
    CHUNK_ROWS,
    GEMM_MIN_ROWS,
    MAX_ROWS,
    Int8Linear,
    SkinnyLinear,
    batch_invariant,
    gemm_rows,
    quantize_rows,
    use_skinny_linear,
)
from sglang_dflash.ops import reference
from sglang_dflash.ops.testing import skinny_linear_error_ratio
from tests.dflash_testlib import cpu_flags, int8_linear_is_right, run_fresh_python

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(rows, n, k, dtype, seed, bias=True, lead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _assert_close(out, x, w, b):
    """|out - exact| within what the kernel's arithmetic allows (ops/testing.py)."""
    ratio = skinny_linear_error_ratio(out, x, w, b).max().item()
    assert ratio <= 1, f"error up to {ratio:.3g}x the bound"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", [(1, 1, 1), (1, 64, 576), (3, 33, 8), (4, 96, 100), (5, 7, 1536),
                                      (6, 65, 200), (7, 31, 576), (8, 257, 576), (9, 12, 33), (11, 40, 576),
                                      (12, 129, 96), (16, 130, 19), (37, 20, 64), (2, 9, 40)])
def test_matches_reference(dtype, rows, n, k):
    for seed, bias in ((rows * 131 + n, True), (k, False)):
        x, w, b = _inputs(rows, n, k, dtype, seed, bias)
        out = ops.skinny_linear(x, w, b)
        assert out.shape == (rows, n) and out.dtype == dtype
        _assert_close(out, x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [19, 100, 576, 1536 + 7])
def test_bound_rejects_a_kernel_that_drops_the_k_tail(dtype, k):
    """The bound can fail: outputs that leave out the last t products of every dot product (a
    vector loop without its scalar tail) are rejected, where the kernel's own output passes."""
    x, w, b = _inputs(4, 256, k, dtype, seed=k)
    _assert_close(ops.skinny_linear(x, w, b), x, w, b)
    for t in (1, 4, 8):
        head = x.clone()
        head[..., -t:] = 0
        with pytest.raises(AssertionError, match="the bound"):
            _assert_close(reference.skinny_linear(head, w, b), x, w, b)


def test_leading_dims_and_strided_inputs():
    x, w, b = _inputs(3, 40, 72, torch.float32, 5, lead=(2,))
    wide = torch.randn(40, 100)
    wide[:, :72] = w  # weight rows 100 apart in memory
    x_t = x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous
    out = ops.skinny_linear(x_t, wide[:, :72], b)
    assert out.shape == (2, 3, 40)
    _assert_close(out, x, w, b)


def test_each_row_is_bitwise_independent_of_the_others():
    """A verify pass over B tokens must compute exactly what one-token decode steps compute."""
    for dtype in DTYPES:
        x, w, b = _inputs(13, 101, 577, dtype, 11)
        full = ops.skinny_linear(x, w, b)
        for i in range(13):
            assert torch.equal(ops.skinny_linear(x[i:i + 1], w, b)[0], full[i])
        for m in range(2, 13):  # every split of the rows into register tiles (6 + 6, 4 + 3, ...)
            assert torch.equal(ops.skinny_linear(x[:m], w, b), full[:m])
        assert torch.equal(ops.skinny_linear(x[5:9], w, b), full[5:9])


def test_the_widest_fma_path_this_cpu_has_is_taken():
    isa = ops.float_dot_isa()
    assert isa in ("avx512", "avx2", "portable")
    if platform.machine() == "x86_64":
        wide = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()
        assert isa == ("avx512" if wide else "avx2")


def test_avx2_path_matches_the_reference_and_is_batch_invariant_too():
    """The 8-lane path CPUs without AVX-512 run (forced by SGLANG_DFLASH_NO_AVX512=1 in a fresh
    process: the path is chosen once per process). On such a CPU this repeats the tests above."""
    if ops.float_dot_isa() == "portable":
        pytest.skip("built without AVX2")
    code = """
        import torch
        from sglang_dflash import ops
        from sglang_dflash.models.skinny import quantize_rows
        from sglang_dflash.ops.testing import skinny_linear_error_ratio
        assert ops.float_dot_isa() == "avx2", ops.float_dot_isa()
        g = torch.Generator().manual_seed(3)
        for rows, n, k in [(1, 5, 1), (5, 33, 100), (9, 64, 576), (13, 7, 1536 + 7)]:
            for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
                x = torch.randn(rows, k, generator=g).to(torch.float32 if dtype == torch.int8 else dtype)
                w, s = torch.randn(n, k, generator=g), None
                w, s = quantize_rows(w) if dtype == torch.int8 else (w.to(dtype), None)
                b = torch.randn(n, generator=g).to(x.dtype)
                full = ops.skinny_linear(x, w, b, s)
                assert (skinny_linear_error_ratio(full, x, w, b, s) <= 1).all(), (rows, n, k, dtype)
                for m in range(1, rows):
                    assert torch.equal(ops.skinny_linear(x[m:], w, b, s), full[m:]), (rows, m, dtype)
        print("ok")
    """
    assert run_fresh_python(code, SGLANG_DFLASH_NO_AVX512="1") == "ok"


def test_bf16_runs_on_amx_tiles_where_the_cpu_has_them():
    """bf16 x with a bf16 weight takes AMX (skinny_linear_amx.cpp) on a CPU with AMX-BF16 (Linux
    grants the tile state from 5.16 on), else the fp32 FMA path."""
    isa = ops.bf16_dot_isa()
    amx = {"amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx512bw", "avx512vl"} <= cpu_flags()
    assert isa == ("amx_bf16" if amx and platform.machine() == "x86_64" else ops.float_dot_isa())


@pytest.mark.parametrize("rows,n,k", [(1, 16, 32), (3, 49, 64), (16, 100, 576), (17, 33, 96), (37, 130, 1536),
                                      (32, 48, 640), (33, 17, 64), (5, 7, 40), (9, 31, 577)])
def test_bf16_tiles_edges_match_reference_and_are_batch_invariant(rows, n, k):
    """Where AMX serves bf16: partial weight tiles (n % 16), x rows past one tile (16; pairs of x
    tiles share each weight tile load, and an odd last one runs alone), K with and
    without a tail past whole 32-value steps (each its own epilogue), strided weight rows; every
    row bitwise the same alone. Elsewhere this repeats the FMA path's checks."""
    x, w, b = _inputs(rows, n, k, torch.bfloat16, seed=rows * 7 + n)
    wide = torch.randn(n, k + 24).to(torch.bfloat16)
    wide[:, :k] = w
    for weight, bias in ((w, b), (wide[:, :k], None)):
        full = ops.skinny_linear(x, weight, bias)
        _assert_close(full, x, w, bias)
        for i in (0, rows // 2, rows - 1):
            assert torch.equal(ops.skinny_linear(x[i:i + 1], weight, bias)[0], full[i])
        assert torch.equal(ops.skinny_linear(x[1:], weight, bias), full[1:])


def test_bf16_fma_path_with_amx_turned_off():
    """SGLANG_DFLASH_NO_AMX=1 (read once per process) keeps bf16 on the FMA path, within the same
    bound and batch invariant."""
    code = """
        import torch
        from sglang_dflash import ops
        from sglang_dflash.ops.testing import skinny_linear_error_ratio
        assert ops.bf16_dot_isa() == ops.float_dot_isa(), ops.bf16_dot_isa()
        g = torch.Generator().manual_seed(5)
        x, w, b = (torch.randn(*s, generator=g).to(torch.bfloat16) for s in ((9, 576), (40, 576), (40,)))
        full = ops.skinny_linear(x, w, b)
        assert (skinny_linear_error_ratio(full, x, w, b) <= 1).all()
        assert torch.equal(ops.skinny_linear(x[4:], w, b), full[4:])
        print("ok")
    """
    assert run_fresh_python(code, SGLANG_DFLASH_NO_AMX="1") == "ok"


def test_empty_inputs():
    assert ops.skinny_linear(torch.randn(0, 8), torch.randn(5, 8)).shape == (0, 5)
    assert ops.skinny_linear(torch.randn(3, 8), torch.randn(0, 8)).shape == (3, 0)
    out = ops.skinny_linear(torch.randn(2, 0), torch.randn(4, 0), torch.arange(4.0))
    assert torch.equal(out, torch.arange(4.0).expand(2, 4))


def test_meta_shape():
    out = ops.skinny_linear(torch.empty(2, 3, 8, device="meta"), torch.empty(5, 8, device="meta"))
    assert out.shape == (2, 3, 5) and out.device.type == "meta"


@pytest.mark.parametrize("x,w,b,match", [
    (torch.randn(2, 8), torch.randn(5, 8, 1), None, r"weight must be 2-D \[N, K\]"),
    (torch.randn(2, 7), torch.randn(5, 8), None, r"x.shape\[-1\] must be K = weight.shape\[1\] = 8"),
    (torch.randn(2, 8), torch.randn(5, 8).double(), None, "weight must be float32, bfloat16 or float16"),
    (torch.randn(2, 8).bfloat16(), torch.randn(5, 8), None, "x must be Float, got BFloat16"),
    (torch.randn(2, 8), torch.randn(8, 5).T, None, "weight must have a contiguous last dimension"),
    (torch.randn(2, 8), torch.randn(5, 8), torch.randn(4), r"bias.shape\[0\] must be N"),
    (torch.randn(2, 8), torch.randn(5, 8), torch.randn(5).half(), "bias must be Float, got Half"),
    (torch.tensor(1.0), torch.randn(5, 8), None, "x must have at least 1 dimension"),
])
def test_bad_arguments(x, w, b, match):
    with pytest.raises(ValueError, match=match):
        ops.skinny_linear(x, w, b)


def test_module_swap_keeps_parameters_ties_and_falls_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 12, bias=False))
    model[2].weight = model[0].weight  # tied, like an LM head and its embedding
    params = [p.data_ptr() for p in model.parameters()]
    few, many = torch.randn(3, 12), torch.randn(MAX_ROWS + 1, 12)
    with torch.no_grad():
        expected = [model(few), model(many)]
    assert use_skinny_linear(model) == 2 and isinstance(model[0], SkinnyLinear)
    assert [p.data_ptr() for p in model.parameters()] == params and model[2].weight is model[0].weight
    calls = []
    model[0].register_forward_hook(lambda *a: calls.append(1))  # hooks keep working
    with torch.no_grad():
        torch.testing.assert_close(model(few), expected[0], rtol=1e-5, atol=1e-6)
        assert torch.equal(model(many), expected[1])  # above MAX_ROWS: torch's own linear
        with batch_invariant():  # ... except in decode and verify steps: every row as it is alone
            assert torch.equal(model(many), torch.cat([model(row[None]) for row in many]))
    assert len(calls) == 2 + 1 + len(many)
    loss = model(few).square().sum()  # autograd on: torch's linear, gradients flow
    loss.backward()
    assert model[0].weight.grad is not None
    assert use_skinny_linear(model) == 0  # already swapped


def test_module_matches_torch_linear_for_few_rows():
    layer = nn.Linear(64, 96)
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        expected = F.linear(x, layer.weight, layer.bias)
        use_skinny_linear(layer)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def gemm_row_counts(monkeypatch) -> list[int]:
    """The row counts torch's F.linear is called with from now on (a spy around the real one)."""
    seen, real = [], F.linear

    def spy(x, weight, bias=None):
        seen.append(x.numel() // x.shape[-1] if x.shape[-1] else 0)
        return real(x, weight, bias)

    monkeypatch.setattr(F, "linear", spy)
    return seen


def test_gemm_row_counts_are_few_and_pad_by_at_most_a_third():
    counts = {gemm_rows(m) for m in range(1, 20001)}
    assert len(counts) <= 2 * math.log2(20000 / GEMM_MIN_ROWS) + 2
    for m in range(GEMM_MIN_ROWS + 1, 20001):
        assert m <= gemm_rows(m) and gemm_rows(m) - m < gemm_rows(m) / 3  # under a third is padding
    assert gemm_rows(1) == gemm_rows(GEMM_MIN_ROWS) == GEMM_MIN_ROWS and gemm_rows(33) == 48 and gemm_rows(49) == 64


@pytest.mark.parametrize("shape", [(17, 64), (32, 64), (33, 64), (2, 50, 40), (511, 96), (512, 96), (513, 96),
                                   (3, 700, 24), (1600, 8)])
def test_bf16_gemm_runs_in_bounded_row_counts_and_each_row_is_its_linear(monkeypatch, shape):
    g = torch.Generator().manual_seed(sum(shape))
    k, n = shape[-1], 48
    x = torch.randn(*shape, generator=g).bfloat16()
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    expected = F.linear(x.float(), w.float(), b.float())
    plain = F.linear(x, w, b)
    seen = gemm_row_counts(monkeypatch)
    out = skinny.bounded_rows_linear(x, w, b)
    assert seen == [gemm_rows(x.numel() // k)]
    assert out.shape == (*shape[:-1], n) and out.dtype == torch.bfloat16 and out.is_contiguous()
    # bf16 output: one rounding of an fp32-accumulated dot product
    tolerance = {"rtol": 2 ** -7, "atol": 2 ** -7 * expected.abs().max().item()}
    torch.testing.assert_close(out.float(), expected, **tolerance)
    torch.testing.assert_close(out, plain, **tolerance)


def test_only_bf16_on_the_cpu_is_bounded_and_an_empty_input_passes_through(monkeypatch):
    assert skinny.gemm_rows_bounded(torch.randn(40, 16).bfloat16())
    assert not skinny.gemm_rows_bounded(torch.randn(40, 16, device="meta").bfloat16())
    assert not skinny.gemm_rows_bounded(torch.randn(40, 16))
    assert not skinny.gemm_rows_bounded(torch.randn(40, 16).half())
    seen = gemm_row_counts(monkeypatch)
    out = skinny.bounded_rows_linear(torch.randn(2, 0, 16).bfloat16(), torch.randn(8, 16).bfloat16())
    assert out.shape == (2, 0, 8) and seen == [0]


def _int8_inputs(rows, n, k, x_dtype, seed, bias=True):
    """x in x_dtype, an int8 weight spanning [-127, 127] with row scales of varied magnitude."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(x_dtype)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 10.0 ** torch.randint(-4, 1, (n,), generator=g)
    b = torch.randn(n, generator=g).to(x_dtype) if bias else None
    return x, w, b, scale


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", [(1, 1, 1), (1, 64, 576), (2, 33, 8), (3, 97, 100), (5, 7, 1536),
                                      (8, 258, 577), (16, 130, 19), (37, 21, 64)])
def test_int8_weight_matches_reference(x_dtype, rows, n, k):
    """Weight-only int8: column n is scale[n] * (x . w[n]) + b[n], in x's dtype, within the bound;
    N not a multiple of the 4-row weight tile, K with and without a vector tail."""
    for seed, bias in ((rows * 7 + n, True), (k + 1, False)):
        x, w, b, scale = _int8_inputs(rows, n, k, x_dtype, seed, bias)
        out = ops.skinny_linear(x, w, b, scale)
        assert out.shape == (rows, n) and out.dtype == x_dtype
        ratio = skinny_linear_error_ratio(out, x, w, b, scale).max().item()
        assert ratio <= 1, f"error up to {ratio:.3g}x the bound"


def test_int8_bound_rejects_a_missing_or_wrong_scale():
    """The int8 bound can fail: the unscaled sums, or the scales of the neighbouring rows, are
    rejected where the kernel's output passes."""
    x, w, b, scale = _int8_inputs(3, 40, 96, torch.float32, 3)
    assert skinny_linear_error_ratio(ops.skinny_linear(x, w, b, scale), x, w, b, scale).max() <= 1
    for wrong in (torch.ones_like(scale), scale.roll(1)):
        assert skinny_linear_error_ratio(reference.skinny_linear(x, w, b, wrong), x, w, b, scale).max() > 1


def test_int8_rows_are_bitwise_independent_of_the_others():
    x, w, b, scale = _int8_inputs(11, 101, 577, torch.bfloat16, 8)
    full = ops.skinny_linear(x, w, b, scale)
    for i in range(11):
        assert torch.equal(ops.skinny_linear(x[i:i + 1], w, b, scale)[0], full[i])


@pytest.mark.parametrize("w,b,scale,match", [
    (torch.ones(5, 8, dtype=torch.int8), None, None, "an int8 weight needs weight_scale"),
    (torch.randn(5, 8), None, torch.ones(5), "weight_scale is given, so weight must be int8"),
    (torch.ones(5, 8, dtype=torch.int8), None, torch.ones(4), r"weight_scale.shape\[0\] must be N"),
    (torch.ones(5, 8, dtype=torch.int8), None, torch.ones(5).double(), "weight_scale must be Float, got Double"),
    (torch.ones(5, 8, dtype=torch.int8), None, torch.ones(5, 1), r"weight_scale must be 1-D \[N\]"),
    (torch.ones(5, 8, dtype=torch.int8), torch.ones(5).bfloat16(), torch.ones(5), "bias must be Float, got BFloat16"),
])
def test_int8_bad_arguments(w, b, scale, match):
    with pytest.raises(ValueError, match=match):
        ops.skinny_linear(torch.randn(2, 8), w, b, scale)


def test_int8_needs_a_float_x_and_has_a_meta_kernel():
    w, scale = torch.ones(5, 8, dtype=torch.int8), torch.ones(5)
    with pytest.raises(ValueError, match="x must be float32, bfloat16 or float16, got Double"):
        ops.skinny_linear(torch.randn(2, 8).double(), w, None, scale)
    out = ops.skinny_linear(torch.empty(3, 8, dtype=torch.bfloat16, device="meta"), w.to("meta"), None,
                            scale.to("meta"))
    assert out.shape == (3, 5) and out.dtype == torch.bfloat16 and out.device.type == "meta"


def test_quantize_rows_round_trip_and_edges():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(33, 70, generator=g) * torch.logspace(-3, 1, 33)[:, None]
    w[4] = 0  # an all-zero row: scale 1, all zeros
    q, scale = quantize_rows(w.bfloat16())
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == w.shape and scale.shape == (33,)
    assert scale[4] == 1 and not q[4].any()
    assert int(q.abs().amax(dim=1)[torch.arange(33) != 4].min()) == 127  # every row uses the full range
    err = (q.float() * scale[:, None] - w.bfloat16().float()).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-6)).all())
    with pytest.raises(ValueError, match="finite 2-D weight"):
        quantize_rows(torch.tensor([[1.0, float("nan")]]))


def test_int8_linear_module_few_and_many_rows_and_off_cpu():
    """Int8Linear computes F.linear with the dequantized weight: through a kernel for any row
    count on the CPU (past MAX_ROWS and CHUNK_ROWS too; w8a8_linear where the CPU has VNNI, bit for
    bit its reference, else skinny_linear), dequantized on another device (meta here)."""
    layer = nn.Linear(64, 40).bfloat16()
    q = Int8Linear(layer)
    dequantized = (q.weight.float() * q.weight_scale[:, None]).bfloat16()
    for rows in (1, 3, MAX_ROWS + 5, CHUNK_ROWS + 172):
        x = torch.randn(rows, 64).bfloat16()
        with torch.no_grad():
            out = q(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 40)
        assert int8_linear_is_right(out, x, q.weight, q.bias, q.weight_scale), rows
        torch.testing.assert_close(out, F.linear(x, dequantized, q.bias), rtol=2e-2, atol=2e-2)
    assert q.to("meta")(torch.empty(2, 64, dtype=torch.bfloat16, device="meta")).shape == (2, 40)
