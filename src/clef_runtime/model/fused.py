"""Fused CUDA kernels for the Gated DeltaNet layers (the ``cuda`` extra), and the switch that turns them off.

transformers' Qwen3.5 module picks its DeltaNet functions when it is imported: ``causal_conv1d_fn`` and
``causal_conv1d_update`` come from the ``causal-conv1d`` package and ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` from ``flash-linear-attention`` (``fla``, Triton) when those import,
else its reference PyTorch code. ``pip install 'clef-runtime[cuda]'`` installs both; nothing else is needed
for the CUDA path to use them.

`set_fused_kernels` (``--no-fused-kernels`` / ``CLEF_FUSED_KERNELS=0``) swaps the module's four names back to
the reference functions underneath (or back again), for comparisons such as ``benchmarks/gpu_check.py``.
It is process-wide: every Qwen3.5 model in the process follows the last call. The names it sets count their
calls, fused and reference apart (`fused_kernels_status`'s ``calls``, `reset_fused_call_counts`): whether
the fused kernels run is read from what was called, not inferred from what is installed. On CPU
clef-runtime's own kernels (`clef_runtime.model.kernels`) replace the DeltaNet forward and use neither.

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
    "reset_fused_call_counts",
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
#: Calls of each function through the names `set_fused_kernels` set: {name: {"fused": n, "reference": n}}.
_CALLS: dict[str, dict[str, int]] = {name: {"fused": 0, "reference": 0} for name in FUSED_FUNCTIONS}


def _is_fused(name: str, function: Callable[..., Any]) -> bool:
    """Whether calling ``function`` (one of transformers' four names, or what `set_fused_kernels` put there)
    runs a fused kernel. The reference function itself never does. transformers' dispatcher wraps the
    reference even when no package is installed (and then falls back to it): it records in its closure whether
    it found another implementation (``is_new_implementation``), which is read here; a dispatcher that does
    not is taken to be fused when its package imports."""
    if inspect.unwrap(function) is function:
        return False
    try:
        found = inspect.getclosurevars(function).nonlocals.get("is_new_implementation")
    except (TypeError, ValueError):
        found = None
    return bool(found) if found is not None else _package_for(name) is not None


def _counting(name: str, target: Callable[..., Any], fused: bool) -> Callable[..., Any]:
    kind = "fused" if fused else "reference"

    def counted(*args: Any, **kwargs: Any) -> Any:
        _CALLS[name][kind] += 1  # from the one thread that runs the model: no lock on the hot path
        return target(*args, **kwargs)

    counted.__wrapped__ = target  # type: ignore[attr-defined]
    return counted


def _module() -> Any:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def _remember_originals(module: Any) -> None:
    if not _ORIGINALS:
        for name in FUSED_FUNCTIONS:
            _ORIGINALS[name] = getattr(module, name)


def fused_kernels_status() -> dict[str, Any]:
    """Which fused packages are installed, which implementation each of transformers' four names holds now,
    and how often each was called since `reset_fused_call_counts` (counted only once `set_fused_kernels` has
    run in the process: every model load off CPU calls it).

    Returns ``{"packages": {distribution: installed}, "active": {function: a fused implementation is in
    place}, "calls": {function: {"fused": n, "reference": n}}}``.
    """
    module = _module()
    with _LOCK:
        _remember_originals(module)
        active = {}
        for name in FUSED_FUNCTIONS:
            current = getattr(module, name)
            target = getattr(current, "__wrapped__", current) if current is not _ORIGINALS[name] else current
            active[name] = _is_fused(name, target)
        calls = {name: dict(counts) for name, counts in _CALLS.items()}
    return {
        "packages": {
            dist: importlib.util.find_spec(name) is not None for name, dist in FUSED_PACKAGES.items()
        },
        "active": active,
        "calls": calls,
    }


def reset_fused_call_counts() -> None:
    """Set every call count of `fused_kernels_status` back to zero."""
    with _LOCK:
        for counts in _CALLS.values():
            counts.update(fused=0, reference=0)


def _package_for(function: str) -> str | None:
    package = "causal_conv1d" if function.startswith("causal_conv1d") else "fla"
    return package if importlib.util.find_spec(package) is not None else None


def set_fused_kernels(enabled: bool) -> None:
    """Use the fused kernels where installed (``enabled``) or transformers' reference PyTorch functions,
    through names that count their calls.

    Process-wide (see the module docstring); calling it twice is harmless."""
    module = _module()
    with _LOCK:
        _remember_originals(module)
        for name, original in _ORIGINALS.items():
            target = original if enabled else inspect.unwrap(original)
            setattr(module, name, _counting(name, target, fused=_is_fused(name, target)))


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
