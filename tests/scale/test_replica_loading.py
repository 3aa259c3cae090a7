"""A Ray model replica loads and warms its engine on a thread that then ends (so that thread's CPU thread
team goes with it and the batcher thread owns the only one; see model/kernels.py), and a load failure
still reaches the replica's own thread."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import clef_runtime.server.runtime as runtime
from clef_runtime.scale import ray_serve
from clef_runtime.server.settings import ServerSettings


class Engine:
    def __init__(self) -> None:
        self.loaded_on = threading.current_thread()
        self.warmed_on: threading.Thread | None = None

    def warmup(self, **limits: Any) -> None:
        self.warmed_on = threading.current_thread()


def test_the_engine_is_loaded_and_warmed_on_a_thread_that_has_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "load_clef", lambda settings: Engine())
    engine = ray_serve._load_on_a_passing_thread(ServerSettings(model="fake"))
    assert engine.loaded_on is engine.warmed_on
    assert engine.loaded_on is not threading.current_thread()
    assert not engine.loaded_on.is_alive()


def test_a_load_failure_is_raised_on_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(settings: ServerSettings) -> Engine:
        raise FileNotFoundError("no such model")

    monkeypatch.setattr(runtime, "load_clef", fail)
    with pytest.raises(FileNotFoundError, match="no such model"):
        ray_serve._load_on_a_passing_thread(ServerSettings(model="fake"))
