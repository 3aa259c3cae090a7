"""``clef tune`` end to end on the tiny model: its defaults learn the keyword task (held-out accuracy from
chance to > 0.9), the report is complete and agrees with an independent scoring of the head it wrote,
``--calibrate`` writes a file the engine accepts, and bad usage exits 2 naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from clef_runtime.engine.calibration import Calibration
from clef_runtime.engine.clef import Clef
from clef_runtime.evaluation.cases import load_cases
from clef_runtime.evaluation.metrics import Outcome
from clef_runtime.model.head import JointSchemaHead, probabilities
from clef_runtime.tuning.arguments import DEFAULT_LR, TuneSettings
from clef_runtime.tuning.command import CALIBRATION_FILE, REPORT_FILE, separable_types
from clef_runtime.tuning.features import FeatureStore, model_fingerprint, row_key
from clef_runtime.tuning.rows import prepare_rows
from tests.tuning.conftest import CliRun, run_cli, tune_in_process
from tests.tuning.tasks import HOLDOUT_CASES, TRAIN_CASES, billing_cases, write_cases

DEFAULTS = TuneSettings()

#: An untrained head answers the keyword task at chance: at most this held-out accuracy.
CHANCE_BAND = 0.7


@pytest.mark.slow
def test_the_defaults_learn_the_keyword_task(default_run: CliRun) -> None:
    assert default_run.status == 0, default_run.stderr
    report = default_run.report
    settings = report["settings"]
    assert (settings["tier"], settings["lr"], settings["batch_size"]) == (
        DEFAULTS.tier,
        DEFAULT_LR[DEFAULTS.tier],
        DEFAULTS.batch_size,
    )
    assert report["epochs_run"] <= 30
    before, after = report["holdout"]["before"]["overall"], report["holdout"]["after"]["overall"]
    assert before["n"] == after["n"] == HOLDOUT_CASES
    assert before["accuracy"] <= CHANCE_BAND
    assert after["accuracy"] > 0.9
    assert after["nll"] < before["nll"]
    assert "holdout (60 questions)" in default_run.stdout and "McNemar p" in default_run.stdout


@pytest.mark.slow
def test_the_report_agrees_with_an_independent_scoring_of_the_written_head(
    default_run: CliRun, tiny: Clef, billing_files: tuple[Path, Path]
) -> None:
    report = default_run.report
    head = JointSchemaHead.from_files(default_run.out)
    store = FeatureStore(report["features"]["cache_dir"])
    cases = load_cases(billing_files[1])
    rows, _, problems = prepare_rows(tiny.prepare, cases, lambda p: row_key(model_fingerprint(tiny), p))
    assert not problems and len(rows) == len(cases)
    correct = 0
    for row, case in zip(rows, cases, strict=True):
        features = store.read(row.key, row.layout)
        assert features is not None
        (logits,) = head.score_batch([features.hidden], [features.layout], [features.lexical])
        (p,) = probabilities(logits, features.layout)
        correct += (bool(p[0] >= 0.5)) == case.expected["billing"]  # noul: option 0 is "true"
    assert correct / len(cases) == report["holdout"]["after"]["overall"]["accuracy"]


@pytest.mark.slow
def test_the_report_is_complete_and_consistent(default_run: CliRun) -> None:
    report = default_run.report
    assert set(report) >= {
        "version",
        "model",
        "settings",
        "trained_parameters",
        "cases",
        "features",
        "epochs_run",
        "best_epoch",
        "stopped_early",
        "curve",
        "holdout",
        "paired_tests",
        "calibration",
        "seconds",
    }
    assert report["model"] == "tiny" and report["calibration"] is None
    assert report["settings"]["loss"] == {
        "cross_entropy_weight": 1.0,
        "label_smoothing": DEFAULTS.label_smoothing,
        "brier_weight": DEFAULTS.brier_weight,
        "ordinal_weight": DEFAULTS.ordinal_weight,
    }
    assert report["settings"]["seed"] == 0
    cases = report["cases"]
    assert (cases["train_cases"], cases["holdout_cases"]) == (TRAIN_CASES, HOLDOUT_CASES)
    assert cases["holdout_source"] == "file" and cases["holdout_file"] == "holdout.jsonl"
    assert report["features"]["computed"] + report["features"]["cached"] == TRAIN_CASES + HOLDOUT_CASES
    curve = report["curve"]
    assert [point["epoch"] for point in curve] == list(range(report["epochs_run"] + 1))
    best = min(curve, key=lambda point: point["holdout_nll"])
    assert best["epoch"] == report["best_epoch"] > 0
    # The curve's NLL of the best epoch is the written head's holdout NLL (float32 logits vs float64 softmax).
    assert best["holdout_nll"] == pytest.approx(report["holdout"]["after"]["overall"]["nll"], abs=1e-4)
    assert curve[0]["holdout_nll"] == pytest.approx(report["holdout"]["before"]["overall"]["nll"], abs=1e-4)
    assert report["stopped_early"] == (report["epochs_run"] < DEFAULTS.epochs)
    tests = report["paired_tests"]
    assert tests["questions"] == HOLDOUT_CASES
    assert tests["accuracy"]["only_after"] > tests["accuracy"]["only_before"]
    assert tests["accuracy"]["p_value"] < 0.01
    nll = tests["nll"]
    assert nll["bootstrap"]["low"] <= nll["mean_difference"] <= nll["bootstrap"]["high"] < 0
    for p in (nll["sign"]["p_value"], nll["wilcoxon"]["p_value"], nll["bootstrap"]["p_value"]):
        assert 0 <= p < 0.05
    assert report["seconds"]["total"] >= report["seconds"]["training"] > 0
    assert len(report["trained_parameters"]) == len(JointSchemaHead.from_files(default_run.out).state_dict())


def test_calibrate_writes_a_calibration_the_engine_accepts(
    tiny: Clef, billing_files: tuple[Path, Path], tmp_path: Path
) -> None:
    train, holdout = billing_files
    out = tmp_path / "head"
    cache = tmp_path / "cache"
    flags = ("--tier", "scalars", "--epochs", "2")
    report = tune_in_process(tiny, train, out, *flags, holdout=holdout, cache_dir=cache, calibrate=True)
    calibration = Calibration.load(out / CALIBRATION_FILE)
    assert set(calibration.temperatures) == {"noul", "choice", "score"}
    assert calibration.temperatures["noul"] == report["calibration"]["temperatures"]["noul"]
    assert calibration.fitted_on["cases"] == HOLDOUT_CASES
    assert report["calibration"]["no_wrong_answer"] == []  # the scalars tier stays near chance here
    # A later run without --calibrate (--force: DIR holds a head) moves it away: it fits the earlier head.
    tune_in_process(tiny, train, out, *flags, holdout=holdout, cache_dir=cache, force=True)
    assert not (out / CALIBRATION_FILE).exists()
    assert (out / "previous" / CALIBRATION_FILE).is_file()
    assert (out / REPORT_FILE).is_file()


@pytest.mark.slow
def test_calibrate_warns_when_the_holdout_has_no_wrong_answer(
    default_run: CliRun,
    tiny: Clef,
    billing_files: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    train, _ = billing_files
    cache = Path(default_run.report["features"]["cache_dir"])
    capsys.readouterr()
    # The training cases held out as well: the epoch that fits them best answers every one of them right.
    report = tune_in_process(tiny, train, tmp_path / "head", holdout=train, cache_dir=cache, calibrate=True)
    assert report["features"]["computed"] == 0  # the default run's features, read back
    assert report["holdout"]["after"]["overall"]["accuracy"] == 1.0
    assert report["calibration"]["no_wrong_answer"] == ["noul"]
    assert report["calibration"]["temperatures"]["noul"] < 1  # it could only sharpen
    assert "answers every held-out noul question right" in capsys.readouterr().err


def test_separable_types_are_those_without_a_wrong_scored_answer() -> None:
    def outcome(kind: str, p_true: float, expected: int | None) -> Outcome:
        return Outcome("c", "q", kind, ("true", "false"), np.array([p_true, 1 - p_true]), expected)

    outcomes = [
        outcome("noul", 0.9, 0),
        outcome("noul", 0.2, 1),
        outcome("choice", 0.7, 0),
        outcome("choice", 0.7, 1),  # wrong: choice is not separable
        outcome("score", 0.1, None),  # unscored: says nothing
    ]
    assert separable_types(outcomes) == ["noul"]
    assert separable_types(outcomes[2:]) == []


def test_bad_case_lines_exit_2_listing_them(tmp_path: Path) -> None:
    path = tmp_path / "cases.jsonl"
    good = billing_cases(2, 0)
    path.write_text(
        json.dumps(good[0]) + "\n{not json\n" + json.dumps({**good[1], "expected": {"nope": True}}) + "\n",
        encoding="utf-8",
    )
    status, _, stderr = run_cli("tune", str(path), "--out", str(tmp_path / "out"))
    assert status == 2
    assert f"{path}:2: malformed JSON" in stderr
    assert f"{path}:3: expected.nope: no such question" in stderr
    assert "clef tune: error: 2 invalid line(s)" in stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--epochs", "0"), "--epochs must be at least 1"),
        (("--lr", "-1"), "--lr must be a positive number"),
        (("--holdout-fraction", "1.5"), "--holdout-fraction must be between 0 and 1"),
        (("--batch-size", "0"), "--batch-size must be at least 1"),
        (("--calibration", "x.json"), "drop --calibration"),
    ],
)
def test_bad_flags_exit_2(tmp_path: Path, flags: tuple[str, ...], message: str) -> None:
    cases = write_cases(tmp_path / "cases.jsonl", billing_cases(4, 0))
    status, _, stderr = run_cli("tune", str(cases), "--out", str(tmp_path / "out"), *flags)
    assert status == 2 and stderr.startswith("clef tune: error: ") and message in stderr


def test_unusable_inputs_exit_2(tmp_path: Path) -> None:
    cases = write_cases(tmp_path / "cases.jsonl", billing_cases(4, 0))
    a_file = tmp_path / "file"
    a_file.write_text("x", encoding="utf-8")
    status, _, stderr = run_cli("tune", str(cases), "--out", str(a_file))
    assert status == 2 and "--out" in stderr and "is a file" in stderr
    unlabelled = write_cases(
        tmp_path / "unlabelled.jsonl",
        [{k: v for k, v in c.items() if k != "expected"} for c in billing_cases(4, 0)],
    )
    status, _, stderr = run_cli("tune", str(unlabelled), "--out", str(tmp_path / "out"))
    assert status == 2 and "has an expected answer: nothing to learn" in stderr
    status, _, stderr = run_cli("tune", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "out"))
    assert status == 2 and "cannot read" in stderr
    status, _, stderr = run_cli(
        "tune", str(cases), "--out", str(tmp_path / "out"), "--holdout-fraction", "0.5", "--epochs", "x"
    )
    assert status == 2 and "--epochs" in stderr


def test_a_model_that_cannot_load_exits_1(tmp_path: Path) -> None:
    cases = write_cases(tmp_path / "cases.jsonl", billing_cases(4, 0))
    status, _, stderr = run_cli(
        "tune", str(cases), "--out", str(tmp_path / "out"), "--model", str(tmp_path / "no-such-model")
    )
    assert status == 1 and "clef tune: error: cannot load" in stderr


def test_a_split_without_enough_cases_exits_2(tiny: Clef, tmp_path: Path) -> None:
    from clef_runtime.tuning.command import TuneError

    one = write_cases(tmp_path / "one.jsonl", billing_cases(1, 0))
    with pytest.raises(TuneError, match="at least 2 cases") as caught:
        tune_in_process(tiny, one, tmp_path / "out")
    assert caught.value.status == 2


def test_cases_the_engine_refuses_are_listed(tiny: Clef, tmp_path: Path) -> None:
    from clef_runtime.tuning.command import TuneError

    cases = billing_cases(3, 0)
    cases[1]["images"] = ["data:image/png;base64,bm90IGFuIGltYWdl"]  # "not an image"
    path = write_cases(tmp_path / "cases.jsonl", cases)
    with pytest.raises(TuneError) as caught:
        tune_in_process(tiny, path, tmp_path / "out")
    assert caught.value.status == 2
    assert len(caught.value.lines) == 1 and caught.value.lines[0].startswith(f"{path}:2: case c-1: ")


def test_tensors_written_are_fp32(default_run: CliRun) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(default_run.out / "joint_head.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.float32}
