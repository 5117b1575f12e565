"""materialize_context_kv (CPU kernel) against the pure-PyTorch reference and against SGLang's
per-layer composition of plain torch ops, writing into poisoned pools; its argument errors."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from sglang_dflash import _extension, ops
from sglang_dflash.ops import reference
from sglang_dflash.ops.testing import make_context_kv_inputs as make_inputs
from sglang_dflash.ops.testing import sglang_cos_sin_cache

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = list(TOLERANCE)


def _storage(t):
    """The whole tensor a pool is a view of, padding included."""
    return t if t._base is None else t._base


def _bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _clone_view(t):
    return _storage(t).clone().as_strided(t.shape, t.stride(), t.storage_offset())


def assert_rows_close(got, want, tol):
    """got / want [n, Hkv, D]: every (row, head)'s max of |got - want| / (tol * (1 + |want|)) <= 1."""
    assert torch.isfinite(got).all(), "non-finite values (an element never written keeps its NaN poison)"
    err = ((got.float() - want.float()).abs() / (tol * (1 + want.float().abs()))).amax(-1)
    if err.numel():
        worst = divmod(int(err.argmax()), err.shape[1])
        assert err.max() <= 1, f"(row, head) {worst}: error {float(err.max()):.2f} x the tolerance {tol}"


def check_against_reference(args, run=ops.materialize_context_kv):
    """Runs `run` on args and the reference on copies of the pools (on their device). Written rows
    must agree within the coarser dtype's tolerance; all else in the pools' storage keeps its bits."""
    pools = args["k_caches"] + args["v_caches"]
    before = [_storage(p).clone() for p in pools]
    ref_k, ref_v = [_clone_view(p) for p in args["k_caches"]], [_clone_view(p) for p in args["v_caches"]]
    run(**args)
    reference.materialize_context_kv(**{**args, "k_caches": ref_k, "v_caches": ref_v})
    tol = max(TOLERANCE[args["ctx"].dtype], TOLERANCE[pools[0].dtype])
    slots = args["out_loc"][args["out_loc"] >= 0].long()
    for out, ref, old in zip(pools, ref_k + ref_v, before, strict=True):
        written = torch.zeros(old.shape, dtype=torch.bool, device=old.device)
        written.as_strided(out.shape, out.stride(), out.storage_offset())[slots] = True
        assert torch.equal(_bits(_storage(out))[~written], _bits(old)[~written]), "wrote outside out_loc"
        assert_rows_close(out[slots], ref[slots], tol)


def _grid_cases():
    """A seeded sample of the full grid, plus the corners that break kernels most often."""
    rng = random.Random(4321)
    grid = list(
        itertools.product(
            [1, 2, 5, 16, 17, 40],  # N: skinny_linear up to 16 rows, at::linear above
            [1, 2, 3],  # L
            [1, 2, 3, 4],  # Hkv
            [(64, 64), (64, 30), (128, 128), (128, 46)],  # (D, rotary_dim): odd rotary_dim / 2 too
            DTYPES,  # ctx
            DTYPES,  # pools
            [True, False],  # is_neox
        )
    )
    cases = []
    for i, (n, layers, hkv, (d, rot), dtype, pool_dtype, neox) in enumerate(rng.sample(grid, 40)):
        kwargs = dict(
            pool_dtype=pool_dtype, is_neox=neox, seed=i, bias=rng.random() < 0.3,
            index_dtype=rng.choice([torch.int32, torch.int64]), skip=rng.choice([0, n // 3, n - 1]),
            poison=rng.choice(["nan", "sentinel"]),
        )  # fmt: skip
        cases.append(((n, rng.choice([64, 100, 576]), layers, hkv, d, rot, dtype), kwargs))
    smol = (4, 576, 3, 3, 64, 64, torch.float16)  # the shipped SmolLM2 drafter at decode
    cases += [
        (smol, dict(seed=100)),
        (smol, dict(seed=101, pool_dtype=torch.bfloat16, bias=True, index_dtype=torch.int32)),
        ((7, 64, 2, 2, 64, 64, torch.bfloat16), dict(seed=102, skip=7)),  # every row skipped
        ((9, 96, 2, 3, 64, 32, torch.bfloat16), dict(seed=103, pad=1, is_neox=False)),  # strided, unaligned pools
        ((6, 64, 1, 2, 80, 80, torch.float32), dict(seed=104, pad=3, poison="sentinel")),  # D not a power of 2
        ((5, 64, 2, 1, 64, 64, torch.bfloat16), dict(seed=105, cos_sin_dtype=torch.bfloat16)),  # SGLang CPU cache
        ((5, 64, 2, 1, 64, 64, torch.float32), dict(seed=106, cos_sin_dtype=torch.float16, eps=0.1)),
        ((33, 200, 2, 4, 128, 128, torch.float16), dict(seed=107, pool_dtype=torch.float32, skip=5)),
        ((1, 64, 1, 1, 64, 2, torch.float32), dict(seed=108, is_neox=False)),  # one rotated pair
    ]
    return cases


@pytest.mark.parametrize("shape,kwargs", _grid_cases())
def test_matches_reference(shape, kwargs):
    check_against_reference(make_inputs(*shape, **kwargs))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_matches_sglang_per_layer_composition(dtype, rotary_dim):
    """What SGLang's CPU path does layer by layer with plain torch ops: k_proj / v_proj out of the
    fused qkv_proj weight, Qwen3's k_norm, rotate-half RoPE from its cos_sin_cache, set_kv_buffer."""
    gen = torch.Generator().manual_seed(rotary_dim)
    n, hidden, layers, hq, hkv, d, eps = 9, 128, 2, 4, 2, 64, 1e-6
    q_size, kv_size = hq * d, hkv * d
    qkv = [(torch.randn(q_size + 2 * kv_size, hidden, generator=gen) / hidden**0.5).to(dtype) for _ in range(layers)]
    k_norm = [(1 + 0.3 * torch.randn(d, generator=gen)).to(dtype) for _ in range(layers)]
    ctx = torch.randn(n, hidden, generator=gen).to(dtype)
    positions = torch.randint(0, 4000, (n,), generator=gen)
    out_loc = torch.tensor([5, -1, 0, 11, 3, -1, 8, 1, 2])
    cache = sglang_cos_sin_cache(rotary_dim, 4096)
    slots = 12

    expected_k = [torch.zeros(slots, hkv, d, dtype=dtype) for _ in range(layers)]
    expected_v = [torch.zeros(slots, hkv, d, dtype=dtype) for _ in range(layers)]
    keep = out_loc >= 0
    for layer in range(layers):
        w = qkv[layer]
        k = F.linear(ctx, w[q_size : q_size + kv_size]).view(n, hkv, d)
        v = F.linear(ctx, w[q_size + kv_size :]).view(n, hkv, d)
        kf = k.float()
        k = (kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * k_norm[layer]
        cos, sin = cache[positions].chunk(2, dim=-1)
        cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
        rot = k[..., :rotary_dim].float()
        k = torch.cat([(rot * cos + _rotate_half(rot) * sin).to(dtype), k[..., rotary_dim:]], dim=-1)
        expected_k[layer][out_loc[keep]] = k[keep]
        expected_v[layer][out_loc[keep]] = v[keep]

    k_caches = [torch.zeros(slots, hkv, d, dtype=dtype) for _ in range(layers)]
    v_caches = [torch.zeros(slots, hkv, d, dtype=dtype) for _ in range(layers)]
    ops.materialize_context_kv(ctx, [w[q_size:] for w in qkv], None, k_norm, eps, cache, True, positions, out_loc,
                               k_caches, v_caches)
    tol = TOLERANCE[dtype]
    for got, want in zip(k_caches + v_caches, expected_k + expected_v, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_empty_batch_writes_nothing():
    args = make_inputs(3, 64, 2, 2, 64, 64, torch.float32, seed=9, poison="sentinel")
    before = [p.clone() for p in args["k_caches"] + args["v_caches"]]
    for name in ("ctx", "positions", "out_loc"):
        args[name] = args[name][:0]
    ops.materialize_context_kv(**args)
    assert all(torch.equal(a, b) for a, b in zip(args["k_caches"] + args["v_caches"], before, strict=True))


def test_meta_tensors_validate_without_data():
    """FakeTensor / torch.compile path: the Meta kernel runs the argument checks, writes nothing."""
    args = make_inputs(4, 64, 2, 2, 64, 32, torch.bfloat16, seed=5, bias=True)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    for name in ("kv_weights", "kv_biases", "k_norm_weights", "k_caches", "v_caches"):
        meta[name] = [t.to("meta") for t in args[name]]
    assert ops.materialize_context_kv(**meta) is None
    with pytest.raises(ValueError, match=r"k_norm_weights\[1\].shape\[0\] must be D"):
        ops.materialize_context_kv(**{**meta, "k_norm_weights": [meta["k_norm_weights"][0], meta["ctx"][0, :8]]})


def test_torch_compile_keeps_the_pool_writes():
    """The mutation annotations let torch.compile functionalize the op and write the pools back."""
    args = make_inputs(5, 64, 2, 2, 64, 64, torch.float32, seed=6, skip=1)
    static = {k: v for k, v in args.items() if k not in ("ctx", "k_caches", "v_caches")}

    op = _extension.ops().materialize_context_kv  # the torch op itself: what a compiled model calls

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(ctx, k_caches, v_caches):
        op(
            ctx * 1.0, static["kv_weights"], None, static["k_norm_weights"], static["eps"], static["cos_sin_cache"],
            True, static["positions"], static["out_loc"], k_caches, v_caches, static["v_scale"])

    check_against_reference(args, run=lambda ctx, k_caches, v_caches, **_: step(ctx, k_caches, v_caches))


def _set(args, name, value):
    return {**args, name: value}


def _with_item(args, name, index, value):
    items = list(args[name])
    items[index] = value
    return _set(args, name, items)


def _bad_cases():
    a = make_inputs(3, 32, 2, 2, 16, 8, torch.float32, seed=0, bias=True, skip=1)
    k0, v1, w0 = a["k_caches"][0], a["v_caches"][1], a["kv_weights"][0]
    pos, loc = a["positions"], a["out_loc"]
    slot = int(loc[loc >= 0][0])
    yield "ctx_rank", _set(a, "ctx", a["ctx"][0]), r"ctx must be 2-D \[N, H\]"
    yield "ctx_dtype", _set(a, "ctx", a["ctx"].double()), "ctx must be float32, bfloat16 or float16"
    yield "no_layers", _set(a, "kv_weights", []), "kv_weights must hold at least one layer"
    yield "norm_count", _set(a, "k_norm_weights", a["k_norm_weights"][:1]), \
        r"k_norm_weights must hold one tensor per layer \(L = 2"
    yield "k_count", _set(a, "k_caches", a["k_caches"] * 2), "k_caches must hold one tensor per layer"
    yield "v_count", _set(a, "v_caches", a["v_caches"][:1]), "v_caches must hold one tensor per layer"
    yield "bias_count", _set(a, "kv_biases", a["kv_biases"][:1]), "kv_biases must hold one tensor per layer"
    yield "pool_rank", _with_item(a, "k_caches", 0, k0[0]), r"k_caches\[0\] must be 3-D \[S, Hkv, D\]"
    yield "pool_dtype", _with_item(a, "k_caches", 0, k0.double()), r"k_caches\[0\] must be float32"
    yield "pool_dtypes_differ", _with_item(a, "v_caches", 0, k0.half()), r"v_caches\[0\] must have k_caches\[0\]'s"
    yield "pool_slots", _with_item(a, "v_caches", 1, v1[:-1]), r"v_caches\[1\].shape\[0\] must be S"
    yield "pool_heads", _with_item(a, "k_caches", 1, v1[:, :1]), r"k_caches\[1\].shape\[1\] must be Hkv"
    yield "pool_head_dim", _with_item(a, "v_caches", 1, v1[..., :8]), r"v_caches\[1\].shape\[2\] must be D"
    yield "pool_stride", _with_item(a, "k_caches", 1, v1.transpose(1, 2).contiguous().transpose(1, 2)), \
        r"k_caches\[1\] must have a contiguous last dimension"
    yield "pool_device", _with_item(a, "v_caches", 1, v1.to("meta")), r"v_caches\[1\] is on meta"
    yield "weight_rows", _with_item(a, "kv_weights", 1, w0[:-1]), r"kv_weights\[1\].shape\[0\] must be 2 \* Hkv \* D"
    yield "weight_cols", _with_item(a, "kv_weights", 0, w0[:, :-1]), r"kv_weights\[0\].shape\[1\] must be H"
    yield "weight_dtype", _with_item(a, "kv_weights", 0, w0.half()), r"kv_weights\[0\] must have ctx's dtype"
    yield "weight_stride", _with_item(a, "kv_weights", 1, torch.randn(32, 64).t()), \
        r"kv_weights\[1\] must have a contiguous last dimension"
    yield "bias_shape", _with_item(a, "kv_biases", 1, a["kv_biases"][1][1:]), r"kv_biases\[1\].shape\[0\] must be"
    yield "bias_dtype", _with_item(a, "kv_biases", 0, a["kv_biases"][0].bfloat16()), r"kv_biases\[0\] must have ctx's"
    yield "norm_shape", _with_item(a, "k_norm_weights", 1, torch.ones(8)), r"k_norm_weights\[1\].shape\[0\] must be D"
    yield "norm_dtype", _with_item(a, "k_norm_weights", 0, torch.ones(16).half()), r"k_norm_weights\[0\] must have"
    cache = a["cos_sin_cache"]
    yield "cache_rank", _set(a, "cos_sin_cache", cache[0]), r"cos_sin_cache must be 2-D \[P, rotary_dim\]"
    yield "cache_dtype", _set(a, "cos_sin_cache", cache.double()), "cos_sin_cache must be float32"
    yield "rotary_odd", _set(a, "cos_sin_cache", cache[:, :7]), r"rotary_dim: cos then sin halves\) must be even"
    yield "rotary_wide", _set(a, "cos_sin_cache", torch.ones(8, 18)), r"must be even, in \[2, D = 16\]"
    yield "cache_stride", _set(a, "cos_sin_cache", torch.ones(8, 8).t()), "cos_sin_cache must have a contiguous last"
    yield "cache_device", _set(a, "cos_sin_cache", cache.to("meta")), "cos_sin_cache is on meta"
    yield "positions_dtype", _set(a, "positions", pos.float()), "positions must be int32 or int64"
    yield "positions_len", _set(a, "positions", pos[:2]), r"positions.shape\[0\] must be N = ctx.shape\[0\]"
    yield "positions_rank", _set(a, "positions", pos[None]), r"positions must be 1-D \[N\]"
    yield "positions_range", _set(a, "positions", pos.clone().fill_(cache.shape[0])), \
        r"positions\[0\] = 8 is outside the rows \[0, 8\) of cos_sin_cache"
    yield "positions_negative", _set(a, "positions", pos - 100), r"positions\[0\] = -\d+ is outside the rows"
    yield "out_loc_dtype", _set(a, "out_loc", loc.double()), "out_loc must be int32 or int64"
    yield "out_loc_len", _set(a, "out_loc", loc[:1]), r"out_loc.shape\[0\] must be N"
    yield "out_loc_range", _set(a, "out_loc", torch.tensor([-1, 0, k0.shape[0]])), r"outside \[-1, 13\)"
    yield "out_loc_below", _set(a, "out_loc", torch.tensor([-2, 0, 1])), r"out_loc\[0\] = -2 is outside \[-1, 13\)"
    yield "out_loc_twice", _set(a, "out_loc", torch.tensor([slot, -1, slot])), \
        rf"out_loc\[0\] and out_loc\[2\] are both slot {slot}"


@pytest.mark.parametrize("name,args,message", list(_bad_cases()), ids=[c[0] for c in _bad_cases()])
def test_rejects(name, args, message):
    before = [p.clone() for p in args["k_caches"] + args["v_caches"] if p.device.type == "cpu"]
    with pytest.raises(ValueError, match=message):
        ops.materialize_context_kv(**args)
    after = [p for p in args["k_caches"] + args["v_caches"] if p.device.type == "cpu"]
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(after, before, strict=True))


def test_rejects_through_torch_ops_directly():
    """The checks live in the extension, not the Python wrapper."""
    a = make_inputs(2, 32, 1, 1, 16, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"k_norm_weights\[0\].shape\[0\] must be D"):
        _extension.ops().materialize_context_kv(
            a["ctx"], a["kv_weights"], None, [torch.ones(4)], 1e-6, a["cos_sin_cache"], True, a["positions"],
            a["out_loc"], a["k_caches"], a["v_caches"])
