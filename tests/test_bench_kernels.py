"""bench/bench_kernels.py without a GPU: case lists, byte counts, input rotation, statistics, records
and goals; the torch baselines (SDPA on packed queries, the vectorised accept, the sampled path) against
the reference on the CPU; the Triton split-KV kernel under TRITON_INTERPRET=1; the timing loop with
CUDA faked; the benchmarks' plumbing on tiny CPU shapes (trees too: the masked SDPA and the torch walk
against the reference); and the script's one-line refusal where
there is no CUDA device."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench import bench_kernels as bk
from sglang_dflash.ops import reference
from sglang_dflash.ops.testing import make_tree

ROOT = Path(__file__).resolve().parents[1]

MB = 1 << 20


def test_quick_cases_are_a_subset_that_covers_every_goal():
    assert set(bk.attention_cases(True)) <= set(bk.attention_cases(False))
    assert set(bk.verify_cases(True)) <= set(bk.verify_cases(False))
    cases = [dict(op="block_attention", bs=bs, ctx=ctx) for bs, ctx in bk.attention_cases(True)]
    cases += [dict(op="verify_block", bs=bs, mode=mode, vocab=bk.VOCAB) for bs, mode in bk.verify_cases(True)]
    rows = bk.goal_rows(cases)
    assert {r["goal"] for r in rows} == {goal[0] for goal in bk.GOALS}
    assert not any(r["met"] for r in rows)  # nothing measured: no value, nothing met


def test_block_attention_bytes_counts_each_tensor_once():
    # bs 1, ctx 32k, Qwen3-8B draft: K + V = 2 * 32768 * 8 * 128 * 2 bytes = 128 MiB dominates.
    kv = 2 * 32768 * 8 * 128 * 2
    total = bk.block_attention_bytes(1, 32768, 16, 32, 8, 128, 2)
    slot_ids, q_and_block, lens_and_pools, out = 32768 * 4, 16 * (32 + 16) * 128 * 2, 2 * 4, 16 * 32 * 128 * 2
    assert total == kv + slot_ids + q_and_block + lens_and_pools + out
    draft = (16, 32, 8, 128, 2)  # block, Hq, Hkv, D, bytes per element
    assert bk.block_attention_bytes(8, 4096, *draft) == 8 * bk.block_attention_bytes(1, 4096, *draft)
    assert bk.block_attention_flops(1, 1024, 16, 32, 128) == 4 * 16 * 32 * 1040 * 128


def test_verify_bytes_is_dominated_by_one_read_of_the_logits():
    logits = 32 * 16 * 151936 * 4  # 311 MB: the ~72 us floor of csrc/cuda/NOTES.md at ~4.3 TB/s
    total = bk.verify_bytes(32, 16, 151936, 4)
    assert total == logits + 32 * 16 * 8 * 2 + 32 * (20 + 12)
    assert total / logits < 1.001


def test_rotation_reads_several_l2_sizes_between_uses_of_a_set():
    l2 = 50 * MB
    for case in (1 * MB, 4 * MB + 123, 33 * MB, 199 * MB):
        n = bk.rotation_sets(case, l2)
        assert (n - 1) * case >= bk.L2_MULTIPLE * l2 - case and n >= 2
    assert bk.rotation_sets(4 * MB, l2) == 50
    assert bk.rotation_sets(10 << 30, l2) == 2  # a set far beyond L2 still alternates with another


def test_timing_summary_median_and_deciles():
    s = bk.timing_summary([float(x) for x in range(1, 12)])  # 1 .. 11
    assert (s["median_ms"], s["p10_ms"], s["p90_ms"], s["reps"]) == (6.0, 2.0, 10.0, 11)
    s = bk.timing_summary([3.0, 1.0])
    assert s["median_ms"] == 2.0 and s["p10_ms"] == pytest.approx(1.2) and s["p90_ms"] == pytest.approx(2.8)


def test_triton_split_count_fills_the_gpu_within_bounds():
    assert bk.triton_num_splits(1, 8, 32768, 132) == 32  # 33 wanted, capped
    assert bk.triton_num_splits(4, 8, 32768, 132) == 8  # 264 // 32
    assert bk.triton_num_splits(1, 8, 1024, 132) == 4  # >= 256 keys per chunk
    assert bk.triton_num_splits(64, 8, 32768, 132) == 1
    assert bk.triton_num_splits(1, 8, 0, 132) == 1
    assert [bk.next_pow2(n) for n in (1, 2, 3, 16, 17, 64)] == [1, 2, 4, 16, 32, 64]


def test_filter_k():
    assert bk.filter_k([0, 0], [1.0, 1.0], 100) is None
    assert bk.filter_k([20, 5], [0.9, 1.0], 100) == 20
    assert bk.filter_k([200], [1.0], 100) == 100
    assert bk.filter_k([20, 0], [1.0, 1.0], 100) == 100  # the unfiltered row needs every id
    assert bk.filter_k([0], [0.9], 100) == 100  # top-p alone: the whole row sorted


def test_device_names_and_spec_bandwidth():
    assert bk.device_slug("NVIDIA H200") == "h200"
    assert bk.device_slug("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    assert bk.default_out("NVIDIA H200", True) == str(ROOT / "bench/results/bench_kernels_h200_quick.json")
    assert bk.spec_bandwidth("NVIDIA H200") == 4.8e12 and bk.spec_bandwidth("NVIDIA A10") is None


def test_case_record_ratios_and_fractions():
    ours = dict(median_ms=0.05, p10_ms=0.049, p90_ms=0.052, reps=100)
    baselines = {"sdpa_pregathered": dict(median_ms=0.1, backend="FLASH_ATTENTION"),
                 "triton_split_kv": {"error": "check failed: max per-(row, head) relative error 1.0"}}
    record = bk.case_record(dict(op="block_attention", bs=1, ctx=8192), 200_000_000, ours, baselines, 4e12, 4.8e12,
                            rotation_sets=3)  # fmt: skip
    assert record["speedup"] == {"sdpa_pregathered": pytest.approx(2.0)}
    assert record["hbm_fraction"] == pytest.approx(200e6 / 50e-6 / 4e12)  # 1.0
    assert record["hbm_fraction_spec"] == pytest.approx(200e6 / 50e-6 / 4.8e12)
    assert record["floor_ms"] == pytest.approx(0.05)
    assert record["failures"] == ["triton_split_kv: check failed: max per-(row, head) relative error 1.0"]
    assert record["rotation_sets"] == 3
    failed = bk.case_record(dict(op="block_attention", bs=1, ctx=8192), 1, {"error": "boom"}, {}, 1.0, None)
    assert "speedup" not in failed and "hbm_fraction" not in failed and failed["failures"] == ["ours: boom"]


def test_goal_rows_read_off_each_applicable_case():
    cases = [
        dict(op="block_attention", bs=1, ctx=16384, hbm_fraction=0.8, speedup={"sdpa_pregathered": 1.2}),
        dict(op="block_attention", bs=32, ctx=4096, hbm_fraction=0.5, speedup={"sdpa_pregathered": 3.0}),
        dict(op="verify_block", bs=32, mode="top_k_top_p", vocab=151936, speedup={"torch_sampled": 6.0}),
        dict(op="verify_block", bs=32, mode="greedy", vocab=151936, speedup={"torch_argmax_accept": 1.0}),
    ]
    rows = {(r["goal"], r["case"]): (r["value"], r["met"]) for r in bk.goal_rows(cases)}
    hbm, sdpa, sampled = (g[0] for g in bk.GOALS)
    assert rows == {(hbm, "bs 1 ctx 16384"): (0.8, True), (sdpa, "bs 1 ctx 16384"): (1.2, False),
                    (sampled, "bs 32 top_k_top_p"): (6.0, True)}  # fmt: skip
    table = bk.goal_table(bk.goal_rows(cases)).splitlines()
    assert len(table) == 4  # a header, one line per goal
    assert table[1].startswith(hbm) and table[1].endswith(" 0.70     1/1  0.80 (bs 1 ctx 16384)")
    assert table[2].endswith(" 1.50     0/1  1.20 (bs 1 ctx 16384)")
    assert table[3].endswith(" 5.00     1/1  6.00 (bs 32 top_k_top_p)")
    assert bk.goal_table([]).splitlines()[1].endswith("0/0  -")


def test_relative_error_is_per_row_and_head():
    ref = torch.randn(16, 4, 32)
    assert bk.max_rel_err_per_row_head(ref, ref) == 0.0
    wrong = ref.clone()
    wrong[3, 2] *= 1.1  # one head of one row: 10 % there, ~1 % over the whole tensor
    assert bk.max_rel_err_per_row_head(wrong, ref) == pytest.approx(0.1, rel=1e-4)
    assert (wrong - ref).norm() / ref.norm() < 0.03
    wrong[0, 0, 0] = float("nan")
    detail, passed = bk.attention_check(ref)(wrong)
    assert not passed and "nan" in detail


def _paged_case(bs, ctx_lens, block, hq, hkv, d, dtype, seed=0):
    """Random block_attention arguments (positional, up to ctx_lens) with permuted slots and pool rows."""
    g = torch.Generator().manual_seed(seed)
    n_slots = sum(ctx_lens) + 7
    q = torch.randn(bs * block, hq, d, generator=g).to(dtype)
    kb, vb = (torch.randn(bs * block, hkv, d, generator=g).to(dtype) for _ in range(2))
    k_cache, v_cache = (torch.randn(n_slots, hkv, d, generator=g).to(dtype) for _ in range(2))
    table = torch.zeros(bs + 1, max(ctx_lens) + block, dtype=torch.int32)
    pools = torch.randperm(bs + 1, generator=g)[:bs].int()
    slots = torch.randperm(n_slots, generator=g).int()
    for b, ctx in enumerate(ctx_lens):
        table[pools[b], :ctx] = slots[:ctx]
        slots = slots[ctx:]
    return q, kb, vb, k_cache, v_cache, table, pools, torch.tensor(ctx_lens, dtype=torch.int32)


def test_sdpa_on_packed_queries_and_gathered_kv_is_block_attention():
    block, hkv, ctx = 4, 2, 37
    args = _paged_case(3, [ctx] * 3, block, 6, hkv, 16, torch.float32)
    q, kb, vb, k_cache, v_cache, table, pools, _ = args
    ref = reference.block_attention(*args, block, 0.3)
    dense = (bk.pack_queries(q, block, hkv), bk.gather_kv(k_cache, kb, table, pools, ctx, block),
             bk.gather_kv(v_cache, vb, table, pools, ctx, block))  # fmt: skip
    assert dense[0].shape == (3, hkv, block * 3, 16) and dense[1].shape == (3, hkv, ctx + block, 16)
    assert torch.equal(bk.unpack_out(dense[0], block), q)
    backend = bk.pick_sdpa_backend(*dense, 0.3)
    assert backend in bk.SDPA_BACKENDS
    out = bk.sdpa_call(backend, 0.3)(*dense)
    assert bk.max_rel_err_per_row_head(bk.unpack_out(out, block), ref) < 1e-5
    assert bk.attention_check(ref, block)(out)[1]


def test_masked_sdpa_on_packed_queries_is_tree_mode_block_attention():
    block, hkv, hq, ctx = 6, 2, 6, 29
    args = _paged_case(3, [ctx] * 3, block, hq, hkv, 16, torch.float32)
    q, kb, vb, k_cache, v_cache, table, pools, _ = args
    parents = make_tree(3, block, 50, torch.Generator().manual_seed(1), unused=0.0)[1]
    assert (parents[:, 1:] >= 0).any() and (parents[:, 2:] > 0).any()  # branches below the root
    ref = reference.block_attention(*args, block, 0.3, tree_parents=parents)
    mask = bk.packed_tree_mask(parents, ctx, hq // hkv)
    dense = (bk.pack_queries(q, block, hkv), bk.gather_kv(k_cache, kb, table, pools, ctx, block),
             bk.gather_kv(v_cache, vb, table, pools, ctx, block), mask)  # fmt: skip
    assert mask.shape == (3, 1, block * hq // hkv, ctx + block)
    backend = bk.pick_sdpa_backend(*dense[:3], 0.3, mask)
    out = bk.sdpa_call(backend, 0.3)(*dense)
    assert bk.max_rel_err_per_row_head(bk.unpack_out(out, block), ref) < 1e-5
    unmasked = bk.sdpa_call(backend, 0.3)(*dense[:3])  # the mask matters: without it, another result
    assert bk.max_rel_err_per_row_head(bk.unpack_out(unmasked, block), ref) > 1e-2


def test_torch_tree_walk_is_the_reference_walk():
    g = torch.Generator().manual_seed(0)
    bs, nodes = 64, 12
    tokens, parents, depths = make_tree(bs, nodes, 6, g, unused=0.1)
    targets = torch.randint(0, 6, (bs, nodes), generator=g)
    for b, i in itertools.product(range(bs), range(1, nodes)):  # most nodes hold their parent's target
        if parents[b, i] >= 0 and torch.rand((), generator=g) < 0.7:
            targets[b, parents[b, i]] = tokens[b, i]
    got = bk.torch_tree_walk(tokens, parents, targets)
    want = reference.verify_tree_from_ids(tokens, parents, depths, targets)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want, strict=True))
    assert int(got[0].max()) >= 3 and int(got[0].min()) == 0


def test_vectorised_accept_is_the_reference_accept():
    g = torch.Generator().manual_seed(0)
    bs, block = 64, 8
    targets = torch.randint(0, 5, (bs, block), generator=g)
    candidates = torch.randint(0, 5, (bs, block), generator=g)
    agree = torch.randint(0, block, (bs,), generator=g)  # plant prefixes of every length
    for b in range(bs):
        candidates[b, 1 : agree[b] + 1] = targets[b, : agree[b]]
    got = bk.accept_from_targets(candidates, targets)
    want = reference.verify_block_from_ids(candidates, targets)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want, strict=True))
    assert int(got[0].max()) == block - 1 and int(got[0].min()) == 0
    logits = torch.randn(bs * block, 50, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(bk.greedy_verify(candidates, logits),
                                                  reference.verify_block_from_ids(candidates, logits.argmax(-1)),
                                                  strict=True))  # fmt: skip


def test_sampled_baseline_samples_only_the_filtered_set():
    torch.manual_seed(0)
    bs, block, vocab = 4, 16, 1000
    logits = torch.randn(bs * block, vocab) * 3
    temp = torch.tensor([0.7, 1.0, 1.3, 0.5])
    top_k = torch.tensor([1, 5, 20, 50], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.9])
    k_max = bk.filter_k(top_k.tolist(), top_p.tolist(), vocab)
    assert k_max == 50
    keep = torch.stack([reference.sampling_mask(logits[row] / temp[row // block], int(top_k[row // block]),
                                                float(top_p[row // block])) for row in range(bs * block)])  # fmt: skip
    assert keep.sum(1).max() > 1  # the filters leave a choice in some rows
    for _ in range(20):
        y = bk.sampled_targets(logits, temp, top_k, top_p, k_max)
        assert keep.gather(1, y[:, None]).all()
    y = bk.sampled_targets(logits, temp, top_k, top_p, None)  # no filter: any id, one per row
    assert y.shape == (bs * block,) and 0 <= int(y.min()) and int(y.max()) < vocab
    # Frequencies follow softmax(logits / T) over the kept ids.
    row = torch.tensor([2.0, 1.0, 0.0, -5.0]).repeat(4000, 1)
    y = bk.sampled_targets(row, torch.ones(250), torch.full((250,), 3, dtype=torch.int32), torch.ones(250), 3)
    freq = torch.bincount(y, minlength=4).float() / y.numel()
    assert torch.allclose(freq[:3], torch.softmax(row[0, :3], 0), atol=0.03) and freq[3] == 0
    accept, bonus, out = bk.sampled_verify(torch.zeros(bs, block, dtype=torch.int64), logits, temp, top_k, top_p,
                                           k_max)  # fmt: skip
    assert accept.shape == (bs,) and out.shape == (bs, block) and torch.equal(out[torch.arange(bs), accept.long()],
                                                                              bonus)


# Triton reads TRITON_INTERPRET once, when it is first imported; in a whole-suite run another module
# has imported it before these tests start. So the interpreted tests run in a process of their own
# that has it set from the start (test_triton_kernels_under_the_interpreter), and skip elsewhere.
INTERPRETED_PROCESS = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def triton_interpreted():
    """bench_kernels' Triton kernels defined under the interpreter (numpy on the CPU), then forgotten."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    if not INTERPRETED_PROCESS:
        pytest.skip("runs in its own TRITON_INTERPRET=1 process (test_triton_kernels_under_the_interpreter)")
    bk._triton_kernels.cache_clear()
    yield
    bk._triton_kernels.cache_clear()


def test_triton_kernels_under_the_interpreter():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    if INTERPRETED_PROCESS:
        pytest.skip("this is that process")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "triton_split_kv_kernel"], cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0 and "3 passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_split_kv_kernel_matches_the_reference(triton_interpreted, dtype):
    # Contexts 0 (block only), shorter than a tile, and several tiles long; group 2 with block 4 leaves
    # padding rows (8 of 16). Split counts: one, some, and more chunks than tiles (empty chunks).
    block, hq, hkv, d = 4, 4, 2, 32
    args = _paged_case(3, [0, 5, 70], block, hq, hkv, d, dtype)
    ref = reference.block_attention(*args, block, 0.2)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for splits in (1, 3, 8):
        out = bk.triton_block_attention(*args, block, 0.2, splits, block_n=16)
        assert out.dtype == dtype and out.shape == ref.shape
        assert bk.max_rel_err_per_row_head(out, ref) < tol, splits


def test_triton_split_kv_kernel_benchmark_tiles(triton_interpreted):
    # The benchmark's tiles: block 16 x group 4 = 64 query rows (no padding), head_dim 128, 64 keys a tile.
    block, hq, hkv, d = 16, 8, 2, 128
    args = _paged_case(2, [130, 64], block, hq, hkv, d, torch.float16, seed=1)
    ref = reference.block_attention(*args, block, d**-0.5)
    assert bk.max_rel_err_per_row_head(bk.triton_block_attention(*args, block, d**-0.5, 3), ref) < 2e-3
    with pytest.raises(ValueError, match="power of 2"):
        bk.triton_block_attention(*_paged_case(1, [3], 4, 2, 1, 24, torch.float32), 4, 0.2, 1)


def test_without_cuda_the_script_says_so_in_one_line():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU visible, even on a GPU machine
    proc = subprocess.run([sys.executable, "-m", "bench.bench_kernels", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [bk.NO_CUDA.format(torch=torch.__version__, cuda=torch.version.cuda)]


def cpu_bench(tmp_path):
    """A Bench on the CPU with a stand-in timer that calls each input set once; its JSON path."""

    def timer(fn, sets, sleep_ms):
        for args in sets:
            fn(*args)
        return {**bk.timing_summary([1.0, 2.0, 4.0]), "host_bound": False}

    props = SimpleNamespace(name="cpu", multi_processor_count=4)
    out = tmp_path / "bench.json"
    bench = bk.Bench(str(out), props, l2_bytes=64 << 10, sleep_ms=1.0, bw=1e10, spec_bw=None,
                     result=dict(device={}, cases=[]), device=torch.device("cpu"), timer=timer)  # fmt: skip
    return bench, out


def test_benchmark_plumbing_on_the_cpu(tmp_path, capsys):
    """Both benchmarks end to end on tiny shapes on the CPU (cpu_bench's stand-in timer):
    every implementation is checked against the reference and recorded, a baseline that raises (Triton
    cannot launch on CPU tensors) is a failure of its case, and the JSON holds the cases and goals."""
    bench, out = cpu_bench(tmp_path)
    bk.bench_verify(bench, [(3, mode) for mode in bk.VERIFY_MODES], vocab=1000, block=4)
    bk.bench_attention(bench, [(2, 40)], shape=dict(hq=4, hkv=2, head_dim=32, block=4))
    assert bk.finish(bench) == 1  # the Triton baseline failed
    result = json.loads(out.read_text())
    verify, attention = result["cases"][:3], result["cases"][3]
    assert [c["mode"] for c in verify] == list(bk.VERIFY_MODES)
    for case in verify:
        assert case["ours"]["check"].startswith("accept_len, bonus, out_tokens equal") and case["failures"] == []
        assert case["rotation_sets"] == bk.rotation_sets(bk.verify_bytes(3, 4, 1000, 4), 64 << 10)
        assert case["speedup"] == {next(iter(case["baselines"])): 1.0} and case["hbm_fraction"] > 0
    assert verify[0]["baselines"]["torch_argmax_accept"]["check"].endswith("(reference, 3 requests)")
    assert "torch_sampled" in verify[2]["baselines"] and "(reference, 2 requests)" in verify[2]["ours"]["check"]
    assert attention["ours"]["check"].startswith("max per-(row, head) relative error")
    assert attention["baselines"]["sdpa_pregathered"]["backend"] in bk.SDPA_BACKENDS
    assert "median_ms" in attention["baselines"]["sdpa_pregathered"]
    assert attention["baselines"]["triton_split_kv"]["splits"] == 1 and len(attention["failures"]) == 1
    assert attention["failures"][0].startswith("triton_split_kv: ")
    assert result["failures"] == [f"bs 2 ctx 40 block_attention: {attention['failures'][0]}"]
    assert [g["case"] for g in result["goals"]] == ["bs 2 ctx 40"] and result["complete"]
    printed = capsys.readouterr().out
    assert "FAILED triton_split_kv" in printed and "1 failures" in printed


def test_tree_benchmarks_plumbing_on_the_cpu(tmp_path):
    """verify_tree and tree-mode block_attention end to end on tiny CPU shapes (cpu_bench's stand-in
    timer): ours and every baseline checked against the reference pass, the sampled walk is timed
    unchecked, the tree cases count toward no attention goal, and nothing fails."""
    bench, out = cpu_bench(tmp_path)
    bk.bench_verify_tree(bench, [(3, mode) for mode in bk.TREE_VERIFY_MODES], vocab=50, nodes=6)
    bk.bench_attention(bench, [(2, 40)], shape=dict(hq=4, hkv=2, head_dim=32, block=6), tree=True)
    assert bk.finish(bench) == 0
    result = json.loads(out.read_text())
    greedy, sampled, attention = result["cases"]
    assert greedy["ours"]["check"] == "accept_len, path, out_tokens equal (reference, 3 requests)"
    assert greedy["baselines"]["torch_walk"]["check"] == greedy["ours"]["check"]
    assert sampled["ours"]["check"] == "accept_len, path, out_tokens equal (reference, 2 requests)"
    assert "median_ms" in sampled["baselines"]["torch_sampled_walk"]
    assert attention["tree"] and list(attention["baselines"]) == ["sdpa_pregathered"]
    assert attention["ours"]["check"].startswith("max per-(row, head) relative error")
    assert "median_ms" in attention["baselines"]["sdpa_pregathered"] and attention["failures"] == []
    assert result["goals"] == [] and result["failures"] == []
    assert bk.case_label(attention) == "bs 2 ctx 40 tree"


def test_time_calls_rotates_sets_through_warmup_and_timing(monkeypatch):
    """With CUDA's events and sleep kernel faked: consecutive calls never share an input set (warm-up
    included), the repetition bounds hold, and a call slower on the host than the sleep is flagged."""
    clock = iter(range(10**6))

    class Event:
        def __init__(self, enable_timing):
            self.t = None

        def record(self):
            self.t = next(clock)

        def synchronize(self):
            pass

        def elapsed_time(self, stop):
            return float(stop.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    used = []
    stats = bk.time_calls(used.append, [(0,), (1,), (2,)], 1e3, warmup=3, min_reps=5, max_reps=7, budget_s=0.0)
    assert stats["reps"] == 5 and stats["median_ms"] == 1.0 and not stats["host_bound"]
    assert len(used) == 8 and all(a != b for a, b in itertools.pairwise(used))
    stats = bk.time_calls(used.append, [(0,)], 0.0, warmup=0, min_reps=2, max_reps=7, budget_s=60)
    assert stats["reps"] == 7 and stats["host_bound"]


def test_variant_sweep_checks_and_times_every_variant_on_the_cpu(tmp_path, capsys):
    """--variants: each compiled variant of an op is checked against the reference and timed like the
    shipped op, the fastest is named with the shape class its TUNED entry goes to, and a variant that
    fails its check is a failure of its case (CPU builds hold "default" alone; a failing variant is
    simulated by a check that rejects one of them)."""
    from sglang_dflash.ops import variants

    bench, out = cpu_bench(tmp_path)
    bench.sweep_variants = True
    bk.bench_verify(bench, [(3, "greedy")], vocab=1000, block=4)
    bk.bench_attention(bench, [(2, 40)], shape=dict(hq=4, hkv=2, head_dim=32, block=4))
    bk.finish(bench)
    verify, attention = json.loads(out.read_text())["cases"][:2]
    for case, op in ((verify, "verify_block"), (attention, "block_attention")):
        assert list(case["ours"]["variants"]) == variants.kernel_variants(op)
        assert all("median_ms" in r and r["check"] == case["ours"]["check"] for r in case["ours"]["variants"].values())
        assert case["best_variant"] in case["ours"]["variants"]
    printed = capsys.readouterr().out
    assert "Kernel variants:" in printed and "block_attention bs 2 ctx 40 (shape class bs1-8):" in printed
    assert "verify_block bs 3 greedy (shape class rows1-64):" in printed and "<- best" in printed

    record = bk.case_record(dict(op="block_attention", bs=2, ctx=40), 1000,
                            {"median_ms": 1.0, "variants": {"default": {"median_ms": 1.0},
                                                            "k64s3w4": {"error": "check failed: x"}}},
                            {}, bw=1e10, spec_bw=None)
    assert record["failures"] == ["variant k64s3w4: check failed: x"] and record["best_variant"] == "default"
