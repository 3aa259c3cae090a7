"""The one error family of loading a model, and the one place that says what a failure of ``Clef.load`` is.

``clef decide``, ``clef serve``, ``clef eval``/``compare`` and ``clef tune`` all load a model; each asks
:func:`classify_load_error` what a failure is and reports it its own way (a line on stderr and exit 1, a line
in the server's log), so one damaged checkpoint is the same kind of failure everywhere.
"""

from __future__ import annotations

import enum

from clef_runtime.options import OptionsError
from clef_runtime.protocol.errors import ClefError

__all__ = [
    "DeviceUnavailableError",
    "LoadFailure",
    "ModelLoadError",
    "classify_load_error",
    "is_out_of_memory",
]


class ModelLoadError(Exception):
    """Root of the failures to load a model that carry a complete message (what failed, what to do): a
    missing or damaged checkpoint, a failed download, a head that does not load, not enough memory, a
    device torch does not see.

    Not a ``ClefError``: those are a caller's bad request (HTTP 4xx, exit status 2); a model that cannot be
    had is the machine's or the checkpoint's problem (exit status 1, the server never becomes ready)."""


class DeviceUnavailableError(ModelLoadError, ValueError):
    """The device asked for is one torch does not see (``--device cuda`` on a machine without CUDA)."""


class LoadFailure(enum.Enum):
    """What a failure of ``Clef.load`` is, for the entry point to report."""

    BAD_OPTION = "bad_option"
    """An option's value is wrong (`OptionsError`, naming the flag): the command's usage error."""
    UNLOADABLE = "unloadable"
    """The model cannot be had here: one line saying why, exit status 1, no traceback."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the host or the accelerator running out of memory, told by its type."""
    import torch  # here: the checkpoint's errors (a leaf without torch) derive from this module's root

    return isinstance(exc, MemoryError | torch.OutOfMemoryError)


def classify_load_error(exc: BaseException) -> LoadFailure | None:
    """What ``exc``, raised by ``Clef.load``, is; None for anything else (a bug: its traceback is wanted).

    Besides `ModelLoadError` and out-of-memory, a ``ClefError``, an ``OSError`` or a ``ValueError`` count as
    the model not loading: the libraries the loader reads files with (torch, safetensors, tokenizers) say
    in their message which file and what was wrong with it.
    """
    if isinstance(exc, OptionsError):
        return LoadFailure.BAD_OPTION
    if isinstance(exc, ModelLoadError | ClefError | OSError | ValueError) or is_out_of_memory(exc):
        return LoadFailure.UNLOADABLE
    return None
