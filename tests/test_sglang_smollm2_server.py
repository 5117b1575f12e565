"""Real weights through real SGLang servers on CPU: SmolLM2-135M-Instruct (the packaged GGUF,
converted) as the target and the shipped DFlash drafter, served by `python -m sglang.launch_server`
with SGLang's defaults (its auto dtype makes this fp32 checkpoint fp16).

With the plugin, CPU decoding is batch invariant (few-row linears through skinny_linear, decode
and verify attention through block_attention, which tiles keys by absolute position): a verify row
computes exactly what decoding that token alone computes. So greedy DFLASH output must equal the
plain server's token for token, one request at a time and concurrently, whatever block sizes the
adaptive controller picks (chains or, by default on CPU, draft trees of up to 7 nodes), and with
trees at every step (SGLANG_DFLASH_TREE_BUDGET: a tree node's verify row is bitwise the decode of
its path). The servers start together and then serve one at a time (an idle server sleeps).
Needs SGLang (scripts/install_sglang_cpu.sh); ~3 minutes.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install_sglang_cpu.sh VENV installs it beside the package)",
                allow_module_level=True)

from sglang_dflash.control.tree import default_tree_budget
from sglang_dflash.data import gsm8k_path
from sglang_dflash.drafters import SHIPPED_DRAFTER, resolve_draft
from sglang_dflash.engine.packaged import packaged_model_dir
from sglang_dflash.serving.local_server import (
    LocalServer,
    all_ready,
    free_port,
    launch_args,
    server_env,
    sigterm_in_flight,
    sse_chunks,
)

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT = 600
MAX_NEW_TOKENS = 64
TREE_NODES = 7  # at the default --speculative-num-draft-tokens 8, the most a block holds
# Questions SmolLM2 answers in a few tokens, so EOS comes inside a block and ends the request there.
SHORT_ANSWER_PROMPTS = ["What is the capital of France? Answer with one word.", "What is 2 + 2?", "Hi!"]
CODE_PROMPTS = [
    "Write a Python function `is_prime(n)` that returns True when n is a prime number.",
    "Complete this function:\n\ndef running_mean(xs):\n    \"\"\"Return the list of running means of xs.\"\"\"\n",
]


def _chat(target: Path, questions: list[str]) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in questions]


def _prompts(target: Path) -> list[str]:
    return _chat(target, [json.loads(line)["question"] for line in gsm8k_path("test").open()][:2] + CODE_PROMPTS)


def _generate(server: LocalServer, text: str, max_new_tokens=MAX_NEW_TOKENS, return_logprob=False,
              **sampling) -> dict:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, **sampling}
    return server.post("/generate", {"text": text, "sampling_params": params, "return_logprob": return_logprob},
                       timeout=300)


def _abort_while_running(server: LocalServer, text: str) -> dict:
    """A long streamed request, aborted through /abort_request once it has streamed a token; its
    last chunk."""
    rid = f"abort-me-{server.name}"
    body = {"rid": rid, "text": text, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}}
    request = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    final = None
    with urllib.request.urlopen(request, timeout=300) as r:
        for chunk in sse_chunks(r):
            if final is None:
                server.abort(rid)
            final = chunk
    return final


def _served(server: LocalServer, prompts: list[str], short: list[str]) -> dict:
    """Sends a started server the requests, then stops it with SIGTERM while requests run; returns
    what it answered, its KV usage once idle, how it shut down and its log."""
    alone = [_generate(server, p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: _generate(server, p, max_new_tokens=40), prompts))
    bad = []
    for sampling in ({"temperature": -1.0}, {"top_p": 2.0}):
        try:
            _generate(server, prompts[0], max_new_tokens=4, **sampling)
            bad.append(None)
        except urllib.error.HTTPError as exc:
            bad.append(exc.code)
    after_bad = _generate(server, prompts[0], max_new_tokens=8)
    # Where a block meets the end of a request: max_new_tokens inside a block, stop strings,
    # and the logprobs of the committed tokens.
    edges = [_generate(server, p, max_new_tokens=n, stop=stop, return_logprob=True)
             for p in prompts[:2] for n, stop in ((7, None), (13, None), (48, ["."]), (48, ["\n"]))]
    eos = [_generate(server, p, max_new_tokens=48) for p in short]
    aborted = _abort_while_running(server, prompts[0])
    idle = server.wait_idle(timeout=60)
    shutdown = sigterm_in_flight(server, prompts[:3], max_new_tokens=48)
    return dict(name=server.name, alone=alone, together=together, bad=bad, after_bad=after_bad, edges=edges,
                eos=eos, aborted=aborted, idle=idle, shutdown=shutdown, log=server.text())


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The four servers, started together (their start-ups overlap) and then used one at a time (an
    idle server sleeps: --sleep-on-idle). `env` is added to each one's environment."""
    tmp = tmp_path_factory.mktemp("smollm2_servers")
    target, draft = packaged_model_dir("smollm2-135m"), resolve_draft(SHIPPED_DRAFTER)

    def start(name: str, draft: Path | None, **env: str) -> LocalServer:
        return LocalServer(name, launch_args(target, free_port(), draft=draft, extra=["--max-total-tokens", "4096"]),
                           server_env(tmp, OMP_NUM_THREADS="2", **env), tmp / f"{name}.log")

    started = [start("plain", None), start("dflash", draft),
               # Every decode step a tree of TREE_NODES nodes where the batch allows one (grammar and
               # sampling masks do not; logprobs do, their rows moved into path order).
               start("dflash-trees", draft, SGLANG_DFLASH_ADAPTIVE="0", SGLANG_DFLASH_TREE_BUDGET=str(TREE_NODES)),
               # A fixed block size: the adaptive server may verify the last tokens in a plain step
               # (its choice follows step times, so a loaded machine moves it), and chains are to be
               # seen ending inside a block.
               start("dflash-pinned", draft, SGLANG_DFLASH_ADAPTIVE="0")]
    with all_ready(*started, startup_timeout=STARTUP_TIMEOUT):
        yield target, {s.name: s for s in started}


@pytest.fixture(scope="module")
def runs(servers):
    target, by_name = servers
    prompts, short = _prompts(target), _chat(target, SHORT_ANSWER_PROMPTS)
    return tuple(_served(by_name[name], prompts, short) for name in ("plain", "dflash", "dflash-trees"))


@pytest.fixture(scope="module")
def pinned_chain_eos(servers):
    """The short answers from the DFLASH server at a fixed block size."""
    target, by_name = servers
    return [_generate(by_name["dflash-pinned"], p, max_new_tokens=48) for p in _chat(target, SHORT_ANSWER_PROMPTS)]


def test_greedy_dflash_equals_plain_decoding_token_for_token(runs):
    plain = runs[0]
    for served in runs[1:]:
        for ours, theirs in zip(served["alone"] + served["together"], plain["alone"] + plain["together"],
                                strict=True):
            assert ours["output_ids"] == theirs["output_ids"]
            assert ours["meta_info"]["completion_tokens"] == theirs["meta_info"]["completion_tokens"]


def test_the_shipped_drafter_commits_more_than_one_token_per_step(runs):
    for served in runs[1:]:
        steps = sum(r["meta_info"]["spec_verify_ct"] for r in served["alone"])
        tokens = sum(r["meta_info"]["completion_tokens"] for r in served["alone"])
        assert tokens / steps >= 1.5, (served["name"], tokens, steps)


def test_each_tree_steps_nodes_are_in_meta_info_and_the_log(runs):
    trees = runs[2]
    for r in trees["alone"] + trees["together"]:
        nodes = r["meta_info"]["dflash_tree_nodes"]  # per output token: its step's tree (0: a chain)
        assert len(nodes) == r["meta_info"]["completion_tokens"]
        assert nodes[0] == 0 and set(nodes[1:]) == {TREE_NODES}  # the first token is the prefill's
    log = trees["log"]
    assert f"sglang-dflash: draft trees on: {TREE_NODES} nodes (top 4 per position;" in log
    assert f"sglang-dflash: draft trees, steps since the last report: tree of {TREE_NODES} x" in log
    assert "Traceback" not in log


def test_each_steps_block_size_is_in_meta_info_and_the_log(runs):
    dflash = runs[1]
    for r in dflash["alone"] + dflash["together"]:
        sizes = r["meta_info"]["dflash_block_size"]  # per output token: the block size of its step
        assert len(sizes) == r["meta_info"]["completion_tokens"]
        assert sizes[0] == 0 and all(1 <= b <= 8 for b in sizes[1:])  # the first token is the prefill's
    log = dflash["log"]
    assert "sglang-dflash: adaptive block size on: each decode step runs B in 1..8" in log
    # On CPU the adaptive server may verify trees of up to DEFAULT_TREE_BUDGET nodes cut to the 7
    # drafted rows of its block (a tree of n runs at block size n + 1), unless
    # SGLANG_DFLASH_TREE_BUDGET says otherwise.
    assert f"sglang-dflash: draft trees on: up to {default_tree_budget(8 - 1)} nodes (top 4 per position" in log
    assert "sglang-dflash: adaptive block size, steps since the last report: batch 1: B=" in log


def test_the_served_drafter_uses_our_kernels_and_its_draft_vocabulary(runs):
    plain, dflash = runs[:2]
    log = dflash["log"]
    assert "sglang-dflash: drafts take the 16384 ids of" in log
    assert "sglang-dflash: draft context K/V of 3 layers through materialize_context_kv" in log
    assert "sglang-dflash: 3 draft attention layers run block_attention in TARGET_VERIFY" in log
    # fused qkv, o, fused gate/up and down of 3 layers, and fc (draft_int8.py)
    assert "sglang-dflash: 13 draft linear layers and the draft LM head run int8 weights" in log
    assert re.search(r"sglang-dflash: [1-9]\d* draft RMSNorms and the q/k norm \+ RoPE of 3 draft attentions run "
                     r"rms_norm_rope", log)
    # The stand-in sgl_kernel, like the PyPI wheel, has no torch.ops.sgl_kernel CPU ops: ours serve.
    assert "this sgl-kernel lacks torch.ops.sgl_kernel.copy_all_layer_kv_cache_cpu" in log
    assert "DFlashKernelWorker" not in plain["log"]
    for text in (log, plain["log"]):
        assert "Traceback" not in text


def test_bad_sampling_parameters_get_an_error_response_and_the_server_keeps_serving(runs):
    for run in runs:
        assert all(code == 400 for code in run["bad"]), run["bad"]
        assert run["after_bad"]["meta_info"]["completion_tokens"] == 8


def test_block_edges_end_requests_as_plain_decoding_does(runs):
    """max_new_tokens reached inside a block, stop strings met inside one: the same tokens and text
    as the plain server, and the committed tokens' logprobs equal its (fp16 logits; both servers
    compute each token's logits the same way, so only the logprob arithmetic may differ)."""
    plain, *served = runs
    for ours in served:
        _assert_edges_as_plain(ours["edges"], plain["edges"])


def _assert_edges_as_plain(edges: list[dict], plain_edges: list[dict]) -> None:
    stopped = 0
    for ours, theirs in zip(edges, plain_edges, strict=True):
        assert ours["output_ids"] == theirs["output_ids"]
        assert ours["text"] == theirs["text"]
        assert ours["meta_info"]["finish_reason"] == theirs["meta_info"]["finish_reason"]
        stopped += ours["meta_info"]["finish_reason"]["type"] == "stop"
        ours_lp = [lp for lp, *_ in ours["meta_info"]["output_token_logprobs"]]
        theirs_lp = [lp for lp, *_ in theirs["meta_info"]["output_token_logprobs"]]
        assert len(ours_lp) == len(ours["output_ids"])
        assert ours_lp == pytest.approx(theirs_lp, abs=1e-3)
    assert [len(r["output_ids"]) for r in edges[:2]] == [7, 13]
    assert stopped >= 2  # the stop strings did end requests early


def test_eos_inside_a_block_ends_the_request_there(runs, pinned_chain_eos):
    """Short answers end with EOS inside a verified block: the answer stops at the EOS (the block's
    tokens after it are dropped), exactly as plain decoding stops. The adaptive server's answers
    must match too, wherever its last step was; the pinned chain's and the trees' last steps are
    a block of 8 and a tree."""
    plain, dflash, trees = runs
    eos_id = 2  # SmolLM2-Instruct's <|im_end|>
    for answers in (dflash["eos"], pinned_chain_eos, trees["eos"]):
        for ours, theirs in zip(answers, plain["eos"], strict=True):
            assert ours["output_ids"] == theirs["output_ids"]
            assert ours["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos_id}
            assert ours["output_ids"][-1] == eos_id and eos_id not in ours["output_ids"][:-1]
            assert len(ours["output_ids"]) < 48
    # A pinned server verifies a block of 8 every decode step (and reports no per-token sizes).
    assert all(ours["meta_info"]["spec_verify_ct"] >= 1 for ours in pinned_chain_eos)
    assert all(ours["meta_info"]["dflash_tree_nodes"][-1] >= TREE_NODES for ours in trees["eos"])


def test_an_aborted_request_ends_with_abort_and_frees_its_kv_slots(runs):
    for run in runs:
        meta = run["aborted"]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort", meta["finish_reason"]
        assert meta["completion_tokens"] < 200
        # Once idle, no request holds a KV slot (the draft K/V live in the same pool's slots).
        assert run["idle"]["num_used_tokens"] == 0, run["idle"]
        assert "memory leak detected" not in run["log"]


def test_sigterm_with_requests_in_flight_answers_them_and_ends_every_process(runs):
    for run in runs:
        shutdown = run["shutdown"]
        assert shutdown["clients_hung"] == 0 and shutdown["processes_left_after_exit"] == [], shutdown
        # SGLang drains running requests on SIGTERM: each gets its whole answer.
        assert [o["outcome"] for o in shutdown["outcomes"]] == ["answered"] * 3, shutdown
