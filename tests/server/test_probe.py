"""``python -m clef_runtime.probe``, the container's HEALTHCHECK (here beside the server tests, whose live
server it probes): it probes what the server's own variables say it bound, and is 0 only when ready."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
from devtools.fake_engine import FakeClef
from devtools.harness import free_port

from clef_runtime import probe
from tests.server.conftest import LiveServer


@pytest.mark.parametrize(
    ("environ", "target"),
    [
        ({}, ("127.0.0.1", 8094, False)),
        ({"CLEF_HOST": "0.0.0.0", "CLEF_PORT": "9000"}, ("127.0.0.1", 9000, False)),
        ({"CLEF_HOST": "::"}, ("::1", 8094, False)),
        ({"CLEF_HOST": "10.0.0.5"}, ("10.0.0.5", 8094, False)),
        ({"CLEF_SSL_CERTFILE": "/tls/server.crt"}, ("127.0.0.1", 8094, True)),
    ],
)
def test_the_probe_targets_what_the_server_bound(
    environ: dict[str, str], target: tuple[str, int, bool]
) -> None:
    assert probe.probe_target(environ) == target


def test_ready_is_0_and_anything_else_is_1(
    live_fake: Callable[..., LiveServer], capsys: pytest.CaptureFixture[str]
) -> None:
    served = live_fake(FakeClef())
    assert probe.main({"CLEF_HOST": "0.0.0.0", "CLEF_PORT": str(served.port)}) == 0
    served.app.state.runtime._state = "loading"  # as before the model is loaded: /ready is 503
    assert probe.main({"CLEF_PORT": str(served.port)}) == 1
    assert "answered 503 (not ready)" in capsys.readouterr().err
    assert probe.main({"CLEF_PORT": str(free_port())}) == 1  # nothing listens
    assert "Connection refused" in capsys.readouterr().err
    assert probe.main({"CLEF_PORT": "http"}) == 1


def test_the_probe_never_imports_torch() -> None:
    # It runs every few seconds in the container: the standard library only.
    code = (
        "import sys; from clef_runtime import probe; "
        "print(sorted(m for m in ('torch', 'fastapi') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
