"""One error family for loading a model: every entry point that loads one (``clef decide``, ``clef serve``,
``clef eval``, ``clef tune``) classifies a failure of ``Clef.load`` the same way, and out of memory is told by
its type."""

from __future__ import annotations

import argparse
import logging
import threading
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from clef_runtime import cli
from clef_runtime.engine.clef import Clef
from clef_runtime.evaluation import commands as evaluation_commands
from clef_runtime.model.checkpoint import CheckpointError
from clef_runtime.model.device import resolve_device
from clef_runtime.model.head import HeadLoadError
from clef_runtime.model.load_errors import (
    DeviceUnavailableError,
    LoadFailure,
    ModelLoadError,
    classify_load_error,
    is_out_of_memory,
)
from clef_runtime.model.memory import InsufficientMemoryError
from clef_runtime.options import EngineOptions, OptionsError
from clef_runtime.server.metrics import ServerMetrics
from clef_runtime.server.runtime import ServerRuntime
from clef_runtime.server.settings import ServerSettings
from clef_runtime.tuning import command as tune_command

Outcome = Literal["one line", "usage error", "traceback"]

# Not torch's: a class that only shares the name must not pass for running out of memory.
NamedLikeOutOfMemory = type("OutOfMemoryError", (RuntimeError,), {})

ERRORS: dict[str, tuple[BaseException, LoadFailure | None]] = {
    "damaged checkpoint": (
        CheckpointError("model.safetensors is truncated", file=Path("model.safetensors")),
        LoadFailure.UNLOADABLE,
    ),
    "model too large": (
        InsufficientMemoryError("needs 20 GB, 8 GB free", needed_bytes=20, available_bytes=8),
        LoadFailure.UNLOADABLE,
    ),
    "CUDA out of memory": (torch.OutOfMemoryError("CUDA out of memory"), LoadFailure.UNLOADABLE),
    "no CUDA device": (DeviceUnavailableError("torch sees no CUDA device"), LoadFailure.UNLOADABLE),
    "damaged head": (HeadLoadError("head/config.json", "not valid JSON"), LoadFailure.UNLOADABLE),
    "unreadable file": (PermissionError(13, "Permission denied", "x.safetensors"), LoadFailure.UNLOADABLE),
    "bad option": (OptionsError("--cache-mb must be >= 0"), LoadFailure.BAD_OPTION),
    "bug": (RuntimeError("a bug in the loader"), None),
    "bug named OutOfMemoryError": (NamedLikeOutOfMemory("a bug in the loader"), None),
}


EXPECTED: dict[LoadFailure | None, Outcome] = {
    LoadFailure.UNLOADABLE: "one line",
    LoadFailure.BAD_OPTION: "usage error",
    None: "traceback",
}


def _raising(exc: BaseException) -> Any:
    def load(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return load


class _NotRaised(Exception):
    """What ``clef decide``'s loader never raises: it reports a failure by returning None."""


def _outcome_of(call: Any, exc: BaseException, reported: type[BaseException]) -> Outcome:
    """What an entry point's load function made of ``exc``: reported as ``reported`` (one line, exit 1),
    ``exc`` itself passed on (an `OptionsError` to the usage error, anything else as a traceback)."""
    try:
        result = call()
    except reported:
        return "one line"
    except BaseException as passed_on:
        assert passed_on is exc
        return "usage error" if isinstance(passed_on, OptionsError) else "traceback"
    assert result is None  # clef decide: None after its one line
    return "one line"


def _decide(exc: BaseException, capsys: pytest.CaptureFixture[str]) -> Outcome:
    args = cli.build_parser().parse_args(["decide", "--model", "tiny"])
    outcome = _outcome_of(lambda: cli._load_clef(args), exc, _NotRaised)
    if outcome == "one line":
        assert capsys.readouterr().err == f"error: {exc}\n"
    return outcome


def _eval(exc: BaseException, capsys: pytest.CaptureFixture[str]) -> Outcome:
    load = evaluation_commands._load_engine
    outcome = _outcome_of(lambda: load("eval", "tiny", EngineOptions()), exc, evaluation_commands._Stop)
    if outcome == "one line":
        assert capsys.readouterr().err == f"clef eval: error: cannot load 'tiny': {exc}\n"
    return outcome


def _tune(exc: BaseException, capsys: pytest.CaptureFixture[str]) -> Outcome:
    args = argparse.Namespace(model="tiny")
    return _outcome_of(lambda: tune_command._load_engine(args, EngineOptions()), exc, tune_command.TuneError)


def _serve(exc: BaseException, caplog: pytest.LogCaptureFixture) -> Outcome:
    """The server's loader thread: one error line without a traceback, or the traceback of a bug (the
    server exits 1 either way; a bad option is refused before it starts, as a usage error)."""
    fatal = threading.Event()
    runtime = ServerRuntime(
        ServerSettings(model="tiny"), _raising(exc), ServerMetrics(), on_fatal=lambda error: fatal.set()
    )
    with caplog.at_level(logging.ERROR, logger="clef_runtime.server"):
        runtime.start_loading()
        assert not runtime.wait_until_loaded(10)
    assert fatal.is_set()
    (record,) = [r for r in caplog.records if "loading model" in r.getMessage()]
    return "traceback" if record.exc_info else "one line"


@pytest.mark.parametrize(("exc", "failure"), ERRORS.values(), ids=ERRORS.keys())
def test_each_load_failure_has_one_classification(exc: BaseException, failure: LoadFailure | None) -> None:
    assert classify_load_error(exc) is failure


@pytest.mark.parametrize(("exc", "failure"), ERRORS.values(), ids=ERRORS.keys())
def test_every_entry_point_reports_a_load_failure_as_classified(
    exc: BaseException,
    failure: LoadFailure | None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(Clef, "load", _raising(exc))
    outcomes = {
        "clef decide": _decide(exc, capsys),
        "clef eval": _eval(exc, capsys),
        "clef tune": _tune(exc, capsys),
    }
    assert outcomes == dict.fromkeys(outcomes, EXPECTED[failure])
    # The server logs a bad option in one line too: run_serve refuses one before it binds (exit 2).
    assert _serve(exc, caplog) == ("traceback" if failure is None else "one line")


def test_the_loaders_errors_share_one_root() -> None:
    for error in (CheckpointError, InsufficientMemoryError, HeadLoadError, DeviceUnavailableError):
        assert issubclass(error, ModelLoadError)
    # Still what they were, for callers that catch the builtin.
    assert issubclass(CheckpointError, ValueError) and issubclass(InsufficientMemoryError, MemoryError)


def test_out_of_memory_is_told_by_type_not_by_name() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(NamedLikeOutOfMemory("not torch's"))


def test_a_missing_cuda_device_is_a_load_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailableError, match="torch sees no CUDA device") as raised:
        resolve_device("cuda")
    assert classify_load_error(raised.value) is LoadFailure.UNLOADABLE
