"""The files ``--calibration`` and ``--head`` name are read and checked once before ``clef serve`` listens,
and what was read goes on to ``Clef.load``, which reads neither again."""

from __future__ import annotations

import argparse
import json
import socket
from collections import Counter
from pathlib import Path
from typing import Any, cast

import pytest

from clef_runtime import serve_command
from clef_runtime.engine import heads
from clef_runtime.engine.calibration import Calibration
from clef_runtime.engine.clef import Clef
from clef_runtime.engine.preflight import check_engine_files
from clef_runtime.options import EngineOptions, OptionsError
from clef_runtime.server.runtime import load_clef
from clef_runtime.server.settings import ServerSettings
from tests.engine.head_dirs import write_tuned_head

CALIBRATION = {"version": 1, "temperatures": {"noul": 0.5, "choice": 2.5, "score": 1.7}, "questions": {}}


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Counter[Path]:
    """Every read of a calibration file and every check of a head directory, by path."""
    counted: Counter[Path] = Counter()
    read_calibration = Calibration.load.__func__  # type: ignore[attr-defined]
    check_head_dir = heads.check_head_dir

    def load(cls: type[Calibration], path: str | Path) -> Calibration:
        counted[Path(path)] += 1
        return read_calibration(cls, path)  # type: ignore[no-any-return]

    def check(path: Path) -> None:
        counted[Path(path)] += 1
        check_head_dir(path)

    monkeypatch.setattr(Calibration, "load", classmethod(load))
    monkeypatch.setattr(heads, "check_head_dir", check)
    return counted


def test_clef_serve_reads_the_files_once_before_listening_and_the_load_reads_them_no_more(
    tiny: Clef, tmp_path: Path, reads: Counter[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps(CALIBRATION), encoding="utf-8")
    head = write_tuned_head(tiny.path, tmp_path / "tuned", seed=3)
    served: list[tuple[ServerSettings, Any, socket.socket]] = []

    def serve(settings: ServerSettings, *, engine_factory: Any = None, sock: socket.socket) -> int:
        served.append((settings, engine_factory, sock))
        return 0

    monkeypatch.setattr(serve_command, "serve", serve)
    parser = argparse.ArgumentParser()
    serve_command.add_serve_arguments(parser)
    flags = ["--model", "tiny", "--port", "0", "--calibration", str(calibration), "--head", f"tuned={head}"]
    assert serve_command.run_serve(parser.parse_args(flags), environ={}) == 0
    (settings, engine_factory, sock) = served[0]
    sock.close()
    assert reads == {calibration: 1, head: 1}

    engine = cast(Clef, (engine_factory or load_clef)(settings))  # without one: the server's default
    # The head directory is read once more as the head loads, the calibration file not again.
    assert reads == {calibration: 1, head: 2}
    assert engine.calibration is not None and engine.calibration.temperatures["choice"] == 2.5
    assert "tuned" in {served_head.name for served_head in engine.heads.served()}


def test_files_checked_for_other_options_are_refused(tmp_path: Path) -> None:
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps(CALIBRATION), encoding="utf-8")
    files = check_engine_files(EngineOptions(calibration=str(calibration)))
    with pytest.raises(ValueError, match="other --calibration / --head values"):
        Clef.load("tiny", EngineOptions(), checked_files=files)


def test_a_bad_file_is_an_options_error_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(OptionsError, match=r"--head tuned=.*: not a directory"):
        check_engine_files(EngineOptions(head=(f"tuned={tmp_path / 'missing'}",)))
