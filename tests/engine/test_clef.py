"""End to end on the tiny model: `Clef.load` -> `decide` / `decide_encoded`, and the `clef decide` CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clef_runtime import Clef
from clef_runtime.protocol.errors import RequestValidationError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE: dict[str, Any] = json.loads((ROOT / "examples" / "request.json").read_text())

REQUESTS: list[dict[str, Any]] = [
    EXAMPLE,
    {"state": "short", "questions": {"only": {"type": "noul", "criteria": {"false": "no way"}}}},
    {
        "model": "jev-latest",
        "state": {"log": ["error " * 40, {"code": 500}], "long": "x " * 300},
        "questions": {
            "sev": {"type": "score", "criteria": ["none", "low", "mid", "high", {"level": "critical"}]},
            "kind": {"type": "choice", "criteria": {f"k{i}": f"kind {i}" for i in range(7)}},
            "real": {"type": "noul", "instructions": {"ask": "is this a real incident?"}},
        },
    },
]


@pytest.fixture(scope="module")
def clef() -> Clef:
    return Clef.load("tiny")


def check_response(request: dict[str, Any], response: dict[str, Any], input_tokens: int) -> None:
    assert set(response) == {"model", "answers", "usage"}
    assert response["model"] == request.get("model", "tiny")
    assert response["usage"] == {"input_tokens": input_tokens, "output_tokens": 0}
    assert list(response["answers"]) == list(request["questions"])  # request order
    for qid, answer in response["answers"].items():
        question = request["questions"][qid]
        assert answer["type"] == question["type"]
        if question["type"] == "noul":
            assert set(answer) == {"type", "noul"}
            assert 0.0 <= answer["noul"] <= 1.0
            continue
        probs = answer["probabilities"]
        # Each rounded probability is off by at most 5e-5.
        assert abs(sum(probs.values()) - 1.0) <= 5e-5 * len(probs) + 1e-9
        assert answer["confidence"] == max(probs.values())
        if question["type"] == "choice":
            assert list(probs) == [str(k) for k in question["criteria"]]
            assert probs[answer["choice"]] == max(probs.values())
        else:
            assert list(probs) == [str(i) for i in range(len(question["criteria"]))]
            expected = sum(i * p for i, p in enumerate(probs.values()))
            assert math.isclose(answer["score"], expected, abs_tol=5e-5 * len(probs) ** 2)
            assert answer["legend"] == {str(i): c for i, c in enumerate(question["criteria"])}


@pytest.mark.parametrize("index", range(len(REQUESTS)))
def test_decide_shapes(clef: Clef, index: int) -> None:
    request = REQUESTS[index]
    response = clef.decide(request)
    check_response(request, response, clef.encode(request).input_tokens)


def test_tiny_is_described_as_untrained(clef: Clef) -> None:
    assert clef.untrained
    assert "untrained" in clef.description.lower()


def test_requests_do_not_affect_each_other(clef: Clef) -> None:
    alone = [clef.decide(r) for r in REQUESTS]
    # long, short, long again, in a row
    in_a_row = [clef.decide(REQUESTS[2]), clef.decide(REQUESTS[1]), clef.decide(REQUESTS[2])]
    assert in_a_row[0] == alone[2]
    assert in_a_row[1] == alone[1]
    assert in_a_row[2] == alone[2]


def flatten(response: dict[str, Any]) -> dict[str, float]:
    out = {}
    for qid, answer in response["answers"].items():
        if answer["type"] == "noul":
            out[qid] = answer["noul"]
        else:
            for k, p in answer["probabilities"].items():
                out[f"{qid}/{k}"] = p
    return out


def test_batch_equals_single(clef: Clef) -> None:
    items = [(clef.parse(r), clef.encode(r)) for r in REQUESTS]
    batched = clef.decide_encoded(items)
    assert clef.last_timings.batch_size == len(REQUESTS)
    for request, response in zip(REQUESTS, batched, strict=True):
        single = clef.decide(request)
        a, b = flatten(response), flatten(single)
        assert a.keys() == b.keys()
        # 1e-4 on the probabilities, plus one unit of the 4th decimal for rounding.
        assert max(abs(a[k] - b[k]) for k in a) <= 2e-4


def test_backbone_token_counter_counts_real_work(clef: Clef) -> None:
    before = clef.backbone_tokens
    clef.decide(REQUESTS[1])
    assert clef.backbone_tokens - before == clef.encode(REQUESTS[1]).input_tokens


def test_invalid_request_raises_validation_error(clef: Clef) -> None:
    with pytest.raises(RequestValidationError) as info:
        clef.decide({"state": "s", "questions": {"q": {"type": "choice", "criteria": ["a", "b"]}}})
    assert info.value.errors[0]["loc"] == ("questions", "q", "criteria")


def run_cli(*args: str, stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clef_runtime.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_cli_decide_and_jsonl(clef: Clef) -> None:
    done = run_cli("decide", "--model", "tiny", "-", stdin=json.dumps(REQUESTS[1]))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == clef.decide(REQUESTS[1])
    assert "untrained" in done.stderr

    lines = [json.dumps(REQUESTS[1]), '{"state": 3, "questions": {}}', json.dumps(REQUESTS[0])]
    done = run_cli("decide", "--model", "tiny", "--jsonl", stdin="\n".join(lines) + "\n")
    assert done.returncode == 2
    out = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(out) == 3
    assert out[0] == clef.decide(REQUESTS[1])
    assert out[1]["error"]["detail"][0]["loc"] == ["state"]
    assert out[2] == clef.decide(REQUESTS[0])


def test_cli_decide_invalid_exits_2_naming_the_field() -> None:
    bad = {"state": "s", "questions": {"q": {"type": "score", "criteria": {"0": "a"}}}}
    done = run_cli("decide", "--model", "tiny", "-", stdin=json.dumps(bad))
    assert done.returncode == 2
    assert "questions.q.criteria" in done.stderr.strip().splitlines()[-1]
