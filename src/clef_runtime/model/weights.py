"""bf16 weight storage with fp32 compute on CPU, and the automatic choice between it and fp32.

The 9B release needs ~32 GB for its text stack in fp32 and does not fit a 24 GB machine; in bf16 it
needs half. On CPUs without fast bf16 matmuls (AVX2 only), bf16 GEMMs run ~7x slower than fp32,
so the weights are *stored* in bf16 and every ``nn.Linear`` converts its weight to fp32 right
before its matmul. Activations, norms, the conv, the DeltaNet decays and RoPE stay fp32, so the
result equals an fp32 model whose Linear weights were rounded to bf16.

The conversion goes into a scratch buffer that is reused by every Linear of the model (a fresh
200 MB fp32 tensor per matmul would be mapped and page-faulted in again on every call under
glibc's default allocator settings): each Linear converts its own weight into the shared scratch
just before its matmul (scratch = the largest weight, 201 MB at the 9B width).

``benchmarks/bench_weights.py`` measures it against fp32 and pure bf16.

``compute_dtype=torch.bfloat16`` is a third option for CPUs with bf16 matrix units (AMX /
AVX512-BF16, see :func:`has_fast_bf16_matmul`): the Linear inputs are rounded to bf16 and the
matmul runs in bf16 with fp32 accumulation, with fp32 activations everywhere else. It changes
results (activations rounded at every Linear), so it is never chosen automatically.
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from clef_runtime.model.checkpoint import CheckpointInfo

__all__ = [
    "WeightMode",
    "WeightPlan",
    "apply_bf16_storage",
    "choose_weight_mode",
    "has_fast_bf16_matmul",
    "parameter_bytes",
    "plan_weights",
    "set_linear_compute_dtype",
]

WeightMode = Literal["fp32", "bf16-storage"]

# Memory beyond the weights that a prefill needs: torch runtime, activations of a few thousand
# tokens at the 9B width (~1-2 GB at T = 1024-4096), the fp32 scratch of bf16 storage (<= 0.9 GB)
# and allocator slack (the glibc settings recommended for speed keep freed memory mapped).
_FIXED_HEADROOM_BYTES = 3 * (1 << 30)
_PROPORTIONAL_HEADROOM = 0.10

_STATE_ATTRIBUTE = "_clef_bf16_storage"
#: The attribute of each bf16-stored Linear that holds the model's shared `_Fp32Scratch`.
_SCRATCH_ATTRIBUTE = "_clef_scratch"

logger = logging.getLogger(__name__)


def choose_weight_mode(
    param_bytes_fp32: int,
    available_bytes: int,
    *,
    headroom_bytes: int | None = None,
) -> WeightMode:
    """Pick fp32 weights when they fit with headroom, else bf16 storage with fp32 compute.

    fp32 is preferred when it fits: bf16 storage pays a weight conversion per matmul (3-30 % of
    the prefill time on the 9B width, more for short prompts) and rounds the weights to bf16.

    Args:
        param_bytes_fp32: bytes of all parameters if stored in fp32 (4 x parameter count).
        available_bytes: memory the process may use (e.g. MemAvailable).
        headroom_bytes: memory to keep free beyond the weights; default 3 GiB + 10 % of the fp32
            weights (activations, scratch, allocator slack).

    Returns:
        ``"fp32"`` if ``param_bytes_fp32 + headroom`` fits in ``available_bytes``, else
        ``"bf16-storage"`` (whether *that* fits is for the caller's memory check to decide).

    Raises:
        ValueError: if a byte count is negative.
    """
    if param_bytes_fp32 < 0 or available_bytes < 0 or (headroom_bytes is not None and headroom_bytes < 0):
        raise ValueError("byte counts must be non-negative")
    if headroom_bytes is None:
        headroom_bytes = _FIXED_HEADROOM_BYTES + int(_PROPORTIONAL_HEADROOM * param_bytes_fp32)
    return "fp32" if param_bytes_fp32 + headroom_bytes <= available_bytes else "bf16-storage"


@dataclass(frozen=True)
class WeightPlan:
    """How `Backbone.load` stores the text weights: ``storage_dtype`` for every tensor except the decoder
    Linear weights of ``int8_layers`` (int8) or ``fp8_layers`` (e4m3, `clef_runtime.model.fp8`). ``label``
    names the mode (logs, ``Backbone.weight_mode``)."""

    storage_dtype: torch.dtype
    int8_layers: tuple[int, ...] = ()
    label: str = "fp32"
    fp8_layers: tuple[int, ...] = ()

    @property
    def quantized_layers(self) -> tuple[int, ...]:
        """The layers whose decoder Linears hold one byte per weight (int8 or fp8) plus a scale per row."""
        return self.int8_layers or self.fp8_layers

    @property
    def bf16_storage(self) -> bool:
        """True when floating weights are stored in bf16 under fp32 compute (`apply_bf16_storage`)."""
        return self.storage_dtype == torch.bfloat16 and self.label.endswith("bf16-storage")


def plan_weights(
    weights: str,
    *,
    info: CheckpointInfo,
    device: torch.device,
    dtype: torch.dtype,
    int8_layers: str = "late",
    available_bytes: int | None = None,
) -> WeightPlan:
    """Decide how to store the text weights of the release ``info`` for ``--weights weights``.

    ``fp8`` (bf16 compute on a CUDA GPU that `check_fp8_device` accepts) quantises the decoder Linears of the
    ``--int8-layers`` selection to e4m3 and holds the rest in bf16. Otherwise only CPU fp32 compute has
    choices. ``fp32`` and ``bf16-storage`` are what they say; ``int8`` quantises
    the decoder Linears of the ``--int8-layers`` selection and stores the rest in fp32 when that fits with
    headroom (`choose_weight_mode`), else in bf16; ``auto`` keeps exact weights (fp32, else bf16 storage)
    whenever bf16 storage fits in ``available_bytes`` (default: `available_memory`) and picks int8 (the
    ``--int8-layers`` selection, bf16 elsewhere) only when it does not, saying so in the log.

    Returns a `WeightPlan`. Raises `OptionsError` for ``int8`` on a non-CPU device or non-fp32 compute, for
    ``fp8`` on a device that cannot run it or under non-bf16 compute, and for an ``--int8-layers`` selection
    the model does not have; ValueError for an unknown mode.
    """
    from clef_runtime.model.memory import available_memory, estimate_model_memory
    from clef_runtime.model.quantize import describe_layers, select_int8_layers
    from clef_runtime.options import WEIGHT_MODES, OptionsError
    from clef_runtime.release import TEXT_PREFIX

    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, not {weights!r}")
    if weights == "fp8":
        return _plan_fp8(info, device, dtype, int8_layers)
    cpu_fp32 = device.type == "cpu" and dtype == torch.float32
    if not cpu_fp32:
        if weights == "int8":
            raise OptionsError(
                f"--weights int8 is a CPU feature (x86 int8 kernels); on {device.type} with "
                f"{str(dtype).removeprefix('torch.')} compute use --weights auto"
            )
        from clef_runtime.model.compute_dtype import dtype_name

        # Said as --dtype says it (bf16, not torch's bfloat16): the weights are held in the compute dtype.
        return WeightPlan(dtype, label=dtype_name(dtype))
    if weights == "fp32":
        return WeightPlan(torch.float32)
    if weights == "bf16-storage":
        return WeightPlan(torch.bfloat16, label="bf16-storage")
    depth = int(info.text_config["num_hidden_layers"])
    chosen = select_int8_layers(int8_layers, depth)
    available = available_memory(device) if available_bytes is None else available_bytes

    def need(storage: torch.dtype, layers: tuple[int, ...] = ()) -> int:
        return estimate_model_memory(info, device=device, dtype=storage, int8_layers=layers).total_bytes

    if weights == "int8":
        # The other tensors in fp32 when that fits (the estimate includes working memory), else bf16.
        rest_fp32 = need(torch.float32, chosen) <= available
        label = f"int8 layers {describe_layers(chosen)}, " + ("fp32" if rest_fp32 else "bf16-storage")
        return WeightPlan(torch.float32 if rest_fp32 else torch.bfloat16, chosen, label)
    text_params = sum(t.numel for n, t in info.tensors.items() if n.startswith(TEXT_PREFIX))
    if choose_weight_mode(4 * text_params, available) == "fp32":
        return WeightPlan(torch.float32)
    if need(torch.bfloat16) <= available:
        return WeightPlan(torch.bfloat16, label="bf16-storage")
    label = f"int8 layers {describe_layers(chosen)}, bf16-storage"
    logger.warning(
        "--weights auto: bf16 storage needs %.1f GB but %.1f GB is available: using int8 for layers %s "
        "(changes the numbers slightly; --weights bf16-storage to refuse instead)",
        need(torch.bfloat16) / 1e9,
        available / 1e9,
        describe_layers(chosen),
    )
    return WeightPlan(torch.bfloat16, chosen, label)


def _plan_fp8(info: CheckpointInfo, device: torch.device, dtype: torch.dtype, layers_spec: str) -> WeightPlan:
    """`plan_weights` for ``--weights fp8``: the device is asked first (on a CPU that is the whole answer),
    then the compute dtype, then the layer selection."""
    from clef_runtime.model.fp8 import check_fp8_device
    from clef_runtime.model.quantize import describe_layers, select_int8_layers
    from clef_runtime.options import OptionsError

    check_fp8_device(device)
    if dtype != torch.bfloat16:
        raise OptionsError(f"--weights fp8 computes in bf16, not {str(dtype).removeprefix('torch.')}")
    chosen = select_int8_layers(layers_spec, int(info.text_config["num_hidden_layers"]))
    return WeightPlan(torch.bfloat16, label=f"fp8 layers {describe_layers(chosen)}, bf16", fp8_layers=chosen)


def parameter_bytes(model: nn.Module) -> int:
    """Return the bytes held by ``model``'s parameters (each counted once) in their current dtypes."""
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            total += parameter.numel() * parameter.element_size()
    return total


def has_fast_bf16_matmul(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Return True if this x86 CPU has bf16 matrix/dot-product instructions (AMX-BF16 or AVX512-BF16).

    Without them (e.g. AVX2-only Zen 3) torch's bf16 GEMM runs ~7x slower than fp32; with AMX it
    ran ~6x *faster* than fp32 (930 vs 160 GFLOP/s on a 2-core Sapphire Rapids VM). Returns False
    when the flags cannot be read (non-Linux, non-x86).
    """
    from clef_runtime.model.compute_dtype import bf16_cpu_flags

    return bool(bf16_cpu_flags(cpuinfo))


class _Fp32Scratch:
    """One growable fp32 buffer shared by the Linears of a model, plus the lock that serialises its use."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.float32)
        self.lock = threading.RLock()

    def reserve(self, numel: int) -> None:
        if self.buffer.numel() < numel:
            self.buffer = torch.empty(numel, dtype=torch.float32)

    def upcast(self, weight: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Copy ``weight`` into the buffer at ``offset`` (growing it if needed) and return the fp32 view."""
        end = offset + weight.numel()
        self.reserve(end)
        view = self.buffer[offset:end].view(weight.shape)
        view.copy_(weight)
        return view


def _scratch_of(linear: nn.Module) -> _Fp32Scratch:
    """The shared scratch `apply_bf16_storage` attached to ``linear``."""
    scratch: _Fp32Scratch = getattr(linear, _SCRATCH_ATTRIBUTE)
    return scratch


def _bind_forward(module: nn.Module, forward: Callable[..., torch.Tensor]) -> None:
    """Shadow the class's ``forward`` of ``module`` with ``forward`` bound to it (an instance attribute)."""
    # setattr rather than `module.forward = ...`: type checkers refuse assigning to a method, which is
    # exactly what is meant here.
    setattr(module, "forward", types.MethodType(forward, module))  # noqa: B010


def _linear_forward_per_linear(self: nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
    """fp32 Linear on a bf16-stored weight: convert into the shared scratch, then matmul."""
    scratch = _scratch_of(self)
    with scratch.lock:
        weight = scratch.upcast(self.weight)
        return F.linear(hidden_states.float(), weight, self.bias)


def _linear_forward_bf16_compute(self: nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
    """bf16 matmul (fp32 accumulation inside the GEMM) on bf16 weights, fp32 output."""
    bias = None if self.bias is None else self.bias.to(torch.bfloat16)
    return F.linear(hidden_states.to(torch.bfloat16), self.weight, bias).float()


def _embedding_forward(self: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    """Gather bf16 rows, return them in fp32."""
    rows = F.embedding(
        input_ids,
        self.weight,
        self.padding_idx,
        self.max_norm,
        self.norm_type,
        self.scale_grad_by_freq,
        self.sparse,
    )
    return rows.float()


def _restore_rotary_inv_freq(module: nn.Module) -> None:
    """Recompute an fp32 RoPE ``inv_freq`` if a cast to bf16 rounded it (it is not in the state dict)."""
    inv_freq = getattr(module, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dtype == torch.float32:
        return
    config = getattr(module, "config", None)
    rope_type = getattr(module, "rope_type", "default")
    compute_default = getattr(module, "compute_default_rope_parameters", None)
    if config is not None and rope_type == "default" and compute_default is not None:
        fresh, _ = compute_default(config)
    elif config is not None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        fresh, _ = ROPE_INIT_FUNCTIONS[rope_type](config)
    else:
        fresh = inv_freq.float()
    restored = fresh.to(device=inv_freq.device, dtype=torch.float32)
    module.inv_freq = restored
    if isinstance(getattr(module, "original_inv_freq", None), torch.Tensor):
        module.original_inv_freq = restored.clone()


def apply_bf16_storage(
    model: nn.Module,
    *,
    compute_dtype: torch.dtype = torch.float32,
    include_embeddings: bool = True,
) -> None:
    """Store every ``nn.Linear`` (and ``nn.Embedding``) weight in bf16; compute in fp32.

    In place, on CPU models. Linear weights become bf16 parameters; Linear biases, norms, the
    conv, ``A_log``/``dt_bias`` and every other floating parameter or buffer become fp32, and a
    RoPE ``inv_freq`` rounded by an earlier bf16 cast is recomputed in fp32. Each Linear then
    converts its weight to fp32 into the shared scratch just before its matmul and returns fp32;
    an Embedding gathers bf16 rows and returns them in fp32. Feed the model fp32 activations
    (``inputs_embeds``) or ids. Calling it twice is an error.

    Args:
        model: the module tree (e.g. a ``Qwen3_5TextModel``).
        compute_dtype: ``torch.float32`` (default), or ``torch.bfloat16`` for bf16 matmuls with
            fp32 activations elsewhere (fast only where :func:`has_fast_bf16_matmul`).
        include_embeddings: also keep ``nn.Embedding`` weights in bf16 (the 9B's 1B-row table).

    Raises:
        ValueError: on an unknown compute dtype, or if already applied.
    """
    if compute_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"compute_dtype must be float32 or bfloat16, got {compute_dtype}")
    if getattr(model, _STATE_ATTRIBUTE, False):
        raise ValueError("bf16 storage is already applied to this model")

    scratch = _Fp32Scratch()
    linears: list[nn.Linear] = []
    stored_in_bf16: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight.data = module.weight.data.to(torch.bfloat16)
            stored_in_bf16.add(id(module.weight))
            linears.append(module)
        elif isinstance(module, nn.Embedding) and include_embeddings:
            module.weight.data = module.weight.data.to(torch.bfloat16)
            stored_in_bf16.add(id(module.weight))
            _bind_forward(module, _embedding_forward)
    # Everything else that is floating point (biases, norms, conv, A_log, dt_bias, buffers): fp32.
    for parameter in model.parameters():
        if id(parameter) not in stored_in_bf16 and parameter.is_floating_point():
            parameter.data = parameter.data.float()
    for module in model.modules():
        _restore_rotary_inv_freq(module)
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != torch.float32:
                setattr(module, name, buffer.float())

    for linear in linears:
        setattr(linear, _SCRATCH_ATTRIBUTE, scratch)
    setattr(model, _STATE_ATTRIBUTE, True)
    set_linear_compute_dtype(model, compute_dtype)


def set_linear_compute_dtype(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """Switch the Linears of a bf16-storage model between fp32 and bf16 matmuls.

    For a model prepared by :func:`apply_bf16_storage`: fp32 converts
    each weight into the shared scratch (allocated at its final size on first use of fp32);
    bf16 runs the matmul in bf16 with fp32 activations around it.

    Raises:
        ValueError: if the model has no bf16 storage, or the dtype is neither float32 nor bfloat16.
    """
    if compute_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"compute_dtype must be float32 or bfloat16, got {compute_dtype}")
    if not getattr(model, _STATE_ATTRIBUTE, False):
        raise ValueError("needs a model prepared by apply_bf16_storage")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and hasattr(m, _SCRATCH_ATTRIBUTE)]
    if compute_dtype == torch.bfloat16:
        for linear in linears:
            _bind_forward(linear, _linear_forward_bf16_compute)
        return
    for linear in linears:
        _bind_forward(linear, _linear_forward_per_linear)
    if linears:
        # Allocate the shared scratch once, at its final size, before the first forward.
        _scratch_of(linears[0]).reserve(max(linear.weight.numel() for linear in linears))
