"""The engine's adaptive block size against every fixed one, in batches, in lock-step.

What a user of `sglang-dflash generate --adaptive` gets: each call builds a fresh Generator, as a
new process would, and decodes a batch of prompts. The adaptive one starts from the state the
previous adaptive run on this machine saved (engine/controller_state.py, as the CLI does; one state
for the whole benchmark, as one user's machine has, first learned by one untimed call per batch
size and temperature on other prompts); "adaptive (fresh)" learns from nothing in every call, as
the first run on a machine (or `--fresh-adaptive`) does. For every batch size, temperature and
round, every configuration runs once, in an order that rotates from round to round, so a slow
spell of the machine falls on all of them: plain decoding (B = 1), each fixed block size, and the
adaptive choice up to the drafter's block size with the draft trees it plays by default. Greedy
and seeded sampling give the same tokens whatever the block size (every step is a lossless
verify), so every configuration decodes the same tokens, and that is checked.

The figure of merit is milliseconds per generated token of the whole call. Reported per cell: the
median over rounds of each configuration, and adaptive / best fixed as the median over rounds of
the paired ratio (the best fixed block size by median, timed in the same round); the same for
the fresh adaptive run; and what each adaptive run's steps verified (plain, a chain of B rows, a
tree), as shares of its request-steps over the rounds.

    python -m bench.bench_adaptive [--batch-sizes 1 3 8] [--temperatures 0 0.7] [--rounds 5]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.provenance import run_info
from sglang_dflash.control.tree import DEFAULT_TREE_TOPK, default_tree_budget, most_tree_nodes
from sglang_dflash.data import gsm8k_path
from sglang_dflash.drafters import SHIPPED_DRAFTER, resolve_draft
from sglang_dflash.engine import Generator, HFTarget, SamplingParams, encode_prompt, load_drafter
from sglang_dflash.engine.drafters import NoDrafter
from sglang_dflash.engine.packaged import model_dir

ROOT = Path(__file__).resolve().parents[1]
CHAT_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain why the sky is blue in three sentences.",
    "List five fruits and one fact about each.",
    "What is the difference between a list and a tuple in Python?",
]
# The saved state's untimed first runs read other text than the timed ones.
WARM_UP_CHAT_PROMPTS = [
    "Write a Python function that reverses the words of a sentence.",
    "Explain how a rainbow forms in three sentences.",
    "Name four planets and one fact about each.",
    "What does a dictionary do in Python?",
]


def prompts(count: int, warm_up: bool = False) -> list[str]:
    """Chat prompts and GSM8K test questions, alternating: a batch mixes kinds of text. The warm-up
    set shares no prompt with the timed one."""
    skip = 100 if warm_up else 0
    questions = [json.loads(line)["question"] for line in gsm8k_path("test").open()][skip:skip + count]
    chat = WARM_UP_CHAT_PROMPTS if warm_up else CHAT_PROMPTS
    mixed = [p for pair in zip(chat * count, questions, strict=False) for p in pair]
    return mixed[:count]


def configurations(max_block_size: int, fixed: list[int]) -> list[dict]:
    budget = default_tree_budget(most_tree_nodes(max_block_size, DEFAULT_TREE_TOPK))
    return ([{"name": "plain", "block_size": 1}]
            + [{"name": f"B={b}", "block_size": b} for b in fixed if 1 < b <= max_block_size]
            + [{"name": "adaptive", "block_size": max_block_size, "adaptive": True, "tree_budget": budget,
                "saved_state": True},
               {"name": "adaptive (fresh)", "block_size": max_block_size, "adaptive": True, "tree_budget": budget}])


def run_once(target, drafter, config: dict, batch: list[list[int]], params: SamplingParams,
             state_dir: Path) -> tuple[float, list, collections.Counter]:
    """Seconds per generated token of one fresh Generator's call, its outputs, and what its steps
    verified (`played`)."""
    gen = Generator(target, drafter if config["block_size"] > 1 else NoDrafter(), config["block_size"],
                    adaptive=config.get("adaptive", False), tree_budget=config.get("tree_budget", 0),
                    adaptive_state_dir=state_dir if config.get("saved_state") else None)
    start = time.perf_counter()
    results = gen.generate(batch, params)
    seconds = time.perf_counter() - start
    return seconds / sum(len(r.output_ids) for r in results), [r.output_ids for r in results], played(results)


def played(results) -> collections.Counter:
    """An adaptive call's request-steps by what they verified: plain, a chain of B rows, a tree of n
    nodes (empty for a fixed block size)."""
    counts = collections.Counter()
    for result in results:
        for decision in result.decisions:
            rows = decision.get("verified", decision["block_size"])
            counts[f"tree of {decision['tree_budget']}" if decision.get("tree_budget")
                   else "plain" if rows == 1 else f"B={rows}"] += 1
    return counts


def cell_report(times: dict[str, list[float]]) -> dict:
    """Median ms/token per configuration; adaptive / best fixed (paired per round, then the median),
    for the adaptive run from the saved state and the fresh one."""
    medians = {name: statistics.median(t) for name, t in times.items()}
    fixed = {name: m for name, m in medians.items() if not name.startswith("adaptive")}
    best = min(fixed, key=fixed.get)
    report = {"ms_per_token": {name: round(1e3 * m, 3) for name, m in medians.items()}, "best_fixed": best}
    for name, key in (("adaptive", "adaptive"), ("adaptive (fresh)", "fresh_adaptive")):
        paired = [b / a for a, b in zip(times[name], times[best], strict=True)]
        report.update({f"{key}_over_best_fixed": round(statistics.median(paired), 4),
                       f"{key}_over_best_fixed_by_round": [round(p, 4) for p in paired],
                       f"{key}_over_plain": round(medians["plain"] / medians[name], 4)})
    return report


def shares(counts: collections.Counter) -> dict[str, float]:
    """Each choice's share of the request-steps, most played first."""
    total = sum(counts.values())
    return {choice: round(n / total, 4) for choice, n in counts.most_common()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default=SHIPPED_DRAFTER)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 3, 8])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--fixed", type=int, nargs="+", default=[2, 3, 4, 6, 8], help="fixed block sizes")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "adaptive_engine_cpu.json")
    args = parser.parse_args()

    info = run_info({"target": model_dir(args.target), "draft": resolve_draft(args.draft)})
    target = HFTarget.from_pretrained(args.target)
    drafter = load_drafter(resolve_draft(args.draft), target)
    configs = configurations(drafter.max_block_size, args.fixed)
    texts, other_texts = prompts(max(args.batch_sizes)), prompts(max(args.batch_sizes), warm_up=True)
    adaptive = next(c for c in configs if c.get("saved_state"))
    state_dir = Path(tempfile.mkdtemp(prefix="bench_adaptive_"))  # the benchmark's "machine": one state
    cells = []
    total = len(args.batch_sizes) * len(args.temperatures) * (args.rounds * len(configs) + 1)
    with tqdm(total=total, desc="lock-step runs", unit="run") as bar:
        for batch_size in args.batch_sizes:
            batch = [encode_prompt(target.tokenizer, t) for t in texts[:batch_size]]
            for temperature in args.temperatures:
                params = SamplingParams(temperature=temperature, seed=1, max_new_tokens=args.max_new_tokens)
                # Untimed: the saved state learns this batch size and temperature on other prompts.
                run_once(target, drafter, adaptive,
                         [encode_prompt(target.tokenizer, t) for t in other_texts[:batch_size]], params, state_dir)
                bar.update()
                times: dict[str, list[float]] = {c["name"]: [] for c in configs}
                outputs: dict[str, list] = {}
                mix = {c["name"]: collections.Counter() for c in configs if c.get("adaptive")}
                for round_ in range(args.rounds):
                    shift = round_ % len(configs)
                    for config in configs[shift:] + configs[:shift]:
                        per_token, out, steps = run_once(target, drafter, config, batch, params, state_dir)
                        times[config["name"]].append(per_token)
                        if config["name"] in mix:
                            mix[config["name"]] += steps
                        outputs.setdefault(config["name"], out)
                        bar.update()
                differing = [name for name, out in outputs.items() if out != outputs["plain"]]
                if differing:
                    raise SystemExit(f"batch {batch_size}, T={temperature}: {differing} decoded other tokens "
                                     "than plain decoding")
                cell = {"batch_size": batch_size, "temperature": temperature, **cell_report(times),
                        "tokens": sum(len(o) for o in outputs["plain"]),
                        "played": {name: shares(counts) for name, counts in mix.items()}}
                cells.append(cell)
                ms = cell["ms_per_token"]
                tqdm.write(f"batch {batch_size} T={temperature}: adaptive {ms['adaptive']} ms/token, "
                           f"fresh {ms['adaptive (fresh)']}, best fixed {cell['best_fixed']} {ms[cell['best_fixed']]}, "
                           f"plain {ms['plain']}; adaptive / best fixed {cell['adaptive_over_best_fixed']} "
                           f"(rounds {cell['adaptive_over_best_fixed_by_round']}), "
                           f"fresh / best fixed {cell['fresh_adaptive_over_best_fixed']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "provenance": info,
        "setup": {"target": args.target, "draft": args.draft, "max_new_tokens": args.max_new_tokens,
                  "rounds": args.rounds, "configurations": configs, "threads": torch.get_num_threads(),
                  "figure": "milliseconds per generated token of a fresh Generator's generate() call"},
        "cells": cells}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
