"""Which of our optional GPU ops a server switches on by default, per GPU class.

On the CPU our draft attention (`block_attention`) and context K/V (`materialize_context_kv`) are
what make DFLASH fast, so they run by default. On a GPU they replace SGLang's own attention and
projection paths, which are fast there; one of ours runs by default only where the committed kernel
benchmark for that GPU class (bench/results/bench_kernels_<gpu>.json) shows it faster than the paged
baseline it stands in for in every case it measured. `BENCHMARKED_WINS` records those verdicts and
tests/test_gpu_defaults.py keeps it equal to the committed results. An environment switch still
forces an op on or off; the server log says which ops run and why.
"""

from __future__ import annotations

# The ops a GPU server may run in place of SGLang's own path, and the baseline of the kernel
# benchmark (bench/bench_kernels.py) that plays SGLang's path for each.
GATED_OPS = {"block_attention": "triton_split_kv", "materialize_context_kv": None}

# (GPU class, op) -> (wins, the result file the verdict comes from). A pair not listed has no
# committed benchmark, so the op stays off there.
BENCHMARKED_WINS: dict[tuple[str, str], tuple[bool, str]] = {
    ("sm90", "block_attention"): (False, "bench/results/bench_kernels_h200.json"),
}


def default_on(op: str, gpu_class: str) -> tuple[bool, str]:
    """Whether `op` runs by default on a GPU of `gpu_class` (e.g. "sm90"), and why, for the log."""
    if op not in GATED_OPS:
        raise ValueError(f"{op!r} is not a gated GPU op; gated: {', '.join(GATED_OPS)}")
    verdict = BENCHMARKED_WINS.get((gpu_class, op))
    if verdict is None:
        return False, f"no committed kernel benchmark of {op} on {gpu_class}"
    wins, source = verdict
    if wins:
        return True, f"faster than {GATED_OPS[op]} in every case of {source}"
    return False, f"slower than {GATED_OPS[op]} in some case of {source}"
