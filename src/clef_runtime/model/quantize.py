"""int8 decoder linears on CPU: per-output-channel int8 weights, per-token int8 dynamic activations.

``--weights int8`` replaces the ``nn.Linear`` modules of the chosen decoder layers with `Int8Linear`:

- weights: symmetric int8 per output channel (``scale[n] = max|w[n, :]| / 127``), quantised once while the
  checkpoint is read, so the full-precision copy of a quantised layer never exists in memory (a 1-byte
  weight plus a 4-byte scale per output row);
- activations: symmetric int8 per token (``scale[t] = max|x[t, :]| / 127``), computed at every call;
- the product: ``torch._int_mm`` (int8 x int8 -> int32; oneDNN's VNNI/AMX kernels on x86), rescaled to
  fp32 by the outer product of the two scale vectors.

Why this kernel: ``benchmarks/bench_int8.py`` measured it against fp32 and torch's other int8 paths at the
release's shapes (BENCHMARKS.md). Per-token activation scales also keep one outlier token (LLMs carry a few
"massive activations") from flattening the resolution of every other token, which a per-tensor activation
scale (torch's ``quantized.linear_dynamic``) cannot.

Which layers: `select_int8_layers`. ``late`` (the default) is every layer from ``floor(3/8 * depth)`` on:
for the 9B release's 32 layers, 12-31. The public evidence (the Core AI port of Clef-flash,
CYBRTRK2/coreai-model-zoo ``models/clef-flash/gate-*.json``, against the author's fp32 run on 401
questions, weight-only int8 in blocks of 32) put int8 drift in layers 0-11: all 248 decoder linears int8 gave
max |dp| 0.075; layers 12-31 int8 with 0-11 kept in 16 bits gave 0.015 (fp16 alone: 0.011). Random test
weights cannot show this, so the default follows that measurement. The joint head, the lm_head option rows
(`LexicalTable`) and the embeddings are never quantised here.

Loading (`Int8Plan`, a `LinearQuantPlan`): ``prepare`` swaps the chosen ``nn.Linear`` modules of the
meta-device model for `Int8Linear` modules (same ``weight`` name and shape, int8), ``convert`` quantises
each such tensor as it is read from the shards, and ``finish`` installs the scales. Everything else loads as
before.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import ClassVar, Self

import torch
from torch import Tensor, nn

from clef_runtime.options import OptionsError

__all__ = [
    "Int8Linear",
    "Int8Plan",
    "LinearQuantPlan",
    "QuantizedLinear",
    "describe_layers",
    "int8_linear_count",
    "int8_matmul",
    "int8_weight_bytes",
    "is_int8_weight",
    "late_start",
    "quantize_rows",
    "select_int8_layers",
]

_INT8_MAX = 127
# A row of zeros gets this scale instead of 0 (its int8 values are all 0 either way; no division by zero).
_MIN_SCALE = 1e-12
_LAYER_WEIGHT = re.compile(r"^layers\.(\d+)\.(.+)\.weight$")


def late_start(depth: int) -> int:
    """The first layer of the ``late`` selection: ``floor(3/8 * depth)`` (12 of the release's 32)."""
    return (3 * depth) // 8


def select_int8_layers(spec: str, depth: int) -> tuple[int, ...]:
    """The decoder-layer indices ``--int8-layers spec`` selects in a model of ``depth`` layers, sorted.

    ``late``: ``late_start(depth) .. depth - 1``; ``all``: every layer; otherwise comma-separated indices,
    each in ``0 .. depth - 1`` (duplicates are merged). Raises `OptionsError` naming ``--int8-layers`` for
    anything else, an index outside the model, or an empty selection.
    """
    text = spec.strip().lower()
    if text == "late":
        return tuple(range(late_start(depth), depth))
    if text == "all":
        return tuple(range(depth))
    if not re.fullmatch(r"\d+(\s*,\s*\d+)*", text):
        raise OptionsError(f"--int8-layers must be late, all or comma-separated layer indices, got {spec!r}")
    indices = sorted({int(item) for item in text.split(",")})
    outside = [index for index in indices if index >= depth]
    if outside:
        raise OptionsError(
            f"--int8-layers: layer(s) {outside} do not exist: this model has {depth} layers (0..{depth - 1})"
        )
    return tuple(indices)


def quantize_rows(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 quantisation of each row of a 2-D tensor.

    Returns ``(values, scales)``: int8 ``[rows, cols]`` in -127..127 and fp32 ``[rows]`` with
    ``matrix ~= values * scales[:, None]``. Raises ValueError for a tensor that is not 2-D.
    """
    if matrix.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(matrix.shape)}")
    rows = matrix.float()
    scales = rows.abs().amax(dim=1).clamp_min(_MIN_SCALE) / _INT8_MAX
    values = torch.round(rows / scales[:, None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return values, scales


def int8_matmul(inputs: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """``inputs @ dequant(weight).T (+ bias)`` with ``inputs`` quantised to int8 per row on the fly.

    ``inputs``: [M, K] floating; ``weight``: int8 [N, K]; ``weight_scale``: fp32 [N]. Returns fp32 [M, N].
    """
    rows = inputs.float()
    row_scale = rows.abs().amax(dim=1, keepdim=True).clamp_min_(_MIN_SCALE).div_(_INT8_MAX)
    quantised = torch.round(rows / row_scale).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    # The [N, K] weight passed transposed: oneDNN reads it as a column-major [K, N] without a copy (and this
    # layout measured faster than a row-major [K, N] copy).
    out = torch._int_mm(quantised, weight.t()).to(torch.float32)
    out.mul_(row_scale).mul_(weight_scale)
    if bias is not None:
        out.add_(bias)
    return out


class QuantizedLinear(nn.Module):
    """A Linear whose weight is held at one byte per element with an fp32 scale per output channel, and whose
    input is quantised per token at every call; `Int8Linear` and `clef_runtime.model.fp8.Fp8Linear` say in
    which format (``quantize`` for the weight rows, ``matmul`` for the product).

    Buffers: ``weight`` (``stored_dtype`` [out, in], the name and shape of the ``nn.Linear`` it replaces, so
    the shard loader fills it), ``weight_scale`` (fp32 [out], not in the state dict: computed from the shard
    tensor), and an optional ``bias`` (in ``bias_dtype``; None keeps the loaded one's). The output has the
    input's floating dtype.
    """

    format_name: ClassVar[str] = ""
    stored_dtype: ClassVar[torch.dtype] = torch.int8
    bias_dtype: ClassVar[torch.dtype | None] = None

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=self.stored_dtype))
        self.register_buffer("weight_scale", torch.ones(out_features), persistent=False)
        self.bias: Tensor | None
        if bias:
            self.register_buffer("bias", torch.zeros(out_features))
        else:
            self.bias = None

    @staticmethod
    def quantize(matrix: Tensor) -> tuple[Tensor, Tensor]:
        """``(values, scales)`` of a floating [out, in] weight, one fp32 scale per output row."""
        raise NotImplementedError

    def matmul(self, rows: Tensor) -> Tensor:
        """``rows`` [M, in] -> [M, out] (bias included), in the format's output dtype."""
        raise NotImplementedError

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Self:
        """A module holding ``linear``'s weight quantised per output row (and its bias), on its device."""
        weight = linear.weight.detach()
        with torch.device(weight.device):
            module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        module.set_weight(weight)
        if linear.bias is not None:
            module.bias = linear.bias.detach().clone()
            module.keep_bias()
        return module

    def set_weight(self, weight: Tensor) -> None:
        """Quantise a floating [out, in] ``weight`` into this module (in place). Raises ValueError on a shape
        mismatch."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight shape {tuple(weight.shape)} != ({self.out_features}, {self.in_features})"
            )
        self.weight, self.weight_scale = self.quantize(weight.detach())

    def keep_bias(self) -> None:
        """Hold a loaded bias in ``bias_dtype`` (where the format names one)."""
        if self.bias is not None and self.bias_dtype is not None:
            self.bias = self.bias.to(self.bias_dtype)

    def dequantized_weight(self) -> Tensor:
        """The fp32 weight this module stands for: ``weight * weight_scale[:, None]``, [out, in]."""
        return self.weight.float() * self.weight_scale[:, None]

    def forward(self, inputs: Tensor) -> Tensor:
        """``inputs`` [..., in] -> [..., out] in the input's dtype (computed as described in the class)."""
        leading = inputs.shape[:-1]
        out = self.matmul(inputs.reshape(-1, self.in_features))
        return out.reshape(*leading, self.out_features).to(inputs.dtype)

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, {self.format_name} per-channel"


class Int8Linear(QuantizedLinear):
    """A `QuantizedLinear` in int8: `quantize_rows` weights, `int8_matmul` products in fp32, fp32 bias."""

    format_name = "int8"
    stored_dtype = torch.int8
    bias_dtype = torch.float32
    quantize = staticmethod(quantize_rows)

    def matmul(self, rows: Tensor) -> Tensor:
        return int8_matmul(rows, self.weight, self.weight_scale, self.bias)


def int8_linear_count(model: nn.Module) -> int:
    """The number of `Int8Linear` modules in ``model``."""
    return sum(1 for module in model.modules() if isinstance(module, Int8Linear))


def _decoder_layer_list(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no decoder 'layers' list")
    return layers


@dataclass
class LinearQuantPlan:
    """Which decoder layers get quantised Linears (``module_type``), and the loading steps that make them so
    (see the module docstring): `Int8Plan` here, `clef_runtime.model.fp8.Fp8Plan` for fp8.

    ``layers``: the indices (from `select_int8_layers`). Use either the three loading steps (``prepare`` on
    the meta-device model, ``convert`` per shard tensor, ``finish`` after ``load_state_dict``) or `apply`
    on an already loaded model.
    """

    layers: tuple[int, ...]
    _names: set[str] = field(default_factory=set)
    _scales: dict[str, Tensor] = field(default_factory=dict)

    module_type: ClassVar[type[QuantizedLinear]]

    def eligible(self, linear: nn.Linear) -> bool:
        """Whether ``linear`` can be quantised (a format may need aligned shapes); others stay as they are."""
        return True

    def _linears(self, model: nn.Module) -> Iterable[tuple[str, nn.Module, str, nn.Linear]]:
        """(qualified name, parent, attribute, linear) of each eligible ``nn.Linear`` of the chosen layers."""
        layers = _decoder_layer_list(model)
        for index in self.layers:
            for name, parent in layers[index].named_modules():
                for attribute, child in parent.named_children():
                    if isinstance(child, nn.Linear) and self.eligible(child):
                        qualified = ".".join(part for part in (f"layers.{index}", name, attribute) if part)
                        yield qualified, parent, attribute, child

    def prepare(self, model: nn.Module) -> None:
        """Swap the chosen layers' ``nn.Linear`` modules of ``model`` (on the meta device) for empty
        ``module_type`` placeholders; ``convert`` then fills their ``weight`` from the shards."""
        for qualified, parent, attribute, linear in list(self._linears(model)):
            with torch.device("meta"):
                replacement = self.module_type(
                    linear.in_features, linear.out_features, bias=linear.bias is not None
                )
            setattr(parent, attribute, replacement)
            self._names.add(f"{qualified}.weight")

    def convert(self, name: str, stored: Tensor, *, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The tensor to load for the shard tensor ``name`` (text-model name): quantised (on ``device``) for
        a weight that ``prepare`` swapped (its scale is kept for ``finish``), else ``stored`` cast to
        ``dtype``."""
        if name in self._names:
            values, scales = self.module_type.quantize(stored.to(device))
            self._scales[name] = scales
            return values
        return stored.to(device=device, dtype=dtype)

    def finish(self, model: nn.Module) -> int:
        """Install the scales ``convert`` computed (and hold any bias in the format's dtype); returns the
        number of quantised modules. Raises RuntimeError if a prepared weight was never converted."""
        count = 0
        layers = _decoder_layer_list(model)
        for index in self.layers:
            for name, module in layers[index].named_modules():
                if not isinstance(module, QuantizedLinear):
                    continue
                weight_name = ".".join(part for part in (f"layers.{index}", name, "weight") if part)
                scales = self._scales.pop(weight_name, None)
                if scales is None:
                    raise RuntimeError(
                        f"{module.format_name} weight {weight_name} was never read from the checkpoint"
                    )
                module.weight_scale = scales
                module.keep_bias()
                count += 1
        return count

    def apply(self, model: nn.Module) -> int:
        """Quantise the chosen layers of an already loaded ``model`` in place, one Linear at a time (each
        full-precision weight is dropped as its replacement is installed); returns the number of quantised
        modules made."""
        count = 0
        for _qualified, parent, attribute, linear in list(self._linears(model)):
            setattr(parent, attribute, self.module_type.from_linear(linear))
            count += 1
        return count


class Int8Plan(LinearQuantPlan):
    """`LinearQuantPlan` with `Int8Linear` modules (every decoder Linear shape qualifies)."""

    module_type = Int8Linear


def is_int8_weight(name: str, shape: Collection[int], layers: Collection[int]) -> bool:
    """True when the text tensor ``name`` (without the text prefix) of ``shape`` is a decoder Linear weight
    in ``layers``, i.e. one that ``--weights int8`` stores in int8 (decoder Linears are the only 2-D weights
    inside a layer: norms are 1-D, the DeltaNet convolution 3-D)."""
    match = _LAYER_WEIGHT.match(name)
    return match is not None and len(shape) == 2 and int(match.group(1)) in layers


def int8_weight_bytes(shape: Collection[int]) -> int:
    """Bytes of one int8 Linear weight of ``shape`` [out, in]: one per element plus a 4-byte scale per row."""
    rows, cols = shape
    return rows * cols + 4 * rows


def describe_layers(layers: Collection[int]) -> str:
    """``12-31``, ``0,2,5-7`` or ``none``: a compact form of sorted layer indices for logs."""
    ordered = sorted(layers)
    if not ordered:
        return "none"
    runs: list[str] = []
    start = previous = ordered[0]
    for index in [*ordered[1:], None]:
        if index is not None and index == previous + 1:
            previous = index
            continue
        runs.append(str(start) if start == previous else f"{start}-{previous}")
        if index is not None:
            start = previous = index
    return ",".join(runs)
