"""``clef heads list | load | unload`` against a live loopback server around the fake engine: the table and
``--json`` list, loading and unloading with the admin key (flag or ``$CLEF_ADMIN_KEY`` in the server's own
``NAME:KEY`` form), a relative path sent absolute, and every refusal as one line on stderr: exit 2 for a 4xx
(an API key where the admin key belongs, no admin key, a bad path, an unknown head), exit 1 naming the URL
for a server that cannot be reached or fails."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from devtools.fake_engine import FakeClef, fake_head

from tests.helpers import CliRun, run_cli
from tests.server.conftest import LiveServer
from tests.serving import free_port

ADMIN_KEY = "admin-secret"
USER_KEY = "user-secret"


@pytest.fixture(autouse=True)
def no_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CLEF_URL", "CLEF_API_KEY", "CLEF_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def keyed(live_fake: Callable[..., LiveServer]) -> LiveServer:
    """A server with an API key and an admin key."""
    return live_fake(FakeClef(), api_keys=(f"alice:{USER_KEY}",), admin_keys=(f"ops:{ADMIN_KEY}",))


def heads(*args: str) -> CliRun:
    return run_cli("heads", *args)


def one_error_line(done: CliRun, status: int) -> str:
    assert done.returncode == status, (done.stdout, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def rows(table: str) -> list[list[str]]:
    return [line.split() for line in table.splitlines()]


def test_list_is_a_table_of_the_heads_and_json_on_request(live_fake: Callable[..., LiveServer]) -> None:
    engine = FakeClef()
    calibrated = dataclasses.replace(
        fake_head("fraud", path="/srv/heads/fraud"), calibration={"label": "ts-v2"}
    )
    engine.heads["fraud"] = calibrated
    served = live_fake(engine)  # no API key configured: none needed
    done = heads("list", "--url", served.url)
    assert done.returncode == 0, done.stderr
    default = engine.heads[engine.name]
    assert rows(done.stdout) == [
        ["NAME", "DIGEST", "DEFAULT", "SOURCE", "PATH", "CALIBRATION"],
        [engine.name, default.digest[:12], "yes", "release", "-", "-"],
        ["fraud", calibrated.digest[:12], "no", "api", "/srv/heads/fraud", "ts-v2"],
    ]
    raw = heads("--url", served.url, "list", "--json")
    assert json.loads(raw.stdout) == {"object": "list", "data": [default.as_api(), calibrated.as_api()]}


def test_list_takes_the_api_key_from_the_flag_or_the_variable(
    keyed: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = one_error_line(heads("list", "--url", keyed.url), 2)
    assert line.startswith("error: ") and "(HTTP 401)" in line
    assert heads("list", "--url", keyed.url, "--api-key", USER_KEY).returncode == 0
    assert heads("--api-key", USER_KEY, "list", "--url", keyed.url).returncode == 0
    monkeypatch.setenv("CLEF_API_KEY", USER_KEY)
    monkeypatch.setenv("CLEF_URL", keyed.url)
    listed = heads("list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [head["name"] for head in json.loads(listed.stdout)["data"]] == [keyed.engine.name]


def test_load_then_list_then_unload(keyed: LiveServer) -> None:
    loaded = heads("load", "billing", "/srv/heads/billing", "--url", keyed.url, "--admin-key", ADMIN_KEY)
    assert loaded.returncode == 0, loaded.stderr
    card = keyed.engine.heads["billing"]
    assert card.path == "/srv/heads/billing"
    assert loaded.stdout == f"loaded billing@{card.digest[:12]} from /srv/heads/billing\n"
    listed = heads("list", "--url", keyed.url, "--api-key", USER_KEY)
    assert ["billing", card.digest[:12], "no", "api", "/srv/heads/billing", "-"] in rows(listed.stdout)
    unloaded = heads("unload", "billing", "--url", keyed.url, "--admin-key", ADMIN_KEY)
    assert unloaded.returncode == 0, unloaded.stderr
    assert unloaded.stdout == f"unloaded billing@{card.digest[:12]}\n"
    assert "billing" not in keyed.engine.heads
    again = one_error_line(heads("unload", "billing", "--url", keyed.url, "--admin-key", ADMIN_KEY), 2)
    assert "'billing' is not loaded" in again and "(HTTP 404)" in again


def test_the_admin_key_variable_takes_the_servers_own_value(
    keyed: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same CLEF_ADMIN_KEY the server was started with: NAME:KEY, possibly a list.
    monkeypatch.setenv("CLEF_ADMIN_KEY", f"ops:{ADMIN_KEY},backup:other-secret")
    loaded = heads("load", "billing", "/srv/heads/billing", "--url", keyed.url)
    assert loaded.returncode == 0, loaded.stderr
    assert "billing" in keyed.engine.heads


def test_an_api_key_where_the_admin_key_belongs_is_exit_2_with_the_403(keyed: LiveServer) -> None:
    line = one_error_line(
        heads("load", "billing", "/srv/heads/billing", "--url", keyed.url, "--admin-key", USER_KEY), 2
    )
    assert "may decide but not change heads" in line and "(HTTP 403)" in line
    assert "billing" not in keyed.engine.heads


def test_without_an_admin_key_nothing_is_sent(keyed: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLEF_API_KEY", USER_KEY)  # the API key does not stand in for the admin key
    for command in (["load", "billing", "/srv/heads/billing"], ["unload", "billing"]):
        line = one_error_line(heads("--api-key", USER_KEY, *command, "--url", keyed.url), 2)
        assert line.startswith(f"clef heads {command[0]}: error: no admin key")
        assert "--admin-key" in line and "CLEF_ADMIN_KEY" in line
    assert list(keyed.engine.heads) == [keyed.engine.name]


def test_a_bad_path_is_exit_2_naming_the_path(keyed: LiveServer) -> None:
    line = one_error_line(
        heads("load", "billing", "/srv/heads/missing", "--url", keyed.url, "--admin-key", ADMIN_KEY), 2
    )
    assert "body.path: " in line and "/srv/heads/missing" in line and "(HTTP 422)" in line


def test_a_relative_path_is_sent_absolute(
    keyed: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    loaded = heads("load", "billing", "heads/billing", "--url", keyed.url, "--admin-key", ADMIN_KEY)
    assert loaded.returncode == 0, loaded.stderr
    absolute = str(tmp_path / "heads" / "billing")
    assert keyed.engine.heads["billing"].path == absolute
    assert loaded.stdout.endswith(f" from {absolute}\n")


def test_a_server_that_cannot_be_reached_is_exit_1_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for command in (["list"], ["load", "billing", "/srv/heads/billing"], ["unload", "billing"]):
        line = one_error_line(heads("--admin-key", ADMIN_KEY, *command, "--url", url), 1)
        assert line.startswith(f"error: cannot reach {url}: ")


class FailingLoads(FakeClef):
    def load_head(self, name: str, path: str) -> object:
        raise RuntimeError("the disk went away")


def test_a_server_error_is_exit_1_naming_the_url(live_fake: Callable[..., LiveServer]) -> None:
    served = live_fake(FailingLoads(), admin_keys=(ADMIN_KEY,))
    line = one_error_line(
        heads("load", "billing", "/srv/heads/billing", "--url", served.url, "--admin-key", ADMIN_KEY), 1
    )
    assert line.startswith(f"error: {served.url} failed with HTTP 500: ")
