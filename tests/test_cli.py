"""The ``clef`` command's expected failures: one line on stderr and exit 2, never a traceback; the untrained
warning once; ``--help`` and ``encode`` without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

GOOD = {"state": "a ticket", "questions": {"q": {"type": "noul"}}}


def clef(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clef_runtime.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def assert_one_line_exit_2(done: subprocess.CompletedProcess[str], needle: str) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert needle in lines[0], lines[0]
    assert done.stdout == ""
    return lines[0]


@pytest.mark.parametrize("command", ["encode", "decide"])
def test_a_missing_input_file_is_one_line_and_exit_2(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    line = assert_one_line_exit_2(clef(command, str(missing)), f"cannot read {missing}")
    assert line.startswith(f"clef {command}: error:")  # and no untrained-model warning: nothing was loaded


def test_an_unreadable_or_non_utf8_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    assert_one_line_exit_2(clef("encode", str(tmp_path)), "cannot read")  # a directory
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    assert_one_line_exit_2(clef("encode", str(binary)), "not UTF-8")


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ('{"state": "\\ud800", "questions": {"q": {"type": "noul"}}}', "state:"),
        ('{"state": {"n": 1e400}, "questions": {"q": {"type": "noul"}}}', "state.n:"),
        ('{"state": {"n": NaN}, "questions": {"q": {"type": "noul"}}}', "malformed JSON"),
        ('{"model": "\\udfff", "state": "s", "questions": {"q": {"type": "noul"}}}', "model:"),
        ('{"state": [' + "9" * 5000 + '], "questions": {"q": {"type": "noul"}}}', "malformed JSON"),
    ],
)
@pytest.mark.slow  # each case loads the tokenizer in a new process
def test_clef_encode_names_the_bad_field(raw: str, field: str) -> None:
    line = assert_one_line_exit_2(clef("encode", "-", stdin=raw), field)
    assert line.startswith("invalid request:")


@pytest.mark.slow
def test_clef_decide_warns_once_and_names_a_bad_field(tmp_path: Path) -> None:
    request = tmp_path / "bad.json"
    request.write_text('{"state": {"note": "\\ud800"}, "questions": {"q": {"type": "noul"}}}')
    done = clef("decide", "--model", "tiny", str(request))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert sum("untrained" in line.lower() for line in lines) == 1, done.stderr
    assert lines[-1].startswith("invalid request: state.note: "), done.stderr

    done = clef("decide", "--model", "tiny", "-", stdin=json.dumps(GOOD))
    assert done.returncode == 0, done.stderr
    assert done.stderr.lower().count("untrained") == 1, done.stderr
    assert "q" in json.loads(done.stdout)["answers"]


TORCH_PROBE = """
import sys
from clef_runtime.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exc:
    status = exc.code
print("torch" in sys.modules, status, file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["--help"], ["encode", "--help"], ["encode", "-"]])
def test_help_and_encode_do_not_import_torch(args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", TORCH_PROBE, *args],
        input=json.dumps(GOOD),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.stderr.strip().splitlines()[-1] == "False 0", done.stderr
    if args == ["encode", "-"]:
        assert len(json.loads(done.stdout)["input_ids"]) > 0


@pytest.mark.slow  # imports torch in a fresh process
def test_make_tiny_into_an_unwritable_place_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    done = clef("make-tiny", str(blocker / "tiny"))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"clef make-tiny: error: cannot write {blocker / 'tiny'}")


@pytest.mark.parametrize(("command", "team_on_main"), [("serve", False), ("decide", True)])
def test_only_commands_that_compute_on_the_main_thread_start_a_thread_team_there(
    command: str, team_on_main: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # clef serve computes on its batcher thread: a team on the main thread too would slow it.
    import clef_runtime.model.kernels as kernels
    from clef_runtime import cli

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(kernels, "configure_cpu_threads", lambda *a, **k: calls.append(k) or 2)
    monkeypatch.setattr(cli, "_cmd_serve", lambda args: 0)
    monkeypatch.setattr(cli, "_cmd_decide", lambda args: 0)
    request = tmp_path / "r.json"
    request.write_text("{}")
    argv = ["serve", "--model", "tiny"] if command == "serve" else ["decide", str(request)]
    assert cli.main(argv) == 0
    assert calls == [{"start_pool": team_on_main}]
