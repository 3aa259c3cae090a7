"""Which dtype the backbone computes in: ``--dtype auto|fp32|bf16``.

``fp32`` is the reference's numbers (what exactness tests use). ``bf16`` computes the backbone's matmuls,
attention and activations in bf16, with the Gated DeltaNet recurrent states, every norm's statistics and the
joint head in fp32 (`clef_runtime.model.kernels` and the head upcast). ``auto`` (the default) picks:

- on CUDA (and other accelerators): bf16, as every GPU server of this model does;
- on a CPU: bf16 only where the CPU has native bf16 dot products (AVX512_BF16 or AMX-BF16 in
  ``/proc/cpuinfo``) *and* a short measurement at load, a GEMM of the model's own projection shape,
  confirms that bf16 is faster there; otherwise fp32. The flags alone are not trusted: torch's bf16 GEMM
  on an AVX2-only Zen 3 ran ~7x slower than fp32, and a model too narrow for its GEMMs to dominate gains
  nothing;
- fp32 whenever ``--weights`` names an fp32-compute storage mode (``fp32``, ``bf16-storage``, ``int8``): the
  user asked for those numbers; bf16 with ``--weights fp8``, whose products come out in bf16.

The measurement takes well under a second at the release's width (the shape's width is capped) and is done
once per shape per process.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from clef_runtime.options import (
    BF16_COMPUTE_WEIGHT_MODES,
    COMPUTE_DTYPES,
    FP32_COMPUTE_WEIGHT_MODES,
    OptionsError,
)

__all__ = [
    "BF16_CPU_FLAGS",
    "MIN_BF16_HIDDEN",
    "MIN_BF16_SPEEDUP",
    "ComputeChoice",
    "bf16_cpu_flags",
    "choose_compute_dtype",
    "dtype_name",
    "measure_bf16_speedup",
]

#: The /proc/cpuinfo flags of native bf16 dot products.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")

#: ``auto`` takes bf16 on a CPU only when its GEMM is at least this much faster than fp32 (a margin for
#: the casts around each matmul and the elementwise work that bf16 does not speed up).
MIN_BF16_SPEEDUP = 1.3

#: The measured shape: ``[tokens x inner] @ [inner x outer]`` with the model's hidden and intermediate
#: sizes, each capped so the probe stays short at the release's width (2 x 256 x 2048 x 4096 = 4.3 GFLOP).
_PROBE_TOKENS = 256
_PROBE_CAP = (2048, 4096)
#: The two dtypes are timed in this many interleaved pairs of batches, each batch lasting at least
#: _PROBE_BATCH_S (a narrow GEMM takes microseconds: single calls would measure timer noise), and the median
#: of the pairs' ratios is the speedup: interleaving gives both dtypes the same share of whatever else the
#: machine is doing (a probe timing all fp32 calls first swung from 0.7x to 4x under load).
_PROBE_PAIRS = 5
_PROBE_BATCH_S = 0.01
#: Models narrower than this compute fp32 under ``auto`` without a measurement: their time goes to
#: elementwise work and per-op overhead, which bf16 does not speed up (the built-in tiny model, hidden 64).
MIN_BF16_HIDDEN = 256

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

_measured: dict[tuple[int, int, int], float] = {}
_measure_lock = threading.Lock()


@dataclass(frozen=True)
class ComputeChoice:
    """The backbone's compute dtype and why it was chosen (for the startup log and ``/v1/models``)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        """``fp32``, ``bf16`` (or ``fp16``)."""
        return dtype_name(self.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """The short name options, logs and ``/v1/models`` use: ``fp32``, ``bf16``, ``fp16`` (else torch's)."""
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


def bf16_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, ...]:
    """The native-bf16 flags (`BF16_CPU_FLAGS`) this CPU reports; empty where /proc/cpuinfo is unreadable
    (non-Linux) or the CPU has none (AVX2-only x86, most ARM servers)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return ()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            reported = set(line.split(":", 1)[1].split())
            return tuple(flag for flag in BF16_CPU_FLAGS if flag in reported)
    return ()


def _batch_seconds(inputs: torch.Tensor, weight: torch.Tensor, calls: int) -> float:
    """Seconds per ``F.linear(inputs, weight)`` over ``calls`` calls."""
    started = time.perf_counter()
    for _ in range(calls):
        F.linear(inputs, weight)
    return (time.perf_counter() - started) / calls


def _calls_per_batch(inputs: torch.Tensor, weight: torch.Tensor) -> int:
    for _ in range(2):  # warm-up: oneDNN picks and caches its kernel on the first call
        single = _batch_seconds(inputs, weight, 1)
    return max(1, int(_PROBE_BATCH_S / max(single, 1e-7)))


def measure_bf16_speedup(hidden_size: int, intermediate_size: int) -> float:
    """fp32 time / bf16 time of one CPU GEMM ``[256 x hidden] @ [hidden x intermediate]`` (each dimension
    capped, see ``_PROBE_CAP``): the median ratio of `_PROBE_PAIRS` interleaved pairs of timed batches,
    after a warm-up. Cached per shape for the process."""
    shape = (_PROBE_TOKENS, min(hidden_size, _PROBE_CAP[0]), min(intermediate_size, _PROBE_CAP[1]))
    with _measure_lock:
        if shape not in _measured:
            from clef_runtime.model.kernels import flush_denormals

            tokens, inner, outer = shape
            generator = torch.Generator().manual_seed(0)
            inputs = torch.randn(tokens, inner, generator=generator)
            weight = torch.randn(outer, inner, generator=generator)
            low = (inputs.bfloat16(), weight.bfloat16())
            with flush_denormals(), torch.inference_mode():
                calls = (_calls_per_batch(inputs, weight), _calls_per_batch(*low))
                ratios = [
                    _batch_seconds(inputs, weight, calls[0]) / _batch_seconds(*low, calls[1])
                    for _ in range(_PROBE_PAIRS)
                ]
            _measured[shape] = statistics.median(ratios)
        return _measured[shape]


def choose_compute_dtype(
    requested: str,
    *,
    device: torch.device,
    weights: str = "auto",
    hidden_size: int,
    intermediate_size: int,
    cpuinfo: Path = Path("/proc/cpuinfo"),
) -> ComputeChoice:
    """The compute dtype for ``--dtype requested`` (``auto``, ``fp32`` or ``bf16``) on ``device``, given
    ``--weights weights`` and the model's width (the probe's shape, on CPU).

    Raises `OptionsError` for an unknown dtype, for ``bf16`` together with an fp32-compute weight mode
    (``--weights fp32``, ``bf16-storage`` or ``int8``), or for ``fp32`` with ``--weights fp8``.
    """
    if requested not in COMPUTE_DTYPES:
        raise OptionsError(f"--dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {requested!r}")
    if weights in BF16_COMPUTE_WEIGHT_MODES:
        if requested == "fp32":
            raise OptionsError(f"--weights {weights} computes in bf16: use --dtype auto or bf16 with it")
        return ComputeChoice(torch.bfloat16, f"--weights {weights} computes in bf16")
    if requested == "fp32":
        return ComputeChoice(torch.float32, "--dtype fp32")
    if weights in FP32_COMPUTE_WEIGHT_MODES:
        if requested == "bf16":
            raise OptionsError(
                f"--weights {weights} is a storage mode for fp32 compute; with --dtype bf16 use "
                "--weights auto (bf16 compute keeps the weights in bf16)"
            )
        return ComputeChoice(torch.float32, f"--weights {weights} computes in fp32")
    if requested == "bf16":
        return ComputeChoice(torch.bfloat16, "--dtype bf16")
    if device.type != "cpu":
        return ComputeChoice(torch.bfloat16, f"auto: bf16 on {device.type}")
    flags = bf16_cpu_flags(cpuinfo)
    if not flags:
        return ComputeChoice(torch.float32, "auto: this CPU has no native bf16 (no AVX512_BF16 or AMX)")
    if hidden_size < MIN_BF16_HIDDEN:
        return ComputeChoice(
            torch.float32, f"auto: hidden size {hidden_size} < {MIN_BF16_HIDDEN}, too narrow for bf16 to pay"
        )
    speedup = measure_bf16_speedup(hidden_size, intermediate_size)
    measured = f"bf16 GEMM {speedup:.1f}x fp32 measured at this model's width"
    if speedup >= MIN_BF16_SPEEDUP:
        return ComputeChoice(torch.bfloat16, f"auto: {'+'.join(flags)}, {measured}")
    return ComputeChoice(
        torch.float32, f"auto: {'+'.join(flags)} but {measured} (< {MIN_BF16_SPEEDUP}x): fp32"
    )
