"""End to end on CPU: `python -m sglang.launch_server --device cpu --speculative-algorithm dflash`
serves through sglang-dflash's worker and kernels, and its greedy outputs equal the same server
without speculative decoding, token for token.

Real SGLang processes on 127.0.0.1, with a tiny Qwen3 target (3 layers, hidden 64) and a tiny
DFlash drafter, both with SGLang's deterministic dummy weights (`--load-format dummy`), and a
byte-level BPE tokenizer trained here. Needs SGLang installed for CPU
(scripts/install_sglang_cpu.sh); skipped otherwise. Marked slow: about 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
from pathlib import Path

import pytest

from sglang_dflash.serving.local_server import LocalServer, all_ready, free_port, launch_args, server_env

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "SGLang is not installed (scripts/install_sglang_cpu.sh VENV installs it beside the package)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT = 420
VOCAB = 1000
MASK_ID = 1
SPECIALS = ["<|endoftext|>", "<|MASK|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "def add(a, b): return a + b",
    "one two three four five six",
    "speculative decoding drafts a block of tokens",
    "hello world",
]


# -- models -----------------------------------------------------------------------------------


def _qwen3(hidden=64, layers=3, **extra):
    cfg = {
        "model_type": "qwen3", "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "torch_dtype": "float32", "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 0,
    }
    cfg.update(extra)
    return cfg


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = (
        "the quick brown fox jumps over lazy dog def add return one two three four five six seven "
        "speculative decoding drafts a block of tokens hello world target draft verify accept bonus "
        "cpu kernel attention cache layer model server request response"
    ).split()
    corpus = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(400)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    assert tok.token_to_id("<|MASK|>") == MASK_ID and tok.get_vocab_size() <= VOCAB
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "mask_token": "<|MASK|>", "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }))


def make_models(root: Path, *, draft_hidden=64, block_size=4) -> tuple[Path, Path]:
    target, draft = root / "target", root / "draft"
    target.mkdir(parents=True, exist_ok=True)
    draft.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(dict(_qwen3(), architectures=["Qwen3ForCausalLM"])))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    _write_tokenizer(target)
    (draft / "config.json").write_text(json.dumps(dict(
        _qwen3(hidden=draft_hidden, layers=1), architectures=["DFlashDraftModel"], block_size=block_size,
        num_target_layers=3, dflash_config={"block_size": block_size, "target_layer_ids": [0, 1],
                                            "mask_token_id": MASK_ID, "mask_token": "<|MASK|>"},
    )))
    return target, draft


# -- servers ----------------------------------------------------------------------------------


# A DFLASH server of make_models' target and drafter, both with SGLang's deterministic dummy weights
# (the router and data-parallel tests' servers).
DUMMY_DFLASH_ARGS = ["--load-format", "dummy", "--speculative-draft-load-format", "dummy", "--dtype", "float32",
                     "--random-seed", "0", "--max-total-tokens", "4096"]


def _env(tmp: Path) -> dict:
    # One thread each: the two servers run side by side on a small CI machine.
    return server_env(tmp, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


def _launch_args(target: Path, port: int, draft: Path | None, extra=()) -> list[str]:
    common = ["--load-format", "dummy", "--dtype", "float32", "--max-total-tokens", "4096",
              "--max-running-requests", "8", "--random-seed", "0"]
    if draft is not None:
        common += ["--speculative-draft-load-format", "dummy"]
    return launch_args(target, port, draft=draft, extra=[*common, *extra])


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang_cpu")
    target, draft = make_models(tmp / "models")
    env = _env(tmp)
    spec = LocalServer("dflash", _launch_args(target, free_port(), draft), env, tmp / "dflash.log")
    base = LocalServer("baseline", _launch_args(target, free_port(), None), env, tmp / "baseline.log")
    with all_ready(spec, base, startup_timeout=STARTUP_TIMEOUT):
        yield spec, base


# -- tests ------------------------------------------------------------------------------------


def _generate(server, prompt, **sampling):
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    params.update(sampling)
    return server.post("/generate", {"text": prompt, "sampling_params": params})


def test_server_log_names_our_worker_and_kernels(servers):
    spec, base = servers
    _generate(spec, PROMPTS[0])
    log = spec.text()
    worker = "sglang_dflash.serving.worker.DFlashKernelWorker"
    assert f"sglang-dflash: speculative algorithm DFLASH runs worker {worker}" in log
    assert "sglang-dflash: first verify on cpu ran sglang_dflash kernels" in log
    assert "sglang-dflash: 1 draft attention layers run block_attention in TARGET_VERIFY" in log
    assert re.search(r"sglang-dflash: [1-9]\d* draft RMSNorms and the q/k norm \+ RoPE of 1 draft attentions run "
                     r"rms_norm_rope", log)
    assert "DFlashKernelWorker" not in base.text()


def test_greedy_generate_equals_the_server_without_speculation(servers):
    spec, base = servers
    for prompt in PROMPTS:
        ours, theirs = _generate(spec, prompt), _generate(base, prompt)
        assert ours["output_ids"] == theirs["output_ids"], prompt
        assert ours["text"] == theirs["text"]
        assert ours["meta_info"]["completion_tokens"] == 24
        assert ours["meta_info"]["spec_accept_length"] >= 1.0
        assert "spec_accept_length" not in theirs["meta_info"] or not theirs["meta_info"]["spec_accept_length"]


def test_concurrent_greedy_requests_equal_the_baseline(servers):
    spec, base = servers
    prompts = PROMPTS * 2
    lengths = [8 + 5 * i for i in range(len(prompts))]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        ours = list(pool.map(lambda a: _generate(spec, a[0], max_new_tokens=a[1]), zip(prompts, lengths, strict=True)))
    theirs = [_generate(base, p, max_new_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
    for o, t, n in zip(ours, theirs, lengths, strict=True):
        assert o["output_ids"] == t["output_ids"]
        assert len(o["output_ids"]) == n


def test_batched_generate_equals_the_baseline(servers):
    spec, base = servers
    body = {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}}
    ours, theirs = spec.post("/generate", body), base.post("/generate", body)
    assert [o["output_ids"] for o in ours] == [t["output_ids"] for t in theirs]


def test_chat_completions_equal_the_baseline(servers):
    spec, base = servers
    for prompt in PROMPTS[:3]:
        body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                "max_tokens": 20}
        ours, theirs = spec.post("/v1/chat/completions", body), base.post("/v1/chat/completions", body)
        assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
        assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]


def test_sampled_requests_complete(servers):
    spec, _ = servers
    cases = [dict(temperature=0.8), dict(temperature=1.0, top_k=20), dict(temperature=0.7, top_p=0.9),
             dict(temperature=1.2, top_k=50, top_p=0.8)]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        outs = list(pool.map(lambda c: _generate(spec, PROMPTS[1], max_new_tokens=20, **c), cases))
    for out in outs:
        assert len(out["output_ids"]) == 20
        assert all(0 <= t < VOCAB for t in out["output_ids"])
        assert out["meta_info"]["spec_accept_length"] >= 1.0
    log = spec.text()
    assert "falling back to greedy" not in log


@pytest.mark.parametrize("prompt,message", [
    ({"text": ""}, "the prompt is empty: it must have at least one token"),
    ({"input_ids": [5, VOCAB + 5]}, f"prompt token id {VOCAB + 5} is outside the vocabulary [0, {VOCAB})"),
])
def test_prompts_that_crash_stock_sglang_get_a_400_and_the_server_keeps_serving(servers, prompt, message):
    for server in servers:  # with speculation and without: both run the plugin
        with pytest.raises(urllib.error.HTTPError) as err:
            server.post("/generate", {**prompt, "sampling_params": {"max_new_tokens": 4}})
        assert err.value.code == 400 and message in err.value.read().decode()
        assert len(_generate(server, PROMPTS[0], max_new_tokens=4)["output_ids"]) == 4


def test_server_shuts_down_cleanly(servers):
    spec, base = servers
    # Last in this module: stops both servers and checks nothing of them is left.
    for server in (spec, base):
        before = len(server.text())
        rc = server.stop()
        assert rc is not None
        deadline = time.time() + 30
        while server.group_alive() and time.time() < deadline:
            time.sleep(0.5)
        assert not server.group_alive(), f"{server.name}: processes left in its group"
        log = server.text()
        assert "Traceback" not in log[before:], log[before:][-3000:]
        assert "Scheduler hit an exception" not in log
        assert "crashed" not in log[before:], log[before:][-3000:]
        assert rc == 0 or rc == -signal.SIGTERM, rc


# -- bad input: the server refuses to start, with a clear message, without hanging ------------


@pytest.mark.parametrize(
    "case",
    ["missing_draft_path", "block_size_mismatch", "draft_hidden_mismatch"],
)
def test_bad_configuration_refuses_to_start(case, tmp_path):
    target, draft = make_models(tmp_path / "models", draft_hidden=128 if case == "draft_hidden_mismatch" else 64)
    port = free_port()
    if case == "missing_draft_path":
        args = _launch_args(target, port, None, ["--speculative-algorithm", "dflash"])
        expect = "requires setting --speculative-draft-model-path"
    elif case == "block_size_mismatch":
        args = _launch_args(target, port, draft, ["--speculative-dflash-block-size", "8",
                                                  "--speculative-num-draft-tokens", "4"])
        expect = "they differ"
    else:
        args = _launch_args(target, port, draft)
        expect = "the drafter's hidden_size 128 does not match the target's 64"
    proc = subprocess.run(args, env=_env(tmp_path), capture_output=True, text=True, timeout=300,
                          start_new_session=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert expect in out, out[-3000:]
