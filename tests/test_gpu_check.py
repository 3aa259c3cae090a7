"""benchmarks/gpu_check.py's plumbing, run on CPU (``--device cpu --quick``): its numbers mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_on_cpu_and_writes_its_report(tmp_path: Path) -> None:
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    done = subprocess.run(
        [sys.executable, script, "--device", "cpu", "--quick", "--requests", "2", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    tiny = report["models"]["tiny"]
    for key in ("fused_on", "fused_off"):
        run = tiny[key]
        # CPU against CPU fp32: the same computation, so the parity plumbing must report (near) zero.
        assert run["parity_vs_cpu_fp32"]["max_abs_dp"] <= 1e-5
        assert [t["concurrency"] for t in run["throughput"]] == [1, 4]
        assert all(t["tokens"] > 0 and t["tokens_per_s"] > 0 for t in run["throughput"])
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "| tiny | on |" in markdown and "| tiny | off |" in markdown


def test_gpu_check_refuses_cuda_without_a_device(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")  # the refusal is what is tested, not the GPU run
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 2 and "no CUDA device" in done.stderr
