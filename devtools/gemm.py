"""GEMM limits: how fast this machine multiplies matrices, per dtype and shape, in the run they judge.

fp32 and bf16 are ``F.linear(x [T, K], w [N, K])``; int8 is ``torch._int_mm`` on int8 operands (what
`Int8Linear` calls), counted in GOP/s. Each (shape, dtype) gets one untimed warm-up, then ``repeats`` timed
calls; its rate is the best of them (the call least disturbed by other jobs), with every sample kept. The
*limit* of a dtype is the best rate over the shapes measured, and a figure is judged against the limit over
the shapes its model runs (`linear_shapes`), never against one shape: a model whose projections run faster
than the one shape measured would otherwise sit above "100%".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from devtools.timing import DEFAULT_REPEATS, repeat

__all__ = [
    "DTYPES",
    "QUICK_SHAPES",
    "STANDARD_SHAPES",
    "GemmShape",
    "gemm_limit",
    "linear_modules",
    "linear_shapes",
    "measure_gemm",
    "model_shapes",
]

DTYPES = ("fp32", "bf16", "int8")
_RATE_KEYS = {"fp32": "fp32_gflops", "bf16": "bf16_gflops", "int8": "int8_gops"}


@dataclass(frozen=True)
class GemmShape:
    """``[tokens x inner] @ [inner x outer]``: a Linear of ``inner -> outer`` applied to ``tokens`` rows."""

    tokens: int
    inner: int
    outer: int

    @property
    def operations(self) -> float:
        """Multiply-adds counted twice (the usual FLOP convention)."""
        return 2.0 * self.tokens * self.inner * self.outer

    @property
    def label(self) -> str:
        return f"[{self.tokens}x{self.inner}] @ [{self.inner}x{self.outer}]"


#: The release's projection shapes at T = 1,024 (4096 -> 4096, 4096 -> 12288, 12288 -> 4096) and a square one.
STANDARD_SHAPES: tuple[GemmShape, ...] = (
    GemmShape(1024, 4096, 4096),
    GemmShape(1024, 4096, 12288),
    GemmShape(1024, 12288, 4096),
    GemmShape(2048, 2048, 2048),
)
#: Small shapes for smoke runs and tests (their limits mean little).
QUICK_SHAPES: tuple[GemmShape, ...] = (
    GemmShape(64, 256, 256),
    GemmShape(64, 256, 768),
    GemmShape(96, 96, 96),
)


def linear_modules(model: nn.Module) -> Iterator[nn.Module]:
    """The Linear layers of ``model``: every module with integer ``in_features`` / ``out_features`` (an
    ``nn.Linear``, and `Int8Linear`, which is a plain ``nn.Module``)."""
    for module in model.modules():
        inner, outer = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if isinstance(inner, int) and isinstance(outer, int):
            yield module


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The distinct ``(in, out)`` sizes of the Linear layers in ``model`` (`linear_modules`), in order of
    first appearance."""
    seen: dict[tuple[int, int], None] = {}
    for module in linear_modules(model):
        seen.setdefault((module.in_features, module.out_features), None)
    return list(seen)


def model_shapes(model: nn.Module, tokens: Iterable[int]) -> list[GemmShape]:
    """Every Linear shape of ``model`` at each of ``tokens`` rows: the GEMMs a prefill of that length runs."""
    sizes = linear_shapes(model)
    return [GemmShape(count, inner, outer) for count in tokens for inner, outer in sizes]


def _operands(shape: GemmShape, dtype: str, device: torch.device) -> Callable[[], object]:
    generator = torch.Generator().manual_seed(shape.tokens * 31 + shape.inner * 7 + shape.outer)
    if dtype == "int8":
        x = torch.randint(-127, 128, (shape.tokens, shape.inner), dtype=torch.int8, generator=generator)
        w = torch.randint(-127, 128, (shape.outer, shape.inner), dtype=torch.int8, generator=generator)
        x, w = x.to(device), w.to(device)
        return lambda: torch._int_mm(x, w.t())
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    x = torch.randn(shape.tokens, shape.inner, generator=generator).to(device=device, dtype=torch_dtype)
    w = torch.randn(shape.outer, shape.inner, generator=generator).to(device=device, dtype=torch_dtype)
    return lambda: F.linear(x, w)


def measure_gemm(
    shapes: Sequence[GemmShape],
    *,
    dtypes: Sequence[str] = DTYPES,
    repeats: int = DEFAULT_REPEATS,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Measure every shape in every dtype; returns the JSON record.

    ``{"repeats", "device", "unit", "shapes": [{"shape", "tokens", "inner", "outer", "fp32_gflops":
    {"best", "median", "samples"}, ...}], "limit": {"fp32_gflops": best over shapes, ...}}``. A dtype this
    device cannot run at a shape (``torch._int_mm`` has size rules on CUDA) records ``{"error": ...}`` there.
    Raises ValueError for an unknown dtype, no shapes or ``repeats < 1``.
    """
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown or not shapes:
        raise ValueError(f"measure_gemm needs shapes and dtypes from {DTYPES}, got {list(dtypes)}")
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    rows = []
    with torch.inference_mode():
        for shape in shapes:
            row: dict[str, Any] = {
                "shape": shape.label,
                "tokens": shape.tokens,
                "inner": shape.inner,
                "outer": shape.outer,
            }
            for dtype in dtypes:
                try:
                    seconds = repeat(_operands(shape, dtype, device), repeats, sync=sync)
                except RuntimeError as error:  # a kernel this device lacks for this shape or dtype
                    row[_RATE_KEYS[dtype]] = {"error": str(error).splitlines()[0][:200]}
                    continue
                rates = seconds.map(lambda s, shape=shape: shape.operations / s / 1e9)
                row[_RATE_KEYS[dtype]] = {
                    "best": _significant(rates.max),
                    "median": _significant(rates.median),
                    "samples": [_significant(rate) for rate in rates.values],
                }
            rows.append(row)
    record: dict[str, Any] = {
        "repeats": repeats,
        "device": str(device),
        "unit": "GFLOP/s (int8: GOP/s), best of the repeats after one warm-up",
        "shapes": rows,
    }
    record["limit"] = {
        _RATE_KEYS[dtype]: gemm_limit(record, dtype) for dtype in dtypes if _has_rate(record, dtype)
    }
    return record


def _significant(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant digits (a small shape's rate stays visible, a large one is not
    given to the last MFLOP/s)."""
    return float(f"{value:.{digits}g}")


def _has_rate(record: dict[str, Any], dtype: str) -> bool:
    return any("best" in row.get(_RATE_KEYS[dtype], {}) for row in record["shapes"])


def gemm_limit(record: dict[str, Any], dtype: str, shapes: Iterable[GemmShape] | None = None) -> float:
    """The best rate of ``dtype`` in a `measure_gemm` record, over ``shapes`` (default: every shape in it).

    Raises KeyError when none of those shapes has a rate for ``dtype`` (not measured there)."""
    wanted = None if shapes is None else {(s.tokens, s.inner, s.outer) for s in shapes}
    rates = [
        row[_RATE_KEYS[dtype]]["best"]
        for row in record["shapes"]
        if "best" in row.get(_RATE_KEYS[dtype], {})
        and (wanted is None or (row["tokens"], row["inner"], row["outer"]) in wanted)
    ]
    if not rates:
        raise KeyError(f"no {dtype} GEMM rate measured at those shapes")
    return float(max(rates))
