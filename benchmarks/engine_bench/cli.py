"""The command line: options, the whole run (`run_suite`), `main`."""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from devtools.flags import engine_options, has_engine_option
from devtools.gemm import QUICK_SHAPES, gemm_limit, model_shapes
from devtools.models import GEOMETRIES, resolve_model
from devtools.results import command_line, finish_report, start_report, write_json
from torch import nn

from benchmarks.engine_bench.baseline import ReferenceBaseline
from benchmarks.engine_bench.engine import engine_decide_batch
from benchmarks.engine_bench.markdown import render_markdown
from benchmarks.engine_bench.measure import _peak_rss_mib, _reset_peak_rss, _text_model, linear_weights
from benchmarks.engine_bench.plans import DEFAULT_CACHE_MB, PLANS, SECTIONS
from benchmarks.engine_bench.sections import (
    _Context,
    section_concurrency,
    section_latency,
    section_padding,
    section_questions,
    section_state_cache,
)
from benchmarks.engine_bench.targets import evaluate_targets
from benchmarks.engine_bench.workload import request_of_length
from clef_runtime.options import ENGINE_OPTIONS, EngineOptions, add_option_arguments

PACKAGE = Path(__file__).resolve().parent
"""The package's folder: the reports record the command as ``python -m benchmarks.engine_bench ...``."""
DESCRIPTION = "The engine measured side by side with the reference way, in one run, on one model."
"""The first line of ``--help`` (the package docstring's first sentence)."""

# ----------------------------------------------------------------------------------------------- CLI


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this script's options to ``parser``: the workload, and every engine option of the ``clef`` CLI
    (from `ENGINE_OPTIONS`)."""
    parser.add_argument(
        "--model",
        default="tiny",
        help="'tiny', a benchmark model (medium-1024: the release geometry scaled down to hidden 1,024; "
        "medium: hidden 512; built once into the cache), a release directory or a Hugging Face repo id",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a smoke run (seconds on tiny when idle)")
    size.add_argument("--full", action="store_true", help="also 16k-token requests and more repetitions")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the raw results as JSON to OUT")
    parser.add_argument(
        "--markdown", default=None, metavar="OUT", help="write the markdown tables to OUT (default: stdout)"
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="which sections to run (default: all)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    engine = parser.add_argument_group(
        "engine options", f"as for clef decide; --cache-mb defaults to {DEFAULT_CACHE_MB:g} here"
    )
    add_option_arguments(engine, ENGINE_OPTIONS)


def _mode(args: argparse.Namespace) -> str:
    if getattr(args, "quick", False):
        return "quick"
    if getattr(args, "full", False):
        return "full"
    return "default"


def _state_cache_on(options: EngineOptions) -> bool:
    """Whether the engine has a state cache with this configuration: the option exists in the table (the
    engine's own definition of what it supports) and is not switched off."""
    return has_engine_option("cache_mb") and options.cache_mb != 0


def _judged_limits(
    gemm: dict[str, Any], model: nn.Module, tokens: Sequence[int], dtype: str
) -> dict[int, float]:
    """The limit of ``dtype`` over the model's Linear shapes at each of ``tokens`` rows where it was
    measured (a device may lack an int8 kernel for some shapes: that T is left out)."""
    limits = {}
    for count in tokens:
        try:
            limits[count] = gemm_limit(gemm, dtype, model_shapes(model, [count]))
        except KeyError:
            continue
    return limits


def _describe_model(model: str, clef: Any) -> str:
    if model == "tiny":
        return "built-in tiny model (untrained)"
    if model in GEOMETRIES:
        size = GEOMETRIES[model]
        return (
            f"{model} random model (untrained; hidden {size.hidden_size}, {size.layers} layers in the "
            "release's 3:1 pattern, full vocabulary)"
        )
    return str(getattr(clef, "description", model))


def run_suite(
    model: str,
    *,
    mode: str = "default",
    sections: Sequence[str] = SECTIONS,
    options: EngineOptions | None = None,
    seed: int = 0,
    command: str = "",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark suite on one model and return the report (the JSON this script writes).

    ``model``: "tiny", a benchmark model name or anything `Clef.load` accepts; ``options``: the engine's
    (default: the defaults with a `DEFAULT_CACHE_MB` state cache). Raises ValueError for an unknown mode or
    section; loading errors of `Clef.load` propagate.
    """
    from clef_runtime.engine.clef import Clef

    if mode not in PLANS:
        raise ValueError(f"unknown mode {mode!r}; use one of {list(PLANS)}")
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown sections {unknown}; use some of {list(SECTIONS)}")
    say = progress or (lambda message: None)
    plan = PLANS[mode]
    options = options or engine_options(cache_mb=DEFAULT_CACHE_MB)
    skipped: list[str] = []

    path = resolve_model(model)
    cache_enabled = _state_cache_on(options)
    say(f"loading {model} ...")
    _reset_peak_rss()
    load_started = time.perf_counter()
    clef = Clef.load(path, options)
    load_s = time.perf_counter() - load_started
    load_rss = _peak_rss_mib()
    backbone = clef.backbone
    text = _text_model(backbone.model)
    device_used = backbone.device
    baseline = ReferenceBaseline(clef)

    gemm_dtype = "fp32" if backbone.dtype == torch.float32 else "bf16"
    tokens = list(plan.latency_reps)
    if "gemm" in sections:
        say(f"gemm: the GEMM limits over the model's Linear shapes at T = {tokens}")
        shapes = model_shapes(text.layers, tokens)
    else:
        shapes = list(QUICK_SHAPES)
        skipped.append("GEMM limits at the model's shapes (section not selected): no FLOP/s fractions")
    report = start_report(
        "clef-bench",
        PACKAGE,
        command=command or command_line(PACKAGE, ["--model", model]),
        device=device_used,
        gemm_shapes=shapes,
        gemm_repeats=plan.gemm_repeats,
    )
    limits = (
        _judged_limits(report["machine"]["gemm"], text.layers, tokens, gemm_dtype)
        if "gemm" in sections
        else None
    )
    floating_weights, int8_weights = linear_weights(text)
    int8_limits = (
        _judged_limits(report["machine"]["gemm"], text.layers, tokens, "int8")
        if limits and int8_weights
        else None
    )
    if limits and int8_weights and len(int8_limits or {}) < len(tokens):
        skipped.append(
            "backbone % of the GEMM limit where no int8 GEMM rate was measured at the model's shapes "
            f"(T = {sorted(set(tokens) - set(int8_limits or {}))}): its int8 layers cannot be judged"
        )
    context = _Context(
        clef=clef,
        baseline=baseline,
        plan=plan,
        gemm_limits=limits,
        device=device_used,
        seed=seed,
        progress=say,
        int8_limits=int8_limits,
    )

    # Warm both paths once (lazy initialisation, allocator growth) before anything is timed.
    say("warming up")
    warm_rng = random.Random(f"{seed}-warmup")
    warm = request_of_length(warm_rng, 512, 2, "warm")
    engine_decide_batch(clef, [warm])
    baseline.decide(warm)

    results: dict[str, Any] = {}
    section_seconds: dict[str, float] = {}
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "latency": lambda: section_latency(context),
        "questions": lambda: section_questions(context),
        "concurrency": lambda: section_concurrency(context),
        "state_cache": lambda: section_state_cache(context, cache_enabled),
        "padding": lambda: section_padding(plan, seed, say),
    }
    for name, runner in runners.items():
        if name in sections:
            section_started = time.perf_counter()
            results[name] = runner()
            section_seconds[name] = round(time.perf_counter() - section_started, 1)
    if "state_cache" in sections and not cache_enabled:
        skipped.append("state-cache speed-up (the state cache is off: --cache-mb 0)")
    if mode != "full":
        skipped.append("16k-token requests (run with --full)")

    head_parameters = sum(parameter.numel() for parameter in clef.head.parameters())
    config = text.config
    report.update(
        {
            "mode": mode,
            "engine_options": options.as_dict(),
            "model": {
                "spec": model,
                "path": str(path),
                "description": _describe_model(model, clef),
                "hidden_size": config.hidden_size,
                "layers": config.num_hidden_layers,
                "layer_types": list(config.layer_types),
                "intermediate_size": config.intermediate_size,
                "attention_heads": [config.num_attention_heads, config.num_key_value_heads, config.head_dim],
                "deltanet_heads": [
                    config.linear_num_key_heads,
                    config.linear_num_value_heads,
                    config.linear_key_head_dim,
                ],
                "vocab_size": config.vocab_size,
                "backbone_parameters": backbone.num_parameters,
                "backbone_linear_parameters": floating_weights + int8_weights,
                "backbone_int8_linear_parameters": int8_weights,
                "backbone_dtype": str(backbone.dtype),
                "head_config": clef.head.config,
                "head_parameters": head_parameters,
                "load_s": round(load_s, 2),
                "rss_after_load_mib": load_rss,
                "state_cache": {"available": cache_enabled, "cache_mb": options.cache_mb},
            },
            "plan": {
                "latency_tokens": list(plan.latency_reps),
                "question_counts": list(plan.question_reps),
                "question_state_tokens": plan.question_state_tokens,
                "concurrency": plan.concurrency,
                "concurrency_tokens": list(plan.concurrency_reps),
            },
            "baseline_description": (
                "the reference way, implemented in the benchmark on the same weights: one request at a "
                "time, pieces tokenized with the HF tokenizer and no cache, one full stock transformers "
                "forward, a head forward looping over questions and options (torch TransformerDecoderLayer "
                "/ MultiheadAttention modules), no state cache."
            ),
            "gemm": (
                {
                    "dtype": gemm_dtype,
                    "repeats": plan.gemm_repeats,
                    "linear_shapes": len(shapes) // len(tokens),
                    "limit_gflops": max(limits.values()),
                    "limit_by_tokens": {str(count): value for count, value in limits.items()},
                    "int8_limit_gops": max(int8_limits.values()) if int8_limits else None,
                    "int8_limit_by_tokens": (
                        {str(count): value for count, value in int8_limits.items()} if int8_limits else None
                    ),
                }
                if limits
                else None
            ),
            "sections": results,
            "targets": evaluate_targets(results),
            "parity_max_abs_diff": max(context.parity) if context.parity else None,
            "section_seconds": section_seconds,
            "skipped": skipped,
        }
    )
    return finish_report(report)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point: parse ``argv`` and `run_bench`. Returns the exit status."""
    from clef_runtime.model.kernels import configure_cpu_threads

    configure_cpu_threads()  # before torch's first parallel operation (see model/kernels.py)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_bench", description=DESCRIPTION)
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    return run_bench(args, command_line(PACKAGE, argv))


def run_bench(args: argparse.Namespace, command: str = "") -> int:
    """Run the suite, print or write the markdown, write the JSON.

    Returns the exit status: 0 when the run completed (targets not met do not fail it), 2 when the model
    cannot be loaded, an option is invalid or an output file cannot be written.
    """
    from clef_runtime.model.checkpoint import CheckpointError

    def progress(message: str) -> None:
        print(f"[engine_bench] {message}", file=sys.stderr, flush=True)

    try:
        values = EngineOptions.from_sources(args, {}).as_dict()
        if args.cache_mb is None:
            values["cache_mb"] = DEFAULT_CACHE_MB
        report = run_suite(
            args.model,
            mode=_mode(args),
            sections=args.sections,
            options=engine_options(**values),
            seed=args.seed,
            command=command,
            progress=progress,
        )
    except (CheckpointError, OSError, ValueError) as error:
        print(f"engine_bench: {error}", file=sys.stderr)
        return 2
    markdown = render_markdown(report)
    try:
        if args.json:
            write_json(args.json, report)
        if args.markdown:
            Path(args.markdown).write_text(markdown, encoding="utf-8")
    except OSError as error:
        print(f"engine_bench: cannot write the results: {error}", file=sys.stderr)
        return 2
    if not args.markdown:
        sys.stdout.write(markdown)
    return 0
