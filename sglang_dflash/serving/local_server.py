"""SGLang servers as child processes on 127.0.0.1, for the CPU-server tests and the serving
benchmark: `python -m sglang.launch_server` with this package's plugin active.

Standard library only (and the settings registry, which is too): whoever imports this (pytest
collection, a benchmark's client) must not pay for importing SGLang or torch; the server processes
do that themselves.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from importlib import metadata
from pathlib import Path

from sglang_dflash import settings

EP_GROUP = "sglang.srt.plugins"
EP_VALUE = "sglang_dflash.serving.plugin:register"
# The directory that holds the sglang_dflash package: put first on the servers' PYTHONPATH so they
# import this copy of it.
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


# Servers' HTTP ports come from here: below Linux's default ephemeral range (32768+), where no
# connect() or bind(0) lands, and off SGLang's own pick for its NCCL/gloo port (22000-29999). A
# port from bind(0) was free when picked, but the server binds it only after loading its model,
# tens of seconds later, and meanwhile any client connection (our readiness polls of another
# server included) may take it as its local port, and the server then fails with "address already
# in use".
SERVER_PORTS = range(10000, 22000)


def free_port() -> int:
    """A port nobody listens on now, that the kernel does not hand out to other sockets."""
    for port in random.sample(SERVER_PORTS, 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all taken: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(tmp_dir: Path, **overrides: str) -> dict:
    """The environment of a CPU server with the plugin active, then `overrides` on top.

    SGLang finds plugins through entry points only; when this package runs from a source tree
    whose entry point is not installed, a minimal dist-info declaring it is written under
    `tmp_dir` and put on PYTHONPATH."""
    path = [str(PACKAGE_PARENT)]
    if not any(ep.value == EP_VALUE for ep in metadata.entry_points(group=EP_GROUP)):
        dist = Path(tmp_dir) / "ep" / "sglang_dflash_entry_point-0.0.0.dist-info"
        dist.mkdir(parents=True, exist_ok=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-dflash-entry-point\nVersion: 0.0.0\n")
        (dist / "entry_points.txt").write_text(f"[{EP_GROUP}]\nsglang_dflash = {EP_VALUE}\n")
        path.insert(0, str(dist.parent))
    env = dict(os.environ)
    # Switches inherited from the caller's shell would silently change what is measured or tested:
    # every one of ours that is read at run time, and SGLang's plugin allow-list.
    for var in [*settings.runtime_names(), "SGLANG_PLUGINS"]:
        env.pop(var, None)
    env.update(
        PYTHONPATH=os.pathsep.join(path + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        SGLANG_USE_CPU_ENGINE="1",
        # SGLang otherwise waits for a CUDA core dump before a crashed server exits.
        SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.update(overrides)
    return env


def core_groups(count: int) -> list[list[int]] | None:
    """This process's cores in `count` disjoint groups of equal size, one per server sharing this
    machine (LocalServer's `cores`). Without them every server's OpenMP threads run on every core and
    spin while they wait for each other, which slows every server down several times over. None when
    there are fewer cores than groups."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        return None
    size = len(cores) // count
    return [cores[i * size:(i + 1) * size] for i in range(count)]


def launch_args(model_path: Path, port: int, *, draft: Path | None = None, extra=()) -> list[str]:
    """`python -m sglang.launch_server` on CPU at 127.0.0.1:port; DFLASH with `draft` when given.
    --sleep-on-idle: an idle SGLang scheduler otherwise polls its sockets in a busy loop, a whole
    core, and the servers started here share a small machine with each other and their clients."""
    args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path), "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(port), "--sleep-on-idle"]
    if draft is not None:
        args += ["--speculative-algorithm", "dflash", "--speculative-draft-model-path", str(draft)]
    return args + list(extra)


def sse_chunks(response):
    """The JSON chunks of a server-sent event stream (SGLang's /generate with "stream": true), up
    to `data: [DONE]`; lines that are not data, and empty data, are skipped."""
    for line in response:
        if not line.startswith(b"data:"):
            continue
        payload = line[len(b"data:"):].strip()
        if payload == b"[DONE]":
            return
        if payload:
            yield json.loads(payload)


class ServerStartError(RuntimeError):
    """A server that exited, could not bind its port or did not answer in time; `server` is it."""

    def __init__(self, server: LocalServer, message: str):
        super().__init__(message)
        self.server = server


class ServerStartTimeout(ServerStartError, TimeoutError):
    pass


class LocalServer:
    """One server process, in a session of its own (so its scheduler and detokenizer children can be
    found and killed as a group), its output in `log_path`."""

    def __init__(self, name: str, args: list[str], env: dict, log_path: Path, cores: list[int] | None = None):
        """`cores`: the only cores the server and its children may run on (as `taskset -c` would).
        SGLANG_CPU_OMP_THREADS_BIND cannot do this everywhere: SGLang 0.5.23 binds threads only on
        CPUs with AMX or on arm64, and elsewhere just checks the variable's syntax."""
        self.name, self.log = name, Path(log_path)
        self.port = int(args[args.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_file = open(self.log, "wb")
        pin = None if cores is None else lambda: os.sched_setaffinity(0, cores)
        self.proc = subprocess.Popen(args, env=env, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=pin)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def _raise_if_failed(self) -> None:
        """Raises with the log's tail when the process has exited or could not bind its port."""
        if self.proc.poll() is not None:
            raise ServerStartError(self, f"{self.name} server exited ({self.proc.returncode}):\n"
                                         f"{self.text()[-4000:]}")
        if "address already in use" in self.text().lower():  # uvicorn could not bind, yet the process stays
            raise ServerStartError(self, f"{self.name} server: port {self.port} taken:\n{self.text()[-4000:]}")

    def ready(self) -> bool:
        """Whether /health_generate answers now (a real forward pass); raises with the log's tail
        when the process has exited or could not bind its port."""
        self._raise_if_failed()
        try:
            with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, deadline: float) -> None:
        """Until the server answers, or raise with the log's tail when the process exits or
        time.time() passes `deadline`."""
        wait_all_ready([self], deadline)

    def _request(self, path: str, body: dict) -> urllib.request.Request:
        return urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                      headers={"Content-Type": "application/json"})

    def post(self, path: str, body: dict, timeout: float = 120):
        """POST `body` as JSON; the decoded JSON answer, or its text when it is not JSON (e.g.
        /flush_cache)."""
        with urllib.request.urlopen(self._request(path, body), timeout=timeout) as r:
            raw = r.read()
            if r.headers.get_content_type() == "application/json":
                return json.loads(raw)
            return raw.decode(errors="replace")

    def stream_generate(self, body: dict, timeout: float = 600) -> tuple[dict, list[tuple[float, int]]]:
        """POST /generate with "stream": true and read its server-sent events up to `data: [DONE]`.

        Returns the last chunk (SGLang's non-incremental stream: the whole output so far and its
        meta_info) and, per chunk, (seconds since the request was sent, completion_tokens so far),
        from which time to first token and per-token times follow. `timeout` bounds the whole
        request (and each wait for a chunk)."""
        start = time.perf_counter()
        final, arrivals = None, []
        with urllib.request.urlopen(self._request("/generate", dict(body, stream=True)), timeout=timeout) as r:
            for chunk in sse_chunks(r):
                if "error" in chunk:
                    raise RuntimeError(f"{self.name}: {chunk['error']}")
                arrivals.append((time.perf_counter() - start, chunk["meta_info"]["completion_tokens"]))
                final = chunk
                if arrivals[-1][0] > timeout:
                    raise TimeoutError(f"{self.name}: request still streaming after {timeout} s")
        if final is None:
            raise RuntimeError(f"{self.name}: the stream ended without a chunk")
        return final, arrivals

    def load(self) -> dict:
        """This server's scheduler load (GET /v1/loads, data-parallel rank 0): running and waiting
        requests, and num_used_tokens: KV slots held by requests (cached prefixes that could be
        evicted do not count; the draft model's K/V live in the same slots, so they count too)."""
        with urllib.request.urlopen(self.url + "/v1/loads", timeout=30) as r:
            return json.loads(r.read())["loads"][0]

    def wait_idle(self, timeout: float = 60) -> dict:
        """Polls load() until no request runs or waits; returns that load, or raises TimeoutError."""
        deadline = time.time() + timeout
        while True:
            load = self.load()
            if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
                return load
            if time.time() > deadline:
                raise TimeoutError(f"{self.name}: still busy after {timeout} s: {load}")
            time.sleep(0.5)

    def generate_requests_answered(self) -> int:
        """POST /generate requests this server has answered with 200, from its access log."""
        return self.text().count('"POST /generate HTTP/1.1" 200')

    def abort(self, rid: str) -> None:
        """POST /abort_request for the request with id `rid` (sent as "rid" in its body)."""
        self.post("/abort_request", {"rid": rid}, timeout=30)

    def pids(self) -> list[int]:
        """The processes of this server's session: the HTTP server, its scheduler, detokenizer."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.getsid(int(entry.name)) == self.proc.pid:
                        pids.append(int(entry.name))
                except OSError:  # exited meanwhile
                    pass
        return sorted(pids)

    def resident_bytes(self) -> int:
        """Resident memory of all this server's processes (VmRSS summed; Linux /proc)."""
        total = 0
        for pid in self.pids():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM to the server's main process; its process group is killed only if it has not
        exited within `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log_file.close()
        return self.proc.returncode

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False


class LocalRouter(LocalServer):
    """SGLang's router (the sglang-router package) on 127.0.0.1:port in front of `workers`."""

    def __init__(self, name: str, workers: list[LocalServer], port: int, log_path: Path, policy: str = "cache_aware"):
        self.workers = workers
        args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--policy", policy, "--worker-urls", *(w.url for w in workers)]
        super().__init__(name, args, dict(os.environ), log_path)

    def ready(self) -> bool:
        """Whether the router lists every worker as healthy. It answers /health at once but registers
        its workers in the background, and until then answers requests with 503
        no_available_workers."""
        self._raise_if_failed()
        try:
            with urllib.request.urlopen(self.url + "/workers", timeout=30) as r:
                listed = json.loads(r.read()).get("workers", [])
        except OSError:
            return False
        healthy = {w.get("url") for w in listed if w.get("is_healthy")}
        return all(w.url in healthy for w in self.workers)


def wait_all_ready(servers: list[LocalServer], deadline: float, on_ready=None) -> None:
    """Until every one of `servers` (started together, so their start-ups overlap: mostly
    single-threaded imports and model loading) answers; `on_ready(server, seconds)` as each does.
    The first that exits, cannot bind its port or is still not ready at `deadline` (time.time())
    raises ServerStartError (ServerStartTimeout), named, with its log's tail."""
    started, waiting = time.time(), list(servers)
    while True:
        for server in list(waiting):
            if server.ready():
                waiting.remove(server)
                if on_ready is not None:
                    on_ready(server, time.time() - started)
        if not waiting:
            return
        if time.time() >= deadline:
            late = waiting[0]
            raise ServerStartTimeout(late, f"{late.name} server not ready after {time.time() - started:.0f} s:\n"
                                           f"{late.text()[-4000:]}")
        time.sleep(2)


def stop_all(servers) -> None:
    for server in servers:
        server.stop()


@contextlib.contextmanager
def all_ready(*servers: LocalServer, startup_timeout: float):
    """`servers` once all answer (wait_all_ready); stops them all on exit, also when one fails to
    start."""
    try:
        wait_all_ready(list(servers), time.time() + startup_timeout)
        yield servers
    finally:
        stop_all(servers)


def sigterm_in_flight(server: LocalServer, texts: list[str], max_new_tokens: int = 96) -> dict:
    """Clean shutdown under load: one long streamed greedy request per text, SIGTERM to the server
    once each has streamed a token, then waits for the clients and for every process of the server's
    session to end (SGLang drains the running requests first). Returns each client's outcome
    ("answered": all max_new_tokens; or "connection closed"), how many clients hung, and the
    server's processes still alive 30 s after its main process exited (then SIGKILLed)."""
    count = len(texts)
    started = threading.Barrier(count + 1, timeout=300)
    outcomes = [None] * count

    def client(i: int) -> None:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
        body = {"text": texts[i], "stream": True, "sampling_params": params}
        request = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        final, waited = None, False
        try:
            with urllib.request.urlopen(request, timeout=300) as r:
                for final in sse_chunks(r):  # noqa: B007 (the last chunk is the answer)
                    if not waited:
                        waited = True
                        with contextlib.suppress(threading.BrokenBarrierError):
                            started.wait()
            tokens = final["meta_info"]["completion_tokens"] if final else 0
            ended = "answered" if tokens == max_new_tokens else f"stream ended after {tokens} tokens"
            outcomes[i] = {"outcome": ended, "tokens": tokens}
        except (OSError, http.client.HTTPException) as e:
            outcomes[i] = {"outcome": "connection closed", "error": f"{type(e).__name__}: {e}"}
        finally:
            if not waited:
                started.abort()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):  # a client failed early: SIGTERM all the same
        started.wait()
    pids = server.pids()
    t0 = time.time()
    os.kill(server.proc.pid, signal.SIGTERM)
    for t in threads:
        t.join(timeout=300)
    try:
        server.proc.wait(timeout=180)
    except subprocess.TimeoutExpired:  # reported below: its pid stays in the list
        pass
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.5)
    left = [p for p in pids if _alive(p)]
    for p in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return {"in_flight": count, "outcomes": outcomes, "clients_hung": sum(t.is_alive() for t in threads),
            "server_processes": len(pids), "processes_left_after_exit": left,
            "exit_code": server.proc.returncode, "seconds_to_exit": round(time.time() - t0, 1)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
