"""``--weights int8`` measured: candidate int8 kernels vs fp32, the 9B release's memory, drift and speed.

Not a test. Sections (``--sections``, all by default), each measured in this one process:

- ``kernels``: at the release's shapes ([T x 4096] @ [4096 x 4096], 4096 -> 12288, 12288 -> 4096 for
  T = 128 / 1024 / 4096), seconds of fp32 ``F.linear`` and of each int8 candidate (best of ``--repeats``
  after a warm-up, every sample kept), interleaved shape by shape: clef's `Int8Linear` (per-channel int8
  weights, per-token int8 activations, ``torch._int_mm``), torch's dynamic quantized linear (per-tensor
  activations) with the fbgemm/x86 and the oneDNN packings, oneDNN's ``qlinear_pointwise`` with a
  per-tensor activation scale, and int8 weight-only (``torch._weight_int8pack_mm``). Relative output error
  vs fp32 for each. The machine record's GEMM limits are measured at the same shapes.
- ``memory``: the 9B release's need from its safetensors layout (header entries built from the release
  geometry, no weights): bf16 storage, int8 late / all with bf16 or fp32 elsewhere.
- ``drift``: ``--requests`` generated requests (varied states, 1-3 questions of each type) decided by the
  ``--model`` benchmark model (default ``medium-1024``) in fp32, int8 ``late`` and int8 ``all``: max and
  mean |dp| over every option probability, top-1 agreement per question; then backbone prefill seconds at
  ``--prefill-tokens`` for the three, interleaved, ``--repeats`` times.

    python -m benchmarks.bench_int8 --json benchmarks/results/int8.json
    python -m benchmarks.bench_int8 --quick --json /tmp/int8.json          # smoke run on tiny (seconds)
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from devtools.flags import engine_options
from devtools.gemm import QUICK_SHAPES, GemmShape
from devtools.models import GEOMETRIES, model_directory, resolve_model
from devtools.requests import answer_vectors, drift, generated_requests
from devtools.results import add_run_arguments, publish, start_report
from devtools.timing import Samples, repeat, spread
from torch import nn

from clef_runtime.model.quantize import Int8Linear

SECTIONS = ("kernels", "memory", "drift")
KERNEL_SHAPES = ((4096, 4096), (4096, 12288), (12288, 4096))  # (in, out): the release's projections


def _timing(seconds: Samples) -> dict[str, Any]:
    return {"s": round(seconds.min, 4), "spread_s": seconds.summary()}


# ------------------------------------------------------------------------------------------- kernels


def kernel_candidates(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each int8 way of computing ``x @ weight.T``, prepared once for ``weight`` [out, in]."""
    candidates: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight
    clef = Int8Linear.from_linear(linear)
    candidates["clef Int8Linear (per-token act, _int_mm)"] = clef
    values, scales = clef.weight, clef.weight_scale
    per_channel = torch.quantize_per_channel(
        weight, scales.double(), torch.zeros(weight.shape[0], dtype=torch.long), 0, torch.qint8
    )
    for engine in ("x86", "onednn"):
        if engine in torch.backends.quantized.supported_engines:
            torch.backends.quantized.engine = engine
            packed = torch.ops.quantized.linear_prepack(per_channel, None)
            candidates[f"quantized.linear_dynamic {engine} (per-tensor act)"] = lambda x, packed=packed: (
                torch.ops.quantized.linear_dynamic(x, packed, False)
            )
    onednn_weight = torch.ops.onednn.qlinear_prepack(values, None)
    zero_points = torch.zeros(weight.shape[0], dtype=torch.int32)

    def qlinear_pointwise(x: torch.Tensor) -> torch.Tensor:
        qx = torch.quantize_per_tensor_dynamic(x, torch.quint8, False)
        return torch.ops.onednn.qlinear_pointwise(
            qx.int_repr(), qx.q_scale(), qx.q_zero_point(), onednn_weight, scales, zero_points,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip

    candidates["onednn qlinear_pointwise (per-tensor act)"] = qlinear_pointwise
    candidates["weight-only _weight_int8pack_mm"] = lambda x: torch._weight_int8pack_mm(x, values, scales)
    return candidates


def section_kernels(args: argparse.Namespace) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for inner, outer in KERNEL_SHAPES:
        weight = torch.randn(outer, inner, generator=generator) * 0.02
        candidates = kernel_candidates(weight)
        for tokens in args.kernel_tokens:
            x = torch.randn(tokens, inner, generator=generator)
            with torch.inference_mode():
                exact = F.linear(x, weight)
                fp32 = repeat(lambda x=x, weight=weight: F.linear(x, weight), args.repeats)
                row: dict[str, Any] = {"T": tokens, "in": inner, "out": outer, "fp32": _timing(fp32)}
                row["fp32_gflops"] = round(2 * tokens * inner * outer / fp32.min / 1e9, 1)
                for name, call in candidates.items():
                    if name.startswith("weight-only") and tokens > args.weight_only_max_tokens:
                        continue  # measured ~1 GFLOP/s at T = 1024 here: minutes per call beyond
                    out = call(x)
                    seconds = repeat(lambda call=call, x=x: call(x), args.repeats)
                    error = ((out - exact).norm() / exact.norm()).item()
                    row[name] = {
                        **_timing(seconds),
                        "speedup_vs_fp32": round(fp32.min / seconds.min, 2),
                        "relative_error": round(error, 5),
                    }
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "fp32"}), file=sys.stderr, flush=True)
    return {"rows": rows}


# -------------------------------------------------------------------------------------------- memory


def release_info() -> Any:
    """A `CheckpointInfo` with the 9B release's tensor names and shapes (bf16 headers), built from its
    geometry on the meta device: no weights, no files (`clef_runtime.model.layouts`)."""
    from clef_runtime.model.layouts import release_layout

    return release_layout("Cloudflare/clef-flash")


def section_memory(args: argparse.Namespace) -> dict[str, Any]:
    from clef_runtime.model.memory import estimate_model_memory
    from clef_runtime.model.quantize import select_int8_layers

    info = release_info()
    layers = GEOMETRIES["release"].layers
    text_params = sum(t.numel for n, t in info.tensors.items() if n.startswith("model.language_model."))
    rows = {}
    for label, dtype, spec in (
        ("fp32", torch.float32, None),
        ("bf16-storage", torch.bfloat16, None),
        ("int8 late (12-31) + fp32", torch.float32, "late"),
        ("int8 late (12-31) + bf16-storage", torch.bfloat16, "late"),
        ("int8 all + bf16-storage", torch.bfloat16, "all"),
    ):
        selected = select_int8_layers(spec, layers) if spec else ()
        estimate = estimate_model_memory(info, device="cpu", dtype=dtype, int8_layers=selected)
        rows[label] = {
            "total_gb": round(estimate.total_bytes / 1e9, 2),
            "text_gb": round(estimate.text_bytes / 1e9, 2),
            "describe": estimate.describe(),
        }
    return {"tensors": len(info.tensors), "text_params": text_params, "estimates": rows}


# --------------------------------------------------------------------------------------------- drift

VARIANTS: dict[str, dict[str, str]] = {
    "fp32": {"weights": "fp32"},
    "int8 late": {"weights": "int8", "int8_layers": "late"},
    "int8 all": {"weights": "int8", "int8_layers": "all"},
}


def section_drift(args: argparse.Namespace) -> dict[str, Any]:
    from clef_runtime.engine.clef import Clef
    from clef_runtime.model.backbone import Backbone

    path = resolve_model(args.model)
    requests = generated_requests(args.requests, args.seed)
    vectors: dict[str, list[list[list[float]]]] = {}
    for name, values in VARIANTS.items():
        clef = Clef.load(path, engine_options(cache_mb=0, **values))
        vectors[name] = [answer_vectors(clef.decide(request)) for request in requests]
        print(f"{name}: {len(requests)} requests decided", file=sys.stderr, flush=True)
        del clef
        gc.collect()
    report: dict[str, Any] = {"model": args.model, "requests": len(requests)}
    for name in ("int8 late", "int8 all"):
        report[name] = drift(vectors["fp32"], vectors[name])

    # Prefill speed: the three backbones side by side, interleaved repetition by repetition.
    directory = model_directory(args.model)
    backbones = {}
    for name, values in VARIANTS.items():
        options = engine_options(**values)
        backbones[name] = Backbone.load(
            directory, device="cpu", weights=options.weights, int8_layers=options.int8_layers
        )
    ids = [random.Random(1).randrange(1000, 200_000) for _ in range(args.prefill_tokens)]
    for backbone in backbones.values():
        backbone.hidden_states(ids[:64])  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in backbones}
    for _ in range(args.repeats):
        for name, backbone in backbones.items():
            seconds[name] += repeat(lambda backbone=backbone: backbone.hidden_states(ids), 1, warmup=0).values
    fp32 = seconds["fp32"]
    report["prefill"] = {
        "tokens": args.prefill_tokens,
        "seconds": {name: round(min(values), 3) for name, values in seconds.items()},
        "spread_s": {name: spread(values) for name, values in seconds.items()},
        "speedup_vs_fp32": {name: round(min(fp32) / min(values), 2) for name, values in seconds.items()},
        # fp32 / mode for each interleaved repetition.
        "speedup_spread": {
            name: spread(a / b for a, b in zip(fp32, values, strict=True)) for name, values in seconds.items()
        },
    }
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--kernel-tokens", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--weight-only-max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    add_run_arguments(parser, quick="T = 64, tiny model, 4 requests, 1 repeat", model="medium-1024")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.kernel_tokens, args.repeats, args.model = [64], 1, "tiny"
        args.requests, args.prefill_tokens, args.weight_only_max_tokens = 4, 128, 64

    from clef_runtime.model.kernels import configure_cpu_threads

    configure_cpu_threads()
    shapes = [GemmShape(t, i, o) for i, o in KERNEL_SHAPES for t in args.kernel_tokens]
    result = start_report(
        "bench_int8",
        __file__,
        argv,
        gemm_shapes=QUICK_SHAPES if args.quick else shapes,
        gemm_repeats=max(args.repeats, 1),
    )
    result["args"] = {
        key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()
    }
    sections: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
        "kernels": section_kernels,
        "memory": section_memory,
        "drift": section_drift,
    }
    for name in args.sections:
        result[name] = sections[name](args)
    return publish(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
