"""Security defaults: loopback bind, constant-time key checks, keys and bodies out of the logs, limits
before any model work, no network fetches, no code or pickle from a checkpoint, a user-only cache.

Already covered elsewhere (referenced in RELIABILITY.md): the default host in the settings and keys
redacted from the settings' log line (tests/server/test_settings.py), bodies logged only with
--log-requests and remote image URLs refused (tests/server/test_logs.py, test_conformance.py)."""

from __future__ import annotations

import base64
import hmac
import io
import json
import logging
import os
import pickle
import shutil
import signal
import socket
import stat
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from devtools.harness import CLEF_LAUNCHER, engine_launcher, free_port, start_clef_server
from PIL import Image

from clef_runtime.encoding.tokenizer import cache_dir
from clef_runtime.engine.clef import Clef
from clef_runtime.model.checkpoint import CheckpointError
from clef_runtime.model.resolve import resolve_model, tiny_cache_path
from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.images import extract_images
from clef_runtime.server import auth
from clef_runtime.server.auth import KeyChecker
from tests.server.conftest import Served
from tests.server.helpers import REQUEST, post
from tests.server.test_live import start_fake_process

NOUL = {"type": "noul", "instructions": "Refund?"}


# --------------------------------------------------------------------------------------------- binding


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) of sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.add(address)
    return found


@pytest.mark.slow
def test_the_server_listens_on_loopback_only_by_default() -> None:
    process, url = start_fake_process(delay_s=0.0)
    try:
        port = int(url.rsplit(":", 1)[1])
        assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, nothing else
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    log = process.stdout.read().decode() if process.stdout else ""
    assert "without --api-key" not in log


def test_another_machines_address_without_a_key_is_refused_before_anything_starts() -> None:
    done = subprocess.run(
        [*CLEF_LAUNCHER, "serve", "--model", "tiny", "--host", "0.0.0.0", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        env={key: value for key, value in os.environ.items() if not key.startswith("CLEF_")},
    )
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.count("\n") == 1
        and "--api-key" in done.stderr
        and "--allow-unauthenticated" in done.stderr
    )


@pytest.mark.slow
def test_allow_unauthenticated_serves_every_interface_and_says_so() -> None:
    server = start_clef_server(
        "fake",
        launcher=engine_launcher("devtools.fake_engine:FakeClef"),
        timeout=60,
        host="0.0.0.0",
        allow_unauthenticated=True,
    )
    try:
        port = int(server.url.rsplit(":", 1)[1])
        assert _listening_addresses(port) == {"00000000"}  # 0.0.0.0: every interface
    finally:
        assert server.stop() == 0
    assert "without --api-key (--allow-unauthenticated): anyone who can reach it can use it" in server.log()


# ------------------------------------------------------------------------------------------------- keys


def test_keys_are_compared_in_constant_time_against_every_configured_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest  # auth.hmac is the hmac module: keep the original before patching

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    checker = KeyChecker(["first-key", "second-key", "third-key"])
    for presented, expected in [("first-key", True), ("nope", False), ("third-key", True), ("", False)]:
        calls.clear()
        assert checker.matches(presented) is expected
        # Every key is compared, even after a match, and always as fixed-length digests.
        assert len(calls) == 3
        assert {len(a) for a, _ in calls} == {len(b) for _, b in calls} == {32}


def test_api_keys_never_reach_the_logs(
    serve_fake: Callable[..., Served], caplog: pytest.LogCaptureFixture
) -> None:
    key, wrong = "sk-live-0123456789abcdef", "sk-wrong-fedcba9876543210"
    with caplog.at_level(logging.DEBUG):
        served = serve_fake(api_keys=(key,), log_requests=True)
        ok = post(served.client, REQUEST, headers={"Authorization": f"Bearer {key}"})
        denied = post(served.client, REQUEST, headers={"X-API-Key": wrong})
        missing = post(served.client, REQUEST)
    assert (ok.status_code, denied.status_code, missing.status_code) == (200, 401, 401)
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "request_body" in logged  # --log-requests was on: the bodies are there, the keys are not
    assert key not in logged and wrong not in logged
    assert key not in denied.text and wrong not in denied.text


# ------------------------------------------------------------------------------- limits before the model


def _png(size: int = 8) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (200, 10, 10)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _over_limit_bodies() -> list[tuple[str, Any, int]]:
    """(what, body, expected status) for every limit; the body limit is set to 64 KiB by the test. (Image
    limits are the engine's ``prepare`` - the fake engine has none - see the image test below.)"""
    many_questions = {f"q{i}": NOUL for i in range(65)}
    many_options = {"type": "choice", "instructions": "?", "criteria": {f"o{i}": None for i in range(256)}}
    many_levels = {"type": "score", "instructions": "?", "criteria": [f"l{i}" for i in range(11)]}
    return [
        ("body", {"state": "x" * 70_000, "questions": {"q": NOUL}}, 413),
        ("questions", {"state": "x", "questions": many_questions}, 422),
        ("options", {"state": "x", "questions": {"q": many_options}}, 422),
        ("levels", {"state": "x", "questions": {"q": many_levels}}, 422),
        ("question id", {"state": "x", "questions": {"q" * 257: NOUL}}, 422),
        ("tokens", {"state": "word " * 2_000, "questions": {"q": NOUL}}, 413),
        ("schema tokens", {"state": "x", "questions": {"q": {**NOUL, "instructions": "w " * 600}}}, 413),
    ]


def test_every_limit_is_enforced_before_any_model_work(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake(max_body_bytes=64 * 1024, max_input_tokens=500, on_overflow="reject")
    for what, body, status in _over_limit_bodies():
        response = post(served.client, body)
        assert response.status_code == status, (what, response.text)
    assert served.engine.batches == []  # the engine never ran
    assert post(served.client, REQUEST).status_code == 200
    assert len(served.engine.batches) == 1


def test_image_limits_are_enforced_while_reading_the_body() -> None:
    """``extract_images`` (the first step of ``Clef.prepare``, before the model) enforces the count, the
    size per image and the total; the last two without decoding a byte of a too-large payload."""
    request = {"state": "x", "questions": {"q": NOUL}}
    assert len(extract_images({**request, "images": [_png()] * 4})[1]) == 4
    big = "data:image/png;base64," + "A" * (4 * 1024 * 1024 * 4 // 3 + 8)
    medium = "data:image/png;base64," + "A" * (3 * 1024 * 1024 * 4 // 3)
    for images, needle in [([_png()] * 5, "images"), ([big], "images"), ([medium] * 3, "images")]:
        with pytest.raises(RequestValidationError) as error:
            extract_images({**request, "images": images})
        assert error.value.errors[0]["loc"][0] == needle


# ---------------------------------------------------------------------------------------------- network


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Record (and refuse) every attempt to open a connection or a URL."""
    attempts: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        attempts.append(args)
        raise OSError("network access attempted in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    monkeypatch.setattr(httpx.Client, "send", refuse)
    yield attempts


@pytest.mark.parametrize(
    "body",
    [
        {"images": ["https://example.com/cat.png"]},
        {"images": ["http://127.0.0.1:1/x.png"]},
        {"images": [{"url": "https://example.com/cat.png"}]},
        {"state": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]},
        {"state": [{"type": "input_image", "image_url": "ftp://example.com/cat.png"}]},
        {"state": [{"type": "image_url", "image_url": "file:///etc/passwd"}]},
    ],
)
def test_no_url_is_ever_fetched(no_network: list[Any], body: dict[str, Any]) -> None:
    request = {"state": "x", "questions": {"q": NOUL}, **body}
    with pytest.raises(RequestValidationError):
        extract_images(request)
    assert no_network == []


# --------------------------------------------------------------------------------------- checkpoints


class _Trap:
    """Unpickling it creates ``path``: proof that a pickle was loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def _plant_traps(checkpoint: Path, marker: Path) -> None:
    """Pickled weights, a Python module and an ``auto_map`` pointing at it: all must be ignored."""
    payload = pickle.dumps(_Trap(marker))
    for name in ("pytorch_model.bin", "joint_head.bin", "training_args.bin", "model.pt", "head.pkl"):
        (checkpoint / name).write_bytes(payload)
    (checkpoint / "modeling_clef.py").write_text(f"import os\nos.mkdir({str(marker)!r})\n")
    config_path = checkpoint / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoModel": "modeling_clef.ClefModel", "AutoConfig": "modeling_clef.ClefConfig"}
    config_path.unlink()  # a symlink into the shared tiny checkpoint
    config_path.write_text(json.dumps(config))


@pytest.mark.slow
def test_no_code_or_pickle_is_loaded_from_a_checkpoint(tmp_path: Path) -> None:
    tiny = resolve_model("tiny").path
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny, checkpoint, copy_function=os.symlink)
    marker = tmp_path / "executed"
    _plant_traps(checkpoint, marker)
    engine = Clef.load(str(checkpoint), dtype="fp32", cache_mb=0)
    response = engine.decide({"state": "x", "questions": {"q": NOUL}})
    assert 0 <= response["answers"]["q"]["noul"] <= 1
    assert not marker.exists()

    # Pickled weights instead of safetensors: refused, not loaded.
    pickled_only = tmp_path / "pickled"
    shutil.copytree(checkpoint, pickled_only, symlinks=True)
    (pickled_only / "joint_head.safetensors").unlink()
    with pytest.raises(CheckpointError, match="joint_head"):
        Clef.load(str(pickled_only), cache_mb=0)
    assert not marker.exists()


# -------------------------------------------------------------------------------------------- the cache


def test_the_cache_directory_is_user_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = tmp_path / "fresh" / "clef"
    monkeypatch.setenv("CLEF_CACHE_DIR", str(fresh))
    old_umask = os.umask(0o022)
    try:
        assert cache_dir() == fresh
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    assert tiny_cache_path().parent == fresh  # the tiny model is built inside it

    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    loose.chmod(0o777)
    monkeypatch.setenv("CLEF_CACHE_DIR", str(loose))
    cache_dir()
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700  # an existing directory is tightened
