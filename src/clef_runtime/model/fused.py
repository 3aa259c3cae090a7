"""Fused CUDA kernels for the Gated DeltaNet layers (the ``cuda`` extra), and the switch that turns them off.

transformers' Qwen3.5 module picks its DeltaNet functions when it is imported: ``causal_conv1d_fn`` and
``causal_conv1d_update`` come from the ``causal-conv1d`` package and ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` from ``flash-linear-attention`` (``fla``, Triton) when those import,
else its reference PyTorch code. ``pip install 'clef-runtime[cuda]'`` installs both; nothing else is needed
for the CUDA path to use them.

`set_fused_kernels` (``--no-fused-kernels`` / ``CLEF_FUSED_KERNELS=0``) swaps the module's four names back to
the reference functions underneath (or back again), for comparisons such as ``benchmarks/gpu_check.py``.
It is process-wide: every Qwen3.5 model in the process follows the last call. On CPU clef-runtime's own
kernels (`clef_runtime.model.kernels`) replace the DeltaNet forward and use neither.

transformers warns, the first time a reference function runs, that ``causal_conv1d`` or
``flash-linear-attention`` should be installed for speed. Both are CUDA-only: on CPU the advice cannot be
followed (the per-token steps the CPU kernels leave to transformers are the only implementation there), so
`quiet_fallback_advice` drops that warning while no model of the process is on an accelerator, and lets it
through once one is, where it says something true. transformers emits each such message once per process
(``warning_once`` is memoized on its arguments), so a message dropped while only CPU models ran is used up:
a CUDA model loaded later in the same process does not repeat it. A server or CLI run loads one model on one
device, which this does not affect; every load on an accelerator logs `fused_kernels_status` (what is
installed and in use) at INFO either way.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "FUSED_FUNCTIONS",
    "FUSED_PACKAGES",
    "fused_kernels_status",
    "quiet_fallback_advice",
    "set_fused_kernels",
]

#: The DeltaNet functions of transformers' Qwen3.5 module that a fused package can provide.
FUSED_FUNCTIONS = (
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
)
#: Import name -> distribution name of the packages behind them (the ``cuda`` extra).
FUSED_PACKAGES = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}

_LOCK = threading.Lock()
_ORIGINALS: dict[str, Callable[..., Any]] = {}


def _module() -> Any:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def _remember_originals(module: Any) -> None:
    if not _ORIGINALS:
        for name in FUSED_FUNCTIONS:
            _ORIGINALS[name] = getattr(module, name)


def fused_kernels_status() -> dict[str, Any]:
    """Which fused packages are installed and whether transformers' functions use them now.

    Returns ``{"packages": {distribution: installed}, "active": {function: uses a fused implementation}}``.
    """
    module = _module()
    with _LOCK:
        _remember_originals(module)
        active = {}
        for name in FUSED_FUNCTIONS:
            current = getattr(module, name)
            # A wrapper around a fused implementation records it in its closure; the reference function is
            # what inspect.unwrap reaches. Installed package + the wrapper in place = fused.
            active[name] = current is _ORIGINALS[name] and _package_for(name) is not None
    return {
        "packages": {
            dist: importlib.util.find_spec(name) is not None for name, dist in FUSED_PACKAGES.items()
        },
        "active": active,
    }


def _package_for(function: str) -> str | None:
    package = "causal_conv1d" if function.startswith("causal_conv1d") else "fla"
    return package if importlib.util.find_spec(package) is not None else None


def set_fused_kernels(enabled: bool) -> None:
    """Use the fused kernels where installed (``enabled``) or transformers' reference PyTorch functions.

    Process-wide (see the module docstring); calling it twice is harmless."""
    module = _module()
    with _LOCK:
        _remember_originals(module)
        for name, original in _ORIGINALS.items():
            setattr(module, name, original if enabled else inspect.unwrap(original))


#: Where transformers says a DeltaNet function "is falling back to its reference PyTorch implementation".
FALLBACK_LOGGER = "transformers.integrations.hub_kernels"
_FALLBACK_PHRASE = "falling back to its reference PyTorch implementation"
_PACKAGE_NAMES = tuple(f"`{name}`" for pair in FUSED_PACKAGES.items() for name in pair)
_devices: set[str] = set()
"""Device types the process has loaded a model on (`quiet_fallback_advice`)."""


class _FallbackAdviceFilter(logging.Filter):
    """Drops the advice to install a CUDA-only package while every model of the process is on the CPU."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _devices - {"cpu"}:
            return True
        message = record.getMessage()
        return not (_FALLBACK_PHRASE in message and any(name in message for name in _PACKAGE_NAMES))


_FILTER = _FallbackAdviceFilter()


def quiet_fallback_advice(device_type: str) -> None:
    """Note that a model is loaded on ``device_type`` (``"cpu"``, ``"cuda"``, ...): transformers' advice to
    install the fused packages is dropped while only CPU models are loaded (it cannot apply there) and let
    through from the first model on an accelerator on. A message already dropped is not shown again:
    transformers emits each one once per process (see the module docstring). Idempotent."""
    with _LOCK:
        _devices.add(device_type)
        logger = logging.getLogger(FALLBACK_LOGGER)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
