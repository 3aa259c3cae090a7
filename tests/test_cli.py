"""The ``clef`` command: expected failures are one line on stderr and exit 2, never a traceback (an unknown
flag names itself); the untrained warning once; ``--help`` and ``encode`` without torch; ``encode`` of an
image request equals the engine's preparation; ``--jsonl`` answers every input line; every flag has help."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from clef_runtime.cli import build_parser
from clef_runtime.encoding.special_tokens import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID
from clef_runtime.engine.clef import Clef
from clef_runtime.engine.preparer import RequestPreparer
from tests.helpers import MINIMAL_REQUEST as GOOD
from tests.helpers import CliRun, png_data_url, run_cli
from tests.helpers import run_cli_process as clef


def assert_one_line_exit_2(done: subprocess.CompletedProcess[str] | CliRun, needle: str) -> str:
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


# --- clef encode with images: the engine's preparation, in every image mode ---------------------------------

IMAGE_REQUEST = {
    "state": "what is in the picture?",
    "images": [png_data_url(320, 256, 7)],
    "questions": GOOD["questions"],
}
#: Image pads per mode for the 320x256 image: g256 and g448 are fixed tiles (8x8, 14x14 merged tokens);
#: native keeps the size (multiples of 32 within the processor's pixel bounds): (320/32) * (256/32).
PADS = {"native": 10 * 8, "g256": 64, "g448": 196}


@pytest.mark.parametrize("mode", sorted(PADS))
def test_encode_with_an_image_is_what_the_engine_prepares(tiny: Clef, mode: str, tmp_path: Path) -> None:
    preparer = RequestPreparer(tiny.encoder, replace(tiny.image_settings, mode=mode))
    expected = preparer.prepare(IMAGE_REQUEST).record
    request = tmp_path / "image.json"
    request.write_text(json.dumps(IMAGE_REQUEST))
    # the tiny checkpoint as the tokenizer directory (its tokenizer.json and processor_config.json), and
    # the built-in tokenizer with the stock processor settings, which are the tiny checkpoint's
    for tokenizer in (["--tokenizer", str(tiny.path)], []):
        done = run_cli("encode", "--image-mode", mode, *tokenizer, str(request))
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
        assert got == expected.to_json()
        ids = got["input_ids"]
        assert ids.count(IMAGE_PAD_ID) == PADS[mode]
        assert ids.count(VISION_START_ID) == 1 and ids.count(VISION_END_ID) == 1
    text_only = json.loads(run_cli("encode", "-", stdin=json.dumps({**IMAGE_REQUEST, "images": []})).stdout)
    # the image block: <|vision_start|>, the pads, <|vision_end|> and the newline after it
    assert len(got["input_ids"]) - len(text_only["input_ids"]) == PADS[mode] + 3


def test_encode_jsonl_mixes_image_and_text_requests(tiny: Clef) -> None:
    lines = [json.dumps(GOOD), json.dumps(IMAGE_REQUEST), json.dumps({**IMAGE_REQUEST, "images": ["x"]})]
    done = run_cli("encode", "--jsonl", "--image-mode", "g256", stdin="\n".join(lines) + "\n")
    assert done.returncode == 2
    text, image, bad = (json.loads(line) for line in done.stdout.splitlines())
    assert text == tiny.encoder.encode(GOOD).to_json()
    assert image["input_ids"].count(IMAGE_PAD_ID) == 64
    assert bad["line"] == 3 and bad["error"]["detail"][0]["loc"] == ["images", 0]


def test_encode_refuses_an_independent_request_with_images_in_one_line() -> None:
    # The engine splits it into one request per question: not one record that `clef encode` could print.
    request = {
        **IMAGE_REQUEST,
        "questions": {"a": {"type": "noul"}, "b": {"type": "noul"}},
        "x_independent": True,
    }
    done = run_cli("encode", "--image-mode", "g256", "-", stdin=json.dumps(request))
    assert_one_line_exit_2(done, "x_independent")


def test_encode_with_a_tokenizer_directory_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    request = tmp_path / "r.json"
    request.write_text(json.dumps(GOOD))
    line = assert_one_line_exit_2(
        run_cli("encode", "--tokenizer", str(tmp_path), str(request)), "tokenizer.json"
    )
    assert line.startswith("clef encode: error:") and str(tmp_path) in line


# --- usage errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "prog", "suggestion"),
    [
        (["decide", "--weigths", "fp32"], "clef decide", "--weights"),
        (["encode", "--max-lenght", "9"], "clef encode", "--max-length"),
        (["eval", "--concurrencey", "2"], "clef eval", "--concurrency"),
        (["jobs", "status", "job_x", "--jsn"], "clef jobs status", "--json"),
        (["decide", "--colour", "red"], "clef decide", None),
    ],
)
def test_an_unknown_flag_is_a_usage_error_naming_it(
    argv: list[str], prog: str, suggestion: str | None, tmp_path: Path
) -> None:
    request = tmp_path / "r.json"
    request.write_text(json.dumps(GOOD))
    flag = next(a for a in argv if a.startswith("--"))
    # The typo'd flag's value must not be taken as the input file (nor the file reported as unknown).
    line = assert_one_line_exit_2(run_cli(*argv, str(request)), f"unknown flag {flag}")
    assert line.startswith(f"{prog}: error:"), line
    assert str(request) not in line
    if suggestion:
        assert f"did you mean {suggestion}?" in line
    else:
        assert "did you mean" not in line


def test_an_extra_argument_is_a_usage_error(tmp_path: Path) -> None:
    line = assert_one_line_exit_2(run_cli("encode", "a.json", "b.json"), "unexpected argument 'b.json'")
    assert line.startswith("clef encode: error:")


def all_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from all_parsers(sub)


def test_every_flag_and_subcommand_has_a_help_text() -> None:
    missing = []
    for parser in all_parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{parser.prog} {c.dest}" for c in action._choices_actions if not c.help]
            elif not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []


@pytest.mark.parametrize("command", ["encode", "decide"])
def test_the_input_argument_says_stdin_is_the_default(command: str) -> None:
    done = run_cli(command, "--help")
    assert done.returncode == 0
    assert "FILE|-" in done.stdout and "stdin (the default)" in done.stdout


# --- --jsonl: output line N answers input line N ------------------------------------------------------------


def test_encode_jsonl_answers_every_line_and_numbers_the_errors(tiny: Clef) -> None:
    lines = [json.dumps(GOOD), "", '{"state": 3, "questions": {}}', "   ", json.dumps(GOOD), "{oops"]
    done = run_cli("encode", "--jsonl", stdin="\n".join(lines) + "\n")
    assert done.returncode == 2, done.stderr
    out = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(out) == len(lines)
    assert out[0] == out[4] == tiny.encoder.encode(GOOD).to_json()
    errors = {number: item for number, item in enumerate(out, start=1) if "error" in item}
    assert sorted(errors) == [2, 3, 4, 6]
    assert all(item["line"] == number for number, item in errors.items())
    assert errors[2]["error"]["detail"][0]["type"] == "blank_line"
    assert "blank" in errors[4]["error"]["detail"][0]["msg"]
    assert errors[3]["error"]["detail"][0]["loc"] == ["state"]
    assert errors[6]["error"]["detail"][0]["type"] == "json_invalid"


def test_decide_jsonl_answers_every_line_and_numbers_the_errors(
    tiny: Clef, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clef_runtime import cli

    monkeypatch.setattr(cli, "_load_clef", lambda args: tiny)  # the session's model, not a second load
    lines = ["", json.dumps(GOOD), '{"state": "s"}', "", json.dumps(GOOD)]
    done = run_cli("decide", "--jsonl", stdin="\n".join(lines) + "\n")
    assert done.returncode == 2, done.stderr
    out = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(out) == len(lines)
    assert [item.get("line") for item in out] == [1, None, 3, 4, None]
    assert out[1]["answers"]["q"]["type"] == "noul" and out[4]["answers"]["q"]["type"] == "noul"
    assert out[2]["error"]["detail"][0]["loc"] == ["questions"]
