"""The fused-kernel switch: transformers' Qwen3.5 DeltaNet functions swapped to the reference and back, their
calls counted; transformers' advice to install the CUDA-only fused packages, dropped on CPU and kept on an
accelerator; and our own warning, once, when a CUDA load runs without them."""

from __future__ import annotations

import inspect
import json
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from clef_runtime.model import fused
from clef_runtime.model.fused import (
    FALLBACK_LOGGER,
    FUSED_FUNCTIONS,
    FUSED_PACKAGES,
    INSTALL_COMMAND,
    fused_kernels_status,
    quiet_fallback_advice,
    reset_fused_call_counts,
    set_fused_kernels,
)
from tests.serving import REPO


def test_switch_swaps_to_the_reference_functions_and_back() -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as module

    try:
        set_fused_kernels(False)
        originals = dict(fused._ORIGINALS)  # what transformers picked at import (fused where installed)
        for name in FUSED_FUNCTIONS:
            current = getattr(module, name)
            # A counting name around the reference function itself, no dispatcher.
            assert current.__wrapped__ is inspect.unwrap(originals[name])
        assert not any(fused_kernels_status()["active"].values())
        set_fused_kernels(False)  # twice is harmless
        set_fused_kernels(True)
        assert {name: getattr(module, name).__wrapped__ for name in FUSED_FUNCTIONS} == originals
    finally:
        set_fused_kernels(True)
    status = fused_kernels_status()
    assert set(status["packages"]) == {"flash-linear-attention", "causal-conv1d"}
    assert set(status["active"]) == set(FUSED_FUNCTIONS) == set(status["calls"])


def test_calls_are_counted_fused_and_reference_apart(tiny_dir: Path) -> None:
    """The status says which implementation ran from the calls made, not from what is installed: here (no
    fused package on a CPU machine) transformers' reference DeltaNet ran, and nothing fused did."""
    from clef_runtime.model.backbone import Backbone

    backbone = Backbone.load(tiny_dir, device="cpu", cpu_kernels=False)  # transformers' own forward
    try:
        set_fused_kernels(True)
        reset_fused_call_counts()
        backbone.hidden_states(list(range(100, 180)))
        calls = fused_kernels_status()["calls"]
        assert calls["torch_chunk_gated_delta_rule"]["reference"] > 0
        assert calls["causal_conv1d_fn"]["reference"] > 0  # a prefill, not a one-token update
        assert sum(counts["fused"] for counts in calls.values()) == 0
        reset_fused_call_counts()
        assert all(
            counts == {"fused": 0, "reference": 0} for counts in fused_kernels_status()["calls"].values()
        )
    finally:
        set_fused_kernels(True)


# What transformers' reference DeltaNet functions log the first time they run without the fused packages.
ADVICE = (
    "`causal_conv1d_update` is falling back to its reference PyTorch implementation because `causal_conv1d` "
    "is not installed. This is correct but much slower; install `causal_conv1d` for the optimized kernel."
)

_DECIDE_ON_CPU = """
import json, logging
from transformers.models.qwen3_5 import modeling_qwen3_5 as module
from clef_runtime.engine.clef import Clef
from clef_runtime.model.fused import FALLBACK_LOGGER

calls = []
for name in ("causal_conv1d_update", "torch_recurrent_gated_delta_rule"):
    def counted(*args, _original=getattr(module, name), _name=name, **kwargs):
        calls.append(_name)
        return _original(*args, **kwargs)
    setattr(module, name, counted)

class Kept(logging.Handler):
    records = []
    def emit(self, record):
        self.records.append(record.getMessage())

logging.getLogger(FALLBACK_LOGGER).addHandler(Kept())
clef = Clef.load("tiny", dtype="fp32", device="cpu")
clef.decide({"state": "a ticket", "questions": {"q": {"type": "noul"}}})
print(json.dumps({"reference_calls": sorted(set(calls)), "records": Kept.records}))
"""


@pytest.mark.slow  # a fresh interpreter: transformers warns once per process
def test_no_advice_to_install_cuda_packages_while_the_cpu_kernels_answer() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _DECIDE_ON_CPU], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # The reference functions that warn did run (the per-token steps the CPU kernels leave to transformers).
    assert seen["reference_calls"] == ["causal_conv1d_update", "torch_recurrent_gated_delta_rule"]
    assert seen["records"] == []
    for name in ("causal_conv1d", "flash-linear-attention", "falling back"):
        assert name not in done.stderr, done.stderr


def test_the_advice_is_kept_once_a_model_is_on_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "_devices", set())
    logger = logging.getLogger(FALLBACK_LOGGER)
    kept: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: kept.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        quiet_fallback_advice("cpu")
        logger.warning(ADVICE)
        logger.warning("an unrelated warning")
        assert kept == ["an unrelated warning"]
        quiet_fallback_advice("cuda")
        logger.warning(ADVICE)  # on CUDA the packages would help: say so
        assert kept == ["an unrelated warning", ADVICE]
    finally:
        logger.removeHandler(handler)


def test_a_call_on_cpu_tensors_counts_as_reference_whatever_is_in_place() -> None:
    """Every fused implementation hands CPU tensors to the reference code: such a call is not a fused one."""
    import torch

    reset_fused_call_counts()
    counted = fused._counting("torch_chunk_gated_delta_rule", lambda *args, **kwargs: None, fused=True)
    counted(torch.zeros(1))
    counted(torch.empty(1, device="meta"))  # any device but the CPU: the fused kernel runs
    assert fused_kernels_status()["calls"]["torch_chunk_gated_delta_rule"] == {"fused": 1, "reference": 1}
    reset_fused_call_counts()


def _status(*active: bool) -> dict[str, Any]:
    return {
        "packages": {},
        "active": dict(zip(FUSED_FUNCTIONS, active, strict=True)),
        "conv": "reference",
        "calls": {},
    }


LoadOn = Callable[..., list[str]]


@pytest.fixture
def load_on(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Iterator[LoadOn]:
    """``load_on(device, status, fused_kernels=True)``: the warnings of `_prepare_device` for a model loaded
    on ``device`` (faked: resolved without asking torch) where `fused_kernels_status` says ``status``."""
    from clef_runtime.model import backbone

    monkeypatch.setattr(fused, "_devices", set())

    def load(device: str, status: dict[str, Any], fused_kernels: bool = True) -> list[str]:
        import torch

        monkeypatch.setattr(backbone, "resolve_device", lambda _device: torch.device(device))
        monkeypatch.setattr(fused, "fused_kernels_status", lambda: status)
        monkeypatch.setattr(backbone, "configure_cpu_threads", lambda threads: None)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=backbone.__name__):
            backbone._prepare_device(device, None, fused_kernels)
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    try:
        yield load
    finally:
        set_fused_kernels(True)


def test_a_cuda_load_without_the_fused_kernels_warns_once_with_the_install_command(load_on: LoadOn) -> None:
    warnings = load_on("cuda:0", _status(False, False, False, False))
    assert len(warnings) == 1
    (line,) = warnings
    assert "\n" not in line
    for said in ("not installed", "flash-linear-attention", "cuda:0", "2.5x", INSTALL_COMMAND):
        assert said in line, line
    # causal-conv1d without fla: the delta rules are still missing, and said so.
    (line,) = load_on("cuda:0", _status(True, True, False, False))
    assert "flash-linear-attention missing" in line and "torch_chunk_gated_delta_rule" in line


def test_no_warning_on_cpu_with_the_kernels_off_or_in_place(load_on: LoadOn) -> None:
    missing = _status(False, False, False, False)
    assert load_on("cpu", missing) == []  # the CPU has kernels of its own
    assert load_on("cuda:0", missing, fused_kernels=False) == []  # --no-fused-kernels: asked for
    assert load_on("cuda:0", _status(True, True, True, True)) == []


def test_the_install_command_installs_both_packages() -> None:
    """`INSTALL_COMMAND` names pyproject's ``cuda`` extra, which holds both fused packages."""
    import tomllib

    assert INSTALL_COMMAND == "pip install 'clef-runtime[cuda]'"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = " ".join(project["optional-dependencies"]["cuda"])
    assert project["name"] == "clef-runtime"
    assert all(distribution in extra for distribution in FUSED_PACKAGES.values())
