"""Speculative vs plain decoding side by side (engine/compare.py), the demo that prints it with
the shipped drafter, and the end-to-end benchmark script on a small slice."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bench import bench_e2e
from sglang_dflash.control.tree import DEFAULT_TREE_MIN_PROB
from sglang_dflash.drafters import SHIPPED_DRAFTERS, resolve_draft
from sglang_dflash.engine import DFlashDrafter, SamplingParams
from sglang_dflash.engine.compare import compare
from sglang_dflash.engine.drafters import NoDrafter
from sglang_dflash.engine.generator import Generator
from sglang_dflash.models import load_draft
from tests.dflash_testlib import random_draft, tiny_target

ROOT = Path(__file__).resolve().parents[1]


def plain_tau(c):
    """Tokens per plain step: 1, except that the prefill token is not counted among the steps."""
    return sum(len(r.output_ids) - 1 for r in c.plain) / sum(r.stats.steps for r in c.plain)


def new_target():
    return tiny_target(seed=2)


def new_drafter(target):
    return DFlashDrafter(random_draft(target, block_size=8), target)


def test_comparison_summary_is_consistent_with_the_runs():
    prompts = [[3, 9, 14, 22], [5, 6, 40, 41, 42, 43, 10]]
    params = SamplingParams(max_new_tokens=20)
    comparisons = compare(new_target, new_drafter, prompts, [4, 8], params, chat=False, adaptive_block_sizes=[8],
                          tree_budgets=[5], tree_topk=3, adaptive_tree_budgets=[6], tree_min_probs=[0, 0.99])
    assert [(c.block_size, c.adaptive, c.tree_budget, c.tree_min_prob) for c in comparisons] == [
        (4, False, 0, 0), (8, False, 0, 0), (8, True, 0, 0), (8, False, 5, 0), (8, False, 5, 0.99), (8, True, 6, 0)]
    for c in comparisons:
        s = c.summary()
        assert s["identical_to_plain"] is True and s["tree_min_prob"] == c.tree_min_prob
        if c.adaptive:
            assert 1 <= s["mean_block_size"] <= max(8, c.tree_budget + 1)
        elif c.tree_budget:
            # The root and 5 drafted nodes a step; with a least path probability of 0.99 (a random
            # drafter's) the root and the first node only.
            assert s["mean_block_size"] == (2 if c.tree_min_prob else 6) and s["tree_topk"] == 3
        else:
            assert s["mean_block_size"] == c.block_size
        steps = sum(r.stats.steps for r in c.spec)
        assert sum(s["accept_histogram"]) == steps and len(s["accept_histogram"]) == c.block_size
        tokens = sum(len(r.output_ids) - 1 for r in c.spec)
        assert s["tau_token_weighted"] == pytest.approx(tokens / steps)
        assert s["speedup"] == pytest.approx(s["spec_tok_s"] / s["plain_tok_s"])
        # tokens/s = tau / step time, so the speedup decomposes into tau and the two step times
        assert s["speedup"] == pytest.approx(
            s["tau_token_weighted"] / s["spec_step_ms"] / (plain_tau(c) / s["plain_step_ms"]))
        assert 0 < s["draft_ms_per_step"] < s["spec_step_ms"]
        for name, rate in (("spec", s["spec_tok_s"]), ("plain", s["plain_tok_s"])):
            tokens, seconds = zip(*s["per_prompt"][name], strict=True)
            assert len(tokens) == len(prompts) and sum(tokens) / sum(seconds) == pytest.approx(rate)
    assert comparisons[0].plain is comparisons[2].plain, "plain decoding runs once for all block sizes"
    sampled = compare(new_target, new_drafter, prompts[:1], [4], SamplingParams(temperature=1.0, max_new_tokens=8),
                      chat=False)[0]
    assert sampled.summary()["identical_to_plain"] is True  # same seed: the same samples


def test_lockstep_runs_equal_runs_alone_and_count_only_their_own_time():
    """Runs stepped in turns (as compare does) produce what each produces alone, and each run's
    times leave out the others' turns (here a sleep between a run's steps)."""
    prompts = [[3, 9, 14, 22], [5, 6, 40, 41, 42, 43, 10]]
    params = SamplingParams(temperature=0.8, max_new_tokens=16, seed=3)
    target = new_target()
    generators = [Generator(new_target(), NoDrafter(), 1), Generator(target, new_drafter(target), 4, adaptive=True)]
    alone = [g.generate(prompts, params, chat=False) for g in generators]
    runs = [g.start(prompts, params, chat=False) for g in generators]
    slept = 0.0
    start = time.perf_counter()
    while any([run.step() for run in runs]):
        t0 = time.perf_counter()
        time.sleep(0.05)
        slept += time.perf_counter() - t0
    elapsed = time.perf_counter() - start
    for run, ref in zip(runs, alone, strict=True):
        assert [r.output_ids for r in run.results] == [r.output_ids for r in ref]
        assert run.done and not run.step()
        for r in run.results:
            # A run's time holds its own steps only: at most what the loop spent outside the sleeps,
            # however fast or loaded the machine is.
            assert 0 < r.stats.prefill_s < r.stats.wall_s <= elapsed - slept, (r.stats.wall_s, elapsed, slept)


@pytest.mark.parametrize("name", sorted(SHIPPED_DRAFTERS))
def test_shipped_drafter_loads_by_name(name):
    assert resolve_draft(name) == SHIPPED_DRAFTERS[name]
    assert resolve_draft("some/dir") == Path("some/dir")
    directory = SHIPPED_DRAFTERS[name]
    assert (directory / "README.md").read_text().startswith("# ")
    draft = load_draft(directory)
    assert draft.config.hidden_size == 576 and draft.config.vocab_size == 49152
    # The file holds the drafter's weights and nothing else (bf16 or fp32: a few tens of MB).
    with safe_open(directory / "model.safetensors", "pt") as f:
        stored = [f.get_tensor(k) for k in f.keys()]
    assert {t.dtype for t in stored} <= {torch.bfloat16, torch.float32}
    assert sum(t.numel() for t in stored) == sum(p.numel() for p in draft.parameters())
    weights_bytes = sum(t.nbytes for t in stored)
    assert weights_bytes <= (directory / "model.safetensors").stat().st_size <= weights_bytes + 2**16
    assert draft.draft_vocab.shape == (16384,)


def test_every_shipped_drafter_file_is_package_data():
    """A file the wheel leaves out would make the installed drafter differ from the repository's."""
    import fnmatch

    import tomllib

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "sglang_dflash.drafters"]
    for directory in SHIPPED_DRAFTERS.values():
        for path in directory.iterdir():
            name = str(path.relative_to(directory.parent))
            assert any(fnmatch.fnmatch(name, p) for p in patterns), f"{name} is not in package-data"


def test_engine_demo_runs_the_shipped_drafter_and_matches_plain_decoding(capsys):
    from sglang_dflash.cli import main

    assert main(["demo-engine", "--max-new-tokens", "24", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("tau ") == 4 and out.count("same text as plain decoding: True") == 4
    assert "output identical to plain greedy decoding: True" in out


def test_e2e_benchmark_on_a_gsm8k_slice(tmp_path):
    out = tmp_path / "e2e.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "bench.bench_e2e", "--datasets", "gsm8k", "--samples",
                          "2", "--block-sizes", "4", "8", "--adaptive", "4", "--tree-budgets", "6",
                          "--adaptive-tree-budgets", "6",
                          "--temperatures", "0", "1",
                          "--max-new-tokens", "12", "--threads", "2", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "tau(tok)" in run.stdout
    result = json.loads(out.read_text())
    assert [(c["temperature"], c["block_size"], c["adaptive"], c["tree_budget"]) for c in result["cases"]] == [
        (t, b, a, n) for t in (0.0, 1.0)
        for b, a, n in ((4, False, 0), (8, False, 0), (4, True, 0), (8, False, 6), (8, True, 6))]
    assert "≤4" in run.stdout
    assert all(c["identical_to_plain"] for c in result["cases"])
    for c in result["cases"]:  # a step commits 1..B tokens; the shipped drafter earns > 1.5 greedy at B=4
        assert 1.0 <= c["tau_token_weighted"] <= c["block_size"], c
        assert sum(c["accept_histogram"]) > 0
    greedy_b4 = next(c for c in result["cases"] if (c["temperature"], c["block_size"], c["adaptive"]) == (0, 4, False))
    assert greedy_b4["tau_token_weighted"] >= 1.5, greedy_b4
    assert out.with_name("e2e_tau_hist.png").stat().st_size > 1000
    assert out.with_name("e2e_speedup.png").stat().st_size > 1000
    for name in ("tau", "speedup"):
        assert out.with_name(f"e2e_tree_{name}.png").stat().st_size > 1000
    trees = result["tree_against_chain"]
    assert [(t["temperature"], t["tree"]) for t in trees] == [
        (t, label) for t in (0.0, 1.0) for label in (f"tree6/{DEFAULT_TREE_MIN_PROB:g}", "≤8+tree≤6")]
    for t in trees:
        chains = [c for c in result["cases"] if c["temperature"] == t["temperature"] and not c["adaptive"]
                  and not c["tree_budget"]]
        assert t["best_chain_tau"] == max(c["tau_token_weighted"] for c in chains)
        assert t["speedup_vs_best_chain"] == pytest.approx(t["speedup"] / max(c["speedup"] for c in chains))
    # Adaptive against the best fixed size, per temperature, in the JSON and the markdown table.
    vs_best = result["adaptive_against_fixed"]
    assert [(a["temperature"], a["adaptive"]) for a in vs_best] == [
        (t, label) for t in (0.0, 1.0) for label in ("≤4", "≤8+tree≤6")]
    for a in vs_best:
        fixed = [c["speedup"] for c in result["cases"]
                 if c["temperature"] == a["temperature"] and not c["adaptive"] and not c["tree_budget"]]
        assert a["best_fixed_speedup"] == max([1.0, *fixed])
        adaptive = next(c for c in result["cases"] if c["temperature"] == a["temperature"] and c["adaptive"]
                        and bool(c["tree_budget"]) == ("tree" in a["adaptive"]))
        assert a["vs_best_fixed"] == pytest.approx(adaptive["speedup"] / a["best_fixed_speedup"])
        low, high = a["vs_best_fixed_interval"]
        assert 0 < low <= high, a
    table = subprocess.run([sys.executable, "-m", "bench.bench_e2e", "--table", str(out)],
                           cwd=ROOT, capture_output=True, text=True, env=env, check=True).stdout
    assert table.splitlines()[0].startswith(
        f"| dataset | T | tau B=4 | tau B=8 | tau tree6/{DEFAULT_TREE_MIN_PROB:g} | B=4 | B=8 | "
        f"tree6/{DEFAULT_TREE_MIN_PROB:g} | B≤4 (mean B) | B≤8+tree≤6 (mean B) | "
        "B≤4 / best fixed | B≤8+tree≤6 / best fixed |")
    assert [line.split(" | ")[1] for line in table.splitlines()[2:]] == ["0", "1"]


def case(block_size, per_prompt_spec, per_prompt_plain, adaptive=False):
    """A bench_e2e row from per-prompt (tokens, seconds), its speedup as the benchmark computes it."""
    def rate(runs):
        return sum(t for t, _ in runs) / sum(s for _, s in runs)

    return {"dataset": "d", "temperature": 0.0, "block_size": block_size, "adaptive": adaptive, "tree_budget": 0,
            "speedup": rate(per_prompt_spec) / rate(per_prompt_plain),
            "per_prompt": {"spec": per_prompt_spec, "plain": per_prompt_plain}}


def test_adaptive_against_fixed_interval_over_resampled_prompts():
    """The 90 % interval of adaptive / best fixed over resampled prompts: a point when every prompt
    says the same; with fixed sizes that win on different prompts the best is picked per resample,
    so an adaptive run equal to one of them is never above 1.0; rows of older files have none."""
    plain = [[100, 4.0], [100, 4.0], [100, 4.0], [100, 4.0]]
    same = [[100, 2.0]] * 4
    rows = [case(2, [[100, 2.5]] * 4, plain), case(4, same, plain), case(8, same, plain, adaptive=True)]
    (against,) = bench_e2e.adaptive_against_fixed(rows)
    assert against["vs_best_fixed"] == pytest.approx(1.0)
    assert against["vs_best_fixed_interval"] == pytest.approx([1.0, 1.0])
    first_good = [[100, 1.0], [100, 3.0], [100, 3.0], [100, 3.0]]
    last_good = [[100, 3.0], [100, 3.0], [100, 3.0], [100, 1.0]]
    rows = [case(2, first_good, plain), case(4, last_good, plain), case(8, first_good, plain, adaptive=True)]
    (against,) = bench_e2e.adaptive_against_fixed(rows)
    low, high = against["vs_best_fixed_interval"]
    assert against["vs_best_fixed"] == pytest.approx(1.0) and low < 0.9 and high == pytest.approx(1.0)
    assert bench_e2e.ratio_text(against) == f"1.00 ({low:.2f}-1.00)"
    for row in rows:
        del row["per_prompt"]
    (against,) = bench_e2e.adaptive_against_fixed(rows)
    assert against["vs_best_fixed_interval"] is None and bench_e2e.ratio_text(against) == "1.00"
