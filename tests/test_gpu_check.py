"""benchmarks.gpu_check's plumbing, run on CPU (``--device cpu --smoke``): its numbers mean nothing, but
every check runs, the correctness checks decide the exit status, and the report is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_gpu_check(*arguments: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.gpu_check ARGUMENTS`` from the repository root, its output captured."""
    command = [sys.executable, "-m", "benchmarks.gpu_check", *arguments]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_gpu_check_smoke_runs_on_cpu_checks_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    done = run_gpu_check("--device", "cpu", "--smoke", "--requests", "2", "--json", str(out), timeout=600)
    report = json.loads(out.read_text())
    checks = report["models"]["tiny"]["checks"]
    gating = {row["check"]: row["passed"] for row in checks if row["gating"]}
    # CPU against CPU fp32 (tiny is narrow: auto computes fp32): the parity plumbing must report ~0.
    assert checks[0]["check"].startswith("parity") and checks[0]["value"]["max_abs_dp"] <= 1e-5
    assert all(gating.values()) and report["passed"], gating
    assert done.returncode == 0, done.stderr[-2000:]
    # The timing checks ran too, and off CUDA they are recorded without deciding the verdict.
    timing = [row for row in checks if row["check"].startswith(("burst gain", "first burst"))]
    assert len(timing) == 4 and not any(row["gating"] for row in timing)
    for key in ("fused_on", "fused_off"):
        bursts = report["models"]["tiny"][key]["bursts"]
        assert [b["concurrency"] for b in bursts] == [1, 16]
        assert all(b["tokens"] > 0 and b["tokens_per_s"] > 0 for b in bursts)
    markdown = out.with_suffix(".md").read_text()
    assert "PASSED" in markdown and "| tiny | parity vs CPU fp32 (fused on) |" in markdown


def test_gpu_check_refuses_cuda_without_a_device(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")  # the refusal is what is tested, not the GPU run
    done = run_gpu_check("--json", str(tmp_path / "r.json"), timeout=300)
    assert done.returncode == 2 and "no CUDA device" in done.stderr
