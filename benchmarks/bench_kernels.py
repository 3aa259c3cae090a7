"""Prefill time of a random Qwen3.5 text model with transformers' reference GDN kernels vs ours.

Not a test. Builds the text stack of a benchmark model (``--model``, default ``medium-1024``: hidden 1,024,
8 layers in the 3:1 DeltaNet/attention pattern with the release's head dims; `devtools.models`) in
memory with a small vocabulary, then times full-sequence prefills at each T with the reference kernels and
with ``install_cpu_kernels``, alternating between the two, and prints one JSON object.

FLOP/s counts the linear layers only (2 x non-embedding parameters x tokens, the usual convention), so the
DeltaNet scan, convolution, attention and norms show up as lost efficiency; it is also given as a fraction
of the fp32 GEMM limit over the model's own Linear shapes at that T, measured in the same run (the machine
record). With ``--profile`` each run is also broken down by component (timing wrappers around modules and
kernel functions: adds a little overhead).

The machine is shared and noisy: every number is reported as min and median over ``--repeats`` runs (plus
process CPU time), every sample kept; compare the two kernels only within one run. On a busy machine run it
with ``OMP_WAIT_POLICY=PASSIVE`` (see ``RECOMMENDED_CPU_ENVIRONMENT``), else 2-thread timings are dominated
by OpenMP threads spinning at barriers.

    python -m benchmarks.bench_kernels --T 1024,2048 --profile --json /tmp/kernels.json
    python -m benchmarks.bench_kernels --quick                 # smoke run (medium, T = 128, seconds)
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from devtools.results import add_run_arguments, publish, start_report
from devtools.timing import spread


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from devtools.models import GEOMETRIES

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", choices=sorted(GEOMETRIES), default="medium-1024")
    parser.add_argument("--T", default="1024,2048", help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="default: all CPUs of this process")
    parser.add_argument("--no-flush-denormal", action="store_true", help="leave denormals on (slow)")
    parser.add_argument("--profile", action="store_true", help="also time components (adds overhead)")
    parser.add_argument("--vocab", type=int, default=4096)
    add_run_arguments(parser, quick="medium, T = 128, one repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.T, args.repeats = "medium", "128", 1
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Threads and flush-to-zero first: OpenMP workers copy the FTZ flag when they are created.
    from clef_runtime.model.kernels import configure_cpu_threads

    threads = configure_cpu_threads(args.threads, flush_denormal=not args.no_flush_denormal)

    import torch
    from devtools.gemm import gemm_limit, model_shapes
    from devtools.models import text_model

    model = text_model(args.model, vocab_size=args.vocab)
    lengths = [int(t) for t in args.T.split(",")]
    result = start_report(
        "bench_kernels",
        __file__,
        argv,
        gemm_shapes=model_shapes(model.layers, lengths),
        gemm_repeats=max(args.repeats, 1),
    )
    linear_params = sum(
        module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear)
    )
    result.update(
        {
            "model": args.model,
            "config": {key: getattr(model.config, key) for key in CONFIG_KEYS},
            "linear_params": linear_params,
            "threads": threads,
            "flush_denormal": not args.no_flush_denormal,
            "runs": [],
        }
    )
    for seq_len in lengths:
        gemm = gemm_limit(result["machine"]["gemm"], "fp32", model_shapes(model.layers, [seq_len]))
        result["runs"].append(run_length(model, seq_len, args.repeats, linear_params, gemm, args.profile))
        print(json.dumps(result["runs"][-1]), file=sys.stderr, flush=True)
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return publish(result, args.json)


CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "vocab_size",
)


def run_length(
    model: Any, seq_len: int, repeats: int, linear_params: int, gemm: float, profile: bool
) -> dict[str, Any]:
    import torch

    from clef_runtime.model.kernels import install_cpu_kernels, uninstall_cpu_kernels

    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    variants = {"reference": uninstall_cpu_kernels, "clef": install_cpu_kernels}
    walls: dict[str, list[float]] = {name: [] for name in variants}
    cpus: dict[str, list[float]] = {name: [] for name in variants}
    outputs: dict[str, torch.Tensor] = {}
    breakdowns: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for switch in variants.values():  # warm-up (first calls allocate and initialise)
            switch(model)
            model(input_ids=ids[:, :64])
        for _ in range(repeats):
            for name, switch in variants.items():
                switch(model)
                cpu_start = time.process_time()
                wall_start = time.perf_counter()
                outputs[name] = model(input_ids=ids).last_hidden_state
                walls[name].append(time.perf_counter() - wall_start)
                cpus[name].append(time.process_time() - cpu_start)
        if profile:
            for name, switch in variants.items():
                switch(model)
                breakdowns[name] = component_breakdown(model, ids)
    uninstall_cpu_kernels(model)
    flops = 2 * linear_params * seq_len
    run: dict[str, Any] = {
        "T": seq_len,
        "gemm_limit_fp32_gflops": gemm,
        "max_abs_diff": (outputs["clef"] - outputs["reference"]).abs().max().item(),
    }
    for name in variants:
        best = min(walls[name])
        run[name] = {
            "wall_s_min": round(best, 3),
            "wall_s_median": round(statistics.median(walls[name]), 3),
            "wall_spread_s": spread(walls[name]),
            "cpu_s_min": round(min(cpus[name]), 3),
            "tokens_per_s": round(seq_len / best, 1),
            "linear_gflops": round(flops / best / 1e9, 1),
            "fraction_of_gemm": round(flops / best / 1e9 / gemm, 3),
        }
        if name in breakdowns:
            run[name]["breakdown_s"] = breakdowns[name]
    run["speedup_wall_min"] = round(run["reference"]["wall_s_min"] / run["clef"]["wall_s_min"], 2)
    run["speedup_spread"] = spread(a / b for a, b in zip(walls["reference"], walls["clef"], strict=True))
    return run


def component_breakdown(model: Any, ids: Any) -> dict[str, float]:
    """Seconds per component of one prefill, from timing wrappers (exclusive times)."""
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

    from clef_runtime.model import kernels

    totals: dict[str, float] = collections.defaultdict(float)
    restore: list[Callable[[], None]] = []

    def wrap(owner: Any, attribute: str, label: str) -> None:
        original = getattr(owner, attribute)
        had_instance_attribute = attribute in getattr(owner, "__dict__", {})

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start

        setattr(owner, attribute, wrapper)
        if had_instance_attribute or not isinstance(owner, torch.nn.Module):
            restore.append(lambda: setattr(owner, attribute, original))
        else:
            restore.append(lambda: owner.__dict__.pop(attribute, None))

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            label = (
                "mlp"
                if ".mlp." in name
                else "gdn_projections"
                if "linear_attn" in name
                else "attn_projections"
            )
            wrap(module, "forward", label)
        elif name.endswith("linear_attn"):
            wrap(module, "forward", "gdn_total")
        elif name.endswith("self_attn"):
            wrap(module, "forward", "attn_total")
        elif name.endswith("layernorm") or name == "norm":
            wrap(module, "forward", "rmsnorm")
        elif name.endswith("linear_attn.norm"):
            wrap(module, "forward", "gdn_gated_norm")
    for owner in (hf_qwen3_5, kernels):
        for attribute, label in (
            ("torch_chunk_gated_delta_rule", "gdn_delta_rule"),
            ("chunk_gated_delta_rule", "gdn_delta_rule"),
            ("causal_conv1d_fn", "gdn_conv"),
            ("causal_conv1d_time_major", "gdn_conv"),
            ("gated_rms_norm", "gdn_gated_norm"),
        ):
            if hasattr(owner, attribute):
                wrap(owner, attribute, label)
    try:
        start = time.perf_counter()
        model(input_ids=ids)
        total = time.perf_counter() - start
    finally:
        for undo in reversed(restore):
            undo()
    gdn_parts = ("gdn_projections", "gdn_delta_rule", "gdn_conv", "gdn_gated_norm")
    totals["gdn_other"] = totals.pop("gdn_total", 0.0) - sum(totals.get(part, 0.0) for part in gdn_parts)
    totals["attn_core"] = totals.pop("attn_total", 0.0) - totals.get("attn_projections", 0.0)
    totals["rest"] = total - sum(totals.values())
    breakdown = {label: round(seconds, 3) for label, seconds in sorted(totals.items())}
    breakdown["total"] = round(total, 3)
    return breakdown


if __name__ == "__main__":
    sys.exit(main())
