"""``clef batch INPUT OUTPUT``: its flags and variables, and the run with its exit status.

Exit status: 0 when the run wrote every row (a row's own error is an error row, counted in the summary), 2
for a usage error (a bad flag, an unreadable INPUT, a duplicate ``custom_id``, an OUTPUT of another job:
nothing computed), 1 when the model cannot be loaded, 130 when interrupted (what was computed is committed:
rerun to go on).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from clef_runtime.options import (
    ENGINE_OPTIONS,
    MODEL_OPTION,
    EngineOptions,
    Option,
    OptionsError,
    add_option_arguments,
    parse_float,
    parse_int,
    parse_lower,
    read_option_values,
)
from clef_runtime.scale.settings import RAY_OPTIONS

__all__ = ["BATCH_OPTIONS", "BATCH_TABLE_OPTIONS", "add_batch_arguments", "run_batch_command"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
LOCAL_RAY = "local"

BATCH_OPTIONS: tuple[Option, ...] = (
    Option(
        "format",
        "--format",
        "CLEF_BATCH_FORMAT",
        parse_lower,
        "what OUTPUT's part files are: parquet (default; response and error as JSON text) or jsonl (the jobs "
        "results' lines)",
        "FORMAT",
        choices=("parquet", "jsonl"),
    ),
    Option(
        "batch_rows",
        "--batch-rows",
        "CLEF_BATCH_ROWS",
        parse_int,
        "rows per batch a worker answers together (default 64); rows about one state share a batch",
        "N",
    ),
    Option(
        "grouping",
        "--grouping",
        "CLEF_BATCH_GROUPING",
        parse_lower,
        "how rows about one state are brought together: sort (default), partition, or none (input order)",
        "HOW",
        choices=("sort", "partition", "none"),
    ),
    Option(
        "commit_rows",
        "--commit-rows",
        "CLEF_BATCH_COMMIT_ROWS",
        parse_int,
        "answers per part file committed to OUTPUT (default 10000; also every --commit-seconds): "
        "an interrupted run loses at most that",
        "N",
    ),
    Option(
        "commit_seconds",
        "--commit-seconds",
        "CLEF_BATCH_COMMIT_SECONDS",
        parse_float,
        "commit what is answered at least this often (default 30)",
        "S",
    ),
)
RAY_OPTION = Option(
    "ray",
    "--ray",
    "CLEF_BATCH_RAY",
    str,
    "run on Ray Data: --replicas actors (ClefBatchWorker), each holding the model; --ray alone (or 'local') "
    "starts a local Ray head on 127.0.0.1 and stops it at the end, --ray ADDRESS joins a cluster (auto, "
    "ray://head:10001)",
    "[ADDRESS]",
)
_POOL_OPTIONS: tuple[Option, ...] = tuple(
    option for option in RAY_OPTIONS if option.field in ("replicas", "ray_num_cpus", "ray_num_gpus")
)
BATCH_TABLE_OPTIONS: tuple[Option, ...] = (*BATCH_OPTIONS, RAY_OPTION, *_POOL_OPTIONS)
"""What README's batch table lists: the batch options, --ray and the pool's (the engine's are the serve
table's)."""


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """INPUT, OUTPUT, the model and engine options, the batch options and the Ray pool's."""
    parser.add_argument(
        "input",
        metavar="INPUT",
        help="JSONL (one System One request per line, optional custom_id) or Parquet: a file or a folder, a "
        "local path or a URI pyarrow reads (s3://, gs://, file://)",
    )
    parser.add_argument(
        "output",
        metavar="OUTPUT",
        help="the folder of results (created; rerun with the same OUTPUT to resume), local or a URI",
    )
    add_option_arguments(parser, (MODEL_OPTION, *ENGINE_OPTIONS, *BATCH_OPTIONS, *_POOL_OPTIONS))
    # Not add_option_arguments: the address is optional after the flag (``--ray`` alone: a local head).
    parser.add_argument(
        RAY_OPTION.flag,
        dest=RAY_OPTION.field,
        nargs="?",
        const=LOCAL_RAY,
        default=None,
        metavar="ADDRESS",  # argparse brackets an optional value itself
        help=f"{RAY_OPTION.help} [env {RAY_OPTION.env}]",
    )


def _job(args: argparse.Namespace) -> Any:
    from clef_runtime.batch.pipeline import BatchJob
    from clef_runtime.batch.ray_data import RayPool

    values = read_option_values(args, os.environ, (MODEL_OPTION, *BATCH_OPTIONS, RAY_OPTION, *_POOL_OPTIONS))
    options = EngineOptions.from_sources(args, os.environ)
    ray = values.pop("ray", None) or None
    pool = None
    if ray is not None:
        replicas = values.pop("replicas", 2)
        cpus = values.pop("ray_num_cpus", 1.0)
        # An actor given no GPU sees none (Ray hides them): --device cuda means one GPU per actor unless
        # --ray-num-gpus says otherwise, rather than a load that fails on every actor.
        gpus = values.pop("ray_num_gpus", 1.0 if options.device.startswith("cuda") else 0.0)
        if replicas < 1 or cpus < 0 or gpus < 0:
            raise OptionsError("--replicas must be at least 1, --ray-num-cpus and --ray-num-gpus at least 0")
        pool = RayPool(None if ray == LOCAL_RAY else ray, replicas, cpus, gpus)
    else:
        for name in ("replicas", "ray_num_cpus", "ray_num_gpus"):
            values.pop(name, None)
    if values.get("commit_seconds", 1.0) <= 0:
        raise OptionsError("--commit-seconds must be above 0")
    try:
        return BatchJob(
            input=args.input,
            output=args.output,
            options=options,
            ray=pool,
            progress=sys.stderr.isatty(),
            **values,
        )
    except ValueError as exc:
        raise OptionsError(str(exc)) from None


def run_batch_command(args: argparse.Namespace) -> int:
    """Run ``clef batch``; returns the exit status."""
    from clef_runtime.batch.inputs import InputError
    from clef_runtime.batch.pipeline import run_batch
    from clef_runtime.model.load_errors import LoadFailure, classify_load_error

    job = _job(args)
    try:
        summary = run_batch(job)
    except InputError as exc:
        print(f"clef batch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        if classify_load_error(exc) is not LoadFailure.UNLOADABLE:
            raise
        print(f"clef batch: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(summary.line(), file=sys.stderr)
    print(json.dumps(summary.as_json()))
    return EXIT_OK
