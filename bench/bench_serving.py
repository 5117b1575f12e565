"""Serving benchmark: `python -m sglang.launch_server` with DFLASH against the same server without
speculation, side by side on this machine, through the HTTP API a user calls.

All server configurations run side by side on 127.0.0.1, each started (one after the other) with
--sleep-on-idle (launch_args adds it), so a server waiting for its turn sleeps (~1.5 % of a core;
without the flag an idle SGLang scheduler spins a whole core) and warmed up with one request. Then every level's
requests go in rounds: each server in turn (which one first rotates per round) gets the round's c
requests at once and finishes them before the next server's turn, so a slow spell of this 2-core
VM falls on all servers alike. (Run one server after another, its speed drifted by up to 1.7x
between servers measured minutes apart: one run's stock plain server made 14.5 tok/s at 1 client
against 24.8 in another.) The configurations:

  plain          no speculation, plugin disabled (SGLANG_DFLASH_DISABLE=1): stock SGLang
  plain-plugin   no speculation, plugin active (its CPU hooks can change plain decoding too)
  dflash         --speculative-algorithm dflash with the drafter
  dflash-bN      the same with --speculative-dflash-block-size N (the adaptive block size's maximum)
  dflash-fixed[-bN]  the same with SGLANG_DFLASH_ADAPTIVE=0: every step at that one block size
  dflash...-treeN  any of these with SGLANG_DFLASH_TREE_BUDGET=N: decode steps may verify a draft
                 tree of N nodes (fixed: every eligible step; adaptive: chain or tree as it expects)
  dflash...-floatdraft  any of these with SGLANG_DFLASH_DRAFT_INT8=0: the drafter's weights in the
                 model's dtype instead of int8
  ngram[-dN]     SGLang's own --speculative-algorithm NGRAM (no drafter: drafts from n-grams of the
                 prompt and output), what a CPU user would pick instead of DFLASH; with N, its
                 --speculative-num-draft-tokens. Plugin active: on CPU it supplies the sgl-kernel
                 ops and the tree-verify attention NGRAM needs there

The requests are the first --samples prompts of HumanEval, GSM8K test and MT-Bench in the
target's chat template, streamed from /generate at every temperature and at every concurrency
level c (each prompt once per level and server, in rounds of c concurrent requests, prompts
repeated in turn when c exceeds their count so that a round holds c; the radix cache is flushed
before each level). A server's output tok/s at a level is its tokens over the
summed wall time of its rounds. Per server, temperature and concurrency it records output tok/s, p50/p99 time per output
token, mean time to first token and DFLASH's acceptance; per non-plain server, the tok/s ratio to
`plain` (and to `plain-plugin`), and its greedy parity twice: against `plain-plugin` (which must
be exact: the plugin's decoding is batch invariant) and against stock `plain`, each differing
output with its position and the fp32 target's logit margin at the first differing token. Writes
bench/results/serving_<target>.json (with provenance: bench/provenance.py) and a PNG beside it, and
prints a table.

    python -m bench.bench_serving [--servers plain plain-plugin dflash dflash-b4] [--samples 2]
        [--concurrency 1 4 8] [--temperatures 0 0.7] [--max-new-tokens 128] [--server-args "--dtype float32"]
        [--target DIR] [--draft DIR|NAME] [--time-limit 1800] [--out PATH]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.bench_e2e import DEFAULT_GSM8K, load_prompts
from bench.provenance import run_info
from sglang_dflash.drafters import SHIPPED_DRAFTER, resolve_draft
from sglang_dflash.engine.packaged import packaged_model_dir
from sglang_dflash.serving.local_server import LocalServer, free_port, launch_args, server_env

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = "smollm2-135m"
DATASETS = ["humaneval", "gsm8k", "mtbench"]
COMMON_ARGS = ["--max-total-tokens", "8192", "--random-seed", "0", "--max-running-requests", "16"]
# SGLang reads a request's sampling_seed only under this server flag; without it sampled outputs
# are not reproducible, so they are compared with plain's only when it is given.
DETERMINISTIC_FLAG = "--enable-deterministic-inference"
SEED_BASE = 1000  # sampling_seed of prompt i is SEED_BASE + i
STARTUP_TIMEOUT = 600
FLUSH_TIMEOUT = 60
REFERENCE = "plain"
PLUGIN_REFERENCE = "plain-plugin"
# Whose greedy outputs every other server's are compared with: stock SGLang, then the plain server
# with the plugin (a reference is compared only with the references before it).
PARITY_REFERENCES = (REFERENCE, PLUGIN_REFERENCE)


# -- configurations and requests ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    name: str
    draft: Path | None
    extra: tuple[str, ...] = ()
    env: dict = dataclasses.field(default_factory=dict)


def server_config(name: str, draft: Path) -> ServerConfig:
    if name == "plain":
        return ServerConfig(name, None, env={"SGLANG_DFLASH_DISABLE": "1"})
    if name == "plain-plugin":
        return ServerConfig(name, None)
    ngram = re.fullmatch(r"ngram(?:-d(\d+))?", name)
    if ngram is not None:
        draft_tokens = ("--speculative-num-draft-tokens", ngram[1]) if ngram[1] else ()
        return ServerConfig(name, None, ("--speculative-algorithm", "NGRAM", *draft_tokens))
    match = re.fullmatch(r"dflash(-fixed)?(?:-b(\d+))?(?:-tree(\d+))?(-floatdraft)?", name)
    if match is None:
        raise SystemExit(f"unknown server configuration {name!r}: plain, plain-plugin, "
                         "dflash[-fixed][-bN][-treeN][-floatdraft], ngram[-dN]")
    env = {"SGLANG_DFLASH_ADAPTIVE": "0"} if match[1] else {}
    if match[3]:
        env["SGLANG_DFLASH_TREE_BUDGET"] = match[3]
    if match[4]:
        env["SGLANG_DFLASH_DRAFT_INT8"] = "0"
    return ServerConfig(name, draft, ("--speculative-dflash-block-size", match[2]) if match[2] else (), env=env)


def baselines(server: str) -> list[str]:
    """The servers whose tok/s `server`'s is divided by."""
    if server.startswith(("dflash", "ngram")):
        return ["plain", "plain-plugin"]
    return [] if server == REFERENCE else [REFERENCE]


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str  # "<dataset>/<index>"
    text: str  # in the target's chat template, ready for /generate
    seed: int


def chat_prompts(tokenizer, datasets: list[str], samples: int, gsm8k: Path) -> list[Prompt]:
    prompts = []
    for dataset in datasets:
        for i, message in enumerate(load_prompts(dataset, samples, gsm8k)):
            text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                                 tokenize=False)
            prompts.append(Prompt(f"{dataset}/{i}", text, SEED_BASE + len(prompts)))
    return prompts


def request_body(prompt: Prompt, temperature: float, max_new_tokens: int) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    if temperature > 0:
        params["sampling_seed"] = prompt.seed
    return {"text": prompt.text, "sampling_params": params}


# -- one request, one concurrency level ------------------------------------------------------


def tpot(latency_s: float, ttft_s: float, completion_tokens: int) -> float | None:
    """Time per output token after the first; undefined for a single token."""
    return (latency_s - ttft_s) / (completion_tokens - 1) if completion_tokens > 1 else None


def outcome(prompt_id: str, final: dict, arrivals: list[tuple[float, int]]) -> dict:
    """One streamed request's record, from its last chunk and its chunks' (time, tokens so far)."""
    meta = final["meta_info"]
    ttft = next((t for t, tokens in arrivals if tokens > 0), None)  # None: no token at all
    latency = arrivals[-1][0]
    n = meta["completion_tokens"]
    return {
        "prompt": prompt_id, "completion_tokens": n, "prompt_tokens": meta["prompt_tokens"],
        "ttft_s": ttft, "latency_s": latency, "tpot_s": tpot(latency, ttft, n),
        "finish_reason": meta.get("finish_reason"),
        "spec_accept_length": meta.get("spec_accept_length"), "spec_verify_ct": meta.get("spec_verify_ct"),
        "output_ids": final["output_ids"],
    }


def run_level(send, items: list, concurrency: int, deadline: float, on_done=lambda: None) -> tuple[list, float]:
    """send(item) for every item with at most `concurrency` in flight. Items not started by
    time.time() `deadline` give None; a send that raises gives {"error": ...}. Returns the
    results in item order and the wall time."""

    def one(item):
        if time.time() > deadline:
            return None
        try:
            return send(item)
        except Exception as e:  # recorded per request; a dead server is checked by the caller
            return {"error": f"{type(e).__name__}: {e}"}
        finally:
            on_done()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, items))
    return results, time.perf_counter() - start


def mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def level_metrics(results: list, wall_s: float) -> dict:
    """Throughput and latency of one concurrency level: output tok/s = all completion tokens over
    the level's wall time; TPOT percentiles and means over its completed requests."""
    done = [r for r in results if r is not None and "error" not in r]
    tokens = sum(r["completion_tokens"] for r in done)
    tpots = [r["tpot_s"] for r in done if r["tpot_s"] is not None]
    return {
        "requests": len(results), "completed": len(done), "cut": results.count(None),
        "errors": [r["error"] for r in results if r is not None and "error" in r],
        "completion_tokens": tokens, "wall_s": wall_s,
        "output_tok_s": tokens / wall_s if done else None,
        "tpot_p50_ms": float(np.percentile(tpots, 50)) * 1e3 if tpots else None,
        "tpot_p99_ms": float(np.percentile(tpots, 99)) * 1e3 if tpots else None,
        "ttft_mean_ms": mean([r["ttft_s"] * 1e3 for r in done if r["ttft_s"] is not None]),
        "latency_mean_s": mean([r["latency_s"] for r in done]),
        "spec_accept_length_mean": mean([r["spec_accept_length"] for r in done if r["spec_accept_length"] is not None]),
        "spec_verify_ct_mean": mean([r["spec_verify_ct"] for r in done if r["spec_verify_ct"] is not None]),
        "step_ms_mean": mean([step_ms(r) for r in done if step_ms(r) is not None]),
    }


def step_ms(record: dict) -> float | None:
    """Mean time of one decode step (one target pass) of a request after its first token: a verify
    step on DFLASH servers (spec_verify_ct of them), a plain step otherwise (one per token)."""
    # The first token comes from the prefill, before any decode step.
    steps = record["spec_verify_ct"] or record["completion_tokens"] - 1
    if steps <= 0 or record["ttft_s"] is None:
        return None
    return (record["latency_s"] - record["ttft_s"]) / steps * 1e3


# -- comparisons ---------------------------------------------------------------------------


def level_key(level: dict) -> tuple:
    return level["server"], level["temperature"], level["concurrency"]


def add_speedups(levels: list[dict]) -> None:
    """speedup_vs_<baseline>: a level's output tok/s over its baseline server's at the same
    temperature and concurrency."""
    index = {level_key(lv): lv for lv in levels}
    for lv in levels:
        for base in baselines(lv["server"]):
            ref = index.get((base, lv["temperature"], lv["concurrency"]))
            if ref and ref["output_tok_s"] and lv["output_tok_s"] is not None:
                lv[f"speedup_vs_{base.replace('-', '_')}"] = lv["output_tok_s"] / ref["output_tok_s"]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (a missing token counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(reference: list, other: list) -> dict:
    """Prompt by prompt, `other`'s output_ids against `reference`'s (completed requests of both)."""
    ref = {r["prompt"]: r["output_ids"] for r in reference if r is not None and "error" not in r}
    compared, equal, divergences = 0, 0, []
    for r in other:
        if r is None or "error" in r or r["prompt"] not in ref:
            continue
        compared += 1
        a, b = ref[r["prompt"]], r["output_ids"]
        pos = first_divergence(a, b)
        if pos is None:
            equal += 1
        else:
            divergences.append({"prompt": r["prompt"], "position": pos,
                                "reference_token": a[pos] if pos < len(a) else None,
                                "token": b[pos] if pos < len(b) else None})
    return {"compared": compared, "equal": equal, "divergences": divergences}


def comparisons(levels: list[dict], sampled_too: bool) -> list[dict]:
    """Every level against each parity reference's level at the same temperature and concurrency
    (greedy always, sampled only when `sampled_too`): against `plain-plugin` (exact by
    construction: "must_be_exact"), and against stock `plain`, from which the plugin's
    batch-invariant plain decoding may differ at near-ties."""
    index = {level_key(lv): lv for lv in levels}
    found = []
    for lv in levels:
        if lv["temperature"] > 0 and not sampled_too:
            continue
        for reference in PARITY_REFERENCES:
            ref = index.get((reference, lv["temperature"], lv["concurrency"]))
            if ref is None or lv["server"] in PARITY_REFERENCES[: PARITY_REFERENCES.index(reference) + 1]:
                continue
            found.append({"server": lv["server"], "reference": reference,
                          "must_be_exact": reference == PLUGIN_REFERENCE, "temperature": lv["temperature"],
                          "concurrency": lv["concurrency"], **compare_outputs(ref["outcomes"], lv["outcomes"])})
    return found


def logit_margin(logits, reference_token: int, token: int) -> dict:
    """At a divergence: the two tokens' logits in the fp32 target and their difference (positive:
    fp32 prefers the reference's token; near zero: a near-tie that rounding can flip)."""
    ref_logit, logit = float(logits[reference_token]), float(logits[token])
    return {"reference_logit": ref_logit, "logit": logit, "margin": ref_logit - logit,
            "fp32_argmax": int(logits.argmax())}


def add_margins(found: list[dict], levels: list[dict], target: Path, tokenizer, prompts: list[Prompt]) -> None:
    """Each greedy divergence gets the fp32 target's logit margin, from the prompt ids plus the
    common prefix of the two outputs."""
    todo = [(c, d) for c in found if c["temperature"] == 0 for d in c["divergences"]
            if d["reference_token"] is not None and d["token"] is not None]
    if not todo:
        return
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    texts = {p.id: p.text for p in prompts}
    index = {level_key(lv): lv for lv in levels}
    for comparison, div in tqdm(todo, desc="fp32 margins", unit="divergence"):
        ref_level = index[(comparison["reference"], comparison["temperature"], comparison["concurrency"])]
        ref = next(r for r in ref_level["outcomes"] if r is not None and r.get("prompt") == div["prompt"])
        prompt_ids = tokenizer(texts[div["prompt"]])["input_ids"]
        ids = torch.tensor([prompt_ids + ref["output_ids"][:div["position"]]])
        with torch.no_grad():
            logits = model(ids).logits[0, -1]
        div.update(logit_margin(logits, div["reference_token"], div["token"]),
                   prompt_ids_match_server=len(prompt_ids) == ref["prompt_tokens"])


# -- running the servers -------------------------------------------------------------------


class ServerFailed(Exception):
    pass


def fail(server: LocalServer, message: str):
    raise ServerFailed(f"{server.name}: {message}\n--- tail of {server.log} ---\n{server.text()[-4000:]}")


def log_line(text: str, needle: str) -> str | None:
    return next((line.strip() for line in text.splitlines() if needle in line), None)


@dataclasses.dataclass
class Run:
    """What every server of a run shares, and what the run records besides the levels."""

    args: argparse.Namespace
    target: Path
    prompts: list[Prompt]
    log_dir: Path
    deadline: float  # time.time() after which no request is sent
    cut: list[str] = dataclasses.field(default_factory=list)  # what the time limit left out
    launches: dict = dataclasses.field(default_factory=dict)  # server name -> how it was started


def start(run: Run, server: LocalServer) -> bool:
    """Wait for the server; False if the time limit ran out first."""
    try:
        server.wait_ready(min(run.deadline, time.time() + STARTUP_TIMEOUT))
    except TimeoutError as e:
        if time.time() < run.deadline:
            raise ServerFailed(str(e)) from None
        run.cut.append(f"server {server.name}: time limit during start-up")
        return False
    except RuntimeError as e:  # exited; the message has the log's tail
        raise ServerFailed(str(e)) from None
    return True


def start_server(run: Run, config: ServerConfig) -> LocalServer | None:
    """Start one server and warm it up; None if the time limit ran out first. The caller stops it."""
    extra = [*config.extra, *COMMON_ARGS, *shlex.split(run.args.server_args)]
    argv = launch_args(run.target, free_port(), draft=config.draft, extra=extra)
    server = LocalServer(config.name, argv, server_env(run.log_dir, **config.env), run.log_dir / f"{config.name}.log")
    try:
        if not start(run, server):
            server.stop()
            return None
        # One untimed request: the first forward passes allocate and warm caches.
        server.stream_generate(request_body(run.prompts[0], 0.0, run.args.max_new_tokens), run.args.request_timeout)
    except (RuntimeError, OSError) as e:
        try:
            fail(server, f"{type(e).__name__}: {e}")
        finally:
            server.stop()
    except BaseException:
        server.stop()
        raise
    run.launches[config.name] = {"args": argv[1:], "env": config.env,
                                 "threads": log_line(server.text(), "init_threads_binding")}
    return server


def rounds(items: list, concurrency: int, servers: list) -> list[tuple[list, list]]:
    """The rounds of one level: (the round's items, the servers in the order they take it), `concurrency`
    items a round, the first server rotating from round to round."""
    n = len(servers)
    chunks = [items[i:i + concurrency] for i in range(0, len(items), concurrency)]
    return [(chunk, servers[i % n:] + servers[:i % n]) for i, chunk in enumerate(chunks)]


def level_prompts(prompts: list[Prompt], concurrency: int) -> list[Prompt]:
    """A level's requests: every prompt once, and at a concurrency above the prompt count the prompts
    again in turn until `concurrency` requests fill the round (a level past the server's running
    slots then queues, as it would under that many clients)."""
    return [prompts[i % len(prompts)] for i in range(max(len(prompts), concurrency))]


def run_one_level(run: Run, servers: list[LocalServer], temperature: float, concurrency: int, bar) -> list[dict]:
    """One temperature x concurrency level on every server, in rounds; one level record per server."""
    # Every level starts from an empty prefix cache, or later levels would skip the prefills. With a
    # timeout SGLang defers the flush until the scheduler is idle: it may still be retiring the last
    # level's requests after their streams have ended, and refuses an immediate flush then.
    for server in servers:
        server.post(f"/flush_cache?timeout={FLUSH_TIMEOUT}", {})
    results = {server.name: [] for server in servers}
    walls = dict.fromkeys(results, 0.0)
    for chunk, order in rounds(level_prompts(run.prompts, concurrency), concurrency, servers):
        for server in order:
            def send(prompt: Prompt, server=server) -> dict:
                body = request_body(prompt, temperature, run.args.max_new_tokens)
                return outcome(prompt.id, *server.stream_generate(body, run.args.request_timeout))

            done, wall = run_level(send, chunk, concurrency, run.deadline, bar.update)
            if server.proc.poll() is not None:
                fail(server, f"exited ({server.proc.returncode}) during T={temperature} c={concurrency}")
            results[server.name] += done
            walls[server.name] += wall
    levels = []
    for server in servers:
        done = results[server.name]
        level = {"server": server.name, "temperature": temperature, "concurrency": concurrency,
                 **level_metrics(done, walls[server.name]), "outcomes": done}
        if level["cut"]:
            run.cut.append(f"{server.name} T={temperature} c={concurrency}: {level['cut']} of {len(done)} "
                           "requests not sent (time limit)")
        levels.append(level)
    return levels


def run_servers(run: Run, configs: list[ServerConfig]) -> list[dict]:
    """Start every server, run every temperature x concurrency level on all of them, stop them."""
    servers = []
    try:
        for config in tqdm(configs, desc="starting servers", unit="server"):
            if time.time() > run.deadline:
                run.cut.append(f"server {config.name}: not started (time limit)")
                continue
            server = start_server(run, config)
            if server is not None:
                servers.append(server)
        levels = []
        total = len(run.args.temperatures) * len(servers) * sum(
            len(level_prompts(run.prompts, c)) for c in run.args.concurrency)
        with tqdm(total=total, desc="requests", unit="req") as bar:
            for temperature in run.args.temperatures:
                for concurrency in run.args.concurrency:
                    try:
                        levels += run_one_level(run, servers, temperature, concurrency, bar)
                    except (RuntimeError, OSError) as e:
                        raise ServerFailed(f"T={temperature} c={concurrency}: {type(e).__name__}: {e}") from None
        return levels
    finally:
        for server in servers:
            server.stop()


# -- output -------------------------------------------------------------------------------


def plot(levels: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({lv["temperature"] for lv in levels})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(5 * len(temperatures), 4), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures, strict=True):
        for server in dict.fromkeys(lv["server"] for lv in levels):
            points = [(lv["concurrency"], lv["output_tok_s"]) for lv in levels
                      if lv["server"] == server and lv["temperature"] == temperature and lv["output_tok_s"]]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=server)
        ax.set_xticks(sorted({lv["concurrency"] for lv in levels}))
        ax.set(xlabel="concurrent requests", ylabel="output tok/s", title=f"T = {temperature}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def fmt(value, spec: str) -> str:
    """`value` in format `spec` ("7.2f"), or "-" right-aligned in the same width when it is None."""
    return f"{'-':>{spec.split('.')[0]}}" if value is None else format(value, spec)


def print_table(levels: list[dict], found: list[dict]) -> None:
    equal = {(c["server"], c["temperature"], c["concurrency"], c["reference"]): f"{c['equal']}/{c['compared']}"
             for c in found}
    print(f"\n{'server':14s} {'T':>4s} {'c':>3s} {'tok/s':>7s} {'x plain':>7s} {'x plugin':>8s} {'TPOT p50':>8s} "
          f"{'p99 ms':>7s} {'TTFT ms':>8s} {'accept':>6s} {'=plugin':>7s} {'=plain':>6s} {'cut':>4s}")
    for lv in levels:
        key = level_key(lv)
        print(f"{lv['server']:14s} {lv['temperature']:4.1f} {lv['concurrency']:3d} {fmt(lv['output_tok_s'], '7.1f')} "
              f"{fmt(lv.get('speedup_vs_plain'), '7.2f')} {fmt(lv.get('speedup_vs_plain_plugin'), '8.2f')} "
              f"{fmt(lv['tpot_p50_ms'], '8.1f')} {fmt(lv['tpot_p99_ms'], '7.1f')} {fmt(lv['ttft_mean_ms'], '8.0f')} "
              f"{fmt(lv['spec_accept_length_mean'], '6.2f')} {equal.get((*key, PLUGIN_REFERENCE), '-'):>7s} "
              f"{equal.get((*key, REFERENCE), '-'):>6s} {lv['cut']:4d}")
    for c in found:
        for d in c["divergences"]:
            print(f"  {'NOT EXACT: ' if c['must_be_exact'] else ''}{c['server']} T={c['temperature']} "
                  f"c={c['concurrency']} {d['prompt']}: differs from {c['reference']} at token {d['position']} "
                  f"({d['reference_token']} vs {d['token']}), fp32 margin {fmt(d.get('margin'), '.3f')}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, help=f"HF model directory (default: the packaged {DEFAULT_TARGET})")
    parser.add_argument("--draft", default=SHIPPED_DRAFTER, help="DFlash checkpoint directory or shipped drafter name")
    parser.add_argument("--servers", nargs="+", default=["plain", "dflash"],
                        help="plain, plain-plugin, dflash (the served defaults, docs/serving.md#settings), "
                             "dflash[-fixed][-bN][-treeN][-floatdraft] (-tree0: chains only); all run side by side")
    parser.add_argument("--server-args", default="", help='extra server arguments, e.g. "--dtype float32"')
    parser.add_argument("--datasets", nargs="+", default=DATASETS)
    parser.add_argument("--samples", type=int, default=2, help="prompts per dataset")
    parser.add_argument("--gsm8k", type=Path, default=DEFAULT_GSM8K)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--request-timeout", type=float, default=600, help="seconds per request")
    parser.add_argument("--time-limit", type=float, default=1800,
                        help="seconds for the whole run; then it stops sending and writes what it has")
    parser.add_argument("--out", type=Path, help=f"JSON path (default bench/results/serving_{DEFAULT_TARGET}.json "
                                                 "for the default target)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    deadline = time.time() + args.time_limit
    from transformers import AutoTokenizer

    target = args.target or packaged_model_dir(DEFAULT_TARGET)
    draft = resolve_draft(args.draft)
    configs = [server_config(name, draft) for name in args.servers]
    deterministic = DETERMINISTIC_FLAG in shlex.split(args.server_args)
    info = run_info({"target": target, **({"draft": draft} if any(c.draft for c in configs) else {})})
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = chat_prompts(tokenizer, args.datasets, args.samples, args.gsm8k)
    run = Run(args, target, prompts, Path(tempfile.mkdtemp(prefix="bench_serving_")), deadline)
    print(f"{len(prompts)} prompts; load average {info['load_average'][0]:.2f} on {info['threads']['cpu_count']} "
          f"cores (other work on the machine skews every number); server logs in {run.log_dir}")

    try:
        levels = run_servers(run, configs)
    except ServerFailed as e:
        print(e, file=sys.stderr)
        raise SystemExit(1) from None

    add_speedups(levels)
    found = comparisons(levels, sampled_too=deterministic)
    add_margins(found, levels, target, tokenizer, prompts)
    print_table(levels, found)
    for note in run.cut:
        print(f"cut: {note}")

    out = args.out or ROOT / "bench" / "results" / f"serving_{args.target.name if args.target else DEFAULT_TARGET}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    setup = {
        "target": str(target), "draft": str(draft), "servers": run.launches, "common_args": COMMON_ARGS,
        "server_args": args.server_args, "datasets": args.datasets, "samples": args.samples,
        "prompts": [p.id for p in prompts], "temperatures": args.temperatures, "concurrency": args.concurrency,
        "max_new_tokens": args.max_new_tokens, "request_timeout_s": args.request_timeout,
        "time_limit_s": args.time_limit, "log_dir": str(run.log_dir),
        "deterministic_inference": deterministic, "sampled_outputs_compared": deterministic,
        "sampling_seed_note": f"SGLang uses a request's sampling_seed only under {DETERMINISTIC_FLAG}; even then "
                              "plain SGLang and the DFLASH worker draw different (equally distributed) samples",
    }
    out.write_text(json.dumps({"provenance": info, "setup": setup, "levels": levels, "comparisons": found,
                               "cut": run.cut}, indent=1))
    print(f"wrote {out}")
    if levels:
        plot(levels, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
