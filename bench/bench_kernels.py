"""GPU microbenchmarks of the CUDA kernels against baselines, side by side in one process.

block_attention (bf16, Qwen3-8B draft shapes: Hq 32, Hkv 8, D 128, B 16) against
  (a) PyTorch SDPA on the K/V gathered from the paged cache (gather + SDPA, the honest cost of a
      dense kernel on a paged cache),
  (b) FlashInfer's paged prefill with causal=False, page size 1, when flashinfer is importable,
  (c) a Triton paged attention written here (all B x group rows of a kv head per program).
verify_block (V 151936, B 16) against
  - the PyTorch spec (sglang_dflash.ops.reference, a Python loop over rows),
  - a dense-probabilities path like SGLang's torch fallback: softmax -> sort -> top-k / top-p
    renorm -> multinomial, then a vectorised accept scan (greedy: argmax + accept scan).

Times are medians of CUDA-event timings over many runs, rotating among input sets so that small
cases do not run from L2. hbm_fraction = bytes that must be read (context K/V, or logits) / time,
over the device-to-device copy bandwidth measured at start. Writes one JSON file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from sglang_dflash import ops
from sglang_dflash.ops import reference

DEV = torch.device("cuda")
L2_FLUSH_BYTES = 256 << 20  # rotate inputs until one round touches at least this much


def timed(fn, inputs, *, max_reps=100, budget_s=0.4, warmup=2, min_reps=3, sleep_cycles=2_000_000):
    """Median milliseconds of fn(*inputs[i % len(inputs)]) over CUDA events.

    Each timed call is queued behind a ~1 ms sleep kernel, so the host enqueues it while the GPU
    is busy and the events measure device time, not Python / dispatch overhead (SGLang replays
    these ops inside CUDA graphs). A baseline slower on the host than on the GPU (the Python-loop
    spec) still shows its full cost."""
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    start_wall = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start_wall < budget_s):
        args = inputs[len(times) % len(inputs)]
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def measure_hbm_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), [()], max_reps=20, budget_s=0.5, sleep_cycles=0)
    return 2 * (1 << 30) / (ms * 1e-3)


# ------------------------------------------------------------------------------------------------
# block attention baselines


def sdpa_gathered(q, k_block, v_block, k_cache, v_cache, slots, block, sm_scale):
    """Gather each request's context K/V (all requests have the same length here), then SDPA."""
    bs = slots.shape[0]
    hq, d = q.shape[1], q.shape[2]
    hkv = k_block.shape[1]
    k = torch.cat([k_cache[slots], k_block.view(bs, block, hkv, d)], dim=1).transpose(1, 2)
    v = torch.cat([v_cache[slots], v_block.view(bs, block, hkv, d)], dim=1).transpose(1, 2)
    qh = q.view(bs, block, hq, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(qh, k, v, scale=sm_scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(bs * block, hq, d)


_triton_kernel = None


def _build_triton():
    global _triton_kernel
    if _triton_kernel is not None:
        return _triton_kernel
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(
        Q, KB, VB, KC, VC, TABLE, POOLS, CTX, OUT, sm_scale,
        s_qn, s_qh, s_kbn, s_kbh, s_kcs, s_kch, s_tr, s_on, s_oh,
        HKV: tl.constexpr, B: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        b = pid // HKV
        h = pid % HKV
        rows = tl.arange(0, B * G)
        qi = rows // G
        qg = rows % G
        dims = tl.arange(0, D)
        q = tl.load(Q + (b * B + qi)[:, None] * s_qn + (h * G + qg)[:, None] * s_qh + dims[None, :])
        ctx = tl.load(CTX + b).to(tl.int64)
        pool = tl.load(POOLS + b).to(tl.int64)
        m_i = tl.full([B * G], float("-inf"), tl.float32)
        l_i = tl.zeros([B * G], tl.float32)
        acc = tl.zeros([B * G, D], tl.float32)
        for start in range(0, ctx, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            valid = keys < ctx
            slots = tl.load(TABLE + pool * s_tr + keys, mask=valid, other=0).to(tl.int64)
            k = tl.load(KC + slots[None, :] * s_kcs + h * s_kch + dims[:, None],
                        mask=valid[None, :], other=0.0)  # fmt: skip
            s = tl.dot(q, k) * sm_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VC + slots[:, None] * s_kcs + h * s_kch + dims[None, :],
                        mask=valid[:, None], other=0.0)  # fmt: skip
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        brow = tl.arange(0, B)
        k = tl.load(KB + (b * B + brow)[None, :] * s_kbn + h * s_kbh + dims[:, None])
        s = tl.dot(q, k) * sm_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VB + (b * B + brow)[:, None] * s_kbn + h * s_kbh + dims[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        out = acc / l_i[:, None]
        tl.store(
            OUT + (b * B + qi)[:, None] * s_on + (h * G + qg)[:, None] * s_oh + dims[None, :],
            out.to(OUT.dtype.element_ty),
        )

    _triton_kernel = kernel
    return kernel


def triton_block_attention(q, k_block, v_block, k_cache, v_cache, table, pools, ctx, block, scale):
    """Non-causal, no window; K and V caches share strides; B x group a power of two."""
    kernel = _build_triton()
    n, hq, d = q.shape
    hkv = k_block.shape[1]
    bs = n // block
    out = torch.empty_like(q)
    kernel[(bs * hkv,)](
        q, k_block, v_block, k_cache, v_cache, table, pools, ctx, out, scale,
        q.stride(0), q.stride(1), k_block.stride(0), k_block.stride(1),
        k_cache.stride(0), k_cache.stride(1), table.stride(0), out.stride(0), out.stride(1),
        HKV=hkv, B=block, G=hq // hkv, D=d, BLOCK_N=64, num_warps=4, num_stages=2,
    )  # fmt: skip
    return out


def flashinfer_runner(q, k_block, v_block, k_cache, v_cache, slots, block_slots, block, scale):
    """FlashInfer paged prefill (page size 1, causal=False) over context + block slots; the block
    K/V are written into the cache first, as SGLang's backend does (not timed)."""
    import flashinfer

    bs = slots.shape[0]
    hq, d = q.shape[1], q.shape[2]
    hkv = k_block.shape[1]
    k_cache[block_slots.reshape(-1)] = k_block
    v_cache[block_slots.reshape(-1)] = v_block
    indices = torch.cat([slots, block_slots], dim=1).reshape(-1).int()
    per_req = slots.shape[1] + block
    qo_indptr = torch.arange(0, bs + 1, device=DEV, dtype=torch.int32) * block
    kv_indptr = torch.arange(0, bs + 1, device=DEV, dtype=torch.int32) * per_req
    last = torch.ones(bs, dtype=torch.int32, device=DEV)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        qo_indptr, kv_indptr, indices, last, hq, hkv, d, 1, causal=False, sm_scale=scale,
        q_data_type=q.dtype, kv_data_type=k_cache.dtype,
    )  # fmt: skip
    paged = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))  # [pages, page_size 1, Hkv, D]
    return lambda qq: wrapper.run(qq, paged)


def bench_block_attention(cases, hbm_bw, log):
    hq, hkv, d, block = 32, 8, 128, 16
    scale = d**-0.5
    max_tokens = max(bs * ctx for bs, ctx in cases)
    bytes_per_token = 2 * hkv * d * 2  # K and V, bf16
    n_rot_max = 4
    n_slots = max(max_tokens, L2_FLUSH_BYTES // bytes_per_token * 2) + 64 * block * 4 + 64
    g = torch.Generator(device=DEV).manual_seed(0)
    k_cache = torch.randn(n_slots, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn(n_slots, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
    results = []
    for bs, ctx in cases:
        case_bytes = bs * ctx * bytes_per_token
        n_rot = max(1, min(n_rot_max, math.ceil(L2_FLUSH_BYTES / case_bytes)))
        n_rot = min(n_rot, max(1, (n_slots - 64 * block * 4) // (bs * ctx)))
        sets = []
        perm = torch.randperm(n_slots - bs * block, device=DEV, generator=g)
        for r in range(n_rot):
            q = torch.randn(bs * block, hq, d, device=DEV, dtype=torch.bfloat16, generator=g)
            kb = torch.randn(bs * block, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
            vb = torch.randn(bs * block, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
            slots = perm[r * bs * ctx : (r + 1) * bs * ctx].view(bs, ctx)
            table = torch.zeros(bs, ctx + 8, dtype=torch.int32, device=DEV)
            table[:, :ctx] = slots.int()
            pools = torch.arange(bs, dtype=torch.int32, device=DEV)
            lens = torch.full((bs,), ctx, dtype=torch.int32, device=DEV)
            sets.append((q, kb, vb, table, pools, lens, slots.long()))

        def ours(q, kb, vb, table, pools, lens, slots):
            return ops.block_attention(q, kb, vb, k_cache, v_cache, table, pools, lens, block, scale)

        entry = dict(
            kernel="block_attention", bs=bs, ctx=ctx, hq=hq, hkv=hkv, head_dim=d, block=block,
            dtype="bfloat16", bytes=case_bytes, rotating_sets=n_rot,
        )  # fmt: skip
        entry["ours_ms"] = timed(ours, sets)
        baselines, errors, notes = {}, {}, {}
        ref_out = sdpa_gathered(*sets[0][:3], k_cache, v_cache, sets[0][6], block, scale)
        our_out = ours(*sets[0])
        notes["rel_err_vs_sdpa"] = float((our_out.float() - ref_out.float()).norm() / ref_out.float().norm())
        try:
            baselines["sdpa_gathered"] = timed(
                lambda q, kb, vb, t, p, ln, s: sdpa_gathered(q, kb, vb, k_cache, v_cache, s,
                                                             block, scale),
                sets,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            errors["sdpa_gathered"] = repr(exc)[:300]
        try:
            out = triton_block_attention(*sets[0][:3], k_cache, v_cache, *sets[0][3:6], block,
                                         scale)  # fmt: skip
            notes["triton_rel_err_vs_sdpa"] = float((out.float() - ref_out.float()).norm() / ref_out.float().norm())
            baselines["triton"] = timed(
                lambda q, kb, vb, t, p, ln, s: triton_block_attention(
                    q, kb, vb, k_cache, v_cache, t, p, ln, block, scale
                ),
                sets,
            )
        except Exception as exc:  # noqa: BLE001
            errors["triton"] = repr(exc)[:300]
        try:
            block_slots = torch.arange(bs * block, device=DEV).view(bs, block) + n_slots - bs * block
            q, kb, vb, *_rest, slots = sets[0]
            run = flashinfer_runner(q, kb, vb, k_cache, v_cache, slots, block_slots, block, scale)
            baselines["flashinfer_paged_prefill"] = timed(run, [(s[0],) for s in sets[:1]])
        except Exception as exc:  # noqa: BLE001
            errors["flashinfer_paged_prefill"] = repr(exc)[:300]
        finish(entry, baselines, errors, notes, hbm_bw)
        results.append(entry)
        log(entry)
        del sets
    return results


# ------------------------------------------------------------------------------------------------
# verify baselines


def accept_from_targets(candidates, y):
    """Vectorised accept scan (what SGLang's greedy accept kernel computes)."""
    bs, block = candidates.shape
    agree = candidates[:, 1:] == y[:, :-1]
    accept = agree.int().cumprod(dim=1).sum(dim=1)
    bonus = y.gather(1, accept[:, None].long())[:, 0]
    pos = torch.arange(block, device=y.device)[None, :]
    out = torch.where(pos < accept[:, None], torch.roll(candidates, -1, dims=1), -1)
    out = out.scatter(1, accept[:, None].long(), bonus[:, None])
    return accept.int(), bonus, out


def dense_verify(candidates, logits, temp, topk, topp):
    """Dense probabilities: softmax -> sort -> top-k / top-p renorm -> multinomial -> accept."""
    bs, block = candidates.shape
    t_rows = temp.repeat_interleave(block)
    greedy = t_rows <= 0
    probs = torch.softmax(logits.float() / torch.where(greedy, 1.0, t_rows)[:, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[1], device=probs.device)[None, :]
    k_rows = topk.repeat_interleave(block)
    drop = (k_rows[:, None] > 0) & (ranks >= k_rows[:, None])
    cum = sorted_p.cumsum(dim=-1)
    drop |= (cum - sorted_p) > topp.repeat_interleave(block)[:, None]
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    pick = torch.multinomial(sorted_p / sorted_p.sum(-1, keepdim=True), 1)
    y = order.gather(1, pick)[:, 0]
    y = torch.where(greedy, logits.argmax(-1), y).view(bs, block)
    return accept_from_targets(candidates, y)


def greedy_baseline(candidates, logits):
    return accept_from_targets(candidates, logits.argmax(-1).view(candidates.shape))


def bench_verify(batches, vocab, hbm_bw, log, dtype=torch.float32):
    block = 16
    results = []
    g = torch.Generator(device=DEV).manual_seed(1)
    modes = {
        "greedy": (0.0, 0, 1.0),
        "temperature": (1.0, 0, 1.0),
        "top_k_top_p": (0.7, 20, 0.95),
    }
    for bs in batches:
        case_bytes = bs * block * vocab * torch.finfo(dtype).bits // 8
        n_rot = max(1, min(3, math.ceil(L2_FLUSH_BYTES / case_bytes)))
        sets = []
        for _ in range(n_rot):
            logits = (torch.randn(bs * block, vocab, device=DEV, generator=g) * 4).to(dtype)
            cand = torch.randint(0, vocab, (bs, block), device=DEV, generator=g)
            cand[:, 1:] = logits.argmax(-1).view(bs, block)[:, :-1]  # long accepts
            sets.append((cand, logits))
        offs = torch.arange(bs, device=DEV, dtype=torch.int64) * 1000
        for mode, (t, k, p) in modes.items():
            temp = torch.full((bs,), t, device=DEV)
            topk = torch.full((bs,), k, dtype=torch.int32, device=DEV)
            topp = torch.full((bs,), p, device=DEV)
            entry = dict(
                kernel="verify_block", mode=mode, bs=bs, block=block, vocab=vocab,
                dtype=str(dtype).replace("torch.", ""), temperature=t, top_k=k, top_p=p,
                bytes=case_bytes, rotating_sets=n_rot,
            )  # fmt: skip
            params = (temp, topk, topp)
            entry["ours_ms"] = timed(lambda c, lg, a=params, o=offs: ops.verify_block(c, lg, *a, 7, o), sets)
            baselines, errors, notes = {}, {}, {}
            try:
                if mode == "greedy":
                    baselines["torch_argmax_accept"] = timed(greedy_baseline, sets)
                baselines["dense_probabilities"] = timed(
                    lambda c, lg, a=params: dense_verify(c, lg, *a), sets, max_reps=30
                )
            except Exception as exc:  # noqa: BLE001
                errors["dense_probabilities"] = repr(exc)[:300]
            if bs <= 32:  # the Python-loop spec: seconds per call at larger batches
                try:
                    baselines["pytorch_reference"] = timed(
                        lambda c, lg, a=params, o=offs: reference.verify_block(c, lg, *a, 7, o),
                        sets[:1], max_reps=2, warmup=1, min_reps=1, budget_s=0.0,
                    )  # fmt: skip
                    ours = ops.verify_block(*sets[0], temp, topk, topp, 7, offs)
                    ref = reference.verify_block(*sets[0], temp, topk, topp, 7, offs)
                    notes["accept_len_equal_to_reference"] = bool(torch.equal(ours[0], ref[0]))
                    notes["out_tokens_equal_to_reference"] = bool(torch.equal(ours[2], ref[2]))
                except Exception as exc:  # noqa: BLE001
                    errors["pytorch_reference"] = repr(exc)[:300]
            finish(entry, baselines, errors, notes, hbm_bw)
            results.append(entry)
            log(entry)
        del sets
        torch.cuda.empty_cache()
    return results


def finish(entry, baselines, errors, notes, hbm_bw):
    entry["baselines_ms"] = baselines
    if errors:
        entry["baseline_errors"] = errors
    if notes:
        entry["notes"] = notes
    best = min(baselines.values()) if baselines else None
    entry["best_baseline"] = min(baselines, key=baselines.get) if baselines else None
    entry["speedup_vs_best_baseline"] = best / entry["ours_ms"] if best else None
    entry["speedups"] = {k: v / entry["ours_ms"] for k, v in baselines.items()}
    entry["hbm_fraction"] = entry["bytes"] / (entry["ours_ms"] * 1e-3) / hbm_bw


def git_commit() -> str:
    if os.environ.get("SGLANG_DFLASH_COMMIT"):
        return os.environ["SGLANG_DFLASH_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()  # fmt: skip
    except Exception:  # noqa: BLE001
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/bench_kernels.json")
    parser.add_argument("--quick", action="store_true", help="a few cases only")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--skip-verify", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")

    props = torch.cuda.get_device_properties(0)
    result = dict(
        device=props.name,
        sm_count=props.multi_processor_count,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=git_commit(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        timing="median of CUDA-event times per call, each call queued behind a sleep kernel "
        "(device time, host overhead hidden), inputs rotated to defeat L2 reuse",
        complete=False,
        cases=[],
    )

    def write():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(args.out + ".tmp", args.out)

    def log(entry):
        """Print one line per case and rewrite the JSON, so a run cut short keeps its cases."""
        result["cases"].append(entry)
        write()
        base = {k: round(v, 4) for k, v in entry["baselines_ms"].items()}
        sp = entry["speedup_vs_best_baseline"]
        shape = {k: entry[k] for k in ("mode", "bs", "ctx", "vocab") if k in entry}
        print(
            f"{entry['kernel']:16s} {shape} ours {entry['ours_ms']:.4f} ms  {base}  "
            f"speedup {sp and round(sp, 2)}  hbm {entry['hbm_fraction']:.2f}"
            + (f"  errors {list(entry['baseline_errors'])}" if "baseline_errors" in entry else ""),
            flush=True,
        )

    hbm = measure_hbm_bandwidth()
    result["hbm_copy_bandwidth_bytes_per_s"] = hbm
    print(f"device-to-device copy: {hbm / 1e12:.2f} TB/s", flush=True)
    attn_cases = [(bs, ctx) for bs in (1, 8, 32, 64) for ctx in (1024, 4096, 16384, 32768)]
    verify_batches = [1, 32, 128]
    if args.quick:
        attn_cases = [(1, 4096), (8, 16384)]
        verify_batches = [32]
    # Verify first: it is the shorter half, and the attention grid's largest cases come last.
    if not args.skip_verify:
        bench_verify(verify_batches, 151936, hbm, log)
        torch.cuda.empty_cache()
    if not args.skip_attention:
        bench_block_attention(attn_cases, hbm, log)
    result["complete"] = True
    write()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
