"""Real-width figures: the 9B release's layer geometry at T = 256 / 1k (/ 4k), fp32 vs bf16 storage vs int8.

Not a test. A block of 4 Qwen3.5-9B layers in the release's 3:1 pattern (3 Gated DeltaNet + 1 attention:
hidden 4096, intermediate 12288, the real attention and DeltaNet head dims; random weights, built by
``bench_weights.build_real_block``) is timed as a full prefill (``use_cache=False``, clef's CPU kernels
installed). The embedding and lm_head are left out (vocabulary 4096 instead of 248,320: a row gather and a
table the backbone never multiplies by); the 9B's 32 layers are 8 such blocks.

Memory (< 8 GB) decides the order; every comparison is measured side by side in one phase:

1. fp32 block and int8 block (the int8 block is the ``late`` layers' configuration: every Linear int8),
   interleaved per T, with the machine's fp32 and int8 GEMM limits ([T x 4096] @ [4096 x 12288]: fp32
   ``F.linear`` and ``torch._int_mm`` on int8 operands) measured in the same loop;
2. the fp32 block dropped, a bf16-storage block timed interleaved with the int8 block again.

Projection to the 9B: seconds = 8 x block seconds for a uniform mode; ``int8 late`` = 12 layers of the
exact mode + 20 int8 layers (per-layer time = block / 4). Useful FLOPs counted: the Linears only
(2 x weights x T), so the fraction of the GEMM limit is a lower bound.

    flock /tmp/clef-bench.lock .venv/bin/python benchmarks/bench_realwidth.py \\
        --json benchmarks/results/realwidth.json [--T 256 1024 4096] [--profile]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_int8 import best_seconds, machine
from bench_weights import build_real_block

NINE_B_LAYERS = 32
BLOCK_LAYERS = 4
LATE_INT8_LAYERS = 20  # layers 12-31 of 32


def linear_weights(model: Any) -> int:
    """Weights of the block's Linears (int8 ones included)."""
    import torch

    from clef_runtime.model.quantize import Int8Linear

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear | Int8Linear))


def gemm_limits(tokens: int, repeats: int) -> dict[str, float]:
    """GFLOP/s of [T x 4096] @ [4096 x 12288]: fp32 F.linear and int8 ``torch._int_mm``."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 4096, generator=generator)
    w = torch.randn(12288, 4096, generator=generator)
    xq = torch.randint(-127, 128, (tokens, 4096), dtype=torch.int8, generator=generator)
    wq = torch.randint(-127, 128, (12288, 4096), dtype=torch.int8, generator=generator)
    flops = 2 * tokens * 4096 * 12288
    with torch.inference_mode():
        fp32 = best_seconds(lambda: F.linear(x, w), repeats)
        int8 = best_seconds(lambda: torch._int_mm(xq, wq.t()), repeats)
    return {"fp32_gflops": round(flops / fp32 / 1e9, 1), "int8_gops": round(flops / int8 / 1e9, 1)}


def build(mode: str) -> Any:
    """The 4-layer block in ``mode`` (fp32, bf16-storage, int8), CPU kernels installed."""
    import torch

    from clef_runtime.model.kernels import install_cpu_kernels
    from clef_runtime.model.quantize import Int8Plan
    from clef_runtime.model.weights import apply_bf16_storage

    model = build_real_block(torch.float32 if mode == "fp32" else torch.bfloat16)
    if mode == "bf16-storage":
        apply_bf16_storage(model)
    elif mode == "int8":
        Int8Plan(tuple(range(BLOCK_LAYERS))).apply(model)
        gc.collect()
    install_cpu_kernels(model)
    return model


def time_block(model: Any, tokens: int, repeats: int) -> float:
    import torch

    ids = torch.randint(0, 4096, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        return best_seconds(lambda: model(input_ids=ids, use_cache=False), repeats)


def phase(models: dict[str, Any], tokens_list: list[int], repeats: int) -> dict[int, dict[str, Any]]:
    """Block seconds per mode and GEMM limits, interleaved at each T."""
    rows: dict[int, dict[str, Any]] = {}
    for tokens in tokens_list:
        row: dict[str, Any] = {"gemm": gemm_limits(tokens, repeats)}
        for name, model in models.items():
            row[name] = {"block_s": round(time_block(model, tokens, repeats), 3)}
            row[name]["linear_gflops"] = round(
                2 * linear_weights(model) * tokens / row[name]["block_s"] / 1e9, 1
            )
        rows[tokens] = row
        print(json.dumps({"T": tokens, **row}), file=sys.stderr, flush=True)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="profile one fp32 and one int8 prefill at 1k")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from clef_runtime.model.kernels import configure_cpu_threads

    configure_cpu_threads()
    result: dict[str, Any] = {"benchmark": "bench_realwidth", "machine": machine(), "T": args.T}
    int8 = build("int8")
    fp32 = build("fp32")
    first = phase({"fp32": fp32, "int8": int8}, args.T, args.repeats)
    if args.profile:
        result["profile_1k"] = {"fp32": profile(fp32, 1024), "int8": profile(int8, 1024)}
    del fp32
    gc.collect()
    bf16 = build("bf16-storage")
    second = phase({"bf16-storage": bf16, "int8": int8}, args.T, args.repeats)
    table = []
    for tokens in args.T:
        a, b = first[tokens], second[tokens]
        # bf16-storage is scaled by the int8 block measured in both phases (the common yardstick).
        scale = a["int8"]["block_s"] / b["int8"]["block_s"]
        blocks = {
            "fp32": a["fp32"]["block_s"],
            "int8": a["int8"]["block_s"],
            "bf16-storage": b["bf16-storage"]["block_s"] * scale,
        }
        tokens_per_s = project(blocks, tokens)
        table.append(
            {
                "T": tokens,
                "gemm_limit_fp32_gflops": a["gemm"]["fp32_gflops"],
                "gemm_limit_int8_gops": a["gemm"]["int8_gops"],
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
            }
        )
    result.update({"phase_fp32_int8": first, "phase_bf16_int8": second, "table": table})
    result["loadavg_end"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
