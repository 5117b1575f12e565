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
from tests.test_sglang_cpu_server import DUMMY_DFLASH_ARGS, PROMPTS, STARTUP_TIMEOUT, _generate, make_models

pytestmark = pytest.mark.slow

REQUESTS, CLIENTS, NEW_TOKENS = 48, 16, 12
# SGLang's scheduler log lines carry the replica: "[<time> DP1] Prefill batch. ..."
PREFILL_LINE = re.compile(r" DP(\d+)\] Prefill batch")


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    cores = core_groups(2)
    if cores is None:
        pytest.skip("two replicas need two cores")
    tmp = tmp_path_factory.mktemp("dp")
    target, draft = make_models(tmp / "models")
    single = LocalServer("dflash", launch_args(target, free_port(), draft=draft, extra=DUMMY_DFLASH_ARGS),
                         server_env(tmp, OMP_NUM_THREADS="1"), tmp / "dflash.log")
    with all_ready(single, startup_timeout=STARTUP_TIMEOUT):
        alone = [_generate(single, p, max_new_tokens=NEW_TOKENS)["output_ids"] for p in PROMPTS]
    bind = "|".join(",".join(map(str, group)) for group in cores)
    dp_args = launch_args(target, free_port(), draft=draft, extra=[*DUMMY_DFLASH_ARGS, "--dp-size", "2"])
    dp = LocalServer("dflash-dp2", dp_args,
                     server_env(tmp, OMP_NUM_THREADS="1", SGLANG_CPU_OMP_THREADS_BIND=bind),
                     tmp / "dflash-dp2.log")
    with all_ready(dp, startup_timeout=STARTUP_TIMEOUT):
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            answers = list(pool.map(lambda i: _generate(dp, PROMPTS[i % len(PROMPTS)], max_new_tokens=NEW_TOKENS),
                                    range(REQUESTS)))
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
