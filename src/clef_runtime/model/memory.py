"""How much memory a release needs on a device, from the safetensors headers alone, and whether it fits.

The estimate itemises what the runtime holds:

- the text backbone (embeddings, layers, final norm) in the compute dtype, except the decoder Linear weights
  of the layers ``--weights int8`` quantises (``int8_layers``): one byte per weight plus a 4-byte scale per
  output row;
- the vision tower in the compute dtype, only when asked (``include_vision``);
- the lexical table (``lm_head.weight``), which `LexicalTable` keeps in its stored dtype (bf16: 2.0 GB for
  Clef-flash, 2.5 GB for Clef);
- the JointSchemaHead in fp32;
- a working-memory allowance (torch runtime, prefill activations, allocator slack).

For Clef-flash all backbone tensors together are 18.8 GB in bf16 (37.6 GB if every one were fp32); the CPU
default (fp32 text model + bf16 lexical table + fp32 head) needs ~37 GB and does not fit a 24 GB machine.
From the release's layout (``benchmarks/bench_int8.py --sections memory``, BENCHMARKS.md), in all: fp32
36.9 GB, bf16 storage 20.3 GB, int8 layers 12-31 + bf16 storage 15.7 GB, int8 everywhere + bf16 13.0 GB.

The 27B Clef (Qwen3.5-27B geometry, docs/clef-27b.md; 27.4 B parameters, 54.7 GB in bf16) needs, text
model without vision, from its layout (`clef_runtime.model.layouts.estimate_release_memory`: no weights
needed): fp32 111.8 GB, bf16 57.9 GB, int8 layers 24-63 + bf16 storage 42.0 GB, int8 everywhere + bf16
32.4 GB. No form of it fits a 24 GB machine, and `check_fits` says so with that least figure
(``least_total_bytes``) instead of advising modes that would not fit either.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from clef_runtime.model.checkpoint import CheckpointInfo
from clef_runtime.model.compute_dtype import dtype_name
from clef_runtime.model.device import resolve_device
from clef_runtime.model.load_errors import ModelLoadError
from clef_runtime.release import LM_HEAD_TENSOR, TEXT_PREFIX, VISION_PREFIX

__all__ = [
    "InsufficientMemoryError",
    "MemoryEstimate",
    "available_memory",
    "check_fits",
    "estimate_model_memory",
]

_GB = 1e9
# Working memory beyond the weights: the torch runtime itself plus prefill activations at a few thousand
# tokens (measured on the 9B geometry: ~1 GB over the weights at T = 1024) and allocator slack.
_BASE_OVERHEAD_BYTES = 1 << 30
_OVERHEAD_FRACTION = 0.05
_MEMINFO = Path("/proc/meminfo")


class InsufficientMemoryError(ModelLoadError, MemoryError):
    """The model does not fit in the memory available on the chosen device (the message says what to do)."""

    def __init__(self, message: str, *, needed_bytes: int, available_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a loaded model needs on ``device``, itemised (see the module docstring)."""

    device: torch.device
    dtype: torch.dtype
    text_bytes: int
    vision_bytes: int
    lexical_bytes: int
    head_bytes: int
    overhead_bytes: int
    int8_layers: tuple[int, ...] = ()
    least_total_bytes: int | None = None
    """On CPU: the ``total_bytes`` of the least memory the runtime can hold this model in (``--weights int8
    --int8-layers all``: every decoder Linear in int8, the other tensors in bf16); None where not computed
    (int8 is a CPU feature)."""
    quantized_as: str = "int8"
    """The one-byte format of the ``int8_layers``' Linears: ``int8`` (CPU) or ``fp8`` (the same bytes, on a
    GPU)."""

    @property
    def backbone_bytes(self) -> int:
        """Text model + vision tower (when included) + lexical table."""
        return self.text_bytes + self.vision_bytes + self.lexical_bytes

    @property
    def weights_bytes(self) -> int:
        """All weights: backbone_bytes + the head."""
        return self.backbone_bytes + self.head_bytes

    @property
    def total_bytes(self) -> int:
        """Weights + working-memory allowance: what `check_fits` compares with the available memory."""
        return self.weights_bytes + self.overhead_bytes

    def describe(self) -> str:
        """A one-line human summary in GB (10^9 bytes)."""
        parts = [f"text {self.text_bytes / _GB:.1f}"]
        if self.int8_layers:
            from clef_runtime.model.quantize import describe_layers

            parts[0] += f" ({self.quantized_as} layers {describe_layers(self.int8_layers)})"
        if self.vision_bytes:
            parts.append(f"vision {self.vision_bytes / _GB:.1f}")
        parts += [
            f"lm_head table {self.lexical_bytes / _GB:.1f}",
            f"head {self.head_bytes / _GB:.2f}",
            f"working memory {self.overhead_bytes / _GB:.1f}",
        ]
        return (
            f"~{self.total_bytes / _GB:.1f} GB in {dtype_name(self.dtype)} on {self.device.type} ("
            + ", ".join(parts)
            + ")"
        )


def estimate_model_memory(
    info: CheckpointInfo,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    include_vision: bool = False,
    int8_layers: Collection[int] = (),
    quantized_as: str = "int8",
) -> MemoryEstimate:
    """Estimate the memory the runtime needs for the release ``info`` describes (headers only, no data read).

    ``device`` may be "auto" (as in `Backbone.load`). Text (and, with ``include_vision``, vision) tensors are
    counted at ``dtype``'s element size, the lm_head table at its stored size, the head at fp32; the decoder
    Linear weights of ``int8_layers`` at one byte per weight plus four per output row (int8, or fp8 with
    ``quantized_as="fp8"``: the same bytes). On CPU the estimate
    also carries ``least_total_bytes``, the need with every layer in int8 and bf16 elsewhere (what
    `check_fits` names when nothing fits). Returns a `MemoryEstimate`. Raises ValueError for an unavailable
    device.
    """
    resolved_device = resolve_device(device)
    text, vision, lexical = _weight_bytes(info, dtype, int8_layers)
    head = sum(tensor.numel for tensor in info.head_tensors.values()) * 4
    if not include_vision:
        vision = 0
    least = None
    if resolved_device.type == "cpu":
        every_layer = range(int(info.text_config["num_hidden_layers"]))
        least_text, least_vision, _ = _weight_bytes(info, torch.bfloat16, every_layer)
        least_vision = least_vision if include_vision else 0
        least = least_text + least_vision + lexical + head + _overhead(least_text + least_vision)
    return MemoryEstimate(
        device=resolved_device,
        dtype=dtype,
        text_bytes=text,
        vision_bytes=vision,
        lexical_bytes=lexical,
        head_bytes=head,
        overhead_bytes=_overhead(text + vision),
        int8_layers=tuple(sorted(int8_layers)),
        least_total_bytes=least,
        quantized_as=quantized_as,
    )


def _weight_bytes(
    info: CheckpointInfo, dtype: torch.dtype, int8_layers: Collection[int]
) -> tuple[int, int, int]:
    """Bytes of the (text, vision, lexical) tensors: text and vision at ``dtype``'s element size except the
    decoder Linear weights of ``int8_layers`` (int8 + a scale per row), the lm_head table as stored."""
    from clef_runtime.model.quantize import int8_weight_bytes, is_int8_weight

    layers = frozenset(int8_layers)
    element = torch.empty((), dtype=dtype).element_size()
    text = vision = lexical = 0
    for name, tensor in info.tensors.items():
        if name.startswith(TEXT_PREFIX):
            if layers and is_int8_weight(name[len(TEXT_PREFIX) :], tensor.shape, layers):
                text += int8_weight_bytes(tensor.shape)
            else:
                text += tensor.numel * element
        elif name.startswith(VISION_PREFIX):
            vision += tensor.numel * element
        elif name == LM_HEAD_TENSOR:
            lexical += tensor.nbytes
    return text, vision, lexical


def _overhead(model_bytes: int) -> int:
    """The working-memory allowance for a model whose text (+ vision) weights take ``model_bytes``."""
    return _BASE_OVERHEAD_BYTES + int(_OVERHEAD_FRACTION * model_bytes)


def available_memory(device: str | torch.device) -> int:
    """Bytes available for a new model on ``device``.

    CPU: ``MemAvailable`` from /proc/meminfo (falls back to total physical memory via sysconf when that file
    does not exist). CUDA: free bytes from ``torch.cuda.mem_get_info``.
    """
    resolved = torch.device(device)
    if resolved.type == "cuda":
        free, _total = torch.cuda.mem_get_info(resolved)
        return int(free)
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(estimate: MemoryEstimate, available: int | None = None) -> None:
    """Raise `InsufficientMemoryError` when ``estimate.total_bytes`` exceeds the available memory.

    ``available`` defaults to `available_memory` of the estimate's device. Returns None when the model fits.
    """
    if available is None:
        available = available_memory(estimate.device)
    if estimate.total_bytes <= available:
        return
    needed = f"~{estimate.total_bytes / _GB:.1f} GB in {dtype_name(estimate.dtype)}"
    least = estimate.least_total_bytes
    if estimate.device.type == "cpu" and least is not None and least > available:
        advice = (
            f"no weight mode fits: even --weights int8 --int8-layers all (the least memory, bf16 elsewhere) "
            f"needs ~{least / _GB:.1f} GB; use --device cuda with enough GPU memory, or a machine with more "
            "memory"
        )
    elif estimate.device.type == "cpu" and estimate.dtype == torch.float32 and not estimate.int8_layers:
        advice = (
            "use --weights bf16-storage (half the memory, same fp32 compute) or --weights int8 "
            "(--int8-layers all for the least memory), --device cuda, or a machine with more memory"
        )
    elif estimate.device.type == "cpu":
        advice = (
            "use --weights int8 (--int8-layers all for the least memory), --device cuda, or a machine "
            "with more memory"
        )
    else:
        advice = "use a GPU with more free memory, or --device cpu on a machine with enough RAM"
    raise InsufficientMemoryError(
        f"the model needs {needed} on {estimate.device} but only {available / _GB:.1f} GB is available "
        f"({estimate.describe()}); {advice}",
        needed_bytes=estimate.total_bytes,
        available_bytes=available,
    )
