"""The machine record: what a figure was measured on, stored in every results file.

CPU model and the ISA flags that decide which kernels run (AVX2, AVX-512, its BF16 and VNNI extensions,
AMX), the cores and the threads torch uses, memory, the torch build (CUDA or CPU, MKL, oneDNN), the GPU when
there is one, the load average, and the GEMM limits (`devtools.gemm`) measured in the same process.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from devtools.gemm import DTYPES, STANDARD_SHAPES, GemmShape, measure_gemm
from devtools.timing import DEFAULT_REPEATS

__all__ = ["ISA_FLAGS", "cpu_flags", "cpu_model", "load_average", "machine_record", "memory_gib"]

#: The /proc/cpuinfo flags that change which CPU kernels torch and oneDNN pick.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    """The CPU's model name (platform's processor string where /proc/cpuinfo has none)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> dict[str, bool]:
    """Each of `ISA_FLAGS`: whether the first CPU reports it (all False where /proc/cpuinfo is absent)."""
    reported: set[str] = set()
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            reported = set(line.split(":", 1)[1].split())
            break
    return {flag: flag in reported for flag in ISA_FLAGS}


def memory_gib() -> float | None:
    """Total memory in GiB (None where /proc/meminfo is absent)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024**2, 1)
    except (OSError, ValueError):
        pass
    return None


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where the platform has none)."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return []


def _torch_build() -> dict[str, Any]:
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "mkl": torch.backends.mkl.is_available(),
        "onednn": torch.backends.mkldnn.is_available(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
    }


def machine_record(
    device: torch.device | str = "cpu",
    *,
    gemm_shapes: Sequence[GemmShape] = STANDARD_SHAPES,
    gemm_dtypes: Sequence[str] = DTYPES,
    gemm_repeats: int = DEFAULT_REPEATS,
) -> dict[str, Any]:
    """The record of this machine and process, with GEMM limits measured now on ``device`` at
    ``gemm_shapes`` (the shapes the benchmark's model runs, where it judges a figure against them).

    Call it after the process's thread setup (``configure_cpu_threads``): the limits use the same threads as
    the figures they judge. Raises ValueError for bad GEMM arguments (see `measure_gemm`)."""
    device = torch.device(device)
    record: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _torch_build(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "device": str(device),
        "malloc_env": {key: value for key, value in os.environ.items() if key.startswith("MALLOC_")},
        "load_average": load_average(),
    }
    try:
        import transformers

        record["transformers"] = transformers.__version__
    except ImportError:
        record["transformers"] = None
    record["gemm"] = measure_gemm(gemm_shapes, dtypes=gemm_dtypes, repeats=gemm_repeats, device=device)
    return record
