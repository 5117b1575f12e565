"""Scale-out inside one server: `--dp-size 2` with DFLASH on the CPU. SGLang's data-parallel controller
starts one scheduler per replica, each loads the plugin and runs our worker. Every request of a
concurrent load is answered by speculative decoding, both replicas serve, and each greedy answer
equals the one a single-replica server gives.

On the CPU, SGLang wants one core group per replica in SGLANG_CPU_OMP_THREADS_BIND ("0|1") when there
are more replicas than NUMA nodes; it pins each replica's threads to its group only on CPUs with AMX
or on arm64 (elsewhere the replicas share every core). Tiny dummy-weight models
(tests/test_sglang_cpu_server.py's). Needs SGLang; marked slow: about a minute on 2 cores.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import re

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install_sglang_cpu.sh VENV)", allow_module_level=True)

from sglang_dflash.serving.local_server import (
    LocalServer,
    all_ready,
    core_groups,
    free_port,
    launch_args,
    server_env,
)
from tests.test_sglang_cpu_server import make_models

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT = 420
REQUESTS, CLIENTS, NEW_TOKENS = 48, 16, 12
WORDS = "the quick brown fox jumps over the lazy dog one two three four five six seven".split()
PROMPTS = [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(6 + 2 * i)) for i in range(6)]
# SGLang's scheduler log lines carry the replica: "[<time> DP1] Prefill batch. ..."
PREFILL_LINE = re.compile(r" DP(\d+)\] Prefill batch")


def _generate(server: LocalServer, text: str) -> dict:
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    return server.post("/generate", {"text": text, "sampling_params": params}, timeout=300)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    cores = core_groups(2)
    if cores is None:
        pytest.skip("two replicas need two cores")
    tmp = tmp_path_factory.mktemp("dp")
    target, draft = make_models(tmp / "models")
    args = ["--load-format", "dummy", "--speculative-draft-load-format", "dummy", "--dtype", "float32",
            "--random-seed", "0", "--max-total-tokens", "4096"]
    single = LocalServer("dflash", launch_args(target, free_port(), draft=draft, extra=args),
                         server_env(tmp, OMP_NUM_THREADS="1"), tmp / "dflash.log")
    with all_ready(single, startup_timeout=STARTUP_TIMEOUT):
        alone = [_generate(single, p)["output_ids"] for p in PROMPTS]
    bind = "|".join(",".join(map(str, group)) for group in cores)
    dp = LocalServer("dflash-dp2", launch_args(target, free_port(), draft=draft, extra=[*args, "--dp-size", "2"]),
                     server_env(tmp, OMP_NUM_THREADS="1", SGLANG_CPU_OMP_THREADS_BIND=bind),
                     tmp / "dflash-dp2.log")
    with all_ready(dp, startup_timeout=STARTUP_TIMEOUT):
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            answers = list(pool.map(lambda i: _generate(dp, PROMPTS[i % len(PROMPTS)]), range(REQUESTS)))
        yield dict(alone=alone, answers=answers, log=dp.text())


def test_every_request_is_answered_by_speculative_decoding(replicated):
    assert len(replicated["answers"]) == REQUESTS
    for answer in replicated["answers"]:
        assert answer["meta_info"]["completion_tokens"] == NEW_TOKENS
        assert answer["meta_info"].get("spec_verify_ct", 0) > 0, answer["meta_info"]


def test_both_replicas_serve(replicated):
    ranks = {int(m) for m in PREFILL_LINE.findall(replicated["log"])}
    assert ranks == {0, 1}, replicated["log"][-3000:]


def test_greedy_answers_equal_a_single_replicas(replicated):
    for i, answer in enumerate(replicated["answers"]):
        assert answer["output_ids"] == replicated["alone"][i % len(PROMPTS)], i
