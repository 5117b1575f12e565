"""The sgl-kernel CPU ops our plugin registers for SGLang installs that lack them (a stock
`pip install sglang` has a CUDA sgl-kernel without `*_cpu` ops): their C++ kernels against plain
torch, and the registration under torch.ops.sgl_kernel (in fresh processes, since a registration
lasts for the process). Needs no SGLang."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from sglang_dflash._extension import ops


def _ranges(seed, table_dtype, loc_dtype):
    gen = torch.Generator().manual_seed(seed)
    rows, width, bs = 7, 40, 4
    table = torch.randint(0, 10_000, (rows, width), generator=gen).to(table_dtype)
    reqs = torch.randperm(rows, generator=gen)[:bs]
    starts = torch.randint(0, 20, (bs,), generator=gen)
    ends = starts + torch.randint(0, 15, (bs,), generator=gen)
    ends[1] = starts[1]  # an empty range
    total = int((ends - starts).sum())
    locs = torch.randint(0, 10_000, (total,), generator=gen).to(loc_dtype)
    return table, reqs, starts, ends, locs


@pytest.mark.parametrize("table_dtype,loc_dtype", [(torch.int32, torch.int64), (torch.int64, torch.int32)])
def test_assign_req_to_token_pool_writes_each_range_and_nothing_else(table_dtype, loc_dtype):
    table, reqs, starts, ends, locs = _ranges(1, table_dtype, loc_dtype)
    expected, pos = table.clone(), 0
    for r, s, e in zip(reqs.tolist(), starts.tolist(), ends.tolist(), strict=True):
        expected[r, s:e] = locs[pos : pos + e - s].to(table_dtype)
        pos += e - s
    ops().sgl_kernel_assign_req_to_token_pool_cpu(reqs, table, starts, ends, locs, table.shape[1])
    assert torch.equal(table, expected)


@pytest.mark.parametrize("table_dtype,loc_dtype", [(torch.int32, torch.int64), (torch.int64, torch.int64)])
def test_assign_extend_cache_locs_reads_each_range(table_dtype, loc_dtype):
    table, reqs, starts, ends, locs = _ranges(2, table_dtype, loc_dtype)
    locs.fill_(-7)  # poison: every entry must be overwritten
    expected = torch.cat([table[r, s:e] for r, s, e in zip(reqs.tolist(), starts.tolist(), ends.tolist(),
                                                              strict=True)]).to(loc_dtype)
    ops().sgl_kernel_assign_extend_cache_locs_cpu(reqs, table, starts, ends, locs, table.shape[1])
    assert torch.equal(locs, expected)


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
def test_copy_all_layer_kv_cache_moves_rows_of_every_buffer_gather_then_scatter(loc_dtype):
    gen = torch.Generator().manual_seed(3)
    buffers = [torch.randn(50, 3, 8, generator=gen).to(dtype) for dtype in (torch.float16, torch.float32,
                                                                             torch.bfloat16, torch.float32)]
    src = torch.tensor([4, 9, 10, 31, 0], dtype=loc_dtype)
    tgt = torch.tensor([9, 10, 11, 2, 49], dtype=loc_dtype)  # overlaps the sources: staged first
    expected = [b.clone() for b in buffers]
    for e in expected:
        e[tgt.long()] = e[src.long()].clone()
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers], dtype=torch.int64)
    ops().sgl_kernel_copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for got, want in zip(buffers, expected, strict=True):
        assert torch.equal(got, want)


def test_bad_arguments_get_one_clear_error():
    table, reqs, starts, ends, locs = _ranges(4, torch.int32, torch.int64)
    with pytest.raises(ValueError, match="assign_extend_cache_locs_cpu: out_cache_loc has"):
        ops().sgl_kernel_assign_extend_cache_locs_cpu(reqs, table, starts, ends, locs[:1], 40)
    with pytest.raises(ValueError, match="req_pool_indices\\[0\\] = 99 is outside"):
        ops().sgl_kernel_assign_req_to_token_pool_cpu(torch.full_like(reqs, 99), table, starts, ends, locs, 40)
    with pytest.raises(ValueError, match="copy_all_layer_kv_cache_cpu: tgt_loc has 2 entries but src_loc has 1"):
        ops().sgl_kernel_copy_all_layer_kv_cache_cpu(torch.zeros(1, dtype=torch.uint64), torch.ones(1).long(),
                                                     torch.zeros(2).long(), torch.zeros(1).long())


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_missing_ops_are_registered_under_sglangs_names():
    out = _run("""
        import torch
        from sglang_dflash.serving.sgl_kernel_ops import SCHEMAS, register_missing
        print(sorted(register_missing()) == sorted(SCHEMAS))
        print(register_missing())  # a second call finds them all
        table = torch.zeros(3, 8, dtype=torch.int32)
        torch.ops.sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([2]), table, torch.tensor([1]),
                                                          torch.tensor([4]), torch.tensor([5, 6, 7]), 8)
        print(table[2].tolist())
    """)
    assert out.split("\n")[:3] == ["True", "[]", "[0, 5, 6, 7, 0, 0, 0, 0]"]


def test_an_sgl_kernel_that_has_an_op_keeps_it():
    out = _run("""
        import torch
        lib = torch.library.Library("sgl_kernel", "FRAGMENT")  # as a CPU build of sgl-kernel would
        lib.define("copy_all_layer_kv_cache_cpu(Tensor a, Tensor b, Tensor c, Tensor d) -> ()")
        lib.impl("copy_all_layer_kv_cache_cpu", lambda a, b, c, d: print("theirs"), "CPU")
        from sglang_dflash.serving.sgl_kernel_ops import register_missing
        print(sorted(register_missing()))
        t = torch.zeros(1)
        torch.ops.sgl_kernel.copy_all_layer_kv_cache_cpu(t, t, t, t)
    """)
    from sglang_dflash.serving.sgl_kernel_ops import SCHEMAS

    assert out.split("\n")[:2] == [str(sorted(set(SCHEMAS) - {"copy_all_layer_kv_cache_cpu"})), "theirs"]


# -- the tree-verify ops (NGRAM's), in PyTorch: against loops written from SGLang's contract ------


def _random_trees(seed, bs, n):
    """parents [bs, n] of random draft trees (node 0 the root, each parent before its child) and
    their masks [bs, n, n] (node j is node i or an ancestor of it)."""
    from sglang_dflash.ops.reference import tree_ancestors

    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((bs, n), -1, dtype=torch.long)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (bs,), generator=gen)
    return parents, tree_ancestors(parents)


@pytest.mark.parametrize("bs,n", [(1, 1), (1, 8), (3, 5), (4, 12)])
def test_reconstruct_indices_from_tree_mask_follows_the_tree(bs, n):
    from sglang_dflash.serving.sgl_kernel_ops import reconstruct_indices_from_tree_mask

    parents, mask = _random_trees(bs * 100 + n, bs, n)
    seq_lens = torch.randint(1, 50, (bs,), generator=torch.Generator().manual_seed(n))
    outs = [torch.full((bs * n,), -9, dtype=torch.long)] + [torch.full((bs, n), -9, dtype=torch.long)
                                                             for _ in range(3)]
    reconstruct_indices_from_tree_mask(mask.flatten(), seq_lens, *outs, bs, n)
    positions, index, next_token, next_sibling = outs
    for b in range(bs):
        children = {i: [k for k in range(n) if parents[b, k] == i] for i in range(n)}
        for i in range(n):
            depth, p = 0, int(parents[b, i])
            while p >= 0:
                depth, p = depth + 1, int(parents[b, p])
            assert positions[b * n + i] == seq_lens[b] + depth
            assert index[b, i] == b * n + i
            assert next_token[b, i] == (children[i][0] if children[i] else -1)
            p = int(parents[b, i])
            later = [k for k in children.get(p, []) if k > i] if p >= 0 else []
            assert next_sibling[b, i] == (later[0] if later else -1)


@pytest.mark.parametrize("bs,n,steps", [(1, 4, 4), (3, 8, 5), (5, 12, 8)])
def test_verify_tree_greedy_accepts_the_longest_matching_path(bs, n, steps):
    from sglang_dflash.serving.sgl_kernel_ops import reconstruct_indices_from_tree_mask, verify_tree_greedy_cpu

    parents, mask = _random_trees(bs * 10 + n, bs, n)
    gen = torch.Generator().manual_seed(steps)
    candidates = torch.randint(0, 3, (bs, n), generator=gen)  # few tokens: many matches and siblings
    target = torch.randint(0, 3, (bs, n), generator=gen)
    index, next_token, next_sibling = (torch.empty(bs, n, dtype=torch.long) for _ in range(3))
    reconstruct_indices_from_tree_mask(mask.flatten(), torch.zeros(bs), torch.empty(bs * n, dtype=torch.long),
                                       index, next_token, next_sibling, bs, n)
    predicts = torch.full((bs * n,), -5, dtype=torch.int32)
    accept_index = torch.full((bs, steps), -1, dtype=torch.int32)
    accept_num = torch.full((bs,), -5, dtype=torch.int32)
    verify_tree_greedy_cpu(predicts, accept_index, accept_num, candidates, index, next_token, next_sibling, target)
    for b in range(bs):
        path = [0]  # from the root: the first child (in node order) carrying the target's token
        while len(path) < steps:
            match = [k for k in range(n) if parents[b, k] == path[-1] and candidates[b, k] == target[b, path[-1]]]
            if not match:
                break
            path.append(match[0])
        assert accept_num[b] == len(path) - 1
        assert accept_index[b].tolist() == [b * n + k for k in path] + [-1] * (steps - len(path))
        for k in path:
            assert predicts[b * n + k] == target[b, k]
    assert int((predicts != -5).sum()) == int(accept_num.sum()) + bs  # nothing else written


def test_fill_accept_out_cache_loc_and_bonus_tokens():
    from sglang_dflash.serving.sgl_kernel_ops import fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu

    accept_index = torch.tensor([[0, 2, -1], [3, -1, -1], [6, 7, 8]])
    out_cache_loc = torch.arange(100, 109)
    got = torch.full((7,), -1, dtype=torch.long)
    fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, got)
    assert got.tolist() == [100, 102, 103, 106, 107, 108, -1]
    with pytest.raises(ValueError, match="6 accepted entries, but accept_out_cache_loc holds 5"):
        fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, got[:5])
    bonus = torch.full((3,), -1, dtype=torch.long)
    fill_bonus_tokens_cpu(torch.tensor([11, 12, 13, 21, 22, 23, 31, 32, 33]), torch.tensor([2, 1, 3]), bonus, 3)
    assert bonus.tolist() == [12, 21, 33]


def test_an_op_defined_without_a_cpu_kernel_gets_ours():
    out = _run("""
        import torch
        lib = torch.library.Library("sgl_kernel", "FRAGMENT")  # as the CUDA wheel defines it
        lib.define("reconstruct_indices_from_tree_mask(Tensor tree_mask, Tensor verified_seq_len, Tensor positions, "
                   "Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, "
                   "int batch_size, int draft_token_num) -> ()")
        lib.impl("reconstruct_indices_from_tree_mask", lambda *a: None, "Meta")
        from sglang_dflash.serving.sgl_kernel_ops import register_missing
        print("reconstruct_indices_from_tree_mask" in register_missing())
        index = torch.full((1, 2), -9, dtype=torch.long)
        torch.ops.sgl_kernel.reconstruct_indices_from_tree_mask(
            torch.tensor([1, 0, 1, 1]).bool(), torch.tensor([4]), torch.zeros(2, dtype=torch.long), index,
            torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long), 1, 2)
        print(index.tolist())
    """)
    assert out.split("\n")[:2] == ["True", "[[0, 1]]"]
