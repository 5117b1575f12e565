"""Soak test of a DFLASH server: many varied requests, malformed ones and faults, then checks that
nothing was lost, nothing leaked and nothing crashed.

One `python -m sglang.launch_server --speculative-algorithm dflash` (shipped drafter, adaptive
block size, the plugin active) on 127.0.0.1 takes --requests requests from --clients concurrent
clients, more than its --max-running-requests, so the scheduler queues, plus bursts of
--burst-size at once. The requests (seeded, reproducible) mix:

  prompts     chat-template GSM8K questions, and raw token-id prompts from 1 token up to the
              context limit minus the request's max_new_tokens
  decoding    greedy; seeded sampling at T 0.7 / 1.0; top-k; top-p; min-p; n > 1
  endings     max_new_tokens 1-256; ignore_eos on and off; stop strings; stop token ids
  outputs     streamed and not; logprobs (with top logprobs); JSON-schema and regex constraints
  faults      clients that disconnect mid-stream; /abort_request of running requests; malformed
              requests (each must get a 4xx answer while the server keeps serving)

Checks, each a line of the report (exit status 1 if any fails):
  - every accepted request got a complete, well-formed answer (finish reason, token counts, no
    token after an EOS or stop token, none after a stop string, which is trimmed, logprobs per token, constraints met);
  - every malformed request got a 4xx answer;
  - after the run no request is left, the KV pool holds no slot (target and draft K/V share it),
    SGLang's own idle leak check stayed silent, resident memory grew by at most --max-rss-growth-mb;
  - each server process's resident memory, sampled every 250 requests, grew by at most
    --max-process-growth-mb from request 1,000 to the end and by at most --max-growth-per-250-mb per
    250 requests over the run's second half (the slope of a line through its samples there; checked
    when the run is long enough to have them);
  - the server still answers; SIGTERM with requests in flight ends every process of the server and
    each in-flight request gets its answer or a closed connection;
  - the greedy answers equal, exactly, those of a plain server with the plugin active (no
    speculation; its decoding is batch invariant) sent the same requests afterwards.
Reported, not checked: the same greedy requests against a stock plain server (SGLANG_DFLASH_DISABLE=1),
whose decoding the plugin changes; each difference, in both comparisons, with its request, position
and the fp32 target's logit margin at the first differing token (near-ties: |margin| <= --near-tie).

With --servers N > 1, N such servers, each on its own share of the cores (LocalServer's `cores`),
sit behind SGLang's router (sglang-router), which takes every
request (aborts go to each server: the router does not forward them); each server's processes and the
router's are sampled, every server must have answered requests, each server is checked idle and
SIGTERMed under load, and the greedy answers are compared with one DFLASH server alone instead.

Writes bench/results/soak_<target>.json, or soak_<target>_router<N>.json (provenance: bench/provenance.py).

    python -m bench.soak_serving [--requests 1000] [--clients 12] [--servers 1] [--parity-requests N] [--out PATH]
    make soak SOAK_REQUESTS=5000 SOAK_PARITY_REQUESTS=500
    make soak-router
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import http.client
import json
import math
import random
import re
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from bench.bench_serving import PLUGIN_REFERENCE, REFERENCE, first_divergence, logit_margin
from bench.provenance import run_info
from sglang_dflash.data import gsm8k_path
from sglang_dflash.drafters import SHIPPED_DRAFTER, resolve_draft
from sglang_dflash.engine.packaged import packaged_model_dir
from sglang_dflash.serving.local_server import (
    LocalRouter,
    LocalServer,
    all_ready,
    core_groups,
    free_port,
    launch_args,
    server_env,
    sigterm_in_flight,
    sse_chunks,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = "smollm2-135m"
STARTUP_TIMEOUT = 600
SINGLE_REFERENCE = "dflash-single"  # one DFLASH server alone: what answers through the router must equal
REQUEST_TIMEOUT = 600
# SGLang's own idle invariant checks (strict by default: a leak kills the scheduler).
LEAK_MARKERS = ("memory leak detected", "double free", "use-after-free", "Mem Leak Detected")
JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"]}
REGEX = r"[0-9]+(, [0-9]+)*"
STOP_STRINGS = (["\n\n"], ["."], [" the"], ["\n", "?"])


@dataclasses.dataclass
class Spec:
    """One request of the soak and what its answer must satisfy."""

    id: str
    kind: str  # "generate", "malformed/<what>", "disconnect", "abort"
    body: dict | bytes  # the JSON body, or raw bytes for a body that is not JSON
    stream: bool = False
    greedy: bool = False  # compared with the plain server's answer
    chunks_before_disconnect: int = 0
    abort_after_s: float = 0.0


# -- the requests ------------------------------------------------------------------------------


def token_stream(tokenizer) -> list[int]:
    """A long stretch of real text as token ids (GSM8K train questions and answers), from which the
    raw prompts of every length are cut."""
    ids = []
    for line in gsm8k_path("train").open():
        record = json.loads(line)
        ids += tokenizer(record["question"] + "\n" + record["answer"] + "\n\n")["input_ids"]
        if len(ids) > 200_000:
            break
    return ids


def chat_texts(tokenizer, count: int) -> list[str]:
    questions = [json.loads(line)["question"] for line in gsm8k_path("test").open()][:count]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in questions]


def max_new_tokens(rng: random.Random) -> int:
    """Mostly short answers (so a thousand requests fit a CPU), some up to 256."""
    r = rng.random()
    return rng.randint(1, 32) if r < 0.6 else rng.randint(33, 128) if r < 0.9 else rng.randint(129, 256)


def sampling(rng: random.Random) -> dict:
    r = rng.random()
    if r < 0.45:
        return {"temperature": 0}
    seed = {"sampling_seed": rng.randrange(1 << 30)}
    if r < 0.60:
        return {"temperature": 0.7, **seed}
    if r < 0.72:
        return {"temperature": 1.0, "top_p": 0.9, **seed}
    if r < 0.84:
        return {"temperature": 0.8, "top_k": 20, **seed}
    if r < 0.92:
        return {"temperature": 1.0, "min_p": 0.1, **seed}
    return {"temperature": 0.9, "n": rng.choice([2, 3]), **seed}


def malformed(rng: random.Random, tokenizer, context_length: int, stream: list[int]) -> tuple[str, dict | bytes]:
    """A request SGLang (or the plugin) must refuse with a 4xx answer: (what is wrong, body)."""
    vocab = len(tokenizer)
    text = "Say something."
    cases = [
        ("empty prompt", {"text": "", "sampling_params": {"max_new_tokens": 8}}),
        ("empty input_ids", {"input_ids": [], "sampling_params": {"max_new_tokens": 8}}),
        ("out-of-vocabulary id", {"input_ids": [1, 2, vocab + rng.randrange(1000)], "sampling_params": {}}),
        ("negative id", {"input_ids": [5, -3, 7], "sampling_params": {"max_new_tokens": 8}}),
        ("negative temperature", {"text": text, "sampling_params": {"temperature": -1.0}}),
        ("top_p above 1", {"text": text, "sampling_params": {"top_p": 2.0}}),
        ("top_k zero", {"text": text, "sampling_params": {"top_k": 0}}),
        ("negative max_new_tokens", {"text": text, "sampling_params": {"max_new_tokens": -1}}),
        ("no prompt", {"sampling_params": {"max_new_tokens": 8}}),
        ("prompt longer than the context", {"input_ids": stream[:context_length + 16], "sampling_params": {}}),
        ("invalid JSON schema", {"text": text, "sampling_params": {"json_schema": "{not json"}}),
        ("body is not JSON", b'{"text": "unterminated'),
    ]
    return cases[rng.randrange(len(cases))]


def build_requests(count: int, seed: int, tokenizer, context_length: int) -> list[Spec]:
    rng = random.Random(seed)
    stream, texts = token_stream(tokenizer), chat_texts(tokenizer, 200)
    stop_id_choices = [tokenizer.convert_tokens_to_ids(t) for t in (".", "Ċ", ",")]
    specs = []
    for i in range(count):
        rid = f"soak-{seed}-{i}"
        r = rng.random()
        if r < 0.04:
            what, body = malformed(rng, tokenizer, context_length, stream)
            specs.append(Spec(rid, f"malformed/{what}", body))
            continue
        params = {"max_new_tokens": max_new_tokens(rng), **sampling(rng)}
        raw_prompt = None
        if rng.random() < 0.5:
            body = {"text": rng.choice(texts)}
        else:  # raw ids of any length up to the context limit, so long prompts and 1-token ones occur
            room = prompt_room(context_length, params["max_new_tokens"])
            length = min(room, int(math.exp(rng.uniform(0, math.log(room)))))
            at_limit = rng.random() < 0.03
            start = rng.randrange(len(stream) - length)
            raw_prompt, body = (start, length, at_limit), {}  # cut below, once max_new_tokens is final
        if rng.random() < 0.25:
            params["ignore_eos"] = True
        if rng.random() < 0.12:
            params["stop"] = rng.choice(STOP_STRINGS)
        if rng.random() < 0.06:
            params["stop_token_ids"] = [rng.choice(stop_id_choices)]
        constraint = rng.random()
        if constraint < 0.02:
            params.update(json_schema=json.dumps(JSON_SCHEMA), max_new_tokens=64)
            params.pop("ignore_eos", None), params.pop("stop", None), params.pop("stop_token_ids", None)
        elif constraint < 0.04:
            params["regex"] = REGEX
        if rng.random() < 0.12:
            body.update(return_logprob=True, top_logprobs_num=rng.choice([0, 3]))
        body = {"rid": rid, **body, "sampling_params": params}
        stream_it = rng.random() < 0.35
        fault = rng.random()
        if fault < 0.03:
            params.update(max_new_tokens=max(params["max_new_tokens"], 64), ignore_eos=True)
            specs.append(Spec(rid, "disconnect", body, stream=True, chunks_before_disconnect=rng.randint(1, 4)))
        elif fault < 0.05:
            params.update(max_new_tokens=max(params["max_new_tokens"], 64), ignore_eos=True)
            specs.append(Spec(rid, "abort", body, stream=stream_it, abort_after_s=rng.uniform(0.2, 2.0)))
        else:
            greedy = params["temperature"] == 0 and params.get("n", 1) == 1
            specs.append(Spec(rid, "generate", body, stream=stream_it, greedy=greedy))
        if raw_prompt:
            start, length, at_limit = raw_prompt
            room = prompt_room(context_length, params["max_new_tokens"])
            body["input_ids"] = stream[start:start + (room if at_limit else min(length, room))]
    return specs


def prompt_room(context_length: int, max_new_tokens: int) -> int:
    """The longest prompt SGLang accepts with this max_new_tokens: prompt and answer within the context
    (TokenizerManager's check), and the prompt shorter than the scheduler's input limit, the context
    minus 1 minus 5 reserved tokens (TpModelWorker, validate_input_length)."""
    return min(context_length - max_new_tokens - 1, context_length - 7)


# -- sending ---------------------------------------------------------------------------------


class Routed:
    """Where the requests go when --servers > 1: SGLang's router in front of the backends. The router
    does not forward /abort_request, so an abort goes to every backend; only the one running the
    request knows its id."""

    def __init__(self, router: LocalRouter, backends: list[LocalServer]):
        self.router, self.backends, self.url = router, backends, router.url

    def abort(self, rid: str) -> None:
        for backend in self.backends:
            backend.abort(rid)

    def post(self, path: str, body: dict, timeout: float = 120):
        return self.router.post(path, body, timeout)


def send(server: LocalServer | Routed, spec: Spec) -> dict:
    """Sends one request; returns {"status": HTTP status, "answer": JSON answer or None,
    "chunks": streamed chunk count, "error": text} (what happened, checked later)."""
    raw = spec.body if isinstance(spec.body, bytes) else json.dumps(dict(spec.body, stream=spec.stream)).encode()
    request = urllib.request.Request(server.url + "/generate", data=raw, headers={"Content-Type": "application/json"})
    timer = None
    if spec.abort_after_s:
        timer = threading.Timer(spec.abort_after_s, lambda: server.abort(spec.id))
        timer.start()
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as r:
            if not spec.stream:
                return {"status": r.status, "answer": json.loads(r.read())}
            return read_stream(r, spec)
    except urllib.error.HTTPError as e:
        return {"status": e.code, "answer": None, "error": e.read().decode(errors="replace")[:500]}
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        return {"status": None, "answer": None, "error": f"{type(e).__name__}: {e}"}
    finally:
        if timer is not None:
            timer.join()


def read_stream(response, spec: Spec) -> dict:
    """Server-sent events up to `data: [DONE]` (or the disconnect this spec asks for): the last chunk
    of each output index (SGLang's stream repeats the whole output so far)."""
    finals, chunks, problems, seen = {}, 0, [], {}
    for chunk in sse_chunks(response):
        chunks += 1
        if "error" in chunk:
            return {"status": response.status, "answer": None, "chunks": chunks, "error": str(chunk["error"])}
        index = chunk.get("index", 0)
        tokens = chunk["meta_info"]["completion_tokens"]
        if tokens < seen.get(index, 0):
            problems.append(f"streamed token count went back from {seen[index]} to {tokens}")
        seen[index] = tokens
        finals[index] = chunk
        if spec.chunks_before_disconnect and chunks >= spec.chunks_before_disconnect:
            response.close()  # the client goes away mid-stream
            return {"status": response.status, "answer": None, "chunks": chunks, "disconnected": True}
    answer = [finals[i] for i in sorted(finals)] if len(finals) > 1 else next(iter(finals.values()), None)
    return {"status": response.status, "answer": answer, "chunks": chunks, "stream_problems": problems}


# -- checking one answer ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rules:
    """What an answer is checked against: the model's EOS ids, the server's context length, and the
    tokenizer's decode keeping special tokens (SGLang matches stop strings on that text, while the
    text it returns skips them: a stop string that spans a skipped special token ends nothing)."""

    eos_ids: set[int]
    context_length: int
    decode_with_special_tokens: Callable[[list[int]], str]

    @classmethod
    def of(cls, tokenizer, context_length: int) -> Rules:
        return cls({tokenizer.eos_token_id}, context_length,
                   lambda ids: tokenizer.decode(ids, skip_special_tokens=False))


def check(spec: Spec, result: dict, rules: Rules) -> list[str]:
    """What is wrong with `result` as the answer to `spec` (empty: nothing), by SGLang's rules."""
    if spec.kind.startswith("malformed/"):
        ok = result["status"] is not None and 400 <= result["status"] < 500
        return [] if ok else [f"malformed request answered {result['status']} (want 4xx): {result.get('error')}"]
    if spec.kind == "disconnect":
        return [] if result.get("disconnected") else [f"stream ended before the client left: {result}"]
    if result["status"] != 200 or result["answer"] is None:
        return [f"no answer: status {result['status']}, {result.get('error')}"]
    params = spec.body["sampling_params"]
    answers = result["answer"] if isinstance(result["answer"], list) else [result["answer"]]
    problems = list(result.get("stream_problems", []))
    if len(answers) != params.get("n", 1):
        problems.append(f"{len(answers)} answers for n={params.get('n', 1)}")
    for answer in answers:
        problems += check_answer(spec, answer, params, rules)
    return problems


def token_budget(max_new_tokens: int, prompt_tokens: int, context_length: int) -> int:
    """The new tokens SGLang allows a request: its max_new_tokens, capped so that prompt and answer
    stay below the context length minus one (Scheduler.init_req_max_new_tokens)."""
    return max(0, min(max_new_tokens, context_length - 2 - prompt_tokens))


def check_answer(spec: Spec, answer: dict, params: dict, rules: Rules) -> list[str]:
    meta, ids = answer.get("meta_info") or {}, answer.get("output_ids")
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type")
    if spec.kind == "abort":
        # Aborted while queued, the answer is just the abort; finished before the abort came, a
        # normal one (ending on a stop string at most: aborted requests ignore EOS).
        return [] if kind in ("abort", "length", "stop") else [f"aborted request finished {finish}"]
    missing = [k for k in ("completion_tokens", "prompt_tokens") if k not in meta]
    if ids is None:
        missing.append("output_ids")
    if missing:
        return [f"answer without {', '.join(missing)}: {json.dumps(answer)[:300]}"]
    problems = []
    if meta["completion_tokens"] != len(ids):
        problems.append(f"completion_tokens {meta['completion_tokens']} but {len(ids)} output ids")
    budget = token_budget(params["max_new_tokens"], meta["prompt_tokens"], rules.context_length)
    if len(ids) > budget:
        problems.append(f"{len(ids)} tokens for a budget of {budget}")
    if kind == "length" and len(ids) != budget:
        problems.append(f"finish length after {len(ids)} of {budget} tokens")
    if kind not in ("length", "stop"):
        problems.append(f"finish reason {finish}")
    # ignore_eos turns off stop token ids too (Req._check_token_based_finish).
    stop_ids = set() if params.get("ignore_eos") else set(params.get("stop_token_ids", ())) | rules.eos_ids
    if any(t in stop_ids for t in ids[:-1]):
        problems.append("tokens after a stop token")
    # A stop string ends the answer at the token that completes it: none before that token holds it.
    before_last = rules.decode_with_special_tokens(ids[:-1])
    for s in params.get("stop", ()):
        if s in before_last:
            problems.append(f"stop string {s!r} inside the answer, before its last token")
    if kind == "stop" and isinstance(finish.get("matched"), str) and finish["matched"] in answer["text"]:
        problems.append(f"stop string {finish['matched']!r} left in the text")
    if spec.body.get("return_logprob"):
        logprobs = meta.get("output_token_logprobs") or []
        if len(logprobs) != len(ids) or any(not (lp <= 0.0 and math.isfinite(lp)) for lp, *_ in logprobs):
            problems.append(f"{len(logprobs)} output logprobs for {len(ids)} tokens, or one not a log-probability")
    if "json_schema" in params and kind == "stop":
        try:
            value = json.loads(answer["text"])
            if not isinstance(value, dict) or not {"name", "age"} <= value.keys():
                problems.append(f"JSON answer lacks the required keys: {answer['text']!r}")
        except json.JSONDecodeError:
            problems.append(f"constrained answer is not JSON: {answer['text']!r}")
    if "regex" in params and kind == "stop" and not re.fullmatch(REGEX, answer["text"]):
        problems.append(f"constrained answer does not match {REGEX}: {answer['text']!r}")
    return problems


# -- the run ---------------------------------------------------------------------------------


def run_requests(server: LocalServer | Routed, specs: list[Spec], clients: int, burst_size: int, deadline: float,
                 on_rss) -> list[dict | None]:
    """Sends `specs` with `clients` in flight; every 250 requests a burst of `burst_size` of them
    goes out at once on top, then `on_rss(requests done)`. Requests not started by `deadline` give
    None."""
    results: list[dict | None] = [None] * len(specs)

    def one(i: int) -> None:
        if time.time() < deadline:
            results[i] = send(server, specs[i])
        bar.update()

    with tqdm(total=len(specs), desc="soak", unit="req") as bar, \
            concurrent.futures.ThreadPoolExecutor(clients) as pool, \
            concurrent.futures.ThreadPoolExecutor(burst_size) as burst:
        for start in range(0, len(specs), 250):
            chunk = range(start, min(start + 250, len(specs)))
            bursting = list(chunk)[-burst_size:]
            waiting = [burst.submit(one, i) for i in bursting] + [pool.submit(one, i) for i in chunk
                                                                     if i not in bursting]
            concurrent.futures.wait(waiting)
            on_rss(chunk.stop)
    return results


SAMPLE_EVERY = 250  # requests between two samples of the server's resident memory
STEADY_FROM = 1000  # requests after which caches and allocator pools count as warm


def process_memory(pids: list[int], proc: Path = Path("/proc")) -> dict[str, int]:
    """Resident bytes (VmRSS) of each process in `pids`, by its title: SGLang names its children
    (`sglang::scheduler`, `sglang::detokenizer`); the HTTP server keeps its command line, named
    "http_server" here. A second process of the same title (data-parallel ranks) gets " #2" and so on.
    Processes that are gone by the time they are read are left out."""
    out: dict[str, int] = {}
    for pid in pids:
        try:
            argv0 = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
            status = (proc / str(pid) / "status").read_text()
        except OSError:
            continue
        rss = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), None)
        if rss is None:  # a zombie has no VmRSS
            continue
        title = argv0 if argv0.startswith("sglang::") else "http_server"
        name, copy = title, 1
        while name in out:
            copy += 1
            name = f"{title} #{copy}"
        out[name] = rss
    return out


def memory_growth(samples: list[dict]) -> dict[str, dict]:
    """Per process, from `samples` ({"requests": requests done, "mb": {process: MB}}, in order):
    its growth from the first sample at or after STEADY_FROM requests to the last sample, and its
    growth per SAMPLE_EVERY requests over the run's second half: the least-squares slope through
    every sample from half the last sample's requests on. A slope, not the difference of two
    samples: a server's resident size swings by tens of MB from sample to sample (the allocator
    returns memory and takes it again), so two samples say more about where those swings fell
    than about a trend. None where the run has no such samples."""
    if not samples:
        return {}
    last = samples[-1]
    steady = next((s for s in samples if s["requests"] >= STEADY_FROM), None)
    out = {}
    for name, end_mb in last["mb"].items():
        grown = None
        if steady is not None and steady is not last and name in steady["mb"]:
            grown = round(end_mb - steady["mb"][name], 1)
        points = [(s["requests"], s["mb"][name]) for s in samples
                  if s["requests"] >= last["requests"] / 2 and name in s["mb"]]
        per_250 = None
        if len({x for x, _ in points}) >= 2:
            mean_x = sum(x for x, _ in points) / len(points)
            mean_y = sum(y for _, y in points) / len(points)
            slope = (sum((x - mean_x) * (y - mean_y) for x, y in points)
                     / sum((x - mean_x) ** 2 for x, _ in points))
            per_250 = round(slope * SAMPLE_EVERY, 2)
        out[name] = {"growth_after_steady_mb": grown, f"mb_per_{SAMPLE_EVERY}_second_half": per_250}
    return out


def leak_lines(log_text: str) -> list[str]:
    return [line.strip() for line in log_text.splitlines() if any(m in line for m in LEAK_MARKERS)]


def idle_state(server: LocalServer) -> dict:
    """After the run: no request left, the KV slots all free (before and after dropping the radix
    cache), SGLang's idle leak check silent."""
    load = server.wait_idle(timeout=120)
    time.sleep(3)  # a few idle scheduler loops: SGLang runs its leak check there
    flushed = server.post("/flush_cache", {})
    after = server.load()
    return {"num_used_tokens": load["num_used_tokens"], "num_used_tokens_after_flush": after["num_used_tokens"],
            "max_total_num_tokens": after["max_total_num_tokens"], "flush_cache": str(flushed).strip()[:80],
            "leak_log_lines": leak_lines(server.text())}


def reference_server(reference: str, target: Path, draft: Path, extra: list[str], tmp: Path) -> LocalServer:
    """The server a parity replay asks: plain with the plugin active (PLUGIN_REFERENCE), stock plain
    SGLang (REFERENCE) or one DFLASH server alone (SINGLE_REFERENCE)."""
    env = server_env(tmp, SGLANG_DFLASH_DISABLE="1") if reference == REFERENCE else server_env(tmp)
    args = launch_args(target, free_port(), draft=draft if reference == SINGLE_REFERENCE else None, extra=extra)
    return LocalServer(reference, args, env, tmp / f"{reference}.log")


def greedy_parity(args, target: Path, draft: Path, specs: list[Spec], results: list, tmp: Path, extra: list[str],
                  tokenizer, reference: str) -> dict:
    """The greedy requests that the soak answered (at most --parity-requests of them, spread over the
    run), sent again (not streamed) to the `reference` server (reference_server); differing answers
    get the fp32 logit margin at their first differing token."""
    answered = [(s, r) for s, r in zip(specs, results, strict=True)
                if s.greedy and r is not None and r["status"] == 200 and isinstance(r["answer"], dict)
                and "output_ids" in r["answer"]]
    todo = spread(answered, args.parity_requests)
    server = reference_server(reference, target, draft, extra, tmp)
    try:
        server.wait_ready(time.time() + STARTUP_TIMEOUT)
        with tqdm(total=len(todo), desc=f"{reference} server, greedy", unit="req") as bar:
            def replay(item):
                spec, _ = item
                body = {k: v for k, v in spec.body.items() if k != "rid"}
                try:
                    return server.post("/generate", body, timeout=REQUEST_TIMEOUT)
                finally:
                    bar.update()

            with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
                answers = list(pool.map(replay, todo))
    finally:
        server.stop()
    divergences = []
    for (spec, result), theirs in zip(todo, answers, strict=True):
        ours = result["answer"]["output_ids"]
        pos = first_divergence(theirs["output_ids"], ours)
        if pos is not None:
            divergences.append({"request": spec.id, "position": pos, "plain": theirs["output_ids"][pos:pos + 1],
                                "dflash": ours[pos:pos + 1], "prefix": theirs["output_ids"][:pos], "spec": spec})
    add_fp32_margins(divergences, target, tokenizer)
    near = [d for d in divergences if d.get("margin") is not None and abs(d["margin"]) <= args.near_tie]
    return {"greedy_answered": len(answered), "compared": len(todo), "equal": len(todo) - len(divergences),
            "near_ties": len(near),
            "divergences": [{k: v for k, v in d.items() if k not in ("spec", "prefix")} for d in divergences]}


def spread(items: list, count: int | None) -> list:
    """At most `count` of `items` (all when count is None), evenly spaced over the whole list, so a
    capped replay still covers the run's start, middle and end."""
    if count is None or count >= len(items):
        return items
    return [items[i * len(items) // count] for i in range(count)]


def add_fp32_margins(divergences: list[dict], target: Path, tokenizer) -> None:
    todo = [d for d in divergences if d["plain"] and d["dflash"]]
    if not todo:
        return
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for d in tqdm(todo, desc="fp32 margins", unit="divergence"):
        body = d["spec"].body
        prompt = body.get("input_ids") or tokenizer(body["text"])["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + d["prefix"]])).logits[0, -1]
        d.update(logit_margin(logits, d["plain"][0], d["dflash"][0]))


def summarize(specs: list[Spec], results: list, rules: Rules) -> dict:
    by_kind, problems, lost = {}, [], 0
    for spec, result in zip(specs, results, strict=True):
        kind = spec.kind.split("/")[0]
        counts = by_kind.setdefault(kind, {"sent": 0, "ok": 0, "not_sent": 0})
        if result is None:
            counts["not_sent"] += 1
            continue
        counts["sent"] += 1
        try:
            found = check(spec, result, rules)
        except Exception as e:  # noqa: BLE001 -- an answer the checker cannot read is a finding, not a crash
            found = [f"unreadable answer ({type(e).__name__}: {e}): {json.dumps(result)[:300]}"]
        if found:
            problems.append({"request": spec.id, "kind": spec.kind, "problems": found})
            lost += spec.kind in ("generate", "abort") and result.get("answer") is None
        else:
            counts["ok"] += 1
    return {"by_kind": by_kind, "sent": sum(c["sent"] for c in by_kind.values()), "lost": lost,
            "requests_with_problems": len(problems), "problems": problems[:100]}


def step_mix(results: list) -> dict:
    """Which kind of decode step committed the answers' tokens, from the per-token meta_info the
    DFLASH worker reports (adaptive.py's block sizes, trees.py's tree nodes): so the report says
    what the soak exercised (the CPU server's default mixes plain steps, chains and trees). Tokens
    from a prefill (block size 0) and answers without the lists are left out."""
    tokens = {"plain": 0, "chain": 0, "tree": 0}
    tree_sizes: dict[int, int] = {}
    for result in results:
        answer = (result or {}).get("answer")
        for one in answer if isinstance(answer, list) else [answer] if answer else []:
            meta = one.get("meta_info") or {}
            sizes = meta.get("dflash_block_size") or []
            nodes = meta.get("dflash_tree_nodes") or [0] * len(sizes)
            for b, n in zip(sizes, nodes, strict=False):
                if n:
                    tokens["tree"] += 1
                    tree_sizes[n] = tree_sizes.get(n, 0) + 1
                elif b:
                    tokens["plain" if b == 1 else "chain"] += 1
    return {"tokens_by_step": tokens, "tree_tokens_by_nodes": dict(sorted(tree_sizes.items()))}


def verdicts(summary: dict, idle: dict, rss: dict, alive_after: bool, shutdown: dict, parity: dict | None,
             args) -> dict[str, bool]:
    checks = {
        f"at least {args.requests} requests sent": summary["sent"] >= args.requests,
        "0 lost, every answer well-formed, every malformed request refused": summary["requests_with_problems"] == 0,
        "server answered after the run": alive_after,
        "0 KV slots held when idle": idle["num_used_tokens"] == 0 and idle["num_used_tokens_after_flush"] == 0,
        "SGLang's idle leak check silent": not idle["leak_log_lines"],
        f"resident memory grew <= {args.max_rss_growth_mb} MB": rss["growth_mb"] <= args.max_rss_growth_mb,
        **growth_checks(rss["growth_by_process"], args),
        "SIGTERM: every process ended, no client hung": not shutdown["processes_left_after_exit"]
        and shutdown["clients_hung"] == 0,
    }
    if "served_by_backend" in summary:
        checks["every server behind the router served requests"] = all(n > 0 for n in summary["served_by_backend"])
    labels = {PLUGIN_REFERENCE: "greedy equals the plain server with the plugin, exactly",
              SINGLE_REFERENCE: "greedy through the router equals one DFLASH server alone, exactly"}
    for reference, label in labels.items():
        if parity is not None and reference in parity:
            checks[label] = parity[reference]["equal"] == parity[reference]["compared"]
    return checks


def growth_checks(growth: dict[str, dict], args) -> dict[str, bool]:
    """The per-process memory checks the run is long enough for (see memory_growth)."""
    checks = {}
    steady = [g["growth_after_steady_mb"] for g in growth.values()]
    if steady and None not in steady:
        checks[f"each process grew <= {args.max_process_growth_mb} MB after request {STEADY_FROM}"] = \
            max(steady) <= args.max_process_growth_mb
    slopes = [g[f"mb_per_{SAMPLE_EVERY}_second_half"] for g in growth.values()]
    if slopes and None not in slopes:
        checks[f"each process grew <= {args.max_growth_per_250_mb} MB per {SAMPLE_EVERY} requests over the "
               "second half"] = max(slopes) <= args.max_growth_per_250_mb
    return checks


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, help=f"HF model directory (default: the packaged {DEFAULT_TARGET})")
    parser.add_argument("--draft", default=SHIPPED_DRAFTER, help="DFlash checkpoint directory or shipped drafter name")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--servers", type=int, default=1,
                        help="DFLASH servers; above 1 they sit behind SGLang's router (sglang-router), which takes "
                             "every request, and the greedy answers are compared with one DFLASH server alone's")
    parser.add_argument("--clients", type=int, default=12, help="concurrent clients")
    parser.add_argument("--max-running-requests", type=int, default=8, help="the server's; below --clients")
    parser.add_argument("--burst-size", type=int, default=24, help="requests sent at once every 250")
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0, help="of the request mix")
    parser.add_argument("--near-tie", type=float, default=0.05,
                        help="largest |fp32 logit margin| at which a greedy difference passes as a near-tie")
    parser.add_argument("--max-rss-growth-mb", type=float, default=512)
    parser.add_argument("--max-process-growth-mb", type=float, default=32,
                        help=f"largest growth of any server process from request {STEADY_FROM} to the end")
    parser.add_argument("--max-growth-per-250-mb", type=float, default=2,
                        help=f"largest mean growth of any server process per {SAMPLE_EVERY} requests, second half")
    parser.add_argument("--no-parity", action="store_true", help="skip the plain servers' greedy replays")
    parser.add_argument("--parity-requests", type=int,
                        help="replay at most this many greedy answers (evenly spread over the run) on each plain "
                             "server; default: all of them")
    parser.add_argument("--time-limit", type=float, help="seconds of sending, then it stops; default: no limit")
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def merged(states: list[dict], names: list[str]) -> dict:
    """One idle or shutdown record for several servers: counts summed (seconds to exit: the longest),
    lists joined, each server's own record kept whole under "per_server"; a single server's record
    as it is."""
    if len(states) == 1:
        return states[0]
    out = {"per_server": dict(zip(names, states, strict=True))}
    for key, value in states[0].items():
        if key == "exit_code" or isinstance(value, bool) or not isinstance(value, (int, float, list)):
            continue
        values = [state[key] for state in states]
        out[key] = ([x for v in values for x in v] if isinstance(value, list)
                    else max(values) if key == "seconds_to_exit" else sum(values))
    return out


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    target = args.target or packaged_model_dir(DEFAULT_TARGET)
    draft = resolve_draft(args.draft)
    info = run_info({"target": target, "draft": draft})
    tokenizer = AutoTokenizer.from_pretrained(target)
    specs = build_requests(args.requests, args.seed, tokenizer, args.context_length)
    tmp = Path(tempfile.mkdtemp(prefix="soak_serving_"))
    extra = ["--context-length", str(args.context_length), "--max-running-requests", str(args.max_running_requests),
             "--max-total-tokens", "16384", "--random-seed", "0"]
    print(f"{len(specs)} requests, {args.clients} clients, {args.servers} server(s); server logs in {tmp}")

    names = ["dflash"] if args.servers == 1 else [f"dflash-{i}" for i in range(args.servers)]
    # Servers sharing this machine each get their own cores (when there are enough).
    cores = (core_groups(args.servers) if args.servers > 1 else None) or [None] * args.servers
    backends = [LocalServer(name, launch_args(target, free_port(), draft=draft, extra=extra), server_env(tmp),
                            tmp / f"{name}.log", cores=group) for name, group in zip(names, cores, strict=True)]
    router = None
    rss_samples, by_process = [], []

    def sample(requests_done: int) -> None:
        mb = {}
        for server in backends + ([router] if router else []):
            for title, b in process_memory(server.pids()).items():
                name = "router" if server is router else title if args.servers == 1 else f"{server.name} {title}"
                mb[name] = round(b / 2**20, 1)
        by_process.append({"requests": requests_done, "mb": mb})
        rss_samples.append(sum(mb.values()) * 2**20)

    try:
        with all_ready(*backends, startup_timeout=STARTUP_TIMEOUT):
            front = backends[0]
            if args.servers > 1:
                router = LocalRouter("router", backends, free_port(), tmp / "router.log")
                front = Routed(router, backends)
            served_before = [b.generate_requests_answered() for b in backends]
            with all_ready(*([router] if router else []), startup_timeout=120):
                sample(0)
                deadline = math.inf if args.time_limit is None else time.time() + args.time_limit
                results = run_requests(front, specs, args.clients, args.burst_size, deadline, sample)
                for backend in backends:
                    if backend.proc.poll() is not None:
                        raise SystemExit(f"{backend.name} died during the soak:\n{backend.text()[-4000:]}")
                idle = merged([idle_state(b) for b in backends], names)
                alive_after = front.post("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4}})[
                    "meta_info"]["completion_tokens"] == 4
                served = [b.generate_requests_answered() - n for b, n in zip(backends, served_before, strict=True)]
                sample(len(specs) + 1)  # idle, after the leak check and one more request
                shutdown = merged([sigterm_in_flight(b, chat_texts(tokenizer, 6)) for b in backends], names)
    finally:
        for server in backends + ([router] if router else []):
            server.stop()
    rss = {"start_mb": rss_samples[0] / 2**20, "end_mb": rss_samples[-1] / 2**20,
           "samples_mb": [round(b / 2**20, 1) for b in rss_samples],
           "growth_mb": (rss_samples[-1] - rss_samples[1 if len(rss_samples) > 2 else 0]) / 2**20,
           "samples_by_process": by_process, "growth_by_process": memory_growth(by_process)}
    with open(tmp / "answers.jsonl", "w") as f:  # every request and what came back, to look into a problem
        for spec, result in zip(specs, results, strict=True):
            body = spec.body.decode(errors="replace") if isinstance(spec.body, bytes) else spec.body
            f.write(json.dumps({"id": spec.id, "kind": spec.kind, "stream": spec.stream, "body": body,
                                "result": result}) + "\n")
    summary = summarize(specs, results, Rules.of(tokenizer, args.context_length))
    summary["step_mix"] = step_mix(results)
    if args.servers > 1:
        summary["served_by_backend"] = served
    # Behind the router the question is whether routing changes answers: one DFLASH server alone is
    # the reference (the single-server soak compares that with the plain servers).
    references = (PLUGIN_REFERENCE, REFERENCE) if args.servers == 1 else (SINGLE_REFERENCE,)
    parity = None if args.no_parity else {
        reference: greedy_parity(args, target, draft, specs, results, tmp, extra, tokenizer, reference)
        for reference in references}
    checks = verdicts(summary, idle, rss, alive_after, shutdown, parity, args)

    suffix = "" if args.servers == 1 else f"_router{args.servers}"
    stem = f"soak_{args.target.name if args.target else DEFAULT_TARGET}{suffix}"
    out = args.out or ROOT / "bench" / "results" / f"{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    setup = {"target": str(target), "draft": str(draft), "server_args": extra, "servers": args.servers,
             "cores_per_server": cores,
             "router": "sglang_router.launch_router --policy cache_aware" if router else None,
             "requests": args.requests, "clients": args.clients, "burst_size": args.burst_size, "seed": args.seed,
             "time_limit_s": args.time_limit, "parity_requests": args.parity_requests, "log_dir": str(tmp),
             "rss_growth_note": "growth from the first sample after 250 requests to the end (the first "
                                "requests fill allocator pools and caches)"}
    out.write_text(json.dumps({"provenance": info, "setup": setup, "checks": checks, "summary": summary,
                               "idle": idle, "resident_memory": rss, "shutdown": shutdown,
                               "greedy_parity": parity}, indent=1))
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    print(json.dumps({"by_kind": summary["by_kind"], "served_by_backend": summary.get("served_by_backend"),
                      "step_mix": summary["step_mix"], "idle": {k: v for k, v in idle.items() if k != "per_server"},
                      "rss_growth_mb": round(rss["growth_mb"], 1), "growth_by_process": rss["growth_by_process"],
                      "shutdown": {k: shutdown[k] for k in ("clients_hung", "processes_left_after_exit",
                                                            "seconds_to_exit")},
                      "parity": parity and {ref: {k: p[k] for k in ("compared", "equal", "near_ties")}
                                            for ref, p in parity.items()}}, indent=1))
    print(f"wrote {out}")
    raise SystemExit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
