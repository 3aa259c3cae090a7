"""deploy/clef.service: systemd's own checker accepts it, and ``clef serve`` started with exactly its
environment (credential, cache and state directories substituted, as systemd would) serves with the key from
the credential. systemd is not this machine's init, so the unit itself is not started by systemd here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from devtools.apt import ensure_commands
from devtools.harness import REPO, free_port, start_server_process

UNIT = REPO / "deploy" / "clef.service"
VENV_CLEF = str(Path(sys.executable).parent / "clef")


def _unit_with_this_venv(directory: Path, text: str | None = None) -> Path:
    copy = directory / "clef.service"
    copy.write_text((text or UNIT.read_text()).replace("/opt/clef/bin/clef", VENV_CLEF), encoding="utf-8")
    return copy


def test_systemd_analyze_verify_finds_nothing_to_say(tmp_path: Path) -> None:
    ensure_commands(["systemd-analyze"], ["systemd"])
    done = subprocess.run(
        ["systemd-analyze", "verify", str(_unit_with_this_venv(tmp_path))], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout + done.stderr == ""
    # Negative control: a misspelled key is reported (systemd would ignore it and run without it).
    broken = _unit_with_this_venv(tmp_path, UNIT.read_text().replace("RestartSec=", "RestartSecs="))
    done = subprocess.run(["systemd-analyze", "verify", str(broken)], capture_output=True, text=True)
    assert "Unknown key 'RestartSecs'" in done.stdout + done.stderr


def _unit_environment(credentials: Path, cache: Path, state: Path) -> dict[str, str]:
    """The unit's Environment= lines, with systemd's %d (credentials), %C (cache) and %S (state)."""
    environment = {}
    for line in UNIT.read_text().splitlines():
        if match := re.match(r"^Environment=(\w+)=(.*)$", line):
            value = match.group(2).replace("%d", str(credentials)).replace("%C", str(cache))
            environment[match.group(1)] = value.replace("%S", str(state))
    return environment


@pytest.mark.slow
def test_clef_serve_with_the_units_environment_serves_with_the_credentials_key(tmp_path: Path) -> None:
    credentials, cache, state = (tmp_path / name for name in ("credentials", "cache", "state"))
    for folder in (credentials, cache, state):
        folder.mkdir()
    (credentials / "api-key").write_text("unit-secret\n", encoding="utf-8")
    environment = _unit_environment(credentials, cache, state)
    assert environment["CLEF_API_KEY_FILE"] == str(credentials / "api-key")
    port = free_port()
    environment["CLEF_PORT"] = str(port)
    exec_start = next(line for line in UNIT.read_text().splitlines() if line.startswith("ExecStart="))
    argv = exec_start.removeprefix("ExecStart=").replace("/opt/clef/bin/clef", VENV_CLEF).split()
    server = start_server_process(argv, port, env=environment, timeout=300)
    try:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/v1/models", headers={"x-api-key": "unit-secret"}).status_code == 200
        # The jobs database lives in the unit's state directory (StateDirectory=clef: %S/clef).
        assert (state / "clef" / "clef-runtime" / f"jobs-{port}.sqlite3").is_file(), server.log()
    finally:
        assert server.stop() == 0
