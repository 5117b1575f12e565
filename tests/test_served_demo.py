"""`make demo` (sglang_dflash/served_demo.py): a plain and a DFLASH SGLang server on this CPU, the same
prompts, the ratio, identical greedy text; a server that fails to start is named with its log's last
lines, and nothing it started is left running."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from sglang_dflash import served_demo


def test_a_server_that_fails_to_start_is_named_with_its_log_and_stopped(tmp_path, monkeypatch):
    from sglang_dflash.serving import local_server

    started = []

    class Recording(local_server.LocalServer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(local_server, "LocalServer", Recording)
    argv = [sys.executable, "-c", "print('cannot load the model'); raise SystemExit(3)", "--port", "1"]
    with pytest.raises(served_demo.DemoFailed) as failed:
        served_demo._serve("DFLASH", argv, tmp_path, ["a prompt"], 4)
    message = str(failed.value)
    assert message.startswith("the DFLASH server did not start: DFLASH server exited (3)")
    assert "cannot load the model" in message and str(tmp_path / "DFLASH.log") in message
    assert len(started) == 1 and started[0].proc.poll() == 3


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang (make install-sglang-cpu)")
def test_the_demo_serves_plain_and_dflash_with_identical_greedy_text(capsys):
    assert served_demo.run_served_demo(max_new_tokens=24) == 0
    out = capsys.readouterr().out
    assert "plain server ready" in out and "DFLASH server ready" in out
    assert out.count("same text as plain") == len(served_demo.DEMO_PROMPTS)
    assert "greedy output identical: True" in out and "DFLASH / plain: " in out
    assert "SGLANG_USE_CPU_ENGINE=1 python -m sglang.launch_server" in out and "--speculative-algorithm dflash" in out
