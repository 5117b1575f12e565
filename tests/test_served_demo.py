"""`make demo` (sglang_dflash/served_demo.py): a plain and a DFLASH SGLang server on this CPU, the same
prompts, the ratio, identical greedy text; a server that fails to start is named with its log's last
lines, and nothing it started is left running."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from sglang_dflash import served_demo


def test_a_server_that_fails_to_start_is_named_with_its_log_and_everything_is_stopped(tmp_path):
    """Stand-in processes, not SGLang (what is tested is the demo's handling): the plain one would
    never answer, the DFLASH one exits at once. The wait ends on the exit, not at the deadline, names
    the DFLASH server with its log's tail, and the demo stops both."""
    from sglang_dflash.serving.local_server import LocalServer, stop_all

    never_ready = [sys.executable, "-c", "import time; time.sleep(300)", "--port", "1"]
    dies = [sys.executable, "-c", "print('cannot load the model'); raise SystemExit(3)", "--port", "2"]
    servers = [LocalServer("plain", never_ready, {}, tmp_path / "plain.log"),
               LocalServer("DFLASH", dies, {}, tmp_path / "DFLASH.log")]
    try:
        with pytest.raises(served_demo.DemoFailed) as failed:
            served_demo._start(servers)
    finally:
        stop_all(servers)
    message = str(failed.value)
    assert message.startswith("the DFLASH server did not start: DFLASH server exited (3)")
    assert "cannot load the model" in message and str(tmp_path / "DFLASH.log") in message
    assert [s.proc.poll() for s in servers] == [-15, 3]  # the plain one got SIGTERM


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang (make install-sglang-cpu)")
def test_the_demo_serves_plain_and_dflash_with_identical_greedy_text(capsys):
    assert served_demo.run_served_demo(max_new_tokens=24) == 0
    out = capsys.readouterr().out
    assert "plain server ready" in out and "DFLASH server ready" in out
    assert out.count("same text as plain") == len(served_demo.DEMO_PROMPTS)
    assert "greedy output identical: True" in out and "DFLASH / plain: " in out
    assert "SGLANG_USE_CPU_ENGINE=1 python -m sglang.launch_server" in out and "--speculative-algorithm dflash" in out
