"""What ``clef tune`` does to ``--out``: a directory holding a head is refused before any model work unless
``--force``, which keeps the old head in ``DIR/previous/``; the summary says what an unchanged head is
unchanged from; Ctrl-C says what the feature cache kept and writes nothing to DIR; every file written is
mode 0644 whatever the umask."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from clef_runtime.engine.clef import Clef
from clef_runtime.release import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE
from clef_runtime.tuning import command
from clef_runtime.tuning.command import CALIBRATION_FILE, PREVIOUS_DIR, REPORT_FILE
from clef_runtime.tuning.report import text_summary
from tests.tuning.conftest import run_cli, tune_in_process
from tests.tuning.tasks import billing_cases, write_cases

#: A quick run: the cheapest tier for one epoch (what is tested here is what gets written, not learning).
QUICK = ("--tier", "scalars", "--epochs", "1")


@pytest.fixture()
def small_task(tmp_path: Path) -> tuple[Path, Path]:
    """(training file, holdout file): 12 and 4 cases of the keyword task."""
    return (
        write_cases(tmp_path / "train.jsonl", billing_cases(12, 11, "t")),
        write_cases(tmp_path / "holdout.jsonl", billing_cases(4, 12, "h")),
    )


@pytest.fixture()
def cli_on_tiny(tiny: Clef, monkeypatch: pytest.MonkeyPatch) -> Clef:
    """``clef tune`` in process answers with the session's tiny model instead of loading one."""
    monkeypatch.setattr(command, "_load_engine", lambda args, options: tiny)
    return tiny


def _modes(directory: Path) -> dict[str, int]:
    return {
        str(path.relative_to(directory)): stat.S_IMODE(path.stat().st_mode)
        for path in directory.rglob("*")
        if path.is_file()
    }


@pytest.mark.parametrize("name", [HEAD_WEIGHTS_FILE, HEAD_CONFIG_FILE, CALIBRATION_FILE])
def test_an_out_holding_a_head_is_refused_before_the_model_loads(
    name: str, small_task: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_load(args: Any, options: Any) -> Clef:
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(command, "_load_engine", no_load)
    out = tmp_path / "head"
    out.mkdir()
    (out / name).write_text("earlier work", encoding="utf-8")
    status, stdout, stderr = run_cli("tune", str(small_task[0]), "--out", str(out))
    assert status == 2 and stdout == ""
    assert stderr.count("\n") == 1
    assert stderr.startswith(f"clef tune: error: --out {out} already holds a head")
    assert "--force" in stderr and "another directory" in stderr
    assert sorted(p.name for p in out.iterdir()) == [name]
    assert (out / name).read_text(encoding="utf-8") == "earlier work"


def test_force_moves_the_previous_head_to_previous(
    cli_on_tiny: Clef, small_task: tuple[Path, Path], tmp_path: Path
) -> None:
    train, holdout = small_task
    out, cache = tmp_path / "head", tmp_path / "cache"
    first = ("tune", str(train), "--holdout", str(holdout), "--out", str(out), "--cache-dir", str(cache))
    first += QUICK
    assert run_cli(*first, "--calibrate")[0] == 0
    earlier = {name: (out / name).read_bytes() for name in command.PREVIOUS_FILES}
    (out / PREVIOUS_DIR).mkdir()
    (out / PREVIOUS_DIR / "older.txt").write_text("an older generation", encoding="utf-8")

    status, stdout, stderr = run_cli(*first, "--force")
    assert status == 0, stderr
    previous = out / PREVIOUS_DIR
    # The head, its calibration and report, byte for byte; the older generation is replaced.
    assert {p.name: p.read_bytes() for p in previous.iterdir()} == earlier
    assert not (out / CALIBRATION_FILE).exists()  # it belonged to the earlier head
    assert (out / HEAD_WEIGHTS_FILE).is_file() and (out / REPORT_FILE).is_file()
    assert f"moved the head {out} held (with its calibration and report) to {previous}/" in stdout
    assert json.loads((out / REPORT_FILE).read_text(encoding="utf-8"))["previous_head"] == str(previous)


def test_tuning_the_head_of_out_in_place_names_it_as_the_starting_head(
    small_task: tuple[Path, Path], tmp_path: Path
) -> None:
    train, holdout = small_task
    out = tmp_path / "head"
    base = ("tune", str(train), "--holdout", str(holdout), "--cache-dir", str(tmp_path / "cache"), *QUICK)
    assert run_cli(*base, "--out", str(out), "--dtype", "fp32")[0] == 0
    status, _, stderr = run_cli(*base, "--out", str(out), "--head", str(out), "--dtype", "fp32", "--force")
    assert status == 0, stderr
    report = json.loads((out / REPORT_FILE).read_text(encoding="utf-8"))
    assert report["starting_head"] == str(out)
    assert (out / PREVIOUS_DIR / HEAD_WEIGHTS_FILE).is_file()


def test_an_unchanged_head_says_what_it_is_unchanged_from(tiny: Clef, small_task: tuple[Path, Path]) -> None:
    train, holdout = small_task
    out = small_task[0].parent / "head"
    report = tune_in_process(tiny, train, out, *QUICK, holdout=holdout)
    assert report["starting_head"] is None  # the release's own head
    unchanged = {**report, "best_epoch": 0}
    assert (
        "note: no epoch beat the starting head (the release head of tiny) on the holdout NLL: the head "
        "written is the starting head, unchanged" in text_summary(unchanged, str(out))
    )
    in_dir = text_summary({**unchanged, "starting_head": "tuned/billing"}, str(out))
    assert "no epoch beat the starting head (the head in tuned/billing)" in in_dir


def _interrupt_after(calls: int, real: Callable[..., Any]) -> Callable[..., Any]:
    """``real`` for ``calls`` calls, then Ctrl-C."""
    count = 0

    def hidden_rows(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        count += 1
        if count > calls:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    return hidden_rows


def test_ctrl_c_during_the_feature_pass_says_what_is_kept_and_writes_nothing(
    cli_on_tiny: Clef, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cases = write_cases(tmp_path / "cases.jsonl", billing_cases(24, 13, "i"))
    out, cache = tmp_path / "head", tmp_path / "cache"
    monkeypatch.setattr(cli_on_tiny, "hidden_rows", _interrupt_after(1, cli_on_tiny.hidden_rows))
    status, stdout, stderr = run_cli(
        "tune", str(cases), "--out", str(out), "--cache-dir", str(cache), "--feature-batch-size", "8"
    )
    assert status == 130 and stdout == "" and "Traceback" not in stderr
    assert stderr == (
        f"clef tune: interrupted: 8 of 24 rows' features are cached in {cache}; no head, report or "
        f"calibration was written to --out {out}; run the same command again to continue\n"
    )
    assert not out.exists()
    assert len([p for p in cache.rglob("*.safetensors")]) == 8


@pytest.fixture()
def strict_umask() -> Iterator[None]:
    """A umask that would leave new files readable by their owner only."""
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


def test_every_file_written_is_0644_whatever_the_umask(
    tiny: Clef, small_task: tuple[Path, Path], strict_umask: None
) -> None:
    train, holdout = small_task
    out = small_task[0].parent / "head"
    tune_in_process(tiny, train, out, *QUICK, holdout=holdout, calibrate=True)  # features in DIR/features
    modes = _modes(out)
    assert {HEAD_WEIGHTS_FILE, HEAD_CONFIG_FILE, CALIBRATION_FILE, REPORT_FILE} <= set(modes)
    assert any(name.startswith("features/") for name in modes)
    assert {name: oct(mode) for name, mode in modes.items() if mode != 0o644} == {}
