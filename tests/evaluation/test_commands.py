"""``clef eval`` / ``calibrate`` / ``compare`` end to end on the tiny model: eval through a URL equals eval
in-process (within the wire's 4-decimal rounding), the report is self-contained, calibrate writes a file
that eval then applies, compare shows zero drift against itself and a small nonzero one against chunked
prefill (fp32 rounding of another summation order; bf16 storage is lossless on tiny, whose random weights
are bf16 values, so it cannot show drift here)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clef_runtime.cli import main
from clef_runtime.engine.calibration import Calibration
from clef_runtime.engine.clef import Clef
from clef_runtime.evaluation.cases import load_cases, parse_cases
from clef_runtime.evaluation.compare import parse_side
from clef_runtime.evaluation.runner import answer_in_process, answer_url
from clef_runtime.options import OptionsError

#: A wire probability is the unrounded one rounded to 4 decimals: at most half a step away.
WIRE_TOLERANCE = 0.5e-4 + 1e-9
#: Metrics from those probabilities move by at most a few steps of 1e-4 on this small set.
METRIC_TOLERANCE = 1e-3
METRIC_KEYS = ("n", "accuracy", "brier", "nll", "ece", "mce", "macro_f1", "mae")


def close_metrics(a: dict[str, float], b: dict[str, float], tolerance: float) -> None:
    for key in METRIC_KEYS:
        if key in a or key in b:
            assert a[key] == pytest.approx(b[key], abs=tolerance), key


@pytest.mark.slow
def test_url_answers_equal_in_process_answers(tiny: Clef, tiny_url: str, small_cases: Path) -> None:
    cases = load_cases(small_cases)
    local = answer_in_process(tiny, cases, batch_size=4)
    remote = answer_url(tiny_url, cases, concurrency=3)
    assert not local.failures and not remote.failures
    assert remote.source["rounded"] and not local.source["rounded"] and remote.source["model"] == "tiny"
    pairs = list(zip(local.outcomes, remote.outcomes, strict=True))
    assert len(pairs) == sum(len(c.request.questions) for c in cases)
    for a, b in pairs:
        assert (a.case_id, a.question_id, a.options, a.expected) == (
            b.case_id,
            b.question_id,
            b.options,
            b.expected,
        )
        np.testing.assert_allclose(a.probs, b.probs, rtol=0, atol=WIRE_TOLERANCE)
        assert np.array_equal(np.round(a.probs, 4), b.probs) or a.question_type == "noul"


@pytest.mark.slow
def test_cli_eval_url_matches_in_process_and_writes_a_report(
    tiny_url: str, small_cases: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    remote_json, local_json, report = tmp_path / "remote.json", tmp_path / "local.json", tmp_path / "report"
    assert main(["eval", str(small_cases), "--url", tiny_url, "--json", str(remote_json)]) == 0
    out = capsys.readouterr().out
    assert "rounds probabilities to 4 decimals" in out
    assert out.startswith("WARNING: UNTRAINED MODEL: tiny")  # the server says its model is untrained
    status = main(
        ["eval", str(small_cases), "--model", "tiny", "--json", str(local_json), "--report", str(report)]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert "unrounded" in out and out.startswith("WARNING: UNTRAINED MODEL: tiny")
    remote, local = json.loads(remote_json.read_text()), json.loads(local_json.read_text())
    assert set(local) >= {"overall", "by_type", "by_question", "latency_ms"}
    assert set(local["by_type"]) == {"noul", "choice", "score"}
    close_metrics(local["overall"], remote["overall"], METRIC_TOLERANCE)
    for kind in local["by_type"]:
        close_metrics(local["by_type"][kind], remote["by_type"][kind], METRIC_TOLERANCE)
    for qid in local["by_question"]:
        close_metrics(local["by_question"][qid], remote["by_question"][qid], METRIC_TOLERANCE)
    assert local["latency_ms"]["p50"] > 0 and local["latency_ms"]["p95"] >= local["latency_ms"]["p50"]
    assert local["source"]["untrained"] is True and remote["source"]["untrained"] is True
    page = (report / "report.html").read_text(encoding="utf-8")
    assert page.count('src="data:image/png;base64,') == 2
    assert 'class="untrained"' in page
    assert "http://" not in page and "https://" not in page and "<script" not in page
    for png in ("reliability.png", "coverage.png"):
        assert (report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_cli_calibrate_then_eval_with_the_calibration(
    small_cases: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "calibration.json"
    status = main(
        ["calibrate", str(small_cases), "--model", "tiny", "--out", str(out), "--holdout", str(small_cases)]
    )
    assert status == 0
    document = json.loads(out.read_text())
    calibration = Calibration.load(out)
    assert set(calibration.temperatures) == {"noul", "choice", "score"}
    assert document["fitted_on"]["cases"] == 6 and document["fitted_on"]["model"] == "tiny"
    assert document["nll_after"] <= document["nll_before"] + 1e-12
    # The holdout pass answers the same cases again, now resumed from the state cache: the same numbers up
    # to float rounding (seen: 1.7e-9 apart), not bit for bit.
    assert document["holdout"]["after"]["overall"]["nll"] == pytest.approx(document["nll_after"], abs=1e-6)
    assert document["holdout"]["nll_worse"] is False
    assert "warning" not in capsys.readouterr().err
    metrics = tmp_path / "calibrated.json"
    assert (
        main(["eval", str(small_cases), "--model", "tiny", "--calibration", str(out), "--json", str(metrics)])
        == 0
    )
    evaluated = json.loads(metrics.read_text())
    assert evaluated["source"]["calibration"] == calibration.label
    # the engine's calibration (served path) gives the NLL the fit reported
    assert evaluated["overall"]["nll"] == pytest.approx(document["nll_after"], abs=1e-6)
    assert (
        main(["calibrate", str(small_cases), "--calibration", str(out), "--out", str(tmp_path / "x.json")])
        == 2
    )


def test_cli_calibrate_warns_when_the_holdout_nll_gets_worse(
    tiny: Clef, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from clef_runtime.evaluation import commands

    monkeypatch.setattr(commands, "_engine_from_args", lambda command, args, options: tiny)
    question = {"urgent": {"type": "noul", "instructions": "Does this need a reply within the hour?"}}
    bodies = [
        {"state": f"ticket {i}: the export button does nothing, try {i}", "questions": question}
        for i in range(12)
    ]
    answered = answer_in_process(
        tiny, parse_cases([json.dumps(b | {"id": str(i)}) for i, b in enumerate(bodies)])
    )
    p_true = [a.outcomes[0].probs[0] for a in answered.answered]
    assert all(p != 0.5 for p in p_true)

    def case_file(name: str, agree: bool) -> Path:
        # Labels the model's leaning agrees with (the fit sharpens it), or the opposite ones.
        path = tmp_path / name
        lines = [
            json.dumps(body | {"expected": {"urgent": bool(p >= 0.5) == agree}})
            for body, p in zip(bodies, p_true, strict=True)
        ]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    fit, holdout, out = case_file("fit.jsonl", True), case_file("holdout.jsonl", False), tmp_path / "c.json"
    assert main(["calibrate", str(fit), "--holdout", str(holdout), "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["temperatures"]["noul"] < 1  # sharpened
    before = document["holdout"]["before"]["overall"]["nll"]
    after = document["holdout"]["after"]["overall"]["nll"]
    assert after > before and document["holdout"]["nll_worse"] is True
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1
    assert f"{before:.4f} -> {after:.4f}" in warnings[0] and str(holdout) in warnings[0]
    assert "worse" in warnings[0]


@pytest.mark.slow
def test_cli_compare_self_is_zero_and_chunked_prefill_drifts(
    small_cases: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    same = tmp_path / "same.json"
    spec = "model=tiny,weights=fp32,cache_mb=0"
    assert main(["compare", str(small_cases), "--a", spec, "--b", spec, "--json", str(same)]) == 0
    result = json.loads(same.read_text())
    assert result["max_abs_dp"] == 0.0 and result["mean_abs_dp"] == 0.0
    assert result["top1_agreement"] == 1.0 and result["flips"] == []
    assert result["questions"] == 16  # 2 x 3 + 2 x 2 + 2 x 3
    other = tmp_path / "chunked.json"
    chunked = spec + ",prefill_chunk=16"
    assert main(["compare", str(small_cases), "--a", spec, "--b", chunked, "--json", str(other)]) == 0
    drift = json.loads(other.read_text())
    assert 0.0 < drift["max_abs_dp"] < 1e-5
    assert 0.0 < drift["mean_abs_dp"] <= drift["max_abs_dp"]
    assert drift["b"]["options"]["prefill_chunk"] == 16 and drift["a"]["options"]["prefill_chunk"] is None
    for flip in drift["flips"]:
        assert flip["a"] != flip["b"] and flip["a_margin"] >= 0 and flip["b_margin"] >= 0
    assert "top-1 agreement" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_compare_url_against_in_process(tiny_url: str, small_cases: Path, tmp_path: Path) -> None:
    out = tmp_path / "url.json"
    assert main(["compare", str(small_cases), "--a", "model=tiny", "--b", tiny_url, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["rounded"] is True
    assert result["max_abs_dp"] <= WIRE_TOLERANCE


def test_eval_usage_errors(small_cases: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", str(small_cases), "--url", "http://127.0.0.1:9", "--model", "tiny"]) == 2
    assert "--url cannot be combined with --model" in capsys.readouterr().err
    assert main(["eval", str(small_cases), "--api-key", "k"]) == 2
    assert main(["eval", str(small_cases), "--url", "http://127.0.0.1:9"]) == 1
    assert "cannot reach" in capsys.readouterr().err
    assert main(["eval", str(small_cases), "--url", "ftp://host"]) == 1


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("model=tiny,colour=red", "unknown key 'colour'"),
        ("model=tiny,weights=fp4", "weights='fp4' (--weights)"),
        ("model=tiny,prefill_chunk=many", "prefill_chunk='many' (--prefill-chunk)"),
        ("model=tiny,prefill-chunk=0", "--prefill-chunk must be at least 1"),
        ("weights=fp32", "needs model=... or url=..."),
        ("url=http://x,model=tiny", "url= cannot be combined with model"),
        ("model=tiny,api_key=k", "api_key= goes with url="),
        ("model=tiny,weights", "is not KEY=VALUE"),
    ],
)
def test_compare_spec_errors_name_the_key(spec: str, needle: str) -> None:
    with pytest.raises(OptionsError, match="--b") as caught:
        parse_side(spec, "--b")
    assert needle in str(caught.value)


def test_compare_specs_parse() -> None:
    side = parse_side("model=tiny,weights=bf16-storage,prefill-chunk=64,cache_mb=0")
    assert side.model == "tiny" and side.options is not None
    assert (side.options.weights, side.options.prefill_chunk, side.options.cache_mb) == (
        "bf16-storage",
        64,
        0.0,
    )
    assert parse_side("http://127.0.0.1:8094").url == "http://127.0.0.1:8094"
    keyed = parse_side("url=https://clef.example/v1/systemone,api_key=secret")
    assert keyed.api_key == "secret" and "secret" not in json.dumps(keyed.describe())


def test_compare_bad_spec_exits_2(small_cases: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(small_cases), "--a", "model=tiny", "--b", "model=tiny,weights=fp4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--weights" in err[0]
