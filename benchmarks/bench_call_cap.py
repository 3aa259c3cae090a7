"""CPU time per token and row of `Backbone.extend`: one row alone vs 16 rows in one call vs 16 rows in calls
of 512 / 256 / 128 / 64 tokens, on the hidden-512 / 8-layer ``medium`` benchmark model
(`devtools.models`).

One intra-op thread and process CPU time, so that other jobs on a shared machine change the figures little;
each figure is the fastest of ``--reps`` runs (every run kept with its spread). This is the profile behind
`DEFAULT_MAX_CALL_TOKENS`.

    python -m benchmarks.bench_call_cap --json benchmarks/results/call_cap.json
    python -m benchmarks.bench_call_cap --quick --json /tmp/call_cap.json     # smoke run on tiny (seconds)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import torch
from devtools.flags import engine_options
from devtools.models import resolve_model
from devtools.results import add_run_arguments, save, start_report
from devtools.timing import spread


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_run_arguments(parser, quick="tiny, 128 tokens, one rep", model="medium")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1152, 256])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.lengths, args.reps = "tiny", [128], 1

    # Before anything else touches torch (as the CLI does): flush-to-zero must reach the OpenMP workers.
    from clef_runtime.model.kernels import configure_cpu_threads

    configure_cpu_threads(1)
    from clef_runtime.engine.clef import Clef
    from clef_runtime.model.state import Continuation

    clef = Clef.load(resolve_model(args.model), engine_options(cache_mb=0))
    results = start_report("bench_call_cap", __file__, argv, quick=args.quick)
    backbone, prefix = clef.backbone, clef.prefix_state
    generator = torch.Generator().manual_seed(0)

    def rows(count: int, length: int) -> list[Any]:
        return [Continuation(torch.randint(0, 200_000, (length,), generator=generator)) for _ in range(count)]

    def cpu_ms_per_token(count: int, length: int, width: int | None) -> list[float]:
        """CPU ms per token and row of each of ``args.reps`` runs."""
        samples = []
        for _ in range(args.reps):
            batch = rows(count, length)
            started = time.process_time()
            # A width w is asked for as a budget of count * w rows x tokens.
            backbone.extend(prefix, batch, max_call_tokens=None if width is None else count * width)
            samples.append((time.process_time() - started) * 1000 / count / length)
        return samples

    backbone.extend(prefix, rows(1, 64))
    results.update({"unit": "CPU ms per token and row (fastest run)", "model": args.model, "lengths": {}})
    results["spread"] = {}
    for length in args.lengths:
        figures = {"1 row, one call": cpu_ms_per_token(1, length, None)}
        figures["16 rows, one call"] = cpu_ms_per_token(16, length, None)
        for width in (512, 256, 128, 64):
            figures[f"16 rows, {width}-token calls"] = cpu_ms_per_token(16, length, width)
        results["lengths"][str(length)] = {k: round(min(v), 4) for k, v in figures.items()}
        results["spread"][str(length)] = {k: spread(v) for k, v in figures.items()}
        print(length, json.dumps(results["lengths"][str(length)]), flush=True)
    save(results, args.json, "call_cap")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
