"""benchmarks.gpu_check's plumbing, run on CPU (``--device cpu --smoke``): its numbers mean nothing, but
every check runs, the correctness checks decide the exit status, the report is written, and the negative
control (``--self-test``: one layer 10% wrong) makes the check fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[1]
CHECK_SH = ROOT / "benchmarks" / "device" / "check.sh"
# Two requests and a 5 s release step: every check and measurement still runs (first runs always do).
SMOKE_ARGUMENTS = ("--device", "cpu", "--smoke", "--requests", "2", "--release-budget-s", "5")


def run_gpu_check(*arguments: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.gpu_check ARGUMENTS`` from the repository root, its output captured."""
    command = [sys.executable, "-m", "benchmarks.gpu_check", *arguments]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def checks_by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["check"]: row for row in report["models"]["tiny"]["checks"]}


@pytest.fixture(scope="module")
def one_call(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """benchmarks/device/check.sh, the one device call, on CPU with this interpreter (nothing to carry): the
    import smoke, the check and its negative control."""
    out = tmp_path_factory.mktemp("device-call")
    wheels = tmp_path_factory.mktemp("wheels")
    done = subprocess.run(
        ["bash", str(CHECK_SH), str(out), str(wheels), *SMOKE_ARGUMENTS],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, "SELF_TEST_REQUESTS": "2"},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    return done, out


@pytest.mark.slow
def test_the_one_call_passes_the_check_and_fails_its_self_test(
    one_call: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, _ = one_call
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert "import smoke: {" in done.stdout and "'mcp': '" in done.stdout
    assert "gpu_check: exit 0 (must be 0); --self-test: exit 1 (must be 1)" in done.stdout


@pytest.mark.slow
def test_gpu_check_smoke_runs_on_cpu_checks_and_writes_its_report(
    one_call: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    out = one_call[1] / "gpu-check.json"
    report = json.loads(out.read_text())
    checks = checks_by_name(report)
    gating = {name: row["status"] for name, row in checks.items() if row["gating"]}
    assert all(status == "passed" for status in gating.values()) and report["passed"], gating
    # CPU against CPU fp32 (tiny is narrow: auto computes fp32): the hidden rows must be ~equal, and the
    # same with 256-token steps, cache miss and hit.
    for label in ("fused on", "256-token steps, cache miss", "256-token steps, cache hit"):
        assert checks[f"hidden rows vs CPU fp32 ({label})"]["value"]["max_rel_l2"] <= 1e-5
        assert checks[f"answers vs CPU fp32 ({label})"]["value"]["max_abs_dp"] <= 1e-5
    # The second pass really hit the state cache, and the long requests really ran in several steps.
    cache = checks["state cache: every request a miss, then a hit"]["value"]
    assert cache == {"first_misses": 4, "second_hits": 4, "requests": 4}
    steps = checks["requests over 256 tokens ran in several steps"]["value"]
    assert steps["long_requests"] >= 2 and max(steps["steps_of_each"]) >= 4
    # No fused kernels on CPU: the on/off comparison is n/a (neither passed nor gating), not run twice.
    on_off = checks["fused on vs off"]
    assert on_off["status"] == "n/a" and on_off["passed"] is None and not on_off["gating"]
    assert report["models"]["tiny"]["phases"]["device"]["fused_off"] is None
    # bf16-on-cuda is recorded off CUDA without deciding the verdict; so are the timing checks.
    assert not checks["computed bf16 on cuda"]["gating"]
    timing = [row for name, row in checks.items() if name.startswith(("burst gain", "first burst"))]
    assert len(timing) == 2 and not any(row["gating"] for row in timing)
    # The negative control ran inside the normal run, and a 10% wrong layer moved the rows past 3%.
    control = next(row for name, row in checks.items() if name.startswith("self-test: perturbed layer"))
    assert control["gating"] and control["status"] == "passed"
    assert control["value"]["max_rel_l2"] > gpu_check.HIDDEN_REL_L2["bf16"]
    bursts = report["models"]["tiny"]["phases"]["device"]["fused_on"]["bursts"]
    assert [b["concurrency"] for b in bursts] == [1, 16]
    assert all(b["tokens"] > 0 and b["tokens_per_s"] > 0 for b in bursts)
    markdown = out.with_suffix(".md").read_text()
    assert "PASSED" in markdown and "| tiny | hidden rows vs CPU fp32 (fused on) |" in markdown
    assert "| tiny | fused on vs off | no fused kernels here: on CPU |" in markdown
    assert markdown.split("| tiny | fused on vs off |")[1].splitlines()[0].endswith("| n/a |")
    # The release step ran on the smoke geometry, fused on only (n/a off CUDA), and fp8 is n/a on CPU.
    release = report["release"]
    assert list(release["runs"]) == ["fused_on"]
    run = release["runs"]["fused_on"]
    assert [b["concurrency"] for b in run["bursts"]] == [1, 2, 4, 8]
    assert run["state_hit"]["cache_statuses"]["hit"] == ["hit"]
    statuses = {row["check"]: row["status"] for row in release["checks"]}
    assert statuses["fp8 drift vs bf16 (release geometry)"] == "n/a"
    assert statuses["release geometry fused on vs off"] == "n/a"
    assert "| release geometry | value | threshold | passed |" in markdown and "| fused on | " in markdown


def test_fp8_step_measures_the_drift_of_converted_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp8 step on CPU (torch's CPU ``_scaled_mm`` runs e4m3 here; the device check is what the step
    asks of a GPU, patched): the late layers are converted in place, and the drift against the bf16
    answers is measured on the same random weights, so it is not zero and stays bounded."""
    from benchmarks.release_bench import SMOKE_PLAN
    from devtools.device_model import build_device_model

    from clef_runtime.model import fp8

    monkeypatch.setattr(fp8, "fp8_device_problem", lambda device: None)
    model = build_device_model(SMOKE_PLAN.geometry, device="cpu", dtype=torch.bfloat16, name="tiny")
    result = gpu_check.fp8_step(model, "cpu", smoke=True, budget_s=5.0)
    drift = result["drift"]
    assert drift["fp8_linears"] > 0 and drift["fp8_linears"] == fp8.fp8_linear_count(
        model.loaded.backbone.model
    )
    assert 0.0 < drift["max_rel_l2"] < 0.5, drift
    assert model.loaded.backbone.weight_mode.startswith("fp8 layers ")
    assert result["checks"][0]["status"] == "passed" and not result["checks"][0]["gating"]
    assert result["run"]["latency"][0]["p50_ms"] > 0


@pytest.mark.slow
def test_gpu_check_self_test_fails_on_the_hidden_rows(
    one_call: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    out = one_call[1] / "self-test.json"
    assert "the gates caught it" in (one_call[1] / "self-test.log").read_text()
    report = json.loads(out.read_text())
    checks = checks_by_name(report)
    assert not report["passed"]
    hidden = checks["hidden rows vs CPU fp32 (fused on)"]
    assert hidden["gating"] and hidden["status"] == "failed"
    assert hidden["value"]["max_rel_l2"] > gpu_check.HIDDEN_REL_L2["bf16"]
    assert checks["hidden rows vs CPU fp32 (256-token steps, cache hit)"]["status"] == "failed"
    assert "FAILED (--self-test" in out.with_suffix(".md").read_text()


def test_hidden_drift_is_relative_l2_per_request() -> None:
    reference = [torch.ones(2, 4), torch.full((3, 4), 2.0)]
    other = [torch.ones(2, 4) * 1.1, torch.full((3, 4), 2.0)]
    assert gpu_check.hidden_drift(reference, other) == {"max_rel_l2": 0.1, "median_rel_l2": 0.05}
    with pytest.raises(ValueError, match="shape"):
        gpu_check.hidden_drift([torch.ones(2, 4)], [torch.ones(3, 4)])


def test_perturbed_restores_the_exact_weights() -> None:
    from clef_runtime.engine.clef import Clef

    backbone = Clef.load("tiny", cache_mb=0).backbone
    weight = gpu_check.perturbed_weight(backbone)
    saved = weight.clone()
    with gpu_check.perturbed(backbone):
        assert torch.allclose(weight, saved * gpu_check.SELF_TEST_SCALE)
    assert torch.equal(weight, saved)


@pytest.mark.parametrize(
    ("arguments", "message"), [([], "usage:"), (["out", "/nonexistent/wheels"], "is not a folder")]
)
def test_the_one_call_refuses_bad_arguments_with_exit_2(
    tmp_path: Path, arguments: list[str], message: str
) -> None:
    done = subprocess.run(
        ["bash", str(CHECK_SH), *arguments], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_gpu_check_refuses_cuda_without_a_device(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")  # the refusal is what is tested, not the GPU run
    done = run_gpu_check("--json", str(tmp_path / "r.json"), timeout=300)
    assert done.returncode == 2 and "no CUDA device" in done.stderr
