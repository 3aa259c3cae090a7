"""``clef eval --head DIR`` and ``clef compare`` sides with ``head=``: a tuned head is measured and compared
like any model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clef_runtime.cli import main
from clef_runtime.engine.clef import Clef
from clef_runtime.evaluation.cases import load_cases
from clef_runtime.evaluation.compare import parse_side
from clef_runtime.evaluation.metrics import summarize
from clef_runtime.evaluation.runner import answer_in_process
from tests.engine.head_dirs import write_tuned_head


@pytest.fixture(scope="module")
def head_dir(tiny: Clef, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tuned_head(tiny.path, tmp_path_factory.mktemp("head") / "tuned", seed=11)


def test_eval_with_a_head_measures_that_head(small_cases: Path, head_dir: Path, tmp_path: Path) -> None:
    tuned_json, release_json = tmp_path / "tuned.json", tmp_path / "release.json"
    common = [str(small_cases), "--model", "tiny", "--dtype", "fp32"]
    assert main(["eval", *common, "--head", str(head_dir), "--json", str(tuned_json)]) == 0
    assert main(["eval", *common, "--json", str(release_json)]) == 0
    tuned, release = json.loads(tuned_json.read_text()), json.loads(release_json.read_text())
    # The same metrics as scoring the cases with an engine that serves that head.
    engine = Clef.load("tiny", dtype="fp32", head=str(head_dir))
    expected = answer_in_process(engine, load_cases(small_cases), batch_size=8)
    assert tuned["overall"]["nll"] == pytest.approx(summarize(expected.outcomes)["overall"]["nll"], abs=1e-9)
    assert tuned["overall"]["nll"] != pytest.approx(release["overall"]["nll"], abs=1e-6)


def test_compare_takes_a_head_on_either_side(small_cases: Path, head_dir: Path, tmp_path: Path) -> None:
    side = parse_side(f"model=tiny,head={head_dir}", "--b")
    assert side.options is not None and side.options.head == (str(head_dir),)
    drift_json, same_json = tmp_path / "drift.json", tmp_path / "same.json"
    tuned = f"model=tiny,dtype=fp32,head={head_dir}"
    assert (
        main(
            [
                "compare",
                str(small_cases),
                "--a",
                "model=tiny,dtype=fp32",
                "--b",
                tuned,
                "--json",
                str(drift_json),
            ]
        )
        == 0
    )
    assert json.loads(drift_json.read_text())["max_abs_dp"] > 1e-3
    assert main(["compare", str(small_cases), "--a", tuned, "--b", tuned, "--json", str(same_json)]) == 0
    assert json.loads(same_json.read_text())["max_abs_dp"] == 0.0


def test_calibrate_refuses_a_head_that_carries_its_own_calibration(
    small_cases: Path, head_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calibrated = tmp_path / "calibrated"
    calibrated.mkdir()
    for item in head_dir.iterdir():
        (calibrated / item.name).write_bytes(item.read_bytes())
    common = ["calibrate", str(small_cases), "--model", "tiny", "--out", str(tmp_path / "out.json")]
    # Without its own calibration the head is fitted like the release head ...
    assert main([*common, "--head", str(calibrated)]) == 0
    # ... with one, the engine would apply it while fitting: refused before the model loads.
    (calibrated / "calibration.json").write_text((tmp_path / "out.json").read_text())
    capsys.readouterr()
    assert main([*common, "--head", str(calibrated)]) == 2
    assert "carries its own calibration.json" in capsys.readouterr().err
