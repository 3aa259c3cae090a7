"""Device and compute dtype of the backbone (a leaf module: the loader and the memory estimate use it)."""

from __future__ import annotations

import torch

from clef_runtime.model.load_errors import DeviceUnavailableError

__all__ = ["resolve_device", "resolve_dtype"]


def resolve_device(device: str | torch.device) -> torch.device:
    """Map ``"auto"`` to cuda when available, else cpu; return other values as a torch.device.

    Raises `DeviceUnavailableError` (a ValueError) when cuda is asked for but not available.
    """
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError("device 'cuda' was requested but torch sees no CUDA device")
    return resolved


def resolve_dtype(device: torch.device, dtype: torch.dtype | str | None) -> torch.dtype:
    """Default compute dtype: fp32 on CPU (bf16 matmuls are ~7x slower there), bf16 on CUDA.

    Accepts a torch dtype or one of "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16". Raises ValueError
    for anything else.
    """
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported backbone dtype {dtype}")
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"unsupported backbone dtype {dtype!r}; use one of {sorted(names)}")
    return names[dtype]
