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
    assert out.split("\n")[:2] == ["['assign_extend_cache_locs_cpu', 'assign_req_to_token_pool_cpu']", "theirs"]
