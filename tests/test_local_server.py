"""sglang_dflash/serving/local_server.py's port choice, start-up failure detection and server
environment, with stand-in processes instead of SGLang servers (what is tested is the harness, not
SGLang)."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from sglang_dflash import settings
from sglang_dflash.serving import local_server
from sglang_dflash.serving.local_server import SERVER_PORTS, LocalServer, core_groups, free_port, server_env


@pytest.mark.parametrize("cores, count, want", [
    ({0, 1}, 2, [[0], [1]]),
    ({0, 1, 2, 3, 4, 5, 6, 7}, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ({0, 2, 4, 6, 8}, 2, [[0, 2], [4, 6]]),
    ({3, 4, 5}, 1, [[3, 4, 5]]),
    ({0}, 2, None),
])
def test_servers_sharing_a_machine_get_disjoint_core_groups(monkeypatch, cores, count, want):
    monkeypatch.setattr(local_server.os, "sched_getaffinity", lambda pid: cores)
    assert core_groups(count) == want


def test_a_server_given_cores_runs_only_on_them(tmp_path):
    core = sorted(os.sched_getaffinity(0))[-1]
    code = ("import os, time; print('cores', sorted(os.sched_getaffinity(0)), flush=True); "
            "print('Uvicorn running on', flush=True); time.sleep(60)")
    server = LocalServer("pinned", [sys.executable, "-c", code, "--port", str(free_port())], dict(os.environ),
                         tmp_path / "pinned.log", cores=[core])
    try:
        deadline = time.time() + 30
        while "cores" not in server.text() and time.time() < deadline:
            time.sleep(0.1)
        assert f"cores [{core}]" in server.text()
    finally:
        server.stop(timeout=5)


def test_free_ports_are_below_the_ephemeral_range_and_bindable():
    ports = {free_port() for _ in range(20)}
    assert all(p in SERVER_PORTS for p in ports) and len(ports) > 1  # random, not one fixed port
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_a_server_that_cannot_bind_its_port_fails_at_once(tmp_path):
    """uvicorn logs the failed bind and the process lingers: the wait must end on the log line, not
    at the deadline."""
    code = ("import time; print('ERROR:    [Errno 98] error while attempting to bind on address "
            "(\\'127.0.0.1\\', 12345): address already in use', flush=True); time.sleep(120)")
    server = LocalServer("stand-in", [sys.executable, "-c", code, "--port", "12345"], {}, tmp_path / "s.log")
    try:
        started = time.time()
        with pytest.raises(RuntimeError, match="stand-in server: port 12345 taken"):
            server.wait_ready(time.time() + 100)
        assert time.time() - started < 30
    finally:
        server.stop()


def test_a_servers_environment_drops_every_inherited_switch(tmp_path, monkeypatch):
    """Every run-time switch of the settings registry (and SGLang's plugin allow-list) set in the
    caller's shell is gone from a server's environment; what the caller asks for is there."""
    inherited = [*settings.runtime_names(), "SGLANG_PLUGINS"]
    assert settings.NO_AMX.name in inherited and settings.DRAFT_INT8.name in inherited
    assert settings.CUDA.name not in inherited  # a build-time switch: nothing a server reads
    for name in inherited:
        monkeypatch.setenv(name, "1")
    env = server_env(tmp_path, SGLANG_DFLASH_ADAPTIVE="0")
    assert [name for name in inherited if name in env] == [settings.ADAPTIVE.name]
    assert env[settings.ADAPTIVE.name] == "0" and env["SGLANG_USE_CPU_ENGINE"] == "1"
