"""Starting and stopping real server processes, and a client that loads them: the one implementation the
benchmarks and the tests share (``tests/serving.py`` re-exports it).

A server is ``clef serve`` (``python -m clef_runtime.cli serve``), or the same command line run by another
launcher: ``engine_launcher`` serves an in-process engine (an instant one, a fake) through the real server
code, for measuring the server's own cost. Flags come from `devtools.flags` (the options tables).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from devtools.flags import serve_flags

REPO = Path(__file__).resolve().parents[1]

__all__ = [
    "CLEF_LAUNCHER",
    "REPO",
    "Load",
    "ServerProcess",
    "clef_serve_argv",
    "engine_launcher",
    "free_port",
    "post_all",
    "start_clef_server",
    "start_server_process",
]

#: How ``clef`` itself is started: the installed package's CLI module under this interpreter.
CLEF_LAUNCHER: tuple[str, ...] = (sys.executable, "-m", "clef_runtime.cli")


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    """A server subprocess, its URL and where its output goes (a log file, or a pipe when ``log_path`` is
    None)."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path | None = None

    def log(self) -> str:
        """The output so far (from the pipe: everything once the process has ended)."""
        if self.log_path is not None:
            return self.log_path.read_text(errors="replace")
        stdout = self.process.stdout
        return stdout.read().decode(errors="replace") if stdout is not None else ""

    def rss_bytes(self) -> int:
        """The server process' resident set size, from /proc. Raises RuntimeError where it has none."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc status")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then wait up to ``timeout`` s (kill after). Returns the exit status (-9 when killed)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
                return -9
        return int(self.process.returncode)


def clef_serve_argv(model: str, port: int, *args: str) -> list[str]:
    """``python -m clef_runtime.cli serve --model MODEL --port PORT ARGS`` (flags from the options tables)."""
    return [*CLEF_LAUNCHER, "serve", *serve_flags(model=model, port=port), *args]


def engine_launcher(factory: str, **arguments: Any) -> list[str]:
    """A launcher that serves the engine ``factory(**arguments)`` (``"package.module:callable"``, importable
    from the repository root; JSON-serialisable arguments) with the ``clef serve`` flags that follow it."""
    return [sys.executable, "-m", "devtools.engine_server", factory, json.dumps(arguments)]


def start_server_process(
    argv: Sequence[str],
    port: int,
    *,
    log_path: Path | None = None,
    wait_for: str = "/ready",
    ready: Callable[[httpx.Response], bool] | None = None,
    timeout: float = 180.0,
    env: Mapping[str, str] | None = None,
    new_session: bool = False,
    tls: ssl.SSLContext | None = None,
) -> ServerProcess:
    """Run ``argv`` (a server listening on ``port``) from the repository root, with the ``CLEF_*`` variables
    of this process removed and the repository on ``PYTHONPATH``, and wait until ``wait_for`` answers 200
    (and ``ready(response)`` holds, when given). ``env`` adds variables; ``new_session`` starts the server in
    a process session of its own (its children, a Ray head say, then do not get this terminal's signals);
    ``tls``: the server speaks HTTPS, and this client context trusts its certificate (the URL is https).

    Returns the running server. Raises RuntimeError (with its output) when it exits first or does not answer
    within ``timeout`` s (it is killed then).
    """
    environment = {key: value for key, value in os.environ.items() if not key.startswith("CLEF_")}
    environment["PYTHONPATH"] = str(REPO) + os.pathsep + environment.get("PYTHONPATH", "")
    environment.update(env or {})
    options: dict[str, Any] = {"cwd": REPO, "env": environment, "start_new_session": new_session}
    if log_path is None:
        process = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **options)
    else:
        with log_path.open("wb") as log:
            process = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, **options)
    server = ServerProcess(process, f"{'https' if tls else 'http'}://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log()[-4000:]}")
        if time.monotonic() > deadline:
            process.kill()
            process.wait(10)
            raise RuntimeError(
                f"the server did not answer {wait_for} within {timeout} s:\n{server.log()[-4000:]}"
            )
        try:
            response = httpx.get(server.url + wait_for, timeout=5, verify=tls or True)
            if response.status_code == 200 and (ready is None or ready(response)):
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def start_clef_server(
    model: str,
    *,
    launcher: Sequence[str] = CLEF_LAUNCHER,
    log_path: Path | None = None,
    timeout: float = 600.0,
    ready: Callable[[httpx.Response], bool] | None = None,
    env: Mapping[str, str] | None = None,
    new_session: bool = False,
    tls: ssl.SSLContext | None = None,
    **settings: Any,
) -> ServerProcess:
    """``launcher serve --model MODEL --port <free port>`` plus the flags of ``settings`` (field names of the
    engine's and the server's options: ``cache_mb=0``, ``log_level="warning"``), started and ready.

    Raises KeyError for a setting ``clef serve`` has no flag for, RuntimeError as `start_server_process`."""
    port = free_port()
    argv = [*launcher, "serve", *serve_flags(model=model, port=port, **settings)]
    return start_server_process(
        argv, port, log_path=log_path, ready=ready, timeout=timeout, env=env, new_session=new_session, tls=tls
    )


@dataclass
class Load:
    """What one `post_all` measured: wall seconds of the whole load, and per request (in completion order)
    its latency, the server's own ``x_latency_ms`` and its input tokens (200 answers only)."""

    seconds: float
    latencies_s: list[float] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)
    input_tokens: list[int] = field(default_factory=list)
    errors: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def post_all(
    url: str,
    bodies: Sequence[Mapping[str, Any]],
    concurrency: int,
    *,
    path: str = "/v1/systemone",
    timeout: float = 900.0,
) -> Load:
    """Post every body once with ``concurrency`` client threads (one keep-alive connection each, the bodies
    dealt out round robin). A non-200 answer counts as an error; transport errors propagate."""
    clients = [httpx.Client(base_url=url, timeout=timeout) for _ in range(concurrency)]
    load = Load(seconds=0.0)

    def worker(index: int) -> None:
        for body in bodies[index::concurrency]:
            started = time.perf_counter()
            response = clients[index].post(path, json=body)
            load.latencies_s.append(time.perf_counter() - started)
            if response.status_code != 200:
                load.errors += 1
                continue
            answer = response.json()
            if "x_latency_ms" in answer:
                load.server_ms.append(float(answer["x_latency_ms"]))
            load.input_tokens.append(int(answer.get("usage", {}).get("input_tokens", 0)))

    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(worker, range(concurrency)))
    finally:
        for client in clients:
            client.close()
    load.seconds = time.perf_counter() - started
    return load
