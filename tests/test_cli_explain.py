"""``clef decide --explain``: the flags set every request's ``x_explain`` (bad values are one line naming the
flag, exit 2, before any model loads), stdout stays the JSON responses, and the answers' evidence is printed
to stderr one span a line (`evidence_lines`, tested on a made-up body; the real evidence is the engine's)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from clef_runtime import cli
from clef_runtime.cli import evidence_lines
from tests.helpers import MINIMAL_REQUEST, run_cli
from tests.test_cli import assert_one_line_exit_2

BODY: dict[str, Any] = {
    "model": "m",
    "answers": {
        "refund": {
            "type": "noul",
            "noul": 0.9,
            "x_evidence": [
                {"text": "refund", "start": 30, "end": 36, "weight": 0.4123, "path": "/ticket/body"},
                {"text": "twice", "start": 20, "end": 25, "weight": -0.05},
            ],
        },
        "photo": {
            "type": "noul",
            "noul": 0.2,
            "x_evidence": [{"image": 0, "box": [0, 16, 32, 48], "weight": 0.25}],
        },
        "plain": {"type": "noul", "noul": 0.5},
    },
}


def test_evidence_lines_are_one_per_span_with_rank_weight_text_offsets_and_path() -> None:
    assert evidence_lines(BODY) == [
        'refund #1 +0.4123 "refund" [30:36] /ticket/body',
        'refund #2 -0.0500 "twice" [20:25]',
        "photo #1 +0.2500 image 0 box [0, 16, 32, 48]",
    ]
    assert evidence_lines({"answers": {"q": {"type": "noul", "noul": 0.5}}}) == []


class _Engine:
    """Stands in for the loaded model: records each request and ``explain``, answers ``BODY``."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []

    def decide(self, request: Any, *, explain: Any = None) -> dict[str, Any]:
        self.calls.append((request, explain))
        return BODY


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> _Engine:
    stand_in = _Engine()
    monkeypatch.setattr(cli, "_load_clef", lambda args: stand_in)
    return stand_in


@pytest.mark.parametrize(
    ("flags", "explain"),
    [
        (["--explain"], {}),
        (["--explain-top-k", "3"], {"top_k": 3}),
        (
            ["--explain", "--explain-granularity", "field", "--explain-top-k", "20"],
            {"top_k": 20, "granularity": "field"},
        ),
    ],
)
def test_the_flags_explain_every_request_and_print_the_spans_to_stderr(
    engine: _Engine, flags: list[str], explain: dict[str, Any]
) -> None:
    lines = [json.dumps(MINIMAL_REQUEST)] * 2
    done = run_cli("decide", "--jsonl", *flags, stdin="\n".join(lines) + "\n")
    assert done.returncode == 0, done.stderr
    assert [call[1] for call in engine.calls] == [explain, explain]
    assert [json.loads(line) for line in done.stdout.splitlines()] == [BODY, BODY]
    assert done.stderr.splitlines() == evidence_lines(BODY) * 2


def test_without_the_flags_nothing_is_explained_or_printed_to_stderr(engine: _Engine) -> None:
    done = run_cli("decide", stdin=json.dumps(MINIMAL_REQUEST))
    assert done.returncode == 0, done.stderr
    assert engine.calls == [(MINIMAL_REQUEST, None)]
    assert done.stderr == "" and json.loads(done.stdout) == BODY


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--explain-top-k", "0"], "--explain-top-k: top_k must be at least 1"),
        (["--explain", "--explain-top-k", "21"], "--explain-top-k: top_k must be at most 20"),
        (["--explain-top-k", "many"], "--explain-top-k"),
        (["--explain-granularity", "line"], "--explain-granularity"),
    ],
)
def test_a_bad_explain_flag_is_one_line_naming_it_before_the_model_loads(
    engine: _Engine, flags: list[str], needle: str
) -> None:
    assert_one_line_exit_2(run_cli("decide", *flags, stdin=json.dumps(MINIMAL_REQUEST)), needle)
    assert engine.calls == []


def test_the_real_model_prints_the_evidence_it_answers_with_and_takes_the_method() -> None:
    request = {"state": "Charged twice, please refund.", "questions": {"refund": {"type": "noul"}}}
    done = run_cli(
        "decide",
        "--model",
        "tiny",
        "--explain-top-k",
        "2",
        "--explain-method",
        "attention",
        stdin=json.dumps(request),
    )
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["x_explain"]["method"] == "attention"
    spans = body["answers"]["refund"]["x_evidence"]
    assert len(spans) == 2
    assert all(request["state"][span["start"] : span["end"]] == span["text"] for span in spans)
    assert done.stderr.splitlines()[-2:] == evidence_lines(body)


def test_a_bad_explain_method_is_one_line_naming_the_flag(engine: _Engine) -> None:
    done = run_cli("decide", "--explain-method", "saliency", stdin=json.dumps(MINIMAL_REQUEST))
    assert_one_line_exit_2(done, "--explain-method")
    assert engine.calls == []
