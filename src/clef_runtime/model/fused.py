"""Fused CUDA kernels for the Gated DeltaNet layers (the ``cuda`` extra), and the switch that turns them off.

transformers' Qwen3.5 module picks its DeltaNet functions when it is imported: ``causal_conv1d_fn`` and
``causal_conv1d_update`` come from the ``causal-conv1d`` package and ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` from ``flash-linear-attention`` (``fla``, Triton) when those import,
else its reference PyTorch code. ``pip install 'clef-runtime[cuda]'`` installs both; nothing else is needed
for the CUDA path to use them. causal-conv1d builds a CUDA extension (it needs nvcc); flash-linear-attention
is pure Python and has a Triton causal conv of its own: where ``fla`` imports and ``causal_conv1d`` does not,
`set_fused_kernels` puts an adapter onto fla's conv (`fla_causal_conv1d_fn`, `fla_causal_conv1d_update`) in
place of transformers' two conv names, so that the one pure-Python wheel gives the whole fused path.
`fused_kernels_status`'s ``conv`` says which conv is in place (``causal_conv1d``, ``fla`` or ``reference``).

`set_fused_kernels` (``--no-fused-kernels`` / ``CLEF_FUSED_KERNELS=0``) swaps the module's four names back to
the reference functions underneath (or back again), for comparisons such as ``benchmarks/gpu_check.py``.
It is process-wide: every Qwen3.5 model in the process follows the last call. The names it sets count their
calls, fused and reference apart (`fused_kernels_status`'s ``calls``, `reset_fused_call_counts`): whether
the fused kernels run is read from what was called, not inferred from what is installed. A call on CPU
tensors counts as a reference call: every fused implementation hands those to the reference code. On CPU
clef-runtime's own kernels (`clef_runtime.model.kernels`) replace the DeltaNet forward and use neither.

transformers warns, the first time a reference function runs, that ``causal_conv1d`` or
``flash-linear-attention`` should be installed for speed. Both are CUDA-only: on CPU the advice cannot be
followed (the per-token steps the CPU kernels leave to transformers are the only implementation there), so
`quiet_fallback_advice` drops that warning while no model of the process is on an accelerator, and lets it
through once one is, where it says something true. transformers emits each such message once per process
(``warning_once`` is memoized on its arguments), so a message dropped while only CPU models ran is used up:
a CUDA model loaded later in the same process does not repeat it. A server or CLI run loads one model on one
device, which this does not affect; every load on an accelerator logs `fused_kernels_status` (what is
installed and in use) at INFO either way, and `missing_fused_kernels_warning` once at WARNING when a fused
kernel is missing there: that fallback is otherwise silent, and the costliest surprise on a GPU.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "FUSED_FUNCTIONS",
    "FUSED_PACKAGES",
    "INSTALL_COMMAND",
    "fla_causal_conv1d_fn",
    "fla_causal_conv1d_update",
    "fused_kernels_status",
    "missing_fused_kernels_warning",
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
#: transformers' two causal conv names, which fla's conv can stand in for.
CONV_FUNCTIONS = FUSED_FUNCTIONS[:2]
#: What installs the fused kernels (pyproject's ``cuda`` extra).
INSTALL_COMMAND = "pip install 'clef-runtime[cuda]'"
#: Where fla keeps its Triton causal conv: ``fla.modules.causal_conv1d`` from 0.6, ``fla.modules.convolution``
#: before (the ``cuda`` extra takes ``>=0.4,<0.7``).
_FLA_CONV_MODULES = ("fla.modules.causal_conv1d", "fla.modules.convolution")

logger = logging.getLogger(__name__)

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
    if getattr(function, "_fla_conv", False):
        return True
    if inspect.unwrap(function) is function:
        return False
    try:
        found = inspect.getclosurevars(function).nonlocals.get("is_new_implementation")
    except (TypeError, ValueError):
        found = None
    return bool(found) if found is not None else _package_for(name) is not None


def _on_cpu(args: tuple[Any, ...]) -> bool:
    """Whether the call's first argument (a tensor in all four functions) is on the CPU."""
    return bool(args) and getattr(getattr(args[0], "device", None), "type", None) == "cpu"


def _counting(name: str, target: Callable[..., Any], fused: bool) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        # CPU tensors go to the reference code whatever is installed (transformers' dispatcher, fla adapter).
        kind = "fused" if fused and not _on_cpu(args) else "reference"
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
    place}, "conv": "causal_conv1d" | "fla" | "reference", "calls": {function: {"fused": n, "reference":
    n}}}``; ``conv`` is the implementation behind transformers' ``causal_conv1d_fn`` now.
    """
    module = _module()
    with _LOCK:
        _remember_originals(module)
        targets = {}
        for name in FUSED_FUNCTIONS:
            current = getattr(module, name)
            targets[name] = (
                getattr(current, "__wrapped__", current) if current is not _ORIGINALS[name] else current
            )
        active = {name: _is_fused(name, target) for name, target in targets.items()}
        calls = {name: dict(counts) for name, counts in _CALLS.items()}
    conv = _conv_kind(targets[CONV_FUNCTIONS[0]], active[CONV_FUNCTIONS[0]])
    return {
        "packages": {
            dist: importlib.util.find_spec(name) is not None for name, dist in FUSED_PACKAGES.items()
        },
        "active": active,
        "conv": conv,
        "calls": calls,
    }


def _conv_kind(target: Callable[..., Any], fused: bool) -> str:
    """Which causal conv ``target`` (what stands behind ``causal_conv1d_fn``) runs."""
    if getattr(target, "_fla_conv", False):
        return "fla"
    return "causal_conv1d" if fused else "reference"


def missing_fused_kernels_warning(status: dict[str, Any], device: str) -> str | None:
    """The one line a process on ``device`` (an accelerator) logs when a DeltaNet function of ``status``
    (`fused_kernels_status`, read after `set_fused_kernels(True)`) has no fused implementation in place:
    what is missing, what it costs and how to install it. None when all four are fused."""
    missing = [name for name, fused in status["active"].items() if not fused]
    if not missing:
        return None
    # The delta rules need fla, which brings a causal conv too: fla alone then completes the path.
    rules_missing = any(name not in CONV_FUNCTIONS for name in missing)
    packages = "flash-linear-attention" if rules_missing else "causal-conv1d or flash-linear-attention"
    return (
        f"the fused DeltaNet kernels are not installed ({packages} missing; reference PyTorch for "
        f"{', '.join(missing)}): on {device} the Gated DeltaNet layers run transformers' reference path, "
        "about 2.5x slower (MindRouter measured 194 ms against 76 ms with them, 313 tokens on an H200). "
        f"Install them with: {INSTALL_COMMAND}"
    )


def reset_fused_call_counts() -> None:
    """Set every call count of `fused_kernels_status` back to zero."""
    with _LOCK:
        for counts in _CALLS.values():
            counts.update(fused=0, reference=0)


def _package_for(function: str) -> str | None:
    package = "causal_conv1d" if function.startswith("causal_conv1d") else "fla"
    return package if importlib.util.find_spec(package) is not None else None


def set_fused_kernels(enabled: bool) -> None:
    """Use the fused kernels where installed (``enabled``; fla's conv for the causal conv where causal-conv1d
    is not) or transformers' reference PyTorch functions, through names that count their calls.

    Process-wide (see the module docstring); calling it twice is harmless."""
    module = _module()
    with _LOCK:
        _remember_originals(module)
        conv = _fla_causal_conv1d() if enabled else None
        for name, original in _ORIGINALS.items():
            target = original if enabled else inspect.unwrap(original)
            if conv is not None and name in CONV_FUNCTIONS and not _is_fused(name, original):
                target = _fla_adapter(name, original, conv)
            setattr(module, name, _counting(name, target, fused=_is_fused(name, target)))


# ------------------------------------------------------------------------------ fla's causal conv adapter


def _fla_causal_conv1d() -> Callable[..., Any] | None:
    """fla's ``causal_conv1d`` (Triton), or None where fla is not installed or does not import (it needs
    triton, which a CPU machine may not have)."""
    if importlib.util.find_spec("fla") is None:
        return None
    for module_name in _FLA_CONV_MODULES:
        try:
            conv = getattr(importlib.import_module(module_name), "causal_conv1d", None)
        except Exception as exc:  # fla's import reaches triton and the GPU driver: anything may fail there
            logger.debug("no fla causal conv in %s: %s", module_name, exc)
            continue
        if callable(conv):
            return conv
    return None


def _to_fla(hidden_states: Tensor) -> Tensor:
    """transformers' conv layout ``[batch, channels, time]`` as fla's ``[B, T, D]`` (a view: fla's kernel
    reads strided inputs)."""
    return hidden_states.transpose(1, 2)


def _from_fla(output: Tensor) -> Tensor:
    """fla's ``[B, T, D]`` output in transformers' ``[batch, channels, time]`` layout."""
    return output.transpose(1, 2)


def _check_fla_arguments(activation: str | None, kwargs: dict[str, Any]) -> None:
    # fla's kernel applies silu/swish or nothing: any other name would silently be skipped.
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"fla's causal conv applies silu or no activation, not {activation!r}")
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        raise ValueError("the fla causal conv adapter does not keep packed sequences (seq_idx) apart")


def fla_causal_conv1d_fn(
    conv: Callable[..., Any],
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    **kwargs: Any,
) -> Tensor:
    """transformers' ``causal_conv1d_fn`` (``hidden_states`` ``[batch, channels, time]``, ``weight``
    ``[channels, width]``, left zero padding) computed by fla's ``conv`` (``causal_conv1d``)."""
    _check_fla_arguments(activation, kwargs)
    output, _ = conv(
        x=_to_fla(hidden_states.to(weight.dtype)), weight=weight, bias=bias, activation=activation
    )
    return _from_fla(output).to(hidden_states.dtype)


def fla_causal_conv1d_update(
    conv: Callable[..., Any],
    hidden_states: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
) -> Tensor:
    """transformers' ``causal_conv1d_update`` computed by fla's ``conv``: the output of ``hidden_states``
    (``[batch, channels, time]``) continuing the inputs held in ``conv_state`` (``[batch, channels, S]``,
    S >= width - 1, its last column the latest input), which then holds the last S inputs (in place)."""
    import torch
    import torch.nn.functional as F

    _check_fla_arguments(activation, {})
    width = weight.shape[-1]
    state_len = conv_state.shape[-1]
    # fla's initial state is [N, D, width], its last column the input just before the first new one. Its first
    # column is never read: the last width - 1 inputs held, padded on the left, are all it needs.
    held = conv_state[..., state_len - (width - 1) :]
    initial_state = F.pad(held, (width - held.shape[-1], 0)).to(weight.dtype).contiguous()
    output, _ = conv(
        x=_to_fla(hidden_states.to(weight.dtype)),
        weight=weight,
        bias=bias,
        initial_state=initial_state,
        activation=activation,
    )
    conv_state.copy_(torch.cat([conv_state, hidden_states.to(conv_state.dtype)], dim=-1)[..., -state_len:])
    return _from_fla(output).to(hidden_states.dtype)


_FLA_MAPPINGS: dict[str, Callable[..., Any]] = {
    "causal_conv1d_fn": fla_causal_conv1d_fn,
    "causal_conv1d_update": fla_causal_conv1d_update,
}


def _fla_adapter(name: str, original: Callable[..., Any], conv: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' ``name`` (one of `CONV_FUNCTIONS`) onto fla's ``conv``; CPU inputs, which Triton cannot
    take, go to ``original`` (transformers' dispatcher, which runs its reference there)."""
    mapping = _FLA_MAPPINGS[name]

    @functools.wraps(original)
    def adapted(*args: Any, **kwargs: Any) -> Any:
        if _on_cpu(args):
            return original(*args, **kwargs)
        return mapping(conv, *args, **kwargs)

    adapted._fla_conv = True  # type: ignore[attr-defined]
    return adapted


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
