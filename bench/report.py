"""Writes every results table of README.md and docs/ from the result files in bench/results/.

A table in the docs is text between two markers, `<!-- report:NAME:begin -->` and
`<!-- report:NAME:end -->`; this module owns that text and nothing else in the file. Each table
says which result file it comes from and how that file was made (commit, machine, command), so a
number in the docs is only ever a committed result, and a rerun of a benchmark changes the docs
through this generator:

    python -m bench.report          rewrite the generated sections in place
    python -m bench.report --check  exit 1, naming each section that differs from what it would write

`MANIFEST` lists every result file bench/results/ holds and the command that makes it; a result
file it does not list, or a listed one that is missing or malformed, is an error, not a gap.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


class ReportError(RuntimeError):
    """A result file is missing, unlisted or malformed, or a document lacks a section's markers."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One result file: how it is made, and what it measures."""

    make: str  # the make target, or the command where there is none
    what: str
    plots: tuple[str, ...] = ()


MANIFEST = {
    "e2e_smollm2-135m.json": Entry(
        "make e2e", "engine, CPU: the shipped drafter on SmolLM2-135M (fp32), chains and the adaptive block size",
        ("e2e_smollm2-135m_speedup.png", "e2e_smollm2-135m_tau_hist.png")),
    "e2e_smollm2-135m_trees.json": Entry(
        "make e2e-trees", "engine, CPU: draft trees against chains, fp32 target",
        ("e2e_smollm2-135m_trees_speedup.png", "e2e_smollm2-135m_trees_tau_hist.png",
         "e2e_smollm2-135m_trees_tree_speedup.png", "e2e_smollm2-135m_trees_tree_tau.png")),
    "e2e_smollm2-135m_trees_bf16.json": Entry(
        "make e2e-trees TARGET_DTYPE=bfloat16", "engine, CPU: draft trees against chains, bf16 target",
        ("e2e_smollm2-135m_trees_bf16_speedup.png", "e2e_smollm2-135m_trees_bf16_tau_hist.png",
         "e2e_smollm2-135m_trees_bf16_tree_speedup.png", "e2e_smollm2-135m_trees_bf16_tree_tau.png")),
    "serving_smollm2-135m.json": Entry(
        "make bench-serving", "SGLang servers on the CPU side by side: plain and DFLASH configurations",
        ("serving_smollm2-135m.png",)),
    "serving_smollm2-135m_load.json": Entry(
        "make bench-serving-load", "SGLang servers on the CPU under 1-32 clients: stock plain, plain with the plugin, "
        "DFLASH and NGRAM", ("serving_smollm2-135m_load.png",)),
    "soak_smollm2-135m.json": Entry("make soak SOAK_REQUESTS=5000 SOAK_PARITY_REQUESTS=500",
                                    "a DFLASH server under thousands of varied requests and faults"),
    "soak_smollm2-135m_router2.json": Entry(
        "make soak-router", "two DFLASH servers behind SGLang's router under 1,000 varied requests and faults"),
    "linear_memory_cpu.json": Entry(
        "python -m bench.linear_memory --lengths 400 --max-rows 1024",
        "CPU bf16 linear layers: resident memory over prefills of every length, and the time bounding it costs"),
    "adaptive_engine_cpu.json": Entry(
        "make bench-adaptive", "engine, CPU: the adaptive block size against every fixed one, batches of 1-8"),
    "engine_cpu.json": Entry(
        "bench_engine.py (no make target)", "engine, CPU: per-step overhead with an oracle drafter (tau = B)"),
    "cpu_ops.json": Entry("make bench", "CPU kernels against torch on SmolLM2's shapes"),
    "bench_kernels_h200.json": Entry(
        "make gpu-check (its bench stage)", "CUDA kernels against torch, SDPA and "
        "Triton on an H200"),
    "gpu_check_h200.json": Entry("make gpu-check (its summary.json)", "the GPU check's stages on an H200"),
    "gpu_smoke_h200.json": Entry("make gpu-check (its smoke stage)",
                                 "each CUDA op against the reference on an H200"),
}

# What a DFLASH server runs with no switch set, at the commit a serving result was made: labels say
# what ran, not what the defaults are today. A serving result from a commit not listed here stops the
# report until its defaults are added (git show <commit>:sglang_dflash/... tells them).
@dataclasses.dataclass(frozen=True)
class ServedDefaults:
    tree_budget: int  # draft trees where the block size adapts (0: chains only)
    draft_int8: bool  # the drafter's weights in int8 on the CPU


SERVED_DEFAULTS = {"2e1d3e7": ServedDefaults(tree_budget=0, draft_int8=False),
                   "d701478": ServedDefaults(tree_budget=15, draft_int8=True)}

DATASETS = {"humaneval": "HumanEval", "gsm8k": "GSM8K", "mtbench": "MT-Bench"}


# ---------------------------------------------------------------- reading result files

class Results:
    """The result files of one directory, read once each and checked against MANIFEST."""

    def __init__(self, directory: Path = RESULTS):
        self.directory = Path(directory)
        self._cache: dict[str, dict] = {}
        present = {p.name for p in self.directory.glob("*.json")}
        unlisted = sorted(present - set(MANIFEST))
        if unlisted:
            raise ReportError(f"{self.directory}: result files not in bench/report.py's MANIFEST: "
                              f"{', '.join(unlisted)} (list them with the command that makes them, or delete them)")
        for name, entry in MANIFEST.items():
            for plot in entry.plots:
                if not (self.directory / plot).is_file():
                    raise ReportError(f"{self.directory / plot}: missing (MANIFEST lists it as a plot of {name})")

    def __getitem__(self, name: str) -> dict:
        if name not in self._cache:
            path = self.directory / name
            if not path.is_file():
                raise ReportError(f"{path}: missing (MANIFEST lists it; rerun `{MANIFEST[name].make}`)")
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise ReportError(f"{path}: not valid JSON ({exc})") from exc
            if not isinstance(data, dict):
                raise ReportError(f"{path}: not a JSON object")
            self._cache[name] = data
        return self._cache[name]


def num(value, digits: int = 2, suffix: str = "") -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")
    return f"{value:.{digits}f}{suffix}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def short_command(command: str) -> str:
    """The command as a reader runs it from the repository root: `python`, not this machine's venv."""
    words = command.split()
    if words and re.search(r"(^|/)python[0-9.]*$", words[0]):
        words[0] = "python"
    return " ".join(words)


def provenance_line(name: str, prov: dict) -> str:
    """Where a result file comes from: its commit (and uncommitted changes), date, machine, command."""
    git = prov["git"]
    state = "clean"
    if git["dirty"]:
        changed = git.get("changed_files")
        state = (f"uncommitted changes to {', '.join(f'`{f}`' for f in changed)}" if changed
                 else "uncommitted changes (not recorded which)")
    versions = prov["versions"]
    software = ", ".join(f"{k} {v}" for k, v in versions.items() if v and k in ("torch", "sglang"))
    threads = prov.get("threads", {}).get("torch_num_threads")
    machine = prov["cpu"] + (f", {threads} torch threads" if threads else "")
    return (f"Source: [`bench/results/{name}`](../bench/results/{name}), commit `{git['commit'][:7]}` ({state}), "
            f"{prov['date'][:10]}, {machine}, {software}; made by `{short_command(prov['command'])}`.")


# ---------------------------------------------------------------- engine end to end (bench_e2e)

def e2e_label(case: dict) -> str:
    """A configuration as bench_e2e's own summaries name it: B=4, ≤8, tree8, tree8/0.03, ≤8+tree≤4."""
    budget, min_prob = case["tree_budget"], case.get("tree_min_prob") or 0
    if case["adaptive"]:
        return f"≤{case['block_size']}" + (f"+tree≤{budget}" if budget else "")
    if budget:
        return f"tree{budget}" + (f"/{min_prob:g}" if min_prob else "")
    return f"B={case['block_size']}"


def e2e_cells(data: dict) -> list[tuple[str, float]]:
    return list(dict.fromkeys((c["dataset"], c["temperature"]) for c in data["cases"]))


def cell_name(dataset: str, temperature: float) -> str:
    return f"{DATASETS.get(dataset, dataset)} T {temperature:g}"


def e2e_section(name: str) -> Callable[[Results], str]:
    def render(results: Results) -> str:
        data = results[name]
        cells = e2e_cells(data)
        by = {(e2e_label(c), c["dataset"], c["temperature"]): c for c in data["cases"]}
        configs = list(dict.fromkeys(e2e_label(c) for c in data["cases"]))
        best = {cell: max(c["speedup"] for (_, *k), c in by.items() if tuple(k) == cell) for cell in cells}
        rows = []
        for config in configs:
            row = [config]
            for cell in cells:
                case = by.get((config, *cell))
                if case is None:
                    row.append("-")
                    continue
                text = f"{num(case['speedup'], suffix='x')} ({num(case['tau_token_weighted'])})"
                row.append(f"**{text}**" if case["speedup"] == best[cell] else text)
            rows.append(row)
        identical = sum(bool(c["identical_to_plain"]) for c in data["cases"])
        dtype = data.get("target_dtype", "float32")
        out = [
            provenance_line(name, data["provenance"]),
            "",
            f"Target {data['target']} in {dtype}, drafter {data['draft']} with {data['draft_dtype']} weights, "
            f"{data['cases'][0]['samples']} prompts a set, up to {data['max_new_tokens']} new tokens, batch 1. "
            f"Decode speedup over plain decoding of the same target in the same engine, tau (tokens committed "
            f"per target pass) in brackets; the best of each column in bold. Output identical to plain decoding "
            f"in {identical} of {len(data['cases'])} cells.",
            "",
            table(["configuration", *(cell_name(*cell) for cell in cells)], rows),
        ]
        if data["adaptive_against_fixed"]:
            rows = [[cell_name(a["dataset"], a["temperature"]), a["adaptive"], num(a["speedup"], suffix="x"),
                     f"B={a['best_fixed']} {num(a['best_fixed_speedup'], suffix='x')}",
                     f"{num(a['vs_best_fixed'])} ({num(a['vs_best_fixed_interval'][0])}-"
                     f"{num(a['vs_best_fixed_interval'][1])})"]
                    for a in data["adaptive_against_fixed"]]
            out += ["", "The adaptive choice against the best fixed block size of the same cell (picked in "
                    "hindsight; plain decoding counts as B=1), with the 5-95 % bootstrap interval over prompts:", "",
                    table(["cell", "adaptive", "speedup", "best fixed", "adaptive / best fixed"], rows)]
        if data["tree_against_chain"]:
            rows = [[cell_name(t["dataset"], t["temperature"]), t["tree"], num(t["speedup"], suffix="x"),
                     f"B={t['best_chain_speedup_B']} {num(t['best_chain_speedup'], suffix='x')}",
                     num(t["speedup_vs_best_chain"], suffix="x"), num(t["tau_vs_best_chain"], suffix="x")]
                    for t in data["tree_against_chain"]]
            out += ["", "Trees against the best chain of the same cell:", "",
                    table(["cell", "tree", "speedup", "best chain", "speedup / best chain", "tau / best chain"],
                          rows)]
        return "\n".join(out)

    return render


# ---------------------------------------------------------------- SGLang servers (bench_serving)

def _arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def drafter_block_size(draft_dir: str) -> int | None:
    """The block size of a shipped drafter named by a result's draft path (the server's default B)."""
    config = ROOT / "sglang_dflash" / "drafters" / Path(draft_dir).name / "config.json"
    return json.loads(config.read_text())["block_size"] if config.is_file() else None


def served_defaults(name: str, commit: str) -> ServedDefaults:
    for prefix, defaults in SERVED_DEFAULTS.items():
        if commit.startswith(prefix):
            return defaults
    raise ReportError(f"bench/results/{name} was made at {commit[:7]}: add what a DFLASH server ran by default "
                      "at that commit to SERVED_DEFAULTS in bench/report.py")


def server_label(server: dict, block_size: int | None, defaults: ServedDefaults) -> str:
    """What a server of a serving result ran, from its arguments and environment."""
    args, env = server["args"], server["env"]
    if "--speculative-algorithm" not in args:
        if env.get("SGLANG_DFLASH_DISABLE") == "1":
            return "plain, stock SGLang (`SGLANG_DFLASH_DISABLE=1`)"
        return "plain, plugin installed"
    if _arg(args, "--speculative-algorithm").upper() == "NGRAM":
        draft_tokens = _arg(args, "--speculative-num-draft-tokens")
        return f"SGLang's NGRAM{f', {draft_tokens} draft tokens' if draft_tokens else ''}, plugin installed"
    b = _arg(args, "--speculative-dflash-block-size") or block_size or "the drafter's"
    adaptive = env.get("SGLANG_DFLASH_ADAPTIVE") != "0"
    budget = int(env.get("SGLANG_DFLASH_TREE_BUDGET", defaults.tree_budget if adaptive else 0))
    if str(b).isdigit():
        budget = min(budget, int(b) - 1)  # a tree holds at most B - 1 drafted tokens
    parts = [f"adaptive B ≤ {b}" if adaptive else f"fixed B = {b}"]
    parts.append("chains only" if budget == 0 else f"trees ≤ {budget}" if adaptive else f"a tree of {budget}")
    int8 = defaults.draft_int8 and env.get("SGLANG_DFLASH_DRAFT_INT8") != "0"
    parts.append("int8 drafter" if int8 else "drafter in the model's dtype")
    switches = " ".join(f"`{k}={v}`" for k, v in env.items())
    return "DFLASH, " + ", ".join(parts) + f" ({switches or 'no switch set'})"


def soak_parity_rows(parity: dict) -> list[list[str]]:
    """The soak's greedy parity: against the plain server with the plugin and against stock plain, or,
    through the router, against one DFLASH server alone (results before both plain servers were
    replayed hold one comparison, unkeyed, with the plugin's plain server)."""
    labels = {"dflash-single": "greedy answers through the router equal one DFLASH server's alone",
              "plain-plugin": "greedy answers equal to a plain server's with the plugin",
              "plain": "greedy answers equal to stock plain SGLang's"}
    by_reference = parity if labels.keys() & parity.keys() else {"plain-plugin": parity}
    rows = []
    for reference, label in labels.items():
        if reference in by_reference:
            p = by_reference[reference]
            margins = ", ".join(f"{d['request']} at token {d['position']} (fp32 margin {num(d['margin'], 3)})"
                                for d in p["divergences"] if d.get("margin") is not None)
            replayed = f", replayed from {p['greedy_answered']} greedy answers" if p.get("greedy_answered") else ""
            rows.append([label, f"{p['equal']} of {p['compared']} ({p['near_ties']} near-ties{replayed})"
                                + (f"; differing: {margins}" if margins else "")])
    return rows


@dataclasses.dataclass
class ServingRun:
    """A serving result read for its tables: each server's label, the two plain baselines, the levels
    (temperature, clients) in run order, each level's measurements and the greedy parity counts."""

    data: dict
    labels: dict[str, str]
    stock: str | None  # plain with the plugin switched off
    plugin: str | None  # plain with the plugin installed
    headline: str | None  # DFLASH with no switch set
    levels: list[tuple[float, int]]
    level: dict[tuple[str, float, int], dict]  # (server, temperature, clients) -> its level entry
    equal: dict[tuple[str, str], list[int]]  # (server, reference server) -> [equal, compared]

    def tok_s(self, server: str, t: float, c: int) -> float:
        return self.level[(server, t, c)]["output_tok_s"]

    def accept_length(self, server: str, t: float, c: int) -> str:
        accept = self.level[(server, t, c)]["spec_accept_length_mean"]
        return num(accept) if accept is not None else "-"

    def parity(self, server: str, reference: str | None) -> str:
        counts = self.equal.get((server, reference)) if reference else None
        return f"{counts[0]}/{counts[1]}" if counts else "reference" if reference == server else "-"


def serving_run(results: Results, name: str) -> ServingRun:
    data = results[name]
    setup = data["setup"]
    defaults = served_defaults(name, data["provenance"]["git"]["commit"])
    block = drafter_block_size(setup["draft"])
    servers = setup["servers"]

    def plain(server: str) -> bool:
        return "--speculative-algorithm" not in servers[server]["args"]

    stock = next((s for s in servers if plain(s) and servers[s]["env"].get("SGLANG_DFLASH_DISABLE") == "1"), None)
    plugin = next((s for s in servers if plain(s) and not servers[s]["env"]), None)
    headline = next((s for s, c in servers.items()
                     if (_arg(c["args"], "--speculative-algorithm") or "").lower() == "dflash" and not c["env"]), None)
    for lv in data["levels"]:
        if lv["completed"] != lv["requests"]:
            raise ValueError(f"server {lv['server']} completed {lv['completed']} of {lv['requests']} requests")
    equal: dict[tuple[str, str], list[int]] = {}
    for comp in data["comparisons"]:
        counts = equal.setdefault((comp["server"], comp["reference"]), [0, 0])
        counts[0] += comp["equal"]
        counts[1] += comp["compared"]
    return ServingRun(data, {s: server_label(c, block, defaults) for s, c in servers.items()}, stock, plugin, headline,
                      list(dict.fromkeys((lv["temperature"], lv["concurrency"]) for lv in data["levels"])),
                      {(lv["server"], lv["temperature"], lv["concurrency"]): lv for lv in data["levels"]}, equal)


def serving_setup_line(setup: dict) -> str:
    return (f"{len(setup['prompts'])} prompts ({', '.join(DATASETS.get(d, d) for d in setup['datasets'])}), up to "
            f"{setup['max_new_tokens']} new tokens, extra server arguments: `{' '.join(setup['common_args'])}`"
            f"{' ' + setup['server_args'] if setup['server_args'] else ''}. All servers are up at once and take each "
            "level's requests in rounds, one server after the other.")


def serving_table(results: Results, name: str = "serving_smollm2-135m.json") -> str:
    """The serving result's table, one row a server."""
    run = serving_run(results, name)
    rows = []
    for server, label in run.labels.items():
        row = [label]
        for t, c in run.levels:
            value = run.tok_s(server, t, c)
            ratios = [num(value / run.tok_s(ref, t, c)) if ref and ref != server else "-"
                      for ref in (run.stock, run.plugin)]
            row.append(f"{num(value, 1)} ({' / '.join(ratios)})")
        rows.append(row + [run.accept_length(server, *run.levels[0]), run.parity(server, run.stock),
                           run.parity(server, run.plugin)])
    first_t, first_c = run.levels[0]
    header = ["server", *(f"T {t:g}, {c} client{'s' if c > 1 else ''}" for t, c in run.levels),
              f"accept length (T {first_t:g}, {first_c} client)", "greedy output = stock plain",
              "= plain with the plugin"]
    return "\n".join([
        provenance_line(name, run.data["provenance"]),
        "",
        serving_setup_line(run.data["setup"]) + " Output tok/s, in brackets over stock plain SGLang / over plain "
        "with the plugin. Labels say what each server ran at that commit.",
        "",
        table(header, rows),
    ])


def serving_load_section(results: Results, name: str = "serving_smollm2-135m_load.json") -> str:
    """The load run: one row a level (temperature, clients), each server's tok/s, and the no-switch
    DFLASH server's ratio over each of the others."""
    run = serving_run(results, name)
    if run.headline is None:
        raise ValueError("no DFLASH server with no switch set")
    others = [s for s in run.labels if s != run.headline]
    rows = []
    for t, c in run.levels:
        ours = run.tok_s(run.headline, t, c)
        rows.append([f"{t:g}", str(c), *(num(run.tok_s(s, t, c), 1) for s in run.labels),
                     *(num(ours / run.tok_s(s, t, c), suffix="x") for s in others),
                     run.accept_length(run.headline, t, c)])
    header = ["T", "clients", *(f"`{s}` tok/s" for s in run.labels), *(f"`{run.headline}` / `{s}`" for s in others),
              f"`{run.headline}` accept length"]
    slots = _arg(run.data["setup"]["common_args"], "--max-running-requests")
    legend = [f"- `{s}`: {label}; greedy output = stock plain {run.parity(s, run.stock)}, = plain with the plugin "
              f"{run.parity(s, run.plugin)}" for s, label in run.labels.items()]
    return "\n".join([
        provenance_line(name, run.data["provenance"]),
        "",
        serving_setup_line(run.data["setup"]) + (f" A server runs at most {slots} requests at once; more clients "
                                                 "queue." if slots else "") + " Output tok/s of each server:",
        "",
        *legend,
        "",
        table(header, rows),
    ])


def soak_memory_rows(memory: dict) -> list[list[str]]:
    """Each server process's resident memory: its growth after the warm-up and its trend over the
    run's second half (soak_serving.memory_growth; results from before it hold neither)."""
    rows = []
    for process, growth in memory.get("growth_by_process", {}).items():
        parts = [f"{num(v, 1)} MB {what}" for key, what in (
            ("growth_after_steady_mb", "from request 1,000 to the end"),
            ("mb_per_250_second_half", "per 250 requests over the second half")) if (v := growth.get(key)) is not None]
        if parts:
            rows.append([f"`{process}` resident memory", "; ".join(parts)])
    return rows


def soak_section(name: str) -> Callable[[Results], str]:
    """The soak result `name`: one DFLASH server, or several behind SGLang's router."""

    def render(results: Results) -> str:
        data = results[name]
        setup, summary = data["setup"], data["summary"]
        checks = [[check, "pass" if ok else "**FAIL**"] for check, ok in data["checks"].items()]
        kinds = ", ".join(f"{k} {v['ok']}/{v['sent']}" for k, v in summary["by_kind"].items())
        mix = summary["step_mix"]["tokens_by_step"]
        shutdown = data["shutdown"]
        servers = setup.get("servers", 1)
        served = summary.get("served_by_backend")
        facts = [
            ["requests (ok / sent)", f"{kinds}; lost {summary['lost']}"],
            *([["`POST /generate` answered by each server", " / ".join(f"{n:,}" for n in served)]] if served else []),
            ["clients", f"{setup['clients']} (bursts of {setup['burst_size']})"],
            ["decode tokens by step kind", ", ".join(f"{k} {v:,}" for k, v in mix.items())],
            *soak_parity_rows(data["greedy_parity"]),
            ["resident memory growth, all server processes", f"{num(data['resident_memory']['growth_mb'], 0)} MB"],
            *soak_memory_rows(data["resident_memory"]),
            ["SIGTERM with requests streaming" + (" (each server)" if servers > 1 else ""),
             f"{shutdown['in_flight']} in flight, {shutdown['clients_hung']} clients hung, "
             f"exit in {num(shutdown['seconds_to_exit'], 1)} s"],
        ]
        who = ("A DFLASH server" if servers == 1 else
               f"{servers} DFLASH servers behind SGLang's router (`{setup['router']}`), which takes every request;"
               " each server")
        return "\n".join([
            provenance_line(name, data["provenance"]),
            "",
            f"{who} with the drafter {Path(setup['draft']).name} and no switch set, server arguments "
            f"`{' '.join(setup['server_args'])}`.",
            "",
            table(["check", "result"], checks),
            "",
            table(["measured", "value"], facts),
        ])

    return render


# ---------------------------------------------------------------- engine overhead and CPU kernels

def engine_section(results: Results) -> str:
    name = "engine_cpu.json"
    data = results[name]
    oracle = [[str(r["batch"]), str(r["block_size"]), num(r["tau"]), num(r["ar_tok_s"], 1), num(r["spec_tok_s"], 1),
               num(r["speedup"], suffix="x")] for r in data["rows"] if "tau" in r]
    random = [[str(r["batch"]), str(r["block_size"]), str(r["dflash_layers"]), num(r["draft_ms_per_step"], 1),
               num(r["verify_ms_per_step"], 1)] for r in data["rows"] if "draft_ms_per_step" in r]
    return "\n".join([
        provenance_line(name, data["provenance"]),
        "",
        f"Target {data['target']} on the {data['device']}, up to {data['max_new_tokens']} new tokens. An oracle "
        "drafter proposes the target's own greedy continuation, so tau is B (bar the answer's end) and the "
        "speedup measures what a step costs beyond the target's forward:",
        "",
        table(["batch", "B", "tau", "plain tok/s", "speculative tok/s", "speedup"], oracle),
        "",
        "A randomly initialised DFlash drafter's step, drafting against verifying:",
        "",
        table(["batch", "B", "draft layers", "draft ms a step", "verify ms a step"], random),
    ])


def adaptive_section(results: Results) -> str:
    name = "adaptive_engine_cpu.json"
    data = results[name]
    setup, cells = data["setup"], data["cells"]
    fixed = [c["name"] for c in setup["configurations"] if not c.get("adaptive")]
    rows = [[str(c["batch_size"]), num(c["temperature"], 1)]
            + [num(c["ms_per_token"][n], 1) for n in [*fixed, "adaptive", "adaptive (fresh)"]]
            + [c["best_fixed"], num(c["adaptive_over_best_fixed"], 3, "x"),
               num(c["fresh_adaptive_over_best_fixed"], 3, "x"), most_played(c.get("played", {}).get("adaptive"))]
            for c in cells]
    return "\n".join([
        provenance_line(name, data["provenance"]),
        "",
        f"Target {setup['target']} (fp32), drafter {setup['draft']}, {setup['max_new_tokens']} new tokens a request, "
        f"{setup['rounds']} lock-step rounds; milliseconds per generated token of a fresh Generator's call (median "
        "over rounds). `adaptive` starts from the state earlier adaptive runs saved, as the CLI does; `fresh` "
        "learns from nothing. The ratios are the best fixed configuration's time over the adaptive one's, "
        "paired by round (median): above 1.000x the adaptive run was faster.",
        "",
        "`adaptive played`: its most played steps, as shares of its request-steps.",
        "",
        table(["batch", "T", *fixed, "adaptive", "fresh", "best fixed", "adaptive / best", "fresh / best",
               "adaptive played"], rows),
    ])


def most_played(shares: dict[str, float] | None, top: int = 3) -> str:
    """The `top` most played steps of an adaptive run (bench_adaptive.shares), e.g. "B=3 52%, plain
    30%, B=4 9%"; "n/a" for a result file that does not record them."""
    if not shares:
        return "n/a"
    return ", ".join(f"{choice} {round(100 * share)}%" for choice, share in list(shares.items())[:top])


def linear_memory_section(results: Results) -> str:
    name = "linear_memory_cpu.json"
    data = results[name]
    setup = data["setup"]
    first = next(iter(data["memory"].values()))["samples"]
    step = max(1, len(first) // 4)
    marks = [str(s["lengths"]) for s in first[:-1][::step]]
    memory = [[f"`{variant}`", *(f"+{num(s['growth_mb'], 0)} MB" for s in m["samples"][:-1][::step]),
               f"+{num(m['samples'][-1]['growth_mb'], 0)} MB"] for variant, m in data["memory"].items()]
    times = [[str(c["rows"]), num(c["ms"]["F.linear"], 3), num(c["ms"]["bounded_rows_linear"], 3),
              num(c["f_linear_over_bounded"], 3, "x")] for c in data["time"]]
    return "\n".join([
        provenance_line(name, data["provenance"]),
        "",
        f"SmolLM2-135M's {len(setup['shapes'])} linear shapes in bf16, a call each at {setup['lengths']} distinct row "
        f"counts from 17 to {setup['max_rows']} (prefills of every length), one torch thread, a fresh process per "
        "variant: resident memory growth after that many lengths. `bounded_rows_linear` runs the same GEMM, once, "
        f"at the row counts {', '.join(map(str, setup['gemm_row_counts']))} (the input zero-padded to the next one).",
        "",
        table(["variant", *(f"{m} lengths" for m in marks), f"all {setup['lengths']}"], memory),
        "",
        f"Time per call of all shapes (median of {setup['rounds']} lock-step rounds; above 1.000x bounding was "
        "faster):",
        "",
        table(["rows", "F.linear ms", "bounded_rows_linear ms", "F.linear / bounded"], times),
    ])


_CPU_METRICS = {"op", "baseline", "kernel_ms", "reference_ms", "ratio", "kernel_GBps", "kernel_GFLOPs", "roofline_pct"}


def cpu_ops_section(results: Results) -> str:
    name = "cpu_ops.json"
    data = results[name]
    rows = []
    for case in data["cases"]:
        shape = ", ".join(f"{k} {v}" for k, v in case.items() if k not in _CPU_METRICS)
        rows.append([f"`{case['op']}`", shape, case.get("baseline", "reference"), num(case["kernel_ms"], 3),
                     num(case["reference_ms"], 3), num(case["ratio"], suffix="x"), num(case["roofline_pct"], 0)])
    return "\n".join([
        provenance_line(name, data["provenance"]),
        "",
        f"Median times of our kernel and its baseline, called in turns in one process; ratio = baseline / ours "
        f"(above 1: ours is faster); the last column is the bytes the call must read over its time, as % of "
        f"this machine's measured copy bandwidth ({num(data['read_GBps'], 1)} GB/s).",
        "",
        table(["op", "case", "baseline", "ours ms", "baseline ms", "ratio", "% bandwidth"], rows),
    ])


# ---------------------------------------------------------------- the GPU (gpu_check.sh)

_GPU_IGNORED = {"op", "mode", "bytes", "rotation_sets", "floor_ms", "hbm_fraction", "hbm_fraction_spec", "flops",
                "ours", "baselines", "failures", "speedup"}


def gpu_kernels_section(results: Results) -> str:
    name = "bench_kernels_h200.json"
    data = results[name]
    device = data["device"]
    out = [provenance_line(name, data["provenance"]), "",
           f"{device['name']} (compute capability {device['capability']}, torch {device['torch']}). "
           f"{data['method']['timing']}. {data['method']['checks']}. Each baseline: its median ms, then ours' "
           f"speedup over it; HBM = bytes the op must move / our time / the measured copy bandwidth. "
           f"Run {'complete' if data['complete'] else 'INCOMPLETE'}, {len(data['failures'])} failures."]
    groups: dict[tuple, list[dict]] = {}
    for case in data["cases"]:
        groups.setdefault((case["op"], tuple(case["baselines"])), []).append(case)
    for (op, baselines), cases in groups.items():
        keys = [k for k in cases[0] if k not in _GPU_IGNORED]
        rows = []
        for case in cases:
            rows.append([case.get("mode", "-"), *(str(case[k]) for k in keys), num(case["ours"]["median_ms"], 4),
                         *(f"{num(case['baselines'][b]['median_ms'], 4)} ({num(case['speedup'][b], suffix='x')})"
                           for b in baselines), num(case["hbm_fraction"])])
        out += ["", f"`{op}`:", "", table(["mode", *keys, "ours ms", *baselines, "HBM"], rows)]
    return "\n".join(out)


def gpu_goals_section(results: Results) -> str:
    name = "bench_kernels_h200.json"
    goals: dict[str, list[dict]] = {}
    for goal in results[name]["goals"]:
        goals.setdefault(goal["goal"], []).append(goal)
    rows = [[goal, num(items[0]["target"]), f"{sum(g['met'] for g in items)} of {len(items)}",
             f"{num(min(g['value'] for g in items))}-{num(max(g['value'] for g in items))}"]
            for goal, items in goals.items()]
    return "\n".join([f"From [`bench/results/{name}`](../bench/results/{name}):", "",
                      table(["goal", "target", "cases that meet it", "measured"], rows)])


def gpu_check_section(results: Results) -> str:
    name = "gpu_check_h200.json"
    data = results[name]
    env = data["environment"]
    smi = env["nvidia_smi"].splitlines()
    driver = smi[1].split(", ")[1] if len(smi) > 1 else "?"
    rows = [[s["name"], s["status"] if s["status"] == "passed" else f"**{s['status']}**", f"{s['seconds']} s",
             s["note"] or ""] for s in data["stages"]]
    return "\n".join([
        f"Source: [`bench/results/{name}`](../bench/results/{name}) (the check's `summary.json`), commit "
        f"`{data['commit'][:7]}`, started {data['started'][:16].replace('T', ' ')} UTC, "
        f"{'finished' if data['finished'] else 'NOT finished'} in {data['elapsed_s']} s of a {data['budget_s']} s "
        f"budget.",
        "",
        f"{env['gpu']} (compute capability {env['capability']}, {env['sms']} SMs, {env['memory_gib']} GiB), driver "
        f"{driver}, {env['nvcc'][0]}, torch {env['torch']} (CUDA {env['torch_cuda']}), triton {env['triton']}, "
        f"{env['cores']} CPU cores.",
        "",
        table(["stage", "result", "time", "note"], rows),
    ])


def gpu_smoke_section(results: Results) -> str:
    name = "gpu_smoke_h200.json"
    data = results[name]
    rows = []
    for op in data["ops"]:
        cases = op["cases"]
        passed = sum(c["passed"] for c in cases)
        worst = [c.get("max_abs_error", c.get("differing_elements")) for c in cases]
        exact = "differing_elements" in cases[0]
        rows.append([f"`{op['op']}`", "passed" if op["passed"] else "**failed**", f"{passed} of {len(cases)}",
                     (f"{max(worst)} differing elements" if exact else f"max abs error {max(worst):.3g}")])
    prov = data["provenance"]
    return "\n".join([
        f"Source: [`bench/results/{name}`](../bench/results/{name}), commit `{prov['git']['commit'][:7]}`, "
        f"{prov['date'][:10]}, made by `{prov['command']}`."
        + (f" The file's note: {prov['note']}." if prov.get("note") else ""),
        "",
        table(["op", "result", "cases passed", "worst case against the reference"], rows),
    ])


# ---------------------------------------------------------------- manifest and the README's summary

def manifest_section(results: Results) -> str:
    rows = []
    for name, entry in MANIFEST.items():
        data = results[name]
        prov = data.get("provenance")
        commit = (prov["git"]["commit"] if prov else data["commit"])[:7]
        plots = " ".join(f"[{p.removeprefix(name.removesuffix('.json') + '_').removesuffix('.png') or 'plot'}]"
                         f"(../bench/results/{p})" for p in entry.plots)
        rows.append([f"[`{name}`](../bench/results/{name})", entry.what, f"`{entry.make}`", commit, plots or "-"])
    return table(["result file", "measures", "made by", "commit", "plots"], rows)


def summary_section(results: Results) -> str:
    """The README's compact table: one line per kind of result, each naming its file."""
    def link(name: str) -> str:
        return f"[`{name}`](bench/results/{name})"

    def adaptive_cells(name: str, label: str) -> str:
        data = results[name]
        cases = [c for c in data["cases"] if e2e_label(c) == label and c["temperature"] == 0]
        if not cases:
            raise ValueError(f"no greedy cases of {label}")
        return ", ".join(f"{DATASETS.get(c['dataset'], c['dataset'])} {num(c['speedup'], suffix='x')}"
                         for c in cases)

    e2e, trees = "e2e_smollm2-135m.json", "e2e_smollm2-135m_trees_bf16.json"
    served = serving_run(results, "serving_smollm2-135m_load.json")
    if not (served.headline and served.stock and served.plugin):
        raise ValueError("the load run needs stock plain, plain with the plugin and a no-switch DFLASH server")

    def clients(c: int) -> str:
        ours = served.tok_s(served.headline, 0.0, c)
        stock, plugin = (num(ours / served.tok_s(ref, 0.0, c), suffix="x") for ref in (served.stock, served.plugin))
        return (f"{c} client{'s' if c > 1 else ''} {num(ours, 1)} tok/s ({stock} stock plain SGLang, "
                f"{plugin} plain with the plugin)")

    kernels = results["bench_kernels_h200.json"]["cases"]

    def speedups(op: str, mode: str | None, baseline: str) -> str:
        values = [c["speedup"][baseline] for c in kernels if c["op"] == op and c.get("mode") == mode]
        return f"{num(min(values))}-{num(max(values), suffix='x')}"

    soak = results["soak_smollm2-135m.json"]
    rows = [
        ["engine, CPU, SmolLM2-135M fp32 + shipped drafter: adaptive block size, greedy, over plain decoding",
         adaptive_cells(e2e, "≤8"), link(e2e)],
        ["the same, bf16 target: adaptive block size with trees of up to 4 nodes",
         adaptive_cells(trees, "≤8+tree≤4"), link(trees)],
        [f"SGLang server, CPU, greedy: {served.labels[served.headline]}",
         "; ".join(clients(c) for c in (1, 4, 32)), link("serving_smollm2-135m_load.json")],
        [f"SGLang server, CPU: {soak['setup']['requests']:,} varied requests and faults",
         f"{sum(soak['checks'].values())} of {len(soak['checks'])} checks pass", link("soak_smollm2-135m.json")],
        ["H200: `verify_block` over torch (greedy argmax / sampled T = 1)",
         f"{speedups('verify_block', 'greedy', 'torch_argmax_accept')} / "
         f"{speedups('verify_block', 'temperature', 'torch_sampled')}", link("bench_kernels_h200.json")],
        ["H200: `block_attention` over SDPA (FlashAttention) on pre-gathered K/V",
         speedups("block_attention", None, "sdpa_pregathered"), link("bench_kernels_h200.json")],
    ]
    return table(["measured", "result", "from"], rows)


# ---------------------------------------------------------------- documents

@dataclasses.dataclass(frozen=True)
class Section:
    doc: str  # relative to the repository root
    name: str
    files: tuple[str, ...]  # the result files it reads (named in errors)
    render: Callable[[Results], str]


SECTIONS = (
    Section("README.md", "summary", ("e2e_smollm2-135m.json", "e2e_smollm2-135m_trees_bf16.json",
                                     "serving_smollm2-135m_load.json", "soak_smollm2-135m.json",
                                     "bench_kernels_h200.json"),
            summary_section),
    Section("docs/results.md", "manifest", tuple(MANIFEST), manifest_section),
    Section("docs/results.md", "e2e", ("e2e_smollm2-135m.json",), e2e_section("e2e_smollm2-135m.json")),
    Section("docs/results.md", "e2e-trees", ("e2e_smollm2-135m_trees.json",),
            e2e_section("e2e_smollm2-135m_trees.json")),
    Section("docs/results.md", "e2e-trees-bf16", ("e2e_smollm2-135m_trees_bf16.json",),
            e2e_section("e2e_smollm2-135m_trees_bf16.json")),
    Section("docs/results.md", "serving", ("serving_smollm2-135m.json",), serving_table),
    Section("docs/results.md", "serving-load", ("serving_smollm2-135m_load.json",), serving_load_section),
    Section("docs/results.md", "soak", ("soak_smollm2-135m.json",), soak_section("soak_smollm2-135m.json")),
    Section("docs/results.md", "soak-router", ("soak_smollm2-135m_router2.json",),
            soak_section("soak_smollm2-135m_router2.json")),
    Section("docs/results.md", "adaptive", ("adaptive_engine_cpu.json",), adaptive_section),
    Section("docs/results.md", "linear-memory", ("linear_memory_cpu.json",), linear_memory_section),
    Section("docs/results.md", "engine", ("engine_cpu.json",), engine_section),
    Section("docs/results.md", "cpu-ops", ("cpu_ops.json",), cpu_ops_section),
    Section("docs/results.md", "gpu-kernels", ("bench_kernels_h200.json",), gpu_kernels_section),
    Section("docs/gpu.md", "gpu-check", ("gpu_check_h200.json",), gpu_check_section),
    Section("docs/gpu.md", "gpu-smoke", ("gpu_smoke_h200.json",), gpu_smoke_section),
    Section("docs/gpu.md", "gpu-goals", ("bench_kernels_h200.json",), gpu_goals_section),
)


def markers(name: str) -> tuple[str, str]:
    return f"<!-- report:{name}:begin -->", f"<!-- report:{name}:end -->"


def render_sections(results: Results) -> dict[tuple[str, str], str]:
    """Every generated section's text, keyed by (document, section name)."""
    out = {}
    for section in SECTIONS:
        try:
            out[(section.doc, section.name)] = section.render(results)
        except ReportError:
            raise
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
            files = ", ".join(f"bench/results/{f}" for f in section.files)
            raise ReportError(f"{files}: malformed for section {section.name!r} of {section.doc} "
                              f"({type(exc).__name__}: {exc})") from exc
    return out


def replace_section(text: str, doc: str, name: str, body: str) -> str:
    begin, end = markers(name)
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ReportError(f"{doc}: needs exactly one {begin} ... {end} pair, in that order")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def generated_documents(root: Path = ROOT, results_dir: Path | None = None) -> dict[str, tuple[str, str]]:
    """Each document with generated sections: (its text now, its text as the generator writes it)."""
    sections = render_sections(Results(results_dir or root / "bench" / "results"))
    docs: dict[str, tuple[str, str]] = {}
    for (doc, name), body in sections.items():
        if doc not in docs:
            path = root / doc
            if not path.is_file():
                raise ReportError(f"{doc}: missing (it holds the generated section {name!r})")
            text = path.read_text()
            docs[doc] = (text, text)
        current, new = docs[doc]
        docs[doc] = (current, replace_section(new, doc, name, body))
    return docs


def differing_sections(root: Path = ROOT, results_dir: Path | None = None) -> list[str]:
    """`doc: section` for each generated section whose text differs from what the generator writes."""
    sections = render_sections(Results(results_dir or root / "bench" / "results"))
    differ = []
    for (doc, name), body in sections.items():
        path = root / doc
        if not path.is_file():
            differ.append(f"{doc}: {name} (the document is missing)")
            continue
        text = path.read_text()
        begin, end = markers(name)
        if text.count(begin) != 1 or text.count(end) != 1:
            differ.append(f"{doc}: {name} (markers missing or repeated)")
        elif text.split(begin)[1].split(end)[0] != f"\n{body}\n":
            differ.append(f"{doc}: {name}")
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated section differs")
    args = parser.parse_args(argv)
    try:
        if args.check:
            differ = differing_sections()
            for line in differ:
                print(f"differs: {line}")
            if differ:
                print("run `python -m bench.report` to rewrite them")
            return 1 if differ else 0
        for doc, (current, new) in generated_documents().items():
            if new != current:
                (ROOT / doc).write_text(new)
                print(f"rewrote {doc}")
    except ReportError as exc:
        print(f"bench/report.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
