"""fp8 decoder linears on Ada / Hopper GPUs: e4m3 per-output-channel weights, per-token e4m3 activations.

``--weights fp8`` replaces the ``nn.Linear`` modules of the chosen decoder layers with `Fp8Linear`:

- weights: ``float8_e4m3fn`` per output channel (``scale[n] = max|w[n, :]| / 448``, fp32 scales), quantised
  while the checkpoint is read (`Fp8Plan`, the loading steps of int8's `LinearQuantPlan`), so the
  full-precision copy of a quantised layer never exists; or in place on a model already built on the GPU
  (`convert_linears_to_fp8`);
- activations: ``float8_e4m3fn`` per token (``scale[t] = max|x[t, :]| / 448``), computed at every call (one
  outlier token does not flatten the resolution of the others, as with int8);
- the product: `scaled_mm_rowwise`, a thin call of ``torch._scaled_mm`` with row-wise fp32 scales
  (``scale_a`` [M, 1], ``scale_b`` [1, N]), fp32 accumulation and a bf16 output. Its CUDA kernels need compute
  capability 8.9 or newer (Ada, Hopper and later): `check_fp8_device` refuses anything else at load.

Everything that is not a decoder Linear stays as it is: the embeddings, the lm_head option rows
(`LexicalTable`), the norms, the DeltaNet convolution, the vision tower (bf16) and the joint head (fp32).
fp8 computes in bf16 (``--dtype auto`` means bf16 with it; ``--dtype fp32`` is refused).

Which layers: the ``--int8-layers`` selection (`select_int8_layers`, default ``late``: the release's 12-31).
The public measurement behind that default (`clef_runtime.model.quantize`: the Core AI port's int8 drift
sat in layers 0-11) concerns where the model is sensitive to rounded weights, not the int8 format, and e4m3
rounds a row's large weights more coarsely than per-channel int8 does (3 mantissa bits: up to 1/16 of the
value against 1/254 of the row's largest), so fp8 keeps the same default until the device check's drift
figures (hidden rows, answers, top-1 flips against bf16) say otherwise; ``--int8-layers all`` quantises every
layer.

Shapes: ``torch._scaled_mm`` on CUDA needs the inner and output widths in multiples of 16. A Linear with
either width not a multiple of 16 stays in bf16 (`fp8_shape_supported`; every decoder Linear of the 9B and
27B releases qualifies; the tiny test model's 4-wide DeltaNet gate projections do not), rather than padding
activations at every call for the smallest matrices of the model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from clef_runtime.model.quantize import LinearQuantPlan, QuantizedLinear
from clef_runtime.options import OptionsError

__all__ = [
    "FP8_ALIGNMENT",
    "FP8_DTYPE",
    "FP8_MAX",
    "MIN_FP8_CAPABILITY",
    "Fp8Linear",
    "Fp8Plan",
    "check_fp8_device",
    "convert_linears_to_fp8",
    "fp8_device_problem",
    "fp8_linear_count",
    "fp8_matmul",
    "fp8_shape_supported",
    "quantize_rows_fp8",
    "scaled_mm_rowwise",
]

FP8_DTYPE = torch.float8_e4m3fn
#: The largest finite e4m3fn value: a row's largest magnitude maps onto it.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
#: ``torch._scaled_mm``'s fp8 kernels: CUDA compute capability 8.9 (Ada) or newer.
MIN_FP8_CAPABILITY = (8, 9)
#: ``torch._scaled_mm`` on CUDA wants the inner and output widths in multiples of this.
FP8_ALIGNMENT = 16
# A row of zeros gets this scale instead of 0 (its fp8 values are all 0 either way; no division by zero).
_MIN_SCALE = 1e-12


def quantize_rows_fp8(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric e4m3 quantisation of each row of a 2-D tensor.

    Returns ``(values, scales)``: ``float8_e4m3fn`` ``[rows, cols]`` and fp32 ``[rows]`` with
    ``matrix ~= values * scales[:, None]`` (each row's largest magnitude becomes 448), ``values`` row-major
    whatever ``matrix``'s layout (the CUDA kernel refuses any other). Computed on ``matrix``'s device. Raises
    ValueError for a tensor that is not 2-D.
    """
    if matrix.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(matrix.shape)}")
    rows = matrix.contiguous().float()
    scales = rows.abs().amax(dim=1).clamp_min(_MIN_SCALE) / FP8_MAX
    # The clamp guards the cast: the largest entry lands on 448 up to fp32 rounding, never past it.
    values = (rows / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values, scales


def scaled_mm_rowwise(
    inputs: Tensor, input_scale: Tensor, weight: Tensor, weight_scale: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """``(inputs * input_scale[:, None]) @ (weight * weight_scale[:, None]).T`` through ``torch._scaled_mm``.

    ``inputs``: e4m3 [M, K] row-major; ``input_scale``: fp32 [M]; ``weight``: e4m3 [N, K] row-major (passed
    transposed: the column-major [K, N] the kernel wants, without a copy); ``weight_scale``: fp32 [N].
    Returns ``out_dtype`` [M, N] (bf16 for the CUDA row-wise kernels).
    """
    return torch._scaled_mm(
        inputs,
        weight.t(),
        scale_a=input_scale.reshape(-1, 1),
        scale_b=weight_scale.reshape(1, -1),
        out_dtype=out_dtype,
    )


def fp8_matmul(
    inputs: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """``inputs @ dequant(weight).T (+ bias)`` with ``inputs`` quantised to e4m3 per row on the fly.

    ``inputs``: [M, K] floating; ``weight``: e4m3 [N, K]; ``weight_scale``: fp32 [N]. Returns ``out_dtype``
    [M, N].
    """
    quantised, row_scale = quantize_rows_fp8(inputs)
    out = scaled_mm_rowwise(quantised, row_scale, weight, weight_scale, out_dtype)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out


def fp8_shape_supported(in_features: int, out_features: int) -> bool:
    """True when a Linear of these widths can run ``torch._scaled_mm`` (both multiples of 16)."""
    return in_features % FP8_ALIGNMENT == 0 and out_features % FP8_ALIGNMENT == 0


class Fp8Linear(QuantizedLinear):
    """A `QuantizedLinear` in e4m3: `quantize_rows_fp8` weights, `fp8_matmul` products in bf16, the bias kept
    in its loaded dtype."""

    format_name = "fp8 e4m3"
    stored_dtype = FP8_DTYPE
    quantize = staticmethod(quantize_rows_fp8)

    def matmul(self, rows: Tensor) -> Tensor:
        return fp8_matmul(rows, self.weight, self.weight_scale, self.bias)


class Fp8Plan(LinearQuantPlan):
    """`LinearQuantPlan` with `Fp8Linear` modules, for the Linears whose widths `fp8_shape_supported`."""

    module_type = Fp8Linear

    def eligible(self, linear: nn.Linear) -> bool:
        return fp8_shape_supported(linear.in_features, linear.out_features)


def convert_linears_to_fp8(model: nn.Module, layers: Iterable[int] | None = None) -> int:
    """Quantise, in place, the decoder Linears of ``layers`` (default: every layer) of an already built text
    model (one with a ``layers`` list, e.g. ``Backbone.model``) to `Fp8Linear`, one Linear at a time on its
    own device, so the peak is the model plus one Linear's fp32 copy. Linears whose widths are not multiples
    of 16 stay as they are. Returns the number of `Fp8Linear` modules made. Does not check the device: call
    `check_fp8_device` first where the model is to run ``torch._scaled_mm`` on CUDA."""
    depth = len(getattr(model, "layers", ()))
    chosen = tuple(range(depth)) if layers is None else tuple(sorted(set(layers)))
    with torch.no_grad():
        return Fp8Plan(chosen).apply(model)


def fp8_linear_count(model: nn.Module) -> int:
    """The number of `Fp8Linear` modules in ``model``."""
    return sum(1 for module in model.modules() if isinstance(module, Fp8Linear))


def fp8_device_problem(device: torch.device) -> str | None:
    """Why ``device`` cannot run the fp8 kernels (None when it can), asked of the device at run time:
    CUDA with compute capability of at least `MIN_FP8_CAPABILITY`, on an NVIDIA (not ROCm) build of torch."""
    if device.type != "cuda":
        return f"this model would run on {device.type}"
    if torch.version.hip is not None:
        return "this torch is a ROCm build (its fp8 is float8_e4m3fnuz, which this runtime does not use)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_FP8_CAPABILITY:
        return f"{device} ({torch.cuda.get_device_name(device)}) has compute capability {major}.{minor}"
    return None


def check_fp8_device(device: torch.device) -> None:
    """Raise `OptionsError` naming ``--weights fp8`` and what it needs when ``device`` cannot run it."""
    problem = fp8_device_problem(device)
    if problem is not None:
        needed = ".".join(str(part) for part in MIN_FP8_CAPABILITY)
        raise OptionsError(
            f"--weights fp8 needs a CUDA GPU of compute capability {needed} or newer (Ada, Hopper and later: "
            f"torch._scaled_mm's fp8 kernels), and {problem}: use --weights auto (bf16)"
        )
