"""SGLang's own NGRAM speculative decoding on CPU, beside our plugin: on a stock install (a CUDA
sgl-kernel, here its stand-in) NGRAM needs sgl-kernel CPU ops the plugin supplies
(serving/sgl_kernel_ops.py) and a TARGET_VERIFY tree attention that SGLang's torch_native backend
lacks (the plugin's, serving/attention.py). A real NGRAM server on the packaged SmolLM2 target
starts, speculates, and its greedy answers equal a plain server's token for token (both with the
plugin: batch-invariant decoding, so a verify row is bitwise the decode of its token). The servers
run one after the other. Needs SGLang (scripts/install_sglang_cpu.sh); ~5-7 minutes on 2 cores.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install_sglang_cpu.sh VENV installs it beside the package)",
                allow_module_level=True)

from sglang_dflash.engine.packaged import packaged_model_dir
from sglang_dflash.serving.local_server import LocalServer, all_ready, free_port, launch_args, server_env

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT = 600
MAX_NEW_TOKENS = 48
# Answers that repeat their prompt's words, so NGRAM's n-gram matches find drafts.
QUESTIONS = [
    "Repeat exactly: one two three four five six seven eight nine ten, one two three four five six seven eight.",
    "Complete this function:\n\ndef running_mean(xs):\n    \"\"\"Return the list of running means of xs.\"\"\"\n",
    "What is the capital of France? Answer with one word.",
]
NGRAM_ARGS = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"]


def _chat(target: Path) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in QUESTIONS]


def _serve(name: str, target: Path, tmp: Path, prompts: list[str], extra=(), **env: str) -> dict:
    server = LocalServer(name, launch_args(target, free_port(), extra=["--max-total-tokens", "4096", *extra]),
                         server_env(tmp, OMP_NUM_THREADS="2", **env), tmp / f"{name}.log")
    with all_ready(server, startup_timeout=STARTUP_TIMEOUT):

        def generate(text):
            body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}}
            return server.post("/generate", body, timeout=300)

        alone = [generate(p) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(generate, prompts))
        return dict(alone=alone, together=together, log=server.text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ngram_servers")
    target = packaged_model_dir("smollm2-135m")
    prompts = _chat(target)
    return _serve("plain", target, tmp, prompts), _serve("ngram", target, tmp, prompts, NGRAM_ARGS)


def test_ngram_greedy_equals_plain_token_for_token(runs):
    plain, ngram = runs
    for ours, theirs in zip(ngram["alone"] + ngram["together"], plain["alone"] + plain["together"], strict=True):
        assert ours["output_ids"] == theirs["output_ids"]


def test_ngram_speculates_with_the_plugins_ops_and_attention(runs):
    ngram = runs[1]
    steps = sum(r["meta_info"]["spec_verify_ct"] for r in ngram["alone"])
    tokens = sum(r["meta_info"]["completion_tokens"] for r in ngram["alone"])
    assert 0 < steps < tokens  # some verify step accepted a draft token
    assert "ours serve them" in ngram["log"] and "reconstruct_indices_from_tree_mask" in ngram["log"]
    assert "Traceback" not in ngram["log"]
