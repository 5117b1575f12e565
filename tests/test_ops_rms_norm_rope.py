"""rms_norm_rope (CPU kernel) against the pure-PyTorch reference, against an independent float64
computation and against the draft model's PyTorch composition (RMSNorm module, then apply_rope);
strided head views, partial rotary dims, both pair layouts; its argument errors."""

from __future__ import annotations

import itertools

import pytest
import torch

from sglang_dflash import _extension, ops
from sglang_dflash.models.draft import RMSNorm, apply_rope
from sglang_dflash.ops import reference
from sglang_dflash.ops.testing import sglang_cos_sin_cache

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def make_inputs(n, heads, head_dim, rotary_dim, dtype, *, seed, extra_heads=2, positions=64,
                index_dtype=torch.int64, cos_sin_dtype=torch.float32):
    """x: heads of a wider fused projection (a strided view, as q / k of a qkv output), values of
    varied scale per vector; weight around 1; a cos/sin table and random positions into it."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(n, heads + extra_heads, head_dim, generator=gen)
    fused = fused * torch.exp(torch.randn(n, heads + extra_heads, 1, generator=gen))
    x = fused.to(dtype)[:, extra_heads:]
    weight = (1 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype)
    cos_sin = sglang_cos_sin_cache(rotary_dim, positions).to(cos_sin_dtype)
    pos = torch.randint(0, positions, (n,), generator=gen).to(index_dtype)
    return x, weight, cos_sin, pos


def assert_close(got, want, tol):
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    err = (got.double() - want.double()).abs() / (tol * (1 + want.double().abs()))
    assert bool((err <= 1).all()), f"error up to {float(err.max()):.3g}x the tolerance {tol}"


CASES = [  # (n, heads, head_dim, rotary_dim)
    (1, 1, 16, 16), (3, 9, 64, 64), (5, 3, 64, 32), (17, 2, 128, 128), (4, 4, 80, 40), (2, 8, 8, 2),
]


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_matches_reference(dtype, case, is_neox):
    x, weight, cos_sin, pos = make_inputs(*case, dtype, seed=hash((case, is_neox)) % 1000,
                                          index_dtype=torch.int32 if is_neox else torch.int64,
                                          cos_sin_dtype=torch.bfloat16 if case[0] == 5 else torch.float32)
    before = x.clone()
    got = ops.rms_norm_rope(x, weight, 1e-6, cos_sin, pos, is_neox)
    assert torch.equal(x, before)  # the input is read only
    assert_close(got, reference.rms_norm_rope(x, weight, 1e-6, cos_sin, pos, is_neox), TOLERANCE[dtype])


def test_reference_is_rmsnorm_then_rope_in_float64():
    """The spec itself, against a float64 computation written out by hand (rotate-half pairs)."""
    x, weight, cos_sin, pos = make_inputs(6, 3, 32, 32, torch.float32, seed=7)
    xd = x.double()
    y = xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * weight.double()
    angle = pos.double()[:, None] * (1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32))
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    want = torch.cat([y[..., :16] * cos - y[..., 16:] * sin, y[..., 16:] * cos + y[..., :16] * sin], dim=-1)
    for impl in (reference.rms_norm_rope, ops.rms_norm_rope):
        torch.testing.assert_close(impl(x, weight, 1e-5, cos_sin, pos).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_matches_the_draft_models_pytorch_path(dtype):
    """What the draft model computed before the kernel: its RMSNorm module (rounding to dtype before
    the weight), then apply_rope with cos / sin rows in dtype; close within the dtype's rounding."""
    x, weight, _, _ = make_inputs(5, 3, 64, 64, dtype, seed=3)
    pos = torch.arange(100, 105)
    norm = RMSNorm(64, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    freqs = pos.float()[:, None] * inv_freq.float()[None, :]
    # apply_rope takes one cos / sin column per rotated pair.
    torch_path = apply_rope(reference.rms_norm_rope(x, weight, 1e-6), freqs.cos().to(dtype), freqs.sin().to(dtype))
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    got = ops.rms_norm_rope(x, weight, 1e-6, table, torch.arange(5))
    assert_close(got, torch_path, 4 * TOLERANCE[dtype])


@pytest.mark.parametrize("shape", [(7,), (4, 576), (2, 3, 5, 64)])
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_without_rope_normalizes_any_leading_shape(shape, dtype):
    gen = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    weight = torch.rand(shape[-1], generator=gen).to(dtype) + 0.5
    assert_close(ops.rms_norm_rope(x, weight, 1e-5), reference.rms_norm_rope(x, weight, 1e-5), TOLERANCE[dtype])
    if len(shape) >= 3:  # leading dims that do not flatten by strides
        t = x.transpose(0, 1)
        assert_close(ops.rms_norm_rope(t, weight, 1e-5), reference.rms_norm_rope(t, weight, 1e-5), TOLERANCE[dtype])


def test_rows_are_independent_of_the_batch():
    """Each vector's result is bitwise the same alone or among others (batch invariance)."""
    x, weight, cos_sin, pos = make_inputs(9, 3, 64, 64, torch.bfloat16, seed=11)
    whole = ops.rms_norm_rope(x, weight, 1e-6, cos_sin, pos)
    for r in range(9):
        assert torch.equal(ops.rms_norm_rope(x[r:r + 1], weight, 1e-6, cos_sin, pos[r:r + 1]), whole[r:r + 1])


def test_empty_and_meta():
    x, weight, cos_sin, pos = make_inputs(0, 2, 16, 16, torch.float32, seed=1)
    assert ops.rms_norm_rope(x, weight, 1e-6, cos_sin, pos).shape == (0, 2, 16)
    meta = ops.rms_norm_rope(torch.empty(3, 2, 16, device="meta"), torch.empty(16, device="meta"), 1e-6,
                             torch.empty(8, 16, device="meta"), torch.empty(3, dtype=torch.long, device="meta"))
    assert meta.shape == (3, 2, 16) and meta.device.type == "meta"
    with pytest.raises(ValueError, match=r"weight.shape\[0\] must be D = x.shape\[-1\] = 16"):
        ops.rms_norm_rope(torch.empty(3, 16, device="meta"), torch.empty(8, device="meta"), 1e-6)


X, W, CS, POS = make_inputs(3, 2, 16, 16, torch.float32, seed=2, positions=8)
BAD = {
    "x int": (dict(x=X.long()), r"x must be float32, bfloat16 or float16, got Long"),
    "x strided last dim": (dict(x=X.transpose(1, 2)), r"x must have a contiguous last dimension"),
    "weight size": (dict(weight=W[:8]), r"weight.shape\[0\] must be D = x.shape\[-1\] = 16"),
    "weight dtype": (dict(weight=W.half()), r"weight must be Float, got Half"),
    "positions alone": (dict(cos_sin_cache=None), r"cos_sin_cache and positions go together .* only positions"),
    "cache alone": (dict(positions=None), r"cos_sin_cache and positions go together .* only cos_sin_cache"),
    "2-D x with rope": (dict(x=X[:, 0]), r"x must be 3-D \[N, heads, D\] \(with RoPE\)"),
    "odd rotary": (dict(cos_sin_cache=CS[:, :15]),
                   r"cos_sin_cache.shape\[1\] \(rotary_dim: cos then sin halves\) must be even"),
    "rotary > D": (dict(cos_sin_cache=torch.cat([CS, CS], 1)),
                   r"cos_sin_cache.shape\[1\] .* must be even, in \[2, D = 16\]"),
    "positions length": (dict(positions=POS[:2]), r"positions.shape\[0\] must be N = x.shape\[0\] = 3"),
    "positions float": (dict(positions=POS.float()), r"positions must be int32 or int64, got Float"),
    "position range": (dict(positions=torch.tensor([0, 8, 1])),
                       r"positions\[1\] = 8 is outside the rows \[0, 8\) of cos_sin_cache"),
    "negative position": (dict(positions=torch.tensor([0, 1, -1])), r"positions\[2\] = -1 is outside"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_arguments(name):
    change, message = BAD[name]
    args = dict(x=X, weight=W, eps=1e-6, cos_sin_cache=CS, positions=POS, is_neox=True) | change
    with pytest.raises(ValueError, match="sglang_dflash.rms_norm_rope: " + message):
        ops.rms_norm_rope(**args)
    with pytest.raises(ValueError, match=message):  # the same check behind the registered op
        _extension.ops().rms_norm_rope(*args.values())


def test_other_devices_are_refused_by_name():
    class Fake:
        device = torch.device("cuda", 0)

    with pytest.raises(ValueError, match="rms_norm_rope: is a CPU kernel; x is on cuda:0"):
        ops.rms_norm_rope(Fake(), W, 1e-6)


def test_every_dtype_pair_of_cache_and_x():
    for dtype, cs_dtype in itertools.product(TOLERANCE, TOLERANCE):
        x, weight, cos_sin, pos = make_inputs(4, 2, 32, 32, dtype, seed=5, cos_sin_dtype=cs_dtype)
        assert_close(ops.rms_norm_rope(x, weight, 1e-6, cos_sin, pos),
                     reference.rms_norm_rope(x, weight, 1e-6, cos_sin, pos), TOLERANCE[dtype])
