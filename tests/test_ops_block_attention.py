"""block_attention (CPU kernel) against the pure-PyTorch reference on fresh random inputs."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash.ops import reference
from sglang_dflash.ops.testing import make_attention_inputs as make_inputs
from sglang_dflash.ops.testing import make_tree
from tests.dflash_testlib import run_fresh_python

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = list(TOLERANCE)


def _grid_cases():
    """A seeded sample of the full grid, plus the corners that break kernels most often."""
    rng = random.Random(1234)
    heads = [(1, 1), (2, 1), (4, 2), (8, 8), (8, 2), (4, 1)]
    grid = list(
        itertools.product([1, 2, 3, 5, 8], [1, 2, 4, 8, 16], heads, [64, 128], DTYPES,
                          [-1, 1, 7, 300], [False, True])
    )
    cases = []
    for i, (bs, block, (hq, hkv), d, dtype, window, causal) in enumerate(rng.sample(grid, 36)):
        ctx_lens = [rng.choice([0, 1, rng.randint(2, 200), rng.randint(200, 1500)]) for _ in range(bs)]
        cases.append((bs, block, hq, hkv, d, ctx_lens, dtype, window, causal, i))
    cases += [
        (1, 16, 8, 2, 128, [0], torch.float32, -1, False, 100),  # block only
        (2, 16, 16, 4, 128, [3000, 2500], torch.bfloat16, -1, False, 101),  # long context
        (2, 16, 16, 4, 128, [3000, 17], torch.float32, 1024, False, 102),  # window < ctx
        (4, 1, 4, 4, 64, [5, 0, 64, 65], torch.float16, -1, True, 103),  # B = 1
        (3, 8, 8, 1, 64, [63, 64, 129], torch.float32, 2, True, 104),  # tile edges, tiny window
        # B x G rows that are not a whole number of vectors (padded rows in the CPU kernel)
        (2, 4, 9, 3, 64, [150, 600], torch.bfloat16, -1, False, 105),  # the shipped drafter: 12 rows
        (1, 8, 9, 3, 64, [129], torch.float32, -1, False, 106),  # 24 rows
        (3, 5, 6, 2, 64, [1, 70, 200], torch.float32, 7, True, 107),  # 10 rows, masked
    ]
    return cases


@pytest.mark.parametrize("bs,block,hq,hkv,head_dim,ctx_lens,dtype,window,causal,seed", _grid_cases())
def test_matches_reference(bs, block, hq, hkv, head_dim, ctx_lens, dtype, window, causal, seed):
    args = make_inputs(bs, block, hq, hkv, head_dim, ctx_lens, dtype, seed=seed,
                       table_dtype=torch.int64 if seed % 3 else torch.int32)
    kwargs = dict(block_size=block, window=window, causal_block=causal)
    out = ops.block_attention(**args, **kwargs)
    expected = reference.block_attention(**args, **kwargs)
    assert out.dtype == dtype and out.shape == (bs * block, hq, head_dim)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_sm_scale_and_window_change_the_result():
    """Guards against a kernel that ignores the scale or the window (the reference would too)."""
    args = make_inputs(2, 4, 4, 2, 64, [40, 90], torch.float32, seed=7)
    base = ops.block_attention(**args, block_size=4)
    scaled = ops.block_attention(**args, block_size=4, sm_scale=0.5)
    windowed = ops.block_attention(**args, block_size=4, window=8)
    torch.testing.assert_close(scaled, reference.block_attention(**args, block_size=4, sm_scale=0.5))
    assert (base - scaled).abs().max() > 1e-2
    assert (base - windowed).abs().max() > 1e-2


def test_context_beyond_ctx_len_is_not_read():
    """Changing K/V of slots outside every request's context leaves the output bit-identical."""
    args = make_inputs(2, 4, 4, 2, 64, [10, 20], torch.float32, seed=3)
    out = ops.block_attention(**args, block_size=4)
    used = set()
    for b in range(2):
        row = int(args["req_pool_indices"][b])
        used |= set(args["req_to_token"][row, : int(args["ctx_lens"][b])].tolist())
    unused = [s for s in range(args["k_cache"].shape[0]) if s not in used]
    args["k_cache"][unused] = 1e4
    args["v_cache"][unused] = float("nan")
    assert torch.equal(ops.block_attention(**args, block_size=4), out)


def test_empty_batch():
    args = make_inputs(1, 4, 2, 1, 64, [5], torch.float32, seed=1)
    for name in ("q", "k_block", "v_block"):
        args[name] = args[name][:0]
    for name in ("req_pool_indices", "ctx_lens"):
        args[name] = args[name][:0]
    assert ops.block_attention(**args, block_size=4).shape == (0, 2, 64)


def test_meta_shapes_without_data():
    """FakeTensor / torch.compile path: shapes come from the Meta kernel, which validates too."""
    args = make_inputs(2, 4, 4, 2, 64, [3, 9], torch.bfloat16, seed=5)
    meta = {k: v.to("meta") for k, v in args.items()}
    out = ops.block_attention(**meta, block_size=4)
    assert out.device.type == "meta" and out.shape == (8, 4, 64) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="block_size"):
        ops.block_attention(**meta, block_size=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctx,block,window,hq,hkv,d", [
    (0, 4, -1, 9, 3, 64), (61, 4, -1, 9, 3, 64), (126, 8, -1, 4, 2, 64), (300, 16, -1, 8, 1, 64),
    (5, 3, -1, 2, 2, 64), (200, 8, 50, 4, 1, 64), (70, 4, 3, 9, 3, 64), (200, 8, 3, 1, 1, 20),
    (90, 16, -1, 3, 3, 72), (130, 5, -1, 12, 3, 36),
])
def test_a_verify_row_is_bitwise_the_decode_of_that_token(dtype, ctx, block, window, hq, hkv, d):
    """Causal verify row i over (ctx tokens in the pool + the block) equals, bit for bit, decoding
    that token with the i tokens before it already in the pool (B = 1, context ctx + i): the
    kernel tiles keys by absolute position, so greedy speculative decoding through it cannot drift
    from plain decoding through it. A decode of few query rows computes its scores with vectors
    across keys, a verify of many across query rows (block_attention.cpp, by_keys): the cases
    cross that line, with head dims that are and are not whole vectors."""
    gen = torch.Generator().manual_seed(ctx * 31 + block)
    n_slots = ctx + block + 9
    k_cache = torch.randn(n_slots, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(n_slots, hkv, d, generator=gen).to(dtype)
    slots = torch.randperm(n_slots, generator=gen)[: ctx + block]
    table = torch.full((2, ctx + block + 4), n_slots + 100, dtype=torch.int64)
    table[1, : ctx + block] = slots
    q = torch.randn(block, hq, d, generator=gen).to(dtype)
    k_block, v_block = k_cache[slots[ctx:]], v_cache[slots[ctx:]]  # the block's K/V, also in the pool
    pools = torch.tensor([1])
    verify = ops.block_attention(q, k_block, v_block, k_cache, v_cache, table, pools, torch.tensor([ctx]), block,
                                 sm_scale=0.125, window=window, causal_block=True)
    for i in range(block):
        decode = ops.block_attention(q[i : i + 1], k_block[i : i + 1], v_block[i : i + 1], k_cache, v_cache, table,
                                     pools, torch.tensor([ctx + i]), 1, sm_scale=0.125, window=window,
                                     causal_block=True)
        assert torch.equal(verify[i], decode[0]), f"row {i}"


def _tree_cases():
    """Trees up to 70 nodes (more than one 64-bit mask word per row), GQA groups, empty and long
    contexts, both index dtypes."""
    rng = random.Random(77)
    heads = [(1, 1), (4, 2), (9, 3), (8, 1)]
    cases = []
    for i, (bs, nodes, (hq, hkv), d, dtype) in enumerate(rng.sample(list(itertools.product(
            [1, 2, 3], [2, 5, 9, 17, 33, 65, 70], heads, [64, 128], DTYPES)), 24)):
        ctx_lens = [rng.choice([0, 1, rng.randint(2, 130), rng.randint(130, 700)]) for _ in range(bs)]
        cases.append((bs, nodes, hq, hkv, d, ctx_lens, dtype, i))
    return cases


def tree_parents(bs, nodes, seed, dtype):
    """Random draft trees' parents (deep chains with branches and unused nodes: make_tree)."""
    return make_tree(bs, nodes, 100, torch.Generator().manual_seed(seed), unused=0.1)[1].to(dtype)


@pytest.mark.parametrize("bs,nodes,hq,hkv,head_dim,ctx_lens,dtype,seed", _tree_cases())
def test_tree_mode_matches_reference(bs, nodes, hq, hkv, head_dim, ctx_lens, dtype, seed):
    args = make_inputs(bs, nodes, hq, hkv, head_dim, ctx_lens, dtype, seed=seed)
    parents = tree_parents(bs, nodes, seed, torch.int32 if seed % 2 else torch.int64)
    out = ops.block_attention(**args, block_size=nodes, tree_parents=parents)
    expected = reference.block_attention(**args, block_size=nodes, tree_parents=parents)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    full = reference.block_attention(**args, block_size=nodes)
    assert nodes < 3 or (expected.float() - full.float()).abs().max() > 1e-2  # the mask matters here


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctx", [0, 60, 150])
def test_tree_node_is_bitwise_the_decode_of_its_path(dtype, ctx):
    """Each node's output equals, bit for bit, a causal chain verify of its path alone (the
    context, then the path's K/V in order), which is bitwise the decode of that path (the test
    above): the kernel streams a node's keys at its depth's position, so greedy tree verification
    through it cannot drift from plain decoding through it. Contexts of 60 and 150 put paths across
    a 64-position tile edge."""
    nodes, hq, hkv, d = 21, 9, 3, 64
    args = make_inputs(1, nodes, hq, hkv, d, [ctx], dtype, seed=11)
    parents = tree_parents(1, nodes, 5, torch.int64)[0]
    tree = ops.block_attention(**args, block_size=nodes, tree_parents=parents[None])
    depths = []
    for i in range(nodes):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        path = path[::-1]
        depths.append(len(path) - 1)
        chain = dict(args, q=args["q"][path], k_block=args["k_block"][path], v_block=args["v_block"][path])
        decode = ops.block_attention(**chain, block_size=len(path), causal_block=True)
        assert torch.equal(tree[i], decode[-1]), f"node {i} (depth {depths[-1]})"
    assert max(depths) >= 5 and len(set(depths)) < nodes  # deep, and with siblings


def test_chain_tree_is_causal_block_bit_for_bit():
    """The tree whose node i hangs under node i - 1 is the causal block: the same keys at the same
    rows, so the same bits."""
    for block, ctx_lens in ((8, [63, 0, 200]), (70, [5, 129, 64])):
        args = make_inputs(3, block, 8, 2, 64, ctx_lens, torch.bfloat16, seed=block)
        chain = (torch.arange(block) - 1).expand(3, block)
        causal = ops.block_attention(**args, block_size=block, causal_block=True)
        assert torch.equal(ops.block_attention(**args, block_size=block, tree_parents=chain), causal)


def test_avx2_path_gives_the_avx512_paths_bits(tmp_path):
    """On a CPU with AVX-512 the tiles' GEMMs run 16 lanes wide; SGLANG_DFLASH_NO_AVX512=1 (in a
    fresh process: the path is chosen once per process) keeps the 8 lanes every AVX2 CPU runs.
    Each element is the same FMA chain on both, so the outputs are the same bits: chains, trees
    and decodes, query rows across and not across whole vectors, head dims of 36, 64 and 72."""
    if ops.float_dot_isa() != "avx512":
        pytest.skip("this CPU has no AVX-512 path to compare")
    code = """
        import torch
        from sglang_dflash import ops
        from sglang_dflash.ops.testing import make_attention_inputs, make_tree
        cases = [
            (1, 1, 9, 3, 64, [300], torch.bfloat16, None), (1, 5, 9, 3, 64, [300], torch.bfloat16, None),
            (2, 9, 9, 3, 64, [70, 200], torch.float32, None), (1, 16, 9, 3, 64, [130], torch.float16, None),
            (3, 6, 12, 3, 36, [0, 64, 65], torch.float32, None), (1, 11, 8, 2, 72, [90], torch.bfloat16, None),
            (2, 9, 9, 3, 64, [61, 150], torch.bfloat16, 3), (1, 33, 4, 1, 64, [40], torch.float32, 4),
        ]
        outs = []
        for i, (bs, block, hq, hkv, d, ctx, dtype, tree_seed) in enumerate(cases):
            args = make_attention_inputs(bs, block, hq, hkv, d, ctx, dtype, seed=i)
            if tree_seed is None:
                outs.append(ops.block_attention(**args, block_size=block, causal_block=True))
            else:
                parents = make_tree(bs, block, 100, torch.Generator().manual_seed(tree_seed), unused=0.1)[1]
                outs.append(ops.block_attention(**args, block_size=block, tree_parents=parents))
        torch.save((ops.float_dot_isa(), outs), PATH)
        print("ok")
    """
    narrow_path, wide_path = str(tmp_path / "avx2.pt"), str(tmp_path / "avx512.pt")
    assert run_fresh_python(code.replace("PATH", repr(narrow_path)), SGLANG_DFLASH_NO_AVX512="1") == "ok"
    assert run_fresh_python(code.replace("PATH", repr(wide_path))) == "ok"
    narrow_isa, narrow = torch.load(narrow_path)
    wide_isa, wide = torch.load(wide_path)
    assert wide_isa == "avx512" and len(wide) == len(narrow) == 8
    for i, (a, b) in enumerate(zip(narrow, wide, strict=True)):
        assert torch.equal(a, b), f"case {i}"
