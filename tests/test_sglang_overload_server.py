"""Overload and restart of a DFLASH CPU server (loopback only): requests beyond
--max-running-requests and --max-total-tokens queue and finish with the answers they get alone; a
client flooding FLOOD requests at once gets, within a bound, answers or clean 503s (SGLang's "queue
full", past --max-queued-requests), never a hung server; a server killed with SIGKILL while
serving leaves no process behind, and a new one on the same port serves again.

Tiny dummy-weight models (tests/test_sglang_cpu_server.py's), so each server starts in about a
minute. Needs SGLang (scripts/install_sglang_cpu.sh); marked slow: ~4-5 minutes on 2 cores.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import importlib.util
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install_sglang_cpu.sh VENV installs it beside the package)",
                allow_module_level=True)

from sglang_dflash.serving.local_server import (
    LocalServer,
    all_ready,
    free_port,
    launch_args,
    server_env,
    sse_chunks,
)
from tests.test_sglang_cpu_server import make_models

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT = 420
RUNNING, TOTAL_TOKENS, QUEUED = 2, 400, 24  # small limits, so that a few requests exceed them
FLOOD = 200
FLOOD_BOUND_S = 240  # every flooding client has its outcome by then
WORDS = "the quick brown fox jumps over the lazy dog one two three four five six seven".split()


def _args(target: Path, draft: Path, port: int) -> list[str]:
    return launch_args(target, port, draft=draft, extra=[
        "--load-format", "dummy", "--speculative-draft-load-format", "dummy", "--dtype", "float32",
        "--random-seed", "0", "--max-running-requests", str(RUNNING), "--max-total-tokens", str(TOTAL_TOKENS),
        "--max-queued-requests", str(QUEUED)])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overload")
    target, draft = make_models(tmp / "models")
    return tmp, target, draft, server_env(tmp, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


@contextlib.contextmanager
def _server(setup, name: str, port: int | None = None):
    tmp, target, draft, env = setup
    server = LocalServer(name, _args(target, draft, port or free_port()), env, tmp / f"{name}.log")
    with all_ready(server, startup_timeout=STARTUP_TIMEOUT):
        yield server


@pytest.fixture(scope="module")
def server(setup):
    with _server(setup, "overload") as s:
        yield s


def _prompt(i: int, words: int = 12) -> str:
    return " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(words))


def _generate(server: LocalServer, text: str, max_new_tokens: int, timeout: float = 300) -> dict:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    return server.post("/generate", {"text": text, "sampling_params": params}, timeout=timeout)


def test_requests_beyond_running_slots_and_kv_tokens_queue_and_finish(server):
    count, new_tokens = 10, 48  # 10 x (~12 prompt + 48 new) tokens: past TOTAL_TOKENS, 5x RUNNING
    texts = [_prompt(i) for i in range(count)]
    alone = [_generate(server, t, new_tokens)["output_ids"] for t in texts[:2]]
    waiting = []
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(_generate, server, t, new_tokens) for t in texts]
        while not all(f.done() for f in futures):
            load = server.load()
            waiting.append(load["num_waiting_reqs"])
            assert load["num_running_reqs"] <= RUNNING
            time.sleep(0.2)
        answers = [f.result() for f in futures]
    assert max(waiting) > 0  # the scheduler did queue
    assert all(a["meta_info"]["completion_tokens"] == new_tokens for a in answers)
    assert [a["output_ids"] for a in answers[:2]] == alone  # queued, retracted or not: the same answers
    assert server.wait_idle(timeout=60)["num_used_tokens"] == 0


def _flood_one(server: LocalServer, i: int) -> str:
    body = {"text": _prompt(i, 4), "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}}
    request = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=FLOOD_BOUND_S) as r:
            answer = json.loads(r.read())
        return "answered" if answer["meta_info"]["completion_tokens"] == 4 else f"short answer: {answer}"
    except urllib.error.HTTPError as e:
        return "503" if e.code == 503 else f"HTTP {e.code}: {e.read()[:200]!r}"
    except (OSError, http.client.HTTPException) as e:
        return f"{type(e).__name__}: {e}"


def test_a_flood_of_requests_gets_answers_or_clean_503s_within_a_bound(server):
    start = time.time()
    with concurrent.futures.ThreadPoolExecutor(FLOOD) as pool:
        outcomes = list(pool.map(lambda i: _flood_one(server, i), range(FLOOD)))
    elapsed = time.time() - start
    other = [o for o in outcomes if o not in ("answered", "503")]
    assert not other, other[:5]
    assert outcomes.count("answered") >= RUNNING + QUEUED  # what the slots and the queue hold was served
    assert outcomes.count("503") > 0  # past --max-queued-requests: refused, not hung
    assert elapsed < FLOOD_BOUND_S
    assert _generate(server, _prompt(0), 8, timeout=60)["meta_info"]["completion_tokens"] == 8
    assert server.wait_idle(timeout=60)["num_used_tokens"] == 0


def _stream_until_first_chunk(server: LocalServer, text: str, ready: concurrent.futures.Future) -> None:
    body = {"text": text, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 400,
                                                              "ignore_eos": True}}
    request = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            for _ in sse_chunks(r):
                if not ready.done():
                    ready.set_result(True)
    except (OSError, http.client.HTTPException):  # the server is killed under it
        pass
    finally:
        if not ready.done():
            ready.set_result(False)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigkill_mid_load_leaves_no_process_and_a_new_server_serves_on_the_same_port(setup):
    tmp, target, draft, env = setup
    victim = LocalServer("victim", _args(target, draft, free_port()), env, tmp / "victim.log")
    try:
        victim.wait_ready(time.time() + STARTUP_TIMEOUT)
        streaming = [concurrent.futures.Future() for _ in range(3)]
        with concurrent.futures.ThreadPoolExecutor(len(streaming)) as pool:
            for i, ready in enumerate(streaming):
                pool.submit(_stream_until_first_chunk, victim, _prompt(i), ready)
            assert all(f.result(timeout=120) for f in streaming)  # requests are streaming
            pids = victim.pids()
            assert len(pids) >= 3  # the HTTP server, its scheduler and its detokenizer
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(timeout=30)
            deadline = time.time() + 30
            while time.time() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.5)
            left = [p for p in pids if _alive(p)]
        for p in left:  # reported below; not left running on the machine
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        assert not left, f"processes left after SIGKILL of the server: {left}"
    finally:
        victim.stop()
    with _server(setup, "restarted", port=victim.port) as again:
        assert _generate(again, _prompt(1), 8, timeout=60)["meta_info"]["completion_tokens"] == 8
