"""Scale-out through SGLang's own router: two DFLASH CPU servers behind `sglang_router.launch_router`
(loopback only). Every request of a concurrent load is answered, both servers serve, and each greedy
answer equals the one a single server gives alone.

Tiny dummy-weight models (tests/test_sglang_cpu_server.py's; both servers load the same dummy
weights). Needs SGLang and sglang-router (scripts/install_sglang_cpu.sh installs both); marked
slow: about a minute on 2 cores.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import urllib.error

import pytest

if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("sglang_router") is None:
    pytest.skip("SGLang or sglang-router is not installed (scripts/install_sglang_cpu.sh VENV installs both)",
                allow_module_level=True)

from sglang_dflash.serving.local_server import (
    LocalRouter,
    LocalServer,
    all_ready,
    free_port,
    launch_args,
    server_env,
)
from tests.test_sglang_cpu_server import DUMMY_DFLASH_ARGS, STARTUP_TIMEOUT, make_models

pytestmark = pytest.mark.slow

REQUESTS, CLIENTS, NEW_TOKENS = 160, 32, 12
WORDS = "the quick brown fox jumps over the lazy dog one two three four five six seven".split()
PROMPTS = [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(8 + i)) for i in range(8)]


def _generate(server: LocalServer, text: str) -> dict:
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    return server.post("/generate", {"text": text, "sampling_params": params}, timeout=300)


def _through(router: LocalRouter, i: int) -> tuple[int, list[int] | str]:
    try:
        return i, _generate(router, PROMPTS[i % len(PROMPTS)])["output_ids"]
    except urllib.error.HTTPError as e:
        return i, f"HTTP {e.code}: {e.read()[:200]!r}"


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    target, draft = make_models(tmp / "models")
    env = server_env(tmp, OMP_NUM_THREADS="1")
    servers = [LocalServer(f"dflash-{i}", launch_args(target, free_port(), draft=draft, extra=DUMMY_DFLASH_ARGS),
                           env, tmp / f"dflash-{i}.log") for i in range(2)]
    with all_ready(*servers, startup_timeout=STARTUP_TIMEOUT):
        alone = [_generate(servers[0], p)["output_ids"] for p in PROMPTS]
        before = [s.generate_requests_answered() for s in servers]
        router = LocalRouter("router", servers, free_port(), tmp / "router.log")
        with all_ready(router, startup_timeout=120):
            with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
                answers = dict(pool.map(lambda i: _through(router, i), range(REQUESTS)))
            yield dict(alone=alone, answers=answers,
                       served=[s.generate_requests_answered() - b for s, b in zip(servers, before, strict=True)])


def test_every_request_through_the_router_is_answered(routed):
    failed = {i: a for i, a in routed["answers"].items() if isinstance(a, str)}
    assert not failed, list(failed.items())[:5]
    assert len(routed["answers"]) == REQUESTS


def test_both_servers_serve(routed):
    assert all(n > 0 for n in routed["served"]), routed["served"]
    assert sum(routed["served"]) >= REQUESTS


def test_greedy_answers_through_the_router_equal_a_single_servers(routed):
    for i, ids in routed["answers"].items():
        assert ids == routed["alone"][i % len(PROMPTS)], i
