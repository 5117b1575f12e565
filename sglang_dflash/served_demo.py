"""`sglang-dflash demo` (`make demo`): the product's main door on this machine. It starts an SGLang
server with plain decoding and one with `--speculative-algorithm dflash` and the shipped drafter on
127.0.0.1 (started together, timed one after the other), sends each the same prompts one at a time
(greedy), and prints the answers, output tok/s and the ratio, whether the greedy text is identical,
and the commands that start such servers. It stops every server it started, also when one fails.

The plain server runs with this package's plugin loaded, as every SGLang server in an environment
with sglang-dflash installed does (the plugin registers itself through an entry point); with plain
decoding the plugin only makes linear layers batch-invariant, which is why both servers give the
same greedy text token for token.
"""

from __future__ import annotations

import importlib.util
import shlex
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from sglang_dflash.demo import DEMO_BLOCK_SIZE, DEMO_PROMPTS

DEMO_TARGET = "smollm2-135m"
# A small KV pool: on the CPU, SGLang otherwise takes most of the RAM for it.
CPU_KV_POOL = ("--max-total-tokens", "8192")
# As the serving benchmark's (launch_args adds --sleep-on-idle).
SERVER_ARGS = (*CPU_KV_POOL, "--random-seed", "0")
STARTUP_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 300


@dataclass
class ServedRun:
    name: str
    answers: list[dict]  # SGLang /generate answers, in prompt order
    seconds: float  # wall time of the timed requests, sent one at a time

    @property
    def completion_tokens(self) -> int:
        return sum(a["meta_info"]["completion_tokens"] for a in self.answers)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds

    def output_ids(self) -> list[list[int]]:
        return [a["output_ids"] for a in self.answers]


class DemoFailed(RuntimeError):
    pass


def _say(text: str) -> None:
    print(text, flush=True)


def _chat_texts(model_dir: Path) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in DEMO_PROMPTS]


def _log_tail(server, lines: int = 25) -> str:
    return f"last lines of {server.log}:\n" + "\n".join(server.text().splitlines()[-lines:])


def _start(servers: list) -> None:
    """Waits until every server answers; they start together, so their start-ups (mostly
    single-threaded imports and model loading) overlap on the machine's cores."""
    from sglang_dflash.serving.local_server import ServerStartError, wait_all_ready

    names = " and ".join(s.name for s in servers)
    _say(f"[demo] starting the {names} servers together (each loads SGLang and the model; usually 30-90 s "
         f"on 2 cores); logs in {servers[0].log.parent}")
    try:
        wait_all_ready(servers, time.time() + STARTUP_TIMEOUT_S,
                       on_ready=lambda server, s: _say(f"[demo] {server.name} server ready on {server.url} "
                                                       f"after {s:.0f} s"))
    except ServerStartError as e:
        raise DemoFailed(f"the {e.server.name} server did not start: {str(e).splitlines()[0]}\n"
                         f"{_log_tail(e.server)}") from None


def _time_prompts(server, texts: list[str], max_new_tokens: int) -> ServedRun:
    """One warm-up request, then the prompts one at a time, timed. An idle server sleeps
    (--sleep-on-idle), so the other one costs nothing while this one is timed."""
    from tqdm import tqdm

    params = {"max_new_tokens": max_new_tokens, "temperature": 0}
    try:
        server.post("/generate", {"text": texts[0], "sampling_params": params}, REQUEST_TIMEOUT_S)  # warm-up
        answers, seconds = [], 0.0
        for text in tqdm(texts, desc=f"{server.name}: prompts", unit="prompt", file=sys.stdout):
            t0 = time.perf_counter()
            answers.append(server.post("/generate", {"text": text, "sampling_params": params}, REQUEST_TIMEOUT_S))
            seconds += time.perf_counter() - t0
    except OSError as e:
        raise DemoFailed(f"the {server.name} server failed a request ({type(e).__name__}: {e})\n"
                         f"{_log_tail(server)}") from None
    return ServedRun(server.name, answers, seconds)


def _check_sglang() -> None:
    """SGLang is installed (found, not imported: importing it takes seconds, and a broken install
    shows as a server that fails to start, named with its log)."""
    if importlib.util.find_spec("sglang") is None:
        raise DemoFailed("SGLang is not installed here; `make install-sglang-cpu` installs it beside this "
                         "package on a CPU machine, `pip install sglang==0.5.23` on a GPU machine")


def run_served_demo(max_new_tokens: int) -> int:
    from sglang_dflash.drafters import SHIPPED_DRAFTER, resolve_draft
    from sglang_dflash.engine.packaged import packaged_model_dir
    from sglang_dflash.serving.local_server import LocalServer, free_port, launch_args, server_env, stop_all

    try:
        _check_sglang()
        _say(f"[demo] preparing the packaged {DEMO_TARGET} target (converted once from its wheel's GGUF)")
        target = packaged_model_dir(DEMO_TARGET)
        draft = resolve_draft(SHIPPED_DRAFTER)
        dflash_args = ("--speculative-dflash-block-size", str(DEMO_BLOCK_SIZE))
        with tempfile.TemporaryDirectory(prefix="sglang-dflash-demo-") as log_dir:
            log_dir = Path(log_dir)
            argvs = {"plain": launch_args(target, free_port(), extra=SERVER_ARGS),
                     "DFLASH": launch_args(target, free_port(), draft=draft, extra=dflash_args + SERVER_ARGS)}
            servers = []
            try:
                for name, argv in argvs.items():
                    servers.append(LocalServer(name, argv, server_env(log_dir), log_dir / f"{name}.log"))
                texts = _chat_texts(target)  # while the servers start
                _start(servers)
                plain, dflash = [_time_prompts(server, texts, max_new_tokens) for server in servers]
            finally:
                stop_all(servers)
    except DemoFailed as e:
        _say(f"[demo] FAILED: {e}")
        return 1
    identical = plain.output_ids() == dflash.output_ids()
    _print_report(plain, dflash, identical, target, draft, dflash_args, max_new_tokens)
    return 0 if identical else 1


def _print_report(plain: ServedRun, dflash: ServedRun, identical: bool, target: Path, draft: Path,
                  dflash_args: tuple[str, ...], max_new_tokens: int) -> None:
    _say(f"\nSGLang on this CPU, {DEMO_TARGET} target, greedy, {len(plain.answers)} prompts sent one at a time, "
         f"up to {max_new_tokens} new tokens each")
    for i, (prompt, a, b) in enumerate(zip(DEMO_PROMPTS, plain.answers, dflash.answers, strict=True), 1):
        _say(f"--- prompt {i}: {textwrap.shorten(prompt, 100)}")
        _say(textwrap.indent(textwrap.shorten(b["text"].strip(), 300), "    "))
        same = "same text as plain" if a["output_ids"] == b["output_ids"] else "DIFFERS from plain"
        _say(f"    {same}")
    _say("")
    for run in (plain, dflash):
        _say(f"{run.name:>7}: {run.completion_tokens} tokens in {run.seconds:.1f} s = {run.tokens_per_s:.1f} tok/s")
    _say(f"DFLASH / plain: {dflash.tokens_per_s / plain.tokens_per_s:.2f}x output tok/s; "
         f"greedy output identical: {identical}")
    launch = ["python", "-m", "sglang.launch_server", "--model-path", str(target)]
    dflash = ["--speculative-algorithm", "dflash", "--speculative-draft-model-path", str(draft), *dflash_args]
    _say("\nStart these servers yourself, on this CPU:")
    cpu = ["--device", "cpu", *CPU_KV_POOL]
    _say("  plain:  SGLANG_USE_CPU_ENGINE=1 " + shlex.join(launch + cpu))
    _say("  DFLASH: SGLANG_USE_CPU_ENGINE=1 " + shlex.join(launch + cpu + dflash))
    _say("On a GPU (pip install sglang==0.5.23 beside this package): " + shlex.join(launch + dflash))
