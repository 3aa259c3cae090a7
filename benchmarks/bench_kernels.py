"""Prefill time of a random Qwen3.5 text model with transformers' reference GDN kernels vs ours.

Not a test. Builds a random ``Qwen3_5TextModel`` (default "medium": hidden 1024, 8 layers in the
3:1 DeltaNet/attention pattern, the real 9B head dims - 16 k / 32 v heads x 128 for the DeltaNet,
16 q / 4 kv heads x 256 for attention - and a small vocabulary), then times full-sequence
prefills at each T with the reference kernels and with ``install_cpu_kernels``, alternating
between the two, and prints one JSON object.

FLOP/s counts the linear layers only (2 x non-embedding parameters x tokens, the usual
convention), so the DeltaNet scan, convolution, attention and norms show up as lost efficiency;
it is also given as a fraction of the fp32 GEMM rate (4096 x 4096 @ 4096 x 4096 ``F.linear``)
measured in the same run. With ``--profile`` each run is also broken down by component (timing
wrappers around modules and kernel functions: adds a little overhead).

The machine is shared and noisy: every number is reported as min and median over ``--repeats``
runs (plus process CPU time); compare the two kernels only within one run. On a busy machine run
it with ``OMP_WAIT_POLICY=PASSIVE`` (see ``RECOMMENDED_CPU_ENVIRONMENT``), else 2-thread timings
are dominated by OpenMP threads spinning at barriers.

    python benchmarks/bench_kernels.py --T 1024,2048 --repeats 2 --profile
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

MALLOC_SETTINGS = {
    "MALLOC_MMAP_THRESHOLD_": "17179869184",
    "MALLOC_TRIM_THRESHOLD_": "68719476736",
    "MALLOC_TOP_PAD_": "1073741824",
}

MODEL_KINDS: dict[str, dict[str, int]] = {
    # the configuration of an early development profile: hidden 512, 8 layers, smaller heads.
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
    },
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=sorted([*MODEL_KINDS, "medium"]), default="medium")
    parser.add_argument("--T", default="1024,2048", help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="default: all CPUs of this process")
    parser.add_argument("--no-flush-denormal", action="store_true", help="leave denormals on (slow)")
    parser.add_argument("--profile", action="store_true", help="also time components (adds overhead)")
    parser.add_argument("--vocab", type=int, default=4096)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # Threads and flush-to-zero first: OpenMP workers copy the FTZ flag when they are created.
    from clef_runtime.model.kernels import configure_cpu_threads

    threads = configure_cpu_threads(args.threads, flush_denormal=not args.no_flush_denormal)

    import torch

    torch.manual_seed(0)
    model = build_model(args.kind, args.vocab)
    gemm = measure_gemm()
    lengths = [int(t) for t in args.T.split(",")]
    linear_params = sum(
        module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear)
    )
    result: dict[str, Any] = {
        "benchmark": "bench_kernels",
        "kind": args.kind,
        "config": {key: getattr(model.config, key) for key in CONFIG_KEYS},
        "linear_params": linear_params,
        "threads": threads,
        "flush_denormal": not args.no_flush_denormal,
        "malloc_tuned": all(os.environ.get(k) == v for k, v in MALLOC_SETTINGS.items()),
        "loadavg_start": os.getloadavg(),
        "gemm_fp32_gflops": gemm,
        "runs": [],
    }
    for seq_len in lengths:
        result["runs"].append(run_length(model, seq_len, args.repeats, linear_params, gemm, args.profile))
        print(json.dumps(result["runs"][-1]), file=sys.stderr, flush=True)
    result["loadavg_end"] = os.getloadavg()
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps(result, indent=2))


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


def build_model(kind: str, vocab: int) -> Any:
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    settings: dict[str, int] = {
        "vocab_size": vocab,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    }
    if kind == "medium":  # the one medium geometry, engine_bench.py's (imported late: it imports torch)
        from engine_bench import MEDIUM_TEXT_OVERRIDES

        settings.update(MEDIUM_TEXT_OVERRIDES)
    else:
        settings.update(MODEL_KINDS[kind])
    return Qwen3_5TextModel(Qwen3_5TextConfig(**settings)).eval()


def measure_gemm(size: int = 4096, repeats: int = 3) -> float:
    """Best fp32 GFLOP/s of ``F.linear`` with a [size, size] input and a [size, size] weight."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(size, size)
    w = torch.randn(size, size)
    F.linear(x, w)
    best = min(timed(lambda: F.linear(x, w)) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


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
        "max_abs_diff": (outputs["clef"] - outputs["reference"]).abs().max().item(),
    }
    for name in variants:
        best = min(walls[name])
        run[name] = {
            "wall_s_min": round(best, 3),
            "wall_s_median": round(statistics.median(walls[name]), 3),
            "cpu_s_min": round(min(cpus[name]), 3),
            "tokens_per_s": round(seq_len / best, 1),
            "linear_gflops": round(flops / best / 1e9, 1),
            "fraction_of_gemm": round(flops / best / 1e9 / gemm, 3),
        }
        if name in breakdowns:
            run[name]["breakdown_s"] = breakdowns[name]
    run["speedup_wall_min"] = round(run["reference"]["wall_s_min"] / run["clef"]["wall_s_min"], 2)
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
            ("causal_conv1d", "gdn_conv"),
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
    main()
