"""Weight storage modes at the real 9B width: fp32 vs bf16 storage (fp32 compute) vs pure bf16.

Not a test. Each (mode, allocator setting) runs in its own subprocess, because glibc's malloc
settings must be in the environment before Python starts and because peak RSS is per process.
A worker builds the ``wide`` benchmark block (`devtools.models`: four Qwen3.5-9B layers, 3 Gated
DeltaNet + 1 attention, hidden 4096, intermediate 12288, all real head dims, vocabulary 4096 instead of
248,320) with the random-checkpoint recipe, applies the mode, installs the CPU kernels, and times
full-sequence prefills (``use_cache=False``) at each T. The parent process measures the machine record
with the GEMM limits (fp32, bf16, int8) over the block's own Linear shapes at each T.

Modes:
  fp32                 fp32 weights, transformers as is
  bf16-storage         bf16 Linear/Embedding weights, each converted into a shared fp32 scratch
                       just before its matmul (``apply_bf16_storage(model)``)
  bf16-compute         bf16 weights and bf16 matmuls, fp32 activations elsewhere
                       (``apply_bf16_storage(compute_dtype=torch.bfloat16)``)
  bf16                 ``model.to(torch.bfloat16)``: bf16 weights and activations

The 9B text stack is exactly 8 of these 4-layer blocks, so its prefill time is extrapolated as
8 x the block's time, and its memory as the 9B weights plus the working memory (peak RSS minus
weights) measured here. The machine is shared: numbers are noisy, each T is run ``--repeats``
times and min/median reported with the process CPU time (with ``--threads 1`` that is the most
stable figure), and the load average is recorded. Other environment variables (e.g.
``OMP_WAIT_POLICY=PASSIVE``) pass through to the workers.

    python -m benchmarks.bench_weights                       # all modes, tuned malloc; fp32 and
                                                             # bf16-storage also untuned
    python -m benchmarks.bench_weights --modes fp32,bf16-storage --malloc tuned --T 256
    python -m benchmarks.bench_weights --quick                # smoke run (medium block, T = 64)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from devtools.results import add_run_arguments, publish, start_report
from devtools.timing import spread

MALLOC_SETTINGS = {
    "MALLOC_MMAP_THRESHOLD_": "17179869184",
    "MALLOC_TRIM_THRESHOLD_": "68719476736",
    "MALLOC_TOP_PAD_": "1073741824",
}
MODES = ("fp32", "bf16-storage", "bf16-compute", "bf16")
DEFAULT_UNTUNED = ("fp32", "bf16-storage")

# Qwen3.5-9B text model (no lm_head): 7.937e9 parameters, 1.017e9 of them the embedding.
NINE_B_TEXT_PARAMS = 7_937_000_000
GIB = 1 << 30


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--malloc", choices=("tuned", "default", "both"), default="both")
    parser.add_argument(
        "--untuned-modes",
        default=",".join(DEFAULT_UNTUNED),
        help="with --malloc both: the modes also run with glibc's default allocator settings",
    )
    parser.add_argument("--T", default="256,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--model", default="wide", help="the block's geometry (default wide: the 9B's layers)"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--accuracy",
        action="store_true",
        help="instead of timing: compare bf16-compute and pure bf16 outputs with bf16 storage (fp32 compute)",
    )
    add_run_arguments(parser, quick="medium block, T = 64, 1 repeat")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.T, args.repeats = "medium", "64", 1
        args.modes, args.malloc = "fp32,bf16-storage", "tuned"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args)))
        return 0
    from clef_runtime.model.kernels import configure_cpu_threads

    configure_cpu_threads(args.threads)
    from devtools.gemm import model_shapes
    from devtools.models import text_model

    block = text_model(args.model, device="meta")
    report = start_report(
        "bench_weights",
        __file__,
        argv,
        gemm_shapes=model_shapes(block.layers, [int(t) for t in args.T.split(",")]),
        gemm_repeats=max(args.repeats, 1),
    )
    if args.accuracy:
        report["accuracy"] = run_accuracy(args)
    else:
        report["workers"] = run_workers(args)
        if args.model == "wide":
            report["nine_b"] = extrapolate(report["workers"])
    return publish(report, args.json)


def run_workers(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (mode, allocator) worker, one after the other; returns their results."""
    modes = [mode for mode in args.modes.split(",") if mode]
    jobs: list[tuple[str, bool]] = []
    if args.malloc in ("tuned", "both"):
        jobs += [(mode, True) for mode in modes]
    if args.malloc == "default":
        jobs += [(mode, False) for mode in modes]
    elif args.malloc == "both":
        jobs += [(mode, False) for mode in args.untuned_modes.split(",") if mode in modes]
    results = []
    for mode, tuned in jobs:
        results.append(spawn_worker(args, mode, tuned))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results


def spawn_worker(args: argparse.Namespace, mode: str, tuned: bool) -> dict[str, Any]:
    env = {key: value for key, value in os.environ.items() if key not in MALLOC_SETTINGS}
    if tuned:
        env.update(MALLOC_SETTINGS)
    command = [
        sys.executable,
        __file__,
        "--worker",
        "--mode",
        mode,
        "--T",
        args.T,
        "--repeats",
        str(args.repeats),
        "--model",
        args.model,
    ]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    started = time.perf_counter()
    completed = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        return {"mode": mode, "malloc_tuned": tuned, "error": completed.stderr[-2000:]}
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    result["subprocess_wall_s"] = round(time.perf_counter() - started, 1)
    return result


def extrapolate(results: list[dict[str, Any]]) -> dict[str, Any]:
    """9B estimates per (mode, malloc): 8 x the block's prefill time; weights + measured working memory."""
    from devtools.models import GEOMETRIES

    blocks = GEOMETRIES["release"].layers // GEOMETRIES["wide"].layers
    estimates: dict[str, Any] = {}
    for result in results:
        if "error" in result:
            continue
        bytes_per_param = 4 if result["mode"] == "fp32" else 2
        weights_gib = NINE_B_TEXT_PARAMS * bytes_per_param / GIB
        working_gib = max(0.0, result["peak_rss_gib"] - result["rss_after_build_gib"])
        key = f"{result['mode']}{'' if result['malloc_tuned'] else ' (default malloc)'}"
        estimates[key] = {
            "weights_gib": round(weights_gib, 1),
            "peak_gib_estimate": round(weights_gib + working_gib + result["scratch_gib"], 1),
            "prefill": {
                str(run["T"]): {
                    "seconds": round(blocks * run["wall_s_min"], 1),
                    "tokens_per_s": round(run["T"] / (blocks * run["wall_s_min"]), 2),
                }
                for run in result["runs"]
            },
        }
    return estimates


# ----------------------------------------------------------------------------------------------
# worker


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    from clef_runtime.model.kernels import configure_cpu_threads

    threads = configure_cpu_threads(args.threads)  # first: FTZ must precede any parallel work
    import torch
    from devtools.models import text_model

    from clef_runtime.model.kernels import install_cpu_kernels
    from clef_runtime.model.weights import apply_bf16_storage, parameter_bytes

    load_start = os.getloadavg()
    build_start = time.perf_counter()
    mode = args.mode
    model = text_model(args.model, torch.float32 if mode == "fp32" else torch.bfloat16)
    if mode in ("bf16-storage", "bf16-compute"):
        apply_bf16_storage(model, compute_dtype=torch.bfloat16 if mode == "bf16-compute" else torch.float32)
    install_cpu_kernels(model)
    build_s = time.perf_counter() - build_start
    rss_after_build = current_rss_bytes()
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    upcast_s = measure_layer_upcast(model) if mode.startswith("bf16-storage") else None

    runs = []
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 4096, (1, 64), generator=generator), use_cache=False)  # warm-up
        for seq_len in (int(t) for t in args.T.split(",")):
            ids = torch.randint(0, 4096, (1, seq_len), generator=generator)
            walls, cpus = [], []
            for _ in range(args.repeats):
                cpu_start = time.process_time()
                start = time.perf_counter()
                out = model(input_ids=ids, use_cache=False).last_hidden_state
                walls.append(time.perf_counter() - start)
                cpus.append(time.process_time() - cpu_start)
            assert torch.isfinite(out).all()
            best = min(walls)
            runs.append(
                {
                    "T": seq_len,
                    "wall_s_min": round(best, 3),
                    "wall_s_median": round(statistics.median(walls), 3),
                    "wall_spread_s": spread(walls),
                    # CPU seconds of the process: with one thread, robust to time-slicing on a busy machine.
                    "cpu_s_min": round(min(cpus), 3),
                    "tokens_per_s": round(seq_len / best, 1),
                    "linear_gflops": round(2 * linear_params * seq_len / best / 1e9, 1),
                }
            )
    return {
        "mode": mode,
        "malloc_tuned": all(os.environ.get(k) == v for k, v in MALLOC_SETTINGS.items()),
        "threads": threads,
        "param_bytes_gib": round(parameter_bytes(model) / GIB, 3),
        "scratch_gib": round(scratch_bytes(model) / GIB, 3),
        "build_s": round(build_s, 1),
        "one_layer_upcast_s": None if upcast_s is None else round(upcast_s, 3),
        "rss_after_build_gib": round(rss_after_build / GIB, 3),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 3),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "runs": runs,
    }


def run_accuracy(args: argparse.Namespace) -> dict[str, Any]:
    """Final-norm hidden states of the 4 real-width layers under each compute mode, same weights.

    The reference is bf16 storage with fp32 compute (exactly an fp32 model with these bf16
    weights). Random weights: this shows the size of the rounding, not how a trained model's
    answers move.
    """
    import torch
    from devtools.models import text_model

    from clef_runtime.model.kernels import install_cpu_kernels
    from clef_runtime.model.weights import apply_bf16_storage, set_linear_compute_dtype

    seq_len = max(int(t) for t in args.T.split(","))
    ids = torch.randint(0, 4096, (1, seq_len), generator=torch.Generator().manual_seed(0))
    outputs: dict[str, Any] = {}
    with torch.inference_mode():
        model = text_model(args.model, torch.bfloat16)
        apply_bf16_storage(model)
        install_cpu_kernels(model)
        outputs["bf16-storage"] = model(input_ids=ids, use_cache=False).last_hidden_state
        set_linear_compute_dtype(model, torch.bfloat16)
        outputs["bf16-compute"] = model(input_ids=ids, use_cache=False).last_hidden_state
        del model
        model = text_model(args.model, torch.bfloat16)  # same seed: the same bf16 weights
        install_cpu_kernels(model)
        outputs["bf16"] = model(input_ids=ids, use_cache=False).last_hidden_state.float()
    reference = outputs["bf16-storage"].double()[0]
    report: dict[str, Any] = {
        "T": seq_len,
        "reference": "bf16-storage",
        "reference_abs_max": reference.abs().max().item(),
    }
    for name in ("bf16-compute", "bf16"):
        other = outputs[name].double()[0]
        cosine = torch.nn.functional.cosine_similarity(other, reference, dim=-1)
        report[name] = {
            "max_abs_diff": round((other - reference).abs().max().item(), 5),
            "mean_abs_diff": round((other - reference).abs().mean().item(), 6),
            "relative_l2": round(((other - reference).norm() / reference.norm()).item(), 6),
            "min_row_cosine": round(cosine.min().item(), 7),
        }
    return report


def measure_layer_upcast(model: Any) -> float:
    """Seconds to convert one DeltaNet layer's bf16 Linear weights into a preallocated fp32 buffer."""
    import torch

    linears = [m for m in model.layers[0].modules() if isinstance(m, torch.nn.Linear)]
    buffer = torch.empty(sum(m.weight.numel() for m in linears))
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        offset = 0
        for linear in linears:
            buffer[offset : offset + linear.weight.numel()].view(linear.weight.shape).copy_(linear.weight)
            offset += linear.weight.numel()
        best = min(best, time.perf_counter() - start)
    return best


def scratch_bytes(model: Any) -> int:
    """Bytes of the fp32 scratch that bf16 storage allocated (0 if none)."""
    for module in model.modules():
        scratch = getattr(module, "_clef_scratch", None)
        if scratch is not None:
            return scratch.buffer.numel() * 4
    return 0


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


if __name__ == "__main__":
    sys.exit(main())
