"""How the browser tests get Chromium: Debian's package, installed with apt-get when missing (as root), a
clear failure otherwise; never a browser download."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from devtools import apt, browser


def _fake_apt(monkeypatch: pytest.MonkeyPatch, target: Path, fail_first: bool) -> list[list[str]]:
    calls: list[list[str]] = []

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        installs = sum(1 for c in calls if c[:2] == ["apt-get", "install"])
        ok = cmd[1] == "update" or not (fail_first and installs == 1)
        if cmd[1] == "install" and ok:
            target.write_text("#!/bin/sh\n")
        return subprocess.CompletedProcess(cmd, 0 if ok else 100, "", "" if ok else "E: Unable to locate")

    monkeypatch.setattr(browser, "CHROMIUM", target)
    monkeypatch.setattr(apt.os, "geteuid", lambda: 0)
    monkeypatch.setattr(apt.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(apt.subprocess, "run", run)
    return calls


def test_a_missing_chromium_is_installed_with_apt_get(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    target = tmp_path / "chromium"
    calls = _fake_apt(monkeypatch, target, fail_first=False)
    assert browser.ensure_chromium() == target
    assert [c[:2] for c in calls] == [["apt-get", "install"]]
    assert "chromium" in calls[0]


def test_apt_get_update_runs_only_when_the_first_install_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    target = tmp_path / "chromium"
    calls = _fake_apt(monkeypatch, target, fail_first=True)
    assert browser.ensure_chromium() == target
    assert [c[:2] for c in calls] == [["apt-get", "install"], ["apt-get", "update"], ["apt-get", "install"]]


def test_without_root_a_missing_chromium_fails_saying_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(browser, "CHROMIUM", tmp_path / "chromium")
    monkeypatch.setattr(apt.os, "geteuid", lambda: 1000)
    with pytest.raises(browser.ChromiumMissing, match="apt-get install -y chromium"):
        browser.ensure_chromium()


def test_an_installed_chromium_is_used_as_it_is(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / "chromium"
    target.write_text("#!/bin/sh\n")
    monkeypatch.setattr(browser, "CHROMIUM", target)
    monkeypatch.setattr(apt.subprocess, "run", lambda *a, **k: pytest.fail("apt-get must not run"))
    assert browser.ensure_chromium() == target
