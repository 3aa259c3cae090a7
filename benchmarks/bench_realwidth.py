"""Real-width figures: the 9B release's layer geometry at T = 256 / 1k (/ 4k), fp32 vs bf16 storage vs int8.

Not a test. The ``wide`` benchmark block, 4 Qwen3.5-9B layers in the release's 3:1 pattern (3 Gated
DeltaNet + 1 attention: hidden 4096, intermediate 12288, the real attention and DeltaNet head dims; random
weights from the checkpoint recipe, `devtools.models.text_model`), is timed as a full prefill
(``use_cache=False``, clef's CPU kernels installed). The embedding and lm_head are left out (vocabulary
4096 instead of 248,320: a row gather and a table the backbone never multiplies by); the 9B's 32 layers
are 8 such blocks.

Memory (< 8 GB) decides the order; every comparison is measured side by side in one phase:

1. fp32 block and int8 block (the int8 block is the ``late`` layers' configuration: every Linear int8),
   interleaved per T, with the machine's GEMM limits (fp32 ``F.linear``, int8 ``torch._int_mm``) over
   every Linear shape of the block at that T measured in the same loop;
2. the fp32 block dropped, a bf16-storage block timed interleaved with the int8 block again.

Each block time is the best of ``--repeats`` prefills (every sample kept with its spread); a fraction of
the limit is the block's useful FLOP/s over the best GEMM rate of the block's own shapes at that T.

Projection to the 9B: seconds = 8 x block seconds for a uniform mode; ``int8 late`` = 12 layers of the
exact mode + 20 int8 layers (per-layer time = block / 4). Useful FLOPs counted: the Linears only
(2 x weights x T), so the fraction of the GEMM limit is a lower bound.

    python -m benchmarks.bench_realwidth --json benchmarks/results/realwidth.json [--T 256 1024] [--profile]
    python -m benchmarks.bench_realwidth --quick         # smoke run (medium geometry, T = 64, seconds)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Sequence
from typing import Any

from devtools.gemm import gemm_limit, measure_gemm, model_shapes
from devtools.models import GEOMETRIES, text_model
from devtools.results import add_run_arguments, publish, start_report
from devtools.timing import Samples, repeat

NINE_B_LAYERS = GEOMETRIES["release"].layers
BLOCK_LAYERS = GEOMETRIES["wide"].layers
LATE_INT8_LAYERS = 20  # layers 12-31 of 32


def linear_weights(model: Any) -> int:
    """Weights of the block's Linears (int8 ones included)."""
    import torch

    from clef_runtime.model.quantize import Int8Linear

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear | Int8Linear))


def gemm_limits(model: Any, tokens: int, repeats: int) -> dict[str, Any]:
    """fp32 and int8 GEMM limits over the block's Linear shapes at ``tokens`` rows, and each shape's rate."""
    shapes = model_shapes(model.layers, [tokens])
    record = measure_gemm(shapes, dtypes=("fp32", "int8"), repeats=repeats)
    return {
        "fp32_gflops": gemm_limit(record, "fp32"),
        "int8_gops": gemm_limit(record, "int8"),
        "shapes": record["shapes"],
    }


def build(mode: str, geometry: str) -> Any:
    """The block of ``geometry`` in ``mode`` (fp32, bf16-storage, int8), CPU kernels installed."""
    import torch

    from clef_runtime.model.kernels import install_cpu_kernels
    from clef_runtime.model.quantize import Int8Plan
    from clef_runtime.model.weights import apply_bf16_storage

    model = text_model(geometry, torch.float32 if mode == "fp32" else torch.bfloat16)
    if mode == "bf16-storage":
        apply_bf16_storage(model)
    elif mode == "int8":
        Int8Plan(tuple(range(len(model.layers)))).apply(model)
        gc.collect()
    install_cpu_kernels(model)
    return model


def time_block(model: Any, tokens: int, repeats: int) -> Samples:
    import torch

    ids = torch.randint(0, 4096, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        return repeat(lambda: model(input_ids=ids, use_cache=False), repeats)


def phase(models: dict[str, Any], tokens_list: list[int], repeats: int) -> dict[int, dict[str, Any]]:
    """Block seconds per mode and GEMM limits, interleaved at each T."""
    rows: dict[int, dict[str, Any]] = {}
    for tokens in tokens_list:
        row: dict[str, Any] = {"gemm": gemm_limits(next(iter(models.values())), tokens, repeats)}
        for name, model in models.items():
            seconds = time_block(model, tokens, repeats)
            row[name] = {"block_s": round(seconds.min, 3), "block_spread_s": seconds.summary()}
            row[name]["linear_gflops"] = round(
                2 * linear_weights(model) * tokens / row[name]["block_s"] / 1e9, 1
            )
        rows[tokens] = row
        shown = {name: value for name, value in row.items() if name != "gemm"}
        print(json.dumps({"T": tokens, **shown}), file=sys.stderr, flush=True)
    return rows


def profile(model: Any, tokens: int) -> list[dict[str, Any]]:
    """The top operators by self CPU time for one prefill (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ids = torch.randint(0, 4096, (1, tokens))
    with torch.inference_mode(), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        model(input_ids=ids, use_cache=False)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return [
        {
            "op": e.key,
            "self_ms": round(e.self_cpu_time_total / 1000, 1),
            "share": round(e.self_cpu_time_total / total, 3),
        }
        for e in events
    ]


def project(block_s: dict[str, float], tokens: int) -> dict[str, float]:
    """9B prefill tokens/s per mode from block seconds (see the module docstring)."""
    per_layer = {name: seconds / BLOCK_LAYERS for name, seconds in block_s.items()}
    seconds = {name: NINE_B_LAYERS * value for name, value in per_layer.items()}
    if "int8" in per_layer:
        for exact in ("fp32", "bf16-storage"):
            if exact in per_layer:
                early = NINE_B_LAYERS - LATE_INT8_LAYERS
                seconds[f"int8 late + {exact}"] = (
                    early * per_layer[exact] + LATE_INT8_LAYERS * per_layer["int8"]
                )
        seconds["int8 all"] = seconds.pop("int8")
    return {name: round(tokens / value, 2) for name, value in seconds.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="profile one fp32 and one int8 prefill at 1k")
    add_run_arguments(parser, quick="the medium geometry at T = 64 (its figures mean nothing)")
    args = parser.parse_args(argv)
    geometry = "medium" if args.quick else "wide"
    if args.quick:
        args.T, args.repeats, args.profile = [64], 1, False

    from clef_runtime.model.kernels import configure_cpu_threads

    configure_cpu_threads()
    int8 = build("int8", geometry)
    fp32 = build("fp32", geometry)
    result = start_report(
        "bench_realwidth",
        __file__,
        argv,
        gemm_shapes=model_shapes(fp32.layers, args.T),
        gemm_repeats=args.repeats,
    )
    result.update({"geometry": geometry, "T": args.T, "repeats": args.repeats})
    first = phase({"fp32": fp32, "int8": int8}, args.T, args.repeats)
    if args.profile:
        result["profile_1k"] = {"fp32": profile(fp32, 1024), "int8": profile(int8, 1024)}
    del fp32
    gc.collect()
    bf16 = build("bf16-storage", geometry)
    second = phase({"bf16-storage": bf16, "int8": int8}, args.T, args.repeats)
    result.update(
        {"phase_fp32_int8": first, "phase_bf16_int8": second, "table": table(args.T, first, second)}
    )
    return publish(result, args.json)


def table(tokens_list: list[int], first: dict[int, Any], second: dict[int, Any]) -> list[dict[str, Any]]:
    """One row per T: limits, fractions of them, per-layer seconds and the 9B projection."""
    rows = []
    for tokens in tokens_list:
        a, b = first[tokens], second[tokens]
        # bf16-storage is scaled by the int8 block measured in both phases (the common yardstick).
        scale = a["int8"]["block_s"] / b["int8"]["block_s"]
        blocks = {
            "fp32": a["fp32"]["block_s"],
            "int8": a["int8"]["block_s"],
            "bf16-storage": b["bf16-storage"]["block_s"] * scale,
        }
        tokens_per_s = project(blocks, tokens)
        rows.append(
            {
                "T": tokens,
                "gemm_limit_fp32_gflops": a["gemm"]["fp32_gflops"],
                "gemm_limit_int8_gops": a["gemm"]["int8_gops"],
                "gemm_limit_shapes": len(a["gemm"]["shapes"]),
                "fp32_linear_gflops": a["fp32"]["linear_gflops"],
                "fp32_fraction_of_gemm_limit": round(
                    a["fp32"]["linear_gflops"] / a["gemm"]["fp32_gflops"], 3
                ),
                "int8_linear_gops": a["int8"]["linear_gflops"],
                "int8_fraction_of_gemm_limit": round(a["int8"]["linear_gflops"] / a["gemm"]["int8_gops"], 3),
                "per_layer_s": {name: round(value / BLOCK_LAYERS, 3) for name, value in blocks.items()},
                "nine_b_tokens_per_s": tokens_per_s,
                "int8_late_vs_fp32": round(tokens_per_s["int8 late + fp32"] / tokens_per_s["fp32"], 2),
                "int8_all_vs_fp32": round(tokens_per_s["int8 all"] / tokens_per_s["fp32"], 2),
                # The same ratio per repetition of the first phase (fp32 and int8 timed side by side).
                "int8_late_vs_fp32_spread": _late_spread(a, tokens),
            }
        )
    return rows


def _late_spread(row: dict[str, Any], tokens: int) -> dict[str, Any]:
    pairs = zip(
        row["fp32"]["block_spread_s"]["samples"], row["int8"]["block_spread_s"]["samples"], strict=True
    )
    ratios = []
    for fp32_s, int8_s in pairs:
        projected = project({"fp32": fp32_s, "int8": int8_s}, tokens)
        ratios.append(projected["int8 late + fp32"] / projected["fp32"])
    return Samples.of(ratios).summary(3)


if __name__ == "__main__":
    sys.exit(main())
